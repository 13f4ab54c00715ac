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
import random
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from hibernate.errors import UnsupportedError
from hibernate.operation.reports import ProcessSleep
from hibernate.pools.capture import SeenGraph
from hibernate.pools.device import (
    CudaCopies,
    CudaFence,
    CudaRuntime,
    DeviceCopies,
    DeviceMemoryError,
    DeviceRegion,
    choose_cudart,
    deferred_copies,
    loaded_cudart,
)
from hibernate.pools.hostpages import HostMapping
from hibernate.pools.tensors import TensorPool, pool_of
from hibernate.store.layout import SpillRoot
from hibernate.store.options import WriteOptions
from hibernate.store.pipeline import PinFn
from hibernate.store.reader import ReadResult, SnapshotReader
from hibernate.store.writer import write_snapshot
from tests.conftest import REPO
from tests.pooled import agent_with
from tests.standins.vllm_cumem import FakeCudaRT

NON_BLOCKING = 1


@pytest.fixture
def cudart(cudart_path: Path) -> FakeCudaRT:
    lib = FakeCudaRT(cudart_path)
    for counter in ("fake_copies", "fake_copied_bytes", "fake_registered_peak"):
        lib.set_counter(counter, 0)
    lib.set_counter("fake_fail_copy_at", -1)
    lib.set_counter("fake_fail_run_at", -1)
    lib.lib.cudaGetLastError()  # this thread's error slot, as a test before this one may have left it
    return lib


def no_graphs() -> list[SeenGraph]:
    """No CUDA graph seen at a capture: what these tests pin does not depend on another test's graphs."""
    return []


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


def test_a_side_stream_write_still_in_flight_when_the_guard_exits_is_in_the_snapshot(
    cudart: FakeCudaRT, work_dir: Path
) -> None:
    weights = torch.zeros(1 << 20, dtype=torch.uint8)
    cache = torch.full((1 << 16,), 3, dtype=torch.uint8)
    pool = TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
        device_of=on_device({"w": weights, "c": cache}, 1),
        graphs=no_graphs,
    )
    pool.track(weights, "weights", True, "w")
    pool.track(cache, "kv_cache", False, "c")
    agent = agent_with(pool, "device-test")
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


def current_device(cudart: FakeCudaRT) -> int:
    device = ctypes.c_int()
    assert cudart.lib.cudaGetDevice(ctypes.byref(device)) == 0
    return device.value


def test_copies_and_fills_on_the_callers_thread_leave_its_current_device_as_it_was(
    cudart: FakeCudaRT,
) -> None:
    copies = CudaCopies(CudaRuntime(cudart.lib))
    memory = (ctypes.c_uint8 * 4096)()
    assert cudart.lib.cudaSetDevice(2) == 0  # the program's current device: what device='cuda' means
    copies.copy_from_host(1, ctypes.addressof(memory), memoryview(bytearray(b"\x05" * 4096)))
    assert current_device(cudart) == 2
    back = bytearray(4096)
    copies.copy_to_host(3, ctypes.addressof(memory), memoryview(back))
    assert current_device(cudart) == 2 and back == b"\x05" * 4096
    copies.zero(1, ctypes.addressof(memory), 4096)
    assert current_device(cudart) == 2 and bytes(memory) == b"\x05" * 4096, "a fill is only queued"
    copies.synchronize(1)
    assert current_device(cudart) == 2 and bytes(memory) == bytes(4096)
    copies.zero(2, ctypes.addressof(memory), 16)  # already current: stays so
    assert current_device(cudart) == 2
    copies.synchronize(2)  # the fill ran before ``memory`` goes


def test_a_failed_device_call_leaves_neither_its_device_current_nor_its_error_pending(
    cudart: FakeCudaRT,
) -> None:
    """torch checks cudaGetLastError after its next launch: an error left there would be blamed on it."""
    copies = CudaCopies(CudaRuntime(cudart.lib))
    memory = (ctypes.c_uint8 * 4096)()
    assert cudart.lib.cudaSetDevice(2) == 0
    cudart.set_counter("fake_fail_copy_at", cudart.counter("fake_copies"))
    with pytest.raises(DeviceMemoryError, match="an illegal memory access was encountered"):
        copies.copy_to_host(1, ctypes.addressof(memory), memoryview(bytearray(4096)))
    assert current_device(cudart) == 2
    assert cudart.lib.cudaGetLastError() == 0
    with pytest.raises(DeviceMemoryError, match=r"cudaSetDevice\(7\) failed .* invalid device ordinal"):
        copies.zero(7, ctypes.addressof(memory), 4096)
    assert current_device(cudart) == 2
    assert cudart.lib.cudaGetLastError() == 0


