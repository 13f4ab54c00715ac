"""Whatever goes into a snapshot comes back byte for byte: property-based round trips.

At the store level with plain byte regions (host memory, and regions without a
host view, as device memory is), and through TensorPool/StorageRegion with
every torch dtype that has plain storage, zero-sized and non-contiguous views,
storages shared by several tensors, several tags, and chunk sizes small enough
that chunks cross every boundary. Also what incremental writes reuse and
reclaim.
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hibernate.errors import SnapshotInvalidError
from hibernate.pools.tensors import StorageRegion, TensorPool
from hibernate.store import reuse as reuse_module
from hibernate.store.arena import PACKED_ALIGNMENT
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import ALIGNMENT, ChunkColumns, align_up
from hibernate.store.options import WriteOptions
from hibernate.store.reader import SnapshotReader
from hibernate.store.readplan import file_order
from hibernate.store.writer import write_snapshot
from tests.conftest import flip_byte_at

KiB = 1024


class BytesRegion:
    """A Region over a bytearray; ``host=False`` hides the view, as device memory does."""

    def __init__(self, key: str, tag: str, data: bytes, *, host: bool = True, meta: Any = None) -> None:
        self.key = key
        self.tag = tag
        self.data = bytearray(data)
        self.host = host
        self.meta: Mapping[str, Any] = meta if meta is not None else {"kind": "bytes"}

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def copy_out(self, offset: int, dst: memoryview) -> None:
        dst[:] = self.data[offset : offset + len(dst)]

    def copy_in(self, offset: int, src: memoryview) -> None:
        self.data[offset : offset + len(src)] = src

    def host_view(self, offset: int, length: int) -> memoryview | None:
        return memoryview(self.data)[offset : offset + length] if self.host else None

    def host_address(self) -> int | None:
        # The bytearray is never resized while a restore runs, so its buffer stays where it is.
        return ctypes.addressof(ctypes.c_char.from_buffer(self.data)) if self.host and self.data else None

    def blank(self) -> BytesRegion:
        """A region of the same shape whose bytes must all be overwritten by a restore."""
        return BytesRegion(self.key, self.tag, b"\xa5" * self.nbytes, host=self.host, meta=self.meta)


def small_options(chunk: int = 4 * KiB, buffer: int = 32 * KiB, **extra: Any) -> WriteOptions:
    return WriteOptions(chunk_bytes=chunk, buffer_bytes=buffer, **extra)


def write(path: Path, regions: list[Any], options: WriteOptions | None = None) -> Any:
    with SpillRoot(path, create=True) as root:
        return write_snapshot(root, regions, producer={"test": True}, options=options or small_options())


def read_back(path: Path, snapshot: str, regions: list[Any], buffer: int = 32 * KiB) -> Any:
    with SpillRoot(path) as root, SnapshotReader(root, snapshot) as reader:
        return reader.read_into(regions, buffer_bytes=buffer)


@pytest.fixture
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hb-store-", dir=os.environ.get("HIBERNATE_TEST_DISK")) as d:
        yield Path(d)


# -- the store alone -------------------------------------------------------------

sizes = st.one_of(
    st.integers(0, 3 * 4 * KiB + 1),
    st.sampled_from([1, ALIGNMENT - 1, ALIGNMENT, ALIGNMENT + 1, 8 * KiB, 8 * KiB + 1, 40 * KiB - 1]),
)
regions_strategy = st.lists(
    st.tuples(sizes, st.sampled_from(["weights", "kv_cache", "optimizer", "t-1.x"]), st.booleans()),
    min_size=0,
    max_size=8,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=regions_strategy,
    chunk=st.sampled_from([4 * KiB, 8 * KiB, 12 * KiB]),
    buffer=st.sampled_from([32 * KiB, 64 * KiB, 96 * KiB]),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_regions_round_trip(
    layout: list[tuple[int, str, bool]], chunk: int, buffer: int, seed: int
) -> None:
    rng = random.Random(seed)
    regions = [
        BytesRegion(f"{tag}/r{i}", tag, rng.randbytes(size), host=host)
        for i, (size, tag, host) in enumerate(layout)
    ]
    with tempfile.TemporaryDirectory(prefix="hb-prop-") as d:
        result = write(Path(d), regions, small_options(chunk, buffer))
        assert result.total_bytes == sum(r.nbytes for r in regions)
        assert result.written_bytes + result.reused_bytes == result.total_bytes
        assert result.staging_bytes <= max(buffer, 2 * ALIGNMENT)
        blanks = [r.blank() for r in regions]
        read_back(Path(d), result.snapshot, blanks, buffer)
        for original, restored in zip(regions, blanks, strict=True):
            assert restored.data == original.data, original.key
        placed: dict[tuple[str, int], int] = {}
        for record in result.manifest.records:
            for ref in record.chunks:
                assert ref.offset % PACKED_ALIGNMENT == 0 and 0 < ref.length <= chunk
                placed[(ref.file, ref.offset)] = ref.length  # a chunk named twice is one chunk
        ends: dict[str, int] = {}
        for (file, offset), length in sorted(placed.items()):
            assert offset >= ends.get(file, 0), "no two chunks share a byte"
            ends[file] = offset + length


def test_identical_chunks_are_written_once_even_without_a_host_view(scratch: Path) -> None:
    zeros = bytes(64 * KiB)
    regions = [BytesRegion("w/a", "w", zeros), BytesRegion("w/b", "w", zeros, host=False)]
    result = write(scratch, regions)
    assert result.written_bytes == 4 * KiB, "sixteen equal chunks of zeros: one is written"
    assert result.reused_bytes == 128 * KiB - 4 * KiB
    blanks = [r.blank() for r in regions]
    read_back(scratch, result.snapshot, blanks)
    assert all(b.data == zeros for b in blanks)


def test_staging_is_bounded_whatever_the_snapshot_size(scratch: Path) -> None:
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(96 * KiB)) for i in range(6)]
    result = write(scratch, regions, small_options(8 * KiB, 32 * KiB))
    assert result.total_bytes == 576 * KiB
    assert result.staging_bytes == 32 * KiB
    with SpillRoot(scratch) as root, SnapshotReader(root, result.snapshot) as reader:
        blanks = [r.blank() for r in regions]
        read = reader.read_into(blanks, buffer_bytes=32 * KiB)
    assert read.staging_bytes == 32 * KiB
    assert [b.data for b in blanks] == [r.data for r in regions]


def test_a_small_buffer_shrinks_the_chunk_size_instead_of_failing() -> None:
    options = WriteOptions(buffer_bytes=16 << 20, chunk_bytes=32 << 20)
    assert options.effective_chunk_bytes == 8 << 20
    with pytest.raises(ValueError, match="chunk_bytes must be a multiple of 4096"):
        WriteOptions(chunk_bytes=5000)
    with pytest.raises(ValueError, match="io_mode"):
        WriteOptions(io_mode="sideways")


# -- incremental writes ------------------------------------------------------------


def test_unchanged_regions_write_no_data_and_changed_chunks_only_are_rewritten(scratch: Path) -> None:
    a = BytesRegion("w/a", "w", os.urandom(40 * KiB))
    b = BytesRegion("w/b", "w", os.urandom(40 * KiB), host=False)
    first = write(scratch, [a, b])
    assert first.written_bytes == 80 * KiB
    second = write(scratch, [a, b])
    assert (second.written_bytes, second.reused_bytes) == (0, 80 * KiB)
    a.data[5 * KiB] ^= 0xFF  # one chunk of a
    b.data[-1] ^= 0xFF  # the last (partial) chunk of b
    third = write(scratch, [a, b])
    assert third.written_bytes == 4 * KiB + 4 * KiB
    blanks = [a.blank(), b.blank()]
    read_back(scratch, third.snapshot, blanks)
    assert [x.data for x in blanks] == [a.data, b.data]


def test_a_known_previous_snapshot_is_used_only_while_it_is_the_newest(
    scratch: Path, manifest_reads: list[str]
) -> None:
    """What a caller keeps from a wake saves the parse; a stale one is set aside for the disk's newest."""
    from hibernate.store.reuse import ReuseSource

    a = BytesRegion("w/a", "w", os.urandom(40 * KiB))
    first = write(scratch, [a])
    kept = ReuseSource.of(first.manifest)
    parsed = manifest_reads
    parsed.clear()
    with SpillRoot(scratch, create=True) as root:
        second = write_snapshot(root, [a], producer={}, options=small_options(), known=kept)
    assert (parsed, second.written_bytes) == ([], 0), "the newest snapshot, as kept: no parse, all reused"
    a.data[0] ^= 0xFF
    with SpillRoot(scratch, create=True) as root:
        third = write_snapshot(root, [a], producer={}, options=small_options(), known=kept)
    assert parsed == [second.snapshot], "the kept one is no longer the newest: the newest is read"
    assert third.written_bytes == 4 * KiB, "and only the changed chunk is written"
    blank = a.blank()
    read_back(scratch, third.snapshot, [blank])
    assert blank.data == a.data


