"""The commands that act on targets and their snapshots: sleep, wake, recover, status, ls, gc and export.

Each parses its flags (hibernate.cli.options), calls the orchestrator and
hands the result to hibernate.cli.render; nothing else lives here. The
orchestrator and render are imported inside each command: ``--help`` and the
commands' registration must not load them (tests/test_cli_light.py).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from hibernate.cli.options import (
    AllOption,
    AllowMovesOption,
    AllUsersOption,
    BufferOption,
    CgroupOption,
    CheckpointerOption,
    CudaCheckpointOption,
    ForceOption,
    IfNeededOption,
    IoDepthOption,
    IoModeOption,
    IoWorkersOption,
    JobOption,
    JsonOption,
    KeepStagingOption,
    NoCudaOption,
    OptionalPidsArgument,
    QuietOption,
    SkipReuseCheckOption,
    SnapshotDirOption,
    TimeoutOption,
    VllmUrlOption,
    by_selector,
    handles_errors,
    or_env,
    parse_pid,
    quiet_option,
    select_targets,
    with_selection,
)

if TYPE_CHECKING:  # for annotations only: the commands import these when they run
    from hibernate.errors import InterruptedByUserError
    from hibernate.operation.progress import ProgressSink
    from hibernate.operation.reports import RecoverReport, SleepReport, WakeReport
    from hibernate.sched.selectors import Selection

Report = TypeVar("Report", "SleepReport", "WakeReport", "RecoverReport")


def _operate_and_report(
    operate: Callable[[ProgressSink], Report],
    show: Callable[[Report], None],
    selection: Selection,
    as_json: bool,
    quiet: bool,
    *,
    operation: str,
    all_users: bool,
) -> None:
    """The ending sleep, wake and recover share: run ``operate`` under a progress display, then
    print its report as JSON (with how the targets were selected) or as ``show``'s lines.

    A Ctrl-C (``operation`` names what it stopped) is reported with the state each target was
    left in (the undo of a sleep's steps has run by then), as the one error of the command; so is
    one whose undo failed (a target left half-way is named with the recover that resolves it).

    One ending, so the three commands cannot drift apart in what --json and --quiet print.
    """
    from hibernate.cli import render
    from hibernate.errors import NeedsRecoveryError

    with render.TerminalProgress(enabled=not (as_json or quiet)) as progress:
        try:
            report = operate(progress)
        except KeyboardInterrupt:
            raise _interrupted(operation, selection, all_users) from None
        except NeedsRecoveryError as exc:
            if not isinstance(exc.__cause__, KeyboardInterrupt):
                raise
            raise _interrupted(operation, selection, all_users) from None  # its undo failed: says so
    render.result(
        with_selection({"ok": True, **report.to_wire()}, selection),
        lambda: show(report),
        as_json=as_json,
        quiet=quiet,
    )


SETTLE_SECONDS = 10.0  # after a Ctrl-C, how long the targets' agents get to finish undoing


def _interrupted(operation: str, selection: Selection, all_users: bool) -> InterruptedByUserError:
    """The error a Ctrl-C ends a sleep, wake or recover with: the targets' states, once settled.

    Read from the agents, not assumed: an agent finishes its own undo when its client goes, so it
    is given a few seconds to stop being busy. A second Ctrl-C, or agents that cannot be read,
    leave the states unknown, and the message says how to find them.
    """
    import time

    from hibernate import orchestrator
    from hibernate.cli import render
    from hibernate.errors import HibernateError, InterruptedByUserError

    pids = " ".join(map(str, selection.pids))
    unknown = InterruptedByUserError(
        f"interrupted: the {operation} stopped; the state of process(es) {pids} is not known",
        hint=f"run `hibernate status {pids}`, and `hibernate recover {pids}` if one was left half-way",
    )
    deadline = time.monotonic() + SETTLE_SECONDS
    try:
        while True:
            entries = orchestrator.status(selection.pids, all_users=all_users)
            if time.monotonic() > deadline or not any(e.get("busy") for e in entries):
                break
            time.sleep(0.1)
    except (HibernateError, OSError, KeyboardInterrupt):
        return unknown
    message, hint = render.interruption(operation, entries)
    return InterruptedByUserError(message, hint=hint)


def _show_agents(
    selection: Selection | None,
    show: Callable[[list[dict[str, Any]]], None],
    *,
    all_users: bool,
    as_json: bool,
) -> None:
    """What status and ls print: the agents of ``selection``'s targets, or all of yours without one;
    the same JSON document for both, ``show``'s lines otherwise."""
    from hibernate import orchestrator
    from hibernate.cli import render

    entries = orchestrator.status(selection.pids if selection else None, all_users=all_users)
    document = {"ok": True, "agents": entries}
    render.result(
        with_selection(document, selection) if selection else document,
        lambda: show(entries),
        as_json=as_json,
    )


NoHeadersOption = Annotated[
    bool,
    typer.Option(
        "--no-headers", help="Only the rows: no header line, nothing below them.", show_default=False
    ),
]


@handles_errors
def sleep(
    to: SnapshotDirOption,
    pids: OptionalPidsArgument = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    all_users: AllUsersOption = False,
    timeout: TimeoutOption = 30.0,
    buffer_mb: BufferOption = 256,
    io_mode: IoModeOption = "auto",
    io_depth: IoDepthOption = None,
    io_workers: IoWorkersOption = None,
    keep_staging_mb: KeepStagingOption = None,
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Read each snapshot back whole (checksums) before any memory is released: "
            "proof over speed, it costs one read of the snapshot.",
        ),
    ] = False,
    skip_reuse_check: SkipReuseCheckOption = False,
    allow_moves: AllowMovesOption = False,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    no_cuda: NoCudaOption = False,
    force: ForceOption = False,
    level: Annotated[
        int | None,
        typer.Option(
            "--level",
            metavar="[1|2]",
            help="vLLM server only: 1 keeps the weights (written to DIR), 2 drops them. [default: 1]",
        ),
    ] = None,
    drain: Annotated[
        str | None,
        typer.Option(
            "--drain",
            metavar="[wait|abort]",
            help="vLLM server only: wait (running requests finish first, within --timeout) or abort "
            "them. [default: wait]",
        ),
    ] = None,
    vllm_url: VllmUrlOption = None,
    if_needed: IfNeededOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Spill each target's tracked memory to DIR, release it, and take CUDA state off the GPU.

    For a vLLM server (any pid of it) the server's own /sleep stops its scheduler and spills the workers.
    """
    from dataclasses import replace

    from hibernate import orchestrator
    from hibernate.cli import render

    options = orchestrator.options_from_flags(
        timeout=timeout,
        buffer_mb=buffer_mb,
        io_mode=io_mode,
        io_depth=io_depth,
        io_workers=io_workers,
        keep_staging_mb=keep_staging_mb,
        verify=verify,
        skip_reuse_check=or_env(skip_reuse_check),
        allow_moves=or_env(allow_moves),
        checkpointer=checkpointer,
        cuda_checkpoint=cuda_checkpoint,
        no_cuda=no_cuda,
        force=force,
        lock_timeout=timeout,
        level=level,
        drain=drain,
        vllm_url=vllm_url,
        all_users=all_users,
        job=job,
        cgroup=cgroup,
        if_needed=if_needed,
    )
    selection = select_targets(pids, every, job, cgroup, sleeping=True)  # after the flags' checks
    options = replace(options, skip_asleep=if_needed or by_selector(selection))  # as a wake skips those awake
    _operate_and_report(
        partial(orchestrator.sleep, selection.pids, to, options),
        render.sleep_report,
        selection,
        as_json,
        quiet,
        operation="sleep",
        all_users=options.all_users,
    )


@handles_errors
def wake(
    pids: OptionalPidsArgument = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    all_users: AllUsersOption = False,
    timeout: TimeoutOption = 30.0,
    buffer_mb: BufferOption = 256,
    io_mode: IoModeOption = "auto",
    io_depth: IoDepthOption = None,
    io_workers: IoWorkersOption = None,
    keep_staging_mb: KeepStagingOption = None,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    no_cuda: NoCudaOption = False,
    force: ForceOption = False,
    device_map: Annotated[
        str | None,
        typer.Option(
            "--device-map",
            metavar="OLD=NEW[,...]",
            help="Restore the CUDA state onto other GPUs of the same type (driver 580+): GPU UUIDs or "
            "indices, every GPU that was checkpointed named.",
            show_default=False,
        ),
    ] = None,
    vllm_url: VllmUrlOption = None,
    if_needed: IfNeededOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Bring each target back where it was put to sleep, verified byte for byte."""
    from hibernate import orchestrator
    from hibernate.cli import render

    options = orchestrator.options_from_flags(
        timeout=timeout,
        buffer_mb=buffer_mb,
        io_mode=io_mode,
        io_depth=io_depth,
        io_workers=io_workers,
        keep_staging_mb=keep_staging_mb,
        checkpointer=checkpointer,
        cuda_checkpoint=cuda_checkpoint,
        no_cuda=no_cuda,
        force=force,
        device_map=device_map,
        vllm_url=vllm_url,
        all_users=all_users,
        job=job,
        cgroup=cgroup,
        if_needed=if_needed,
    )
    selection = select_targets(pids, every, job, cgroup)
    _operate_and_report(
        partial(orchestrator.wake, selection.pids, options),
        render.wake_report,
        selection,
        as_json,
        quiet,
        operation="wake",
        all_users=options.all_users,
    )