@pytest.fixture(scope="module")
def primary_contexts(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The driver's primary-context query (tests/standins/fake_primary_contexts.c), no device's active."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.fail("no C compiler to build the driver stand-in")
    output = tmp_path_factory.mktemp("driver") / "libcuda-contexts.so"
    source = REPO / "tests" / "standins" / "fake_primary_contexts.c"
    build = [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(output), str(source)]
    subprocess.run(build, check=True, capture_output=True)
    return ctypes.CDLL(str(output))


def device_after_a_copy_on_a_fresh_thread(cudart: FakeCudaRT, copies: CudaCopies, device: int) -> int:
    """A staging thread's current device once its copy to ``device`` is done (it started on device 0)."""
    memory = (ctypes.c_uint8 * 64)()
    found: list[int] = []

    def stage() -> None:
        copies.copy_to_host(device, ctypes.addressof(memory), memoryview(bytearray(64)))
        found.append(current_device(cudart))

    thread = threading.Thread(target=stage)
    thread.start()
    thread.join()
    return found[0]


def test_a_thread_is_not_put_back_on_a_device_that_has_no_context(
    cudart: FakeCudaRT, primary_contexts: ctypes.CDLL
) -> None:
    """cudaSetDevice creates the device's primary context: putting a staging thread back on device 0
    would cost GPU 0 hundreds of MiB in a process that never used it (a vLLM worker of rank 1)."""
    copies = CudaCopies(CudaRuntime(cudart.lib, driver=primary_contexts))
    active = ctypes.c_longlong.in_dll(primary_contexts, "fake_active_contexts")
    queries = ctypes.c_longlong.in_dll(primary_contexts, "fake_state_queries")
    asked = queries.value
    active.value = 0b0010  # only device 1 is in use
    assert device_after_a_copy_on_a_fresh_thread(cudart, copies, 1) == 1, (
        "left on device 1: no context made on 0"
    )
    assert queries.value == asked + 1
    active.value = 0b0011  # device 0 in use too
    assert device_after_a_copy_on_a_fresh_thread(cudart, copies, 1) == 0, "put back where it was"
    assert cudart.lib.cudaSetDevice(2) == 0
    memory = (ctypes.c_uint8 * 16)()
    copies.zero(2, ctypes.addressof(memory), 16)
    assert queries.value == asked + 2, "already on the device: nothing to put back, nothing asked"
    copies.synchronize(2)  # the fill ran before ``memory`` goes


# -- copies queued, one wait per staging chunk --------------------------------------------------

KiB = 1 << 10


class QueuedRegion(DeviceRegion):
    """Host memory moved only through the seam, as CUDA memory is, so every copy is queued on a stream
    of the stand-in runtime and runs only when something waits for it."""

    def __init__(self, key: str, copies: CudaCopies, device: int, data: bytes) -> None:
        self.memory = (ctypes.c_uint8 * max(1, len(data)))()
        ctypes.memmove(self.memory, data, len(data))
        super().__init__(key, "weights", True, len(data), device, ctypes.addressof(self.memory))
        self._seam = copies

    def _copies(self) -> DeviceCopies:
        return self._seam

    def bytes(self) -> bytes:
        return ctypes.string_at(self.address, self.nbytes)

    def blank(self) -> None:
        ctypes.memset(self.address, 0xA5, self.nbytes)


def queued_regions(copies: CudaCopies, count: int, seed: int) -> tuple[list[QueuedRegion], list[bytes]]:
    """``count`` regions of 1 B to 20 KiB on devices 1 and 3 (some span several 8 KiB chunks)."""
    rng = random.Random(seed)
    contents = [rng.randbytes(rng.randint(1, 20 * KiB)) for _ in range(count)]
    regions = [
        QueuedRegion(f"weights/r{i}", copies, 1 + 2 * (i % 2), data) for i, data in enumerate(contents)
    ]
    return regions, contents


def spill(path: Path, regions: list[QueuedRegion], pin: PinFn | None) -> str:
    options = WriteOptions(chunk_bytes=8 * KiB, buffer_bytes=32 * KiB)
    with SpillRoot(path, create=True) as root:
        return write_snapshot(root, regions, producer={"test": True}, options=options, pin=pin).snapshot


def restore(path: Path, snapshot: str, regions: list[QueuedRegion], pin: PinFn | None) -> ReadResult:
    with SpillRoot(path) as root, SnapshotReader(root, snapshot) as reader:
        return reader.read_into(regions, buffer_bytes=32 * KiB, threads=2, io_depth=2, pin=pin)


def test_staging_recycled_while_its_copies_are_queued_lands_every_byte(
    cudart: FakeCudaRT, work_dir: Path
) -> None:
    """32 KiB of staging for 3 MiB: the reader takes each buffer back many times, and the stand-in runs
    a queued copy only when someone waits. A buffer read into again before the copies from it ran
    would hand the device the next request's bytes; a chunk hashed before its copy ran would be
    written as the staging's stale bytes."""
    copies = CudaCopies(CudaRuntime(cudart.lib))
    regions, contents = queued_regions(copies, 300, seed=7)
    pin = copies.pinner()
    snapshot = spill(work_dir, regions, pin)
    for region in regions:
        region.blank()
    streams = cudart.counter("fake_streams_created")
    result = restore(work_dir, snapshot, regions, pin)
    assert result.staging_bytes <= 32 * KiB and result.total_bytes > 80 * result.staging_bytes, "recycled"
    for region, data in zip(regions, contents, strict=True):
        assert region.bytes() == data, f"{region.key} is not bit-exact"
    assert cudart.counter("fake_streams_created") - streams <= 4, "a worker's stream per device, reused"
    assert cudart.counter("fake_registered_bytes") == 0, "staging unpinned, once its copies ran"


def test_a_wake_of_many_small_device_tensors_waits_once_per_staging_buffer_not_per_tensor(
    cudart: FakeCudaRT, work_dir: Path
) -> None:
    """One synchronize per region copy was 1,001 waits for a sleep of 1,000 tensors of 1 KiB and as
    many for its wake (the device's own at the end included); copies are now queued a staging chunk
    at a time."""
    generator = torch.Generator().manual_seed(3)
    tensors = {
        f"t{i}": torch.randint(0, 256, (KiB,), dtype=torch.uint8, generator=generator) for i in range(1000)
    }
    before = {name: tensor.clone() for name, tensor in tensors.items()}
    pool = TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)), device_of=on_device(tensors, 1), graphs=no_graphs
    )
    pool.track(tensors, "weights", True, "net")
    agent = agent_with(pool, "device-test")
    waits = cudart.counter("fake_synchronize_count")
    agent.sleep_here(work_dir, 5.0, {"buffer_mb": 1})
    slept = cudart.counter("fake_synchronize_count")
    agent.wake_here({"buffer_mb": 1})
    woke = cudart.counter("fake_synchronize_count")
    assert all(torch.equal(tensors[name], before[name]) for name in tensors), "bit-exact"
    assert slept - waits < len(tensors) // 20, f"{slept - waits} waits to spill {len(tensors)} tensors"
    assert woke - slept < len(tensors) // 20, f"{woke - slept} waits to restore {len(tensors)} tensors"
    assert cudart.counter("fake_last_device_synchronize") > cudart.counter("fake_last_queued"), (
        "the wake still ends with the device synchronized"
    )


