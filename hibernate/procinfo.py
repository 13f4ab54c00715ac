"""Facts about processes read from /proc: identity, owner, descendants.

A pid alone does not name a process: pids are reused. hibernate names a
process by ``(pid, start_time)`` where ``start_time`` is field 22 of
``/proc/<pid>/stat`` (clock ticks since boot), which never changes for the
life of a process and differs for a reused pid.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int

    def to_wire(self) -> dict[str, int]:
        return {"pid": self.pid, "start_time": self.start_time}


def _stat_fields(pid: int) -> list[str]:
    """Fields of /proc/<pid>/stat after the command name (which may hold spaces)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        raw = f.read().decode("ascii", "replace")
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone."""
    try:
        return int(_stat_fields(pid)[19])  # field 22 overall; 3 is the first after ")"
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None


def identity(pid: int) -> ProcessIdentity | None:
    started = start_time(pid)
    return None if started is None else ProcessIdentity(pid, started)


def is_alive(ident: ProcessIdentity) -> bool:
    """True only if the very same process (pid and start time) still exists."""
    if start_time(ident.pid) != ident.start_time:
        return False
    try:
        return _stat_fields(ident.pid)[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def owner_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None


def parent_pid(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[1])
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """``pid`` and every live descendant, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        ppid = parent_pid(int(entry))
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry))
    ordered, frontier = [pid], [pid]
    while frontier:
        nxt = []
        for p in frontier:
            for child in sorted(children.get(p, [])):
                ordered.append(child)
                nxt.append(child)
        frontier = nxt
    return ordered


def resident_bytes(pid: int) -> int | None:
    """Resident set size of ``pid`` in bytes (from /proc/<pid>/statm)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None


def command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return ""


def environment(pid: int) -> dict[str, str]:
    """The environment ``pid`` was started with (readable for own processes, or by root)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return {}
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env
