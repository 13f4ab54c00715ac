"""Stand-in for the module ``vllm.distributed.parallel_state`` in a stand-in worker (tests only).

What hibernate reads of the real one (vLLM 0.33): ``_WORLD``, the world
group, whose ``world_size`` counts the workers sharing communicators, whose
``rank_in_group`` is this worker's, whose ``cpu_all_reduce_(tensor)`` sums a
small CPU tensor over every worker and ``broadcast_object(obj, src)`` hands
one rank's object to all, and the
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

``STANDIN_VLLM_DISTRIBUTED_CHECKPOINT=0`` makes the module of an older vLLM.
"""

from __future__ import annotations

import json
import os
import time
import types
from pathlib import Path
from typing import Any

import torch

MODULE_NAME = "vllm.distributed.parallel_state"
COLLECTIVE_DIR_ENV = "STANDIN_VLLM_COLLECTIVE_DIR"
WITH_CHECKPOINT_ENV = "STANDIN_VLLM_DISTRIBUTED_CHECKPOINT"
COLLECTIVE_TIMEOUT_S = 60.0
PREPARE_STEP, RESTORE_STEP = "vllm-prepare", "vllm-restore"


class StandInCollectiveError(RuntimeError):
    """A collective whose peers did not all come (a real one would hang)."""


class World:
    """One worker's view of its world: rank, size, and where the collective barriers meet."""

    def __init__(self, rank: int, world_size: int, collective_dir: Path | None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.collective_dir = collective_dir
        self.workspaces_up = True
        self._calls: dict[str, int] = {}

    def gather(self, name: str, value: Any = None) -> list[Any]:
        """Every rank's ``value`` (JSON) once all entered the ``name`` collective this many times."""
        if self.collective_dir is None or self.world_size < 2:
            return [value]
        count = self._calls[name] = self._calls.get(name, 0) + 1
        mine = self.collective_dir / f"{name}-{count}-rank{self.rank}"
        mine.with_suffix(".tmp").write_text(json.dumps(value))
        mine.with_suffix(".tmp").rename(mine)
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while len(entered := list(self.collective_dir.glob(f"{name}-{count}-rank*[0-9]"))) < self.world_size:
            if time.monotonic() > deadline:
                raise StandInCollectiveError(f"rank {self.rank}: not every rank entered {name} #{count}")
            time.sleep(0.01)
        return [json.loads(path.read_text()) for path in entered]

    def barrier(self, name: str) -> None:
        self.gather(name)

    @property
    def rank_in_group(self) -> int:
        return self.rank

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """vLLM's ``GroupCoordinator.broadcast_object``: ``src``'s object, on every rank."""
        if self.collective_dir is None or self.world_size < 2:
            return obj
        count = self._calls["broadcast"] = self._calls.get("broadcast", 0) + 1
        shared = self.collective_dir / f"broadcast-{count}"
        if self.rank == src:
            shared.with_suffix(".tmp").write_text(json.dumps(obj))
            shared.with_suffix(".tmp").rename(shared)
            return obj
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while not shared.exists():
            if time.monotonic() > deadline:
                raise StandInCollectiveError(f"rank {self.rank}: rank {src} never broadcast #{count}")
            time.sleep(0.01)
        return json.loads(shared.read_text())

    def cpu_all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """vLLM's ``GroupCoordinator.cpu_all_reduce_``: an in-place SUM over every rank."""
        summed = [sum(column) for column in zip(*self.gather("cpu-all-reduce", tensor.tolist()), strict=True)]
        tensor.copy_(torch.tensor(summed, dtype=tensor.dtype))
        return tensor

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


def make_module(world: World, with_checkpoint: bool = True) -> types.ModuleType:
    module = types.ModuleType(MODULE_NAME, "stand-in for vllm.distributed.parallel_state (tests only)")
    module._WORLD = world  # type: ignore[attr-defined]
    if with_checkpoint:
        module.checkpoint_prepare_distributed_state = world.prepare  # type: ignore[attr-defined]
        module.checkpoint_restore_distributed_state = world.restore  # type: ignore[attr-defined]
    return module


def from_environment() -> tuple[World, bool]:
    """This worker's world as the stand-in server describes it: ``RANK``, ``WORLD_SIZE``, the barrier dir."""
    collective = os.environ.get(COLLECTIVE_DIR_ENV)
    world = World(
        int(os.environ.get("RANK", "0")),
        int(os.environ.get("WORLD_SIZE", "1")),
        Path(collective) if collective else None,
    )
    return world, os.environ.get(WITH_CHECKPOINT_ENV, "1") != "0"
