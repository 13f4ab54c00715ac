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
removing their manifest, and their data files go once nothing refers to them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from hibernate.errors import BusyError, SnapshotInvalidError, StorageError
from hibernate.fsutil import (
    PRIVATE_DIR_MODE,
    ensure_private_dir,
    fsync_dir,
    open_dir,
    read_small_file,
)
from hibernate.store.format import (
    MANIFEST_LIMIT_BYTES,
    MANIFEST_NAME,
    Manifest,
    parse_manifest,
    snapshot_name,
    snapshot_sequence,
)

LOCK_NAME = ".lock"
TMP_PREFIX = ".tmp-"


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
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
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

    def _entries(self, dir_fd: int | None = None) -> list[str]:
        return sorted(os.listdir(self.fd if dir_fd is None else dir_fd))

    def published(self) -> list[str]:
        """Names of published snapshots (directory with a manifest), oldest first."""
        names = []
        for name in self._entries():
            if snapshot_sequence(name) is None:
                continue
            try:
                info = os.stat(f"{name}/{MANIFEST_NAME}", dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode):
                names.append(name)
        return sorted(names, key=lambda n: snapshot_sequence(n) or 0)

    def next_sequence(self) -> int:
        sequences = [snapshot_sequence(n) for n in self._entries()]
        for name in self._entries():
            if name.startswith(TMP_PREFIX):
                sequences.append(snapshot_sequence(name[len(TMP_PREFIX) :].rsplit("-", 1)[0]))
        return max((s for s in sequences if s is not None), default=0) + 1

    def read_manifest(self, name: str) -> Manifest:
        where = f"{self.path / name / MANIFEST_NAME}"
        if snapshot_sequence(name) is None:
            raise SnapshotInvalidError(f"{name!r} is not a snapshot name (snap-NNNNNN)")
        try:
            snap_fd = open_dir(name, dir_fd=self.fd)
        except FileNotFoundError as exc:
            raise SnapshotInvalidError(f"snapshot {self.path / name} does not exist") from exc
        except PermissionError as exc:
            raise SnapshotInvalidError(f"{self.path / name}: {exc}") from exc
        try:
            data = read_small_file(snap_fd, MANIFEST_NAME, MANIFEST_LIMIT_BYTES)
        except FileNotFoundError as exc:
            raise SnapshotInvalidError(f"{where} is missing; the snapshot was not published") from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SnapshotInvalidError(f"{where} is a symbolic link; refusing to follow it") from exc
            raise StorageError(f"cannot read {where}: {exc.strerror}") from exc
        except ValueError as exc:
            raise SnapshotInvalidError(f"{where}: {exc}") from exc
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
                self._remove_tree(name)

    def publish(self, tmp_name: str, final_name: str) -> None:
        os.rename(tmp_name, final_name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        fsync_dir(self.fd)

    def retire_all_but(self, keep: Manifest) -> None:
        """Remove older manifests, then every data file and leftover ``keep`` does not use."""
        for name in self.published():
            if name != keep.snapshot:
                os.unlink(f"{name}/{MANIFEST_NAME}", dir_fd=self.fd)
        fsync_dir(self.fd)
        self.sweep(referenced=keep.files(), keep_dir=keep.snapshot)

    def sweep(self, referenced: set[str], keep_dir: str | None) -> int:
        """Delete unreferenced data, retired directories and temporaries; returns bytes freed.

        Callers hold the exclusive lock, so no temporary directory is in use.
        """
        freed = 0
        for name in self._entries():
            if name.startswith(TMP_PREFIX):
                freed += self._remove_tree(name)
            elif snapshot_sequence(name) is not None and name != keep_dir:
                freed += self._sweep_retired(name, referenced)
        return freed

    def _sweep_retired(self, name: str, referenced: set[str]) -> int:
        info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=self.fd)
            return info.st_size
        try:
            os.stat(f"{name}/{MANIFEST_NAME}", dir_fd=self.fd, follow_symlinks=False)
            return 0  # still published (a newer publish will retire it)
        except FileNotFoundError:
            pass
        freed = 0
        sub_fd = open_dir(name, dir_fd=self.fd)
        try:
            for entry in os.listdir(sub_fd):
                if f"{name}/{entry}" not in referenced:
                    freed += _unlink_any(sub_fd, entry)
            remaining = os.listdir(sub_fd)
        finally:
            os.close(sub_fd)
        if not remaining:
            os.rmdir(name, dir_fd=self.fd)
        return freed

    def _remove_tree(self, name: str) -> int:
        return _unlink_any(self.fd, name)

    def collect_garbage(self) -> int:
        """``hibernate gc``: keep the newest published snapshot, free everything else."""
        newest = self.latest_manifest()
        if newest is not None:
            for name in self.published():
                if name != newest.snapshot:
                    os.unlink(f"{name}/{MANIFEST_NAME}", dir_fd=self.fd)
            fsync_dir(self.fd)
        return self.sweep(
            referenced=newest.files() if newest else set(),
            keep_dir=newest.snapshot if newest else None,
        )

    def disk_usage(self) -> int:
        total = 0
        for name in self._entries():
            info = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            if stat.S_ISDIR(info.st_mode):
                sub_fd = open_dir(name, dir_fd=self.fd)
                try:
                    for entry in os.listdir(sub_fd):
                        total += os.stat(entry, dir_fd=sub_fd, follow_symlinks=False).st_blocks * 512
                finally:
                    os.close(sub_fd)
        return total


def _unlink_any(dir_fd: int, name: str) -> int:
    """Unlink a file (or an unexpected nested directory's files); never follows links."""
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
    return info.st_size
