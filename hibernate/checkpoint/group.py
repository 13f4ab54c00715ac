"""One checkpoint of a group of processes: every CUDA holder of every target, done and undone together.

    sleep: lock ALL (each with a timeout) -> checkpoint ALL
    wake:  check free GPU memory -> restore ALL -> unlock ALL

Every process is locked before any is checkpointed, so no process is copied
out while another of the same job still runs kernels against it. Each step
runs on all processes at once and waits for all; a failure anywhere is then
undone from the processes' *real* states, read back from the driver, not from
what hibernate believes it did:

- sleep: restore every checkpointed process, unlock every locked one, so the
  whole target runs again; the error names the process and step that failed.
- wake: a restore that fails puts the processes already restored back to
  sleep (checkpoint again), so the target stays asleep as a whole and the
  wake can be retried; an unlock that fails leaves the others running.

Wake decides from the states it reads, so it also finishes an interrupted
sleep or wake (some processes checkpointed, some locked, some running).

A checkpoint or restore that outlives its timeout is never cut (it runs in a
process of its own, :mod:`hibernate.checkpoint.detached`): the group then
stops, does nothing more to any process (an undo would act on a process
mid-call), and raises :class:`StillRunningError`, which keeps the journal for
``hibernate recover``.

Before a restore, each GPU's free memory must hold what comes back: the CUDA
state (the drop of ``used`` the sleep measured, or what NVML saw each process
hold) plus the pools the wake maps back (:mod:`hibernate.checkpoint.room`).
A shortfall refuses the wake and the target stays asleep; so does a need that
cannot be known (NVML unreadable, a process nothing measured), unless forced.

The intricate parts are pure functions with their own tests:
:func:`recovery_plan`, :func:`memory_shortfalls` and :func:`classify`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from hibernate.checkpoint import curesult, records, room
from hibernate.checkpoint.base import (
    Checkpointer,
    CheckpointStepError,
    CudaState,
    StepTimeouts,
    StillRunningError,
)
from hibernate.checkpoint.detect import Holder
from hibernate.errors import (
    BusyError,
    CudaCheckpointError,
    HibernateError,
    HibernateTimeoutError,
    NeedsRecoveryError,
    UnsupportedError,
    WrongStateError,
)
from hibernate.threads import run_each
from hibernate.units import human_bytes

# Room left on a GPU beyond what a process held when it was checkpointed.
HEADROOM_BYTES = 64 << 20
WEDGE_HINT = (
    "a restore that runs out of GPU memory leaves the process checkpointed and the driver refuses "
    "every later restore of it (NVIDIA/cuda-checkpoint#44): only restarting it recovers"
)
NEXT_STATE = {
    "lock": CudaState.LOCKED,
    "checkpoint": CudaState.CHECKPOINTED,
    "restore": CudaState.LOCKED,
    "unlock": CudaState.RUNNING,
}


def _pids(pids: Iterable[int]) -> str:
    listed = list(pids)
    return ("process " if len(listed) == 1 else "processes ") + ", ".join(map(str, listed))


# -- pure decisions ---------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What bringing processes back to running takes, from their real states."""

    restore: tuple[int, ...] = ()  # checkpointed: restore, then unlock
    unlock: tuple[int, ...] = ()  # locked, or about to be restored: unlock
    failed: tuple[int, ...] = ()  # the driver gave up on them: only a restart recovers
    busy: tuple[int, ...] = ()  # another tool is checkpointing or restoring them
    unknown: tuple[int, ...] = ()  # the state could not be read

    @property
    def empty(self) -> bool:
        return not (self.restore or self.unlock or self.failed or self.busy or self.unknown)


def recovery_plan(states: Mapping[int, CudaState | None]) -> Plan:
    """How to bring every process of ``states`` to running, in pid order as given.

    This is both the wake and the undo of a sleep: restore what is
    checkpointed, then unlock what is locked (restored processes end locked).
    """
    restore, unlock, failed, busy, unknown = [], [], [], [], []
    for pid, state in states.items():
        if state is CudaState.CHECKPOINTED:
            restore.append(pid)
            unlock.append(pid)
        elif state is CudaState.LOCKED:
            unlock.append(pid)
        elif state is CudaState.FAILED:
            failed.append(pid)
        elif state in (CudaState.CHECKPOINTING, CudaState.RESTORING):
            busy.append(pid)
        elif state is None:
            unknown.append(pid)
    return Plan(tuple(restore), tuple(unlock), tuple(failed), tuple(busy), tuple(unknown))


