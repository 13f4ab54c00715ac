"""Every way a snapshot can be wrong, and the precise refusal each one gets.

A refusal names the file and the problem, and comes before any byte reaches
the process's memory whenever it can be found without reading the data; a
corrupted chunk is caught by its checksum before it is copied in.
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hibernate.errors import SnapshotInvalidError, StorageError, UnsupportedError
from hibernate.pools.tensors import TensorPool
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import WrittenRecords, body_checksum
from hibernate.store.options import WriteOptions
from hibernate.store.reader import SnapshotReader, _Described
from hibernate.store.writer import check_regions, write_snapshot
from tests.test_store_roundtrip import BytesRegion

KiB = 1024
OPTIONS = WriteOptions(chunk_bytes=8 * KiB, buffer_bytes=64 * KiB)


@dataclass
class Spilled:
    root: Path
    snapshot: str
    pool: TensorPool
    tensors: dict[str, torch.Tensor]
    expected: dict[str, bytes]
    written: WrittenRecords  # what the sleep wrote, as an agent keeps it for its wake

    @property
    def regions(self) -> list[Any]:
        return list(self.pool.regions())

    @property
    def manifest_path(self) -> Path:
        return self.root / self.snapshot / "manifest.json"

    @property
    def data_file(self) -> Path:
        return self.root / self.snapshot / "data-000.bin"

    def manifest(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.manifest_path.read_text())
        return document

    def rewrite_manifest(self, document: dict[str, Any], *, resign: bool) -> None:
        """Write an edited manifest; ``resign`` recomputes its checksum, as a careful forger would."""
        if resign:
            document["manifest_checksum"] = body_checksum(document)
        self.manifest_path.write_text(json.dumps(document))

    def read(self, io_mode: str = "auto", *, as_agent: bool = False) -> Any:
        """Read back into the pool's regions; ``as_agent`` first checks them as an agent's wake does,
        against what its sleep wrote."""
        regions = self.regions
        with SpillRoot(self.root) as root, SnapshotReader(root, self.snapshot, io_mode=io_mode) as reader:
            if as_agent:
                reader.check_matches(regions, written=self.written)
            return reader.read_into(regions)

    def intact(self) -> bool:
        return all(raw_bytes(t) == self.expected[name] for name, t in self.tensors.items())


def raw_bytes(tensor: torch.Tensor) -> bytes:
    return ctypes.string_at(tensor.data_ptr(), tensor.nbytes)


@pytest.fixture
def spilled(tmp_path: Path) -> Spilled:
    generator = torch.Generator().manual_seed(7)
    tensors = {
        "w": torch.randn(40, 100, generator=generator),  # 16000 bytes: two chunks
        "b": torch.randn(300, generator=generator).to(torch.float16),
    }
    pool = TensorPool()
    pool.track(tensors, tag="weights", keep=True, name="model")
    root = tmp_path / "proc"
    with SpillRoot(root, create=True) as opened:
        result = write_snapshot(opened, list(pool.regions()), producer={"test": 1}, options=OPTIONS)
    expected = {name: raw_bytes(t) for name, t in tensors.items()}
    for tensor in tensors.values():  # what a restore must overwrite
        tensor.view(torch.uint8).fill_(0)
    return Spilled(root, result.snapshot, pool, tensors, expected, WrittenRecords.of(result.manifest.columns))


def refused(
    spilled: Spilled, pattern: str, *, io_mode: str = "auto", as_agent: bool = False
) -> SnapshotInvalidError:
    with pytest.raises(SnapshotInvalidError) as caught:
        spilled.read(io_mode, as_agent=as_agent)
    assert re.search(pattern, caught.value.message), caught.value.message
    return caught.value


def test_the_fixture_round_trips(spilled: Spilled) -> None:
    assert spilled.read().io_mode == "direct"
    assert spilled.intact()


# -- data files ----------------------------------------------------------------


def test_a_bit_flip_in_a_data_file_is_caught_before_the_chunk_is_copied_in(spilled: Spilled) -> None:
    data = bytearray(spilled.data_file.read_bytes())
    data[9000] ^= 0x10  # in the second chunk of the first record
    spilled.data_file.write_bytes(data)
    error = refused(spilled, r"checksum mismatch; the data on disk is corrupted")
    assert str(spilled.data_file) in error.message
    assert "record 'weights/model.w' bytes 8192..16000" in error.message
    # The corrupted chunk never reached the tensor: its bytes there are still the zeros we put.
    assert raw_bytes(spilled.tensors["w"])[8192:16000] == bytes(16000 - 8192)


def test_a_truncated_data_file_is_refused_before_anything_is_read(spilled: Spilled) -> None:
    size = spilled.data_file.stat().st_size
    os.truncate(spilled.data_file, size - 4096)
    error = refused(spilled, r"is truncated: \d+ bytes, but 'weights/model\.\w' needs \d+")
    assert error.message.startswith(str(spilled.data_file))
    assert all(raw_bytes(t) == bytes(t.nbytes) for t in spilled.tensors.values()), "nothing was copied in"


def test_a_missing_data_file_is_refused(spilled: Spilled) -> None:
    spilled.data_file.unlink()
    error = refused(spilled, r"is missing \(needed by 'weights/model\.\w'\)")
    assert error.message.startswith(str(spilled.data_file))


def test_a_fifo_planted_as_a_data_file_is_refused_without_blocking(spilled: Spilled) -> None:
    spilled.data_file.unlink()
    os.mkfifo(spilled.data_file, 0o600)
    refused(spilled, re.escape(f"{spilled.data_file} is not a regular file"))


# -- the manifest -----------------------------------------------------------------


def test_an_edited_length_is_refused(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["chunks"]["length"][0] -= 8  # record 0's first chunk
    spilled.rewrite_manifest(document, resign=False)
    refused(
        spilled, r"record 0 \('weights/model\.\w'\): chunk lengths add up to \d+ bytes but the record has \d+"
    )


@pytest.mark.parametrize("as_agent", [False, True], ids=["against the regions", "against what was written"])
def test_an_edited_length_and_size_that_agree_still_do_not_match_the_process(
    spilled: Spilled, as_agent: bool
) -> None:
    document = spilled.manifest()
    assert document["records"]["chunks"][0] == 2, "record 0 has chunks 0 and 1"
    document["chunks"]["length"][1] -= 8
    document["records"]["nbytes"][0] -= 8
    spilled.rewrite_manifest(document, resign=True)
    refused(
        spilled,
        r"manifest\.json: record 0 'weights/model\.\w': \d+ bytes in the snapshot, \d+ in the process",
        as_agent=as_agent,
    )


def test_an_edited_offset_is_refused_by_the_manifest_checksum(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["chunks"]["offset"][0] += 4096
    spilled.rewrite_manifest(document, resign=False)
    error = refused(spilled, r"manifest checksum does not match its contents; it was edited or corrupted")
    assert error.message.startswith(str(spilled.manifest_path))


def test_a_resigned_offset_pointing_elsewhere_fails_the_data_checksum(spilled: Spilled) -> None:
    document = spilled.manifest()
    offsets = document["chunks"]["offset"]  # record 0's two chunks are the first two
    offsets[0], offsets[1] = offsets[1], offsets[0]
    spilled.rewrite_manifest(document, resign=True)
    # Both chunks now read other bytes; which is checked first depends on which of the requests in
    # flight lands first, and the refusal names that one, where the manifest now places it.
    refused(
        spilled,
        r"record 'weights/model\.w' bytes (8192\.\.16000 \(file offset 0\)|0\.\.8192 \(file offset 8192\)): "
        r"checksum mismatch",
    )


def test_a_resigned_offset_beyond_the_file_is_refused_as_truncated(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["chunks"]["offset"][0] = 1 << 30
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"data-000\.bin is truncated: \d+ bytes, but 'weights/model\.\w' needs \d+")


def test_an_offset_off_its_page_reads_other_bytes_and_fails_the_checksum(spilled: Spilled) -> None:
    """Offsets need not be on a page (small chunks are packed), so a wrong one is caught by the data."""
    document = spilled.manifest()
    document["chunks"]["offset"][0] = 100
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"record 'weights/model\.w' bytes 0\.\.8192 \(file offset 100\): checksum mismatch")
    assert raw_bytes(spilled.tensors["w"])[:8192] == bytes(8192), "the chunk that failed was not copied in"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("dtype", "float16", r"views\[0\]\.dtype is 'float16' in the snapshot, 'float32' in the process"),
        ("shape", [41, 100], r"views\[0\]\.shape\[0\] is 41 in the snapshot, 40 in the process"),
        ("strides", [1, 40], r"views\[0\]\.strides\[0\] is 1 in the snapshot, 100 in the process"),
    ],
)
@pytest.mark.parametrize("as_agent", [False, True], ids=["against the regions", "against what was written"])
def test_an_edited_dtype_shape_or_stride_does_not_match_the_process(
    spilled: Spilled, field: str, value: Any, message: str, as_agent: bool
) -> None:
    document = spilled.manifest()
    records = document["records"]
    metas = json.loads(records["meta"])  # format 4 stores the records' meta as one JSON text
    metas[records["key"].index("weights/model.w")]["views"][0][field] = value
    records["meta"] = json.dumps(metas)
    spilled.rewrite_manifest(document, resign=False)
    refused(spilled, "manifest checksum does not match", as_agent=as_agent)
    spilled.rewrite_manifest(document, resign=True)
    error = refused(spilled, message, as_agent=as_agent)
    assert error.message.startswith(f"{spilled.manifest_path}: record ")
    assert all(raw_bytes(t) == bytes(t.nbytes) for t in spilled.tensors.values())


def test_a_wake_that_holds_what_its_sleep_wrote_does_not_encode_the_process_meta_again(
    spilled: Spilled, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Encoding every region's meta and a tuple per region was 0.15 s of a wake of 100,000 tensors."""

    def not_encoded(metas: Any) -> str:
        raise AssertionError("the process's meta was encoded again")

    monkeypatch.setattr("hibernate.store.reader.meta_text", not_encoded)
    spilled.read(as_agent=True)
    assert spilled.intact()


