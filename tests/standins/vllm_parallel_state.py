"""Stand-in for the module ``vllm.distributed.parallel_state`` in a stand-in worker (tests only).

What hibernate reads of the real one (vLLM 0.33): ``_WORLD``, the world
group, whose ``world_size`` counts the workers sharing communicators, whose
``rank_in_group`` is this worker's and whose ``cpu_group`` is its gloo group;
``_TP``, ``_PP`` and ``_PCP``, one engine's groups, whose ``world_size``
multiply to the workers of one engine (less than the world's with data
parallelism); the module's ``cpu_all_reduce_(tensor, group, timeout)``
(imported there from ``vllm.distributed.utils``), which sums a small CPU
tensor over every worker of ``group`` and, like gloo's waits, raises
``RuntimeError`` once ``timeout`` passes without its peers (None: no limit);
and the
two collectives ``checkpoint_prepare_distributed_state()`` (tears down the
all-reduce and all-to-all workspaces that live in memory shared across GPUs,
which no CUDA checkpoint can take) and ``checkpoint_restore_distributed_state()``
(builds them again). Older vLLMs have neither function.

Here each call is a collective for real: every worker of the world must enter
it (a barrier over files in a directory the stand-in server shares with its
workers), or it fails after a while, as a collective whose peers never come
would hang. Each call that returns is appended to the stand-in driver's call
log (``$HIBERNATE_STANDIN_DIR/calls.log``, steps ``vllm-prepare`` and
``vllm-restore``), so a test reads in one place whether the workspaces were
torn down before the driver's checkpoint and built again after its restore.
A worker whose workspaces are torn down refuses a second prepare, and one
whose workspaces are up refuses a restore, as the real ones would fail.

``suspend_device_comms()`` and ``resume_device_comms()`` are what vLLM's
``Worker.sleep`` / ``Worker.wake_up`` call after / before the backend with
``--enable-nccl-comm-suspend``: collectives that take the same FlashInfer
workspaces down and up (and suspend NCCL), logged as ``vllm-comm-suspend`` and
``vllm-comm-resume``; they refuse workspaces already down or already up as
``checkpoint_*`` does. A fault point ``standin.suspend_device_comms``
(``HIBERNATE_FAULT``) after its collective makes one worker's fail.

``STANDIN_VLLM_DISTRIBUTED_CHECKPOINT=0`` makes the module of an older vLLM.
"""

from __future__ import annotations

import json
import os
import time
import types
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from hibernate import faults

MODULE_NAME = "vllm.distributed.parallel_state"
COLLECTIVE_DIR_ENV = "STANDIN_VLLM_COLLECTIVE_DIR"
WITH_CHECKPOINT_ENV = "STANDIN_VLLM_DISTRIBUTED_CHECKPOINT"
ENGINE_SIZE_ENV = "STANDIN_VLLM_ENGINE_SIZE"  # workers of one engine; default the whole world
COLLECTIVE_TIMEOUT_S = 60.0  # how long a collective without a timeout stands in for "forever"
PREPARE_STEP, RESTORE_STEP = "vllm-prepare", "vllm-restore"
COMM_SUSPEND_STEP, COMM_RESUME_STEP = "vllm-comm-suspend", "vllm-comm-resume"
COMM_SUSPEND_FAULT = "standin.suspend_device_comms"


class StandInCollectiveError(RuntimeError):
    """A collective without a timeout whose peers did not all come (a real one would hang)."""


@dataclass(frozen=True)
class Group:
    """One of an engine's groups (``_TP``, ``_PP``, ``_PCP``): only its size is read."""

    world_size: int


