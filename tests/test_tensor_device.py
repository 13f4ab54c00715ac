"""Tracked device storages: ordered against the program's streams, copied through the device seam.

No GPU here: the stand-in CUDA runtime (tests/standins/vllm_fake_cudart.c) runs
over host memory and keeps asynchronous work queued on its stream until that
stream or its device is synchronized, which is the slowest schedule the CUDA
stream contract allows. The "device storages" are host storages the pool is
told live on a device (``device_of``), so their bytes move only through the
seam, exactly as a CUDA storage's would.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from hibernate import procinfo
from hibernate.agent.controller import Agent
from hibernate.errors import UnsupportedError
from hibernate.operation.reports import ProcessSleep
from hibernate.pools.device import CudaCopies, CudaRuntime, loaded_cudart
from hibernate.pools.hostpages import HostMapping
from hibernate.pools.tensors import TensorPool, pool_of
from tests.standins.vllm_cumem import FakeCudaRT

NON_BLOCKING = 1


@pytest.fixture
def cudart(cudart_path: Path) -> FakeCudaRT:
    lib = FakeCudaRT(cudart_path)
    for counter in ("fake_copies", "fake_copied_bytes", "fake_registered_peak"):
        lib.set_counter(counter, 0)
    lib.set_counter("fake_fail_copy_at", -1)
    return lib


def side_stream(cudart: FakeCudaRT, device: int) -> ctypes.c_void_p:
    """A non-blocking stream of the program's own, as torch.cuda.Stream() makes."""
    stream = ctypes.c_void_p()
    assert cudart.lib.cudaSetDevice(device) == 0
    assert cudart.lib.cudaStreamCreateWithFlags(ctypes.byref(stream), NON_BLOCKING) == 0
    return stream


def on_device(tensors: dict[str, torch.Tensor], device: int):  # type: ignore[no-untyped-def]
    """``device_of`` for a pool whose stand-in device memory is these tensors' storages."""
    ids = {t.untyped_storage()._cdata for t in tensors.values()}
    return lambda storage: device if storage._cdata in ids else None


def agent_with(pool: TensorPool) -> Agent:
    ident = procinfo.identity(os.getpid())
    assert ident is not None
    agent = Agent(ident, name="device-test")
    agent.add_pool(pool)
    return agent


def test_a_side_stream_write_still_in_flight_when_the_guard_exits_is_in_the_snapshot(
    cudart: FakeCudaRT, work_dir: Path
) -> None:
    weights = torch.zeros(1 << 20, dtype=torch.uint8)
    cache = torch.full((1 << 16,), 3, dtype=torch.uint8)
    pool = TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)), device_of=on_device({"w": weights, "c": cache}, 1)
    )
    pool.track(weights, "weights", True, "w")
    pool.track(cache, "kv_cache", False, "c")
    agent = agent_with(pool)
    stream = side_stream(cudart, 1)
    with agent.guard.hold():
        address = ctypes.c_void_p(weights.data_ptr())
        assert cudart.lib.cudaMemsetAsync(address, 0xAB, weights.nbytes, stream) == 0
    assert int(weights.max()) == 0, "the stand-in keeps the write in flight past the guard"

    report = agent.sleep_here(work_dir, 5.0, {"buffer_mb": 4, "chunk_mb": 1})
    assert weights.untyped_storage().nbytes() == 0, "released"
    assert report["spill"]["total_bytes"] == weights.nbytes
    copies_at_sleep = cudart.counter("fake_copies")
    assert copies_at_sleep >= 1 and cudart.counter("fake_copied_bytes") == weights.nbytes, "through the seam"

    agent.wake_here({"buffer_mb": 4})
    assert bool((weights == 0xAB).all()), "the in-flight write was waited for, spilled and restored"
    assert int(torch.count_nonzero(cache)) == 0, "dropped, zero-filled through the seam"
    assert cudart.counter("fake_copied_bytes") == 2 * weights.nbytes
    assert cudart.counter("fake_last_device_synchronize") > cudart.counter("fake_last_queued"), (
        "a device synchronization came after the last fill of the wake"
    )
    assert 0 < cudart.counter("fake_registered_peak") <= 4 << 20, "staging page-locked through the seam"
    assert cudart.counter("fake_registered_bytes") == 0