def punches_holes(directory: Path) -> bool:
    """Whether this filesystem gives blocks back for a punched range (ext4, xfs, btrfs, tmpfs do)."""
    from hibernate.store.layout import _FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE, _fallocate

    probe = directory / "punch-probe"
    probe.write_bytes(os.urandom(64 * KiB))
    fd = os.open(probe, os.O_WRONLY)
    try:
        os.fsync(fd)
        _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, 64 * KiB)
        return os.fstat(fd).st_blocks == 0
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


def allocated(path: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in path.rglob("data-*.bin"))


def stored(path: Path) -> int:
    """What every data file holds on disk, links included (all the snapshots' files are counted)."""
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*.bin"))


def test_reused_bytes_are_linked_in_and_the_old_snapshot_goes_whole(scratch: Path) -> None:
    if not punches_holes(scratch):
        pytest.skip("this filesystem cannot punch holes; data goes only with whole files")
    a = BytesRegion("w/a", "w", os.urandom(64 * KiB))
    b = BytesRegion("w/b", "w", os.urandom(64 * KiB))
    first = write(scratch, [a, b])
    assert allocated(scratch) >= 128 * KiB
    b.data[:] = os.urandom(64 * KiB)  # b changes entirely; a's chunks are reused from snap 1
    second = write(scratch, [a, b])
    assert second.written_bytes == 64 * KiB
    assert not (scratch / first.snapshot).exists(), "only the newest snapshot stays"
    assert sorted(second.manifest.files) == ["data-000.bin", "reused-000.bin"]
    assert (second.path / "reused-000.bin").stat().st_nlink == 1, "a's bytes live on in the new snapshot"
    assert allocated(scratch) <= 128 * KiB + 16 * KiB, "b's old chunks were punched out of the linked file"
    a.data[:] = os.urandom(64 * KiB)  # now nothing of snap 1 is used
    third = write(scratch, [a, b])
    assert not (third.path / "reused-001.bin").exists()
    assert allocated(scratch) <= 128 * KiB + 16 * KiB


