"""What tests of pools share: an agent over one pool, and what they check of a tensor (where it
lives, and its bytes)."""

from __future__ import annotations

import os
from typing import Any

import torch

from hibernate import procinfo
from hibernate.agent.controller import Agent
from hibernate.pools.base import Pool
from hibernate.pools.device import CudaCopies, CudaRuntime
from hibernate.pools.tensors import TensorPool


def agent_with(pool: Pool, name: str = "pool-test") -> Agent:
    """An agent of this process, not served, that hibernates ``pool``."""
    identity = procinfo.identity(os.getpid())
    assert identity is not None
    agent = Agent(identity, name=name)
    agent.add_pool(pool)
    return agent


def standin_device_pool(cudart: Any, tensors: dict[str, torch.Tensor], device: int) -> TensorPool:
    """A pool tracking ``tensors`` (tag weights, kept, name ``net``) as storages on ``device`` of the
    stand-in CUDA runtime ``cudart`` (a FakeCudaRT): host storages the pool is told live there, so
    their bytes move only through the runtime's seam, as a GPU's would."""
    ids = {t.untyped_storage()._cdata for t in tensors.values()}
    pool = TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
        device_of=lambda storage: device if storage._cdata in ids else None,
        graphs=list,
    )
    pool.track(tensors, "weights", True, "net")
    return pool


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of the tensor's bytes, outside every pool (compared bit for bit: NaN-safe)."""
    return tensor.detach().reshape(-1).view(torch.uint8).clone()


def fingerprint(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[int, torch.Tensor]]:
    """Each tensor's address and bytes, to compare after a wake."""
    return {name: (t.data_ptr(), bits(t)) for name, t in tensors.items()}


def assert_same(tensors: dict[str, torch.Tensor], before: dict[str, tuple[int, torch.Tensor]]) -> None:
    """Every tensor at the address and with the bytes ``fingerprint`` saw."""
    for name, tensor in tensors.items():
        address, contents = before[name]
        assert tensor.data_ptr() == address, f"{name} moved"
        assert torch.equal(bits(tensor), contents), f"{name} is not bit-exact"
