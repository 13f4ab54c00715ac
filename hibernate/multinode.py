"""Many nodes, one outcome: the per-node half of a job-wide sleep or wake.

A job that spans nodes is hibernated by running hibernate once per node with
the scheduler's own launcher (``scripts/slurm/hibernate-job`` runs
``srun --overlap --ntasks-per-node=1 hibernate node-step sleep ...``). Each
run acts on its own node only, so the runs must agree, or half a job would
sleep while the other half waits for it in a collective. They agree through a
directory every node can see (the *barrier*):

    1. each node sleeps its processes (lock all, checkpoint all, undo all on failure),
    2. posts ``node<i>.ok`` or ``node<i>.failed`` there,
    3. waits until one verdict stands: the first node to see every result ok writes
       ``decision`` = commit; the first to see a failure, or to pass the timeout with
       a node still silent (a dead node, a hung node), writes ``decision`` = abort,
    4. follows the verdict: commit, exit 0 asleep; abort, a node that slept wakes its
       processes again and every node exits non-zero with the verdict's exit code.

``decision`` is published with ``link()``, which creates a name only if it is
free, atomically on local file systems and on NFS, so exactly one verdict
stands even when two nodes decide at once, and a late node (its sleep finished
after the timeout) finds it and wakes: every node ends asleep, or every node
ends awake. A wake uses the same barrier so that all nodes report one verdict;
there is nothing to undo after a failed wake (a process that stayed asleep is
woken by running the wake again; nodes already awake agree).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hibernate import orchestrator, targets
from hibernate.errors import (
    ExitCode,
    HibernateError,
    NeedsRecoveryError,
    NothingToHibernateError,
    UsageError,
    WrongStateError,
)

DECISION = "decision"
COMMIT = "commit"
ABORT = "abort"
_RESULT_RE = re.compile(r"^node(\d+)\.(ok|failed)$")
_LIMIT = 1 << 20
ONE_TASK_PER_NODE = "run exactly one task per node (srun --ntasks-per-node=1), each with its own SLURM_NODEID"
OPERATIONS = ("sleep", "wake")


class NodeStepError(HibernateError):
    """The job's nodes agreed on abort; the exit code is the verdict's, the same on every node."""

    wire_name = "node-step"

    def __init__(self, message: str, *, exit_code: ExitCode, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.exit_code = exit_code


@dataclass(frozen=True)
class NodeResult:
    """What one node's local sleep or wake came to."""

    index: int
    node: str
    ok: bool
    exit_code: int = 0
    message: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> NodeResult:
        return cls(
            index=int(data["index"]),
            node=str(data["node"]),
            ok=bool(data["ok"]),
            exit_code=int(data.get("exit_code", 0)),
            message=data.get("message"),
            detail=dict(data.get("detail") or {}),
        )


@dataclass(frozen=True)
class Decision:
    """The one verdict of a barrier: commit or abort, who wrote it, why, and the exit code all use."""

    verdict: str
    reason: str
    exit_code: int
    by: str = ""

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> Decision:
        verdict = str(data["verdict"])
        if verdict not in (COMMIT, ABORT):
            raise ValueError(f"unknown verdict {verdict!r}")
        return cls(
            verdict, str(data.get("reason", "")), int(data.get("exit_code", 0)), str(data.get("by", ""))
        )


def _describe(results: list[NodeResult]) -> str:
    return ", ".join(f"node {r.index} ({r.node})" for r in results)


