"""Whose a spill root is: a process named beyond its pid.

A pid names a process only within one pid namespace of one boot of one
machine. Two containers (or two nodes of a job on a shared file system) can
each have a process 4242 writing into the same ``--to`` directory; before
format 2 they shared ``DIR/proc-4242`` and the second sleep retired the
first's snapshot. An :class:`Owner` adds the boot id, the pid namespace and
the start time; a spill root's marker and every manifest in it carry them
whole, so a sleep never reuses, retires or punches a snapshot that belongs to
another process. The root's name carries a random part instead (see
spill_root_name): a name anyone can compute, anyone can take first.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hibernate import procinfo

Liveness = Literal["alive", "dead", "unknown"]


@dataclass(frozen=True)
class Owner:
    """The process a spill root belongs to: equal owners are the same process, ever."""

    boot_id: str
    pid_namespace: int
    pid: int
    start_time: int
    hostname: str = ""
    uid: int = -1

    @classmethod
    def current(cls) -> Owner:
        """This process, as the agent inside it names itself."""
        return cls(
            boot_id=procinfo.boot_id(),
            pid_namespace=procinfo.pid_namespace() or 0,
            pid=os.getpid(),
            start_time=procinfo.own_start_time(),
            hostname=socket.gethostname(),
            uid=os.getuid(),
        )

    @property
    def key(self) -> tuple[str, int, int, int]:
        """What makes two owners the same process (host name and uid only describe it)."""
        return (self.boot_id, self.pid_namespace, self.pid, self.start_time)

    def same_process(self, other: Owner) -> bool:
        return self.key == other.key

    def describe(self) -> str:
        return (
            f"pid {self.pid} (started at tick {self.start_time}, pid namespace {self.pid_namespace}, "
            f"host {self.hostname or '?'}, boot {self.boot_id[:8] or '?'})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "boot_id": self.boot_id,
            "pid_namespace": self.pid_namespace,
            "pid": self.pid,
            "start_time": self.start_time,
            "hostname": self.hostname,
            "uid": self.uid,
        }


def parse_owner(raw: object) -> Owner | None:
    """An owner from its JSON form, or None if anything is missing or of the wrong type."""
    if not isinstance(raw, Mapping):
        return None
    numbers = {}
    for name in ("pid_namespace", "pid", "start_time", "uid"):
        value = raw.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        numbers[name] = value
    boot, host = raw.get("boot_id"), raw.get("hostname", "")
    if not isinstance(boot, str) or not isinstance(host, str) or len(boot) > 64 or len(host) > 255:
        return None
    return Owner(boot_id=boot, hostname=host, **numbers)


def spill_root_name(label: str, token: str) -> str:
    """The directory of a process's snapshots in a ``--to`` directory: ``<label>-<token>``.

    ``label`` says what the process is (``proc-4242``, ``vllm-rank0-pid4242``);
    ``token`` is random, drawn once by the process's agent. Not derived from
    the process's identity: boot id, pid namespace, pid and start time can all
    be read by any user, so in a shared (1777) ``--to`` another user could
    create that directory first and every sleep of the process would be
    refused. The marker inside, not the name, says whose a root is.
    """
    return f"{label}-{token}"


def liveness(owner: Owner) -> tuple[Liveness, str]:
    """Whether ``owner`` still runs, as far as this machine can tell, and why we think so.

    Only a definite "dead" lets gc delete a snapshot: a process on another
    host, or in a pid namespace this process cannot see, is "unknown".
    """
    here = procinfo.boot_id()
    if owner.boot_id != here:
        if owner.hostname and owner.hostname == socket.gethostname():
            return "dead", "its machine has rebooted since it slept"
        return "unknown", f"it ran on another machine ({owner.hostname or 'unknown host'})"
    ident = procinfo.ProcessIdentity(owner.pid, owner.start_time)
    if owner.pid_namespace == (procinfo.pid_namespace() or 0):
        if procinfo.is_alive(ident):
            return "alive", "it is running"
        return "dead", "it has exited"
    alive, seen, saw_all = procinfo.find_in_namespace(owner.pid_namespace, owner.pid, owner.start_time)
    if alive:
        return "alive", "it is running (in another pid namespace)"
    if seen:
        return "dead", "it has exited (its pid namespace lives on)"
    if saw_all and procinfo.pid_namespace() == procinfo.INITIAL_PID_NAMESPACE:
        # From the machine's first namespace every other one is in sight: one with no
        # process left has ended, and its processes with it.
        return "dead", "it has exited (its pid namespace has ended)"
    return "unknown", "its pid namespace is out of this process's sight"
