"""Which process serves a backend's address: the one holding its listening TCP socket.

``/proc/net/tcp`` and ``tcp6`` list listening sockets by inode; ``/proc/PID/fd``
shows which process holds that inode. Only processes of this user can be
looked into, which is what ``hibernate serve`` may act on anyway.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from hibernate import procinfo

LISTEN = "0A"  # the TCP state column of /proc/net/tcp for a listening socket


def listening_inodes(table: str, port: int) -> set[int]:
    """Inodes of the sockets in a ``/proc/net/tcp``-format ``table`` listening on ``port``."""
    inodes = set()
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != LISTEN:
            continue
        _, _, hex_port = fields[1].rpartition(":")
        if int(hex_port, 16) == port:
            inodes.add(int(fields[9]))
    return inodes


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def holders(inodes: set[int], pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that hold one of the socket ``inodes`` (processes we cannot read are skipped)."""
    wanted = {f"socket:[{inode}]" for inode in inodes}
    found = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                    found.append(pid)
                    break
            except OSError:
                continue
    return found


def topmost(pids: list[int]) -> int | None:
    """The one of ``pids`` none of whose ancestors is another of them (the server, not a child that
    inherited its socket)."""
    members = set(pids)
    for pid in sorted(pids):
        parent = procinfo.parent_pid(pid)
        while parent is not None and parent > 1 and parent not in members:
            parent = procinfo.parent_pid(parent)
        if parent not in members:
            return pid
    return None


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` on this machine, if it is one of ours."""
    inodes = listening_inodes(_read("/proc/net/tcp"), port) | listening_inodes(_read("/proc/net/tcp6"), port)
    if not inodes:
        return None
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    return topmost(holders(inodes, pids))