def decide(
    results: Mapping[int, NodeResult], expected: int, timed_out: bool, timeout: float = 0.0
) -> Decision | None:
    """The verdict these results call for, or None while it is still open.

    Any failure aborts at once (no point waiting for the rest); every node ok
    commits; a node still silent when time is up aborts with TIMEOUT. The exit
    code of a failure verdict is that of the lowest-numbered failed node.
    """
    failed = sorted((r for r in results.values() if not r.ok), key=lambda r: r.index)
    if failed:
        first = failed[0]
        return Decision(
            ABORT,
            f"{_describe(failed)} failed: {first.message or 'no message'}",
            first.exit_code or int(ExitCode.FAILURE),
        )
    if all(i in results for i in range(expected)):
        return Decision(COMMIT, f"all {expected} node(s) succeeded", int(ExitCode.OK))
    if timed_out:
        missing = [i for i in range(expected) if i not in results]
        return Decision(
            ABORT,
            f"node(s) {', '.join(map(str, missing))} of {expected} did not report within {timeout:g}s",
            int(ExitCode.TIMEOUT),
        )
    return None


def _write_new(directory: Path, name: str, document: Mapping[str, Any]) -> bool:
    """Publish ``name`` with ``document`` only if the name is free; False if it was taken.

    The content is written and synced under a private temporary name first, then
    linked: a reader never sees a half-written file, and of two writers racing
    for the same name exactly one wins.
    """
    tmp = directory / f".{name}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(document, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, directory / name)
        except FileExistsError:
            return False
        return True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, OSError):
        return None
    with os.fdopen(fd, "rb") as f:
        raw = f.read(_LIMIT)
    try:
        document = json.loads(raw)
    except ValueError:
        return None
    return document if isinstance(document, dict) else None


class Barrier:
    """A shared directory where the nodes of one operation post results and settle one verdict."""

    def __init__(
        self,
        directory: Path,
        expected: int,
        index: int,
        node: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        pause: Callable[[float], None] = time.sleep,
        poll: float = 0.2,
        appear_timeout: float = 0.0,
    ) -> None:
        self.directory = Path(directory)
        self.expected = expected
        self.index = index
        self.node = node
        self.clock = clock
        self.pause = pause
        self.poll = poll
        self.appear_timeout = appear_timeout
        # A result file is complete when it appears (linked) and never changes: parse each once,
        # not on every poll of wait() (a file system every node shares is slow to read).
        self._parsed: dict[str, NodeResult] = {}

    def check(self) -> None:
        """Refuse what cannot work before anything is touched: a missing, used or foreign barrier."""
        if self.expected < 1:
            raise UsageError(f"--nodes must be at least 1, not {self.expected}")
        if not 0 <= self.index < self.expected:
            raise UsageError(
                f"node index {self.index} is outside 0..{self.expected - 1}",
                hint="run one task per node (srun --ntasks-per-node=1) with --nodes equal to the node count",
            )
        appear_by = self.clock() + self.appear_timeout
        while not self.directory.is_dir() and self.clock() < appear_by:
            self.pause(self.poll)  # made on another node a moment ago: a network file system may lag
        if not self.directory.is_dir():
            raise UsageError(
                f"--barrier {self.directory} is not a directory",
                hint="create a fresh directory on a file system every node shares "
                "(scripts/slurm/hibernate-job does this) and pass the same path to every node",
            )
        standing = self.decision()
        reused = standing.verdict == COMMIT if standing is not None else (self.directory / DECISION).exists()
        if reused:
            raise UsageError(
                f"--barrier {self.directory} was already used (it holds a decision)",
                hint="use a fresh directory for every operation",
            )
        if any((self.directory / f"node{self.index}.{kind}").exists() for kind in ("ok", "failed")):
            raise UsageError(
                f"node index {self.index} already reported in {self.directory}",
                hint=ONE_TASK_PER_NODE,
            )

    def post(self, result: NodeResult) -> None:
        name = f"node{result.index}.{'ok' if result.ok else 'failed'}"
        other = f"node{result.index}.{'failed' if result.ok else 'ok'}"
        if (self.directory / other).exists() or not _write_new(self.directory, name, result.to_wire()):
            raise UsageError(
                f"node index {result.index} already reported in {self.directory}",
                hint=ONE_TASK_PER_NODE,
            )

    def results(self) -> dict[int, NodeResult]:
        found: dict[int, NodeResult] = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return found
        for name in names:
            result = self._parsed.get(name) or self._parse_result(name)
            if result is not None:
                self._parsed[name] = result
                found[result.index] = result
        return found

    def _parse_result(self, name: str) -> NodeResult | None:
        match = _RESULT_RE.match(name)
        if not match:
            return None
        document = _read_json(self.directory / name)
        if document is None:
            return None
        try:
            result = NodeResult.from_wire(document)
        except (KeyError, TypeError, ValueError):
            return None
        if result.index == int(match.group(1)) and result.ok == (match.group(2) == "ok"):
            return result
        return None

    def decision(self) -> Decision | None:
        document = _read_json(self.directory / DECISION)
        if document is None:
            return None
        try:
            return Decision.from_wire(document)
        except (KeyError, TypeError, ValueError):
            return None

    def settle(self, proposal: Decision) -> Decision:
        """Publish ``proposal`` unless a verdict already stands; return the verdict that stands."""
        signed = Decision(proposal.verdict, proposal.reason, proposal.exit_code, proposal.by or self.node)
        if _write_new(self.directory, DECISION, signed.to_wire()):
            return signed
        for _ in range(50):  # another node linked it a moment ago: it is complete, read it
            standing = self.decision()
            if standing is not None:
                return standing
            self.pause(0.05)
        raise UsageError(f"{self.directory / DECISION} exists but cannot be read as a decision")

    def wait(self, deadline: float, timeout: float) -> Decision:
        """Wait until a verdict stands (settling one when the results call for it)."""
        while True:
            standing = self.decision()
            if standing is not None:
                return standing
            proposal = decide(self.results(), self.expected, self.clock() >= deadline, timeout)
            if proposal is not None:
                return self.settle(proposal)
            self.pause(self.poll)