def test_a_copy_refused_when_queued_names_its_region_and_leaves_nothing_queued_on_freed_staging(
    cudart: FakeCudaRT, work_dir: Path
) -> None:
    copies = CudaCopies(CudaRuntime(cudart.lib))
    regions, _ = queued_regions(copies, 60, seed=11)
    pin = copies.pinner()
    cudart.set_counter("fake_fail_copy_at", cudart.counter("fake_copies") + 25)
    with pytest.raises(
        DeviceMemoryError, match=r"copying weights/r\d+ \(\+\d+\) to the host failed: .*illegal"
    ):
        spill(work_dir / "spill", regions, pin)
    snapshot = spill(work_dir, regions, pin)
    cudart.set_counter("fake_fail_copy_at", cudart.counter("fake_copies") + 25)
    with pytest.raises(
        DeviceMemoryError, match=r"copying weights/r\d+ \(\+\d+\) to the device failed: .*illegal"
    ):
        restore(work_dir, snapshot, regions, pin)
    assert cudart.counter("fake_registered_bytes") == 0
    # Whatever was queued before the failure ran before its staging went: running the queues now
    # would otherwise read unmapped memory.
    copies.synchronize(1)
    copies.synchronize(3)


def test_a_copy_that_fails_when_it_runs_fails_the_wake_at_its_fence(
    cudart: FakeCudaRT, work_dir: Path
) -> None:
    copies = CudaCopies(CudaRuntime(cudart.lib))
    regions, _ = queued_regions(copies, 60, seed=13)
    pin = copies.pinner()
    snapshot = spill(work_dir, regions, pin)
    cudart.set_counter("fake_fail_run_at", cudart.counter("fake_copies") + 25)
    with pytest.raises(
        DeviceMemoryError, match=r"queued on device [13] failed when it ran.*illegal memory access"
    ):
        restore(work_dir, snapshot, regions, pin)
    cudart.set_counter("fake_fail_run_at", -1)
    assert cudart.counter("fake_registered_bytes") == 0
    copies.synchronize(1)
    copies.synchronize(3)


