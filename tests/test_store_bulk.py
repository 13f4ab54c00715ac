"""The per-chunk work done a group at a time (hibernate/store/bulk.py): the compiled helper and its
Python twin give the same results, and the helper is built wherever a C compiler is."""

from __future__ import annotations

import contextlib
import ctypes
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
from hibernate.store.manifest import checksum
from tests.test_store_roundtrip import BytesRegion, KiB, read_back, small_options, write

compiled = bulk._native
needs_compiled = pytest.mark.skipif(compiled is None, reason="the compiled helper is not built here")

CHECKSUMS: list[Callable[..., Any]] = [bulk.python_checksums]
STAGES: list[Callable[..., Any]] = [bulk.python_stage_at]
VERIFIES: list[Callable[..., Any]] = [bulk.python_verify_copy_at]
if compiled is not None:
    CHECKSUMS.append(compiled.checksums)
    STAGES.append(compiled.stage_at)
    VERIFIES.append(compiled.verify_copy_at)


def test_the_helper_is_built_and_used_wherever_a_c_compiler_is() -> None:
    """An install on a machine with a compiler must not quietly fall back to the slower Python."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None or os.environ.get("HIBERNATE_NATIVE") == "0":
        pytest.skip(f"no C compiler ({compiler}) here, or the helper is switched off")
    assert bulk.NATIVE, "the _bulk extension was not built, or could not bind xxh3"


def test_hibernate_native_0_chooses_the_python_functions() -> None:
    code = "from hibernate.store import bulk; print(bulk.NATIVE, bulk.verify_copy_at.__name__)"
    env = {**os.environ, "HIBERNATE_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "python_verify_copy_at"]


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


def stage_copies(stage: Callable[..., Any], target: Any, items: Sequence[tuple[int, int, bytes]]) -> Any:
    """``stage`` (a stage_at) of (position, padded, bytes) items, each read at the address of a copy
    of its bytes held meanwhile (none for no bytes)."""
    held = [bytearray(data) for _, _, data in items]
    addresses = [address_of(copy) if copy else 0 for copy in held]
    positions, paddeds = [item[0] for item in items], [item[1] for item in items]
    return stage(target, positions, paddeds, addresses, [len(copy) for copy in held])


@pytest.mark.parametrize("stage", STAGES)
@given(chunks=st.lists(chunk_bytes, min_size=1, max_size=8))
@settings(max_examples=60, deadline=None)
def test_staging_copies_pads_with_zeros_and_hashes_the_copy(
    stage: Callable[..., Any], chunks: list[bytes]
) -> None:
    sizes = [_padded(len(c)) for c in chunks]
    target = bytearray(b"\xee" * (sum(sizes) + 100))
    positions = [sum(sizes[:i]) for i in range(len(chunks))]
    items = list(zip(positions, sizes, chunks, strict=True))
    digests = stage_copies(stage, memoryview(target), items)
    assert digests == [checksum(c) for c in chunks]
    for position, size, chunk in zip(positions, sizes, chunks, strict=True):
        assert target[position : position + len(chunk)] == chunk
        assert target[position + len(chunk) : position + size] == bytes(size - len(chunk))
    assert target[sum(sizes) :] == b"\xee" * 100  # nothing past the last padded slot


@pytest.mark.parametrize("stage", STAGES)
def test_staging_refuses_an_item_that_does_not_fit(stage: Callable[..., Any]) -> None:
    target = memoryview(bytearray(4096))
    with pytest.raises(ValueError):
        stage_copies(stage, target, [(4000, 512, b"x" * 100)])
    with pytest.raises(ValueError):
        stage_copies(stage, target, [(0, 10, b"x" * 100)])  # longer than its padded size


SENTINEL = b"\xee"


def address_of(buffer: bytearray) -> int:
    """Where a bytearray's bytes are (it is not resized while a test uses the address)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class VerifyCase:
    """Chunks back to back in a source read from file offset ``base``, each with a target buffer
    (every third verified only) and a checksum, the ``corrupt`` one's wrong."""

    def __init__(self, chunks: Sequence[bytes], corrupt: int | None, base: int = 0) -> None:
        self.chunks, self.base = list(chunks), base
        self.source = b"".join(chunks)
        self.buffers = [bytearray(SENTINEL * (len(c) + 1)) for c in chunks]  # the last byte: never written
        self.offsets = [base + sum(len(c) for c in chunks[:i]) for i in range(len(chunks))]
        self.lengths = [len(c) for c in chunks]
        self.checksums = "".join(
            checksum(c) if i != corrupt else checksum(c + b"!") for i, c in enumerate(chunks)
        )
        self.targets = [address_of(b) if i % 3 else 0 for i, b in enumerate(self.buffers)]

    def run(self, verify_copy_at: Callable[..., Any], group: list[int], got: int | None = None) -> Any:
        size = len(self.source) if got is None else got
        return verify_copy_at(
            memoryview(self.source),
            self.base,
            size,
            group,
            self.offsets,
            self.lengths,
            self.checksums,
            self.targets,
        )

    def holds(self, index: int, copied: bool) -> bool:
        """Whether chunk ``index``'s buffer holds the chunk (``copied``) or is as it was."""
        expected = self.chunks[index] if copied else SENTINEL * self.lengths[index]
        return self.buffers[index] == expected + SENTINEL