@dataclass
class StepOutcome:
    """One node's part of a job-wide operation, as the CLI reports it."""

    operation: str
    result: NodeResult
    decision: Decision
    results: list[NodeResult]
    report: dict[str, Any] | None = None
    undo: dict[str, Any] | None = None
    selection: dict[str, Any] | None = None
    error: HibernateError | None = None

    def to_wire(self, barrier: Barrier) -> dict[str, Any]:
        return {
            "ok": self.error is None,
            "operation": self.operation,
            "node": barrier.node,
            "node_index": barrier.index,
            "nodes": barrier.expected,
            "barrier": str(barrier.directory),
            "decision": self.decision.to_wire(),
            "results": [r.to_wire() for r in self.results],
            "selection": self.selection,
            "report": self.report,
            "undo": self.undo,
        }


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node as Slurm names it ($SLURMD_NODENAME), else the host name."""
    env = os.environ if environ is None else environ
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def env_int(names: tuple[str, ...], what: str, environ: Mapping[str, str] | None = None) -> int:
    """The first of ``names`` set in the environment, as an int; a UsageError naming the option if none."""
    env = os.environ if environ is None else environ
    for name in names:
        value = env.get(name, "").strip()
        if value:
            try:
                return int(value)
            except ValueError:
                raise UsageError(f"${name} is {value!r}, not a number") from None
    raise UsageError(
        f"{what} is not known here (none of ${', $'.join(names)} is set)",
        hint="run under srun (scripts/slurm/hibernate-job does), or pass it explicitly",
    )


def _no_progress() -> AbstractContextManager[orchestrator.ProgressSink]:
    return contextlib.nullcontext(orchestrator.ProgressSink())


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt while this lasts, restoring the previous handler after.

    srun passes a cancel (scancel, a time limit) on to its tasks as SIGTERM; as an interrupt,
    run_step posts it as this node's failure, settles an abort and undoes this node's sleep.
    """

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def node_step(
    operation: str,
    barrier: Path,
    *,
    options: Callable[[], orchestrator.Options],
    pids: list[int] | None = None,
    every: bool = False,
    job: str | None = None,
    cgroup: str | None = None,
    to: Path | None = None,
    nodes: int | None = None,
    node_index: int | None = None,
    node: str | None = None,
    barrier_timeout: float = 600.0,
    allow_empty: bool = False,
    progress: Callable[[], AbstractContextManager[orchestrator.ProgressSink]] = _no_progress,
) -> tuple[dict[str, Any], HibernateError | None]:
    """``hibernate node-step``: this node's part of a job-wide sleep or wake, start to verdict.

    Checks the request first (operation, ``--to`` for a sleep, this node's name, count and index,
    those two from srun's environment when not given), then selects this node's targets (``pids``
    and the selectors, as ``targets.select``), acts on them and follows the barrier's verdict
    (run_step). Returns the node-step document and, when the nodes agreed to abort, the error
    whose exit code every node exits with: the caller prints the whole picture before exiting.

    ``options`` is called once the node's place is known to be valid, so bad node arguments are
    refused before bad I/O or CUDA flags, as the command always did. ``progress`` makes the sink
    (entered around the local sleep or wake). ``barrier_timeout`` counts from this call: after it,
    silent nodes count as failed.
    """
    started = time.monotonic()
    if operation not in OPERATIONS:
        raise UsageError(f"the operation must be sleep or wake, not {operation!r}")
    if operation == "sleep" and to is None:
        raise UsageError("node-step sleep needs --to DIR")
    name = node or node_name()
    if "/" in name or not name.strip("."):
        raise UsageError(f"--node-name {name!r} cannot name a file")
    count = nodes if nodes is not None else env_int(("SLURM_STEP_NUM_NODES", "SLURM_NNODES"), "--nodes")
    index = node_index if node_index is not None else env_int(("SLURM_NODEID",), "--node-index")
    gate = Barrier(barrier, count, index, name, appear_timeout=min(barrier_timeout, 30.0))
    settings = options()
    chosen: list[int] = []

    def act() -> tuple[dict[str, Any], dict[str, Any] | None]:
        selection = targets.select(pids, every=every, job=job, cgroup=cgroup, sleeping=operation == "sleep")
        chosen.extend(selection.pids)
        wire = selection.to_wire()
        with progress() as sink:
            if operation == "sleep":
                assert to is not None
                return orchestrator.sleep(selection.pids, to / name, settings, sink).to_wire(), wire
            return orchestrator.wake(selection.pids, settings, sink).to_wire(), wire

    def undo() -> dict[str, Any]:
        return orchestrator.wake(chosen, settings).to_wire()

    with _sigterm_interrupts():
        outcome = run_step(
            operation,
            gate,
            act,
            undo,
            deadline=started + barrier_timeout,
            timeout=barrier_timeout,
            allow_empty=allow_empty,
        )
    return outcome.to_wire(gate), outcome.error


