"""The interface every checkpointer implements, the CUDA process states, and their errors.

States and transitions follow the driver's cuCheckpointProcess* API:

    running --lock--> locked --checkpoint--> checkpointed
    checkpointed --restore--> locked --unlock--> running

A lock that times out leaves the process running; a restore that fails (out of
memory, say) leaves it checkpointed. ``failed`` means the driver gave up on the
process: only restarting it recovers. CUDA 13.4 adds the transient
``checkpointing`` and ``restoring`` (custom storage), which hibernate never
starts but may observe.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from hibernate.checkpoint.curesult import CuError
from hibernate.errors import CudaCheckpointError, HibernateTimeoutError
from hibernate.procinfo import ProcessIdentity


class CudaState(str, Enum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"
    CHECKPOINTING = "checkpointing"
    RESTORING = "restoring"


# CUprocessState values, in enum order (cuda.h).
STATE_BY_NUMBER = {
    0: CudaState.RUNNING,
    1: CudaState.LOCKED,
    2: CudaState.CHECKPOINTED,
    3: CudaState.FAILED,
    4: CudaState.CHECKPOINTING,
    5: CudaState.RESTORING,
}


@dataclass(frozen=True)
class StepTimeouts:
    """Seconds hibernate waits for each step before it stops waiting.

    ``lock`` is passed to the driver (``timeoutMs``), which then gives up and
    leaves the process running. A checkpoint or restore is never cut: it runs
    in a process of its own session (:mod:`hibernate.checkpoint.detached`), and
    past its time hibernate stops waiting for it and says so, while it runs on
    to its end (a checkpoint of 80 GB legitimately takes a minute; one stopped
    half-way can leave the process in the driver's failed state). Unlock and the
    queries are waited for in a thread that dies with the command: an unlock
    moves no memory, and the next wake reads the state and unlocks only a
    process still locked.
    """

    lock: float = 30.0
    checkpoint: float = 600.0
    restore: float = 600.0
    unlock: float = 60.0
    query: float = 60.0  # state, restore thread id, --help

    def for_step(self, step: str) -> float:
        if step in ("state", "restore-tid", "help"):
            return self.query
        value: float = getattr(self, step)
        return value


@dataclass(frozen=True)
class DetachedCall:
    """A checkpoint or restore running in a process of its own session, as a journal keeps it."""

    pid: int  # the process it acts on
    step: str  # "checkpoint" or "restore"
    what: str  # the call, as messages name it: cuCheckpointProcessRestore, cuda-checkpoint --action restore
    helper: ProcessIdentity  # the process that makes the call (pid and start time: pids are reused)

    def describe(self) -> str:
        return f"{self.what}({self.pid}) in process {self.helper.pid}"


class CheckpointStepError(CudaCheckpointError):
    """One checkpointer call failed: which process, which step, and the exact CUDA result.

    ``timed_out`` is set when hibernate (not the driver) gave up waiting; the
    process's state is then unknown until queried. ``running`` is the call
    still running when hibernate stopped waiting for it (a checkpoint or
    restore, never cut): nothing may act on that process until it has returned.
    """

    def __init__(
        self,
        pid: int,
        step: str,
        error: CuError,
        *,
        how: str,
        timed_out: bool = False,
        running: DetachedCall | None = None,
        hint: str | None = None,
    ) -> None:
        self.pid = pid
        self.step = step
        self.error = error
        self.timed_out = timed_out
        self.running = running
        super().__init__(f"process {pid} ({step}): {how} failed: {error}", hint=hint)


class StillRunningError(HibernateTimeoutError):
    """A checkpoint or restore outlived its timeout and runs on: nothing else was done to the processes.

    It keeps the journal: ``hibernate recover`` waits for the call, reads the
    real states, and completes the sleep or the wake from them (a sleep whose
    checkpoint did not succeed is undone: the processes are woken).
    """

    keeps_journal = True


class Checkpointer(Protocol):
    """One way of driving cuda-checkpoint for another process.

    Every method names the target by pid and raises CheckpointStepError with
    the exact CUDA result on failure; none of them changes anything on success
    beyond the one transition it is named for.
    """

    name: str
    # Told of each checkpoint or restore started in a process of its own, before it is waited for:
    # where the operation journals it, so that a later command waits for it rather than overlap it.
    on_detach: Callable[[DetachedCall], None] | None

    def describe(self) -> dict[str, Any]:
        """What this checkpointer is: kind, path, driver version, capabilities."""
        ...

    def state(self, pid: int) -> CudaState: ...

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None: ...

    def unlock(self, pid: int) -> None: ...

    def restore_thread_id(self, pid: int) -> int: ...

    def waits(self) -> list[str]:
        """Calls that first waited for an earlier call for the same process that was still running
        (its wait had given up: a timeout or an interrupt; never overlapped), since last asked: the
        outcome of an undo names both."""
        ...


def cuda_version_text(version: int) -> str:
    """12080 -> "12.8" (cuDriverGetVersion encodes 1000*major + 10*minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"