def test_an_unchanged_resleep_trims_nothing_and_a_changed_one_still_does(
    scratch: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """When every chunk of the last snapshot is used again, its links are kept whole without
    walking the chunks for the pages in use; once one is not, the walk and the trim come back."""
    a = BytesRegion("w/a", "w", os.urandom(64 * KiB))
    b = BytesRegion("w/b", "w", os.urandom(64 * KiB))
    same_as_a = BytesRegion("w/c", "w", bytes(a.data))  # its chunks refer to a's: not indexed twice
    walks: list[int] = []
    real = reuse_module._used_ranges

    def counted(chunks: Any, links: list[str]) -> Any:
        walks.append(len(chunks))
        return real(chunks, links)

    monkeypatch.setattr(reuse_module, "_used_ranges", counted)
    write(scratch, [a, b])
    walks.clear()  # a first sleep has no links: its walk finds nothing to do
    size = stored(scratch)
    unchanged = write(scratch, [a, b])
    assert (unchanged.written_bytes, walks, stored(scratch)) == (0, [], size)
    blanks = [a.blank(), b.blank()]
    read_back(scratch, unchanged.snapshot, blanks)
    assert [r.data for r in blanks] == [a.data, b.data]

    b.data[:] = os.urandom(64 * KiB)
    changed = write(scratch, [a, b])
    assert (changed.written_bytes, len(walks)) == (64 * KiB, 1), "b's old chunks are trimmed away"

    with_copy = write(scratch, [a, same_as_a, b])  # uses every chunk of the last one: no walk
    again = write(scratch, [a, same_as_a, b])  # the last one holds a's bytes twice: walked, to be safe
    assert (with_copy.written_bytes, again.written_bytes, len(walks)) == (0, 0, 2)
    blanks = [a.blank(), same_as_a.blank(), b.blank()]
    read_back(scratch, again.snapshot, blanks)
    assert [r.data for r in blanks] == [a.data, a.data, b.data]


def test_without_reuse_everything_is_written_again(scratch: Path) -> None:
    a = BytesRegion("w/a", "w", os.urandom(20 * KiB))
    write(scratch, [a])
    again = write(scratch, [a], small_options(reuse=False))
    assert again.written_bytes == 20 * KiB


# -- through TensorPool and StorageRegion ----------------------------------------------


def _plain_dtypes() -> list[torch.dtype]:
    """Every torch dtype whose tensors have plain storage that can be viewed as bytes."""
    found = []
    for name in sorted(dir(torch)):
        dtype = getattr(torch, name)
        if not isinstance(dtype, torch.dtype) or dtype in found:
            continue
        try:
            torch.empty(4, dtype=dtype).view(torch.uint8)
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        found.append(dtype)
    return found


DTYPES = _plain_dtypes()


def test_the_dtype_list_is_complete() -> None:
    names = {str(d).removeprefix("torch.") for d in DTYPES}
    wanted = {
        "bool",
        "bfloat16",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
        "uint8",
        "int64",
    }
    assert wanted <= names
    assert {n for n in names if n.startswith("float8")} >= {"float8_e4m3fn", "float8_e5m2"}


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: every bit pattern (NaNs, odd bools) must survive."""
    element = torch.empty(0, dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    raw = torch.randint(0, 256, (numel * element,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def storage_bytes(tensor: torch.Tensor) -> bytes:
    storage = tensor.untyped_storage()
    return ctypes.string_at(storage.data_ptr(), storage.nbytes()) if storage.nbytes() else b""


shapes = st.lists(st.integers(0, 33), min_size=1, max_size=3).map(tuple)


@st.composite
def tensor_sets(draw: st.DrawFn) -> dict[str, dict[str, torch.Tensor]]:
    """Tensors grouped by tag; some are views sharing another tensor's storage."""
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for index in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from(DTYPES))
        base = random_tensor(dtype, draw(shapes), generator)
        tag = draw(st.sampled_from(["weights", "optimizer", "extra"]))
        group = groups.setdefault(tag, {})
        group[f"t{index}"] = base
        view = draw(st.sampled_from(["none", "transpose", "stride", "offset"]))
        if base.dim() >= 2 and view == "transpose":
            group[f"t{index}_t"] = base.transpose(0, 1)
        elif base.dim() >= 1 and base.shape[0] > 2 and view == "stride":
            group[f"t{index}_s"] = base[::2]
        elif base.dim() >= 1 and base.shape[0] > 1 and view == "offset":
            groups.setdefault("shared", {})[f"t{index}_o"] = base[1:]
    return groups


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(groups=tensor_sets(), chunk=st.sampled_from([4 * KiB, 8 * KiB]))
def test_tracked_tensors_round_trip_through_storage_regions(
    groups: dict[str, dict[str, torch.Tensor]], chunk: int
) -> None:
    pool = TensorPool()
    for tag, tagged in groups.items():
        pool.track(tagged, tag=tag, keep=True, name=tag)
    regions = list(pool.regions())
    tensors = [t for g in groups.values() for t in g.values()]
    expected = [(storage_bytes(t), t.shape, t.stride(), t.storage_offset(), t.dtype) for t in tensors]
    storages = {t.untyped_storage()._cdata for t in tensors}
    assert len(regions) == len(storages), "one region per storage, shared storages once"
    with tempfile.TemporaryDirectory(prefix="hb-prop-") as d:
        result = write(Path(d), regions, small_options(chunk, 32 * KiB))
        for region in regions:
            assert isinstance(region, StorageRegion)
            region.release()
        assert all(t.untyped_storage().nbytes() == 0 for t in tensors), "memory was given back"
        for region in regions:
            region.reallocate()
            region.zero()
        read_back(Path(d), result.snapshot, regions)
    for tensor, (data, shape, stride, offset, dtype) in zip(tensors, expected, strict=True):
        assert storage_bytes(tensor) == data
        assert (tensor.shape, tensor.stride(), tensor.storage_offset(), tensor.dtype) == (
            shape,
            stride,
            offset,
            dtype,
        )