@dataclass(frozen=True)
class Shortfall:
    uuid: str
    needed: int
    free: int | None  # None: the GPU is not on this machine
    pids: tuple[int, ...]

    def describe(self) -> str:
        need = f"{_pids(self.pids)} need {human_bytes(self.needed)} there"
        if self.free is None:
            return f"{self.uuid} is not on this machine; {need}"
        missing = human_bytes(self.needed - self.free)
        return f"{self.uuid} has {human_bytes(self.free)} free; {need}: {missing} missing"


def memory_shortfalls(
    needs: Mapping[int, Mapping[str, int]], free: Mapping[str, int], headroom: int = HEADROOM_BYTES
) -> list[Shortfall]:
    """GPUs whose free memory cannot take back what the given processes held there.

    ``needs``: pid -> {GPU UUID: bytes it held when checkpointed}; ``free``:
    GPU UUID -> free bytes now. Each process needs ``headroom`` beyond its
    bytes on each GPU it used.
    """
    total: dict[str, int] = {}
    who: dict[str, list[int]] = {}
    for pid, usage in needs.items():
        for uuid, nbytes in usage.items():
            total[uuid] = total.get(uuid, 0) + int(nbytes) + headroom
            who.setdefault(uuid, []).append(pid)
    return [
        Shortfall(uuid, needed, free.get(uuid), tuple(who[uuid]))
        for uuid, needed in total.items()
        if uuid not in free or free[uuid] < needed
    ]


def room_check(needs: room.Needs, unknown: Sequence[int], reading: Any) -> dict[str, Any]:
    """``needs`` (pid -> GPU UUID -> bytes) against each GPU's free memory in ``reading`` (None: no NVML)."""
    unknown = list(dict.fromkeys(unknown))
    needed = {pid: usage for pid, usage in needs.items() if usage}
    if reading is None:
        return {
            "checked": False,
            "reason": "NVML is not available",
            "needed": needed,
            "shortfalls": [],
            "unknown": unknown,
        }
    free = {gpu.uuid: gpu.free for gpu in reading.gpus}
    return {
        "checked": True,
        "free": free,
        "needed": needed,
        "unknown": unknown,
        "shortfalls": [s.describe() for s in memory_shortfalls(needed, free)],
    }


def refuse_without_room(memory: Mapping[str, Any], force: bool) -> None:
    """Refuse a wake, before anything changes, that would not fit or whose fit nobody can tell (unforced)."""
    if memory["shortfalls"]:
        raise UnsupportedError(
            "not enough free GPU memory to restore: "
            + "; ".join(memory["shortfalls"])
            + "; nothing was changed, the target stays asleep",
            hint="free GPU memory (see nvidia-smi), then run `hibernate wake` again; " + WEDGE_HINT,
        )
    if force:
        return
    if not memory["checked"]:
        why = "NVML (libnvidia-ml.so.1) cannot be loaded or started, so no GPU's free memory can be read"
    elif memory["unknown"]:
        why = (
            f"nothing measured what {_pids(memory['unknown'])} will need on the GPU (NVML did not list "
            "the pid at sleep, and the GPUs' used memory did not drop at its checkpoint), or a pool's "
            "device could not be placed on a GPU"
        )
    else:
        return
    raise UnsupportedError(
        f"cannot tell whether the GPUs have room for the wake: {why}; nothing was changed, "
        "the target stays asleep",
        hint="pass --force to restore anyway (at your own risk: " + WEDGE_HINT + ")",
    )


def _used(reading: Any) -> dict[str, int]:
    return {gpu.uuid: gpu.used for gpu in reading.gpus} if reading is not None else {}


