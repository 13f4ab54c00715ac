"""From pids to what a sleep acts on: process trees, the agents in them, the CUDA holders.

A user names any process of a target (a launcher, the server, a worker); the
target is that process and all its descendants. Each process's agent socket is
looked for where that process would have put it (its runtime directory, from
its own environment), so root can act on another user's processes too.
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLost
from hibernate.agent.paths import live_sockets, runtime_dir, socket_name
from hibernate.checkpoint.detect import holds_cuda_context
from hibernate.errors import (
    HibernateError,
    NoSuchProcessError,
    NothingToHibernateError,
    PermissionDeniedError,
)
from hibernate.procinfo import ProcessIdentity

NO_AGENT_HINT = (
    "call hibernate.track(...) in the program, start it under `hibernate run`, "
    "or for vLLM start it with --sleep-mode-backend hibernate"
)


@dataclass
class AgentRef:
    identity: ProcessIdentity
    socket: Path
    status: dict[str, Any]

    @property
    def pid(self) -> int:
        return self.identity.pid

    def connect(self, timeout: float) -> AgentClient:
        return AgentClient(self.socket, timeout=timeout)


@dataclass
class Target:
    requested_pid: int
    processes: list[int]
    agents: list[AgentRef] = field(default_factory=list)
    cuda_holders: list[ProcessIdentity] = field(default_factory=list)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def check_access(pid: int) -> ProcessIdentity:
    """The identity of ``pid`` if it exists and we may act on it."""
    ident = procinfo.identity(pid)
    if ident is None:
        raise NoSuchProcessError(f"no process with pid {pid}")
    uid = procinfo.owner_uid(pid)
    me = os.getuid()
    if me != 0 and uid is not None and uid != me:
        raise PermissionDeniedError(
            f"process {pid} belongs to {_user_name(uid)} (uid {uid}); hibernate acts only on "
            "your own processes",
            hint="run hibernate as that user, or as root",
        )
    return ident


def socket_dirs_for(pid: int) -> list[Path]:
    """Where the agent of ``pid`` would listen, most likely first."""
    uid = procinfo.owner_uid(pid)
    dirs = [runtime_dir(uid, procinfo.environment(pid)) if uid is not None else None, runtime_dir()]
    seen: list[Path] = []
    for d in dirs:
        if d is not None and d not in seen:
            seen.append(d)
    return seen


def probe_agent(ident: ProcessIdentity, sock: Path, timeout: float = 5.0) -> AgentRef | None:
    """Ask the agent at ``sock`` who it is; None if nobody answers there."""
    try:
        with AgentClient(sock, timeout=timeout) as client:
            status = client.call("hello")
    except AgentConnectionLost:
        return None
    if status.get("pid") != ident.pid or status.get("start_time") != ident.start_time:
        return None  # a socket named for another process: never trusted
    return AgentRef(ident, sock, status)


def find_agent(pid: int, timeout: float = 5.0) -> AgentRef | None:
    ident = procinfo.identity(pid)
    if ident is None:
        return None
    for directory in socket_dirs_for(pid):
        sock = directory / socket_name(ident)
        try:
            present = sock.exists()
        except PermissionError:
            continue  # another user's private runtime directory: not ours to look into
        if present:
            ref = probe_agent(ident, sock, timeout)
            if ref is not None:
                return ref
    return None


def resolve(pids: Iterable[int], timeout: float = 5.0) -> list[Target]:
    """One Target per requested pid, each with its agents; errors name the pid and a fix."""
    targets: list[Target] = []
    claimed: set[ProcessIdentity] = set()
    for pid in pids:
        check_access(pid)
        tree = procinfo.descendants(pid)
        target = Target(requested_pid=pid, processes=tree)
        for member in tree:
            ident = procinfo.identity(member)
            if ident is None or ident in claimed:
                continue
            agent = find_agent(member, timeout)
            if agent is not None:
                claimed.add(ident)
                target.agents.append(agent)
            if holds_cuda_context(member):
                target.cuda_holders.append(ident)
        if not target.agents and not any(t.requested_pid == pid for t in targets):
            described = f"process {pid}" + (f" or its {len(tree) - 1} descendants" if len(tree) > 1 else "")
            raise NothingToHibernateError(f"no hibernate agent in {described}", hint=NO_AGENT_HINT)
        targets.append(target)
    return targets


def all_agents(timeout: float = 5.0) -> list[AgentRef]:
    """Every live agent in our runtime directory (``hibernate ls``)."""
    found = []
    for ident, sock in live_sockets(runtime_dir()):
        try:
            ref = probe_agent(ident, sock, timeout)
        except HibernateError:
            continue
        if ref is not None:
            found.append(ref)
    return found
