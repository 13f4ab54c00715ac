"""A spill root: one process's directory of snapshots, and the rules that keep it whole.

    <--to DIR>/proc-4242-3f9a1c0d2b7e/   0700, one per hibernated process (spill_root_name)
      .hibernate-root                   the marker: made by hibernate, for this owner
      .lock                             flock: writers and gc exclusive, readers shared
      snap-000007/                      published: manifest.json + its data files
      .tmp-snap-000008-1a2b3c4d/        being written; never read; swept by the next writer or gc

A snapshot exists for a reader only once its directory has been renamed to
``snap-N`` with a manifest inside, after every file and the directory were
fsynced: a crash leaves the previous snapshot or the new one, never a mix.
Every snapshot is self-contained (bytes it shares with an older one are hard
links in its own directory), so the newest is kept and older ones are simply
deleted once it is published, and deleting any of them by hand breaks no other.

hibernate touches only directories that carry its marker, naming the process
they belong to: a directory without one is never entered or written to, and
one of another process is never reused, retired or punched.

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
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from hibernate.errors import (
    BusyError,
    HibernateError,
    PermissionDeniedError,
    SnapshotInvalidError,
    StorageError,
    UsageError,
)
from hibernate.fsutil import (
    PRIVATE_DIR_MODE,
    ensure_private_dir,
    fsync_dir,
    open_dir,
    read_small_file,
    write_file_atomic,
)
from hibernate.store.manifest import (
    MANIFEST_NAME,
    Manifest,
    RememberedManifest,
    check_manifest_size,
    manifest_digest,
    snapshot_name,
    snapshot_sequence,
)
from hibernate.store.owner import Owner, parse_owner, spill_root_name
from hibernate.store.parse import parse_manifest

LOCK_NAME = ".lock"
MARKER_NAME = ".hibernate-root"
MARKER_FORMAT = "hibernate-spill-root"
TMP_PREFIX = ".tmp-"
_MARKER_LIMIT = 64 << 10
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
# How many names a sleep tries for its spill root in one --to before it gives up: each is random, so
# more than one taken means someone is taking them on purpose.
ROOT_NAME_TRIES = 8


def _storage_error(exc: OSError, what: str, path: Path) -> StorageError:
    """An OSError inside a snapshot tree as exit 9, naming the path (never a bare PermissionError)."""
    if exc.errno in (errno.EACCES, errno.EPERM):
        return StorageError(
            f"cannot {what} {path}: permission denied",
            hint="give the process's user read and write access to it (directories 0700, files 0600)",
        )
    return StorageError(f"cannot {what} {path}: {exc.strerror or exc}")


def read_marker(dir_fd: int) -> Owner | None:
    """The owner a marked directory names; None if it has no marker (not hibernate's).

    A marker that is a link, not a regular file, oversized or malformed is
    refused: whoever planted it does not get hibernate to touch the directory.
    """
    try:
        info = os.stat(MARKER_NAME, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(info.st_mode):
        raise SnapshotInvalidError(f"{MARKER_NAME} is not a regular file")
    try:
        raw = json.loads(read_small_file(dir_fd, MARKER_NAME, _MARKER_LIMIT).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise SnapshotInvalidError(f"{MARKER_NAME} is not a hibernate marker ({exc})") from exc
    owner = parse_owner(raw.get("owner")) if isinstance(raw, dict) else None
    if owner is None or raw.get("format") != MARKER_FORMAT:
        raise SnapshotInvalidError(f"{MARKER_NAME} is not a hibernate marker")
    return owner


def is_spill_root(path: Path) -> bool:
    """Whether ``path`` is a directory hibernate made for one process's snapshots: its marker is a
    regular file, and neither is reached through a symbolic link.

    PermissionError where it cannot be looked into: what to say then (whose it is, or nothing for
    a listing that passes over it) is the caller's.
    """
    try:
        if stat.S_ISLNK(os.lstat(path).st_mode):
            return False
        return stat.S_ISREG(os.lstat(path / MARKER_NAME).st_mode)
    except PermissionError:
        raise
    except OSError:
        return False


def name_taken(path: Path) -> bool:
    """Whether ``path`` is held by another user: a directory, file or symbolic link of theirs.

    What someone who saw the name in one ``--to`` (or guessed it) can put in
    another to make every sleep there fail. What this user has there is not
    taken: it is this process's root, or is refused for what it is (a link is
    never followed).
    """
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    return info.st_uid != os.geteuid()


def open_spill_root_in(
    base: Path, label: str, token: str, owner: Owner, draw: Callable[[], str]
) -> tuple[SpillRoot, str]:
    """Open, creating it if missing, the spill root ``<base>/<label>-<token>``, and the token it took.

    Where the name is taken by someone else (``name_taken``), another token is
    drawn and tried: the caller keeps the one returned for ``base``, so that its
    later sleeps there find this root, and its snapshot, again.
    """
    for _ in range(ROOT_NAME_TRIES):
        path = base / spill_root_name(label, token)
        try:
            return SpillRoot(path, create=True, owner=owner), token
        except HibernateError:
            if not name_taken(path):
                raise
        token = draw()
    raise PermissionDeniedError(
        f"{ROOT_NAME_TRIES} names for this process's snapshots in {base} were all taken by other users",
        hint="choose a --to directory that only you can write to",
    )


class SpillRoot:
    """One process's spill root, opened by path; every later access is relative to it.

    ``owner`` is the process the root must belong to (default: this one); a
    root marked for anyone else is refused. ``inspect=True`` opens any marked
    root whatever its owner (gc), and ``create=True`` makes the root and its
    marker when missing (a sleep). ``remembered``: a manifest the caller wrote
    here, known again by its bytes rather than parsed (see read_manifest).
    """

    def __init__(
        self,
        path: Path,
        *,
        create: bool = False,
        owner: Owner | None = None,
        owner_uid: int | None = None,
        inspect: bool = False,
        remembered: RememberedManifest | None = None,
    ) -> None:
        self.path = Path(path)
        self._remembered = remembered
        expected = None if inspect else (owner or Owner.current())
        if create:
            ensure_private_dir(self.path, owner_uid=owner_uid)
        try:
            self.fd = open_dir(self.path)
        except FileNotFoundError as exc:
            raise SnapshotInvalidError(f"snapshot directory {self.path} does not exist") from exc
        except OSError as exc:  # denied, or a filesystem gone (ENOTCONN, ESTALE, EIO)
            raise _storage_error(exc, "open", self.path) from exc
        self._lock_fd: int | None = None
        try:
            self.owner = self._claim(expected, create, owner_uid)
        except BaseException:
            os.close(self.fd)
            raise

    def _claim(self, expected: Owner | None, create: bool, owner_uid: int | None) -> Owner:
        """The owner named by the root's marker, after checking it is ``expected``; makes it if asked."""
        try:
            found = read_marker(self.fd)
        except SnapshotInvalidError as exc:
            raise SnapshotInvalidError(f"{self.path}: {exc.message}") from exc
        except OSError as exc:
            raise _storage_error(exc, "read", self.path / MARKER_NAME) from exc
        if found is None:
            if not create or expected is None:
                raise SnapshotInvalidError(
                    f"{self.path} was not made by hibernate (it has no {MARKER_NAME}); not touching it"
                )
            if self._entries():
                raise UsageError(
                    f"{self.path} exists and was not made by hibernate (it has no {MARKER_NAME}); "
                    "refusing to write into it",
                    hint="choose another --to directory, or move that directory away",
                )
            self._mark(expected, owner_uid)
            return expected
        if expected is not None and not found.same_process(expected):
            raise SnapshotInvalidError(
                f"{self.path} belongs to another process, {found.describe()}, not {expected.describe()}; "
                "not touching it"
            )
        return found

    def _mark(self, owner: Owner, owner_uid: int | None) -> None:
        """Make an empty directory a spill root: the lock file first, then the marker (atomically)."""
        try:
            fd = os.open(
                LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=self.fd
            )
            try:
                if owner_uid is not None and os.getuid() == 0:
                    os.fchown(fd, owner_uid, -1)
            finally:
                os.close(fd)
            body = {"format": MARKER_FORMAT, "version": 1, "owner": owner.to_json()}
            write_file_atomic(self.fd, MARKER_NAME, json.dumps(body, sort_keys=True).encode() + b"\n")
            if owner_uid is not None and os.getuid() == 0:
                os.chown(MARKER_NAME, owner_uid, -1, dir_fd=self.fd, follow_symlinks=False)
        except OSError as exc:
            raise _storage_error(exc, "create files in", self.path) from exc

    def close(self) -> None:
        self.unlock()
        os.close(self.fd)

    def __enter__(self) -> SpillRoot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- locking -----------------------------------------------------------

    def lock(self, *, exclusive: bool, wait: bool = False) -> bool:
        """Take the root's lock; without ``wait``, returns False if someone else holds it.

        The lock file is never created here (a marked root has one since it
        was made): gc creates nothing. A root removed while we waited for its
        lock is reported as gone.
        """
        if self._lock_fd is None:
            try:
                self._lock_fd = os.open(
                    LOCK_NAME, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=self.fd
                )
            except FileNotFoundError as exc:
                raise SnapshotInvalidError(
                    f"{self.path / LOCK_NAME} is missing; it was deleted by hand",
                    hint=f"if no hibernate is working on {self.path}, create it empty (mode 0600)",
                ) from exc
            except OSError as exc:
                raise _storage_error(exc, "open", self.path / LOCK_NAME) from exc
        flags = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(self._lock_fd, flags | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        if os.fstat(self._lock_fd).st_nlink == 0:
            self.unlock()
            raise SnapshotInvalidError(f"{self.path} was removed (by gc) while we waited for it")
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
        return sorted(n for n in os.listdir(self.fd) if n not in (LOCK_NAME, MARKER_NAME))

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

    def unfinished(self) -> list[str]:
        """Snapshots being written or left by a crash: temporaries and ``snap-N`` without a manifest."""
        published = set(self.published())
        return [
            name
            for name in self._entries()
            if name.startswith(TMP_PREFIX) or (snapshot_sequence(name) is not None and name not in published)
        ]

    def next_sequence(self) -> int:
        """One past every snapshot number in use, published, unfinished or being written."""
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
            raise SnapshotInvalidError(self._why_missing(name)) from exc
        except PermissionDeniedError as exc:
            raise SnapshotInvalidError(
                f"{self.path / name} is a symbolic link or not a directory; refusing to follow it"
            ) from exc
        except PermissionError as exc:
            raise _storage_error(exc, "open", self.path / name) from exc
        try:
            data = _read_manifest_file(snap_fd, where)
        finally:
            os.close(snap_fd)
        known = self._remembered
        if known is not None and known.manifest.snapshot == name and manifest_digest(data) == known.digest:
            manifest = known.manifest  # the very bytes this process published: parsed, they give it
        else:
            manifest = parse_manifest(data, where)
        if manifest.snapshot != name:
            raise SnapshotInvalidError(f"{where}: names snapshot {manifest.snapshot!r}, not {name!r}")
        if not manifest.owner.same_process(self.owner):
            raise SnapshotInvalidError(
                f"{where}: belongs to {manifest.owner.describe()}, not to this root's {self.owner.describe()}"
            )
        return manifest

    def _why_missing(self, name: str) -> str:
        """A missing snapshot explained: replaced by a newer sleep, or deleted."""
        newer = [n for n in self.published() if (snapshot_sequence(n) or 0) > (snapshot_sequence(name) or 0)]
        if newer:
            return (
                f"snapshot {self.path / name} was retired: a newer sleep of this process replaced it "
                f"with {newer[-1]}"
            )
        return f"snapshot {self.path / name} does not exist (it was deleted)"

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
        try:
            os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=self.fd)
            tmp_fd = open_dir(name, dir_fd=self.fd)
        except OSError as exc:
            raise _storage_error(exc, "create a snapshot in", self.path) from exc
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

    def delete_snapshot(self, name: str) -> int:
        """Remove snapshot ``name`` whole (manifest first, so it is never half there); bytes freed, the
        manifest's included."""
        freed = 0
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            freed = _unlink_any(self.fd, f"{name}/{MANIFEST_NAME}")
            fsync_dir(self.fd)
        try:
            return freed + _unlink_any(self.fd, name)
        except FileNotFoundError:
            return freed

    def retire_all_but(self, keep: str | None) -> int:
        """Delete every published snapshot but ``keep`` (each is self-contained); bytes freed."""
        return sum(self.delete_snapshot(name) for name in self.published() if name != keep)

    def sweep_unfinished(self) -> int:
        """Remove what failed or crashed writers left; the caller holds the exclusive lock."""
        return sum(_unlink_any(self.fd, name) for name in self.unfinished())

    def remove(self) -> int:
        """Delete the whole root, marker and lock last; the caller holds the exclusive lock.

        Whoever opened the root and waits for its lock finds it removed (see
        :meth:`lock`). Returns the bytes freed.
        """
        freed = sum(_unlink_any(self.fd, name) for name in self._entries())
        os.unlink(MARKER_NAME, dir_fd=self.fd)
        os.unlink(LOCK_NAME, dir_fd=self.fd)
        parent_fd = open_dir(self.path.parent)
        try:
            info = os.stat(self.path.name, dir_fd=parent_fd, follow_symlinks=False)
            mine = os.fstat(self.fd)
            if (info.st_dev, info.st_ino) == (mine.st_dev, mine.st_ino):
                os.rmdir(self.path.name, dir_fd=parent_fd)
        finally:
            os.close(parent_fd)
        return freed

    def is_empty(self) -> bool:
        """Nothing in the root but its marker and lock."""
        return not self._entries()


