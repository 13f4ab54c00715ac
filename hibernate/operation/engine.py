"""Sleep, wake, recover and status over any set of targets, as one unit.

    sleep: lock, connect (everyone) -> every unit's memory steps -> cuda-lock, cuda (one CUDA stage)
    wake:  lock, connect (everyone) -> cuda-restore, cuda (one CUDA stage) -> every unit's wake steps

The targets are grouped into units by the kind their agents name (a flow
registered for each kind); any mix of kinds moves together, and a failure
anywhere undoes everything, in reverse.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.agent.paths import runtime_dir
from hibernate.agent.wire import AgentState
from hibernate.checkpoint.base import StillRunningError
from hibernate.checkpoint.group import SLEEP_RECOVERY, WAKE_RECOVERY
from hibernate.errors import BusyError, HibernateError, StorageError, UsageError, WrongStateError
from hibernate.fsutil import ensure_private_dir, open_private_dir
from hibernate.operation import cuda as cuda_stage
from hibernate.operation import registry
from hibernate.operation.cuda import CudaStage
from hibernate.operation.ledger import Ledger, interrupted_operation, sweep_dead
from hibernate.operation.options import Options
from hibernate.operation.progress import ProgressSink
from hibernate.operation.recovery import Action, UnitRecord, decide
from hibernate.operation.reports import RecoverReport, SleepReport, UnitReport, WakeReport
from hibernate.operation.steps import Step, fault_points, run_steps
from hibernate.operation.targets import AgentRef, Target, all_agents, remember_elsewhere, resolve
from hibernate.operation.unit import Context, Unit, already_asleep, refuse_unsettled, skipped_entry

# A --to DIR root creates for the agents of several users: each makes its own 0700 directory in it.
SHARED_DIR_MODE = 0o1777


# -- planning ------------------------------------------------------------------------------


def _check_kind_options(options: Options, kinds: set[str], targets: Sequence[Target]) -> None:
    """Options of a kind of target given for a selection with no target of that kind are refused."""
    for registration in registry.registrations():
        given = [name for name in registration.options if name in options.kind_options]
        if given and registration.kind not in kinds:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)  # vllm_url: --vllm-url
            pids = ", ".join(str(t.requested_pid) for t in targets)
            raise UsageError(
                f"{flags} apply to {registration.noun}, and process(es) {pids} are not one; "
                "nothing was changed"
            )


def plan_units(ctx: Context, targets: Sequence[Target]) -> list[Unit]:
    """The units of ``targets``: their agents grouped by kind, each kind's flow loaded and asked."""
    agents = list({a.identity: a for t in targets for a in t.agents}.values())
    by_kind: dict[str, list[AgentRef]] = {registry.PLAIN: []}
    for ref in agents:
        by_kind.setdefault(registry.kind_of(ref.status), []).append(ref)
    kinds = {kind for kind, refs in by_kind.items() if refs}
    _check_kind_options(ctx.options, kinds, targets)
    units: list[Unit] = []
    for kind, refs in by_kind.items():
        if refs:
            units.extend(registry.load(kind).plan(ctx, refs, targets))
    return units


def _processes(units: Sequence[Unit]) -> list[int]:
    return list(dict.fromkeys(p for u in units for p in u.processes))


def _pool_bytes(
    units: Sequence[Unit], state: AgentState | None = AgentState.ASLEEP
) -> dict[int, dict[str, int]]:
    """Per agent (in ``state``, any if None), its pools' bytes on each CUDA device, as its status said.

    Of asleep agents at a wake: what their pools will map back.
    """
    return {
        ref.pid: dict(ref.status.device_bytes)
        for unit in units
        for ref in unit.refs
        if (state is None or ref.status.state is state) and ref.status.device_bytes
    }


def _spilled_bytes(units: Sequence[Unit], reports: Sequence[UnitReport]) -> dict[int, dict[str, int]]:
    """Per agent, its pools' bytes on each CUDA device at a sleep: as its spill counted them, else
    (an older agent's spill, which did not) as its status said."""
    counted = _pool_bytes(units, state=None)
    for report in reports:
        for spilled in report.sleeps:
            if spilled.device_bytes:
                counted[spilled.pid] = dict(spilled.device_bytes)
    return counted


def prepare_directory(directory: Path, refs: Sequence[AgentRef]) -> Path:
    """Resolve ``--to``; create it 0700 if missing; refuse a file or an unwritable directory.

    An existing directory is used as it is (a shared scratch area may belong to
    someone else): privacy comes from the 0700 per-process directories inside.
    """
    directory = Path(directory).expanduser().absolute()
    if directory.exists() and not directory.is_dir():
        raise UsageError(f"--to {directory} is a file, not a directory")
    if not directory.exists():
        owners = {procinfo.owner_uid(ref.pid) for ref in refs}
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


