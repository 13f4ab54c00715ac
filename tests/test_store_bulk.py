"""The per-chunk work done a group at a time (hibernate/store/bulk.py): the compiled helper and its
Python twin give the same results, and the helper is built wherever a C compiler is."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hibernate.errors import SnapshotInvalidError
from hibernate.store import bulk
from hibernate.store.format import checksum
from tests.test_store_roundtrip import BytesRegion, KiB, read_back, small_options, write

compiled = bulk._native
needs_compiled = pytest.mark.skipif(compiled is None, reason="the compiled helper is not built here")

CHECKSUMS: list[Callable[..., Any]] = [bulk.python_checksums]
STAGES: list[Callable[..., Any]] = [bulk.python_stage]
VERIFIES: list[Callable[..., Any]] = [bulk.python_verify_copy]
if compiled is not None:
    CHECKSUMS.append(compiled.checksums)
    STAGES.append(compiled.stage)
    VERIFIES.append(compiled.verify_copy)


def test_the_helper_is_built_and_used_wherever_a_c_compiler_is() -> None:
    """An install on a machine with a compiler must not quietly fall back to the slower Python."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None or os.environ.get("HIBERNATE_NATIVE") == "0":
        pytest.skip(f"no C compiler ({compiler}) here, or the helper is switched off")
    assert bulk.NATIVE, "the _bulk extension was not built, or could not bind xxh3"


