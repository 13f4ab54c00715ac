"""The per-node half of a job-wide sleep or wake: act on this node, post, follow the verdict.

See :mod:`hibernate.sched.barrier` for how the nodes agree.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hibernate import orchestrator
from hibernate.errors import (
    ExitCode,
    HibernateError,
    NeedsRecoveryError,
    NothingToHibernateError,
    UsageError,
    WrongStateError,
)
from hibernate.sched import selectors, slurm
from hibernate.sched.barrier import ABORT, COMMIT, Barrier, Decision, NodeResult

OPERATIONS = ("sleep", "wake")


class NodeStepError(HibernateError):
    """The job's nodes agreed on abort; the exit code is the verdict's, the same on every node."""

    wire_name = "node-step"

    def __init__(self, message: str, *, exit_code: ExitCode, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.exit_code = exit_code


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
    and the selectors, as ``selectors.select``), acts on them and follows the barrier's verdict
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
    name = node or slurm.node_name()
    if "/" in name or not name.strip("."):
        raise UsageError(f"--node-name {name!r} cannot name a file")
    count = nodes if nodes is not None else env_int(slurm.NODE_COUNT_ENV, "--nodes")
    index = node_index if node_index is not None else env_int(slurm.NODE_INDEX_ENV, "--node-index")
    gate = Barrier(barrier, count, index, name, appear_timeout=min(barrier_timeout, 30.0))
    settings = options()
    chosen: list[int] = []

    def act() -> tuple[dict[str, Any], dict[str, Any] | None]:
        selection = selectors.select(pids, every=every, job=job, cgroup=cgroup, sleeping=operation == "sleep")
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
