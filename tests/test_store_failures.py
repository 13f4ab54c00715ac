"""Full disks and failing disks: a clean abort, nothing published, the memory untouched.

ENOSPC is produced three ways: a stand-in for ``pwritev`` that runs out after a
number of bytes (any user), a real tmpfs that is too small (root only), and the
free-space check that refuses before anything is written.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hibernate.store.writer as writer_module
from hibernate.errors import AbortedError, StorageError
from hibernate.store.layout import SpillRoot
from hibernate.store.options import WriteOptions
from hibernate.store.reader import SnapshotReader
from hibernate.store.writer import write_snapshot
from tests.conftest import is_root
from tests.test_store_roundtrip import BytesRegion

KiB = 1024
MiB = 1 << 20
OPTIONS = WriteOptions(chunk_bytes=64 * KiB, buffer_bytes=512 * KiB)


def regions_of(size: int, count: int = 4, *, host: bool = True) -> list[BytesRegion]:
    return [BytesRegion(f"weights/r{i}", "weights", os.urandom(size), host=host) for i in range(count)]


def write(root_path: Path, regions: list[BytesRegion], options: WriteOptions = OPTIONS) -> Any:
    with SpillRoot(root_path, create=True) as root:
        return write_snapshot(root, regions, producer={}, options=options)


def entries(root_path: Path) -> list[str]:
    """What a root holds besides its lock and marker."""
    return sorted(p.name for p in root_path.iterdir() if p.name not in (".lock", ".hibernate-root"))


def assert_previous_intact(root_path: Path, snapshot: str, regions: list[BytesRegion]) -> None:
    """The root still holds exactly the previous snapshot, readable and bit-exact."""
    assert entries(root_path) == [snapshot], entries(root_path)
    blanks = [r.blank() for r in regions]
    with SpillRoot(root_path) as root, SnapshotReader(root, snapshot) as reader:
        reader.read_into(blanks)
    assert [b.data for b in blanks] == [r.data for r in regions]


@pytest.fixture
def disk_fills_after(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Make data writes fail with ENOSPC (or another errno) once ``limit`` bytes were written."""

    def install(limit: int, code: int = errno.ENOSPC) -> None:
        real = os.pwritev
        written = [0]

        def pwritev(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
            size = sum(memoryview(b).nbytes for b in buffers)
            if written[0] + size > limit:
                raise OSError(code, os.strerror(code))
            n = real(fd, buffers, offset, *rest)
            written[0] += n
            return n

        monkeypatch.setattr(os, "pwritev", pwritev)

    return install


@pytest.mark.parametrize("host", [True, False], ids=["host-memory", "device-like"])
def test_enospc_mid_write_aborts_cleanly(tmp_path: Path, disk_fills_after: Any, host: bool) -> None:
    root_path = tmp_path / "proc"
    old = regions_of(256 * KiB, host=host)
    previous = write(root_path, old).snapshot
    new = regions_of(256 * KiB, host=host)
    before = [bytes(r.data) for r in new]
    disk_fills_after(300 * KiB)
    with pytest.raises(StorageError) as caught:
        write(root_path, new)
    message = caught.value.message
    assert re.match(
        rf"no space left on the device of {re.escape(str(root_path))} "
        r"\(.*/\.tmp-snap-000002-\w+/data-000\.bin\) "
        r"for the next \d+ bytes, after writing \d+ of the snapshot's 1048576 bytes; "
        r"nothing was published and the process keeps its memory$",
        message,
    ), message
    assert caught.value.hint == "free space or choose another --to directory, then sleep again"
    assert [bytes(r.data) for r in new] == before, "the source memory is untouched"
    assert_previous_intact(root_path, previous, old)


def test_a_resleep_that_runs_out_of_space_says_what_it_was_writing_not_the_whole_snapshot(
    tmp_path: Path, disk_fills_after: Any
) -> None:
    """A re-sleep writes only what changed since the previous snapshot: out of space, it says how much
    it was writing and how much it reused, not "0 of" the whole snapshot's bytes."""
    root_path = tmp_path / "proc"
    old = regions_of(256 * KiB)
    previous = write(root_path, old).snapshot
    changed = BytesRegion("weights/r3", "weights", os.urandom(256 * KiB))
    again = [*old[:3], changed]  # the last region changed, the others are as they were
    disk_fills_after(0)
    with pytest.raises(StorageError) as caught:
        write(root_path, again, WriteOptions(chunk_bytes=64 * KiB, buffer_bytes=512 * KiB, stage_threads=1))
    found = re.match(
        rf"no space left on the device of {re.escape(str(root_path))} \(.*/data-000\.bin\) "
        r"for the next (\d+) bytes, after writing 0 of the snapshot's 1048576 bytes "
        r"\(786432 of them reused from the previous snapshot so far\); nothing was published",
        caught.value.message,
    )
    assert found is not None, caught.value.message
    assert 0 < int(found[1]) <= 256 * KiB  # what it was writing: the changed region, no more
    assert_previous_intact(root_path, previous, old)


def test_another_io_error_mid_write_says_what_happened(tmp_path: Path, disk_fills_after: Any) -> None:
    root_path = tmp_path / "proc"
    disk_fills_after(100 * KiB, errno.EIO)
    with pytest.raises(
        StorageError, match=r"I/O error writing the snapshot in .*data-000\.bin\): Input/output error"
    ):
        write(root_path, regions_of(256 * KiB))
    assert not root_path.exists()  # a failed first sleep leaves no directory behind


def test_a_read_error_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root_path = tmp_path / "proc"
    regions = regions_of(64 * KiB, 2)
    snapshot = write(root_path, regions).snapshot

    def failing_preadv(*args: Any) -> int:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "preadv", failing_preadv)
    with (
        SpillRoot(root_path) as root,
        SnapshotReader(root, snapshot) as reader,
        pytest.raises(
            StorageError, match=rf"cannot read {re.escape(str(root_path))}/snap-000001/data-000\.bin"
        ),
    ):
        reader.read_into([r.blank() for r in regions])


