"""CPU storages torch cannot resize (numpy-shared, frombuffer/from_blob, memory maps) hibernated in place.

Whether pages really went back to the OS is read from /proc/self/pagemap (the
"present" bit of each page, readable without privileges) and from the
process's RSS, not taken on trust from the report.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import hibernate
from hibernate.errors import HibernatingError, UnsupportedError
from hibernate.pools import hostpages
from hibernate.pools.hostpages import (
    PAGE_SIZE,
    HostMapping,
    discard_pages,
    interior,
    kept_with_overlaps,
    parse_maps,
    placement,
)
from tests.conftest import REPO, wait_until
from tests.test_cli_json_schema import valid

MIB = 1 << 20


def present_pages(address: int, length: int) -> int:
    """How many pages of ``[address, address + length)`` are in RAM now (pagemap bit 63)."""
    first = address // PAGE_SIZE
    last = -(-(address + length) // PAGE_SIZE)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        raw = pagemap.read((last - first) * 8)
    return sum(1 for (entry,) in struct.iter_unpack("<Q", raw) if entry >> 63)


def pattern(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_a_numpy_shared_tensor_sleeps_frees_its_pages_and_wakes_bit_exact_at_the_same_address(
    fresh_agent: None, work_dir: Path
) -> None:
    tensor = pattern(64 * MIB, seed=1).view(torch.float32)
    array = tensor.numpy()  # from here torch cannot resize (free) this storage
    assert not tensor.untyped_storage().resizable()
    expected = tensor.clone()
    address = tensor.data_ptr()
    hibernate.track(tensor, name="shared")
    report = hibernate.sleep(work_dir)
    first, length = interior(address, tensor.nbytes)
    assert length > 60 * MIB
    assert present_pages(first, length) == 0, "the interior pages went back to the OS"
    release = report["release"]
    assert release["released_bytes"] == length
    assert release["resident_bytes"] == tensor.nbytes - length
    assert release["rss_before"] - release["rss_after"] >= 60 * MIB, "the process's RSS went down"
    assert report["spill"]["total_bytes"] == tensor.nbytes and report["spill"]["warnings"] == []
    with pytest.raises(HibernatingError, match="shared"):
        tensor.sum()
    hibernate.wake()
    assert tensor.data_ptr() == address and array.ctypes.data == address, "same address, numpy's too"
    assert torch.equal(tensor.view(torch.uint8), expected.view(torch.uint8))
    assert array.tobytes() == expected.numpy().tobytes(), "numpy sees the bytes again"


def test_a_from_blob_tensor_keeps_the_neighbours_of_its_partial_edge_pages(
    fresh_agent: None, work_dir: Path
) -> None:
    """torch.frombuffer is from_blob's Python face: memory owned by someone else, at an odd offset here."""
    size, offset = 8 * MIB, 100
    buffer = (ctypes.c_uint8 * size).from_buffer_copy(pattern(size, seed=2).numpy().tobytes())
    whole = bytes(buffer)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8, offset=offset, count=size - offset - 300)
    assert not tensor.untyped_storage().resizable()
    address = tensor.data_ptr()
    first, length = interior(address, tensor.nbytes)
    assert first > address and first + length < address + tensor.nbytes, "partial pages at both ends"
    hibernate.track(tensor, name="blob")
    report = hibernate.sleep(work_dir)
    assert report["release"]["resident_bytes"] == tensor.nbytes - length > 0
    assert present_pages(first, length) == 0
    assert present_pages(address, first - address) == 1, "the partial head page stays"
    base = ctypes.addressof(buffer)
    # Bytes outside the tensor on its edge pages belong to others: untouched while asleep.
    assert ctypes.string_at(base, offset) == whole[:offset]
    assert ctypes.string_at(base + size - 300, 300) == whole[-300:]
    hibernate.wake()
    assert tensor.data_ptr() == address
    assert bytes(buffer) == whole


