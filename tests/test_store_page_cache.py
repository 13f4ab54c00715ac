"""A snapshot already in memory is read from there: through the page cache, never the disk again.

The files a sleep writes with direct I/O are not in the page cache; an
operator who reads them once (to warm a wake), a sleep with
``--io-mode buffered`` or a tmpfs puts them there. A wake then reads them
through the cache and leaves them cached, still checking every chunk; what
must prove the disk's own bytes (``--verify``, the reuse check) never does.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import SnapshotInvalidError
from hibernate.store import reusecheck
from hibernate.store.directio import CACHED, DIRECT, DataFile, follow_page_cache, open_data_file
from hibernate.store.layout import SpillRoot
from hibernate.store.pagecache import CACHED_SHARE, mostly_cached, resident_share
from hibernate.store.reader import SnapshotReader, verify_snapshot
from hibernate.store.tuning import LOCAL, MEMORY
from tests.conftest import flip_byte_at
from tests.test_store_roundtrip import BytesRegion, small_options, write

KiB, MiB = 1024, 1 << 20


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    """A directory on a disk that takes direct I/O and whose files the page cache holds and lets go
    as asked (not a tmpfs, whose pages are the files, nor a filesystem with a cache of its own)."""
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(MiB))
    dropped(probe)
    gone = share(probe)
    warmed(probe)
    back = share(probe)
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
    except OSError:
        pytest.skip(f"{tmp_path} refuses direct I/O")
    probe.unlink()
    if (gone, back) != (0.0, 1.0):
        pytest.skip(f"{tmp_path}'s files do not enter and leave the page cache as asked ({gone}, {back})")
    return tmp_path


def dropped(path: Path) -> None:
    """``path`` made durable and its pages dropped from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warmed(path: Path, length: int | None = None) -> None:
    """The first ``length`` bytes of ``path`` (all of them by default) read once through the cache,
    and no more (no read-ahead)."""
    with open(path, "rb", buffering=0) as stream:
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        stream.read(length if length is not None else -1)


def share(path: Path) -> float:
    fd = os.open(path, os.O_RDONLY)
    try:
        return resident_share(fd, path.stat().st_size)
    finally:
        os.close(fd)


def data_files(root: Path, snapshot: str) -> list[Path]:
    return sorted(path for path in (root / snapshot).iterdir() if path.suffix == ".bin")


# -- how much is there ------------------------------------------------------------------


def test_a_file_read_once_is_in_the_page_cache_and_one_dropped_is_not(disk: Path) -> None:
    path = disk / "file.bin"
    path.write_bytes(os.urandom(8 * MiB))
    dropped(path)
    assert share(path) == 0.0
    warmed(path)
    assert share(path) == 1.0


def test_the_share_is_sampled_over_the_whole_file(disk: Path) -> None:
    path = disk / "file.bin"
    path.write_bytes(os.urandom(64 * MiB))
    dropped(path)
    warmed(path, 16 * MiB)  # the first quarter
    assert share(path) == pytest.approx(0.25, abs=0.05)
    with open(path, "rb") as stream:
        assert not mostly_cached(stream.fileno())
    warmed(path, 60 * MiB)
    with open(path, "rb") as stream:
        assert share(path) >= CACHED_SHARE and mostly_cached(stream.fileno())


