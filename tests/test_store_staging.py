"""Staging memory: huge-page buffers behave as plain ones, and a lazy pool allocates only what is used."""

from __future__ import annotations

import mmap
import threading

import pytest

from hibernate.store import directio
from hibernate.store.directio import PipelineAborted, StagingBuffer, StagingPool

MiB = 1 << 20


@pytest.mark.parametrize("huge", [False, True])
def test_a_staging_buffer_is_zeroed_writable_and_page_aligned(huge: bool) -> None:
    buffer = StagingBuffer(4 * MiB, huge=huge)
    try:
        assert len(buffer.view) == 4 * MiB and not buffer.view.readonly
        assert buffer.view[:: mmap.PAGESIZE].tobytes() == bytes(4 * MiB // mmap.PAGESIZE)
        buffer.view[-1] = 7
        assert buffer.view[-1] == 7
    finally:
        buffer.close()


def test_a_lazy_pool_allocates_a_buffer_only_when_none_is_free() -> None:
    abort = threading.Event()
    pool = StagingPool(4 * MiB, MiB, lazy=True, huge=True)
    try:
        assert pool.total_bytes == 0
        first = pool.take(abort)
        pool.give(first)
        assert pool.take(abort) is first and pool.total_bytes == MiB  # reused, not a second one
        taken = [first] + [pool.take(abort) for _ in range(3)]
        assert len({id(b) for b in taken}) == 4 and pool.total_bytes == 4 * MiB
        abort.set()
        with pytest.raises(PipelineAborted):
            pool.take(abort)  # the pool is full: it waits for a buffer rather than allocating
        assert pool.total_bytes == 4 * MiB
    finally:
        pool.close()


def test_an_eager_pool_allocates_all_its_buffers_at_the_first_take() -> None:
    pool = StagingPool(3 * MiB, MiB)
    try:
        pool.take(threading.Event())
        assert pool.total_bytes == 3 * MiB
    finally:
        pool.close()


def test_prefill_allocates_within_the_pool_size_and_takes_use_those_first() -> None:
    abort = threading.Event()
    pool = StagingPool(3 * MiB, MiB, lazy=True, huge=True)
    try:
        pool.prefill(2)
        assert pool.total_bytes == 2 * MiB
        pool.take(abort), pool.take(abort)
        assert pool.total_bytes == 2 * MiB  # both came from the prefill
        pool.prefill(5)
        assert pool.total_bytes == 3 * MiB  # never past the pool's size
    finally:
        pool.close()


def test_a_failed_allocation_leaves_the_pool_able_to_allocate(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = StagingPool(2 * MiB, MiB, lazy=True)
    real = directio.StagingBuffer

    def refuse(size: int, *, huge: bool = False) -> StagingBuffer:
        raise MemoryError

    monkeypatch.setattr(directio, "StagingBuffer", refuse)
    with pytest.raises(MemoryError):
        pool.take(threading.Event())
    monkeypatch.setattr(directio, "StagingBuffer", real)
    abort = threading.Event()
    timer = threading.Timer(5, abort.set)  # a take waiting for the failed one raises PipelineAborted
    timer.start()
    try:
        assert pool.take(abort) is not None and pool.total_bytes == MiB
    finally:
        timer.cancel()
        pool.close()