def test_a_fence_covers_what_its_block_queued_and_not_what_came_after(cudart: FakeCudaRT) -> None:
    """The event is recorded on the stream the thread held for the block: a later copy of another
    block, even on a stream taken back from the same pool, is not waited for by it."""
    copies = CudaCopies(CudaRuntime(cudart.lib))
    first, second = (ctypes.c_uint8 * 64)(), (ctypes.c_uint8 * 64)()
    staging = bytearray(b"\x07" * 64)
    with deferred_copies() as queued:
        copies.copy_from_host(2, ctypes.addressof(first), memoryview(staging))
        copies.copy_from_host(2, ctypes.addressof(second), memoryview(b"\x09" * 64))  # read-only: kept
    fence = queued.fence
    assert isinstance(fence, CudaFence) and not fence.done(), "queued, not run"
    with deferred_copies() as later:
        copies.zero(2, ctypes.addressof(first), 64)
    assert bytes(first) == bytes(64) and bytes(second) == bytes(64)
    fence.wait()
    assert bytes(first) == b"\x07" * 64 and bytes(second) == b"\x09" * 64, "both ran, the read-only copy kept"
    assert fence.done()
    assert isinstance(later.fence, CudaFence) and not later.fence.done(), "the later block's fill has not run"
    later.fence.wait()
    assert bytes(first) == bytes(64)
    with deferred_copies() as idle:
        pass
    assert idle.fence is None, "nothing queued, nothing to wait for"


def test_a_block_left_by_an_exception_has_waited_for_what_it_queued(cudart: FakeCudaRT) -> None:
    copies = CudaCopies(CudaRuntime(cudart.lib))
    memory, staging = (ctypes.c_uint8 * 64)(), bytearray(b"\x03" * 64)
    with pytest.raises(KeyError), deferred_copies():
        copies.copy_from_host(1, ctypes.addressof(memory), memoryview(staging))
        raise KeyError("the verify of the next chunk failed")
    assert bytes(memory) == b"\x03" * 64
    with pytest.raises(RuntimeError, match="do not nest"), deferred_copies(), deferred_copies():
        pass


# -- which CUDA runtime: the one torch links --------------------------------------------------------

SITE = "/opt/venv/lib/python3.11/site-packages"
TORCH_DIRS = [f"{SITE}/torch", f"{SITE}/nvidia"]
CU12, CU13 = f"{SITE}/nvidia/cuda_runtime/lib/libcudart.so.12", f"{SITE}/nvidia/cu13/lib/libcudart.so.13"


@pytest.mark.parametrize(
    "paths, cuda_version, chosen",
    [
        # A pip torch for CUDA 13: the runtime from the nvidia wheel, among others.
        (["/usr/lib/x86_64-linux-gnu/libc.so.6", CU13], "13.0", 1),
        # An extension built for CUDA 12 loaded its own runtime, first, beside torch's.
        ([CU12, CU13], "13.0", 1),
        # The system's copy of the same major version, loaded first by another library: torch's wins.
        (["/usr/local/cuda-12.8/lib64/libcudart.so.12.8.90", CU12], "12.8", 1),
        # A runtime vendored into a wheel under auditwheel's hashed name.
        (["/usr/lib/libcudart.so.11.0", f"{SITE}/torch/lib/libcudart-9335f6a2.so.12"], "12.1", 1),
        # Conda: the one runtime, outside torch's directories, is taken.
        (["/opt/conda/lib/libcudart.so.12.4.127"], "12.4", 0),
        # A torch that names no CUDA version: the first runtime mapped.
        (["/a/libcudart.so.12", "/b/libcudart.so.13"], None, 0),
    ],
)
def test_the_cuda_runtime_torch_uses_is_chosen_among_the_mapped_ones(
    paths: list[str], cuda_version: str | None, chosen: int
) -> None:
    assert choose_cudart(paths, cuda_version, TORCH_DIRS) == paths[chosen]


