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

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

from hibernate.checkpoint.curesult import CuError
from hibernate.errors import CudaCheckpointError


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
    """Seconds each step may take before hibernate gives up on it.

    ``lock`` is passed to the driver (``timeoutMs``), which then leaves the
    process running; the others bound a call the driver cannot bound itself
    (a checkpoint of 80 GB legitimately takes a minute). A call abandoned on
    timeout leaves the process in a state only a fresh ``state()`` can tell.
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


class CheckpointStepError(CudaCheckpointError):
    """One checkpointer call failed: which process, which step, and the exact CUDA result.

    ``timed_out`` is set when hibernate (not the driver) gave up waiting; the
    process's state is then unknown until queried.
    """

    def __init__(
        self,
        pid: int,
        step: str,
        error: CuError,
        *,
        how: str,
        timed_out: bool = False,
        hint: str | None = None,
    ) -> None:
        self.pid = pid
        self.step = step
        self.error = error
        self.timed_out = timed_out
        super().__init__(f"process {pid} ({step}): {how} failed: {error}", hint=hint)


class Checkpointer(Protocol):
    """One way of driving cuda-checkpoint for another process.

    Every method names the target by pid and raises CheckpointStepError with
    the exact CUDA result on failure; none of them changes anything on success
    beyond the one transition it is named for.
    """

    name: str

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
        """Calls that first waited for an earlier call for the same process that had timed out and was
        still running (never overlapped), since last asked: the outcome of an undo names both."""
        ...


def cuda_version_text(version: int) -> str:
    """12080 -> "12.8" (cuDriverGetVersion encodes 1000*major + 10*minor)."""
    return f"{version // 1000}.{version % 1000 // 10}"
