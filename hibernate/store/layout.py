"""A spill root: one process's directory of snapshots, and the rules that keep it whole.

    <root>/                       0700, one per hibernated process
      .lock                       flock: writers and gc exclusive, readers shared
      snap-000007/                published: manifest.json + data-NNN.bin
      snap-000006/                retired: no manifest, only data still referenced by snap-000007
      .tmp-snap-000008-1a2b3c4d/  being written; never read; swept by the next writer or gc

A snapshot exists for a reader only once its directory has been renamed to
``snap-N`` with a manifest inside, after every file and the directory were
fsynced: a crash leaves the previous snapshot or the new one, never a mix.
Only the newest published snapshot is kept; older ones are retired by
removing their manifest. Their data goes once nothing refers to it: a whole
file when no chunk of it is used, otherwise the unused ranges are punched out
(the file keeps its size, so offsets stay valid, but gives its blocks back).

Every access after opening the root is relative to the root's descriptor and
never follows a symbolic link, so a path swapped under us cannot redirect a
read, a write or a deletion.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

from hibernate.errors import BusyError, PermissionDeniedError, SnapshotInvalidError, StorageError
from hibernate.fsutil import PRIVATE_DIR_MODE, ensure_private_dir, fsync_dir, open_dir
from hibernate.store.format import (
    MANIFEST_LIMIT_BYTES,
    MANIFEST_NAME,
    Manifest,
    align_up,
    parse_manifest,
    snapshot_name,
    snapshot_sequence,
)

LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02

# file (relative to the root) -> sorted (start, end) byte ranges some published snapshot uses
Ranges = dict[str, list[tuple[int, int]]]


def referenced_ranges(manifests: Iterable[Manifest]) -> Ranges:
    """The byte ranges of data files that ``manifests`` use (each chunk with its alignment padding)."""
    ranges: Ranges = {}
    for manifest in manifests:
        for record in manifest.records:
            for chunk in record.chunks:
                ranges.setdefault(chunk.file, []).append(
                    (chunk.offset, chunk.offset + align_up(chunk.length))
                )
    return {file: _merge(spans) for file, spans in ranges.items()}


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class SpillRoot:
    """Opened by path; every later access is relative to the opened directory."""

    def __init__(self, path: Path, *, create: bool = False, owner_uid: int | None = None) -> None:
        self.path = Path(path)
        if create:
            ensure_private_dir(self.path, owner_uid=owner_uid)
        try:
            self.fd = open_dir(self.path)
        except FileNotFoundError as exc:
            raise SnapshotInvalidError(f"snapshot directory {self.path} does not exist") from exc
        self._lock_fd: int | None = None

    def close(self) -> None:
        self.unlock()
        os.close(self.fd)

    def __enter__(self) -> SpillRoot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- locking -----------------------------------------------------------

    def lock(self, *, exclusive: bool, wait: bool = False) -> bool:
        """Take the root's lock; without ``wait``, returns False if someone else holds it."""
        if self._lock_fd is None:
            self._lock_fd = os.open(
                LOCK_NAME,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                0o600,
                dir_fd=self.fd,
            )
        flags = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(self._lock_fd, flags | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def lock_for_write(self) -> None:
        if not self.lock(exclusive=True):
            raise BusyError(f"another hibernate operation is writing or collecting {self.path}")

    def unlock(self) -> None:
        if self._lock_fd is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- what is there -----------------------------------------------------

    def _entries(self) -> list[str]:
        return sorted(os.listdir(self.fd))

    def _is_dir(self, name: str) -> bool:
        """A real directory (a symlink to one is not)."""
        try:
            return stat.S_ISDIR(os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode)
        except FileNotFoundError:
            return False

    def _has_manifest(self, name: str) -> bool:
        try:
            info = os.stat(f"{name}/{MANIFEST_NAME}", dir_fd=self.fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return False
        return stat.S_ISREG(info.st_mode)

    def published(self) -> list[str]:
        """Names of published snapshots (a real directory with a manifest), oldest first."""
        names = [
            name
            for name in self._entries()
            if snapshot_sequence(name) is not None and self._is_dir(name) and self._has_manifest(name)
        ]
        return sorted(names, key=lambda n: snapshot_sequence(n) or 0)

    def next_sequence(self) -> int:
        """One past every snapshot number in use, published, retired or being written."""
        sequences = [snapshot_sequence(n) for n in self._entries()]
        for name in self._entries():
            if name.startswith(TMP_PREFIX):
                sequences.append(snapshot_sequence(name[len(TMP_PREFIX) :].rsplit("-", 1)[0]))
        return max((s for s in sequences if s is not None), default=0) + 1

    def read_manifest(self, name: str) -> Manifest:
        """The validated manifest of snapshot ``name``; every refusal names the file and the problem."""
        where = f"{self.path / name / MANIFEST_NAME}"
        if snapshot_sequence(name) is None:
            raise SnapshotInvalidError(f"{name!r} is not a snapshot name (snap-NNNNNN)")
        try:
            snap_fd = open_dir(name, dir_fd=self.fd)
        except FileNotFoundError as exc:
            raise SnapshotInvalidError(f"snapshot {self.path / name} does not exist") from exc
        except PermissionDeniedError as exc:
            raise SnapshotInvalidError(
                f"{self.path / name} is a symbolic link or not a directory; refusing to follow it"
            ) from exc
        except PermissionError as exc:
            raise SnapshotInvalidError(f"{self.path / name}: {exc.strerror}") from exc
        try:
            data = _read_manifest_file(snap_fd, where)
        finally:
            os.close(snap_fd)
        manifest = parse_manifest(data, where)
        if manifest.snapshot != name:
            raise SnapshotInvalidError(f"{where}: names snapshot {manifest.snapshot!r}, not {name!r}")
        return manifest

    def latest_manifest(self) -> Manifest | None:
        """The newest published snapshot that parses, for chunk reuse; broken ones are skipped."""
        for name in reversed(self.published()):
            try:
                return self.read_manifest(name)
            except SnapshotInvalidError:
                continue
        return None

    def _published_manifests(self) -> tuple[list[Manifest], list[str]]:
        """Every published manifest that parses, and the names of those that do not."""
        good, broken = [], []
        for name in self.published():
            try:
                good.append(self.read_manifest(name))
            except SnapshotInvalidError:
                broken.append(name)
        return good, broken

    # -- writing -----------------------------------------------------------

    @contextlib.contextmanager
    def staging_dir(self, sequence: int, token: str) -> Iterator[tuple[str, int]]:
        """A fresh temporary snapshot directory, removed unless :meth:`publish` renamed it."""
        name = f"{TMP_PREFIX}{snapshot_name(sequence)}-{token}"
        os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=self.fd)
        tmp_fd = open_dir(name, dir_fd=self.fd)
        try:
            yield name, tmp_fd
        finally:
            os.close(tmp_fd)
            with contextlib.suppress(FileNotFoundError):
                _unlink_any(self.fd, name)

    def publish(self, tmp_name: str, final_name: str) -> None:
        """The commit point: the snapshot appears, whole, under its final name."""
        os.rename(tmp_name, final_name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        fsync_dir(self.fd)

    def retire_all_but(self, keep: Manifest) -> None:
        """After a publish: remove older manifests, then everything ``keep`` does not use."""
        for name in self.published():
            if name != keep.snapshot:
                os.unlink(f"{name}/{MANIFEST_NAME}", dir_fd=self.fd)
        fsync_dir(self.fd)
        self.sweep(referenced_ranges([keep]))

    def sweep_leftovers(self) -> int:
        """Before a write: clear what earlier failures and crashes left, keeping every published byte.

        If a published manifest cannot be read we cannot know what it uses, so
        only temporaries go.
        """
        good, broken = self._published_manifests()
        return self.sweep(None if broken else referenced_ranges(good))

    def sweep(self, referenced: Ranges | None) -> int:
        """Delete temporaries and, when ``referenced`` is known, retired data it does not cover.

        Published snapshot directories are never touched. Callers hold the
        exclusive lock, so no temporary directory is in use. Returns the bytes
        of disk space given back.
        """
        freed = 0
        for name in self._entries():
            if name.startswith(TMP_PREFIX):
                freed += _unlink_any(self.fd, name)
            elif (
                referenced is not None
                and snapshot_sequence(name) is not None
                and not self._has_manifest(name)
            ):
                freed += self._sweep_retired(name, referenced)
        return freed

    def _sweep_retired(self, name: str, referenced: Ranges) -> int:
        if not self._is_dir(name):
            return _unlink_any(self.fd, name)  # a file or link with a snapshot's name: not ours
        freed = 0
        sub_fd = open_dir(name, dir_fd=self.fd)
        try:
            for entry in os.listdir(sub_fd):
                used = referenced.get(f"{name}/{entry}")
                freed += _unlink_any(sub_fd, entry) if used is None else _punch_unused(sub_fd, entry, used)
            remaining = os.listdir(sub_fd)
        finally:
            os.close(sub_fd)
        if not remaining:
            os.rmdir(name, dir_fd=self.fd)
        return freed

    def collect_garbage(self) -> tuple[int, list[str]]:
        """``hibernate gc``: keep the newest published snapshot, free everything else.

        Returns the bytes freed and warnings. A published manifest that does
        not parse and is newer than every one that does might be what a
        sleeping process needs once repaired: then nothing is retired and only
        temporaries go.
        """
        good, broken = self._published_manifests()
        newest = good[-1] if good else None
        newest_sequence = (snapshot_sequence(newest.snapshot) or 0) if newest else 0
        newer_broken = [n for n in broken if (snapshot_sequence(n) or 0) > newest_sequence]
        if newer_broken:
            warning = (
                f"{', '.join(str(self.path / n / MANIFEST_NAME) for n in newer_broken)} cannot be read; "
                "kept every snapshot and its data (repair or delete it, then run gc again)"
            )
            return self.sweep(None), [warning]
        for name in self.published():
            if newest is None or name != newest.snapshot:
                os.unlink(f"{name}/{MANIFEST_NAME}", dir_fd=self.fd)
        fsync_dir(self.fd)
        return self.sweep(referenced_ranges([newest] if newest else [])), []


def _read_manifest_file(snap_fd: int, where: str) -> bytes:
    """The manifest's bytes: a regular file, not a link, not a FIFO, not oversized."""
    try:
        fd = os.open(
            MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=snap_fd
        )
    except FileNotFoundError as exc:
        raise SnapshotInvalidError(f"{where} is missing; the snapshot was not published") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SnapshotInvalidError(f"{where} is a symbolic link; refusing to follow it") from exc
        raise StorageError(f"cannot read {where}: {exc.strerror}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotInvalidError(f"{where} is not a regular file")
        if info.st_size > MANIFEST_LIMIT_BYTES:
            raise SnapshotInvalidError(
                f"{where} is {info.st_size} bytes, more than the {MANIFEST_LIMIT_BYTES} allowed"
            )
        parts = []
        while chunk := os.read(fd, 1 << 20):
            parts.append(chunk)
        return b"".join(parts)
    except OSError as exc:
        raise StorageError(f"cannot read {where}: {exc.strerror}") from exc
    finally:
        os.close(fd)


_libc: ctypes.CDLL | None = None


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if _libc.fallocate(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _punch_unused(dir_fd: int, name: str, used: list[tuple[int, int]]) -> int:
    """Give back the blocks of ``name`` outside ``used``; returns the bytes freed.

    Filesystems without hole punching keep the blocks until the whole file goes.
    """
    fd = os.open(name, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return 0
        allocated = info.st_blocks * 512
        if allocated <= sum(end - start for start, end in used):
            return 0  # nothing left to give back (already punched)
        position = 0
        try:
            for start, end in [*used, (info.st_size, info.st_size)]:
                if start > position:
                    _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, position, start - position)
                position = max(position, end)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                return 0
            raise
        return max(0, allocated - os.fstat(fd).st_blocks * 512)
    finally:
        os.close(fd)


def _unlink_any(dir_fd: int, name: str) -> int:
    """Unlink a file (or an unexpected nested directory's files); never follows links.

    Returns the disk space given back (allocated blocks).
    """
    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISDIR(info.st_mode):
        sub_fd = open_dir(name, dir_fd=dir_fd)
        freed = 0
        try:
            for entry in os.listdir(sub_fd):
                freed += _unlink_any(sub_fd, entry)
        finally:
            os.close(sub_fd)
        os.rmdir(name, dir_fd=dir_fd)
        return freed
    os.unlink(name, dir_fd=dir_fd)
    return info.st_blocks * 512 if stat.S_ISREG(info.st_mode) else 0
