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


_MAX_SYMLINKS = 40  # as the kernel's own limit on a path lookup


def _refuse_link(shown: str, owner: int) -> PermissionDeniedError:
    return PermissionDeniedError(
        f"{shown} is a symbolic link owned by uid {owner}; refusing to follow it",
        hint="a link is followed only if it belongs to you or to root; use the real path",
    )


def _walk_to_parent(path: Path, *, create: bool, owner_uid: int | None) -> tuple[int, str]:
    """Open the directory that holds ``path``'s last component, one component at a time.

    Each component is opened with ``O_NOFOLLOW`` relative to the one before, so
    nothing between a check and a use can be swapped under us. A symbolic link
    on the way is followed only if it belongs to root or to the caller: those
    can already do whatever the link would lead us to, while a link planted by
    another user (the owner of a runtime directory root acts in) is refused,
    the way the kernel's ``protected_symlinks`` treats links in sticky
    directories. Missing components are created when ``create`` (as ``mkdir
    -p`` would, and given to ``owner_uid`` when root creates them for a user).
    Returns the open parent descriptor (the caller closes it) and the leaf name.
    """
    absolute = Path(path).absolute()
    pending = list(absolute.parts[1:])
    if not pending or pending[-1] in (".", ".."):
        raise UsageError(f"{path} does not name a directory hibernate can create")
    leaf = pending.pop()
    fd = os.open("/", _DIR_FLAGS)
    walked = Path("/")
    links = 0
    try:
        while pending:
            name = pending.pop(0)
            if name in ("", "."):
                continue
            try:
                next_fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                next_fd = _make_component(fd, name, walked / name, owner_uid)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    if not create:
                        raise
                    raise StorageError(f"cannot reach {path}: {walked / name}: {exc.strerror}") from exc
                target = _trusted_link(fd, name, walked / name)
                links += 1
                if links > _MAX_SYMLINKS:
                    raise UsageError(f"cannot use {path}: too many symbolic links") from exc
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", _DIR_FLAGS)
                    walked = Path("/")
                pending[:0] = target.split("/")
                continue
            os.close(fd)
            fd = next_fd
            walked = walked.parent if name == ".." else walked / name
    except BaseException:
        os.close(fd)
        raise
    return fd, leaf


def _trusted_link(dir_fd: int, name: str, shown: Path) -> str:
    """The target of the symbolic link ``name``, if root or the caller owns it; refused otherwise.

    The link is opened itself (``O_PATH | O_NOFOLLOW``) and its owner and
    target are read from that descriptor, so it cannot be swapped between the
    check and the read.
    """
    try:
        link_fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        raise PermissionDeniedError(f"{shown} changed while being looked at; refusing to use it") from exc
    try:
        info = os.fstat(link_fd)
        if not stat.S_ISLNK(info.st_mode):
            raise UsageError(f"{shown} exists and is not a directory")
        if info.st_uid not in (0, os.geteuid()):
            raise _refuse_link(str(shown), info.st_uid)
        return os.readlink("", dir_fd=link_fd)
    finally:
        os.close(link_fd)


def _mkdir(parent_fd: int, name: str, mode: int, shown: Path) -> bool:
    """Create directory ``name``; False if it exists already (open it with the same checks)."""
    try:
        os.mkdir(name, mode, dir_fd=parent_fd)
    except FileExistsError:
        return False
    except PermissionError as exc:
        raise StorageError(f"cannot create directory {shown}: permission denied") from exc
    except OSError as exc:
        raise StorageError(f"cannot create directory {shown}: {exc.strerror}") from exc
    return True


def _make_component(parent_fd: int, name: str, shown: Path, owner_uid: int | None) -> int:
    """Create one missing parent directory (umask applies, as with ``mkdir -p``) and open it."""
    made = _mkdir(parent_fd, name, 0o777, shown)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        raise PermissionDeniedError(f"{shown} changed while being created; refusing to use it") from exc
    if made and owner_uid is not None and os.getuid() == 0:
        os.fchown(fd, owner_uid, -1)
    return fd


def open_private_dir(path: Path, *, owner_uid: int | None = None) -> int:
    """``ensure_private_dir``, returning the open directory for use without another lookup.

    Every check and change is made on the opened descriptor (``fstat``,
    ``fchown``, ``fchmod``), never on the path, so a directory swapped for a
    symbolic link at any moment is refused rather than acted through.
    """
    parent_fd, leaf = _walk_to_parent(Path(path), create=True, owner_uid=owner_uid)
    try:
        created = _mkdir(parent_fd, leaf, PRIVATE_DIR_MODE, Path(path))
        try:
            fd = os.open(leaf, _DIR_FLAGS, dir_fd=parent_fd)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):  # a link gives either, by kernel version
                raise StorageError(f"cannot open directory {path}: {exc.strerror}") from exc
            if stat.S_ISLNK(os.stat(leaf, dir_fd=parent_fd, follow_symlinks=False).st_mode):
                raise PermissionDeniedError(f"{path} is a symbolic link; refusing to use it") from exc
            raise UsageError(f"{path} exists and is not a directory") from exc
    finally:
        os.close(parent_fd)
    try:
        _make_private(fd, Path(path), created, owner_uid)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _make_private(fd: int, path: Path, created: bool, owner_uid: int | None) -> None:
    """Give the open directory its owner and mode 0700, or refuse one that is someone else's.

    Root acting for a user gives the user a directory it has just created, or
    one root itself owns (left by an earlier version that did not hand it
    over); a third user's directory is never given away.
    """
    info = os.fstat(fd)
    expected_uid = os.getuid() if owner_uid is None else owner_uid
    if info.st_uid != expected_uid:
        if os.getuid() == 0 and owner_uid is not None and (created or info.st_uid == 0):
            os.fchown(fd, owner_uid, -1)
        elif owner_uid is None or owner_uid == os.getuid():
            raise PermissionDeniedError(
                f"{path} belongs to uid {info.st_uid}, not to you (uid {expected_uid})",
                hint="choose a directory of your own",
            )
        else:
            raise PermissionDeniedError(
                f"{path} belongs to uid {info.st_uid}, not to uid {expected_uid} whose process it serves",
                hint=f"remove it, or make uid {expected_uid} its owner",
            )
    if stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
        os.fchmod(fd, PRIVATE_DIR_MODE)


