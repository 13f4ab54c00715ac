"""Staging memory: huge-page buffers behave as plain ones, and a lazy pool allocates only what is used."""

from __future__ import annotations

import mmap
import threading

import pytest

from hibernate.store import directio, hugepages
from hibernate.store.directio import PipelineAbortedError, StagingBuffer, StagingPool

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
        with pytest.raises(PipelineAbortedError):
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
    timer = threading.Timer(5, abort.set)  # a take waiting for the failed one raises PipelineAbortedError
    timer.start()
    try:
        assert pool.take(abort) is not None and pool.total_bytes == MiB
    finally:
        timer.cancel()
        pool.close()


# -- huge pages for the memory a wake refills (hibernate.store.hugepages) --------------

BUDDYINFO = """\
Node 0, zone      DMA      0      0      0      0      0      0      0      0      1      1      3
Node 0, zone    DMA32      2      2      3      1      2      2      1      4      4      2    752
Node 0, zone   Normal   1702   1102   4167   8406   2957   3862   1127    962    271    214    549
"""


def test_free_huge_blocks_count_only_blocks_of_2_mib_and_more() -> None:
    # order 9 (2 MiB) and order 10 (4 MiB) blocks, with 4 KiB pages: (1+2+214) x 2 MiB + (3+752+549) x 4 MiB
    expected = (1 + 2 + 214) * (2 << 20) + (3 + 752 + 549) * (4 << 20)
    assert hugepages.free_huge_block_bytes(BUDDYINFO, page_bytes=4096) == expected


def test_a_buddyinfo_line_that_does_not_parse_counts_nothing() -> None:
    text = "Node 0, zone Normal 1 2 x\ngarbage\nNode 0, zone DMA " + " ".join(["0"] * 10 + ["1"])
    assert hugepages.free_huge_block_bytes(text, page_bytes=4096) == 4 << 20


def test_free_page_reporting_is_seen_on_a_balloon_device_only() -> None:
    reporting = "0110010100000000000000000000000010000000"
    assert hugepages.reports_free_pages({0x0005: reporting, 0x0002: "0" * 40})
    assert not hugepages.reports_free_pages({0x0005: "0110000100000000", 0x0001: reporting})
    assert not hugepages.reports_free_pages({})


def test_the_environment_overrides_the_huge_page_decision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HIBERNATE_HUGE_PAGES", "1")
    assert hugepages.huge_pages_pay_off(1)
    monkeypatch.setenv("HIBERNATE_HUGE_PAGES", "0")
    assert not hugepages.huge_pages_pay_off(1 << 40)


def test_populate_with_huge_pages_keeps_the_contents() -> None:
    size = 8 << 20
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory[: 1 << 20] = bytes(range(256)) * 4096
    view = memoryview(memory)[4096 + 64 :]  # not aligned, as a tensor's storage is not
    directio.populate(view, threading.Event(), huge=True)
    assert memory[: 1 << 20] == bytes(range(256)) * 4096
    assert memory[1 << 20 :] == bytes(size - (1 << 20))
    view.release()
    memory.close()
