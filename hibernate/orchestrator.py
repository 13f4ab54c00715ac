"""Sleep and wake as sequences of phases across every process of every target.

    sleep: connect -> quiesce -> spill -> release -> cuda (lock all, checkpoint all)
    wake:  connect -> cuda (restore all, unlock all) -> restore -> resume

Each phase runs on every member before the next starts, so a target of many
processes (a server and its tensor-parallel workers) moves as one. When a phase
fails, what was done is undone in reverse, and the error says which process
failed in which phase. Nothing is lost before ``release``, and after it the
published snapshot holds every kept byte, so an undo can always restore.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate import faults, procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLost
from hibernate.agent.paths import runtime_dir, sweep_stale_sockets
from hibernate.checkpoint.base import Checkpointer, StepTimeouts
from hibernate.errors import (
    HibernateError,
    HibernateTimeoutError,
    NeedsRecoveryError,
    NoSuchProcessError,
    StorageError,
    UnsupportedError,
    UsageError,
    WrongStateError,
)
from hibernate.fsutil import ensure_private_dir, open_private_dir
from hibernate.journal import Entry, Journal, TargetLock
from hibernate.procinfo import ProcessIdentity
from hibernate.targets import AgentRef, Target, resolve

# A --to DIR root creates for the agents of several users: each makes its own 0700 directory in it.
SHARED_DIR_MODE = 0o1777

# Phase boundaries, in order; each is journaled and is a fault point ("sleep.after-<phase>").
SLEEP_PHASES = ("lock", "connect", "quiesce", "spill", "release", "cuda-lock", "cuda")
WAKE_PHASES = ("lock", "connect", "cuda-restore", "cuda", "restore", "resume")
# A vLLM server (hibernate/integrations/vllm_flow.py): its own /sleep and /wake_up move the memory.
VLLM_SLEEP_PHASES = ("lock", "connect", "configure", "drain", "vllm-sleep", "cuda-lock", "cuda")
VLLM_WAKE_PHASES = ("lock", "connect", "cuda-restore", "cuda", "vllm-wake")


class ProgressSink:
    """Receives phase changes and byte counts; the CLI renders them, the default ignores them."""

    def phase(self, name: str) -> None:
        """A new phase begins."""

    def transfer(self, phase: str, done: int, total: int) -> None:
        """Bytes moved so far in a spill or restore, summed over every process."""


@dataclass
class IoOptions:
    buffer_mb: int = 256
    chunk_mb: int = 32
    io_mode: str = "auto"
    verify: bool = False  # read each snapshot back before its memory is released

    def to_args(self) -> dict[str, Any]:
        return {
            "buffer_mb": self.buffer_mb,
            "chunk_mb": self.chunk_mb,
            "io_mode": self.io_mode,
            "verify": self.verify,
        }


@dataclass
class VllmOptions:
    """How to put a vLLM server to sleep; None: the default (level 1, drain wait, URL from its command line).

    Set only when the user gave them, so that they can be refused for a target that is not vLLM.
    """

    level: int | None = None
    drain: str | None = None
    url: str | None = None

    def given(self) -> list[str]:
        named = (("--level", self.level), ("--drain", self.drain), ("--vllm-url", self.url))
        return [name for name, value in named if value is not None]


@dataclass
class Options:
    quiesce_timeout: float = 30.0
    agent_timeout: float = 60.0  # longest silence from an agent before giving up
    io: IoOptions = field(default_factory=IoOptions)
    # The CUDA phase: an explicit checkpointer, else one chosen (once, lazily) by kind:
    # "auto" (driver API, else the cuda-checkpoint binary, else none), "driver" or "binary".
    checkpointer: Checkpointer | None = None
    checkpointer_kind: str = "auto"
    cuda_checkpoint: str | None = None  # path of the cuda-checkpoint binary (--cuda-checkpoint)
    cuda_timeouts: StepTimeouts = field(default_factory=StepTimeouts)
    vllm: VllmOptions = field(default_factory=VllmOptions)
    # A sleep of targets chosen by a selector (--all, --job, --cgroup) skips those already asleep and
    # lists them, as a wake skips those awake: "everything of mine" should end asleep, not fail because
    # part of it already is. Pids named one by one are refused instead (the user meant those).
    skip_asleep: bool = False
    # Agents of several users in one command (root only): --all-users, or a --job/--cgroup selection.
    all_users: bool = False
    _chosen: bool = field(default=False, repr=False)
    _passed_over: list[str] = field(default_factory=list, repr=False)
    _skipped: list[dict[str, Any]] = field(default_factory=list, repr=False)


def exits(identity: ProcessIdentity, within: float = 2.0) -> bool:
    """Whether a process whose agent just hung up is gone, or goes within ``within`` seconds.

    A dying process's sockets close before /proc shows it gone (the kernel
    closes its files first), so "connection lost" is judged only once the
    process had a moment to finish exiting.
    """
    deadline = time.monotonic() + within
    while procinfo.is_alive(identity):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@dataclass
class _Member:
    """One agent taking part in an operation, and what happened to it."""

    ref: AgentRef
    client: AgentClient
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    reached: str = "connected"
    unresponsive: bool = False  # stopped answering: it is left to roll back by itself

    @property
    def pid(self) -> int:
        return self.ref.pid

    def call(self, op: str, args: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            result = self.client.call(op, args, **kwargs)
        except AgentConnectionLost as exc:
            if exits(self.ref.identity):
                raise NoSuchProcessError(f"process {self.pid} exited during {op}") from exc
            raise
        except HibernateTimeoutError as exc:
            # Hang up: an agent whose client is gone rolls a half-done sleep back to running
            # by itself as soon as it runs again; waiting on it for an undo would hang too.
            self.unresponsive = True
            self.client.close()
            exc.message += (
                "; the connection was closed, so the process goes back to running by itself "
                "as soon as it answers again"
                if self.reached in ("begin", "quiesce", "spill")
                else ""
            )
            raise
        # The phase as this command saw it, from request to answer: everything the agent did for it
        # (not only the store's transfer, which it reports as io_seconds) and the round trip.
        result["seconds"] = time.perf_counter() - started
        self.phases[op] = result
        self.reached = op
        return result


class _ByteCounter:
    """Sums the progress of several agents transferring at once."""

    def __init__(self, sink: ProgressSink, phase: str, on_first: Callable[[], None] = lambda: None) -> None:
        self._sink = sink
        self._phase = phase
        self._on_first = on_first
        self._lock = threading.Lock()
        self._done: dict[int, int] = {}
        self._total: dict[int, int] = {}

    def for_member(self, pid: int) -> Callable[[dict[str, Any]], None]:
        def update(event: dict[str, Any]) -> None:
            with self._lock:
                self._done[pid] = int(event.get("done", 0))
                self._total[pid] = int(event.get("total", 0))
                done, total = sum(self._done.values()), sum(self._total.values())
            self._sink.transfer(self._phase, done, total)
            self._on_first()

        return update


class _Operation:
    """One sleep or wake: a lock per process, a journal entry per process, a fault point per phase.

    The locks keep a second command off the same processes (the kernel drops
    them if this command is killed). The journal says, durably and before the
    command moves on, which phases are complete, so that ``hibernate status``
    can show an interrupted operation and ``hibernate recover`` can finish or
    undo it. A completed (or cleanly undone) operation leaves no entry behind.
    """

    def __init__(self, op: str, targets: Sequence[Target]) -> None:
        self.op = op
        self.refs = list({a.identity: a for t in targets for a in t.agents}.values())
        self._locks: list[TargetLock] = []
        self._entries: list[tuple[Journal, Entry]] = []
        self._fired: set[str] = set()

    @staticmethod
    def _owner(ref: AgentRef) -> int | None:
        return procinfo.owner_uid(ref.pid) if os.getuid() == 0 else None

    def lock(self) -> None:
        description = f"hibernate {self.op} (pid {os.getpid()}, since {time.strftime('%H:%M:%S')})"
        try:
            for ref in self.refs:
                lock = TargetLock(ref.socket.parent, ref.identity, self._owner(ref))
                lock.acquire(description)
                self._locks.append(lock)
        except BaseException:
            self.release()
            raise

    def record(
        self, directory: Path | None, holders: Sequence[ProcessIdentity], checkpointer: str | None
    ) -> None:
        members = [[r.pid, r.identity.start_time] for r in self.refs]
        cuda = [[h.pid, h.start_time] for h in holders]
        for ref in self.refs:
            journal = Journal(ref.socket.parent, self._owner(ref))
            entry = Entry(
                op=self.op,
                pid=ref.pid,
                start_time=ref.identity.start_time,
                cli_pid=os.getpid(),
                directory=str(directory) if directory else None,
                members=members,
                cuda_holders=cuda,
                checkpointer=checkpointer,
            )
            journal.record(entry)
            self._entries.append((journal, entry))

    def passed(self, phase: str) -> None:
        """``phase`` is complete everywhere: journal it, then give the fault point its chance."""
        for journal, entry in self._entries:
            journal.mark(entry, phase)
        faults.point(f"{self.op}.after-{phase}")

    def during(self, phase: str) -> None:
        """Inside a long phase (the first progress report of a transfer)."""
        if phase not in self._fired:
            self._fired.add(phase)
            faults.point(f"{self.op}.during-{phase}")

    def finish(self) -> None:
        """Done, or cleanly undone: nothing to recover; earlier entries of these processes go too."""
        for ref in self.refs:
            Journal(ref.socket.parent, self._owner(ref)).remove(ref.identity)
        self._entries.clear()
        self.release()

    @contextlib.contextmanager
    def concluding(self, *keep_journal_on: type[BaseException]) -> Iterator[None]:
        """End the operation with the block that runs its phases.

        Success and a clean undo leave nothing to recover (``finish``); a
        NeedsRecoveryError, or one of ``keep_journal_on``, keeps the journal
        entry for ``hibernate recover`` and only lets go of the locks.
        """
        keep: tuple[type[BaseException], ...] = (NeedsRecoveryError, *keep_journal_on)
        try:
            yield
        except keep:
            self.release()
            raise
        except BaseException:
            self.finish()
            raise
        self.finish()

    def release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks.clear()
        for directory in {ref.socket.parent for ref in self.refs}:
            _sweep_dead(directory)


def _sweep_dead(directory: Path) -> None:
    """Sockets, journal entries and lock files of processes that no longer exist go."""
    sweep_stale_sockets(directory)
    journal = Journal(directory)
    journal.sweep_dead_entries()
    journal.sweep_locks()


def _vllm(targets: Sequence[Target], options: Options) -> bool:
    """Whether the targets are a vLLM server (its own flow); vLLM-only options refused for anything else."""
    if any(a.status.get("sleep_driver") == "vLLM" for t in targets for a in t.agents):
        return True
    given = options.vllm.given()
    if given:
        pids = ", ".join(str(t.requested_pid) for t in targets)
        raise UsageError(
            f"{', '.join(given)} apply to a vLLM server, and process(es) {pids} are not one; "
            "nothing was changed"
        )
    return False


def prepare_directory(directory: Path, targets: Sequence[Target]) -> Path:
    """Resolve ``--to``; create it 0700 if missing; refuse a file or an unwritable directory.

    An existing directory is used as it is (a shared scratch area may belong to
    someone else): privacy comes from the 0700 per-process directories inside.
    """
    directory = Path(directory).expanduser().absolute()
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--to {directory} is a file, not a directory")
    if not directory.exists():
        owners = {procinfo.owner_uid(a.pid) for t in targets for a in t.agents}
        if os.getuid() == 0 and len(owners) > 1:
            # Root for several users (--all-users): each user's agent makes its own 0700
            # directory in DIR, so DIR is shared the way /tmp is (sticky, world-writable).
            fd = open_private_dir(directory)
            try:
                os.fchmod(fd, SHARED_DIR_MODE)
            finally:
                os.close(fd)
        else:
            owner = owners.pop() if len(owners) == 1 else None
            ensure_private_dir(directory, owner_uid=owner if os.getuid() == 0 else None)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise StorageError(
            f"--to {directory} is not writable by you", hint="choose a directory you can write to"
        )
    return directory


def _connect(targets: Sequence[Target], timeout: float) -> list[_Member]:
    members: list[_Member] = []
    try:
        for target in targets:
            for ref in target.agents:
                member = _Member(ref, ref.connect(timeout))
                members.append(member)
                member.call("begin")
    except BaseException:
        _hang_up(members)
        raise
    return members


def _describe_state(member: _Member) -> str:
    status = member.phases["begin"]
    state = status.get("state")
    if state == "asleep":
        where = (status.get("snapshot") or {}).get("path")
        return f"process {member.pid} is already asleep" + (f" (snapshot {where})" if where else "")
    return f"process {member.pid} is {'not asleep, it is ' if state == 'running' else ''}{state}"


def _hang_up(members: Sequence[_Member]) -> None:
    for member in members:
        member.client.close()


@contextlib.contextmanager
def _closing(members: Sequence[_Member]) -> Iterator[None]:
    """Hang up on every member when the block ends (``members`` may still grow inside it)."""
    try:
        yield
    finally:
        _hang_up(members)


def _parallel(members: Sequence[_Member], work: Callable[[_Member], object]) -> None:
    """Run ``work`` on every member at once; re-raise the first failure after all finish."""
    if len(members) == 1:
        work(members[0])
        return
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=len(members)) as pool:
        for future in [pool.submit(work, m) for m in members]:
            exc = future.exception()
            if exc is not None:
                errors.append(exc)
    if errors:
        raise errors[0]


def _checkpointer(options: Options) -> Checkpointer | None:
    """The checkpointer of ``options``, chosen on first use (an explicit kind that is missing raises)."""
    if options.checkpointer is None and not options._chosen:
        from hibernate.checkpoint.selection import choose

        options.checkpointer, options._passed_over = choose(
            options.checkpointer_kind, options.cuda_checkpoint, options.cuda_timeouts
        )
        options._chosen = True
    return options.checkpointer


def _survey_cuda(targets: Sequence[Target], options: Options) -> Any:
    """Find every CUDA holder of the targets (device files, or the driver answering for the pid).

    Sets each target's ``cuda_holders`` (a process in several requested trees
    counts once) and returns the survey (holders with their states).
    """
    from hibernate.checkpoint.detect import survey

    found = survey([p for t in targets for p in t.processes], _checkpointer(options))
    options._skipped = found.skipped
    seen: set[ProcessIdentity] = set()
    for target in targets:
        target.cuda_holders = []
        for holder in found.holders:
            if holder.pid in target.processes and holder.identity not in seen:
                seen.add(holder.identity)
                target.cuda_holders.append(holder.identity)
    return found


def _require_checkpointer(targets: Sequence[Target], options: Options) -> None:
    """Before anything changes: find the CUDA holders; refuse unless all can be checkpointed."""
    from hibernate.checkpoint.phase import check_sleepable

    found = _survey_cuda(targets, options)
    holders = [h.pid for h in found.holders]
    if holders and options.checkpointer is None:
        why = "; ".join(options._passed_over)
        raise UnsupportedError(
            f"process(es) {', '.join(map(str, holders))} hold a CUDA context and neither the driver's "
            f"checkpoint API nor the cuda-checkpoint binary is available to take it off the GPU"
            + (f" ({why})" if why else "")
            + "; nothing was changed",
            hint="install an NVIDIA driver >= 570, or cuda-checkpoint (see `hibernate doctor`)",
        )
    check_sleepable(found.holders)


def _annotate(exc: HibernateError, member: _Member, phase: str) -> HibernateError:
    return exc.add_context(f"process {member.pid} ({phase})", unless=f"process {member.pid}")


def _undo_sleep(members: Sequence[_Member], error: BaseException) -> None:
    """Put every member back to running; NeedsRecoveryError if that fails too."""
    failures = []
    for member in reversed(members):
        if member.unresponsive or not procinfo.is_alive(member.ref.identity):
            continue  # left to roll back by itself, or gone: nothing of it to put back
        try:
            if member.reached == "release":
                member.call("restore", idle_timeout=None)
            if member.reached in ("quiesce", "spill", "release", "restore"):
                member.call("resume")
        except HibernateError as undo_error:
            failures.append(f"process {member.pid}: {undo_error.message}")
    if failures:
        raise NeedsRecoveryError(
            f"{error}; undoing it failed too: {'; '.join(failures)}",
            hint="run `hibernate wake PID` (or `hibernate status`) once the cause is fixed",
        ) from error


def _asleep(target: Target) -> bool:
    """Whether ``target`` is asleep as a whole: every agent of it that holds memory is asleep.

    A vLLM server's API process holds no pools (its workers do) and stays
    running while the server sleeps, so it does not count.
    """
    from hibernate.integrations.vllm_flow import holds_pools, is_vllm

    holders = [a for a in target.agents if not (is_vllm(a.status) and not holds_pools(a.status))]
    return bool(holders) and all(a.status.get("state") == "asleep" for a in holders)


def _skip_asleep(targets: Sequence[Target]) -> tuple[list[Target], list[dict[str, Any]]]:
    """The targets still to put to sleep, and what was skipped because it already sleeps.

    Decided from the agents' answers when the targets were resolved, before any
    lock: a target half asleep is not skipped (the sleep then refuses it, as
    one named by pid). Nothing left to do is a WrongStateError, as a wake of
    nothing asleep is.
    """
    asleep = [t for t in targets if _asleep(t)]
    remaining = [t for t in targets if not any(t is a for a in asleep)]
    skipped = [
        {
            "pid": a.pid,
            "name": a.status.get("name"),
            "state": a.status.get("state"),
            "snapshot": (a.status.get("snapshot") or {}).get("path"),
        }
        for t in asleep
        for a in t.agents
        if a.status.get("state") == "asleep"
    ]
    if not remaining:
        raise WrongStateError("nothing to put to sleep: " + "; ".join(_describe_skipped(s) for s in skipped))
    return remaining, skipped


def _describe_skipped(entry: dict[str, Any]) -> str:
    where = entry.get("snapshot")
    return f"process {entry['pid']} is already asleep" + (f" (snapshot {where})" if where else "")


def sleep(
    pids: Sequence[int], directory: Path, options: Options, sink: ProgressSink | None = None
) -> dict[str, Any]:
    sink = sink or ProgressSink()
    started = time.perf_counter()
    sink.phase("connect")
    targets = resolve(pids, all_users=options.all_users)
    skipped: list[dict[str, Any]] = []
    if options.skip_asleep:
        targets, skipped = _skip_asleep(targets)
    if _vllm(targets, options):
        from hibernate.integrations import vllm_flow

        report = vllm_flow.sleep(targets, directory, options, sink)
    else:
        report = _sleep_targets(targets, directory, options, sink, started)
    if skipped:
        report["skipped"] = skipped
    return report


def _sleep_targets(
    targets: Sequence[Target], directory: Path, options: Options, sink: ProgressSink, started: float
) -> dict[str, Any]:
    """quiesce, spill, release and the CUDA phase of targets that are not a vLLM server."""
    operation = _Operation("sleep", targets)
    operation.lock()
    members: list[_Member] = []
    with operation.concluding(), _closing(members):
        _require_checkpointer(targets, options)
        directory = prepare_directory(directory, targets)
        holders = [h for t in targets for h in t.cuda_holders]
        checkpointer = options.checkpointer
        operation.record(directory, holders, checkpointer.name if checkpointer is not None else None)
        operation.passed("lock")
        members.extend(_connect(targets, options.agent_timeout))
        not_running = [m for m in members if m.phases["begin"].get("state") != "running"]
        if not_running:
            raise WrongStateError(
                "; ".join(_describe_state(m) for m in not_running) + "; nothing was changed",
                hint=f"wake it first: hibernate wake {' '.join(str(m.pid) for m in not_running)}",
            )
        operation.passed("connect")
        cuda = _sleep_phases(targets, members, directory, options, sink, operation)
    return _sleep_report(members, cuda, directory, time.perf_counter() - started)


def _sleep_phases(
    targets: Sequence[Target],
    members: Sequence[_Member],
    directory: Path,
    options: Options,
    sink: ProgressSink,
    operation: _Operation,
) -> dict[str, Any]:
    """quiesce -> spill -> release -> cuda on every member; undone on any failure."""
    phase = "quiesce"
    cuda_done = False
    try:
        sink.phase("quiesce")
        for member in members:
            member.call(
                "quiesce",
                {"timeout": options.quiesce_timeout},
                idle_timeout=options.quiesce_timeout + options.agent_timeout,
            )
        operation.passed("quiesce")
        phase = "spill"
        sink.phase("spill")
        counter = _ByteCounter(sink, "spill", lambda: operation.during("spill"))
        args = {"dir": str(directory), **options.io.to_args()}
        _parallel(
            members,
            lambda m: m.call(
                "spill", args, progress=counter.for_member(m.pid), idle_timeout=options.agent_timeout
            ),
        )
        operation.passed("spill")
        phase = "release"
        sink.phase("release")
        for member in members:
            member.call("release")
        operation.passed("release")
        phase = "cuda"
        sink.phase("cuda")
        cuda = _cuda_sleep(targets, options, operation)
        cuda_done = True
        operation.passed("cuda")
        return cuda
    except HibernateError as exc:
        if phase == "cuda" and isinstance(exc, NeedsRecoveryError):
            # CUDA could not be brought back: the agents stay asleep too (their memory must not be
            # touched while CUDA is locked), and `hibernate wake` brings both back.
            raise
        if cuda_done:
            _undo_cuda(targets, options, operation, exc)
        failed = next((m for m in members if m.reached != phase), members[0])
        _undo_sleep(members, exc)
        raise (exc if phase == "cuda" else _annotate(exc, failed, phase)) from None
    except BaseException as exc:
        if cuda_done:
            _undo_cuda(targets, options, operation, exc)
        _undo_sleep(members, exc)
        raise


def _undo_cuda(
    targets: Sequence[Target], options: Options, operation: _Operation, error: BaseException
) -> None:
    """Bring a completed CUDA phase back (restore, unlock) before any agent touches memory again."""
    try:
        _cuda_wake(targets, options, operation)
    except HibernateError as undo_error:
        raise NeedsRecoveryError(
            f"{error}; bringing the CUDA state back failed too: {undo_error.message}",
            hint="run `hibernate wake PID` once the cause is fixed",
        ) from error


def _skipped_cuda(options: Options) -> dict[str, Any]:
    report: dict[str, Any] = {"status": "none (skipped)", "processes": []}
    if options._skipped:
        report["skipped"] = options._skipped
    return report


def _cuda_sleep(targets: Sequence[Target], options: Options, operation: _Operation) -> dict[str, Any]:
    """Lock, then checkpoint, every CUDA holder found before the sleep began (undone on failure)."""
    from hibernate.checkpoint.detect import Holder, nvidia_device_files
    from hibernate.checkpoint.phase import CudaPhase

    identities = list(dict.fromkeys(h for t in targets for h in t.cuda_holders))
    checkpointer = _checkpointer(options)
    if not identities:
        return _skipped_cuda(options)
    if checkpointer is None:  # guarded by _require_checkpointer
        raise UnsupportedError("the CUDA phase needs a checkpointer")
    gone = [ident.pid for ident in identities if not procinfo.is_alive(ident)]
    if gone:
        raise NoSuchProcessError(f"process(es) {', '.join(map(str, gone))} exited during the sleep")
    holders = [Holder(ident, nvidia_device_files(ident.pid), None) for ident in identities]

    def after_step(step: str) -> None:
        if step == "lock":
            operation.passed("cuda-lock")

    report = CudaPhase(checkpointer, options.cuda_timeouts, after_step=after_step).sleep(holders)
    if options._skipped:
        report["skipped"] = options._skipped
    return report


def _io_seconds(phase: dict[str, Any]) -> float | None:
    """The store's own transfer time within a spill or restore; None where the agent did not say."""
    value = phase.get("io_seconds")
    return round(float(value), 6) if isinstance(value, (int, float)) else None