def _summary(report: Mapping[str, Any] | None) -> dict[str, Any]:
    if not report:
        return {}
    return {
        "pids": [p["pid"] for p in report.get("processes", [])],
        "seconds": report.get("seconds"),
    }


def run_step(
    operation: str,
    barrier: Barrier,
    act: Callable[[], tuple[dict[str, Any], dict[str, Any] | None]],
    undo: Callable[[], dict[str, Any]],
    *,
    deadline: float,
    timeout: float,
    allow_empty: bool = False,
) -> StepOutcome:
    """This node's sleep or wake, its result posted, the verdict awaited and followed.

    ``act`` does the local operation and returns (report, selection); ``undo``
    wakes this node's processes again after an aborted sleep. Raises nothing
    for an abort: the outcome carries the error, so the CLI can print the whole
    picture (every node's result, the verdict) before exiting with its code.
    A KeyboardInterrupt (SIGINT, or SIGTERM from the launcher) is posted as a
    failure, settles an abort, undoes this node's sleep and is re-raised.
    """
    if operation not in OPERATIONS:
        raise UsageError(f"the operation must be sleep or wake, not {operation!r}")
    barrier.check()
    report: dict[str, Any] | None = None
    selection: dict[str, Any] | None = None
    local_error: HibernateError | None = None
    interrupted = False
    standing = barrier.decision()
    if standing is not None:  # the others gave up before this node started (an abort: check() said so)
        result = NodeResult(barrier.index, barrier.node, False, standing.exit_code, "started after the abort")
        with contextlib.suppress(UsageError):
            barrier.post(result)
        outcome = StepOutcome(operation, result, standing, _ordered(barrier.results()))
        outcome.error = _abort_error(operation, barrier, standing, None, False)
        return outcome
    try:
        report, selection = act()
        result = NodeResult(barrier.index, barrier.node, True, detail=_summary(report))
    except NothingToHibernateError as exc:
        if not allow_empty:
            local_error = exc
            result = _failed(barrier, exc)
        else:
            result = NodeResult(
                barrier.index, barrier.node, True, message=exc.message, detail={"empty": True}
            )
    except WrongStateError as exc:
        if operation == "wake":  # nothing asleep here: this node already is where a wake leads
            result = NodeResult(
                barrier.index, barrier.node, True, message=exc.message, detail={"already_awake": True}
            )
        else:
            local_error = exc
            result = _failed(barrier, exc)
    except HibernateError as exc:
        local_error = exc
        result = _failed(barrier, exc)
    except KeyboardInterrupt:
        interrupted = True
        result = NodeResult(barrier.index, barrier.node, False, int(ExitCode.FAILURE), "interrupted")
    slept = operation == "sleep" and report is not None
    try:
        barrier.post(result)
    except UsageError:
        if slept:  # another task took this node's place meanwhile: leave this node as it was
            undo()
        raise
    try:
        decision = barrier.settle(_interrupted(barrier)) if interrupted else barrier.wait(deadline, timeout)
    except KeyboardInterrupt:
        interrupted = True
        decision = barrier.settle(_interrupted(barrier))
    outcome = StepOutcome(operation, result, decision, _ordered(barrier.results()), report, None, selection)
    if decision.verdict == COMMIT:
        return outcome
    if slept:
        try:
            outcome.undo = undo()
        except HibernateError as exc:
            outcome.error = NeedsRecoveryError(
                f"node {barrier.index} ({barrier.node}): the job's nodes agreed to abort "
                f"({decision.reason}), and waking this node's processes again failed: {exc.message}",
                hint="fix the cause, then run the wake again (scripts/slurm/hibernate-job wake, or "
                "`hibernate wake` with the same selection on this node)",
            )
            return outcome
    if interrupted:
        raise KeyboardInterrupt
    outcome.error = _abort_error(operation, barrier, decision, local_error, slept)
    return outcome


