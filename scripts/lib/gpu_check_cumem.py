"""A child of scripts/gpu-check: vLLM's cumem_allocator extension, carried in alone, driven through
hibernate's vLLM pool (hibernate.pools.vllm) without vLLM installed.

    python scripts/lib/gpu_check_cumem.py PATH/cumem_allocator.abi3.so
    python scripts/lib/gpu_check_cumem.py --standin        # gpu-check's dry run, on a CPU

It allocates tagged tensors through the extension's pluggable allocator, as
vLLM's CuMemAllocator does, records a CUDA graph over them, copies the kept
allocations out through the pool, releases every one (their address ranges
stay reserved, unmapped), prints ``{"released": bytes, ...}`` and waits for a
line on stdin: meanwhile the parent checkpoints and restores the process with
the driver. Then it maps them back, copies the kept bytes in, replays the graph
and prints ``{"bit_exact": ..., "graph_replay_same": ...}``, then waits to be
checkpointed and killed (a restored process must not simply end).

With ``--standin`` the same steps run over the stand-ins of ``tests/standins``
(vLLM's allocator records and extension over host memory, a stand-in CUDA
graph, hibernate's device seam over those host ranges): what the dry run of
gpu-check walks in place of the extension, which needs a real libcuda.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))


@dataclass
class Allocation:
    """The fields of vLLM's AllocationData that hibernate's pool reads and keeps coherent."""

    handle: tuple[int, int, int, Any]  # device, size, address, the physical handle(s)
    tag: str
    cpu_backup_tensor: Any = None
    is_asleep: bool = False


class Allocator:
    """The records vLLM's CuMemAllocator keeps, by device address, filled by the extension's callbacks."""

    def __init__(self) -> None:
        self.pointer_to_data: dict[int, Allocation] = {}
        self.tag = "weights"

    def on_malloc(self, handle: tuple[int, int, int, Any]) -> None:
        self.pointer_to_data[handle[2]] = Allocation(handle, self.tag)

    def on_free(self, address: int) -> tuple[int, int, int, Any]:
        import torch

        handle = self.pointer_to_data.pop(address).handle
        torch.cuda.synchronize(handle[0])  # no kernel may still use what the extension unmaps
        return handle


def load_extension(path: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("cumem_allocator", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class Backend:
    """Where the child's tagged memory comes from: the real extension on a GPU, or the stand-ins."""

    allocator: Any  # pointer_to_data: address -> Allocation, as vLLM's CuMemAllocator keeps it
    tagged: Callable[[str], contextlib.AbstractContextManager[Any]]  # allocations under a tag
    device_memory: Any  # hibernate's DeviceMemory seam over that memory
    device: str
    dim: int


def real_backend(path: str) -> Backend:
    """The extension loaded into torch's pluggable allocator, as vLLM's CuMemAllocator loads it."""
    import ctypes

    import torch

    from hibernate.pools.device import CudaDeviceMemory, CudaRuntime, loaded_cudart
    from hibernate.pools.hostpages import own_mappings

    extension = load_extension(path)
    allocator = Allocator()
    extension.init_module(allocator.on_malloc, allocator.on_free)
    pluggable = torch.cuda.memory.CUDAPluggableAllocator(path, "my_malloc", "my_free")
    pool = torch.cuda.MemPool(pluggable.allocator())

    @contextlib.contextmanager
    def tagged(tag: str) -> Iterator[None]:
        allocator.tag = tag
        with torch.cuda.use_mem_pool(pool):
            yield

    cudart = loaded_cudart(own_mappings())
    assert cudart is not None, "torch's CUDA runtime is not mapped into this process"
    device = CudaDeviceMemory(
        CudaRuntime(ctypes.CDLL(cudart)),
        lambda handle: extension.python_create_and_map(*handle),
        lambda handle: extension.python_unmap_and_release(*handle),
    )
    return Backend(allocator, tagged, device, "cuda", 4096)


def standin_backend() -> Backend:
    """vLLM's allocator records and extension over host memory (tests/standins), on a CPU."""
    from tests.standins.vllm_memory import HostDeviceMemory, HostReservations, StandInCuMemAllocator

    reservations = HostReservations()
    allocator = StandInCuMemAllocator(reservations)
    return Backend(allocator, allocator.use_memory_pool, HostDeviceMemory(reservations), "cpu", 1024)


def main() -> int:
    import torch

    from hibernate.pools.vllm import CuMemPool

    backend = standin_backend() if sys.argv[1] == "--standin" else real_backend(sys.argv[1])
    dim, on = backend.dim, backend.device
    generator = torch.Generator(device=on).manual_seed(0)
    with backend.tagged("weights"):
        weight = torch.randn(dim, dim, device=on, generator=generator)
    with backend.tagged("kv_cache"):
        kv = torch.ones(64 << 20, dtype=torch.uint8, device=on)
    x = torch.randn(dim, 256, device=on, generator=generator)
    y = torch.empty(dim, 256, device=on)
    torch.matmul(weight, x, out=y)  # warm-up: cuBLAS's handle and workspace exist before the capture
    synchronize(torch, on)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.matmul(weight, x, out=y)
    graph.replay()
    synchronize(torch, on)
    expected_weight, expected_y = weight.cpu().clone(), y.cpu().clone()

    allocator, device = backend.allocator, backend.device_memory
    hibernate_pool = CuMemPool(allocator=lambda: allocator, device=lambda: device)
    regions = list(hibernate_pool.regions())
    kept: dict[str, bytearray] = {}
    for region in regions:
        if region.keep:
            kept[region.key] = bytearray(region.nbytes)
            region.copy_out(0, memoryview(kept[region.key]))
    hibernate_pool.synchronize()
    for region in regions:
        region.release()
    hibernate_pool.after_release()
    print(json.dumps({
        "released": sum(r.nbytes for r in regions),
        "regions": [{"key": r.key, "tag": r.tag, "keep": r.keep, "bytes": r.nbytes} for r in regions],
    }), flush=True)  # fmt: skip
    sys.stdin.readline()
    for region in regions:
        region.reallocate()
        if region.keep:
            region.copy_in(0, memoryview(kept[region.key]))
        else:
            region.zero()
    hibernate_pool.synchronize()
    y.zero_()
    graph.replay()
    synchronize(torch, on)
    print(json.dumps({
        "bit_exact": bool(torch.equal(weight.cpu(), expected_weight)),
        "dropped_zeroed": bool((kv == 0).all()),
        "graph_replay_same": bool(torch.equal(y.cpu(), expected_y)),
    }), flush=True)  # fmt: skip
    sys.stdin.readline()  # the parent checkpoints this restored process before it kills it
    return 0


def synchronize(torch: Any, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