def test_sizes_are_compared_with_the_regions_even_where_the_snapshot_is_as_written(spilled: Spilled) -> None:
    """The copies' bounds never rest on the caller's word: a region list that is not the one
    written (here one storage shrank) is refused though the snapshot is exactly what was written."""
    spilled.tensors["b"].untyped_storage().resize_(16)
    refused(
        spilled,
        r"manifest\.json: record 1 'weights/model\.b': 600 bytes in the snapshot, 16 in the process",
        as_agent=True,
    )


def test_a_snapshot_that_is_not_what_was_written_is_compared_with_the_regions(spilled: Spilled) -> None:
    """Written by another sleep (its keys in another order, say), a snapshot that still describes
    the regions exactly is read: what was written is a shortcut, not the rule."""
    other = spilled.written._replace(keys=list(reversed(spilled.written.keys)))
    spilled.written = other
    spilled.read(as_agent=True)
    assert spilled.intact()


def test_a_truncated_manifest_is_refused(spilled: Spilled) -> None:
    text = spilled.manifest_path.read_bytes()
    spilled.manifest_path.write_bytes(text[: len(text) // 2])
    error = refused(spilled, r"not valid JSON \(.*\); truncated or corrupted")
    assert error.message.startswith(str(spilled.manifest_path))


def test_an_unknown_major_version_is_refused_with_a_hint(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["version"] = "5.0"
    spilled.rewrite_manifest(document, resign=True)
    error = refused(spilled, r"format version 5\.0 is not supported \(this hibernate reads 3\.x and 4\.x\)")
    assert error.hint is not None and "wake it with the version that wrote it" in error.hint


def test_a_format_1_snapshot_is_refused_with_a_hint(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["version"] = "1.0"
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"format version 1\.0 is not supported \(this hibernate reads 3\.x and 4\.x\)")


def test_a_format_2_snapshot_is_refused_with_a_hint(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["version"] = "2.0"
    spilled.rewrite_manifest(document, resign=True)
    error = refused(spilled, r"format version 2\.0 is not supported \(this hibernate reads 3\.x and 4\.x\)")
    assert error.hint is not None and "wake it with the version that wrote it" in error.hint


def test_columns_of_different_lengths_are_refused(spilled: Spilled) -> None:
    original = spilled.manifest()
    document = spilled.manifest()
    document["records"]["tag"].append("weights")
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"the records' columns differ in length")
    document = original
    document["chunks"]["checksum"] = document["chunks"]["checksum"][:-1]
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"chunks\.checksum must hold 16 hex digits for each chunk")


def test_an_edited_checksum_digit_is_refused_by_record_and_chunk(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["chunks"]["checksum"] = "X" + document["chunks"]["checksum"][1:]
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"record 0 \('weights/model\.w'\) chunk 0: checksum 'X\w{15}' is not 16 hex digits")


def test_a_newer_minor_version_with_unknown_fields_is_read(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["version"] = "4.9"
    document["a_field_from_the_future"] = {"ignored": True}
    spilled.rewrite_manifest(document, resign=True)
    spilled.read()
    assert spilled.intact()


def as_format_3(document: dict[str, Any]) -> dict[str, Any]:
    """A format-4 manifest as the previous release wrote it: meta as values, not text (packing
    aside, which a reader does not see)."""
    document["version"] = "3.0"
    document["records"]["meta"] = json.loads(document["records"]["meta"])
    return document


def test_a_format_3_snapshot_with_meta_as_values_is_still_read(spilled: Spilled) -> None:
    """A process put to sleep by the previous release wakes after an upgrade."""
    spilled.rewrite_manifest(as_format_3(spilled.manifest()), resign=True)
    spilled.read()
    assert spilled.intact()


def test_a_format_3_snapshot_with_a_meta_that_differs_names_the_difference(spilled: Spilled) -> None:
    document = as_format_3(spilled.manifest())
    document["records"]["meta"][0]["device"] = "cuda:3"
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"record 0 'weights/model\.w': device is 'cuda:3' in the snapshot, 'cpu' in the process")


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ("[{", r"records\.meta is not valid JSON"),
        ("[]", r"records\.meta must hold one object for each of the 2 records"),
        ("[{}, 1]", r"records\.meta must hold one object for each of the 2 records"),
        ('{"views": []}', r"records\.meta must hold one object for each of the 2 records"),
    ],
)
def test_a_meta_text_that_is_not_an_array_of_objects_is_refused(
    spilled: Spilled, meta: str, message: str
) -> None:
    document = spilled.manifest()
    document["records"]["meta"] = meta
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, message)
    assert all(raw_bytes(t) == bytes(t.nbytes) for t in spilled.tensors.values()), "nothing was copied in"