def _failed(barrier: Barrier, exc: HibernateError) -> NodeResult:
    return NodeResult(barrier.index, barrier.node, False, int(exc.exit_code), exc.message)


def _interrupted(barrier: Barrier) -> Decision:
    return Decision(ABORT, f"node {barrier.index} ({barrier.node}) was interrupted", int(ExitCode.FAILURE))


def _ordered(results: Mapping[int, NodeResult]) -> list[NodeResult]:
    return [results[i] for i in sorted(results)]


def _abort_error(
    operation: str, barrier: Barrier, decision: Decision, local: HibernateError | None, slept: bool
) -> NodeStepError:
    here = f"node {barrier.index} ({barrier.node})"
    if local is not None:
        message = f"{here}: {local.message}; the job's nodes agreed to abort: {decision.reason}"
    else:
        if operation == "wake":
            what = "this node's own wake succeeded"
        elif slept:
            what = "this node's processes were woken again"
        else:
            what = "nothing was put to sleep on this node"
        message = f"{here}: the job's nodes agreed to abort ({decision.reason}); {what}"
    try:
        code = ExitCode(decision.exit_code)
    except ValueError:
        code = ExitCode.FAILURE
    hint = local.hint if local is not None and local.hint else "see the failing node's own message above"
    return NodeStepError(message, exit_code=code, hint=hint)
