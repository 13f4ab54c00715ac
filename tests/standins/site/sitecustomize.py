"""Stand-ins for hibernate.pool() and CUDA graphs, installed in a CPU demo's process at start-up.

``scripts/gpu-check --dry-run`` puts this directory first on the PYTHONPATH
of the demos of its ``pools`` section (``python -m hibernate.demo serve
--pool --graphs`` and ``--graphs`` alone, on CPU); Python imports this module
before the demo's first line, so the stand-ins are in place before the demo
allocates anything (tests only):

* torch_memory_saver is the stand-in of ``tests.standins.tms`` (over host
  memory: fixed address ranges, paused by unmapping them), installed as the
  ``torch_memory_saver`` module, and hibernate's provider is a
  ``TmsProvider`` over it with the stand-in's seams (its allocator snapshot,
  copies through the host reservations, its free memory, its device), so
  ``hibernate.pool()`` and ``hibernate.cuda_graph()`` run their real code;
* ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph`` capture a block as a CUDA
  graph does, by raw address (the recorder of ``tests.standins.cuda_graphs``),
  its allocations in the MemPool named by ``pool=`` if any:
  a replay reads and writes the memory the block captured, not the Python
  tensors, checks that this memory is still in place (a read of a storage
  freed or reallocated since, or of a paused allocation, raises where a GPU
  would read other memory or fault) and writes its results into the tensors
  the block made, where a real graph's outputs stay;
* the tracked tensors' pool (``hibernate.track``) sees a CUDA process: its
  storages are device storages of cuda:0, copied through the stand-in CUDA
  runtime (``HIBERNATE_STANDIN_CUDART``, built from
  ``tests/standins/vllm_fake_cudart.c``: a device pointer is a host address),
  and a graph captured without ``pool=`` makes a private pool ``(N, 0)``
  that shows in the allocator's segments, as a CUDA process's snapshot shows
  it: what the refusal of a sleep that would move memory under a graph looks
  for (tracked device memory beside a graph's own pool).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import traceback
import weakref
from collections.abc import Iterator
from typing import Any

CUDART_ENV = "HIBERNATE_STANDIN_CUDART"  # the stand-in CUDA runtime's shared library


class StandInCUDAGraph:
    """``torch.cuda.CUDAGraph`` for a CPU torch: ``capture_begin``/``capture_end`` by ``torch.cuda.graph``."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._recorder: Any = None
        self._pool: tuple[int, int] | None = None

    def pool(self) -> tuple[int, int]:
        if self._pool is None:
            raise RuntimeError("the graph is not captured")
        return self._pool

    def record(self, recorder: Any, pool: tuple[int, int]) -> None:
        self._recorder = recorder
        self._pool = pool
        _live.add(self)

    def replay(self) -> None:
        """The recorded ops on the raw addresses captured; the results written into the block's tensors."""
        from torch.utils._pytree import tree_flatten, tree_unflatten

        from tests.standins import cuda_graphs

        recorder = self._recorder
        if recorder is None:
            raise RuntimeError("the graph is not captured")
        for read, guard in zip(recorder.reads, recorder.guards, strict=True):
            guard.check(read)
        storages: dict[int, Any] = {}

        def rebuild(leaf: Any) -> Any:
            if isinstance(leaf, cuda_graphs._Read):
                return cuda_graphs._tensor_at(recorder.reads[leaf.index])
            if isinstance(leaf, cuda_graphs._Made):
                return cuda_graphs._over(storages[leaf.key], leaf)
            if isinstance(leaf, cuda_graphs._Empty):
                return _torch().empty(leaf.shape, dtype=leaf.dtype)
            return leaf

        with _torch().no_grad():
            for step in recorder.steps:
                args, kwargs = tree_unflatten([rebuild(leaf) for leaf in step.leaves], step.spec)
                produced = tree_flatten(step.func(*args, **kwargs))[0]
                for index, key in step.made:
                    storages[key] = produced[index].untyped_storage()
            for key, made in enumerate(recorder._alive):  # the block's tensors, where its outputs are
                made.untyped_storage().copy_(storages[key])

    def reset(self) -> None:
        _live.discard(self)
        self._recorder = None

    def segments(self) -> list[dict[str, Any]]:
        """The graph's memory in a private pool of its own, as torch's allocator snapshot lists it."""
        if self._recorder is None or self._pool is None or self._pool[1] != 0:
            return []  # captured into a user pool (hibernate.cuda_graph): that pool lists it
        return [
            {
                "device": 0,
                "address": made.untyped_storage().data_ptr(),
                "total_size": made.untyped_storage().nbytes(),
                "segment_pool_id": self._pool,
                "blocks": [],
            }
            for made in self._recorder._alive
        ]


_live: weakref.WeakSet[StandInCUDAGraph] = weakref.WeakSet()


def _torch() -> Any:
    import torch

    return torch


@contextlib.contextmanager
def stand_in_graph(
    cuda_graph: StandInCUDAGraph, pool: tuple[int, int] | None = None, stream: Any = None,
    capture_error_mode: str = "global",
) -> Iterator[None]:  # fmt: skip
    """``torch.cuda.graph``: the block's ops recorded; with ``pool=`` a MemPool's id (a torch_memory_saver
    tag's), the memory the block allocates comes from that pool, as a capture into it allocates."""
    from tests.standins import cuda_graphs, tms

    mempools = [p for p in tms.current().pools() if pool is not None and p.id == tuple(pool)]
    recorder = cuda_graphs._Recorder()
    with tms.current().use_mem_pool(mempools[0]) if mempools else contextlib.nullcontext(), recorder:
        yield
    cuda_graph.record(recorder, tuple(pool) if pool is not None else cuda_graphs.graph_pool_handle())


def allocator_segments() -> list[dict[str, Any]]:
    """What torch's allocator snapshot shows of the stand-ins: every live graph's private pool."""
    return [segment for graph in list(_live) for segment in graph.segments()]


def install() -> None:
    torch = _torch()

    from hibernate.agent.local import local_agent
    from hibernate.pools import provided
    from hibernate.pools.device import CudaCopies, CudaRuntime
    from hibernate.pools.tensors import TensorPool
    from hibernate.pools.tms import TmsProvider
    from tests.standins import tms
    from tests.standins.vllm_memory import HostDeviceMemory

    module = tms.install()  # the real package's fatal paths: exit(1), as on a GPU
    world = module.standin
    provided.install(
        TmsProvider(
            saver=module,
            segments=world.memory_snapshot,
            copies=lambda: HostDeviceMemory(world.reservations),
            free_bytes=world.free_bytes,
            device=lambda: world.current_device,
        )
    )
    torch.cuda.CUDAGraph = StandInCUDAGraph
    torch.cuda.graph = stand_in_graph
    # hibernate.track() adds its tensors to this pool: the agent is made here, not yet served.
    runtime = CudaRuntime(ctypes.CDLL(os.environ[CUDART_ENV]))
    tracked = TensorPool(
        copies=lambda: CudaCopies(runtime),
        device_of=lambda storage: 0 if storage.device.type == "cpu" else None,
        segments=allocator_segments,
    )
    local_agent(serve=False).add_pool(tracked)


try:
    install()
except Exception:  # a demo without its stand-ins would fail later, and less clearly
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