def test_a_meta_nested_hundreds_deep_is_compared_by_value_and_a_verify_does_not_compare_it(
    spilled: Spilled,
) -> None:
    """Encoding such a meta would overflow Python's stack; it is not encoded, and a verify (which
    reads the manifest's own records back) has nothing to compare."""
    from hibernate.store.manifest import meta_text
    from hibernate.store.reader import verify_snapshot

    deep: dict[str, Any] = {"leaf": 1}
    for _ in range(600):
        deep = {"inner": deep}
    assert meta_text([deep]) is None
    document = spilled.manifest()
    metas = json.loads(document["records"]["meta"])
    metas[0]["deep"] = "X"
    document["records"]["meta"] = json.dumps(metas).replace('"X"', json.dumps(deep))
    spilled.rewrite_manifest(document, resign=True)
    with SpillRoot(spilled.root) as root:
        assert verify_snapshot(root, spilled.snapshot).total_bytes == sum(r.nbytes for r in spilled.regions)
    refused(spilled, r"record 0 \('weights/model\.w'\): meta is nested too deeply")


def test_a_meta_its_maker_vouched_for_that_is_not_json_is_refused_before_publishing(tmp_path: Path) -> None:
    from hibernate.store.manifest import PlainMeta

    region = BytesRegion("w/x", "w", bytes(4096), meta=PlainMeta(shape={1, 2}))  # a set: not JSON
    with (
        SpillRoot(tmp_path / "proc", create=True) as root,
        pytest.raises(
            UnsupportedError, match=r"not plain JSON: no wake could read it, so nothing was published"
        ),
    ):
        write_snapshot(root, [region], producer={"test": 1}, options=OPTIONS)
    assert not any((tmp_path / "proc").glob("snap-*")), "nothing was published"