def test_the_free_space_check_refuses_before_writing_and_says_how_much(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root_path = tmp_path / "proc"
    monkeypatch.setattr(writer_module, "free_bytes", lambda path: 2 * MiB)
    with pytest.raises(StorageError) as caught:
        write(root_path, regions_of(1 * MiB))
    assert caught.value.message == (
        f"not enough space in {root_path}: the snapshot needs {5 * MiB} bytes (5.0 MiB), "
        f"{2 * MiB} are free (2.0 MiB)"
    )
    assert not root_path.exists()  # a failed first sleep leaves no directory behind


def test_the_free_space_check_counts_what_can_be_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root_path = tmp_path / "proc"
    regions = regions_of(1 * MiB)
    write(root_path, regions)
    monkeypatch.setattr(writer_module, "free_bytes", lambda path: 2 * MiB)
    again = write(root_path, regions)  # all of it can be reused: only the manifest is new
    assert again.written_bytes == 0


def test_the_free_space_check_counts_packed_small_chunks_at_their_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """2,000 tensors of 100 bytes take about 0.2 MB packed, not the 8 MB a page each would."""
    regions = [BytesRegion(f"w/r{i}", "w", os.urandom(100)) for i in range(2000)]  # all distinct
    free = 2000 * 100 + writer_module.FREE_SPACE_MARGIN + 64 * 1024
    monkeypatch.setattr(writer_module, "free_bytes", lambda path: free)
    result = write(tmp_path / "proc", regions)
    assert result.written_bytes == 2000 * 100
    assert sum(f.stat().st_size for f in (tmp_path / "proc" / result.snapshot).glob("*.bin")) < free


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    if not is_root():
        pytest.skip("mounting a small filesystem needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_a_real_full_filesystem_mid_write(small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(writer_module, "free_bytes", lambda path: 1 << 40)  # get past the check
    regions = regions_of(1 * MiB, 2)
    before = [bytes(r.data) for r in regions]
    with pytest.raises(StorageError, match=r"^no space left on the device of .*nothing was published"):
        write(small_tmpfs / "proc", regions)
    assert not (small_tmpfs / "proc").exists(), "the temporary directory and the empty root were removed"
    assert [bytes(r.data) for r in regions] == before


def test_a_real_full_filesystem_is_refused_up_front(small_tmpfs: Path) -> None:
    with pytest.raises(StorageError, match=r"^not enough space in .*: the snapshot needs \d+ bytes"):
        write(small_tmpfs / "proc", regions_of(1 * MiB, 2))
    assert not (small_tmpfs / "proc").exists()


def test_a_cancelled_spill_publishes_nothing(tmp_path: Path) -> None:
    root_path = tmp_path / "proc"
    calls = [0]

    def cancelled() -> bool:
        calls[0] += 1
        return calls[0] > 3

    # Asked once per run of chunks a stager takes (at most 8 MiB): 48 MiB is called off midway.
    with SpillRoot(root_path, create=True) as root, pytest.raises(AbortedError, match="called off"):
        write_snapshot(root, regions_of(12 * 1024 * KiB), producer={}, options=OPTIONS, cancelled=cancelled)
    assert not root_path.exists()  # a failed first sleep leaves no directory behind


def test_a_failing_region_copy_aborts_and_its_error_comes_through(tmp_path: Path) -> None:
    class Broken(BytesRegion):
        def copy_out(self, offset: int, dst: memoryview) -> None:
            raise RuntimeError("device lost")

    regions: list[BytesRegion] = [
        *regions_of(64 * KiB, 2),
        Broken("weights/x", "weights", bytes(64 * KiB), host=False),
    ]
    with pytest.raises(RuntimeError, match="device lost"):
        write(tmp_path / "proc", regions)
    assert not (tmp_path / "proc").exists()