def classify(error: CheckpointStepError, suffix: str = "") -> HibernateError:
    """The error to show for a failed step: its exit code, and a hint that says what to do."""
    code = error.error.code
    message = error.message + suffix
    if error.timed_out:
        return HibernateTimeoutError(
            message, hint="the driver did not answer in time; `hibernate doctor PID` shows its state"
        )
    if error.step == "lock" and code in (curesult.CUDA_ERROR_NOT_READY, curesult.CUDA_ERROR_TIMEOUT):
        return HibernateTimeoutError(
            f"{error.message} (its CUDA work did not finish within the lock timeout){suffix}",
            hint="let running kernels finish (raise --timeout), or look for a hung NCCL collective",
        )
    if error.step == "restore" and code in (
        curesult.CUDA_ERROR_OUT_OF_MEMORY,
        curesult.CUDA_ERROR_OPERATING_SYSTEM,
    ):
        return NeedsRecoveryError(message, hint=WEDGE_HINT)
    if code == curesult.CUDA_ERROR_OPERATING_SYSTEM:
        return CudaCheckpointError(
            message,
            hint="often CUDA IPC or NCCL peer memory shared between processes; `hibernate doctor PID` "
            "lists the NCCL settings that avoid it",
        )
    if code == curesult.CUDA_ERROR_NOT_SUPPORTED:
        return UnsupportedError(
            message,
            hint="the driver cannot checkpoint this process (UVM/managed memory, CUDA IPC, MIG or MPS?); "
            "see `hibernate doctor PID`",
        )
    if code == curesult.CUDA_ERROR_NOT_PERMITTED:
        return CudaCheckpointError(
            message,
            hint="run hibernate as root (or the process's user) and enable persistence mode: "
            "nvidia-smi -pm 1",
        )
    if code == curesult.CUDA_ERROR_ILLEGAL_STATE:
        return CudaCheckpointError(
            message, hint="another tool may be operating on it; `hibernate doctor PID` shows its state"
        )
    return CudaCheckpointError(
        message, hint=error.hint or "`hibernate doctor PID` checks what the driver needs for this process"
    )


SLEEP_RECOVERY = "completes the sleep if every checkpoint succeeded, or else wakes the processes"
WAKE_RECOVERY = "finishes the wake from the state the call left"


def stop_if_running(errors: Sequence[CheckpointStepError], done: Sequence[int], recovery: str) -> None:
    """Raise StillRunningError if a call among ``errors`` runs on: nothing may act on the group now.

    ``recovery`` says what ``hibernate recover`` will do once the call has returned.
    """
    running = [error for error in errors if error.running is not None]
    if not running:
        return
    pids = [error.pid for error in running]
    others = [e.message for e in errors if e.running is None]
    also = f"; also {'; '.join(others)}" if others else ""
    finished = f"; {_pids(done)} finished that step" if done else ""
    raise StillRunningError(
        "; ".join(error.message for error in running)
        + also
        + finished
        + "; nothing more was done to any process, so as not to act on one in the middle of a driver call",
        hint=f"`hibernate recover {' '.join(map(str, pids))}` waits for the call to return, then {recovery}",
    )


def check_sleepable(holders: Sequence[Holder]) -> None:
    """Refuse, before anything changes, a sleep of holders not all running."""
    by_state: dict[CudaState, list[int]] = {}
    for holder in holders:
        if holder.state is not None and holder.state is not CudaState.RUNNING:
            by_state.setdefault(holder.state, []).append(holder.pid)
    if CudaState.FAILED in by_state:
        pids = by_state[CudaState.FAILED]
        raise CudaCheckpointError(
            f"{_pids(pids)} {'is' if len(pids) == 1 else 'are'} in the driver's failed state; "
            "nothing was changed",
            hint="a process in the failed state cannot be checkpointed or restored: restart it",
        )
    busy = by_state.get(CudaState.CHECKPOINTING, []) + by_state.get(CudaState.RESTORING, [])
    if busy:
        raise _busy(busy)
    stuck = by_state.get(CudaState.LOCKED, []) + by_state.get(CudaState.CHECKPOINTED, [])
    if stuck:
        described = "; ".join(f"process {pid} is CUDA-{_state_of(holders, pid)}" for pid in stuck)
        raise WrongStateError(
            f"{described} (an interrupted hibernate operation, or another tool); nothing was changed",
            hint=f"bring it back first: hibernate wake {' '.join(map(str, stuck))}",
        )


def _busy(pids: Sequence[int]) -> BusyError:
    """Refusal of a sleep or wake of processes another tool is checkpointing or restoring."""
    return BusyError(
        f"{_pids(pids)}: another tool is checkpointing or restoring its CUDA state; nothing was changed",
        hint="wait for it to finish, then retry",
    )


def _state_of(holders: Sequence[Holder], pid: int) -> str:
    return next(str(h.state.value) for h in holders if h.pid == pid and h.state is not None)


# -- the group checkpoint ----------------------------------------------------