def test_synchronize_waits_for_every_stream_and_keeps_the_callers_current_device(cudart: FakeCudaRT) -> None:
    copies = CudaCopies(CudaRuntime(cudart.lib))
    target = (ctypes.c_uint8 * 4096)()
    stream = side_stream(cudart, 3)
    assert cudart.lib.cudaMemsetAsync(ctypes.addressof(target), 7, 4096, stream) == 0
    assert bytes(target) == bytes(4096)
    assert cudart.lib.cudaSetDevice(2) == 0  # the program's current device
    copies.synchronize(1)
    assert bytes(target) == bytes(4096), "another device's work is not waited for"
    copies.synchronize(3)
    assert bytes(target) == b"\x07" * 4096
    device = ctypes.c_int()
    assert cudart.lib.cudaGetDevice(ctypes.byref(device)) == 0 and device.value == 2


def test_the_process_cuda_runtime_is_found_by_its_mapping() -> None:
    def lib(path: str) -> HostMapping:
        return HostMapping(0x1000, 0x2000, False, False, path)

    found = loaded_cudart([lib("/usr/lib/libc.so.6"), lib("/site/nvidia/cu13/lib/libcudart.so.13")])
    assert found == "/site/nvidia/cu13/lib/libcudart.so.13"
    assert loaded_cudart([lib("/tmp/libcudart-standin.so"), lib("")]) is None


def test_without_a_loaded_cuda_runtime_device_copies_are_refused_clearly() -> None:
    # This CPU build of torch loads no libcudart.
    with pytest.raises(UnsupportedError, match=r"no CUDA runtime library \(libcudart.so\)"):
        CudaCopies.from_process()


# -- storages in a non-default pool: released, but nothing freed on the GPU ------------------------


def segment(device: int, address: int, size: int, pool: tuple[int, int]) -> dict[str, object]:
    """A segment as torch.cuda.memory_snapshot() lists it (the fields read here)."""
    return {"device": device, "address": address, "total_size": size, "segment_pool_id": pool}


def test_a_storage_in_a_private_pool_is_named_in_the_sleeps_warnings(
    cudart: FakeCudaRT, work_dir: Path
) -> None:
    in_mempool = torch.arange(4096, dtype=torch.int32)
    in_default = torch.arange(1024, dtype=torch.int64)
    expected = (in_mempool.clone(), in_default.clone())
    segments = [
        # The same addresses on another device belong to other memory: not these storages.
        segment(0, in_mempool.data_ptr(), in_mempool.nbytes, (0, 1)),
        segment(1, in_mempool.data_ptr(), in_mempool.nbytes, (0, 1)),
        segment(1, in_default.data_ptr(), in_default.nbytes, (0, 0)),
    ]
    pool = TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
        device_of=on_device({"m": in_mempool, "d": in_default}, 1),
        segments=lambda: segments,
    )
    pool.track({"m": in_mempool, "d": in_default}, "weights", True, "net")
    agent = agent_with(pool)
    report = agent.sleep_here(work_dir, 5.0, {})
    assert report["spill"]["warnings"] == [
        f"weights/net.m ({in_mempool.nbytes} bytes on cuda:1) lives in the private memory pool (0, 1) "
        "(a torch.cuda.MemPool or a CUDA graph's pool): releasing it frees nothing on the GPU, "
        "since empty_cache() does not return a live pool's blocks"
    ]
    agent.wake_here({})
    assert torch.equal(in_mempool, expected[0]) and torch.equal(in_default, expected[1]), "still hibernated"


@pytest.mark.parametrize(
    "address, pool",
    [(0x1000, (0, 0)), (0x1FFF, (0, 0)), (0x2000, (3, 0)), (0x2800, (3, 0)), (0x3000, None), (0x800, None)],
)
def test_pool_of_finds_the_segment_holding_an_address(address: int, pool: tuple[int, int] | None) -> None:
    segments = [segment(0, 0x1000, 0x1000, (0, 0)), segment(0, 0x2000, 0x1000, (3, 0))]
    assert pool_of(0, address, segments) == pool
    assert pool_of(1, address, segments) is None
    unnamed = [{k: v for k, v in s.items() if k != "segment_pool_id"} for s in segments]
    assert pool_of(0, address, unnamed) is None, "a torch that does not name the pool: unknown"


def test_the_warnings_and_resident_bytes_reach_the_sleep_report() -> None:
    phases = {
        "spill": {"seconds": 1.0, "warnings": ["w/x lives in the private memory pool (1, 0)"]},
        "release": {"released_bytes": 4096, "resident_bytes": 100},
    }
    process = ProcessSleep.from_answers(7, "p", phases)
    assert process.warnings == ["w/x lives in the private memory pool (1, 0)"]
    assert process.resident_bytes == 100
    wire = process.to_wire()
    assert ProcessSleep(**wire) == process
    older = {k: v for k, v in wire.items() if k not in ("warnings", "resident_bytes")}
    assert ProcessSleep(**older).warnings == [], "a report written before these fields still reads"
