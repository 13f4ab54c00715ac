"""How results look: rich tables and a progress bar on a terminal, plain lines when piped.

Only the CLI uses this module. Scripts should use ``--json``, whose shape is
documented in docs/json-schema/; the human layout may change between versions.
"""

from __future__ import annotations

import functools
import json
import os
import pwd
import re
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
)

from hibernate.agent.wire import AgentState, state_of
from hibernate.errors import ExitCode, HibernateError
from hibernate.operation.progress import ProgressSink, transfer_rate
from hibernate.operation.reports import (
    ProcessSleep,
    ProcessWake,
    RecoverReport,
    SleepReport,
    WakeReport,
    total_rate,
)
from hibernate.units import human_bytes

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def print_json(document: Any) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
    sys.stdout.flush()


def result(document: dict[str, Any], show: Callable[[], None], *, as_json: bool, quiet: bool = False) -> None:
    """A command's result: ``document`` as JSON with --json, else ``show``'s lines unless --quiet.

    One place chooses between the two faces, so --json (one document, nothing
    else on stdout) and --quiet (no lines) mean the same in every command.
    """
    if as_json:
        print_json(document)
    elif not quiet:
        show()


def error_wire(exc: HibernateError) -> dict[str, Any]:
    """An error as --json reports it: its fields, and the exit code by number and by name."""
    code = int(exc.exit_code)
    return {**exc.to_wire(), "exit_code": code, "exit_name": ExitCode(code).name}


def error(exc: HibernateError, as_json: bool) -> int:
    code = int(exc.exit_code)
    if as_json:
        print_json({"ok": False, "error": error_wire(exc)})
    else:
        err.print(f"[bold red]hibernate: error:[/] {escape(exc.message)}", markup=True)
        if exc.hint:
            err.print(f"  hint: {exc.hint}", markup=False)
    return code


