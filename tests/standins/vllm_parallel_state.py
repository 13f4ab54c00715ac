"""Stand-in for the module ``vllm.distributed.parallel_state`` in a stand-in worker (tests only).

What hibernate reads of the real one (vLLM 0.33): ``_WORLD``, the world
group, whose ``world_size`` counts the workers sharing communicators, and the
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

import os
import time
import types
from pathlib import Path
from types import SimpleNamespace

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

    def barrier(self, name: str) -> None:
        """Wait until every rank entered the ``name`` collective this many times."""
        if self.collective_dir is None or self.world_size < 2:
            return
        count = self._calls[name] = self._calls.get(name, 0) + 1
        (self.collective_dir / f"{name}-{count}-rank{self.rank}").touch()
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
        while len(list(self.collective_dir.glob(f"{name}-{count}-rank*"))) < self.world_size:
            if time.monotonic() > deadline:
                raise StandInCollectiveError(f"rank {self.rank}: not every rank entered {name} #{count}")
            time.sleep(0.01)

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
    module._WORLD = SimpleNamespace(world_size=world.world_size)  # type: ignore[attr-defined]
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