def test_private_mappings_anonymous_or_of_a_file_come_back_and_dropped_ones_come_back_zero(
    fresh_agent: None, work_dir: Path, tmp_path: Path
) -> None:
    anonymous = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE)
    kept = torch.frombuffer(anonymous, dtype=torch.uint8)
    kept.copy_(pattern(4 * MIB, seed=3))
    file = tmp_path / "data.bin"
    file.write_bytes(pattern(4 * MIB, seed=4).numpy().tobytes())
    on_file = torch.from_file(str(file), shared=False, size=4 * MIB, dtype=torch.uint8)
    on_file[: 2 * MIB] = 7  # copy-on-write pages that exist only in this process
    expected, file_expected = kept.clone(), on_file.clone()
    cache = torch.from_file(str(file), shared=False, size=4 * MIB, dtype=torch.uint8)
    ranges = [(t.data_ptr(), t.nbytes) for t in (kept, on_file, cache)]
    hibernate.track(kept, name="anon")
    hibernate.track(on_file, name="file")
    hibernate.track(cache, tag="kv_cache", keep=False, name="cache")
    report = hibernate.sleep(work_dir)
    assert report["spill"]["warnings"] == []
    for address, nbytes in ranges:
        assert present_pages(address, nbytes) == 0
    hibernate.wake()
    assert torch.equal(kept, expected)
    assert torch.equal(on_file, file_expected)
    assert int(torch.count_nonzero(cache)) == 0, "dropped: zeros, not the file's bytes again"
    assert file.read_bytes() == pattern(4 * MIB, seed=4).numpy().tobytes(), "a private map never writes"
    del kept, on_file, cache
    anonymous.close()


def test_shared_mappings_are_left_in_place_and_named(
    fresh_agent: None, work_dir: Path, tmp_path: Path
) -> None:
    file = tmp_path / "weights.bin"
    file.write_bytes(bytes(2 * MIB))
    on_file = torch.from_file(str(file), shared=True, size=2 * MIB, dtype=torch.uint8)
    on_file.fill_(5)
    shared_memory = mmap.mmap(-1, 2 * MIB)  # MAP_SHARED | MAP_ANONYMOUS
    in_shm = torch.frombuffer(shared_memory, dtype=torch.uint8)
    in_shm.fill_(9)
    ordinary = torch.ones(1000)
    hibernate.track({"file": on_file, "shm": in_shm, "ordinary": ordinary}, name="m")
    report = hibernate.sleep(work_dir)
    warnings = report["spill"]["warnings"]
    assert len(warnings) == 2
    assert any("m.file" in w and str(file) in w and "data lives in the file" in w for w in warnings)
    assert any("m.shm" in w and "shared memory" in w for w in warnings)
    assert report["spill"]["total_bytes"] == ordinary.nbytes, "left in place: not in the snapshot"
    assert int(on_file.sum()) == 5 * 2 * MIB and int(in_shm.sum()) == 9 * 2 * MIB, "still usable"
    hibernate.wake()
    assert torch.equal(ordinary, torch.ones(1000))
    del on_file, in_shm
    shared_memory.close()


def mapping(start: int, end: int, perms: str = "rw-p", path: str = "") -> HostMapping:
    return parse_maps(f"{start:x}-{end:x} {perms} 00000000 00:00 0 {path}")[0]


@pytest.mark.parametrize(
    "mappings, hibernated, reason",
    [
        ([mapping(0x1000, 0x9000)], True, ""),
        ([mapping(0x1000, 0x3000, path="[heap]"), mapping(0x3000, 0x9000)], True, ""),
        ([mapping(0x1000, 0x9000, path="/data/weights.bin")], True, ""),
        ([mapping(0x1000, 0x9000, "rw-s", "/data/w.bin")], False, "/data/w.bin: its data lives in the file"),
        ([mapping(0x1000, 0x9000, "rw-s", "/dev/zero (deleted)")], False, "shared memory"),
        ([mapping(0x1000, 0x9000, "rw-s", "/dev/shm/torch_1_2")], False, "shared memory"),
        ([mapping(0x1000, 0x9000, "rw-s", "/memfd:x (deleted)")], False, "shared memory"),
        ([mapping(0x1000, 0x9000, "r--p", "/data/w.bin")], False, "read-only"),
        ([mapping(0x1000, 0x3000), mapping(0x4000, 0x9000)], False, "not (wholly) mapped"),
        ([mapping(0x1000, 0x5000)], False, "not (wholly) mapped"),
    ],
)
def test_placement_of_a_host_range(mappings: list[HostMapping], hibernated: bool, reason: str) -> None:
    where = placement(0x2000, 0x8000, mappings)
    assert where.hibernate is hibernated
    assert reason in where.reason and bool(where.reason) is not hibernated