def test_holes_do_not_count_against_the_data_around_them(disk: Path) -> None:
    """A re-sleep punches holes where a shared file's chunks are no longer used."""
    path = disk / "sparse.bin"
    with open(path, "wb") as stream:
        stream.write(os.urandom(4 * MiB))
        stream.seek(60 * MiB)
        stream.write(os.urandom(4 * MiB))
    with open(path, "rb") as stream:
        if os.lseek(stream.fileno(), 4 * MiB, os.SEEK_DATA) != 60 * MiB:
            pytest.skip(f"{disk}'s filesystem does not say where a file's holes are")
    dropped(path)
    assert share(path) == 0.0
    warmed(path, 4 * MiB)
    with open(path, "rb", buffering=0) as stream:
        os.posix_fadvise(stream.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        stream.seek(60 * MiB)
        stream.read()
    assert share(path) == 1.0, "the 56 MiB hole between is not counted"


def test_what_cannot_be_told_is_not_cached(tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (empty, fifo):
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            assert not mostly_cached(fd)
        finally:
            os.close(fd)


# -- a wake ------------------------------------------------------------------------


def spilled(disk: Path, **options: Any) -> tuple[Path, str, list[BytesRegion]]:
    """Three regions slept with direct I/O (the default); the files then dropped from the cache."""
    regions = [BytesRegion(f"w{n}", "weights", os.urandom(40 * KiB + n)) for n in range(3)]
    root = disk / "proc"
    snapshot = write(root, regions, small_options(**options)).snapshot
    for path in data_files(root, snapshot):
        dropped(path)
    return root, snapshot, regions


def read(
    root: Path, snapshot: str, regions: list[BytesRegion], **reader: Any
) -> tuple[Any, list[BytesRegion]]:
    blanks = [region.blank() for region in regions]
    with SpillRoot(root) as spill_root, SnapshotReader(spill_root, snapshot, **reader) as opened:
        result = opened.read_into(blanks, buffer_bytes=32 * KiB)
    return result, blanks


def test_a_wake_reads_a_snapshot_in_the_page_cache_through_it_and_leaves_it_there(disk: Path) -> None:
    root, snapshot, regions = spilled(disk)
    cold, filled = read(root, snapshot, regions)
    assert cold.io_mode == DIRECT and cold.tuning.kind == LOCAL
    assert [r.data for r in filled] == [r.data for r in regions]
    (path,) = data_files(root, snapshot)
    assert share(path) == 0.0, "a direct read caches nothing"

    warmed(path)
    warm, filled = read(root, snapshot, regions)
    assert warm.io_mode == CACHED
    assert warm.tuning.kind == MEMORY and warm.tuning.io_depth == warm.tuning.workers
    assert warm.tuning.filesystem == cold.tuning.filesystem  # still the disk's, named as it is
    assert [r.data for r in filled] == [r.data for r in regions]
    assert share(path) == 1.0, "what was found in the cache is left there"


def test_a_damaged_byte_in_the_page_cache_is_refused_as_on_the_disk(disk: Path) -> None:
    root, snapshot, regions = spilled(disk)
    (path,) = data_files(root, snapshot)
    flip_byte_at(path, 20 * KiB)  # written through the cache, so the damaged page is cached
    warmed(path)
    assert share(path) == 1.0, "the read below is one through the page cache"
    with pytest.raises(SnapshotInvalidError, match="checksum mismatch"):
        read(root, snapshot, regions)


def test_a_cached_file_is_read_without_o_direct_and_with_it_again_once_it_left_the_cache(
    disk: Path,
) -> None:
    root, snapshot, _ = spilled(disk)
    (path,) = data_files(root, snapshot)
    warmed(path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        file = open_data_file(directory, path.name, "auto")
    finally:
        os.close(directory)
    try:
        assert (file.mode, file.opened_as) == (CACHED, DIRECT)
        assert not fcntl.fcntl(file.fd, fcntl.F_GETFL) & os.O_DIRECT
        dropped(path)
        follow_page_cache(file)
        assert file.mode == DIRECT and fcntl.fcntl(file.fd, fcntl.F_GETFL) & os.O_DIRECT
    finally:
        file.close()


def test_a_snapshot_pushed_out_of_the_page_cache_after_it_was_opened_is_read_from_the_disk(
    disk: Path,
) -> None:
    """Between the open and the read a wake maps its destination in, which may evict the snapshot."""
    root, snapshot, regions = spilled(disk)
    (path,) = data_files(root, snapshot)
    warmed(path)
    blanks = [region.blank() for region in regions]
    with SpillRoot(root) as spill_root, SnapshotReader(spill_root, snapshot) as opened:
        assert opened.io_mode == CACHED
        dropped(path)
        result = opened.read_into(blanks, buffer_bytes=32 * KiB)
    assert result.io_mode == DIRECT and result.tuning is not None and result.tuning.kind == LOCAL
    assert [r.data for r in blanks] == [r.data for r in regions]
    assert share(path) == 0.0, "nothing of it was left in the page cache"


def test_a_snapshot_partly_in_the_page_cache_says_so_and_keeps_the_disks_tuning(disk: Path) -> None:
    root, snapshot, regions = spilled(disk, segment_bytes=44 * KiB)  # a data file per region
    files = data_files(root, snapshot)
    assert len(files) > 1
    warmed(files[1])
    result, filled = read(root, snapshot, regions)
    assert result.io_mode == f"{CACHED}+{DIRECT}" and result.tuning.kind == LOCAL
    assert [r.data for r in filled] == [r.data for r in regions]


def test_io_mode_direct_and_verify_read_the_disk_even_where_the_page_cache_has_it(disk: Path) -> None:
    root, snapshot, regions = spilled(disk)
    for path in data_files(root, snapshot):
        warmed(path)
    direct, filled = read(root, snapshot, regions, io_mode="direct")
    assert direct.io_mode == DIRECT and [r.data for r in filled] == [r.data for r in regions]
    with SpillRoot(root) as spill_root:
        assert verify_snapshot(spill_root, snapshot).io_mode == DIRECT


def test_the_reuse_check_reads_the_disk_even_where_the_page_cache_has_it(
    disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A re-sleep refers to the old snapshot's bytes on the disk: it checks those, not a cached copy."""
    root, snapshot, regions = spilled(disk)
    for path in data_files(root, snapshot):
        warmed(path)
    opened: list[DataFile] = []
    original = reusecheck.open_data_file

    def recorded(*args: Any, **kwargs: Any) -> DataFile:
        opened.append(original(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(reusecheck, "open_data_file", recorded)
    result = write(root, regions)
    assert result.reused_bytes == sum(r.nbytes for r in regions)
    assert opened and {file.mode for file in opened} == {DIRECT}


@pytest.fixture
def in_memory(tmp_path: Path) -> Iterator[Path]:
    """A directory on a tmpfs (/dev/shm), where there is one."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("no writable /dev/shm")
    with tempfile.TemporaryDirectory(prefix="hb-cache-", dir=shm) as directory:
        yield Path(directory)


def test_a_snapshot_on_a_tmpfs_is_read_from_memory(in_memory: Path) -> None:
    regions = [BytesRegion(f"w{n}", "weights", os.urandom(40 * KiB + n)) for n in range(3)]
    root = in_memory / "proc"
    snapshot = write(root, regions, small_options()).snapshot
    result, filled = read(root, snapshot, regions)
    assert result.io_mode == CACHED and result.tuning.kind == MEMORY
    assert [r.data for r in filled] == [r.data for r in regions]