def _read_manifest_file(snap_fd: int, where: str) -> bytes:
    """The manifest's bytes: a regular file, not a link, not a FIFO, not oversized."""
    try:
        fd = os.open(
            MANIFEST_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=snap_fd
        )
    except FileNotFoundError as exc:
        raise SnapshotInvalidError(
            f"{where} is missing: the snapshot was never published, or its manifest was deleted"
        ) from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SnapshotInvalidError(f"{where} is a symbolic link; refusing to follow it") from exc
        raise _storage_error(exc, "read", Path(where)) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotInvalidError(f"{where} is not a regular file")
        check_manifest_size(info.st_size, 0, where)
        # One read of the whole file (a manifest of 100,000 tensors is 25 MB; read in 1 MiB parts
        # and joined, it was copied twice), then whatever it grew by since the fstat.
        data = os.read(fd, info.st_size + 1)
        grown = []
        while chunk := os.read(fd, 1 << 20):
            grown.append(chunk)
        return b"".join([data, *grown]) if grown else data
    except OSError as exc:
        raise _storage_error(exc, "read", Path(where)) from exc
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


def punch_unused(dir_fd: int, name: str, used: list[tuple[int, int]]) -> int:
    """Give back the blocks of ``name`` outside the sorted, merged ``used`` ranges; bytes freed.

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
        os.fsync(fd)
        return max(0, allocated - os.fstat(fd).st_blocks * 512)
    finally:
        os.close(fd)


def _unlink_any(dir_fd: int, name: str) -> int:
    """Unlink a file or a directory tree; never follows links.

    Returns the disk space given back (allocated blocks of files whose last link went).
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
    last_link = stat.S_ISREG(info.st_mode) and info.st_nlink <= 1
    return info.st_blocks * 512 if last_link else 0