def test_libraries_that_are_not_a_cuda_runtime_are_not_taken_for_one() -> None:
    paths = ["/tmp/libcudart-standin.so", "", "[heap]", "/x/libcudart_static.a", "/x/libcudart.so.12.bak"]
    assert choose_cudart(paths, "12.4", TORCH_DIRS) is None
    mappings = [HostMapping(0x1000, 0x2000, False, False, p) for p in paths]
    assert loaded_cudart(mappings) is None


TWO_RUNTIMES = """
import ctypes, sys
import torch
torch.version.cuda = "13.0"  # as a CUDA 13 build says
other, torchs = ctypes.CDLL(sys.argv[1]), ctypes.CDLL(sys.argv[2])
from hibernate.pools.device import CudaCopies
memory = (ctypes.c_uint8 * 64)()
CudaCopies.from_process().copy_to_host(0, ctypes.addressof(memory), memoryview(bytearray(64)))
print(*(ctypes.c_longlong.in_dll(lib, "fake_copies").value for lib in (other, torchs)))
"""


def test_of_two_runtimes_loaded_side_by_side_the_copies_use_the_one_torch_was_built_for(
    cudart_path: Path, tmp_path: Path
) -> None:
    # Two stand-in runtimes, each counting its own copies: another library's CUDA 12 one,
    # loaded first, and a CUDA 13 one under a vendored (hashed) name.
    other = tmp_path / "other" / "libcudart.so.12"
    torchs = tmp_path / "vendored" / "libcudart-1a2b3c4d.so.13"
    for path in (other, torchs):
        path.parent.mkdir()
        shutil.copy(cudart_path, path)
    run = subprocess.run(
        [sys.executable, "-c", TWO_RUNTIMES, str(other), str(torchs)],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", "1"], "the copy ran on the CUDA 13 runtime only"


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
        graphs=no_graphs,
    )
    pool.track({"m": in_mempool, "d": in_default}, "weights", True, "net")
    agent = agent_with(pool, "device-test")
    report = agent.sleep_here(work_dir, 5.0, {})
    assert report["spill"]["warnings"] == [
        f"weights/net.m ({in_mempool.nbytes} bytes on cuda:1) lives in the private memory pool (0, 1) "
        "(a torch.cuda.MemPool or a CUDA graph's pool): releasing it frees nothing on the GPU, "
        "since empty_cache() does not return a live pool's blocks"
    ]
    agent.wake_here({})
    assert torch.equal(in_mempool, expected[0]) and torch.equal(in_default, expected[1]), "still hibernated"


# torch's words (torch/csrc/cuda/CUDAPluggableAllocator.cpp) when the caching allocator was replaced.
PLUGGABLE_SNAPSHOT = (
    "CUDAPluggableAllocator does not yet support snapshot. "
    "If you need it, please file an issue describing your use case."
)


def test_with_a_pluggable_allocator_the_sleep_goes_on_and_says_the_pools_are_unknown(
    cudart: FakeCudaRT, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def snapshot(*args: object, **kwargs: object) -> None:
        raise RuntimeError(PLUGGABLE_SNAPSHOT)

    import hibernate.pools.tensors as tensors

    monkeypatch.setattr(tensors, "torch_cuda_in_use", lambda: True)  # the snapshot is asked for
    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    weights = torch.arange(4096, dtype=torch.int32)
    expected = weights.clone()
    pool = TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
        device_of=on_device({"w": weights}, 0),
        graphs=no_graphs,
    )
    pool.track(weights, "weights", True, "w")
    agent = agent_with(pool, "device-test")
    report = agent.sleep_here(work_dir, 5.0, {})
    assert weights.untyped_storage().nbytes() == 0, "asleep: the sleep did not fail"
    assert report["spill"]["warnings"] == [
        f"torch's CUDA allocator cannot list its memory pools ({PLUGGABLE_SNAPSHOT}): the process uses "
        "another allocator (RMM, torch.cuda.memory.change_current_allocator), so whether releasing the "
        f"1 tracked CUDA storages ({weights.nbytes} bytes) frees memory on the GPU, or leaves it with "
        "that allocator, is unknown"
    ]
    agent.wake_here({})
    assert torch.equal(weights, expected)


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
    phases: dict[str, dict[str, Any]] = {
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