@handles_errors
def recover(
    pids: OptionalPidsArgument = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    all_users: AllUsersOption = False,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    force: ForceOption = False,
    vllm_url: VllmUrlOption = None,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Finish or undo a sleep or wake whose hibernate command was killed half-way.

    A batch script that lost its `hibernate sleep --job ID` recovers the same set with
    `hibernate recover --job ID`.
    """
    from hibernate import orchestrator
    from hibernate.cli import render

    options = orchestrator.options_from_flags(
        checkpointer=checkpointer,
        cuda_checkpoint=cuda_checkpoint,
        force=force,
        vllm_url=vllm_url,
        all_users=all_users,
        job=job,
        cgroup=cgroup,
    )
    selection = select_targets(pids, every, job, cgroup)
    _operate_and_report(
        partial(orchestrator.recover, selection.pids, options),
        render.recover_report,
        selection,
        as_json,
        quiet,
        operation="recover",
        all_users=options.all_users,
    )


@handles_errors
def status(
    pids: Annotated[
        list[int] | None,
        typer.Argument(
            parser=parse_pid,
            metavar="PID",
            help="Targets to show (default: all of yours).",
            show_default=False,
        ),
    ] = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    all_users: AllUsersOption = False,
    wide: Annotated[
        bool,
        typer.Option(
            "--wide",
            "-w",
            help="More columns: user, name, who is busy with it, tracked bytes, bytes per GPU, command line.",
            show_default=False,
        ),
    ] = False,
    no_headers: NoHeadersOption = False,
    as_json: JsonOption = False,
) -> None:
    """State, memory and snapshot of each agent of the given targets (or all of yours), one line each.

    Lines are never cut, piped or not; below them, what holds an agent awake and any interrupted
    operation with the command that resolves it.
    """
    from hibernate.cli import render
    from hibernate.operation.options import spans_users

    selection = select_targets(pids, every, job, cgroup) if (pids or every or job or cgroup) else None
    _show_agents(
        selection,
        partial(render.agents_table, wide=wide, headers=not no_headers),
        all_users=spans_users(all_users, job, cgroup),
        as_json=as_json,
    )


@handles_errors
def list_agents(no_headers: NoHeadersOption = False, as_json: JsonOption = False) -> None:
    """Every hibernate agent of yours on this machine: pid, state, kind and command line, to find a target.

    `hibernate status` shows their memory and snapshots; --json prints the same document as status.
    """
    from hibernate.cli import render

    _show_agents(None, partial(render.agent_list, headers=not no_headers), all_users=False, as_json=as_json)


@handles_errors
def gc(
    directory: Annotated[
        Path, typer.Argument(metavar="DIR", help="A --to directory (or one process's directory in it).")
    ],
    awake: Annotated[
        bool, typer.Option("--awake", help="Also delete the snapshot kept by processes that are awake.")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted, and why.")] = False,
    as_json: JsonOption = False,
    quiet: Annotated[bool, quiet_option("No output unless something fails.")] = False,
) -> None:
    """Delete unfinished snapshots and those of processes that are gone; never a sleeping one's."""
    from hibernate.cli import render
    from hibernate.operation import targets
    from hibernate.store.maintenance import collect_garbage

    report = collect_garbage(
        directory,
        awake=awake,
        dry_run=dry_run,
        agent_state=lambda owner: targets.agent_state(owner.pid, owner.start_time, owner.pid_namespace),
    )
    render.result({"ok": True, **report}, lambda: render.gc_report(report), as_json=as_json, quiet=quiet)
    for warning in report["warnings"]:  # a warning is worth a log line even with --quiet
        render.err.print(f"hibernate gc: warning: {warning}", markup=False)


def _parse_out(value: str) -> Path:
    """export's --out: an empty string names nothing (``Path("")`` would quietly mean ``.``)."""
    if isinstance(value, Path):
        return value
    if value == "":
        raise typer.BadParameter("an empty string names no file or directory")
    return Path(value)


@handles_errors
def export(
    snapshot: Annotated[
        Path,
        typer.Argument(
            metavar="SNAPSHOT",
            readable=False,  # click's own check would refuse another user's as a usage error: ours says whose
            help="A snapshot directory (DIR/proc-.../snap-000003), or one process's directory in a --to "
            "directory, or a --to directory that holds one process's (its newest snapshot is taken).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            parser=_parse_out,
            metavar="PATH",
            help="FILE.safetensors (one file), or a directory: model.safetensors there, or shards "
            "model-00001-of-0000N.safetensors and model.safetensors.index.json.",
            show_default=False,
        ),
    ],
    fmt: Annotated[str, typer.Option("--format", metavar="[safetensors]", help="The file format.")] = (
        "safetensors"
    ),
    max_shard_size: Annotated[
        str,
        typer.Option(
            "--max-shard-size",
            metavar="SIZE",
            help="The most tensor bytes in one file (5GB, 500MiB, bytes); a directory gets shards above "
            "it, a FILE.safetensors that would not fit is refused.",
        ),
    ] = "5GB",
    tags: Annotated[
        list[str] | None,
        typer.Option(
            "--tag",
            metavar="TAG",
            help="Export only the tensors tracked with this tag (repeat for several; default: every tag).",
            show_default=False,
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace existing output files (and remove an earlier export's other files in the "
            "directory); without it an existing file is never overwritten.",
            show_default=False,
        ),
    ] = False,
    buffer_mb: Annotated[
        int,
        typer.Option(
            "--buffer-mb",
            metavar="MIB",
            help="Staging memory for reading the snapshot, in MiB: 16 to half of this machine's RAM.",
        ),
    ] = 256,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Write a snapshot's tensors as safetensors files, every chunk verified, for any loader."""
    import threading

    from hibernate.cli import render
    from hibernate.store.export import export_snapshot
    from hibernate.units import parse_size

    max_shard_bytes = parse_size(max_shard_size)
    with render.TerminalProgress(enabled=not (as_json or quiet)) as progress:
        lock = threading.Lock()  # the reader's workers report side by side

        def show(done: int, total: int) -> None:
            with lock:
                progress.transfer("export", done, total)

        report = export_snapshot(
            snapshot,
            out,
            fmt=fmt,
            max_shard_bytes=max_shard_bytes,
            tags=tags or (),
            force=force,
            buffer_bytes=buffer_mb << 20,
            progress=show,
        )
    render.result({"ok": True, **report}, lambda: render.export_report(report), as_json=as_json, quiet=quiet)
    for skipped in report["skipped"]:  # worth a log line even with --quiet
        what = f"{skipped['name']!r} of {skipped['key']!r}" if skipped["name"] else repr(skipped["key"])
        render.err.print(f"hibernate export: warning: skipped {what}: {skipped['reason']}", markup=False)