@pytest.mark.parametrize("verify_copy_at", VERIFIES)
@given(chunks=st.lists(chunk_bytes, min_size=1, max_size=8), data=st.data())
@settings(max_examples=60, deadline=None)
def test_verify_copy_at_copies_what_matches_in_the_groups_order_and_stops_at_the_first_mismatch(
    verify_copy_at: Callable[..., Any], chunks: list[bytes], data: st.DataObject
) -> None:
    corrupt = data.draw(st.none() | st.integers(0, len(chunks) - 1))
    group = data.draw(st.permutations(range(len(chunks))))
    case = VerifyCase(chunks, corrupt, base=data.draw(st.integers(0, 1 << 40)))
    expected = -1 if corrupt is None else group.index(corrupt)
    assert case.run(verify_copy_at, group) == (expected, False)
    for position, chunk in enumerate(group):
        assert case.holds(chunk, copied=case.targets[chunk] != 0 and (expected < 0 or position < expected))


@pytest.mark.parametrize("verify_copy_at", VERIFIES)
def test_a_chunk_the_read_did_not_reach_is_reported_after_the_ones_before_it_are_checked(
    verify_copy_at: Callable[..., Any],
) -> None:
    chunks = [b"a" * 100, b"b" * 100, b"c" * 100, b"d" * 100]
    case = VerifyCase(chunks, None)
    assert case.run(verify_copy_at, [0, 1, 2, 3], got=250) == (2, True)
    assert case.holds(1, copied=True) and case.holds(2, copied=False) and case.holds(3, copied=False)
    corrupted = VerifyCase(chunks, 1)
    assert corrupted.run(verify_copy_at, [0, 1, 2, 3], got=250) == (1, False), "a mismatch comes first"
    assert VerifyCase(chunks, None).run(verify_copy_at, [3, 0], got=0) == (0, True)


@pytest.mark.parametrize("verify_copy_at", VERIFIES)
@pytest.mark.parametrize("expected", ["0" * 16, "ABCDEF0123456789", "zz" * 8, "-" * 16])
def test_a_malformed_checksum_matches_nothing(verify_copy_at: Callable[..., Any], expected: str) -> None:
    target = bytearray(4)
    result = verify_copy_at(memoryview(b"abc"), 0, 3, [0], [0], [3], expected, [address_of(target)])
    assert result == (0, False)
    assert target == bytes(4)


@pytest.mark.parametrize("verify_copy_at", VERIFIES)
def test_bad_arguments_are_refused_alike_and_before_anything_is_copied(
    verify_copy_at: Callable[..., Any],
) -> None:
    target = bytearray(4)
    good = checksum(b"abc")
    address = address_of(target)
    shrinks: list[Any] = [0, 3]  # emptied by _Shrinks.__index__, were it ever asked
    for args, error in (
        ((1, 6, [0, 1], [0, 4], [3, 3], good * 2, [address, 0]), ValueError),  # chunk 0 before it
        ((0, 7, [0], [0], [3], good, [address]), ValueError),  # more read than the source holds
        ((-1, 6, [0], [0], [3], good, [address]), ValueError),  # a source before the file's start
        ((2**63, 6, [0], [0], [3], good, [address]), OverflowError),
        ((0, 6.0, [0], [0], [3], good, [address]), TypeError),
        ((0, 6, [0], [0], [3], "é" * 16, [address]), ValueError),  # not hex, and not 16 bytes either
        ((0, 6, [0, 1], [0, 3], [3, 3], good, [address, 0]), ValueError),  # no checksum for chunk 1
        ((0, 6, [0, 1], [0, 3], [3, -3], good * 2, [address, 0]), ValueError),
        ((0, 6, [0, 2], [0, 3], [3, 3], good * 2, [address, 0]), IndexError),
        ((0, 6, [0, -1], [0, 3], [3, 3], good * 2, [address, 0]), IndexError),
        ((0, 6, [0, 1], [0, 2**63], [3, 3], good * 2, [address, 0]), ValueError),
        ((0, 6, [0, 1], [0, 3.0], [3, 3], good * 2, [address, 0]), TypeError),
        ((0, 6, [0, 1], [0, _Shrinks(shrinks)], [3, 3], good * 2, [address, 0]), TypeError),
        ((0, 6, [0, 1], (0, 3), [3, 3], good * 2, [address, 0]), TypeError),  # a tuple, not a list
        ((0, 6, [0, 1], [0, 3], [3, 3], good.encode() * 2, [address, 0]), TypeError),
    ):
        with pytest.raises(error):
            verify_copy_at(memoryview(b"abcabc"), *args)
        assert target == bytes(4), f"{args!r} copied before it was refused"
    assert shrinks == [0, 3], "no Python code runs while the lists are read"


