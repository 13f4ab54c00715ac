"""The stand-in CUDA runtime (tests/standins/vllm_fake_cudart.c) keeps the runtime's event contract.

hibernate's device seam frees staging memory once an event recorded after
its copies completed; the stand-in only runs queued work when something
waits, so these tests pin exactly what waiting on an event runs, and what it
leaves queued, through the library's own symbols.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.standins.vllm_cumem import FakeCudaRT

NON_BLOCKING = 1
DISABLE_TIMING = 2
NOT_READY = 600
INVALID_RESOURCE_HANDLE = 400
ILLEGAL_ADDRESS = 700


@pytest.fixture
def cudart(cudart_path: Path) -> Iterator[FakeCudaRT]:
    lib = FakeCudaRT(cudart_path)
    lib.set_counter("fake_fail_run_at", -1)
    lib.set_counter("fake_fail_copy_at", -1)
    assert lib.lib.cudaSetDevice(0) == 0
    lib.lib.cudaGetLastError()
    yield lib
    lib.set_counter("fake_fail_run_at", -1)  # the library is the process's: the next test's copies
    assert lib.lib.cudaSetDevice(0) == 0


def stream_on(cudart: FakeCudaRT, device: int) -> ctypes.c_void_p:
    stream = ctypes.c_void_p()
    assert cudart.lib.cudaSetDevice(device) == 0
    assert cudart.lib.cudaStreamCreateWithFlags(ctypes.byref(stream), NON_BLOCKING) == 0
    return stream


def event_on(cudart: FakeCudaRT, device: int) -> ctypes.c_void_p:
    event = ctypes.c_void_p()
    assert cudart.lib.cudaSetDevice(device) == 0
    assert cudart.lib.cudaEventCreateWithFlags(ctypes.byref(event), DISABLE_TIMING) == 0
    return event


def fill(
    cudart: FakeCudaRT, memory: ctypes.Array[ctypes.c_uint8], value: int, stream: ctypes.c_void_p
) -> None:
    address = ctypes.c_void_p(ctypes.addressof(memory))
    assert cudart.lib.cudaMemsetAsync(address, value, len(memory), stream) == 0


def test_an_event_completes_once_the_work_queued_before_its_record_ran_and_no_later(
    cudart: FakeCudaRT,
) -> None:
    stream, event = stream_on(cudart, 1), event_on(cudart, 1)
    before, after = (ctypes.c_uint8 * 64)(), (ctypes.c_uint8 * 64)()
    fill(cudart, before, 1, stream)
    assert cudart.lib.cudaEventRecord(event, stream) == 0
    fill(cudart, after, 2, stream)
    assert cudart.lib.cudaEventQuery(event) == NOT_READY, "nothing ran: work runs only when waited for"
    assert cudart.lib.cudaGetLastError() == 0, "not ready is an answer, not an error"
    waits = cudart.counter("fake_synchronize_count")
    assert cudart.lib.cudaEventSynchronize(event) == 0
    assert cudart.counter("fake_synchronize_count") == waits + 1
    assert bytes(before) == b"\x01" * 64, "what was queued before the record ran"
    assert bytes(after) == bytes(64), "what was queued after it has not"
    assert cudart.lib.cudaEventQuery(event) == 0
    assert cudart.lib.cudaStreamSynchronize(stream) == 0
    assert bytes(after) == b"\x02" * 64
    assert cudart.lib.cudaEventDestroy(event) == 0


def test_an_event_never_recorded_is_complete_and_a_record_again_moves_it(cudart: FakeCudaRT) -> None:
    stream, event = stream_on(cudart, 0), event_on(cudart, 0)
    assert cudart.lib.cudaEventQuery(event) == 0 and cudart.lib.cudaEventSynchronize(event) == 0
    first, second = (ctypes.c_uint8 * 16)(), (ctypes.c_uint8 * 16)()
    assert cudart.lib.cudaEventRecord(event, stream) == 0
    fill(cudart, first, 3, stream)
    assert cudart.lib.cudaEventRecord(event, stream) == 0  # the newest record is the one that counts
    fill(cudart, second, 4, stream)
    assert cudart.lib.cudaEventSynchronize(event) == 0
    assert bytes(first) == b"\x03" * 16 and bytes(second) == bytes(16)
    assert cudart.lib.cudaStreamSynchronize(stream) == 0
    assert cudart.lib.cudaEventDestroy(event) == 0


def test_an_event_destroyed_while_pending_is_freed_once_its_stream_ran(cudart: FakeCudaRT) -> None:
    stream, event = stream_on(cudart, 2), event_on(cudart, 2)
    memory = (ctypes.c_uint8 * 16)()
    fill(cudart, memory, 5, stream)
    assert cudart.lib.cudaEventRecord(event, stream) == 0
    destroyed = cudart.counter("fake_events_destroyed")
    assert cudart.lib.cudaEventDestroy(event) == 0, "returns at once, as the runtime does"
    assert cudart.counter("fake_events_destroyed") == destroyed + 1
    assert cudart.lib.cudaEventQuery(event) == INVALID_RESOURCE_HANDLE
    cudart.lib.cudaGetLastError()
    assert cudart.lib.cudaStreamSynchronize(stream) == 0  # runs the marker of the destroyed event
    assert bytes(memory) == b"\x05" * 16


def test_an_event_is_recorded_only_on_a_stream_of_its_device_made_current(cudart: FakeCudaRT) -> None:
    stream, event = stream_on(cudart, 1), event_on(cudart, 3)
    assert cudart.lib.cudaSetDevice(1) == 0
    assert cudart.lib.cudaEventRecord(event, stream) == INVALID_RESOURCE_HANDLE
    assert cudart.lib.cudaGetLastError() == INVALID_RESOURCE_HANDLE
    assert cudart.lib.cudaEventCreateWithFlags(ctypes.byref(ctypes.c_void_p()), 8) == 1, "unknown flag"
    cudart.lib.cudaGetLastError()
    assert cudart.lib.cudaEventDestroy(event) == 0


def test_a_copy_that_fails_when_it_runs_is_reported_by_the_wait_not_the_call(cudart: FakeCudaRT) -> None:
    stream, event = stream_on(cudart, 0), event_on(cudart, 0)
    source, target = (ctypes.c_uint8 * 32)(*range(32)), (ctypes.c_uint8 * 32)()
    cudart.set_counter("fake_fail_run_at", cudart.counter("fake_copies"))
    copy = cudart.lib.cudaMemcpyAsync(
        ctypes.c_void_p(ctypes.addressof(target)), ctypes.c_void_p(ctypes.addressof(source)), 32, 4, stream
    )
    assert copy == 0, "queued: a GPU finds the fault only when the copy runs"
    assert cudart.lib.cudaEventRecord(event, stream) == 0
    assert cudart.lib.cudaEventSynchronize(event) == ILLEGAL_ADDRESS
    assert cudart.lib.cudaGetLastError() == ILLEGAL_ADDRESS
    assert bytes(target) == bytes(32), "nothing copied"
    assert cudart.lib.cudaEventQuery(event) == 0, "the work ran (and failed): the event completed"
    assert cudart.lib.cudaStreamSynchronize(stream) == 0, "not sticky, unlike a real context"
    assert cudart.lib.cudaEventDestroy(event) == 0