class TerminalProgress(ProgressSink):
    """A rich bar per transfer on a terminal; one line per step (and every few seconds) otherwise.

    The rate either shows is :func:`transfer_rate`: the bytes so far over the time since the step
    began, not rich's estimate over the last few updates, which left out the step's start and
    counted a burst of reused chunks as the speed of the disk. Its last one is the report's own
    figure (``ended``): the same bytes over the seconds the agents' answers took, so the two agree
    to the digit (several processes: the report's total line).
    """

    def __init__(self, enabled: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.enabled = enabled
        self.interactive = enabled and err.is_terminal
        self._clock = clock
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._last_line = 0.0
        self._step_started = clock()
        self._final: str | None = None  # a transfer's last line, held for ended()

    def __enter__(self) -> TerminalProgress:
        if self.interactive:
            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(binary_units=True),
                TextColumn("{task.fields[rate]}"),
                TimeRemainingColumn(),
                console=err,
                transient=True,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._flush()
        if self._progress is not None:
            self._progress.stop()

    def step(self, label: str) -> None:
        self._flush()
        self._step_started = self._clock()
        if not self.enabled:
            return
        if self._progress is not None:
            self._task = None
            self._progress.console.print(f"[dim]· {label}[/]", markup=True)
        else:
            err.print(f"step: {label}", markup=False)

    def note(self, message: str) -> None:
        self._flush()
        if not self.enabled:
            return
        if self._progress is not None:
            self._progress.console.print(f"[yellow]note:[/] {escape(message)}", markup=True, highlight=False)
        else:
            err.print(f"note: {message}", markup=False)

    def transfer(self, label: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = self._clock()
        # No rate before the first bytes have moved: "0.00 GB/s" would say the disk is stuck.
        rate = f"{transfer_rate(done, now - self._step_started):.2f} GB/s" if done else ""
        if self._progress is not None:
            if self._task is None:
                self._task = self._progress.add_task(label, total=total, rate=rate)
            self._progress.update(self._task, completed=done, total=total, rate=rate)
            return
        line = f"{label}: {human_bytes(done)} / {human_bytes(total)}" + (f" at {rate}" if rate else "")
        if done >= total:
            self._final = line  # printed once the step goes on, unless ended() brings the report's rate
        elif now - self._last_line >= 2.0:
            self._last_line = now
            err.print(line, markup=False)

    def ended(self, label: str, nbytes: int, seconds: float) -> None:
        """The last rate is the report's: the same bytes over the same seconds (progress.side_by_side)."""
        if not self.enabled:
            return
        rate = f"{transfer_rate(nbytes, seconds):.2f} GB/s"
        if self._progress is not None:
            if self._task is not None:
                self._progress.update(self._task, completed=nbytes, total=nbytes, rate=rate)
            return
        self._final = f"{label}: {human_bytes(nbytes)} / {human_bytes(nbytes)} at {rate}"
        self._flush()

    def _flush(self) -> None:
        if self._final is not None:
            err.print(self._final, markup=False)
            self._final = None


def _line(label: str, text: str) -> None:
    out.print(f"  {label:<9} {text}", markup=False)


def _rss_change(before: int | None, after: int | None) -> str:
    if before is None or after is None:
        return "-"
    change = before - after
    verb = "gave back" if change >= 0 else "took"
    return f"RSS {human_bytes(before)} → {human_bytes(after)} ({verb} {human_bytes(abs(change))})"


def _reuse_check(read: int, rewritten: int) -> str:
    """What the reuse check did: read back what was reused, and wrote again what the disk lost."""
    line = f"read back {human_bytes(read)} of the last snapshot before reusing it"
    if rewritten:
        line += f"; {human_bytes(rewritten)} no longer read back as written and was written again"
    return line


def _kept_staging(kept: dict[str, int] | None) -> str | None:
    """The staging line (--keep-staging-mb): what the transfer took from the process's kept staging,
    what stays kept, what was given back; None where none of it happened (the default)."""
    if not kept or not any(kept.values()):
        return None
    return (
        f"{human_bytes(kept.get('kept_bytes', 0))} kept for the next sleep or wake "
        f"({human_bytes(kept.get('reused_bytes', 0))} reused, "
        f"{human_bytes(kept.get('given_back_bytes', 0))} given back)"
    )


def _how(io_mode: Any, tuning: dict[str, Any] | None) -> str:
    """How a transfer ran: ``direct I/O, 8 requests in flight, 2 workers`` (the I/O mode alone from an
    agent that does not report its tuning)."""
    modes = " and ".join(
        "page-cache" if mode == "cached" else mode for mode in str(io_mode).split("+")
    )  # "cached+direct": a snapshot partly in the page cache
    if not tuning:
        return f"{modes} I/O"
    depth, workers = tuning.get("io_depth"), tuning.get("workers")
    return (
        f"{modes} I/O, {depth} request{'s' if depth != 1 else ''} in flight, "
        f"{workers} worker{'s' if workers != 1 else ''}"
    )


def sleep_report(report: SleepReport) -> None:
    for p in report.processes:
        out.print(f"asleep: pid {p.pid} ({p.name}) in {p.phases.get('spill', 0):.2f}s of spill", markup=False)
        _line("snapshot", str(p.snapshot))
        wrote = f"wrote {human_bytes(p.written_bytes)}" if p.written_bytes else "nothing new to write"
        _line(
            "kept",
            f"{human_bytes(p.total_bytes)} at {p.gb_per_s:.2f} GB/s ({_how(p.io_mode, p.tuning)}): {wrote}, "
            f"reused {human_bytes(p.reused_bytes)}",
        )
        if p.reuse_read_bytes or p.rewritten_bytes:
            _line("checked", _reuse_check(p.reuse_read_bytes, p.rewritten_bytes))
        if p.reused_unread_bytes:
            _line("checked", f"no: {human_bytes(p.reused_unread_bytes)} reused unread (--skip-reuse-check)")
        dropped_tags = sorted({pool["tag"] for pool in p.pools if not pool["keep"]})
        _line(
            "dropped",
            f"{human_bytes(p.dropped_bytes)}" + (f" ({', '.join(dropped_tags)})" if dropped_tags else ""),
        )
        _line("memory", _rss_change(p.rss_before, p.rss_after))
        staging = _kept_staging(p.kept_staging)
        if staging is not None:
            _line("staging", staging)
        if p.resident_bytes:
            _line("resident", f"{human_bytes(p.resident_bytes)} (partial pages at the edges of fixed memory)")
        for warning in p.warnings:
            _line("warning", warning)
    _total_line(report.processes, "kept")
    for s in report.skipped:
        where = f" (snapshot {s['snapshot']})" if s.get("snapshot") else ""
        out.print(f"skipped: pid {s['pid']} ({s['name']}) is already asleep{where}", markup=False)
    for server in report.extras.get("vllm_all", []):
        out.print(vllm_summary(server), markup=False)
    out.print(f"cuda: {cuda_summary(report.cuda)}; total {report.seconds:.2f}s", markup=False)
    for gpu in report.gpus or []:
        out.print(gpu_summary(gpu), markup=False)


def _total_line(processes: Sequence[ProcessSleep] | Sequence[ProcessWake], what: str) -> None:
    """Several processes moved side by side: their bytes and rate as one, the bar's last rate."""
    total = total_rate(processes)
    if total is not None:
        nbytes, rate = total
        out.print(
            f"total: {what} {human_bytes(nbytes)} at {rate:.2f} GB/s ({len(processes)} processes at once)",
            markup=False,
        )


def gpu_summary(gpu: dict[str, Any]) -> str:
    """One line on what a sleep really gave back on one GPU, beside what it tracked there."""
    tracked = gpu.get("tracked_bytes")
    beside = f"tracked {human_bytes(tracked)}" if tracked is not None else "tracked: not placed on a GPU"
    line = (
        f"gpu {gpu['index']} ({gpu['uuid']}): used {human_bytes(gpu['used_before_bytes'])} -> "
        f"{human_bytes(gpu['used_after_bytes'])}, "
        f"{human_bytes(gpu['given_back_bytes'])} given back ({beside})"
    )
    shown = [
        f"pid {p['pid']} {_maybe_bytes(p.get('before_bytes'))} -> {_maybe_bytes(p.get('after_bytes'))}"
        for p in gpu.get("processes", [])
    ]
    return line + (f"; {', '.join(shown)}" if shown else "")


def _maybe_bytes(value: Any) -> str:
    return human_bytes(value) if isinstance(value, int) else "none"


def vllm_summary(vllm: dict[str, Any]) -> str:
    """One line on a vLLM server a sleep or wake went through."""
    seconds = ", ".join(f"{name} {value:.2f}s" for name, value in (vllm.get("seconds") or {}).items())
    how = f"level {vllm['level']}, drain {vllm['mode']}; " if "level" in vllm else ""
    return f"vllm: server pid {vllm['server_pid']} at {vllm['url']} ({vllm['url_from']}); {how}" + (
        seconds or "no request needed"
    )


def wake_report(report: WakeReport) -> None:
    for p in report.processes:
        out.print(f"awake: pid {p.pid} ({p.name})", markup=False)
        _line("snapshot", str(p.snapshot))
        _line(
            "restored",
            f"{human_bytes(p.restored_bytes)} at {p.gb_per_s:.2f} GB/s ({_how(p.io_mode, p.tuning)}), "
            f"verified; {human_bytes(p.zeroed_bytes)} zero-filled",
        )
        _line("memory", _rss_change(p.rss_before, p.rss_after))
        staging = _kept_staging(p.kept_staging)
        if staging is not None:
            _line("staging", staging)
        for warning in p.warnings:
            _line("warning", warning)
    _total_line(report.processes, "restored")
    for s in report.skipped:
        out.print(f"skipped: pid {s['pid']} ({s['name']}) is already awake", markup=False)
    for server in report.extras.get("vllm_all", []):
        out.print(vllm_summary(server), markup=False)
    out.print(f"cuda: {cuda_summary(report.cuda)}; total {report.seconds:.2f}s", markup=False)


def recover_report(report: RecoverReport) -> None:
    out.print(f"recover: {report.message or report.action}", markup=False)
    if isinstance(report.report, WakeReport):
        wake_report(report.report)


def cuda_summary(cuda: dict[str, Any]) -> str:
    if cuda.get("left"):
        return f"{cuda['status']}: process(es) {', '.join(map(str, cuda['left']))}"
    if not cuda.get("processes"):
        return str(cuda.get("status", "none (skipped)"))
    parts = [f"{p['pid']} {p.get('state', '?')} ({p.get('seconds', 0):.2f}s)" for p in cuda["processes"]]
    return f"{cuda.get('status', '')}: " + ", ".join(parts)


_MARK = {"ok": "[green]ok[/]", "warn": "[yellow]warn[/]", "fail": "[bold red]fail[/]"}


def doctor_report(report: dict[str, Any], only_problems: bool = False) -> None:
    """One line per check (status, name, what was found), the fix under each one not ok.

    ``only_problems`` (--quiet, for logs) leaves out the checks that are ok, and
    says nothing at all when every check is.
    """
    problems = [c for c in report["checks"] if c["status"] != "ok"]
    if only_problems and not problems:
        return
    for check in problems if only_problems else report["checks"]:
        status = check["status"]
        mark = _MARK.get(status, status) if out.is_terminal else status
        out.print(mark + " " * max(1, 5 - len(status)), end="", markup=out.is_terminal)
        out.print(f"{check['name']:<15} {check['detail']}", markup=False)
        if check.get("fix") and check["status"] != "ok":
            out.print(f"     {'':<15} fix: {check['fix']}", markup=False)
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    out.print("verdict: " + ("ready" if not failed else f"not ready ({', '.join(failed)})"), markup=False)


def holder_pid(holder: object) -> int | None:
    """The pid in a busy holder's description (``hibernate (pid 12, uid 0)``), if it names one."""
    found = re.search(r"\(pid (\d+)[,)]", holder) if isinstance(holder, str) else None
    return int(found.group(1)) if found else None


def interruption(
    operation: str, entries: list[dict[str, Any]], me: int | None = None
) -> tuple[str, str | None]:
    """What a Ctrl-C left, from the targets' states read after it: one line, and what to run.

    ``me`` (default: this process) is the command whose Ctrl-C it was: an agent still busy with
    it is finishing that command's own undo, not serving another command.

    The sleep's steps are undone before the command exits, so a sleep cut short leaves its targets
    running with their memory in place: the user must hear that nothing was lost, or that one was
    left half-way and which `hibernate recover` finishes or undoes it.
    """
    me = os.getpid() if me is None else me
    parts: list[str] = []
    commands: list[str] = []
    whole = bool(entries)
    for e in entries:
        pid, state = e["pid"], e.get("state")
        settled = state_of(e) in (AgentState.RUNNING, AgentState.ASLEEP)
        interrupted = e.get("interrupted") or {}
        if "resolve" in interrupted:
            parts.append(f"process {pid} was left half-way ({state})")
            commands.append(interrupted["resolve"])
        elif e.get("busy") or interrupted:
            holder = e.get("busy") or interrupted.get("in_progress")
            if holder_pid(holder) == me:  # this command's own session: its undo, cut by a second Ctrl-C
                parts.append(f"process {pid} is {state}, its undo is still running in the agent")
            else:
                parts.append(f"process {pid} is {state}, still busy ({holder})")
            commands.append(f"hibernate status {pid}")
        else:
            parts.append(f"process {pid} is {state}")
            if not settled:
                commands.append(f"hibernate recover {pid}")
        whole = whole and settled and not commands
    if not entries:
        return f"interrupted: the {operation} found no agent to report on", None
    message = f"interrupted: the {operation} stopped; " + "; ".join(parts)
    if whole:
        return message + ", nothing was lost", None
    return message, "run " + ", then ".join(f"`{c}`" for c in dict.fromkeys(commands))


def plain_columns(
    header: list[str], rows: list[list[str]], *, right: frozenset[str] = frozenset()
) -> list[str]:
    """Rows as aligned columns of plain text, one line each, never cut to a width.

    Piped into grep, awk or a log, a row must stay one line holding every cell
    whole (a rich table shrinks to 80 columns and wraps or cuts the long ones);
    on a terminal a line longer than the screen wraps, which beats losing a
    path. Cells hold no spaces that a caller did not put there, so ``awk`` can
    split them. ``header`` may be empty (``--no-headers``); the columns named in
    ``right`` (numbers) are right-aligned; the last column is never padded.
    """
    names = header or [""] * (len(rows[0]) if rows else 0)
    table = [header, *rows] if header else rows
    widths = [max((len(row[i]) for row in table), default=0) for i in range(len(names))]
    lines = []
    for row in table:
        cells = [
            cell
            if i == len(row) - 1
            else (cell.rjust(widths[i]) if names[i] in right else cell.ljust(widths[i]))
            for i, cell in enumerate(row)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines


def _size(n: int | None) -> str:
    """A size in a table cell: no space inside (``1.5GiB``), so that the columns split on blanks."""
    return human_bytes(n).replace(" ", "")


AGENT_COLUMNS = ["PID", "KIND", "STATE", "KEPT", "DROPPED", "RSS", "SNAPSHOT"]
WIDE_COLUMNS = [
    *("PID", "USER", "NAME", "KIND", "STATE", "BUSY", "KEPT", "DROPPED", "TRACKED", "RSS", "DEVICES"),
    *("SNAPSHOT", "COMMAND"),
]
LIST_COLUMNS = ["PID", "USER", "STATE", "KIND", "NAME", "COMMAND"]
_NUMBERS = frozenset({"PID", "KEPT", "DROPPED", "TRACKED", "RSS"})


@functools.lru_cache(maxsize=64)
def user_cell(uid: int | None) -> str:
    """A user as ``ps`` shows one: the name, else the number (a uid with no name here, such as a
    container's); ``-`` when unknown."""
    if uid is None:
        return "-"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _agent_cells(e: dict[str, Any]) -> dict[str, str]:
    """Every column an agent can be shown with, as text (``-`` for what is unknown or empty)."""
    pools = e.get("pools", [])
    kept = sum(p["bytes"] for p in pools if p["keep"])
    dropped = sum(p["bytes"] for p in pools if not p["keep"])
    devices = e.get("device_bytes") or {}
    return {
        "PID": str(e["pid"]),
        "USER": user_cell(e.get("uid")),
        "NAME": str(e.get("name") or "-"),
        "KIND": str(e.get("kind") or "-"),
        "STATE": str(e.get("state")) + ("(busy)" if e.get("busy") else ""),
        "BUSY": str(e.get("busy") or "-").replace(" ", "_"),
        "KEPT": _size(kept),
        "DROPPED": _size(dropped),
        "TRACKED": _size(kept + dropped),
        "RSS": _size(e.get("rss")),
        "DEVICES": ",".join(f"{name}={_size(n)}" for name, n in sorted(devices.items())) or "-",
        "SNAPSHOT": (e.get("snapshot") or {}).get("path") or "-",
        "COMMAND": str(e.get("command") or "-"),
    }


def agent_lines(entries: list[dict[str, Any]], columns: list[str], *, headers: bool = True) -> list[str]:
    """The agents as lines of ``columns`` (AGENT_COLUMNS, WIDE_COLUMNS or LIST_COLUMNS)."""
    rows = [[cells[c] for c in columns] for cells in map(_agent_cells, entries)]
    return plain_columns(columns if headers else [], rows, right=_NUMBERS)


def agent_list(entries: list[dict[str, Any]], *, headers: bool = True) -> None:
    """What ``ls`` prints: which agents there are, one line each, to find a target by its command."""
    if not entries:
        if headers:
            out.print("no hibernate agents running for this user", markup=False)
        return
    for line in agent_lines(entries, LIST_COLUMNS, headers=headers):
        out.print(line, markup=False)


def agents_table(entries: list[dict[str, Any]], *, wide: bool = False, headers: bool = True) -> None:
    """What ``status`` prints: each agent's state, memory and snapshot, then what holds or interrupted it."""
    if not entries:
        if headers:
            out.print("no hibernate agents running for this user", markup=False)
        return
    for line in agent_lines(entries, WIDE_COLUMNS if wide else AGENT_COLUMNS, headers=headers):
        out.print(line, markup=False)
    if headers:  # --no-headers: the rows alone, for a script
        agent_notes(entries)


def agent_notes(entries: list[dict[str, Any]]) -> None:
    """Below the table, what holds an agent awake and what was interrupted on it, with what to run."""
    for e in entries:
        holders = (e.get("leases") or {}).get("holders") or []
        if holders:
            held = "; ".join(
                f"{h['count']} request{'' if h['count'] == 1 else 's'} through {h['by']}" for h in holders
            )
            out.print(f"pid {e['pid']}: held awake (leases) by {held}", markup=False)
        interrupted = e.get("interrupted")
        if interrupted and "resolve" in interrupted:
            done = ", ".join(interrupted["phases"]) or "nothing"
            out.print(
                f"pid {e['pid']}: a `hibernate {interrupted['op']}` was interrupted after: {done}; "
                f"run `{interrupted['resolve']}` to finish or undo it",
                markup=False,
            )
        elif interrupted:
            out.print(f"pid {e['pid']}: {interrupted['in_progress']} is operating on it", markup=False)


def node_step_report(document: dict[str, Any]) -> None:
    """One node's part of a job-wide operation: its own report, every node's result, the verdict."""
    report = document.get("report")
    if report and report.get("processes"):
        if document["operation"] == "sleep":
            sleep_report(SleepReport.from_wire(report))
        else:
            wake_report(WakeReport.from_wire(report))
    for result in document["results"]:
        state = "ok" if result["ok"] else f"failed (exit {result['exit_code']})"
        note = f": {result['message']}" if result.get("message") else ""
        out.print(f"node {result['index']} ({result['node']}): {state}{note}", markup=False)
    decision = document["decision"]
    out.print(
        f"node {document['node_index']} ({document['node']}) of {document['nodes']}: "
        f"{decision['verdict']} ({decision['reason']})",
        markup=False,
    )


def gc_report(report: dict[str, Any]) -> None:
    """What gc deleted (or would delete) and kept, one line a snapshot, with the reason."""
    verb = "would delete" if report["dry_run"] else "deleted"
    for root in report["roots"]:
        if root["skipped"]:
            out.print(f"{root['path']}: skipped (in use by a sleep, a wake or another gc)", markup=False)
            continue
        for action in root["actions"]:
            what = f"{verb} ({human_bytes(action['bytes'])})" if action["delete"] else "kept"
            out.print(f"{action['path']}: {what}: {action['reason']}", markup=False)
        if root["removed"]:
            out.print(f"{root['path']}: {verb}: its process is gone", markup=False)
    if report["dry_run"]:
        planned = sum(a["bytes"] for r in report["roots"] for a in r["actions"] if a["delete"])
        out.print(f"total: {human_bytes(planned)} would be freed", markup=False)
    else:
        out.print(f"total freed: {human_bytes(report['freed_bytes'])}", markup=False)


def export_report(report: dict[str, Any]) -> None:
    """What an export wrote, in a line or two: the files, the tensors, the tied names."""
    written = [f for f in report["files"] if f["tensors"]]
    where = written[0]["path"] if len(written) == 1 else f"{len(written)} shards and {report['index']}"
    source = f"{report['snapshot']} (the newest)" if report["newest"] else report["snapshot"]
    out.print(
        f"exported {report['tensors']} tensors ({human_bytes(report['bytes'])}) of {source} to {where} "
        f"in {report['seconds']:.2f} s",
        markup=False,
    )
    aliases = report["aliases"]
    if aliases:
        tied = ", ".join(f"{alias} = {name}" for alias, name in list(aliases.items())[:3])
        more = f" and {len(aliases) - 3} more" if len(aliases) > 3 else ""
        out.print(f"  tied (written once, named in the metadata): {tied}{more}", markup=False)
