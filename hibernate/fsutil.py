"""Race-safe, private file-system primitives shared by the store and the agent.

Everything hibernate creates is private to its user (directories 0700, files
0600) and is opened without following symbolic links, relative to an already
opened directory, so a path swapped under us cannot redirect a write or a read
(see docs/security.md).
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path

from hibernate.errors import PermissionDeniedError, StorageError, UsageError

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def ensure_private_dir(path: Path, *, owner_uid: int | None = None) -> None:
    """Create ``path`` (and parents) if missing; the leaf must end up a real 0700 directory.

    An existing directory we own with looser permissions is tightened; one that
    is a symlink, a file, or another user's is refused rather than used.
    """
    path = Path(path)
    if path.is_symlink():
        raise PermissionDeniedError(f"{path} is a symbolic link; refusing to use it")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} exists and is not a directory")
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path, PRIVATE_DIR_MODE)
        except FileExistsError:
            pass
        except PermissionError as exc:
            raise StorageError(f"cannot create directory {path}: permission denied") from exc
        except OSError as exc:
            raise StorageError(f"cannot create directory {path}: {exc.strerror}") from exc
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionDeniedError(f"{path} is not a plain directory; refusing to use it")
    expected_uid = os.getuid() if owner_uid is None else owner_uid
    if info.st_uid != expected_uid:
        if os.getuid() == 0 and owner_uid is not None:
            os.chown(path, owner_uid, -1)
        else:
            raise PermissionDeniedError(
                f"{path} belongs to uid {info.st_uid}, not to you (uid {expected_uid})",
                hint="choose a directory of your own",
            )
    if stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
        os.chmod(path, PRIVATE_DIR_MODE)


def open_dir(path: Path | str, *, dir_fd: int | None = None) -> int:
    """Open a directory without following a symlink at its last component."""
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionDeniedError(
                f"{path} is a symbolic link or not a directory; refusing to follow it"
            ) from exc
        raise


def fsync_dir(dir_fd: int) -> None:
    os.fsync(dir_fd)


def write_file_atomic(dir_fd: int, name: str, data: bytes) -> None:
    """Publish ``name`` in ``dir_fd`` with ``data``, durably: temp file, fsync, rename, fsync dir."""
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        PRIVATE_FILE_MODE,
        dir_fd=dir_fd,
    )
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    fsync_dir(dir_fd)


def read_small_file(dir_fd: int, name: str, limit: int) -> bytes:
    """Read a file of at most ``limit`` bytes, refusing symlinks and oversized files."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise ValueError(f"{name} is {size} bytes, more than the {limit} allowed")
        chunks = []
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def free_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize
