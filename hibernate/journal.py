"""The journal and the per-target lock: how a killed ``hibernate`` command is survived.

Before each phase of a sleep or wake moves on, the orchestrator durably records
(temp file, fsync, rename, fsync directory) what it set out to do and which
phases are complete, in one entry per process it acts on. The entry sits
beside the process's agent socket, so any later command, whoever runs it,
finds it. ``hibernate status`` shows an unfinished entry with the command that
resolves it; ``hibernate wake`` and ``hibernate recover`` read it.

The lock is an ``flock`` on a file per process: the kernel drops it when its
holder dies, however it dies, so a killed command never leaves a target locked.
The holder writes who it is into the file, so the next one can say who is busy.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.errors import BusyError
from hibernate.fsutil import ensure_private_dir, open_dir, read_small_file, write_file_atomic
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
    phases: list[str] = field(default_factory=list)  # completed, in order
    started_unix: float = field(default_factory=time.time)
    version: int = JOURNAL_VERSION

    @property
    def identity(self) -> ProcessIdentity:
        return ProcessIdentity(self.pid, self.start_time)

    @property
    def last_phase(self) -> str | None:
        return self.phases[-1] if self.phases else None

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


def _int_pairs(value: object) -> list[list[int]]:
    if not isinstance(value, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(n, int) for n in p) for p in value
    ):
        raise ValueError("expected a list of [pid, start_time] pairs")
    return [list(p) for p in value]


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
        phases=list(phases),
        started_unix=float(started) if isinstance(started, (int, float)) else 0.0,
    )


class Journal:
    """Entries for the processes whose agents listen in ``directory``."""

    def __init__(self, directory: Path, owner_uid: int | None = None) -> None:
        self.directory = directory / "journal"
        self._owner_uid = owner_uid

    def _dir_fd(self) -> int:
        ensure_private_dir(self.directory, owner_uid=self._owner_uid)
        return open_dir(self.directory)

    def record(self, entry: Entry) -> None:
        fd = self._dir_fd()
        try:
            write_file_atomic(fd, _name(entry.identity, "json"), json.dumps(entry.to_wire()).encode())
            if self._owner_uid is not None and os.getuid() == 0:
                os.chown(_name(entry.identity, "json"), self._owner_uid, -1, dir_fd=fd, follow_symlinks=False)
        finally:
            os.close(fd)

    def mark(self, entry: Entry, phase: str) -> None:
        entry.phases.append(phase)
        self.record(entry)

    def load(self, ident: ProcessIdentity) -> Entry | None:
        try:
            fd = open_dir(self.directory)
        except (FileNotFoundError, OSError):
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
        try:
            fd = open_dir(self.directory)
        except (FileNotFoundError, OSError):
            return
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_name(ident, "json"), dir_fd=fd)
            os.fsync(fd)
        finally:
            os.close(fd)

    def sweep_locks(self) -> None:
        """Delete lock files of processes that are gone: nobody can ever lock them again."""
        locks = self.directory.parent / "locks"
        try:
            names = os.listdir(locks)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return
        for name in names:
            stem, _, suffix = name.partition(".")
            pid_text, _, start_text = stem.partition("-")
            named = suffix == "lock" and pid_text.isdigit() and start_text.isdigit()
            if named and not procinfo.is_alive(ProcessIdentity(int(pid_text), int(start_text))):
                with contextlib.suppress(OSError):
                    os.unlink(locks / name)

    def entries(self) -> list[Entry]:
        """Every entry whose process still lives; entries of dead processes are deleted."""
        try:
            names = sorted(os.listdir(self.directory))
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return []
        found = []
        for name in names:
            stem, _, suffix = name.partition(".")
            pid_text, _, start_text = stem.partition("-")
            if suffix != "json" or not (pid_text.isdigit() and start_text.isdigit()):
                continue
            ident = ProcessIdentity(int(pid_text), int(start_text))
            if not procinfo.is_alive(ident):
                self.remove(ident)
                continue
            entry = self.load(ident)
            if entry is not None:
                found.append(entry)
        return found


class TargetLock:
    """One operation at a time per process, released by the kernel when the holder dies."""

    def __init__(self, directory: Path, ident: ProcessIdentity, owner_uid: int | None = None) -> None:
        self.directory = directory / "locks"
        self.ident = ident
        self._owner_uid = owner_uid
        self._fd: int | None = None

    def acquire(self, description: str) -> None:
        ensure_private_dir(self.directory, owner_uid=self._owner_uid)
        dir_fd = open_dir(self.directory)
        try:
            fd = os.open(
                _name(self.ident, "lock"),
                os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
                dir_fd=dir_fd,
            )
        finally:
            os.close(dir_fd)
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

    def holder(self) -> str | None:
        """Who holds the lock now, or None if nobody does (the lock is not taken)."""
        try:
            dir_fd = open_dir(self.directory)
        except (FileNotFoundError, OSError):
            return None
        try:
            fd = os.open(_name(self.ident, "lock"), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            return None
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