def test_hibernate_native_0_chooses_the_python_functions() -> None:
    code = "from hibernate.store import bulk; print(bulk.NATIVE, bulk.verify_copy.__name__)"
    env = {**os.environ, "HIBERNATE_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "python_verify_copy"]


chunk_bytes = st.binary(min_size=0, max_size=9000)


@pytest.mark.parametrize("checksums", CHECKSUMS)
@given(chunks=st.lists(chunk_bytes, max_size=12))
@settings(max_examples=60, deadline=None)
def test_checksums_are_the_formats_chunk_checksums(
    checksums: Callable[..., Any], chunks: list[bytes]
) -> None:
    assert checksums([memoryview(c) for c in chunks]) == [checksum(c) for c in chunks]


def _padded(n: int) -> int:
    return (n + 511) // 512 * 512 + 512


@pytest.mark.parametrize("stage", STAGES)
@given(chunks=st.lists(chunk_bytes, min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_staging_copies_pads_with_zeros_and_hashes_the_copy(
    stage: Callable[..., Any], chunks: list[bytes]
) -> None:
    sizes = [_padded(len(c)) for c in chunks]
    target = bytearray(b"\xee" * (sum(sizes) + 100))
    positions = [sum(sizes[:i]) for i in range(len(chunks))]
    items = [(p, s, memoryview(c)) for p, s, c in zip(positions, sizes, chunks, strict=True)]
    digests = stage(memoryview(target), items)
    assert digests == [checksum(c) for c in chunks]
    for position, size, chunk in zip(positions, sizes, chunks, strict=True):
        assert target[position : position + len(chunk)] == chunk
        assert target[position + len(chunk) : position + size] == bytes(size - len(chunk))
    assert target[sum(sizes) :] == b"\xee" * 100  # nothing past the last padded slot


@pytest.mark.parametrize("stage", STAGES)
def test_staging_refuses_an_item_that_does_not_fit(stage: Callable[..., Any]) -> None:
    target = memoryview(bytearray(4096))
    with pytest.raises(ValueError):
        stage(target, [(4000, 512, memoryview(b"x" * 100))])
    with pytest.raises(ValueError):
        stage(target, [(0, 10, memoryview(b"x" * 100))])  # longer than its padded size


def _verify_case(chunks: Sequence[bytes], corrupt: int | None) -> tuple[bytes, list[Any], list[bytearray]]:
    source = b"".join(chunks)
    targets = [bytearray(len(c)) for c in chunks]
    items: list[Any] = []
    start = 0
    for index, chunk in enumerate(chunks):
        expected = checksum(chunk) if index != corrupt else checksum(chunk + b"!")
        items.append((start, len(chunk), expected, memoryview(targets[index]) if index % 3 else None))
        start += len(chunk)
    return source, items, targets


@pytest.mark.parametrize("verify_copy", VERIFIES)
@given(chunks=st.lists(chunk_bytes, min_size=1, max_size=8), data=st.data())
@settings(max_examples=60, deadline=None)
def test_verify_copy_copies_what_matches_and_stops_at_the_first_mismatch(
    verify_copy: Callable[..., Any], chunks: list[bytes], data: st.DataObject
) -> None:
    corrupt = data.draw(st.none() | st.integers(0, len(chunks) - 1))
    source, items, targets = _verify_case(chunks, corrupt)
    assert verify_copy(memoryview(source), items) == (-1 if corrupt is None else corrupt)
    for index, (chunk, item) in enumerate(zip(chunks, items, strict=True)):
        copied = item[3] is not None and (corrupt is None or index < corrupt)
        assert targets[index] == (chunk if copied else bytes(len(chunk)))


@pytest.mark.parametrize("verify_copy", VERIFIES)
@pytest.mark.parametrize("expected", ["", "0" * 15, "0" * 17, "ABCDEF0123456789", "zz" * 8, None, 7])
def test_a_malformed_checksum_matches_nothing(verify_copy: Callable[..., Any], expected: object) -> None:
    target = bytearray(3)
    assert verify_copy(memoryview(b"abc"), [(0, 3, expected, memoryview(target))]) == 0
    assert target == bytes(3)


@pytest.mark.parametrize("verify_copy", VERIFIES)
def test_verify_copy_refuses_items_outside_the_source_or_a_target_of_another_size(
    verify_copy: Callable[..., Any],
) -> None:
    source = memoryview(b"abcdef")
    good = checksum(b"abc")
    target = bytearray(3)
    for items in (
        [(0, 3, good, memoryview(target)), (4, 3, good, None)],  # past the end
        [(0, 3, good, memoryview(target)), (-1, 3, good, None)],
        [(0, 3, good, memoryview(bytearray(2)))],
    ):
        with pytest.raises(ValueError):
            verify_copy(source, items)
        assert target == bytes(3), "nothing is copied when an item is refused"


@pytest.mark.parametrize("verify_copy", VERIFIES)
def test_bad_items_are_refused_alike_and_before_anything_is_copied(verify_copy: Callable[..., Any]) -> None:
    source = memoryview(b"abcdef")
    good = checksum(b"abc")
    first = bytearray(3)
    for items, error in (
        ([(0, 3, good, memoryview(first)), [3, 3, good, None]], TypeError),  # a list, not a tuple
        ([(0, 3, good, memoryview(first)), (3, 3, good)], TypeError),
        ([(0, 3, good, memoryview(first)), (3, 3, good, memoryview(b"xyz"))], BufferError),  # read-only
        ([(0, 3, good, memoryview(first)), (3, 3, good, b"xyz")], BufferError),
        ([(0, 3, good, memoryview(first)), (2**63, 3, good, None)], ValueError),
    ):
        with pytest.raises(error):
            verify_copy(source, items)
        assert first == bytes(3), f"{items!r} copied before it was refused"


@pytest.mark.parametrize("stage", STAGES)
def test_staging_refuses_bad_views_alike(stage: Callable[..., Any]) -> None:
    target = memoryview(bytearray(8192))
    strided = memoryview(bytearray(64))[::2]
    with pytest.raises(BufferError):
        stage(target, [(0, 512, strided)])
    with pytest.raises(BufferError):
        stage(memoryview(bytes(8192)), [(0, 512, memoryview(b"x"))])  # a read-only target
    with pytest.raises(ValueError):
        stage(target, [(2**63, 512, memoryview(b"x"))])


@pytest.mark.parametrize(("stage", "verify_copy"), list(zip(STAGES, VERIFIES, strict=True)))
def test_views_of_wider_items_count_in_bytes(
    stage: Callable[..., Any], verify_copy: Callable[..., Any]
) -> None:
    words = memoryview(bytearray(range(16))).cast("I")  # 4 items of 4 bytes
    target = bytearray(4096)
    assert stage(memoryview(target), [(0, 512, words)]) == [checksum(bytes(range(16)))]
    assert target[:16] == bytes(range(16))
    into = memoryview(bytearray(16)).cast("I")
    assert verify_copy(memoryview(bytes(range(16))), [(0, 16, checksum(bytes(range(16))), into)]) == -1
    assert into.tobytes() == bytes(range(16))


@pytest.mark.parametrize(("stage", "verify_copy"), list(zip(STAGES, VERIFIES, strict=True)))
def test_overlapping_source_and_target_copy_as_if_through_a_buffer(
    stage: Callable[..., Any], verify_copy: Callable[..., Any]
) -> None:
    data = bytes(range(64))
    staged = bytearray(data + bytes(1024))
    view = memoryview(staged)
    assert stage(view, [(4, 512, view[0:32])]) == [checksum(data[:32])]
    assert staged[4:36] == data[:32]
    copied = bytearray(data)
    view = memoryview(copied)
    assert verify_copy(view, [(0, 32, checksum(data[:32]), view[4:36])]) == -1
    assert copied[4:36] == data[:32]


@pytest.mark.parametrize("verify_copy", VERIFIES)
def test_items_given_as_an_iterator_are_all_checked(verify_copy: Callable[..., Any]) -> None:
    target = bytearray(3)
    items = ((0, 3, "0" * 16, memoryview(target)) for _ in range(1))
    assert verify_copy(memoryview(b"abc"), items) == 0
    assert target == bytes(3)


class _Shrinks:
    """An index that empties the list of items being parsed: the helper must not read freed items."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __index__(self) -> int:
        self.items.clear()
        return 8


@needs_compiled
def test_the_helper_survives_items_that_change_while_it_reads_them() -> None:
    assert compiled is not None
    items: list[Any] = []
    items += [(_Shrinks(items), 8, memoryview(bytearray(b"abc")))] + [(0, 8, memoryview(b"x"))] * 50
    digests = compiled.stage(memoryview(bytearray(4096)), items)
    assert len(digests) == 51 and items == []
    checks: list[Any] = []
    checks += [(0, _Shrinks(checks), checksum(b"abcdefgh"), None)] * 3
    assert compiled.verify_copy(memoryview(b"abcdefgh"), checks) == -1


# -- through the reader and the writer ---------------------------------------------------------


@contextlib.contextmanager
def python_only() -> Iterator[None]:
    """The store as it runs where the helper was not built."""
    saved = (bulk.NATIVE, bulk.checksums, bulk.stage, bulk.verify_copy)
    bulk.NATIVE, bulk.checksums = False, bulk.python_checksums
    bulk.stage, bulk.verify_copy = bulk.python_stage, bulk.python_verify_copy
    try:
        yield
    finally:
        bulk.NATIVE, bulk.checksums, bulk.stage, bulk.verify_copy = saved


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hb-bulk-", dir=os.environ.get("HIBERNATE_TEST_DISK")) as d:
        yield Path(d)


MODES = ["python", pytest.param("compiled", marks=needs_compiled)]
# Small chunks go through the run-at-a-time paths, large ones (past 16 and 256 KiB) through the
# region's own copy where there is no helper; a region without a host view stands for device memory.
LAYOUT = [1, 4095, 4096, 20 * KiB, 100 * KiB, 300 * KiB, 3 * 1024 * KiB + 7]


def _regions() -> list[BytesRegion]:
    regions = [BytesRegion(f"w/{i}", "weights", os.urandom(n)) for i, n in enumerate(LAYOUT)]
    regions.append(BytesRegion("w/device", "weights", os.urandom(50 * KiB), host=False))
    return regions


@pytest.mark.parametrize("mode", MODES)
def test_a_snapshot_round_trips_and_a_resleep_reuses_it_either_way(mode: str, scratch: Path) -> None:
    regions = _regions()
    options = small_options(chunk=1024 * KiB, buffer=4096 * KiB)
    with python_only() if mode == "python" else contextlib.nullcontext():
        first = write(scratch, regions, options)
        blanks = [region.blank() for region in regions]
        read_back(scratch, first.snapshot, blanks, buffer=4096 * KiB)
        assert [b.data for b in blanks] == [r.data for r in regions]
        again = write(scratch, regions, options)
    assert again.written_bytes == 0 and again.reused_bytes == sum(LAYOUT) + 50 * KiB


@pytest.mark.parametrize("mode", MODES)
def test_a_corrupted_chunk_is_refused_by_name_either_way(mode: str, scratch: Path) -> None:
    regions = _regions()
    first = write(scratch, regions, small_options(chunk=1024 * KiB, buffer=4096 * KiB))
    chunk = first.manifest.records[3].chunks[0]  # the 20 KiB region
    with open(scratch / first.snapshot / chunk.file, "r+b") as f:
        f.seek(chunk.offset + 100)
        f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
    blanks = [region.blank() for region in regions]
    refusal = pytest.raises(SnapshotInvalidError, match=r"record 'w/3' bytes 0\.\.20480 .*checksum mismatch")
    with python_only() if mode == "python" else contextlib.nullcontext(), refusal:
        read_back(scratch, first.snapshot, blanks, buffer=4096 * KiB)