@pytest.mark.parametrize("verify_copy_at", VERIFIES)
def test_an_empty_group_checks_nothing_and_bools_count_as_ints_alike(
    verify_copy_at: Callable[..., Any],
) -> None:
    target = bytearray(2)
    assert verify_copy_at(memoryview(b"ab"), 0, 2, [], [], [], "", []) == (-1, False)
    digests = checksum(b"ab") + checksum(b"b")
    assert verify_copy_at(memoryview(b"ab"), 0, True, [0], [True], [1], digests, [0]) == (0, True)
    assert verify_copy_at(
        memoryview(b"ab"), 0, 2, [True], [0, True], [2, True], digests, [0, address_of(target)]
    ) == (
        -1,
        False,
    )
    assert target == b"b\0"


@pytest.mark.parametrize("verify_copy_at", VERIFIES)
def test_a_source_of_wider_items_counts_in_bytes_and_may_overlap_its_target(
    verify_copy_at: Callable[..., Any],
) -> None:
    data = bytes(range(64))
    words = memoryview(bytearray(data)).cast("I")  # 16 items of 4 bytes
    target = bytearray(17)
    assert verify_copy_at(words, 0, 64, [0], [16], [16], checksum(data[16:32]), [address_of(target)]) == (
        -1,
        False,
    )
    assert target[:16] == data[16:32]
    copied = bytearray(data)
    view = memoryview(copied)
    assert verify_copy_at(view, 0, 64, [0], [0], [32], checksum(data[:32]), [address_of(copied) + 4]) == (
        -1,
        False,
    )
    assert copied[4:36] == data[:32], "as if through a buffer"


@pytest.mark.parametrize("stage", STAGES)
def test_staging_refuses_bad_arguments_alike(stage: Callable[..., Any]) -> None:
    target = memoryview(bytearray(8192))
    one = bytearray(b"x")
    where = address_of(one)
    with pytest.raises(BufferError):
        stage(memoryview(bytes(8192)), [0], [512], [where], [1])  # a read-only target
    with pytest.raises(ValueError):
        stage(target, [2**63], [512], [where], [1])
    with pytest.raises(ValueError):
        stage(target, [0, 512], [512], [where], [1])  # columns of different lengths
    with pytest.raises(ValueError):
        stage(target, [0], [512], [0], [1])  # bytes with no address
    with pytest.raises(ValueError):
        stage(target, [0], [512], [where], [-1])
    with pytest.raises(TypeError):
        stage(target, (0,), [512], [where], [1])  # not a list
    assert target[:1] == b"\0", "nothing was copied"


@pytest.mark.parametrize("stage", STAGES)
def test_staging_from_its_own_target_copies_as_if_through_a_buffer(stage: Callable[..., Any]) -> None:
    data = bytes(range(64))
    staged = bytearray(data + bytes(1024))
    assert stage(memoryview(staged), [4], [512], [address_of(staged)], [32]) == [checksum(data[:32])]
    assert staged[4:36] == data[:32]


class _Shrinks:
    """An index that empties the list of items being parsed: the helper must not read freed items."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def __index__(self) -> int:
        self.items.clear()
        return 8


@pytest.mark.parametrize("stage", STAGES)
def test_an_entry_that_is_no_int_is_refused_without_asking_it(stage: Callable[..., Any]) -> None:
    """The helper reads the lists without the GIL's protection of Python code: an entry that would run
    code to give its value (``__index__``, which could free what is being read) is refused unasked."""
    positions: list[Any] = []
    positions += [_Shrinks(positions)] + [0] * 50
    one = bytearray(b"x")
    with pytest.raises(TypeError):
        stage(memoryview(bytearray(4096)), positions, [8] * 51, [address_of(one)] * 51, [1] * 51)
    assert len(positions) == 51


# -- through the reader and the writer ---------------------------------------------------------


@contextlib.contextmanager
def python_only() -> Iterator[None]:
    """The store as it runs where the helper was not built."""
    saved = (bulk.NATIVE, bulk.checksums, bulk.stage_at, bulk.verify_copy_at)
    bulk.NATIVE, bulk.checksums = False, bulk.python_checksums
    bulk.stage_at, bulk.verify_copy_at = bulk.python_stage_at, bulk.python_verify_copy_at
    try:
        yield
    finally:
        bulk.NATIVE, bulk.checksums, bulk.stage_at, bulk.verify_copy_at = saved


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hb-bulk-", dir=os.environ.get("HIBERNATE_TEST_DISK")) as d:
        yield Path(d)


MODES = ["python", pytest.param("compiled", marks=needs_compiled)]
# A sleep stages chunks up to 256 KiB in runs and larger ones one by one; a wake copies every chunk
# to its region's address; a region without host memory stands for device memory.
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
        byte = f.read(1)[0]
        f.seek(chunk.offset + 100)  # the read moved past it
        f.write(bytes([byte ^ 0xFF]))
    blanks = [region.blank() for region in regions]
    refusal = pytest.raises(SnapshotInvalidError, match=r"record 'w/3' bytes 0\.\.20480 .*checksum mismatch")
    with python_only() if mode == "python" else contextlib.nullcontext(), refusal:
        read_back(scratch, first.snapshot, blanks, buffer=4096 * KiB)