def test_interior_is_the_whole_pages_inside() -> None:
    assert interior(0x1000, 0x3000, page=0x1000) == (0x1000, 0x3000)
    assert interior(0x1001, 0x3000, page=0x1000) == (0x2000, 0x2000)
    assert interior(0x1001, 0x10, page=0x1000) == (0x2000, 0)
    assert interior(0x1000, 0, page=0x1000) == (0x1000, 0)


def test_parse_maps_reads_the_fields_it_needs() -> None:
    text = (
        "7f00-8f00 rw-s 00000000 00:01 1050   /dev/zero (deleted)\n"
        "9000-a000 r-xp 00001000 fe:00 42 /usr/lib/libc.so.6\n"
        "b000-c000 rw-p 00000000 00:00 0\n"
    )
    assert parse_maps(text) == [
        HostMapping(0x7F00, 0x8F00, True, True, "/dev/zero (deleted)"),
        HostMapping(0x9000, 0xA000, False, False, "/usr/lib/libc.so.6"),
        HostMapping(0xB000, 0xC000, True, False, ""),
    ]


TARGET = """
import mmap, signal, sys, torch, hibernate
weights = torch.arange(1 << 20, dtype=torch.float32)
view = weights.numpy()  # numpy-shared: hibernated in place
shared = torch.frombuffer(mmap.mmap(-1, 1 << 20), dtype=torch.uint8)  # shared memory: left in place
hibernate.track({"weights": weights, "shared": shared}, name="m")
open(sys.argv[1], "w").write("ready")
signal.pause()
"""


def test_the_cli_reports_what_was_left_in_memory_and_the_resident_edges(
    cli: Callable[..., Any], runtime_dir: Path, work_dir: Path, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    target = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(ready)], env={**os.environ, "PYTHONPATH": str(REPO)}
    )
    try:
        wait_until(ready.exists, 120, "the target tracking its tensors")
        asleep = valid("sleep", cli("sleep", str(target.pid), "--to", str(work_dir), "--json"))
        (process,) = asleep["processes"]
        (warning,) = process["warnings"]
        assert warning.startswith("weights/m.shared (1048576 bytes) is left in memory: shared memory")
        assert process["total_bytes"] == 4 << 20, "the shared memory is not in the snapshot"
        assert 0 <= process["resident_bytes"] < 2 * PAGE_SIZE, "at most a partial page at each end"
        assert process["released_bytes"] == (4 << 20) - process["resident_bytes"]
        valid("wake", cli("wake", str(target.pid), "--json"))
        table = cli("sleep", str(target.pid), "--to", str(work_dir))
        assert table.returncode == 0 and "warning   weights/m.shared" in table.stdout, table.stdout
        assert cli("wake", str(target.pid)).returncode == 0
    finally:
        target.kill()
        target.wait()


def test_madv_dontneed_frees_nothing_of_shared_memory_which_is_why_it_is_left_in_place() -> None:
    """The fact behind leaving shared memory alone: its data (so its memory) survives MADV_DONTNEED."""
    shared = mmap.mmap(-1, 4 * MIB)  # MAP_SHARED | MAP_ANONYMOUS
    private = mmap.mmap(-1, 4 * MIB, flags=mmap.MAP_PRIVATE)
    for region in (shared, private):
        region.write(b"\x5a" * (4 * MIB))
        address = ctypes.addressof(ctypes.c_char.from_buffer(region))
        discard_pages(address, 4 * MIB)
        assert present_pages(address, 4 * MIB) == 0, "unmapped from this process either way"
    assert shared[: 4 * MIB] == b"\x5a" * (4 * MIB), "shared: the pages and their bytes are still there"
    assert private[: 4 * MIB] == bytes(4 * MIB), "private: gone, zero pages on the next touch"
    shared.close()
    private.close()