def test_a_meta_given_as_values_in_format_4_is_refused(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["records"]["meta"] = json.loads(document["records"]["meta"])
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"records\.meta must be a string \(the JSON text of an array\)")


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("file", "../../etc/passwd", r"file '\.\./\.\./etc/passwd' is not a file of the snapshot's own"),
        ("file", "snap-000001/../../x", r"is not a file of the snapshot's own directory; refusing it"),
        ("file", "/etc/passwd", r"file '/etc/passwd' is not a file of the snapshot's own directory"),
        ("file", "..", r"file '\.\.' is not a file of the snapshot's own directory"),
        ("file", "snap-000000/data-000.bin", r"is not a file of the snapshot's own directory"),
        ("file", "other-000.bin", r"uses 'other-000\.bin', which is not among the snapshot's files"),
        ("key", "../escape", r"key '\.\./escape' contains '\.\.' or is absolute"),
        ("key", "/abs/key", r"key '/abs/key' contains '\.\.' or is absolute"),
        ("key", "w/\x1b[31mred", r"key 'w/\\x1b\[31mred' contains control characters"),
        ("key", "w/gr\u00fc\u00dfe\x7f", r"key 'w/gr\u00fc\u00dfe\\x7f' contains control characters"),
        ("key", "w/\u65e5\u672c\x00", r"key 'w/\u65e5\u672c\\x00' contains control characters"),
    ],
)
def test_names_with_dot_dot_or_absolute_paths_or_control_characters_are_refused(
    spilled: Spilled, where: str, value: str, message: str
) -> None:
    document = spilled.manifest()
    if where == "file":
        document["chunks"]["file"][0] = value
    else:
        document["records"]["key"][0] = value
    spilled.rewrite_manifest(document, resign=True)
    error = refused(spilled, message)
    assert error.message.startswith(str(spilled.manifest_path))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"format": "hibernate-snapshot", "version": "1.0", "created_unix": NaN}', "not valid JSON"),
        ('{"format": "hibernate-snapshot", "version": "1.0", "created_unix": 1e999}', "not valid JSON"),
        (  # a number past 64 bits reads as a float, which no integer field takes
            '{"format":"hibernate-snapshot","version":"3.0","snapshot":"snap-000001","checksum_algorithm":'
            '"xxh3-64","alignment":4096,"chunk_bytes":1' + "0" * 30 + "}",
            "chunk_bytes must be an integer >= 4096, got 1e+30",
        ),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ('{"format": "safetensors"}', "not a hibernate snapshot"),
        ('{"format": "hibernate-snapshot", "version": 1.0}', "version 1.0 is not of the form MAJOR.MINOR"),
    ],
)
def test_hostile_manifests_are_refused_as_invalid_not_crashed_on(
    spilled: Spilled, text: str, message: str
) -> None:
    spilled.manifest_path.write_text(text)
    refused(spilled, re.escape(message))


