"""hibernate's real CUDA seam (ctypes bindings, streams, pinning) against a fake CUDA runtime.

The fake libcudart (tests/standins/vllm_fake_cudart.c, compiled here) does
host memcpy/memset behind the real signatures and error codes, and refuses a
stream used while another device is current, so a missing cudaSetDevice in
any staging thread fails the test.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hibernate import procinfo
from hibernate.agent.controller import Agent
from hibernate.errors import UnsupportedError
from hibernate.integrations.vllm import HibernateBackend
from hibernate.pools.device import CudaDeviceMemory, CudaRuntime, DeviceMemoryError
from tests.standins.vllm_cumem import MODULE_NAME, FakeCudaRT, make_module
from tests.standins.vllm_memory import (
    LAYOUT,
    HostReservations,
    StandInCuMemAllocator,
    create_and_map,
    populate,
    unmap_and_release,
)


@pytest.fixture
def cudart(cudart_path: Path) -> FakeCudaRT:
    lib = FakeCudaRT(cudart_path)
    for counter in ("fake_streams_created", "fake_copies", "fake_copied_bytes", "fake_registered_peak"):
        lib.set_counter(counter, 0)
    lib.set_counter("fake_fail_copy_at", -1)
    lib.set_counter("fake_fail_run_at", -1)
    return lib


@pytest.fixture
def reservations() -> HostReservations:
    return HostReservations()


def make_backend(
    reservations: HostReservations, cudart: FakeCudaRT, spill_dir: Path, device: int
) -> tuple[HibernateBackend, StandInCuMemAllocator, dict[int, bytes]]:
    allocator = StandInCuMemAllocator(reservations, device=device)
    contents = populate(allocator, LAYOUT, seed=device)
    memory = CudaDeviceMemory(
        CudaRuntime(cudart.lib),
        functools.partial(create_and_map, reservations),
        functools.partial(unmap_and_release, reservations),
    )
    agent = Agent(procinfo.identity(os.getpid()), name=f"dev{device}")  # type: ignore[arg-type]
    env = {"HIBERNATE_DIR": str(spill_dir), "HIBERNATE_BUFFER_MB": "4", "HIBERNATE_CHUNK_MB": "1"}
    return HibernateBackend(allocator=allocator, device=memory, agent=agent, environ=env), allocator, contents


def test_spill_and_restore_through_the_cuda_runtime_are_exact_on_a_non_zero_device(
    reservations: HostReservations, cudart: FakeCudaRT, work_dir: Path
) -> None:
    backend, allocator, contents = make_backend(reservations, cudart, work_dir, device=2)
    for cycle in range(3):
        backend.suspend(1)
        assert not any(reservations.is_mapped(a) for a in contents)
        backend.resume()
        for address, before in contents.items():
            tag = allocator.pointer_to_data[address].tag
            expected = bytes(len(before)) if tag in ("kv_cache", "workspace") else before
            assert reservations.read(address, len(before)) == expected, f"cycle {cycle}: {tag}"
    # Streams are pooled: as many as ever ran at once (three readers), not one per thread per cycle.
    assert 0 < cudart.counter("fake_streams_created") <= 4
    # Staging was page-locked within its budget and released after each transfer.
    assert 0 < cudart.counter("fake_registered_peak") <= 4 << 20
    assert cudart.counter("fake_registered_bytes") == 0
    for address in list(allocator.pointer_to_data):
        allocator.free(address)


def test_a_cuda_error_during_the_spill_is_reported_in_cudas_words_and_nothing_is_lost(
    reservations: HostReservations, cudart: FakeCudaRT, work_dir: Path
) -> None:
    backend, allocator, contents = make_backend(reservations, cudart, work_dir, device=1)
    cudart.set_counter("fake_fail_copy_at", 2)
    with pytest.raises(DeviceMemoryError, match="an illegal memory access was encountered"):
        backend.suspend(1)
    assert backend.state() == "RUNNING"
    for address, before in contents.items():
        assert reservations.is_mapped(address) and reservations.read(address, len(before)) == before
    assert cudart.counter("fake_registered_bytes") == 0
    for address in list(allocator.pointer_to_data):
        allocator.free(address)


def test_a_refused_page_lock_falls_back_to_pageable_staging(cudart: FakeCudaRT) -> None:
    runtime = CudaRuntime(cudart.lib)
    memory = CudaDeviceMemory(runtime, lambda h: None, lambda h: None)
    pin = memory.pinner()
    assert pin is not None
    view = memoryview(bytearray(8192))
    unpin = pin(view)
    assert unpin is not None and cudart.counter("fake_registered_bytes") == 8192
    # The same range again is refused by the runtime: no error, no unpin (not page-locked), the
    # error cleared.
    assert pin(view) is None
    assert cudart.counter("fake_registered_bytes") == 8192
    unpin()
    assert cudart.counter("fake_registered_bytes") == 0


# -- the seam of a vLLM worker, from vLLM's own module ---------------------------------------


@pytest.fixture
def cumem_module(
    monkeypatch: pytest.MonkeyPatch, reservations: HostReservations, cudart: FakeCudaRT
) -> Iterator[object]:
    module = make_module(reservations, cudart)
    monkeypatch.setitem(sys.modules, MODULE_NAME, module)
    monkeypatch.setattr(StandInCuMemAllocator, "instance", None)
    yield module


def test_from_vllm_binds_vllms_map_unmap_and_its_libcudart(
    cumem_module: object, reservations: HostReservations
) -> None:
    memory = CudaDeviceMemory.from_vllm()
    address = reservations.reserve(4096)
    handle = (0, 4096, address, 0)
    memory.zero(0, address, 4096)
    memory.synchronize(0)  # a fill is only queued: it must have run before the memory goes
    memory.unmap(handle)
    assert not reservations.is_mapped(address)
    memory.map(handle)
    memory.copy_from_host(0, address, memoryview(b"\x01" * 4096))
    out = memoryview(bytearray(4096))
    memory.copy_to_host(0, address, out)
    assert bytes(out) == b"\x01" * 4096
    reservations.free(address)


def test_without_vllms_cumem_module_the_seam_says_it_is_unsupported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, MODULE_NAME, None)  # import fails, as on a machine without libcuda
    with pytest.raises(UnsupportedError, match="cannot be imported"):
        CudaDeviceMemory.from_vllm()
