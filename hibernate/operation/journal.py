"""The journal and the per-target lock: how a killed ``hibernate`` command is survived.

Before each step of a sleep or wake moves on, the orchestrator records (temp
file, rename: a reader sees a whole entry or none) what it set out to do and
which steps are complete (its *marks*), in one entry per process it acts on. Entries are
not fsynced: they must outlive a killed command, which the page cache does,
and they mean nothing after the machine goes down, when the processes they
describe are gone too (the next command sweeps them). On the disk measured,
two fsyncs per entry per step cost 0.2 s of a four-process sleep. The entry sits
beside the process's agent socket, so any later command, whoever runs it,
finds it. ``hibernate status`` shows an unfinished entry with the command that
resolves it; ``hibernate wake`` and ``hibernate recover`` read it.

An entry also lists each checkpoint or restore the operation started in a
process of its own (:mod:`hibernate.checkpoint.detached`), by that process's
pid and start time, before the command waits for it: such a call is never
cut, so it may outlive the command, and the next command on the process waits
for it to return before it reads the process's state.

The lock is an ``flock`` on a file per process: the kernel drops it when its
holder dies, however it dies, so a killed command never leaves a target locked.
The holder writes who it is into the file, so the next one can say who is busy.

Both live in the runtime directory of the process's user, which that user
controls. When root acts on the process it reaches ``journal/`` and ``locks/``
through directory descriptors, refusing symbolic links (fsutil), and gives
every directory, entry and lock file it creates to the process's user: the
user's own later commands must be able to lock and journal the same process.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.checkpoint.base import DetachedCall
from hibernate.errors import BusyError, HibernateError, PermissionDeniedError
from hibernate.fsutil import open_existing_dir, open_private_dir, read_small_file, write_file_atomic
from hibernate.procinfo import ProcessIdentity

JOURNAL_VERSION = 1
_LIMIT = 1 << 20


def _name(ident: ProcessIdentity, suffix: str) -> str:
    return f"{ident.pid}-{ident.start_time}.{suffix}"


@dataclass
class Entry:
    """What one operation intends for one process, and how far it got."""

    op: str  # "sleep" or "wake"
    pid: int
    start_time: int
    cli_pid: int
    directory: str | None
    members: list[list[int]]  # every agent of the operation: [pid, start_time]
    cuda_holders: list[list[int]]  # every CUDA holder of the operation: [pid, start_time]
    checkpointer: str | None = None
    marks: list[str] = field(default_factory=list)  # the steps completed, in order ("phases" on disk)
    calls: list[DetachedCall] = field(default_factory=list)  # checkpoints and restores started detached
    started_unix: float = field(default_factory=time.time)
    version: int = JOURNAL_VERSION

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_time)

    @property
    def last_mark(self) -> str | None:
        return self.marks[-1] if self.marks else None

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        wire["phases"] = wire.pop("marks")  # the file's key since its first version
        return wire


def _int_pairs(value: object) -> list[list[int]]:
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(n, int) for n in p) for p in value
    ):
        raise ValueError("expected a list of [pid, start_time] pairs")
    return [list(p) for p in value]


def _calls(value: object) -> list[DetachedCall]:
    """The detached calls of an entry, checked field by field."""
    if not isinstance(value, list):
        raise ValueError("calls must be a list")
    calls = []
    for item in value:
        helper = item.get("helper") if isinstance(item, dict) else None
        if not (
            isinstance(item, dict)
            and isinstance(item.get("pid"), int)
            and item.get("step") in ("checkpoint", "restore")
            and isinstance(item.get("what"), str)
            and isinstance(helper, dict)
            and isinstance(helper.get("pid"), int)
            and isinstance(helper.get("start_time"), int)
        ):
            raise ValueError("a call must name pid, step, what and its helper's pid and start_time")
        calls.append(
            DetachedCall(
                item["pid"], item["step"], item["what"], ProcessIdentity(helper["pid"], helper["start_time"])
            )
        )
    return calls


def parse_entry(data: bytes) -> Entry:
    """A journal entry from JSON, validated field by field (nothing is executed)."""
    raw = json.loads(data.decode("utf-8"))
    if not isinstance(raw, dict) or raw.get("version") != JOURNAL_VERSION:
        raise ValueError("not a version-1 journal entry")
    if raw.get("op") not in ("sleep", "wake"):
        raise ValueError(f"unknown operation {raw.get('op')!r}")
    for name in ("pid", "start_time", "cli_pid"):
        if not isinstance(raw.get(name), int):
            raise ValueError(f"{name} must be an integer")
    phases = raw.get("phases", [])
    if not isinstance(phases, list) or not all(isinstance(p, str) for p in phases):
        raise ValueError("phases must be a list of names")
    directory = raw.get("directory")
    checkpointer = raw.get("checkpointer")
    started = raw.get("started_unix", 0.0)
    return Entry(
        op=raw["op"],
        pid=raw["pid"],
        start_time=raw["start_time"],
        cli_pid=raw["cli_pid"],
        directory=directory if isinstance(directory, str) else None,
        members=_int_pairs(raw.get("members", [])),
        cuda_holders=_int_pairs(raw.get("cuda_holders", [])),
        checkpointer=checkpointer if isinstance(checkpointer, str) else None,
        marks=list(phases),
        calls=_calls(raw.get("calls", [])),
        started_unix=float(started) if isinstance(started, (int, float)) else 0.0,
    )


class Journal:
    """Entries for the processes whose agents listen in ``directory``."""

    def __init__(self, directory: Path, owner_uid: int | None = None) -> None:
        self.directory = directory / "journal"
        self._owner_uid = owner_uid

    def record(self, entry: Entry) -> None:
        fd = open_private_dir(self.directory, owner_uid=self._owner_uid)
        try:
            data = json.dumps(entry.to_wire()).encode()
            write_file_atomic(
                fd, _name(entry.identity, "json"), data, owner_uid=self._owner_uid, durable=False
            )
        finally:
            os.close(fd)

    def mark(self, entry: Entry, step: str) -> None:
        entry.marks.append(step)
        self.record(entry)

    def load(self, ident: ProcessIdentity) -> Entry | None:
        """The entry of ``ident``; a journal directory swapped for a link is refused, not read."""
        try:
            fd = open_existing_dir(self.directory)
        except OSError:
            return None
        try:
            entry = parse_entry(read_small_file(fd, _name(ident, "json"), _LIMIT))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, OSError):
            return None  # a damaged entry is no guide; real states decide instead
        finally:
            os.close(fd)
        return entry if entry.identity == ident else None

    def remove(self, ident: ProcessIdentity) -> None:
        fd = _open_quietly(self.directory)  # runs while an operation ends, failed ones too
        if fd is None:
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_name(ident, "json"), dir_fd=fd)
        finally:
            os.close(fd)

    def sweep_locks(self) -> None:
        """Delete lock files of processes that are gone: nobody can ever lock them again."""
        fd = _open_quietly(self.directory.parent / "locks")
        if fd is None:
            return
        try:
            for name in os.listdir(fd):
                ident = _parse_name(name, "lock")
                if ident is not None and not procinfo.is_alive(ident):
                    with contextlib.suppress(OSError):
                        os.unlink(name, dir_fd=fd)
        finally:
            os.close(fd)

    def _identities(self) -> list[ProcessIdentity]:
        """The processes this journal holds an entry for, live or not."""
        fd = _open_quietly(self.directory)
        if fd is None:
            return []
        try:
            names = sorted(os.listdir(fd))
        finally:
            os.close(fd)
        return [ident for name in names if (ident := _parse_name(name, "json")) is not None]

    def entries(self) -> list[Entry]:
        """Every entry whose process still lives."""
        found = []
        for ident in self._identities():
            entry = self.load(ident) if procinfo.is_alive(ident) else None
            if entry is not None:
                found.append(entry)
        return found

    def sweep_dead_entries(self) -> None:
        """Delete the entries of processes that are gone: nothing can be resumed for them."""
        for ident in self._identities():
            if not procinfo.is_alive(ident):
                self.remove(ident)


def _parse_name(name: str, suffix: str) -> ProcessIdentity | None:
    """The process a ``<pid>-<start_time>.<suffix>`` file is for; None for any other name."""
    stem, _, found = name.partition(".")
    pid_text, _, start_text = stem.partition("-")
    if found != suffix or not (pid_text.isdigit() and start_text.isdigit()):
        return None
    return ProcessIdentity(int(pid_text), int(start_text))


def _open_quietly(path: Path) -> int | None:
    """A directory to tidy, or None when it is missing, unreadable or not safely reachable.

    Tidying runs on every exit path of an operation, failed ones too: it must
    never raise over the error being reported.
    """
    try:
        return open_existing_dir(path)
    except (OSError, HibernateError):
        return None


def _foreign_lock(path: Path, uid: int) -> PermissionDeniedError:
    return PermissionDeniedError(
        f"lock file {path} belongs to uid {uid}, not to you; it was left by a hibernate command "
        "of that user (an older hibernate run as root leaves one)",
        hint=f"if no hibernate command of uid {uid} is running on this process, remove it: rm {path}",
    )


class TargetLock:
    """One operation at a time per process, released by the kernel when the holder dies."""

    def __init__(self, directory: Path, ident: ProcessIdentity, owner_uid: int | None = None) -> None:
        self.directory = directory / "locks"
        self.ident = ident
        self._owner_uid = owner_uid
        self._fd: int | None = None

    def acquire(self, description: str) -> None:
        name = _name(self.ident, "lock")
        dir_fd = open_private_dir(self.directory, owner_uid=self._owner_uid)
        try:
            fd = os.open(
                name,
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
        except PermissionError:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            raise _foreign_lock(self.directory / name, info.st_uid) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PermissionDeniedError(
                    f"{self.directory / name} is a symbolic link; refusing to use it",
                    hint=f"remove it: rm {self.directory / name}",
                ) from None
            raise
        finally:
            os.close(dir_fd)
        try:
            self._own(fd, name)
        except BaseException:
            os.close(fd)
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another hibernate command"
            os.close(fd)
            raise BusyError(
                f"process {self.ident.pid} is busy: {holder} is operating on it",
                hint="wait for it to finish, then retry",
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, description.encode(), 0)
        self._fd = fd

    def _own(self, fd: int, name: str) -> None:
        """Check the opened lock file is a plain file of its own, and that it belongs to the process's user.

        A hard link to another file (where the kernel allows linking files one
        does not own) would otherwise be truncated and written by root.
        """
        info = os.fstat(fd)
        shown = self.directory / name
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise PermissionDeniedError(
                f"{shown} is not a plain file of its own ({info.st_nlink} links); refusing to use it",
                hint=f"remove it: rm {shown}",
            )
        expected = os.getuid() if self._owner_uid is None else self._owner_uid
        if info.st_uid != expected:
            if os.getuid() != 0 or self._owner_uid is None or info.st_uid != 0:
                raise _foreign_lock(shown, info.st_uid)
            os.fchown(fd, self._owner_uid, -1)  # root's: just created, or left by an older version
        if stat.S_IMODE(info.st_mode) != 0o600:
            os.fchmod(fd, 0o600)

    def holder(self) -> str | None:
        """Who holds the lock now, or None if nobody does (the lock is not taken)."""
        try:
            dir_fd = open_existing_dir(self.directory)
        except OSError:
            return None
        name = _name(self.ident, "lock")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
        except PermissionError:
            info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            raise _foreign_lock(self.directory / name, info.st_uid) from None
        finally:
            os.close(dir_fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "another hibernate command"
        finally:
            os.close(fd)
        return None

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing drops the flock
            self._fd = None