# -- one operation -----------------------------------------------------------------------------


class Operation:
    """The engine's own steps (lock, connect, the CUDA stage) around the units' steps."""

    scope: Sequence[AgentRef] | None = None  # the engine's steps are journaled for everyone

    def __init__(self, ctx: Context, units: Sequence[Unit], directory: Path | None = None) -> None:
        self.ctx = ctx
        self.units = list(units)
        self.directory = directory
        # A wake that recover runs replaces the interrupted operation's entry even if it fails: recover
        # has read it, and a failed wake (nothing asleep) is how it learns nothing was left.
        self.ledger = Ledger(ctx.op, [ref for u in self.units for ref in u.refs], supersedes=ctx.recovering)
        ctx.ledger = self.ledger
        self.cuda = CudaStage(ctx.options, on_detach=self.ledger.journal_call)
        self.cuda_report: dict[str, Any] = {}

    def label(self, step: str) -> str:
        return step

    def annotate(self, step: str, error: HibernateError) -> None:
        """The engine's steps name the processes in their own errors."""

    # -- the steps ----------------------------------------------------------------

    def lock_for_sleep(self) -> None:
        """Refuse what the CUDA stage cannot do, then journal the operation (nothing changed yet)."""
        themselves = (
            [pid for u in self.units for pid in u.checkpoints_itself()] if self.cuda.pools_only else []
        )
        self.cuda.require(_processes(self.units), themselves)
        self.cuda.read_gpus_before()
        if self.directory is not None:
            self.ctx.directory = prepare_directory(self.directory, self.ledger.refs)
        self.ledger.record(self.ctx.directory, self.cuda.holders, self.cuda.checkpointer_name)

    def lock_for_wake(self) -> None:
        self.ledger.record(None, [], None)

    def connect(self) -> None:
        for unit in self.units:
            unit.connect()

    def cuda_sleep(self) -> None:
        themselves = [pid for u in self.units for pid in u.checkpoints_itself()]
        with self._recover_hint():
            self.cuda_report = self.cuda.sleep(themselves, after_lock=lambda: self.ledger.passed("cuda-lock"))

    def undo_cuda_sleep(self, error: BaseException) -> None:
        self.cuda.undo_sleep(_processes(self.units), error)

    def cuda_wake(self) -> None:
        with self._recover_hint():
            self.cuda_report = self.cuda.wake(
                _processes(self.units),
                after_restore=lambda: self.ledger.passed("cuda-restore"),
                pool_bytes=_pool_bytes(self.units),
            )

    @contextlib.contextmanager
    def _recover_hint(self) -> Iterator[None]:
        """A checkpoint or restore still running: the hint names the command for these targets."""
        try:
            yield
        except StillRunningError as exc:
            pids = " ".join(str(ref.pid) for ref in self.ledger.refs)
            recovery = SLEEP_RECOVERY if self.ctx.op == "sleep" else WAKE_RECOVERY
            exc.hint = f"`hibernate recover {pids}` waits for the call to return, then {recovery}"
            raise

    def steps(
        self,
        opening: Sequence[Step],
        of_unit: Callable[[Unit], Sequence[Step]] = lambda unit: (),
        closing: Sequence[Step] = (),
    ) -> list[tuple[Step, Any]]:
        """The engine's ``opening`` steps, then each unit's own steps in turn, then ``closing``."""
        plan: list[tuple[Step, Any]] = [(step, self) for step in opening]
        for unit in self.units:
            plan.extend((step, unit) for step in of_unit(unit))
        plan.extend((step, self) for step in closing)
        return plan

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Locks for the block; the journal concluded and every unit's connections closed at its end.

        A checkpoint or restore an earlier command left running (journaled) is
        waited for first, before anything reads a state; until then the
        journal is left as it was, whatever happens.
        """
        self.ledger.lock()
        try:
            try:
                self.ledger.await_calls(self.ctx.options.cuda_timeouts.for_step, self.ctx.sink.note)
            except BaseException:
                self.ledger.release()
                raise
            with self.ledger.concluding():
                yield
        finally:
            for unit in self.units:
                unit.close()


SLEEP_OPENING = (
    Step("lock", Operation.lock_for_sleep, shown=False),
    Step("connect", Operation.connect, shown=False),
)
SLEEP_CLOSING = (Step("cuda", Operation.cuda_sleep, undo=Operation.undo_cuda_sleep, inner=("cuda-lock",)),)
WAKE_OPENING = (
    Step("lock", Operation.lock_for_wake, shown=False),
    Step("connect", Operation.connect, shown=False),
)
WAKE_CUDA = (Step("cuda", Operation.cuda_wake, inner=("cuda-restore",)),)


def sleep_points(unit_class: type[Unit]) -> list[str]:
    """Every fault point of a sleep of one unit of ``unit_class``, in order (README, tests)."""
    return fault_points("sleep", [*SLEEP_OPENING, *unit_class.sleep_steps, *SLEEP_CLOSING])


def wake_points(unit_class: type[Unit]) -> list[str]:
    return fault_points("wake", [*WAKE_OPENING, *WAKE_CUDA, *unit_class.wake_steps])


# -- the public operations -----------------------------------------------------------------


def sleep(
    pids: Sequence[int], directory: Path, options: Options, sink: ProgressSink | None = None
) -> SleepReport:
    """Put every target to sleep as one: memory to ``directory``, then the CUDA state off the GPU."""
    sink = sink or ProgressSink()
    started = time.perf_counter()
    sink.step("connect")
    ctx = Context("sleep", options, sink)
    # The pools left uncounted: the spill enumerates them itself, and says what it spilled.
    targets = resolve(pids, all_users=options.all_users, contents=False)
    units = plan_units(ctx, targets)
    skipped: list[dict[str, Any]] = []
    if options.skip_asleep:
        for unit in units:
            skipped.extend(unit.skip_asleep())
        units = [u for u in units if u.refs]
        if not units and options.if_needed:
            return SleepReport(
                directory=str(directory.absolute()),
                seconds=time.perf_counter() - started,
                processes=[],
                cuda={"status": "none (skipped)", "processes": []},
                skipped=skipped,
            )
        if not units:
            raise WrongStateError(
                "nothing to put to sleep: "
                + "; ".join(already_asleep(s["pid"], s.get("snapshot")) for s in skipped)
            )
    for unit in units:
        unit.check()
    remember_elsewhere(ref for unit in units for ref in unit.refs)  # so status and --all see them
    operation = Operation(ctx, units, directory)
    with operation.held():
        run_steps(
            operation.steps(SLEEP_OPENING, lambda unit: unit.sleep_steps, SLEEP_CLOSING),
            operation.ledger,
            sink,
        )
    reports = [u.report() for u in units]
    return SleepReport(
        directory=str(ctx.directory) if ctx.directory else None,
        seconds=time.perf_counter() - started,
        processes=[p for r in reports for p in r.sleeps],
        cuda=operation.cuda_report,
        units=reports,
        skipped=skipped,
        gpus=operation.cuda.given_back(_processes(units), _spilled_bytes(units, reports)),
    )


def wake(pids: Sequence[int], options: Options, sink: ProgressSink | None = None) -> WakeReport:
    """Bring every target back, deciding from the real states: this also finishes or undoes
    whatever an interrupted sleep or wake left behind.

    With ``options.if_needed`` the targets found running are listed as skipped (a wake leaves them
    as they are), and a wake that finds nothing to do because every target runs ends with that
    report instead of refusing; a running one that a command is still at work on, or left
    half-way, is refused all the same (``unit.refuse_unsettled``), as a sleep's are.
    """
    try:
        return _wake(pids, options, sink or ProgressSink(), recovering=False)
    except WrongStateError:
        awake = _already_awake(pids, options) if options.if_needed else None
        if awake is None:
            raise
        return awake


def _settled_running(targets: Sequence[Target]) -> list[AgentRef]:
    """The agents of ``targets`` found running, each settled (else refused: ``refuse_unsettled``)."""
    running = [ref for target in targets for ref in target.agents if ref.status.state is AgentState.RUNNING]
    refuse_unsettled(running)
    return running


def _already_awake(pids: Sequence[int], options: Options) -> WakeReport | None:
    """``wake --if-needed`` of targets that all run already, read after the wake refused them: a wake
    that did nothing, every one skipped (None where one is not running).

    The states are read again, after the refusal, so a target another command moved meanwhile is
    judged as it is, not as it was.
    """
    refs = [ref for target in resolve(pids, all_users=options.all_users) for ref in target.agents]
    if not refs or any(ref.status.state is not AgentState.RUNNING for ref in refs):
        return None
    refuse_unsettled(refs)
    skipped = [skipped_entry(ref.pid, ref.status) for ref in refs]
    return WakeReport(0.0, [], {"status": "running (nothing to restore)", "processes": []}, skipped=skipped)


def _wake(pids: Sequence[int], options: Options, sink: ProgressSink, *, recovering: bool) -> WakeReport:
    started = time.perf_counter()
    sink.step("connect")
    ctx = Context("wake", options, sink, recovering=recovering)
    targets = resolve(pids, all_users=options.all_users)
    running = _settled_running(targets) if options.if_needed else []
    units = plan_units(ctx, targets)
    for unit in units:
        unit.check()
    operation = Operation(ctx, units)
    with operation.held():
        run_steps(operation.steps([*WAKE_OPENING, *WAKE_CUDA]), operation.ledger, sink)
        if not any(u.has_sleeping() for u in units) and not cuda_stage.changed(operation.cuda_report):
            raise WrongStateError("nothing to wake: " + "; ".join(u.describe_state() for u in units))
        run_steps(operation.steps((), lambda unit: unit.wake_steps), operation.ledger, sink)
    reports = [u.report() for u in units]
    woken = [p for r in reports for p in r.wakes]
    woken_pids = {p.pid for p in woken}
    return WakeReport(
        seconds=time.perf_counter() - started,
        processes=woken,
        cuda=operation.cuda_report,
        units=reports,
        skipped=[skipped_entry(ref.pid, ref.status) for ref in running if ref.pid not in woken_pids],
    )


def recover(pids: Sequence[int], options: Options, sink: ProgressSink | None = None) -> RecoverReport:
    """Finish or undo what an interrupted sleep or wake left, from the journal and the real states
    (the table in :mod:`hibernate.operation.recovery`)."""
    sink = sink or ProgressSink()
    ctx = Context("recover", options, sink)
    units = plan_units(ctx, resolve(pids, all_users=options.all_users))
    found = [(ref, interrupted_operation(ref)) for u in units for ref in u.refs]
    busy = [(ref, info) for ref, info in found if info and "in_progress" in info]
    if busy:
        ref, info = busy[0]
        raise BusyError(f"process {ref.pid} is busy: {info['in_progress']} is operating on it")
    if not any(info for _, info in found):
        states = ", ".join(f"{ref.pid}: {ref.status.state_word}" for u in units for ref in u.refs)
        return RecoverReport("none", message=f"nothing to recover ({states})")
    records = []
    for unit in units:
        entry: dict[str, Any] | None = next((i for ref, i in found if i and ref in unit.refs), None)
        last = unit.sleep_steps[-1].name if unit.sleep_steps else "connect"
        records.append(
            UnitRecord(
                op=entry["op"] if entry else None,
                marks=tuple(entry["phases"]) if entry else (),
                last_memory_step=last,
                asleep=unit.asleep_now(),
            )
        )
    action, op = decide(records)
    if action is Action.CLEAR:
        operation = Operation(Context("sleep", options, sink), units)
        operation.ledger.lock()
        operation.ledger.finish()  # every step had completed; only the journal was left
        return RecoverReport(action.value)
    if action is Action.FINISH_SLEEP:
        try:
            return RecoverReport("finished the interrupted sleep", _finish_sleep(units, options, sink))
        except StillRunningError:
            raise  # its checkpoint runs on: a wake now would act on a process mid-call
        except HibernateError as exc:
            sink.note(f"cannot finish the sleep ({exc.message}); waking instead")
    try:
        report = _wake(pids, options, sink, recovering=True)
    except WrongStateError:
        # Nothing was asleep or checkpointed: the operation died before changing anything, or
        # after a wake had brought everything back (its agents resume by themselves when their
        # client goes); either way the wake's bookkeeping has cleared its journal.
        return RecoverReport(f"nothing was left of the interrupted {op}: every process runs")
    return RecoverReport(
        "finished the interrupted wake" if op == "wake" else "undid the interrupted sleep", report
    )


def _finish_sleep(units: Sequence[Unit], options: Options, sink: ProgressSink) -> SleepReport:
    """The CUDA stage of a sleep whose units are all asleep already (nothing to call if every holder
    is CUDA-checkpointed: a checkpoint that outlived the sleep's command and then completed)."""
    started = time.perf_counter()
    operation = Operation(Context("sleep", options, sink), units)
    with operation.held():
        operation.ledger.adopt()  # the interrupted sleep's entries: its marks, and the calls this adds
        done = operation.cuda.checkpointed_already(_processes(units))
        if done is not None:  # its checkpoint outlived the command, then completed: the sleep is whole
            operation.cuda_report = done
            operation.ledger.passed("cuda")
        else:
            operation.cuda.require(_processes(units))  # refuses holders that are not all running
            run_steps(operation.steps(SLEEP_CLOSING), operation.ledger, sink)
    return SleepReport(None, time.perf_counter() - started, [], operation.cuda_report)


def status(pids: Sequence[int] | None, *, all_users: bool = False) -> list[dict[str, Any]]:
    """Status of the agents of ``pids`` (all of ours when None), with any interrupted operation."""
    refs = [a for t in resolve(pids, all_users=all_users) for a in t.agents] if pids else all_agents()
    out = []
    for ref in refs:
        entry = dict(ref.answer)
        entry["rss"] = procinfo.resident_bytes(ref.pid)
        entry["command"] = procinfo.command_line(ref.pid)[:200]
        entry["interrupted"] = interrupted_operation(ref)
        out.append(entry)
    for directory in {runtime_dir(), *(ref.socket.parent for ref in refs)}:
        sweep_dead(directory)
    return out