def test_storage_region_refuses_a_range_outside_its_storage() -> None:
    pool = TensorPool()
    pool.track(torch.ones(10), tag="w", keep=True, name="x")
    (region,) = pool.regions()
    with pytest.raises(ValueError, match="outside its 40"):
        region.copy_in(36, memoryview(bytearray(8)))
    with pytest.raises(ValueError, match="outside its 40"):
        region.copy_out(-1, memoryview(bytearray(4)))


def test_small_chunks_are_packed_back_to_back_and_read_back(scratch: Path) -> None:
    """A page per chunk made a model of small tensors a third larger on disk than in memory."""
    rng = random.Random(5)
    regions = [BytesRegion(f"w/r{i}", "w", rng.randbytes(rng.randint(1, 3000))) for i in range(500)]
    result = write(scratch, regions, small_options(64 * KiB, 4 << 20))
    data_file = scratch / result.snapshot / "data-000.bin"
    total = sum(r.nbytes for r in regions)
    # Each chunk starts on a cache line; a run of them (a stager's batch, an arena) ends on a page.
    assert data_file.stat().st_size <= total + PACKED_ALIGNMENT * len(regions) + 8 * ALIGNMENT
    assert data_file.stat().st_size % ALIGNMENT == 0, "runs end on a page, for direct I/O"
    blanks = [r.blank() for r in regions]
    read_back(scratch, result.snapshot, blanks)
    assert [b.data for b in blanks] == [r.data for r in regions]