def test_a_dropped_tensor_sharing_numpy_memory_with_a_kept_one_is_kept(
    fresh_agent: None, work_dir: Path
) -> None:
    """Two storages over one numpy array: zero-filling the dropped one on wake would wipe the kept bytes."""
    whole = pattern(1 << 20, seed=5)
    array = whole.numpy()
    weights = torch.from_numpy(array)  # a storage of its own, over numpy's memory
    scratch = torch.from_numpy(array[100_000:300_000])  # another storage, over part of the same memory
    expected = weights.clone()
    hibernate.track(weights, name="w")
    hibernate.track(scratch, tag="kv_cache", keep=False, name="scratch")
    report = hibernate.sleep(work_dir)
    assert report["spill"]["dropped_bytes"] == 0, "kept, since it shares bytes with kept weights"
    hibernate.wake()
    assert torch.equal(weights, expected)


@pytest.mark.parametrize(
    "ranges, kept",
    [
        ([], []),
        ([(0, 10, True), (10, 20, False)], [True, False]),  # touching is not sharing
        ([(0, 10, True), (5, 20, False)], [True, True]),
        ([(5, 20, False), (0, 10, True), (15, 30, False), (40, 50, False)], [True, True, True, False]),
        ([(0, 100, False), (10, 20, False), (30, 40, True)], [True, True, True]),
        ([(0, 10, False), (2, 4, False)], [False, False]),
    ],
)
def test_kept_with_overlaps(ranges: list[tuple[int, int, bool]], kept: list[bool]) -> None:
    assert kept_with_overlaps(ranges) == kept


def mlocked(size: int) -> tuple[ctypes.Array[ctypes.c_uint8], int]:
    """A buffer whose pages are locked in memory (as under mlockall), and its address."""
    buffer = (ctypes.c_uint8 * size)()
    address = ctypes.addressof(buffer)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mlock(ctypes.c_void_p(address), ctypes.c_size_t(size)) != 0:
        pytest.skip(f"mlock refused here: {os.strerror(ctypes.get_errno())}")
    return buffer, address


def test_locked_memory_is_left_in_place_and_named(fresh_agent: None, work_dir: Path) -> None:
    buffer, address = mlocked(64 * 1024)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    tensor.fill_(3)
    hibernate.track(tensor, name="pinned")
    report = hibernate.sleep(work_dir)
    (warning,) = report["spill"]["warnings"]
    assert "locked in memory (mlock): MADV_DONTNEED cannot free it" in warning
    assert int(tensor.sum()) == 3 * 64 * 1024, "left as it was, usable"
    hibernate.wake()
    with pytest.raises(UnsupportedError, match="were not released") as refused:
        discard_pages(*interior(address, 64 * 1024))
    assert "mlock" in (refused.value.hint or "")
    assert bytes(buffer) == b"\x03" * (64 * 1024)


def test_parse_maps_reads_smaps_vmflags() -> None:
    text = (
        "7f00-8f00 rw-p 00000000 00:00 0\n"
        "Size:                 60 kB\n"
        "Rss:                  60 kB\n"
        "VmFlags: rd wr mr mw me lo ac sd\n"
        "9000-a000 rw-p 00000000 00:00 0 \n"
        "VmFlags: rd wr mr mw me ac sd\n"
    )
    first, second = parse_maps(text)
    assert "lo" in first.flags and "lo" not in second.flags
    assert (first.start, first.end, second.start) == (0x7F00, 0x8F00, 0x9000)
    where = placement(0x7F00, 0x8000, [first])
    assert not where.hibernate and "locked in memory" in where.reason
    assert placement(0x9000, 0x9100, [second]).hibernate


def test_pages_locked_after_the_enumeration_fail_the_sleep_which_rolls_back(
    fresh_agent: None, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    buffer, _ = mlocked(64 * 1024)
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    tensor.fill_(7)
    other = torch.arange(1000)
    hibernate.track({"locked": tensor, "other": other}, name="m")
    # The enumeration sees the mapping as it was before an mlock: maps has no VmFlags.
    monkeypatch.setattr(hostpages, "own_mappings", lambda: parse_maps(Path("/proc/self/maps").read_text()))
    with pytest.raises(UnsupportedError, match="were not released"):
        hibernate.sleep(work_dir)
    assert hibernate.state() == "running"
    assert int(tensor.sum()) == 7 * 64 * 1024 and torch.equal(other, torch.arange(1000))
