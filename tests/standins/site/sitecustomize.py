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
* ``torch.cuda.CUDAGraph`` and ``torch.cuda.graph`` are the stand-ins of
  ``tests.standins.cuda_graphs``: a capture records its block by raw address,
  its allocations in the MemPool named by ``pool=`` if any, and a replay
  reads and writes the memory captured, not the Python tensors (a read of
  memory freed, moved or paused since raises where a GPU would read other
  memory or fault);
* the tracked tensors' pool (``hibernate.track``) sees a CUDA process: its
  storages are device storages of cuda:0, copied through the stand-in CUDA
  runtime (``HIBERNATE_STANDIN_CUDART``, built from
  ``tests/standins/vllm_fake_cudart.c``: a device pointer is a host address),
  and a graph captured without ``pool=`` makes a private pool ``(N, 0)``
  that shows in the allocator's segments, as a CUDA process's snapshot shows
  it: what the refusal of a sleep that would move memory under a graph looks
  for (tracked device memory beside a graph's own pool);
* ``torch.cuda.memory_snapshot`` lists the stand-ins' pools and graphs
  (``cuda_graphs.memory_snapshot``), and ``torch.cuda.MemPool()`` with
  ``torch.cuda.use_mem_pool`` is a program's own pool over host segments
  (torch's caching allocator of ``tests.standins.mempool``), as a CUDA
  process has them: what a graph captured into a program's own pool shares
  its memory with (``scripts/lib/gpu_check_graph_pool.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import traceback
from typing import Any

CUDART_ENV = "HIBERNATE_STANDIN_CUDART"  # the stand-in CUDA runtime's shared library
_held: list[contextlib.AbstractContextManager[None]] = []  # what must live as long as the process


def install() -> None:

    from hibernate.agent.local import local_agent
    from hibernate.pools import provided
    from hibernate.pools.device import CudaCopies, CudaRuntime
    from hibernate.pools.tensors import TensorPool
    from hibernate.pools.tms import TmsProvider
    from tests.standins import cuda_graphs, tms
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
    # For the life of the process: held here, as a generator's context collected would undo it.
    _held.append(cuda_graphs.patched_torch_cuda())
    _held[-1].__enter__()
    _patch_mempool()
    # hibernate.track() adds its tensors to this pool: the agent is made here, not yet served.
    runtime = CudaRuntime(ctypes.CDLL(os.environ[CUDART_ENV]))
    tracked = TensorPool(
        copies=lambda: CudaCopies(runtime),
        device_of=lambda storage: 0 if storage.device.type == "cpu" else None,
        segments=cuda_graphs.memory_snapshot,
    )
    local_agent(serve=False).add_pool(tracked)


def _patch_mempool() -> None:
    """``torch.cuda.MemPool``, ``use_mem_pool`` and ``memory_snapshot`` over the stand-ins' host pools."""
    import torch

    from tests.standins import cuda_graphs, mempool
    from tests.standins.vllm_memory import HostReservations

    segments = HostReservations()

    class MemPool(mempool.CachingMemPool):
        """``torch.cuda.MemPool()``: a pool of the program's own, ``(0, N)``, torch's allocator over
        segments of its own (an ``allocator=`` is not modelled: the stand-ins that have one make theirs)."""

        def __init__(self, allocator: Any = None, use_on_oom: bool = False) -> None:
            if allocator is not None:
                raise NotImplementedError("the stand-in MemPool takes no allocator")
            super().__init__(0, threading.RLock())

        def malloc_segment(self, size: int) -> int:
            return segments.reserve(size)

        def free_segment(self, address: int) -> None:
            segments.free(address)

    def memory_snapshot(mempool_id: Any = None, **_: Any) -> list[dict[str, Any]]:
        return cuda_graphs.memory_snapshot(mempool_id)

    torch.cuda.MemPool = MemPool  # type: ignore[misc,assignment]
    torch.cuda.use_mem_pool = mempool.use_mem_pool  # type: ignore[assignment]
    torch.cuda.memory_snapshot = memory_snapshot  # type: ignore[assignment]


try:
    install()
except Exception:  # a demo without its stand-ins would fail later, and less clearly
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