class World:
    """One worker's view of its world: rank, size, and where the collective barriers meet."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        collective_dir: Path | None,
        hang_s: float = COLLECTIVE_TIMEOUT_S,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.collective_dir = collective_dir
        self.hang_s = hang_s
        self.workspaces_up = True
        self._calls: dict[str, int] = {}

    def gather(self, name: str, value: Any = None, timeout: timedelta | None = None) -> list[Any]:
        """Every rank's ``value`` (JSON) once all entered the ``name`` collective this many times."""
        if self.collective_dir is None or self.world_size < 2:
            return [value]
        count = self._calls[name] = self._calls.get(name, 0) + 1
        mine = self.collective_dir / f"{name}-{count}-rank{self.rank}"
        mine.with_suffix(".tmp").write_text(json.dumps(value))
        mine.with_suffix(".tmp").rename(mine)
        limit = self.hang_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        while len(entered := list(self.collective_dir.glob(f"{name}-{count}-rank*[0-9]"))) < self.world_size:
            if time.monotonic() > deadline:
                if timeout is None:
                    raise StandInCollectiveError(f"rank {self.rank}: not every rank entered {name} #{count}")
                raise RuntimeError(f"Timed out waiting {limit * 1000:.0f}ms for recv operation to complete")
            time.sleep(0.01)
        return [json.loads(path.read_text()) for path in entered]

    def barrier(self, name: str) -> None:
        self.gather(name)

    @property
    def rank_in_group(self) -> int:
        return self.rank

    @property
    def cpu_group(self) -> World:
        return self  # the stand-in gloo group is the world itself

    def log(self, step: str) -> None:
        directory = os.environ.get("HIBERNATE_STANDIN_DIR")
        if directory:
            with open(Path(directory) / "calls.log", "a") as log:
                log.write(f"vllm {step} {os.getpid()} CUDA_SUCCESS\n")

    def prepare(self) -> None:
        if not self.workspaces_up:
            raise RuntimeError("checkpoint_prepare_distributed_state: the workspaces are already torn down")
        self.barrier(PREPARE_STEP)
        self.workspaces_up = False
        self.log(PREPARE_STEP)

    def restore(self) -> None:
        if self.workspaces_up:
            raise RuntimeError("checkpoint_restore_distributed_state: nothing was torn down")
        self.barrier(RESTORE_STEP)
        self.workspaces_up = True
        self.log(RESTORE_STEP)

    def suspend_comms(self) -> None:
        if not self.workspaces_up:
            raise RuntimeError("suspend_device_comms: the workspaces are already torn down")
        self.barrier(COMM_SUSPEND_STEP)
        self.workspaces_up = False
        self.log(COMM_SUSPEND_STEP)
        faults.point(COMM_SUSPEND_FAULT)

    def resume_comms(self) -> None:
        if self.workspaces_up:
            raise RuntimeError("resume_device_comms: nothing was torn down")
        self.barrier(COMM_RESUME_STEP)
        self.workspaces_up = True
        self.log(COMM_RESUME_STEP)


def cpu_all_reduce_(tensor: torch.Tensor, group: World, timeout: timedelta | None = None) -> torch.Tensor:
    """vLLM's ``vllm.distributed.utils.cpu_all_reduce_``: an in-place SUM over every rank of ``group``."""
    summed = group.gather("cpu-all-reduce", tensor.tolist(), timeout)
    tensor.copy_(torch.tensor(summed, dtype=tensor.dtype).sum(dim=0))
    return tensor


def make_module(
    world: World, with_checkpoint: bool = True, engine_size: int | None = None
) -> types.ModuleType:
    module = types.ModuleType(MODULE_NAME, "stand-in for vllm.distributed.parallel_state (tests only)")
    module._WORLD = world  # type: ignore[attr-defined]
    # One engine: all its workers in one tensor-parallel group, one pipeline stage.
    module._TP = Group(engine_size or world.world_size)  # type: ignore[attr-defined]
    module._PP = Group(1)  # type: ignore[attr-defined]
    module._PCP = Group(1)  # type: ignore[attr-defined]
    module.cpu_all_reduce_ = cpu_all_reduce_  # type: ignore[attr-defined]
    module.suspend_device_comms = world.suspend_comms  # type: ignore[attr-defined]
    module.resume_device_comms = world.resume_comms  # type: ignore[attr-defined]
    if with_checkpoint:
        module.checkpoint_prepare_distributed_state = world.prepare  # type: ignore[attr-defined]
        module.checkpoint_restore_distributed_state = world.restore  # type: ignore[attr-defined]
    return module


def from_environment() -> tuple[World, bool, int | None]:
    """This worker's world as the stand-in server describes it: ``RANK``, ``WORLD_SIZE``, the barrier
    dir, whether its vLLM has the checkpoint collectives, and its engine's size."""
    collective = os.environ.get(COLLECTIVE_DIR_ENV)
    world = World(
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        Path(collective) if collective else None,
    )
    engine = os.environ.get(ENGINE_SIZE_ENV, "").strip()
    return world, os.environ.get(WITH_CHECKPOINT_ENV, "1") != "0", int(engine) if engine else None