def test_regions_changed_after_they_were_checked_are_checked_again(scratch: Path) -> None:
    """The copies go to each region's own address: a list the caller changed after check_matches must
    not be taken as checked (the old region's size, a shorter new one: a write past its end)."""
    regions = [BytesRegion("w/a", "w", os.urandom(8 * KiB)), BytesRegion("w/b", "w", os.urandom(100))]
    result = write(scratch, regions)
    blanks = [r.blank() for r in regions]
    with SpillRoot(scratch) as root, SnapshotReader(root, result.snapshot) as reader:
        reader.check_matches(blanks)
        blanks[0] = BytesRegion("w/a", "w", bytes(16))
        with pytest.raises(SnapshotInvalidError, match="record 0"):
            reader.read_into(blanks)
    assert blanks[0].data == bytes(16)


def test_chunks_are_read_in_file_order_whatever_order_the_stagers_packed_them_in() -> None:
    digests = "0" * 16 * 4
    in_order = ChunkColumns(["a.bin"] * 4, [0, 64, 4096, 8192], [64, 64, 100, 100], digests)
    assert list(file_order(in_order)) == [0, 1, 2, 3]
    interleaved = ChunkColumns(["a.bin"] * 4, [4096, 4160, 0, 64], [64, 64, 64, 64], digests)
    assert list(file_order(interleaved)) == [2, 3, 0, 1]
    named_twice = ChunkColumns(["a.bin"] * 4, [4096, 0, 4096, 0], [64, 64, 64, 64], digests)
    assert list(file_order(named_twice)) == [1, 3, 0, 2]
    two_files = ChunkColumns(["b.bin", "a.bin", "b.bin", "a.bin"], [0, 4096, 4096, 0], [1, 1, 1, 1], digests)
    assert list(file_order(two_files)) == [3, 1, 0, 2]


def test_a_region_without_a_host_view_is_staged_and_verified_the_same(scratch: Path) -> None:
    data = os.urandom(3 * 4 * KiB + 5)
    hidden = BytesRegion("w/device", "weights", data, host=False)
    result = write(scratch, [hidden])
    assert result.written_bytes == len(data)
    on_disk = sum(align_up(c.length) for c in result.manifest.records[0].chunks)
    assert on_disk == 4 * 4 * KiB
    blank = hidden.blank()
    read_back(scratch, result.snapshot, [blank])
    assert blank.data == data


def test_records_left_unread_are_not_requested_and_the_rest_reads_back(scratch: Path) -> None:
    """An adoption of one object reads only its records (reader.Unread): the others' chunks are not
    requested at all, so damage there is for the call that reads them to find."""
    from hibernate.store.reader import Unread

    first = BytesRegion("w/a", "w", bytes(range(256)) * 64)
    skipped = BytesRegion("w/b", "w", b"\x07" * (40 * KiB))
    last = BytesRegion("w/c", "w", b"\x09" * 5000)
    result = write(scratch, [first, skipped, last], small_options(chunk=8 * KiB))
    snapshot = scratch / result.snapshot

    def read(targets: list[Any]) -> Any:
        with SpillRoot(scratch) as root, SnapshotReader(root, result.snapshot) as reader:
            return reader.read_into(targets, buffer_bytes=32 * KiB)

    filled = [first.blank(), last.blank()]
    assert read([filled[0], Unread(skipped), filled[1]]).total_bytes == first.nbytes + last.nbytes
    assert filled[0].data == first.data and filled[1].data == last.data
    _flip_in_record(snapshot, "w/b")  # damage only the unread record: never read, never seen
    assert read([first.blank(), Unread(skipped), last.blank()]).total_bytes == first.nbytes + last.nbytes
    with pytest.raises(SnapshotInvalidError, match="checksum"):
        read([first.blank(), skipped.blank(), last.blank()])
    assert read([Unread(first), Unread(skipped), Unread(last)]).total_bytes == 0


def _flip_in_record(snapshot: Path, key: str) -> None:
    """Flip a byte in the middle of the first chunk of record ``key`` (the manifest lists each
    record's count of chunks, the chunks in record order)."""
    manifest = json.loads((snapshot / "manifest.json").read_text())
    records, chunks = manifest["records"], manifest["chunks"]
    first_chunk = sum(records["chunks"][: records["key"].index(key)])
    at = chunks["offset"][first_chunk] + chunks["length"][first_chunk] // 2
    flip_byte_at(snapshot / chunks["file"][first_chunk], at)
