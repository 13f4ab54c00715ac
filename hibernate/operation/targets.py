"""From pids to what a sleep acts on: process trees, the agents in them, the CUDA holders.

A user names any process of a target (a launcher, the server, a worker); the
target is that process and all its descendants. Each process's agent socket is
looked for where that process would have put it (its runtime directory, from
its own environment), so root can act on another user's processes too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLostError
from hibernate.agent.paths import (
    live_sockets,
    parse_socket_name,
    runtime_dir,
    socket_name,
    sweep_stale_sockets,
)
from hibernate.agent.wire import AgentState, AgentStatus, HelloArgs
from hibernate.checkpoint.detect import holds_cuda_context
from hibernate.errors import (
    HibernateError,
    NoSuchProcessError,
    NothingToHibernateError,
    PermissionDeniedError,
    UsageError,
)
from hibernate.fsutil import ensure_private_dir, open_dir, read_small_file, write_file_atomic
from hibernate.procinfo import ProcessIdentity

NO_AGENT_HINT = (
    "call hibernate.track(...) in the program, start it under `hibernate run`, "
    "or for vLLM start it with --sleep-mode-backend hibernate"
)


@dataclass
class AgentRef:
    """An agent found for a process, and what it answered when it was found."""

    identity: ProcessIdentity
    socket: Path
    answer: Mapping[str, Any]  # its status as it sent it: what `hibernate status` prints, verbatim

    @cached_property
    def status(self) -> AgentStatus:
        """Its status as found, typed (an agent of any hibernate version: see agent.wire)."""
        return AgentStatus.from_wire(self.answer)

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


def check_access(pid: int) -> ProcessIdentity:
    """The identity of ``pid`` if it exists and we may act on it."""
    ident = procinfo.identity(pid)
    if ident is None:
        raise NoSuchProcessError(f"no process with pid {pid}")
    uid = procinfo.owner_uid(pid)
    me = os.getuid()
    if me != 0 and uid is not None and uid != me:
        raise PermissionDeniedError(
            f"process {pid} belongs to {procinfo.describe_user(uid)}; hibernate acts only on "
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


def probe_agent(
    ident: ProcessIdentity, sock: Path, timeout: float = 5.0, *, contents: bool = True
) -> AgentRef | None:
    """Ask the agent at ``sock`` who it is; None if nobody answers there. Without ``contents`` its
    answer may leave its pools uncounted (see wire.HelloArgs)."""
    try:
        with AgentClient(sock, timeout=timeout) as client:
            answer = client.call("hello") if contents else client.call("hello", HelloArgs(False).to_wire())
    except AgentConnectionLostError:
        return None
    ref = AgentRef(ident, sock, answer)
    if not ref.status.names_process(ident.pid, ident.start_time, procinfo.pid_namespace(ident.pid)):
        return None
    return ref


def find_agent(pid: int, timeout: float = 5.0, *, contents: bool = True) -> AgentRef | None:
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
            ref = probe_agent(ident, sock, timeout, contents=contents)
            if ref is not None:
                return ref
    return None


ALL_USERS_HINT = (
    "name a process of one user, or pass --all-users to act on the agents of every user found "
    "(or select them with --job ID or --cgroup PATH)"
)


def check_one_user(targets: Sequence[Target], all_users: bool) -> None:
    """Refuse a command whose targets hold agents of several users, unless that was asked for.

    Root may act on anyone's process, and a process tree it names is walked to
    the end: ``hibernate sleep 1``, or the pid of a shell or of a scheduler's
    daemon, would reach every user's agents on the machine. Root acting on one
    user's process (``sudo hibernate sleep PID``, a launcher of root's running a
    user's server) is the common case and needs nothing more; several users'
    agents at once take ``--all-users`` (or a ``--job``/``--cgroup`` selection,
    which names exactly the processes meant). Checked before anything is touched.
    """
    if all_users:
        return
    by_owner: dict[int, list[int]] = {}
    for target in targets:
        for agent in target.agents:
            owner = procinfo.owner_uid(agent.pid)
            if owner is not None:
                by_owner.setdefault(owner, []).append(agent.pid)
    if len(by_owner) <= 1:
        return
    named = " ".join(str(t.requested_pid) for t in targets)
    users = "; ".join(
        f"{procinfo.describe_user(uid)}: pid{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))}"
        for uid, pids in sorted(by_owner.items())
    )
    raise UsageError(
        f"process(es) {named} hold hibernate agents of {len(by_owner)} users ({users}); nothing was changed",
        hint=ALL_USERS_HINT,
    )


def resolve(
    pids: Iterable[int], timeout: float = 5.0, *, all_users: bool = False, contents: bool = True
) -> list[Target]:
    """One Target per requested pid, each with its agents; errors name the pid and a fix.

    Without ``all_users`` the agents must all belong to one user (check_one_user). Without
    ``contents`` the agents' statuses may leave their pools uncounted (see probe_agent).
    """
    targets: list[Target] = []
    claimed: set[ProcessIdentity] = set()
    children: dict[int, list[int]] | None = None  # walked once, at the first accessible pid
    for pid in pids:
        check_access(pid)
        if children is None:
            children = procinfo.children_by_parent()
        tree = procinfo.descendants(pid, children)
        target = Target(requested_pid=pid, processes=tree)
        for member in tree:
            ident = procinfo.identity(member)
            if ident is None or ident in claimed:
                continue
            agent = find_agent(member, timeout, contents=contents)
            if agent is not None:
                claimed.add(ident)
                target.agents.append(agent)
            if holds_cuda_context(member):
                target.cuda_holders.append(ident)
        if not target.agents and not any(t.requested_pid == pid for t in targets):
            described = f"process {pid}" + (f" or its {len(tree) - 1} descendants" if len(tree) > 1 else "")
            raise NothingToHibernateError(f"no hibernate agent in {described}", hint=NO_AGENT_HINT)
        targets.append(target)
    check_one_user(targets, all_users)
    return targets


# -- agents a sleep of ours reached in other runtime directories ----------------------------
#
# A process tree may hold agents that listen in several runtime directories (a program started
# with its own HIBERNATE_RUNTIME_DIR, another user's server under root's launcher). A sleep acts
# on all of them, but `status` and `--all` look in the caller's own runtime directory: before it
# acts, a sleep leaves there, in ELSEWHERE, a note per agent listening elsewhere (named as the
# agent's socket, holding its path), so that everything it put to sleep stays in sight until it
# is awake again.

ELSEWHERE = "elsewhere"
_NOTE_LIMIT = 4096


def remember_elsewhere(refs: Iterable[AgentRef]) -> None:
    """Note, in our runtime directory, every agent of ``refs`` that listens in another one."""
    own = runtime_dir()
    away = [ref for ref in refs if not _same_directory(ref.socket.parent, own)]
    if not away:
        return
    notes = own / ELSEWHERE
    ensure_private_dir(notes)
    dir_fd = open_dir(notes)
    try:
        for ref in away:
            write_file_atomic(dir_fd, socket_name(ref.identity), os.fsencode(ref.socket), durable=False)
    finally:
        os.close(dir_fd)


def _same_directory(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def agents_elsewhere(timeout: float = 5.0) -> list[AgentRef]:
    """The agents a sleep of ours noted in other runtime directories that are not awake again.

    A note goes once its agent is gone or running (woken, by us or by anyone):
    from then on the agent is in sight only where it listens, as before its sleep.
    """
    notes = runtime_dir() / ELSEWHERE
    try:
        dir_fd = open_dir(notes)
    except OSError:
        return []
    found: list[AgentRef] = []
    try:
        for name in sorted(os.listdir(dir_fd)):
            ident = parse_socket_name(name)
            if ident is None:
                continue
            ref = _noted_agent(dir_fd, name, ident, timeout)
            if ref is not None and ref.status.state is not AgentState.RUNNING:
                found.append(ref)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    return found


def _noted_agent(dir_fd: int, name: str, ident: ProcessIdentity, timeout: float) -> AgentRef | None:
    """The agent a note names, if it still answers there as the process the note is named for."""
    if not procinfo.is_alive(ident):
        return None
    try:
        sock = Path(os.fsdecode(read_small_file(dir_fd, name, _NOTE_LIMIT)))
    except OSError:
        return None
    if sock.name != socket_name(ident) or not sock.is_absolute():
        return None  # a note hibernate did not write
    try:
        return probe_agent(ident, sock, timeout)
    except HibernateError:
        return None


def all_agents(timeout: float = 5.0) -> list[AgentRef]:
    """Every live agent in our runtime directory (``hibernate ls``), and those a sleep of ours put to
    sleep in other runtime directories (see remember_elsewhere); stale sockets are swept first."""
    sweep_stale_sockets(runtime_dir())
    found = []
    for ident, sock in live_sockets(runtime_dir()):
        try:
            ref = probe_agent(ident, sock, timeout)
        except HibernateError:
            continue
        if ref is not None:
            found.append(ref)
    here = {ref.identity for ref in found}
    found.extend(ref for ref in agents_elsewhere(timeout) if ref.identity not in here)
    return found


def tree_holds(pid: int, process: int) -> bool:
    """Whether ``process`` is in the process tree under ``pid`` (``pid`` itself or an ancestor of it)."""
    return pid == process or pid in procinfo.ancestors(process)


def refuse_own_tree(pid: int, caller: int | None = None) -> None:
    """A sleep of a pid whose process tree holds this very command is refused.

    A sleep acts on every agent of the tree under the pid it is given:
    ``hibernate sleep 1``, or the pid of the shell or launcher that started
    this command, would put to sleep every hibernate target under it, in
    every runtime directory, root's container or not.
    """
    caller = os.getpid() if caller is None else caller
    if not tree_holds(pid, caller):
        return
    what = "this command itself" if pid == caller else f"an ancestor of this command (pid {caller})"
    raise UsageError(
        f"process {pid} is {what}: a sleep of its tree would reach every hibernate agent under it; "
        "nothing was changed",
        hint="name the target's own process (its server or launcher), or select targets with --all, "
        "--job ID or --cgroup PATH",
    )


def agent_state(pid: int, start_time: int, pid_namespace: int) -> AgentState | None:
    """What the agent of this very process says its state is; None if it cannot be asked.

    For ``gc --awake``: only an agent that answers for the same pid, start
    time and pid namespace counts, so a reused pid is never taken for it.
    """
    if pid_namespace != procinfo.pid_namespace():
        return None
    ref = find_agent(pid)
    if ref is None or ref.identity.start_time != start_time:
        return None
    return ref.status.state
