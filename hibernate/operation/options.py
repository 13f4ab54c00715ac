"""What a caller may choose about one operation; run state lives elsewhere (the CUDA stage, the units)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hibernate.agent.wire import TransferArgs
from hibernate.checkpoint.base import Checkpointer, StepTimeouts
from hibernate.limits import MIN_BUFFER_MB


@dataclass
class IoOptions:
    buffer_mb: int = 256
    chunk_mb: int = 32
    io_mode: str = "auto"
    verify: bool = False  # read each snapshot back before its memory is released
    # Reuse the previous snapshot's chunks without reading them back first (--skip-reuse-check).
    skip_reuse_check: bool = False
    # Move tracked CUDA memory even while the process has captured CUDA graphs (--allow-moves).
    allow_moves: bool = False

    def transfer(self, buffer_mb: int | None = None) -> TransferArgs:
        """These options as a spill's or restore's arguments (``buffer_mb``: one process's share)."""
        return TransferArgs(
            buffer_mb=self.buffer_mb if buffer_mb is None else buffer_mb,
            chunk_mb=self.chunk_mb,
            io_mode=self.io_mode,
            verify=self.verify,
            skip_reuse_check=self.skip_reuse_check,
            allow_moves=self.allow_moves,
        )

    def to_args(self) -> dict[str, Any]:
        return self.transfer().to_wire()


@dataclass(frozen=True)
class StagingShare:
    """How one staging budget (``--buffer-mb``) is shared by the processes of one transfer."""

    buffer_mb: int  # each process's staging
    at_once: int  # processes transferring at the same time


def share_staging(budget_mb: int, processes: int, floor_mb: int = MIN_BUFFER_MB) -> StagingShare:
    """Divide a node-wide staging budget among ``processes`` moving at once.

    ``--buffer-mb`` is what the whole operation may stage, not each process:
    eight workers of one node sleeping together with 256 MiB each held 2 GiB
    of staging where one budget was asked for. Each process gets an equal
    share; where shares would fall below ``floor_mb`` (staging that small makes
    chunks so small the disk slows), fewer processes move at once, each with
    ``floor_mb`` or more, so the total never passes the budget.
    """
    processes = max(1, processes)
    at_once = max(1, min(processes, budget_mb // floor_mb))
    return StagingShare(buffer_mb=budget_mb // at_once, at_once=at_once)


@dataclass
class Options:
    quiesce_timeout: float = 30.0
    # How long a sleep waits for requests in flight through a proxy to end (leases); None: the
    # quiesce_timeout. A proxy's own idle sleep gives up sooner: another proxy's requests mean the
    # backend is not idle.
    lease_timeout: float | None = None
    agent_timeout: float = 60.0  # longest silence from an agent before giving up
    io: IoOptions = field(default_factory=IoOptions)
    # The CUDA stage: an explicit checkpointer, else one chosen (once, lazily) by kind:
    # "auto" (driver API, else the cuda-checkpoint binary, else none), "driver" or "binary".
    checkpointer: Checkpointer | None = None
    checkpointer_kind: str = "auto"
    cuda_checkpoint: str | None = None  # path of the cuda-checkpoint binary (--cuda-checkpoint)
    cuda_timeouts: StepTimeouts = field(default_factory=StepTimeouts)
    # --force: go on where a safety check cannot tell (a wake's free GPU memory that NVML cannot
    # read; a multi-process CUDA sleep without the NCCL settings a checkpoint needs).
    force: bool = False
    # --device-map: restore onto other GPUs, as given (GPU UUIDs or NVML indices, old -> new).
    device_map: dict[str, str] = field(default_factory=dict)
    # Options of one kind of target, by the name its registration declares (a vLLM server's
    # "level", "drain", "vllm_url"); only those the user gave, so that the engine can refuse
    # them for a selection with no target of that kind.
    kind_options: dict[str, Any] = field(default_factory=dict)
    # A sleep of targets chosen by a selector (--all, --job, --cgroup) skips those already asleep and
    # lists them, as a wake skips those awake: "everything of mine" should end asleep, not fail because
    # part of it already is. Pids named one by one are refused instead (the user meant those).
    skip_asleep: bool = False
    # --if-needed: a sleep that finds every target asleep already (skip_asleep left nothing) ends with
    # a report that lists them as skipped, instead of refusing (exit 6).
    nothing_left_ok: bool = False
    # Agents of several users in one command (root only): --all-users, or a --job/--cgroup selection.
    all_users: bool = False

    @property
    def lease_wait(self) -> float:
        """How long a sleep waits for the leases held on its targets: ``lease_timeout``, else the
        quiesce's."""
        return self.quiesce_timeout if self.lease_timeout is None else self.lease_timeout
