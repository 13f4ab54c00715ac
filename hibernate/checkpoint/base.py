"""The interface every checkpointer implements, and the CUDA process states.

States and transitions follow the driver's cuCheckpointProcess* API:

    running --lock--> locked --checkpoint--> checkpointed
    checkpointed --restore--> locked --unlock--> running

A lock that times out leaves the process running; a restore that fails (out of
memory, say) leaves it checkpointed.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Protocol


class CudaState(str, Enum):
    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


class Checkpointer(Protocol):
    """One way of driving cuda-checkpoint for another process."""

    name: str

    def state(self, pid: int) -> CudaState: ...

    def lock(self, pid: int, timeout_ms: int) -> None: ...

    def checkpoint(self, pid: int) -> None: ...

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None: ...

    def unlock(self, pid: int) -> None: ...

    def restore_thread_id(self, pid: int) -> int: ...