def ensure_private_dir(path: Path, *, owner_uid: int | None = None) -> None:
    """Create ``path`` (and parents) if missing; the leaf must end up a real 0700 directory.

    An existing directory we own with looser permissions is tightened; one that
    is a symlink, a file, or another user's is refused rather than used. Root
    passes ``owner_uid`` when it creates the directory for a user's process:
    the directory (and any parent it had to create) then belongs to that user.
    """
    os.close(open_private_dir(path, owner_uid=owner_uid))


def open_existing_dir(path: Path) -> int:
    """Open an existing directory reached as ``open_private_dir`` reaches it, creating and changing nothing.

    Raises FileNotFoundError when it is missing and PermissionDeniedError when
    it, or a link on the way that is not ours or root's, is a symbolic link.
    """
    parent_fd, leaf = _walk_to_parent(Path(path), create=False, owner_uid=None)
    try:
        return open_dir(leaf, dir_fd=parent_fd, shown=path)
    finally:
        os.close(parent_fd)


def open_dir(path: Path | str, *, dir_fd: int | None = None, shown: Path | str | None = None) -> int:
    """Open a directory without following a symlink at its last component.

    ``shown`` is what an error names where ``path`` is relative to ``dir_fd``.
    """
    try:
        return os.open(path, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise PermissionDeniedError(
                f"{shown or path} is a symbolic link or not a directory; refusing to follow it"
            ) from exc
        raise


def fsync_dir(dir_fd: int) -> None:
    os.fsync(dir_fd)


def write_file_atomic(
    dir_fd: int, name: str, data: bytes, *, owner_uid: int | None = None, durable: bool = True
) -> None:
    """Publish ``name`` in ``dir_fd`` with ``data``: temp file, fsync, rename, fsync dir.

    Root writing for a user's process passes ``owner_uid``: the file is given to
    that user (on its descriptor, before it is published), so the user's own
    commands can replace or remove it later. ``durable=False`` leaves out both
    fsyncs: the file is still whole or absent to every reader, but only until
    the machine goes down, for state that means nothing after a reboot.
    """
    tmp = f".{name}.{secrets.token_hex(4)}.tmp"
    fd = os.open(
        tmp,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        PRIVATE_FILE_MODE,
        dir_fd=dir_fd,
    )
    try:
        if owner_uid is not None and os.getuid() == 0:
            os.fchown(fd, owner_uid, -1)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.close(fd)
    os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    if durable:
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


_SHOWN_NAME_CHARS = 24  # of a name too long, in the message that refuses it


def _limit(directory: str, name: str, default: int) -> int:
    """A filesystem's limit (``PC_NAME_MAX``, ``PC_PATH_MAX``) where ``directory`` lies, else ``default``."""
    try:
        return os.pathconf(directory, name)
    except (OSError, ValueError):
        return default


def path_length_problem(path: Path) -> str | None:
    """Why ``path`` is longer than a path may be, in words; None if it is not.

    Each name in it is held to the limit of the filesystem it is (or would be
    created) on, read with ``pathconf`` from the deepest directory of the path
    that exists (255 bytes on ext4, xfs, tmpfs and most others), and the whole
    path to ``PC_PATH_MAX``. Refused before any command touches anything: the
    kernel's ENAMETOOLONG would otherwise surface half-way, from whichever call
    met the name first.
    """
    absolute = os.path.abspath(path)
    whole = len(os.fsencode(absolute))
    path_max = _limit("/", "PC_PATH_MAX", 4096)
    if whole >= path_max:
        return f"is {whole} bytes long, more than the {path_max - 1} a path may have"
    existing, exists = "/", True
    for name in Path(absolute).parts[1:]:
        size = len(os.fsencode(name))
        name_max = _limit(existing, "PC_NAME_MAX", 255)
        if size > name_max:
            shown = name if len(name) <= _SHOWN_NAME_CHARS else name[:_SHOWN_NAME_CHARS] + "..."
            return (
                f"has a name of {size} bytes ({shown!r}), more than the {name_max} a name may have "
                f"on the filesystem of {existing}"
            )
        if exists:
            candidate = os.path.join(existing, name)
            exists = os.path.isdir(candidate)  # a name not there yet is created on the same filesystem
            existing = candidate if exists else existing
    return None


def free_bytes(path: Path) -> int:
    info = os.statvfs(path)
    return info.f_bavail * info.f_frsize