@dataclass
class _Tracked:
    holder: Holder
    state: CudaState | None
    steps: dict[str, float] = field(default_factory=dict)
    gpus: dict[str, int] | None = None

    @property
    def pid(self) -> int:
        return self.holder.pid

    def to_wire(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "state": self.state.value if self.state is not None else "unknown",
            "seconds": round(sum(self.steps.values()), 6),
            "steps": {step: round(seconds, 6) for step, seconds in self.steps.items()},
            "evidence": self.holder.evidence,
            "gpus": self.gpus,
        }


class GroupCheckpoint:
    """A group's checkpoint or restore with one checkpointer; GPU readings and records are seams."""

    def __init__(
        self,
        checkpointer: Checkpointer,
        timeouts: StepTimeouts | None = None,
        gpus: Callable[[], Any] | None = None,
        remember: bool = True,
        after_step: Callable[[str], None] | None = None,
        *,
        force: bool = False,
        gpu_map: Mapping[str, str] | None = None,
        pools: tuple[room.Needs, list[int]] = ({}, []),
    ) -> None:
        """``after_step(step)`` runs once a step has succeeded on every process (lock, checkpoint,
        restore, unlock): where a journal marks progress or a test injects a fault. If it raises
        during a sleep, the sleep is undone like any other failure.

        ``force`` lets a wake go on when nothing can tell whether the GPUs have room; ``gpu_map``
        (old GPU UUID -> new) restores onto other GPUs; ``pools`` is what the wake's pools will map
        back per process and GPU, and the processes whose pools cannot be placed on a GPU.
        """
        from hibernate.checkpoint import nvml

        self.checkpointer = checkpointer
        self.timeouts = timeouts or StepTimeouts()
        self.read_gpus = gpus or nvml.read_gpus
        self.remember = remember
        self.after_step = after_step or (lambda step: None)
        self.force = force
        self.gpu_map = dict(gpu_map) if gpu_map else None
        self.pools = pools
        self.drop: dict[str, int] | None = None  # per GPU, what the sleep's checkpoint gave back
        self._used_before: dict[str, int] = {}  # per GPU, used memory before the lock
        self._unreadable: dict[int, str] = {}  # why a process's state could not be read

    # -- steps ---------------------------------------------------------------

    def _run(
        self, step: str, tracked: Mapping[int, _Tracked], pids: Sequence[int]
    ) -> tuple[list[int], list[CheckpointStepError]]:
        """Run ``step`` on ``pids`` at once; (pids that succeeded, errors in pid order)."""
        action: Callable[[int], object] = {
            "lock": lambda pid: self.checkpointer.lock(pid, int(self.timeouts.lock * 1000)),
            "checkpoint": self.checkpointer.checkpoint,
            "restore": lambda pid: self.checkpointer.restore(pid, self.gpu_map),
            "unlock": self.checkpointer.unlock,
        }[step]
        outcomes = dict(zip(pids, run_each(pids, action), strict=True))
        done, errors = [], []
        for pid in pids:
            outcome = outcomes[pid]
            if outcome.error is None:
                tracked[pid].steps[step] = tracked[pid].steps.get(step, 0.0) + outcome.seconds
                tracked[pid].state = NEXT_STATE[step]
                done.append(pid)
            elif isinstance(outcome.error, CheckpointStepError):
                errors.append(outcome.error)
            else:
                raise outcome.error
        return done, errors

    def _read_states(self, tracked: Mapping[int, _Tracked]) -> dict[int, CudaState | None]:
        """Each process's state as the driver tells it now (None where it cannot)."""
        outcomes = dict(zip(tracked, run_each(list(tracked), self.checkpointer.state), strict=True))
        states: dict[int, CudaState | None] = {}
        for pid, outcome in outcomes.items():
            states[pid] = outcome.value if outcome.error is None else None
            if outcome.error is None:
                tracked[pid].state = outcome.value
            else:
                self._unreadable[pid] = str(getattr(outcome.error, "message", outcome.error))
        return states

    def _read_gpus_now(self) -> Any:
        """The GPUs now, or None: a broken NVML must not stop a sleep or wake, it only informs them."""
        try:
            return self.read_gpus()
        except Exception:
            return None

    def _usage(self, reading: Any, pids: Sequence[int]) -> dict[int, dict[str, int] | None]:
        if reading is None:
            return {pid: None for pid in pids}
        # A CUDA process holds at least its context: nothing listed means NVML cannot see it (another
        # pid namespace), not that it needs nothing.
        return {pid: reading.usage_of(pid) or None for pid in pids}

    def _report(
        self, status: str, tracked: Mapping[int, _Tracked], started: float, **extra: Any
    ) -> dict[str, Any]:
        return {
            "status": status,
            "checkpointer": self.checkpointer.describe(),
            "seconds": round(time.perf_counter() - started, 6),
            "processes": [t.to_wire() for t in tracked.values()],
            **extra,
        }

    # -- sleep ---------------------------------------------------------------

    def sleep(self, holders: Sequence[Holder]) -> dict[str, Any]:
        """Lock every holder, then checkpoint every holder; on failure undo and raise."""
        started = time.perf_counter()
        tracked = {h.pid: _Tracked(h, h.state) for h in holders}
        before = self._read_gpus_now()
        self._used_before = _used(before)
        usage = self._usage(before, list(tracked))
        for pid, entry in tracked.items():
            entry.gpus = usage[pid]
        errors: list[CheckpointStepError] = []
        try:
            for step in ("lock", "checkpoint"):
                done, errors = self._run(step, tracked, list(tracked))
                running = [error.pid for error in errors if error.running is not None]
                if running:  # what ends checkpointed is woken later: its wake checks memory by these records
                    self._remember(tracked, [*done, *running])
                stop_if_running(errors, done, SLEEP_RECOVERY)
                if errors:
                    break
                self.after_step(step)
        except StillRunningError:
            raise  # no undo over a call still running
        except BaseException as exc:  # interrupted (Ctrl-C) or broken: put the processes back first
            self._undo_sleep(tracked, [], cause=exc)
        if errors:
            self._undo_sleep(tracked, errors)
        self._remember(tracked, list(tracked))
        self._read_states(tracked)
        return self._report("checkpointed", tracked, started, drop=self.drop)

    def _waited(self) -> str:
        """What the undo's calls waited for first: a timed-out call still running for the same process."""
        waits = self.checkpointer.waits()
        return f" ({'; '.join(waits)})" if waits else ""

    def _remember(self, tracked: Mapping[int, _Tracked], pids: Sequence[int]) -> None:
        """Measure what the checkpoint gave back per GPU, and keep it, per process, for the wake's check."""
        self.drop = room.device_drop(self._used_before, _used(self._read_gpus_now()))
        if self.remember:
            for pid in pids:
                entry = tracked[pid]
                records.save(
                    entry.holder.identity,
                    entry.gpus,
                    self.checkpointer.name,
                    drop=self.drop,
                    cohort=list(pids),
                )

    def _undo_sleep(
        self,
        tracked: Mapping[int, _Tracked],
        errors: Sequence[CheckpointStepError],
        cause: BaseException | None = None,
    ) -> NoReturn:
        """Bring every holder back to running, then raise the first failure (or what stopped undo)."""
        first = errors[0] if errors else None
        what = first.message if first is not None else f"interrupted ({type(cause).__name__})"
        states = self._read_states(tracked)
        plan = recovery_plan(states)
        problems = [f"{_pids(plan.failed)} ended in the driver's failed state"] if plan.failed else []
        if plan.busy:
            problems.append(f"{_pids(plan.busy)} are being checkpointed or restored by another tool")
        if plan.unknown:
            why = "; ".join(self._unreadable[pid] for pid in plan.unknown if pid in self._unreadable)
            problems.append(
                f"the state of {_pids(plan.unknown)} could not be read" + (f" ({why})" if why else "")
            )
        restored, restore_errors = self._restore(tracked, plan.restore, problems)
        stay = set(plan.restore) - set(restored)  # still checkpointed: nothing to unlock
        _, unlock_errors = self._run("unlock", tracked, [pid for pid in plan.unlock if pid not in stay])
        problems += [e.message for e in (*restore_errors, *unlock_errors)]
        waited = self._waited()
        if problems:
            # What stays checkpointed waits for a later wake, whose free-memory check needs its record.
            self._remember(tracked, [pid for pid, t in tracked.items() if t.state is CudaState.CHECKPOINTED])
            raise NeedsRecoveryError(
                f"{what}; undoing it failed too: {'; '.join(problems)}{waited}",
                hint="run `hibernate wake PID` once the cause is fixed",
            ) from (first or cause)
        if first is None:
            assert cause is not None
            raise cause
        others = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise classify(first, f"{others}; undone: every CUDA process runs again{waited}") from None

    def _restore(
        self, tracked: Mapping[int, _Tracked], pids: Sequence[int], problems: list[str]
    ) -> tuple[list[int], list[CheckpointStepError]]:
        """Restore ``pids`` after checking GPU memory (a shortfall becomes a problem, not a restore)."""
        if not pids:
            return [], []
        memory = self.memory_check(tracked, pids)
        if memory["shortfalls"]:
            problems.append("not restored, " + "; ".join(memory["shortfalls"]))
            return [], []
        return self._run("restore", tracked, pids)

    # -- wake ----------------------------------------------------------------

    def memory_check(self, tracked: Mapping[int, _Tracked], pids: Sequence[int]) -> dict[str, Any]:
        """What restoring ``pids`` (and the pools after them) needs per GPU, against its free memory."""
        found: dict[int, Mapping[str, Any] | None] = {}
        for pid in pids:
            record = records.load(tracked[pid].holder.identity)
            if record is None:  # the undo of this sleep: nothing saved yet
                record = {"gpus": tracked[pid].gpus, "drop": self.drop, "cohort": list(tracked)}
            found[pid] = record
            if isinstance(record.get("gpus"), dict):
                tracked[pid].gpus = {str(k): int(v) for k, v in record["gpus"].items()}
        cuda, unknown = room.cuda_needs(found)
        pool_needs, pool_unknown = self.pools
        needs = room.remap(room.combine(cuda, pool_needs), self.gpu_map)
        return room_check(needs, [*unknown, *pool_unknown], self._read_gpus_now())

    def wake(self, holders: Sequence[Holder]) -> dict[str, Any]:
        """Restore every checkpointed holder, then unlock every locked one, from their real states."""
        started = time.perf_counter()
        tracked = {h.pid: _Tracked(h, h.state) for h in holders}
        plan = recovery_plan({pid: t.state for pid, t in tracked.items()})
        if plan.failed:
            raise NeedsRecoveryError(
                f"{_pids(plan.failed)} {'is' if len(plan.failed) == 1 else 'are'} in the driver's failed "
                "state: its CUDA state cannot be restored; nothing was changed",
                hint="only restarting the process recovers it",
            )
        if plan.busy:
            raise _busy(plan.busy)
        if plan.unknown:
            raise CudaCheckpointError(
                f"the CUDA state of {_pids(plan.unknown)} is unknown; nothing was changed"
            )
        if not plan.restore and not plan.unlock:
            return self._report("running (nothing to restore)", tracked, started)
        memory: dict[str, Any] = {"checked": False, "shortfalls": [], "unknown": []}
        if plan.restore:
            memory = self.memory_check(tracked, plan.restore)
            refuse_without_room(memory, self.force)
        restored, errors = self._run("restore", tracked, plan.restore)
        stop_if_running(errors, restored, WAKE_RECOVERY)
        if errors:
            self._rewind(tracked, restored, errors)
        if plan.restore:
            self.after_step("restore")
        _, errors = self._run("unlock", tracked, plan.unlock)
        if errors:
            running = [pid for pid in plan.unlock if pid not in {e.pid for e in errors}]
            others = f"; {_pids(running)} run again" if running else ""
            raise classify(
                errors[0], f"{others}; run `hibernate wake` again once the cause is fixed"
            ) from None
        self.after_step("unlock")
        if self.remember:
            for pid in plan.restore:
                records.drop(tracked[pid].holder.identity)
        self._read_states(tracked)
        return self._report("restored", tracked, started, memory=memory)

    def _rewind(
        self, tracked: Mapping[int, _Tracked], restored: Sequence[int], errors: Sequence[CheckpointStepError]
    ) -> NoReturn:
        """After a failed restore, checkpoint the restored processes again: the target stays asleep."""
        _, rewind_errors = self._run("checkpoint", tracked, list(restored))
        first = errors[0]
        if rewind_errors:
            raise NeedsRecoveryError(
                f"{first.message}; putting the restored processes back to sleep failed too: "
                + "; ".join(e.message for e in rewind_errors),
                hint="run `hibernate wake PID` again once the cause is fixed",
            ) from first
        back = f"; {_pids(restored)} checkpointed again" if restored else ""
        raise classify(first, f"{back}; the target stays asleep") from None
