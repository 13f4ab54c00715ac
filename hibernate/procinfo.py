"""Facts about processes read from /proc: identity, owner, ancestors, descendants.

A pid alone does not name a process: pids are reused. hibernate names a
process by ``(pid, start_time)`` where ``start_time`` is field 22 of
``/proc/<pid>/stat`` (clock ticks since boot), which never changes for the
life of a process and differs for a reused pid.
"""

from __future__ import annotations

import contextlib
import os
import pwd
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessIdentity:
    pid: int
    start_time: int

    def to_wire(self) -> dict[str, int]:
        return {"pid": self.pid, "start_time": self.start_time}


def _stat_fields(pid: int | str) -> list[str]:
    """Fields of /proc/<pid>/stat (or /proc/self/stat) after the command name (which may hold spaces)."""
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


def zombie_wait_status(ident: ProcessIdentity) -> int | None:
    """How the very process ``ident`` ended (its wait status), while its parent has not reaped it yet.

    /proc/PID/stat's ``exit_code`` (field 52, Linux 3.5+) is the only place anyone but the parent
    can read it, and only while the process is a zombie. None otherwise.
    """
    try:
        fields = _stat_fields(ident.pid)
        if int(fields[19]) != ident.start_time or fields[0] != "Z":
            return None
        return int(fields[49])  # field 52 overall
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None


def owner_uid(pid: int) -> int | None:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return None


def describe_user(uid: int | None) -> str:
    """A user as messages name one: ``alice (uid 1000)``, ``a user without a name (uid 1000)``."""
    if uid is None:
        return "an unknown user"
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"a user without a name (uid {uid})"


def parent_pid(pid: int) -> int | None:
    try:
        return int(_stat_fields(pid)[1])
    except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
        return None


def ancestors(pid: int, parent_of: Callable[[int], int | None] | None = None) -> Iterator[int]:
    """The strict ancestors of ``pid``, nearest first (each once, even if ``parent_of`` loops);
    ``parent_of`` defaults to :func:`parent_pid` (from /proc)."""
    parent_of = parent_of or parent_pid
    seen: set[int] = set()
    current = parent_of(pid)
    while current is not None and current > 0 and current not in seen:
        yield current
        seen.add(current)
        current = parent_of(current)


def topmost(pids: Iterable[int], parent_of: Callable[[int], int | None] | None = None) -> list[int]:
    """``pids`` without those that descend from another of them, in order, each once.

    The orchestrator takes a pid as the root of a process tree: naming a
    process and its ancestor both would name the descendant's agents twice.
    Each pid's ancestry is walked once (``parent_of`` reads /proc), not once per other pid.
    """
    unique = list(dict.fromkeys(pids))
    chosen = set(unique)
    return [p for p in unique if not any(a != p and a in chosen for a in ancestors(p, parent_of))]


def children_by_parent() -> dict[int, list[int]]:
    """Every live process's children, by parent pid: one walk of /proc, a read per process."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        ppid = parent_pid(int(entry))
        if ppid is not None:
            children.setdefault(ppid, []).append(int(entry))
    return children


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    """``pid`` and every live descendant, parents before children.

    ``children``: a :func:`children_by_parent` taken once for several pids, since
    walking /proc reads a file per process of the node.
    """
    if children is None:
        children = children_by_parent()
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


def boot_id() -> str:
    """This kernel's boot id: the same for every process and container until the next boot.

    With the pid namespace and the start time it names a process on a shared
    file system beyond its pid (two containers, two nodes, one pid).
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_namespace(pid: int | str = "self") -> int | None:
    """The inode of ``pid``'s pid namespace, or None if it cannot be read (gone, or not ours)."""
    try:
        return os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None


def own_start_time() -> int:
    """This process's start time, read through /proc/self.

    Unlike ``start_time(os.getpid())`` it is right inside a pid namespace whose
    /proc was not remounted, where /proc/<our pid> is some other process.
    """
    return int(_stat_fields("self")[19])


def namespaced_pid(pid: int) -> int | None:
    """``pid``'s pid in its own (innermost) pid namespace, from the NSpid line of its status."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        return None
    return pid


def find_in_namespace(namespace: int, pid: int, started: int) -> tuple[bool, bool, bool]:
    """Whether a process with this pid and start time lives in pid namespace ``namespace``.

    Returns ``(alive, namespace_seen, saw_all)``: a namespace no visible
    process is in is either gone or out of our sight (a sibling container, or
    processes whose namespace we may not read), and the caller must not take
    that for death unless ``saw_all``.
    """
    seen, saw_all = False, True
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        found = pid_namespace(entry)
        if found is None:
            saw_all = saw_all and not os.path.exists(f"/proc/{entry}")
            continue
        if found != namespace:
            continue
        seen = True
        if namespaced_pid(int(entry)) == pid and start_time(int(entry)) == started:
            return True, True, saw_all
    return False, seen, saw_all


# The fixed inode of the machine's first pid namespace (PROC_PID_INIT_INO in the kernel).
INITIAL_PID_NAMESPACE = 0xEFFFFFFC


def memory_headroom_bytes(proc: Path = Path("/proc"), cgroups: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Host memory this process may still take: the machine's MemAvailable, or less where a memory
    cgroup it runs in caps it (a batch job's ``--mem``: the machine has room, the job may not).

    Each memory cgroup from this process's up to the root counts, v2 (``memory.max`` less
    ``memory.current``) or v1 (``memory.limit_in_bytes`` less ``memory.usage_in_bytes``), since any
    of them can put it over. None where nothing can be read.
    """
    limits: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                limits.append(int(line.split()[1]) * 1024)
                break
    with contextlib.suppress(OSError, ValueError):
        for line in (proc / "self" / "cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                limits.extend(_cgroup_room(cgroups, path, "memory.max", "memory.current"))
            elif "memory" in controllers.split(","):
                limits.extend(
                    _cgroup_room(cgroups / "memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes")
                )
    return min(limits) if limits else None


def _cgroup_room(mount: Path, path: str, ceiling_file: str, usage_file: str) -> Iterator[int]:
    """What each cgroup from ``path`` up to the root of ``mount`` leaves under its ceiling (none for
    one without a ceiling, or whose files cannot be read: v1 writes no ceiling as a huge number)."""
    group = mount / path.strip().lstrip("/")
    while mount == group or mount in group.parents:
        with contextlib.suppress(OSError, ValueError):
            ceiling = (group / ceiling_file).read_text().strip()
            if ceiling != "max" and int(ceiling) < 1 << 60:
                yield max(0, int(ceiling) - int((group / usage_file).read_text()))
        if group == mount:
            return
        group = group.parent