def test_an_oversized_chunk_size_is_refused_before_any_memory_is_staged(spilled: Spilled) -> None:
    document = spilled.manifest()
    document["chunk_bytes"] = 1 << 40
    spilled.rewrite_manifest(document, resign=True)
    refused(spilled, r"chunk_bytes 1099511627776 is not a multiple of 4096 of at most 1073741824")


# -- symbolic links ----------------------------------------------------------------------


def test_a_data_file_replaced_by_a_symlink_is_refused(spilled: Spilled, tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(spilled.data_file.read_bytes())
    spilled.data_file.unlink()
    spilled.data_file.symlink_to(outside)
    refused(
        spilled,
        re.escape(f"{spilled.data_file} is a symbolic link; refusing to follow it out of the snapshot"),
    )


def test_a_manifest_replaced_by_a_symlink_is_refused(spilled: Spilled, tmp_path: Path) -> None:
    outside = tmp_path / "manifest.json"
    outside.write_bytes(spilled.manifest_path.read_bytes())
    spilled.manifest_path.unlink()
    spilled.manifest_path.symlink_to(outside)
    refused(spilled, re.escape(f"{spilled.manifest_path} is a symbolic link; refusing to follow it"))


def test_a_snapshot_directory_replaced_by_a_symlink_is_refused(spilled: Spilled, tmp_path: Path) -> None:
    real = spilled.root / spilled.snapshot
    moved = tmp_path / "moved"
    real.rename(moved)
    real.symlink_to(moved)
    refused(spilled, re.escape(f"{real} is a symbolic link or not a directory; refusing to follow it"))
    with SpillRoot(spilled.root) as root:
        assert root.published() == [], "a symlinked directory is not a published snapshot"


# -- filesystems without O_DIRECT ------------------------------------------------------------


@pytest.fixture
def no_odirect(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """The kernel contract of a filesystem without direct I/O: open(O_DIRECT) fails with EINVAL."""
    calls: list[tuple[str, Any]] = []
    real_open = os.open

    def open_without_direct(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args, **kwargs)

    real_fadvise, real_fsync = os.posix_fadvise, os.fsync

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append(("fadvise", advice))
        real_fadvise(fd, offset, length, advice)

    def fsync(fd: int) -> None:
        calls.append(("fsync", fd))
        real_fsync(fd)

    monkeypatch.setattr(os, "open", open_without_direct)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr(os, "fsync", fsync)
    return calls


def cached_pages(path: Path) -> int:
    """How many of ``path``'s pages are in the page cache (mincore on a mapping of it)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)  # mapping faults nothing in
    try:
        vector = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
        anchor = ctypes.c_char.from_buffer(mapped)
        libc = ctypes.CDLL(None, use_errno=True)
        status = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector)
        del anchor
        if status != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(v & 1 for v in vector)
    finally:
        mapped.close()


def test_no_odirect_falls_back_to_buffered_io_and_leaves_no_page_cache(
    tmp_path: Path, no_odirect: list[tuple[str, Any]]
) -> None:
    tensors = {"w": torch.randn(512, 1024)}  # 2 MiB
    expected = raw_bytes(tensors["w"])
    pool = TensorPool()
    pool.track(tensors, tag="weights", keep=True, name="m")
    with SpillRoot(tmp_path / "proc", create=True) as root:
        result = write_snapshot(root, list(pool.regions()), producer={}, options=WriteOptions(io_mode="auto"))
    assert result.io_mode == "buffered"
    assert ("fadvise", os.POSIX_FADV_DONTNEED) in no_odirect, "written pages were dropped from the cache"
    assert any(name == "fsync" for name, _ in no_odirect)
    data_file = tmp_path / "proc" / result.snapshot / "data-000.bin"
    assert cached_pages(data_file) == 0
    tensors["w"].zero_()
    with SpillRoot(tmp_path / "proc") as root, SnapshotReader(root, result.snapshot) as reader:
        read = reader.read_into(list(pool.regions()))
    assert read.io_mode == "buffered"
    assert raw_bytes(tensors["w"]) == expected
    assert cached_pages(data_file) == 0, "read pages were dropped from the cache too"


def test_io_mode_direct_refuses_a_filesystem_without_odirect_instead_of_falling_back(
    tmp_path: Path, no_odirect: list[tuple[str, Any]]
) -> None:
    pool = TensorPool()
    pool.track({"w": torch.ones(1024)}, tag="weights", keep=True, name="m")
    root_path = tmp_path / "proc"
    with SpillRoot(root_path, create=True) as root, pytest.raises(StorageError) as caught:
        write_snapshot(root, list(pool.regions()), producer={}, options=WriteOptions(io_mode="direct"))
    assert re.match(
        rf"the filesystem of {re.escape(str(root_path))} \(.*/data-000\.bin\) "
        r"refuses direct I/O \(O_DIRECT\), which --io-mode direct requires; nothing was published",
        caught.value.message,
    ), caught.value.message
    assert not root_path.exists(), "a failed first sleep leaves no directory behind"
    with SpillRoot(root_path, create=True) as root:
        snapshot = write_snapshot(root, list(pool.regions()), producer={}).snapshot
        with pytest.raises(StorageError, match=r"data-000\.bin refuses direct I/O \(O_DIRECT\)"):
            SnapshotReader(root, snapshot, io_mode="direct")


def test_meta_nested_past_the_limit_is_refused_by_a_wake_as_the_writer_refuses_it() -> None:
    """A reader checks meta where it uses it: one that differs from the process's is checked first."""
    from hibernate.store.manifest import (
        MAX_META_DEPTH,
        ChunkRef,
        Columns,
        FileIdentity,
        Manifest,
        Record,
    )
    from hibernate.store.owner import Owner
    from hibernate.store.parse import parse_manifest
    from hibernate.store.reader import Discard, _describe_mismatch

    deep: dict[str, Any] = {"leaf": 1}
    for _ in range(MAX_META_DEPTH + 1):
        deep = {"inner": deep}
    chunk = ChunkRef("data-000.bin", 0, 4096, "0123456789abcdef")
    record = Record("weight", "weights", 4096, deep, (chunk,))
    manifest = Manifest(
        "snap-000001",
        {"name": "hibernate"},
        1 << 20,
        Columns.of([record]),
        Owner.current(),
        {"data-000.bin": FileIdentity(4096, 1, 2, 3, 4)},
    )
    parsed = parse_manifest(manifest.encode()).records[0]
    live = Discard(record._replace(meta={"inner": 1}))
    with pytest.raises(SnapshotInvalidError, match=r"record 0 \('weight'\): meta is nested too deeply"):
        _describe_mismatch(
            _Described(parsed.key, parsed.tag, parsed.nbytes, parsed.meta), live, "manifest.json: record 0"
        )
    with pytest.raises(UnsupportedError, match="nested too deeply"):
        check_regions([BytesRegion("weight", "weights", bytes(4096), meta=deep)])


def test_a_meta_text_equal_to_the_process_s_is_not_parsed(spilled: Spilled) -> None:
    with SpillRoot(spilled.root) as root, SnapshotReader(root, spilled.snapshot) as reader:
        reader.read_into(spilled.regions)
        assert reader.manifest.columns._metas is None, "the texts were equal: nothing to parse"
    assert spilled.intact()


def test_a_meta_text_written_another_way_is_compared_by_its_values(spilled: Spilled) -> None:
    """The text form is only a shortcut: other spacing and key order still mean the same meta."""
    document = spilled.manifest()
    metas = json.loads(document["records"]["meta"])
    document["records"]["meta"] = json.dumps(metas, indent=1, sort_keys=True)
    spilled.rewrite_manifest(document, resign=True)
    with SpillRoot(spilled.root) as root, SnapshotReader(root, spilled.snapshot) as reader:
        reader.read_into(spilled.regions)
        assert reader.manifest.columns._metas == metas
    assert spilled.intact()