def sleep_entry(pid: int, name: Any, phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One process of a sleep report, from what its agent's quiesce, spill and release returned.

    GB/s is the bytes written over the whole spill phase (``seconds``), not over
    the store's transfer alone (``io_seconds``): with many small tensors the
    work around the writes is most of the phase, and a rate that left it out
    would promise what no sleep delivers.
    """
    spill = phases.get("spill", {})
    release = phases.get("release", {})
    written = int(spill.get("written_bytes", 0))
    spill_seconds = float(spill.get("seconds", 0.0)) or 1e-9
    return {
        "pid": pid,
        "name": name,
        "snapshot": spill.get("path"),
        "total_bytes": spill.get("total_bytes", 0),
        "written_bytes": written,
        "reused_bytes": spill.get("reused_bytes", 0),
        "dropped_bytes": spill.get("dropped_bytes", 0),
        "released_bytes": release.get("released_bytes", 0),
        "io_mode": spill.get("io_mode"),
        "gb_per_s": round(written / spill_seconds / 1e9, 3),
        "io_seconds": _io_seconds(spill),
        "verify_seconds": spill.get("verify_seconds"),
        "rss_before": release.get("rss_before"),
        "rss_after": release.get("rss_after"),
        "pools": spill.get("pools", []),
        "phases": {
            k: round(float(v.get("seconds", 0.0)), 6) for k, v in phases.items() if isinstance(v, dict)
        },
    }


def _sleep_report(
    members: Sequence[_Member], cuda: dict[str, Any], directory: Path, seconds: float
) -> dict[str, Any]:
    return {
        "operation": "sleep",
        "directory": str(directory),
        "seconds": round(seconds, 6),
        "processes": [sleep_entry(m.pid, m.ref.status.get("name"), m.phases) for m in members],
        "cuda": cuda,
    }


def wake(pids: Sequence[int], options: Options, sink: ProgressSink | None = None) -> dict[str, Any]:
    """Bring every target back, deciding from the real states: this also finishes or undoes
    whatever an interrupted sleep or wake left behind."""
    sink = sink or ProgressSink()
    started = time.perf_counter()
    sink.phase("connect")
    targets = resolve(pids, all_users=options.all_users)
    if _vllm(targets, options):
        from hibernate.integrations import vllm_flow

        return vllm_flow.wake(targets, options, sink)
    operation = _Operation("wake", targets)
    operation.lock()
    members: list[_Member] = []
    with operation.concluding(), _closing(members):
        operation.record(None, [h for t in targets for h in t.cuda_holders], None)
        operation.passed("lock")
        members.extend(_connect(targets, options.agent_timeout))
        operation.passed("connect")
        report = _wake_phases(targets, members, options, sink, operation, started)
    return report


def _wake_phases(
    targets: Sequence[Target],
    members: Sequence[_Member],
    options: Options,
    sink: ProgressSink,
    operation: _Operation,
    started: float,
) -> dict[str, Any]:
    sleeping = [m for m in members if m.phases["begin"].get("state") == "asleep"]
    sink.phase("cuda")
    cuda = _cuda_wake(targets, options, operation)  # from the real CUDA states, asleep agents or not
    operation.passed("cuda")
    if not sleeping:
        if not _cuda_changed(cuda):
            raise WrongStateError("nothing to wake: " + "; ".join(_describe_state(m) for m in members))
        return _wake_report([], cuda, time.perf_counter() - started)
    sink.phase("restore")
    counter = _ByteCounter(sink, "restore", lambda: operation.during("restore"))
    failures: list[tuple[_Member, HibernateError]] = []
    lock = threading.Lock()

    def restore(member: _Member) -> None:
        try:
            member.call(
                "restore",
                options.io.to_args(),
                progress=counter.for_member(member.pid),
                idle_timeout=options.agent_timeout,
            )
        except HibernateError as exc:
            with lock:
                failures.append((member, exc))

    _parallel(sleeping, restore)
    if not failures:
        operation.passed("restore")
    sink.phase("resume")
    for member in sleeping:
        if member.reached == "restore":
            member.call("resume")
    if failures:
        member, exc = failures[0]
        raise exc.add_context(
            f"process {member.pid} stays asleep",
            hint=f"fix the cause, then run `hibernate wake {member.pid}` again",
        )
    operation.passed("resume")
    return _wake_report(sleeping, cuda, time.perf_counter() - started)


def _cuda_changed(cuda: dict[str, Any]) -> bool:
    return any(p.get("steps") for p in cuda.get("processes", []))


def _cuda_wake(targets: Sequence[Target], options: Options, operation: _Operation) -> dict[str, Any]:
    """Restore every checkpointed holder, then unlock every locked one, deciding from their real states.

    A checkpointed process has closed its device files, so it is found by asking
    the driver; without a checkpointer nothing can be asked, and a process that
    an earlier sleep checkpointed (its record says so) is refused rather than
    left blocked in its first CUDA call.
    """
    from hibernate.checkpoint import records
    from hibernate.checkpoint.phase import CudaPhase

    if _checkpointer(options) is None:
        pending = [
            ident.pid
            for t in targets
            for ident in (procinfo.identity(p) for p in t.processes)
            if ident is not None and records.load(ident) is not None
        ]
        if pending:
            why = "; ".join(options._passed_over)
            raise UnsupportedError(
                f"process(es) {', '.join(map(str, pending))} had their CUDA state checkpointed by "
                "`hibernate sleep`, and neither the driver's checkpoint API nor the cuda-checkpoint binary "
                "is available to restore it" + (f" ({why})" if why else "") + "; nothing was changed",
                hint="run the wake where the sleep ran (same driver), or pass --cuda-checkpoint PATH",
            )
    found = _survey_cuda(targets, options)
    checkpointer = options.checkpointer
    if not found.holders or checkpointer is None:
        return _skipped_cuda(options)

    def after_step(step: str) -> None:
        if step == "restore":
            operation.passed("cuda-restore")

    report = CudaPhase(checkpointer, options.cuda_timeouts, after_step=after_step).wake(found.holders)
    if options._skipped:
        report["skipped"] = options._skipped
    return report


def wake_entry(pid: int, name: Any, snapshot: Any, phases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One process of a wake report, from what its agent's restore and resume returned.

    GB/s is over the whole restore phase, as in :func:`sleep_entry`.
    """
    restore = phases.get("restore", {})
    total = int(restore.get("total_bytes", 0))
    restore_seconds = float(restore.get("seconds", 0.0)) or 1e-9
    return {
        "pid": pid,
        "name": name,
        "snapshot": snapshot,
        "restored_bytes": total,
        "zeroed_bytes": restore.get("zeroed_bytes", 0),
        "io_mode": restore.get("io_mode"),
        "gb_per_s": round(total / restore_seconds / 1e9, 3),
        "io_seconds": _io_seconds(restore),
        "rss_before": restore.get("rss_before"),
        "rss_after": restore.get("rss_after"),
        "phases": {
            k: round(float(v.get("seconds", 0.0)), 6) for k, v in phases.items() if isinstance(v, dict)
        },
    }


def _wake_report(members: Sequence[_Member], cuda: dict[str, Any], seconds: float) -> dict[str, Any]:
    processes = [
        wake_entry(
            m.pid, m.ref.status.get("name"), (m.ref.status.get("snapshot") or {}).get("path"), m.phases
        )
        for m in members
    ]
    return {"operation": "wake", "seconds": round(seconds, 6), "processes": processes, "cuda": cuda}


def interrupted_operation(ref: AgentRef) -> dict[str, Any] | None:
    """An operation on ``ref`` that stopped half-way (its command died), and how to resolve it."""
    owner = procinfo.owner_uid(ref.pid) if os.getuid() == 0 else None
    journal = Journal(ref.socket.parent, owner)
    entry = journal.load(ref.identity)
    if entry is None:
        return None
    holder = TargetLock(ref.socket.parent, ref.identity).holder()
    if holder is not None:
        return {"op": entry.op, "phases": entry.phases, "in_progress": holder}
    return {
        "op": entry.op,
        "phases": entry.phases,
        "cli_pid": entry.cli_pid,
        "since_unix": entry.started_unix,
        "resolve": f"hibernate recover {ref.pid}",
    }


def status(pids: Sequence[int] | None, *, all_users: bool = False) -> list[dict[str, Any]]:
    """Status of the agents of ``pids`` (all of ours when None), with any interrupted operation."""
    from hibernate.targets import all_agents

    refs = [a for t in resolve(pids, all_users=all_users) for a in t.agents] if pids else all_agents()
    out = []
    for ref in refs:
        entry = dict(ref.status)
        entry["rss"] = procinfo.resident_bytes(ref.pid)
        entry["command"] = procinfo.command_line(ref.pid)[:200]
        entry["interrupted"] = interrupted_operation(ref)
        out.append(entry)
    for directory in {runtime_dir(), *(ref.socket.parent for ref in refs)}:
        _sweep_dead(directory)
    return out


def recover(pids: Sequence[int], options: Options, sink: ProgressSink | None = None) -> dict[str, Any]:
    """Finish or undo what an interrupted sleep or wake left, from the journal and the real states.

    An interrupted sleep whose every process had released its memory, with every
    CUDA holder still running, is finished (only the CUDA phase was left).
    Anything else is brought back to running, which is always possible: until
    ``release`` nothing was lost, and after it the snapshot holds every byte.
    """
    sink = sink or ProgressSink()
    targets = resolve(pids, all_users=options.all_users)
    if _vllm(targets, options):
        from hibernate.integrations import vllm_flow

        return vllm_flow.recover(targets, options, sink)
    refs = list({a.identity: a for t in targets for a in t.agents}.values())
    found = [(ref, interrupted_operation(ref)) for ref in refs]
    busy = [(ref, i) for ref, i in found if i and "in_progress" in i]
    if busy:
        ref, info = busy[0]
        from hibernate.errors import BusyError

        raise BusyError(f"process {ref.pid} is busy: {info['in_progress']} is operating on it")
    pending = [(ref, i) for ref, i in found if i]
    if not pending:
        states = ", ".join(f"{r.pid}: {r.status.get('state')}" for r in refs)
        return {"operation": "recover", "action": "none", "message": f"nothing to recover ({states})"}
    op, phases = pending[0][1]["op"], pending[0][1]["phases"]
    all_asleep = all(r.status.get("state") == "asleep" for r in refs)
    if op == "sleep" and phases and phases[-1] == "cuda" and all_asleep:
        operation = _Operation("sleep", targets)
        operation.lock()
        operation.finish()  # every phase had completed; only the journal was left
        return {"operation": "recover", "action": "the interrupted sleep had completed", "report": None}
    if op == "sleep" and "release" in phases and all_asleep:
        try:
            report = _finish_sleep(targets, options, sink)
            return {"operation": "recover", "action": "finished the interrupted sleep", "report": report}
        except HibernateError as exc:
            sink.phase(f"cannot finish the sleep ({exc.message}); waking instead")
    try:
        report = wake(pids, options, sink)
    except WrongStateError:
        # Nothing was asleep or checkpointed: the operation died before changing anything,
        # and the wake's bookkeeping has cleared its journal.
        return {"operation": "recover", "action": f"the interrupted {op} had changed nothing", "report": None}
    action = "finished the interrupted wake" if op == "wake" else "undid the interrupted sleep"
    return {"operation": "recover", "action": action, "report": report}


def _finish_sleep(targets: Sequence[Target], options: Options, sink: ProgressSink) -> dict[str, Any]:
    """The CUDA phase of a sleep whose agents are all asleep already."""
    operation = _Operation("sleep", targets)
    operation.lock()
    with operation.concluding():
        _require_checkpointer(targets, options)  # refuses holders that are not all running
        sink.phase("cuda")
        cuda = _cuda_sleep(targets, options, operation)
    return {"operation": "sleep", "cuda": cuda}
