"""From pids to what a sleep acts on: process trees, the agents in them, the CUDA holders.

A user names any process of a target (a launcher, the server, a worker); the
target is that process and all its descendants. Each process's agent socket is
looked for where that process would have put it (its runtime directory, from
its own environment), so root can act on another user's processes too.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLost
from hibernate.agent.paths import (
    live_sockets,
    parse_socket_name,
    runtime_dir,
    socket_name,
    sweep_stale_sockets,
)
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
    theirs, ours = status.get("pid_namespace"), procinfo.pid_namespace(ident.pid)
    if theirs is not None and ours is not None and theirs != ours:
        return None  # the same pid and start tick in another pid namespace: another process
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
        f"{_user_name(uid)} (uid {uid}): pid{'s' if len(pids) > 1 else ''} {', '.join(map(str, pids))}"
        for uid, pids in sorted(by_owner.items())
    )
    raise UsageError(
        f"process(es) {named} hold hibernate agents of {len(by_owner)} users ({users}); nothing was changed",
        hint=ALL_USERS_HINT,
    )


def resolve(pids: Iterable[int], timeout: float = 5.0, *, all_users: bool = False) -> list[Target]:
    """One Target per requested pid, each with its agents; errors name the pid and a fix.

    Without ``all_users`` the agents must all belong to one user (check_one_user).
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
            if ref is not None and ref.status.get("state") != "running":
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
    return pid == process or pid in _ancestors(process, procinfo.parent_pid)


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


# -- selecting targets the way a batch scheduler sees them ---------------------
#
# A scheduler's script rarely knows pids. It knows "everything of mine on this
# node" (--all), "my job" (--job ID, Slurm) or "this cgroup" (--cgroup PATH).
# Each selector yields a set of processes; the agents among them are the
# processes to hibernate, and each agent is handed to the orchestrator through
# its topmost ancestor in the same set and of the same owner, so that the CUDA
# holders of that process tree (which need not run an agent) are checkpointed
# with it, and a tree is never named twice.

CGROUP_ROOT_ENV = "HIBERNATE_CGROUP_ROOT"
DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
# Deep enough for Slurm's cgroup v1 layout (<controller>/slurm[_<node>]/uid_<uid>/job_<id>) and
# v2 layout (system.slice/[<node>_]slurmstepd.scope/job_<id>), shallow enough to stay fast on a
# node with thousands of cgroups.
JOB_CGROUP_DEPTH = 4
_JOB_ID_RE = re.compile(r"^[0-9]+$")
JOB_ENV_NAMES = ("SLURM_JOB_ID", "SLURM_JOBID")


def cgroup_root(environ: Mapping[str, str] | None = None) -> Path:
    """The cgroup filesystem's root: /sys/fs/cgroup, or $HIBERNATE_CGROUP_ROOT (tests, containers)."""
    env = os.environ if environ is None else environ
    return Path(env[CGROUP_ROOT_ENV]) if env.get(CGROUP_ROOT_ENV) else DEFAULT_CGROUP_ROOT


def check_job_id(job_id: str) -> str:
    """A Slurm job id as the cgroup and the environment spell it (digits), or a UsageError saying how."""
    text = str(job_id).strip()
    if not _JOB_ID_RE.match(text):
        raise UsageError(
            f"--job {job_id!r} is not a Slurm job id (digits only)",
            hint="inside the job use $SLURM_JOB_ID; for an array task 123_4 or a het job 123+0, "
            "`squeue -h -o %A -j 123_4` prints the id to use",
        )
    return text


def parse_pid_list(text: str) -> list[int]:
    """The pids of a ``cgroup.procs`` or ``tasks`` file (one per line; blank lines ignored)."""
    return [int(line) for line in text.split() if line.strip().isdigit()]


def thread_group(tid: int) -> int | None:
    """The process (thread group) a thread id belongs to, from /proc/<tid>/status; None if gone."""
    try:
        with open(f"/proc/{tid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError, ValueError, IndexError):
        return None
    return None


def cgroup_members(directory: Path, tgid_of: Callable[[int], int | None] = thread_group) -> list[int]:
    """Every process in the cgroup at ``directory`` and in the cgroups below it, in first-seen order.

    Each cgroup lists its processes in ``cgroup.procs`` (v2, and v1 too); a v1
    hierarchy that only has ``tasks`` lists threads, which are mapped to their
    processes. Children of a process start in its cgroup, so a job's whole
    process tree is found, however deep its steps nest their cgroups.
    """
    found: dict[int, None] = {}
    for current, _dirs, files in os.walk(directory):
        here = Path(current)
        if "cgroup.procs" in files:
            pids = parse_pid_list(_read_text(here / "cgroup.procs"))
        elif "tasks" in files:
            pids = [p for p in (tgid_of(t) for t in parse_pid_list(_read_text(here / "tasks"))) if p]
        else:
            continue
        for pid in pids:
            found.setdefault(pid, None)
    return list(found)


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (FileNotFoundError, PermissionError, OSError):
        return ""


def find_named_cgroups(root: Path, name: str, max_depth: int = JOB_CGROUP_DEPTH) -> list[Path]:
    """Directories called ``name`` at most ``max_depth`` levels below ``root`` (not below a match)."""
    matches: list[Path] = []
    frontier = [root]
    for _ in range(max_depth):
        below: list[Path] = []
        for directory in frontier:
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except (FileNotFoundError, NotADirectoryError, PermissionError):
                continue
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    continue
                (matches if entry.name == name else below).append(Path(entry.path))
        frontier = below
    return matches


def job_dir_in_cgroup_path(path: str) -> str | None:
    """The job's directory in a Slurm cgroup v2 path: everything before the first ``step_*`` part.

    ``/system.slice/slurmstepd.scope/job_42/step_0/user/task_0`` gives
    ``/system.slice/slurmstepd.scope/job_42``, and so does a job directory named
    by Slurm's newer SLUIDs instead of ``job_<id>``. None outside a job step.
    """
    parts = [p for p in path.strip().split("/") if p]
    for index, part in enumerate(parts):
        if part.startswith("step_") and index > 0:
            return "/" + "/".join(parts[:index])
    return None


def unified_cgroup_path(proc_cgroup_text: str) -> str | None:
    """The cgroup v2 path of a process, from the ``0::PATH`` line of /proc/<pid>/cgroup."""
    for line in proc_cgroup_text.splitlines():
        if line.startswith("0::"):
            return line[3:]
    return None


def job_cgroups(
    job_id: str, root: Path, environ: Mapping[str, str] | None = None, own_cgroup: str | None = None
) -> list[Path]:
    """The cgroup directories of Slurm job ``job_id`` on this node (none if Slurm is not there).

    Looks for ``job_<id>`` directories (Slurm's v1 and v2 layouts); and, when
    this command itself runs inside that job (``srun --overlap``), takes the
    job directory from its own cgroup, which also finds jobs whose directory is
    named by a SLUID (Slurm 26.05 and later, without CgroupJobIdPaths).
    """
    env = os.environ if environ is None else environ
    found = find_named_cgroups(root, f"job_{job_id}")
    if any(env.get(name) == job_id for name in JOB_ENV_NAMES):
        text = own_cgroup if own_cgroup is not None else _read_text(Path("/proc/self/cgroup"))
        own = unified_cgroup_path(text)
        job_dir = job_dir_in_cgroup_path(own) if own else None
        if job_dir is not None:
            candidate = root / job_dir.lstrip("/")
            if candidate.is_dir() and not any(candidate == f or candidate.is_relative_to(f) for f in found):
                found.append(candidate)
    return found


def pids_with_job_environment(
    job_id: str, environments: Iterable[tuple[int, Mapping[str, str]]]
) -> list[int]:
    """The processes whose environment says they belong to Slurm job ``job_id``."""
    return [pid for pid, env in environments if any(env.get(name) == job_id for name in JOB_ENV_NAMES)]


def _all_environments() -> Iterable[tuple[int, Mapping[str, str]]]:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            yield int(entry), procinfo.environment(int(entry))


def resolve_cgroup_path(path: str | Path, root: Path) -> Path:
    """``--cgroup``: a cgroup directory, or a path in the cgroup filesystem as /proc/PID/cgroup shows it."""
    given = Path(path)
    candidates = [given] if given.is_absolute() else []
    candidates.append(root / str(path).lstrip("/"))
    for candidate in candidates:
        if candidate.is_dir() and ((candidate / "cgroup.procs").exists() or (candidate / "tasks").exists()):
            return candidate
    raise UsageError(
        f"--cgroup {path}: no cgroup there (looked at {', '.join(str(c) for c in candidates)})",
        hint="pass a directory under the cgroup filesystem, or the path /proc/PID/cgroup shows "
        f"(relative to {root}; ${CGROUP_ROOT_ENV} moves the root)",
    )


def _ancestors(pid: int, parent_of: Callable[[int], int | None]) -> Iterator[int]:
    """The strict ancestors of ``pid``, nearest first (each once, even if ``parent_of`` loops)."""
    seen: set[int] = set()
    current = parent_of(pid)
    while current is not None and current > 0 and current not in seen:
        yield current
        seen.add(current)
        current = parent_of(current)


def topmost(pids: Iterable[int], parent_of: Callable[[int], int | None]) -> list[int]:
    """``pids`` without those that descend from another of them, in order, each once.

    The orchestrator takes a pid as the root of a process tree: naming a
    process and its ancestor both would name the descendant's agents twice.
    Each pid's ancestry is walked once (``parent_of`` reads /proc), not once per other pid.
    """
    unique = list(dict.fromkeys(pids))
    chosen = set(unique)
    return [p for p in unique if not any(a != p and a in chosen for a in _ancestors(p, parent_of))]


def tree_roots(
    agents: Iterable[int],
    members: set[int],
    parent_of: Callable[[int], int | None],
    owner_of: Callable[[int], int | None],
) -> list[int]:
    """For each agent, its topmost ancestor that is in ``members`` and has the agent's owner.

    Climbing stops at a process outside the selection (another job, a login
    shell) or of another owner (slurmstepd, runs as root), so the tree handed
    to the orchestrator holds the agent's own job processes and nothing else.
    """
    roots: list[int] = []
    for agent in agents:
        owner = owner_of(agent)
        root, seen = agent, {agent}
        parent = parent_of(root)
        while parent is not None and parent in members and parent not in seen and owner_of(parent) == owner:
            root, parent = parent, parent_of(parent)
            seen.add(root)
        roots.append(root)
    return topmost(roots, parent_of)


@dataclass
class Selection:
    """What a set of selectors chose: the pids to hand to the orchestrator, and how they were found."""

    pids: list[int]
    agents: list[int] = field(default_factory=list)
    sources: list[dict[str, Any]] = field(default_factory=list)

    def to_wire(self) -> dict[str, Any]:
        return {"pids": self.pids, "agents": self.agents, "sources": self.sources}


def _may_act(pid: int) -> bool:
    if os.getuid() == 0:
        return True
    return procinfo.owner_uid(pid) == os.getuid()


def _from_members(what: str, members: list[int], timeout: float, source: dict[str, Any]) -> Selection:
    """The agents among ``members`` (the processes a --job or --cgroup found), as tree roots."""
    mine = [p for p in members if _may_act(p)]
    if members and not mine:
        owners = sorted({u for u in (procinfo.owner_uid(p) for p in members) if u is not None})
        raise PermissionDeniedError(
            f"{what}: its {len(members)} process(es) belong to "
            + ", ".join(f"{_user_name(u)} (uid {u})" for u in owners),
            hint="run hibernate as that user, or as root",
        )
    agents = [pid for pid in mine if find_agent(pid, timeout) is not None]
    if not agents:
        raise NothingToHibernateError(
            f"{what}: none of its {len(mine)} process(es) on this node runs a hibernate agent",
            hint=NO_AGENT_HINT,
        )
    roots = tree_roots(agents, set(mine), procinfo.parent_pid, procinfo.owner_uid)
    return Selection(roots, agents, [{**source, "processes": len(members), "agents": agents}])


def select_job(job_id: str, timeout: float = 5.0, environ: Mapping[str, str] | None = None) -> Selection:
    """``--job ID``: the processes of Slurm job ID on this node, from its cgroups, else from environments."""
    job_id = check_job_id(job_id)
    root = cgroup_root(environ)
    cgroups = job_cgroups(job_id, root, environ)
    what = f"Slurm job {job_id}"
    if cgroups:
        members = list(dict.fromkeys(p for c in cgroups for p in cgroup_members(c)))
        source: dict[str, Any] = {"selector": "job", "job": job_id, "via": "cgroup"}
        source["cgroups"] = [str(c) for c in cgroups]
    else:
        members = pids_with_job_environment(job_id, _all_environments())
        source = {"selector": "job", "job": job_id, "via": "environment"}
    members = [p for p in members if p != os.getpid()]
    if not members:
        looked = (
            f"its cgroup(s) {', '.join(map(str, cgroups))} are empty"
            if cgroups
            else f"no job_{job_id} cgroup under {root}, and no process with SLURM_JOB_ID={job_id} "
            "in its environment"
        )
        raise NothingToHibernateError(
            f"{what} has no processes on this node ({looked})",
            hint=f"run this on a node of the job, e.g. `srun --jobid {job_id} --overlap "
            "--ntasks-per-node=1 hibernate ...`, and check the job id (squeue --me)",
        )
    return _from_members(what, members, timeout, source)


def select_cgroup(
    path: str | Path, timeout: float = 5.0, environ: Mapping[str, str] | None = None
) -> Selection:
    """``--cgroup PATH``: the processes of the cgroup at PATH and of the cgroups below it."""
    directory = resolve_cgroup_path(path, cgroup_root(environ))
    members = [p for p in cgroup_members(directory) if p != os.getpid()]
    what = f"cgroup {directory}"
    if not members:
        raise NothingToHibernateError(
            f"{what} has no processes", hint="check the path: `cat /proc/PID/cgroup`"
        )
    return _from_members(what, members, timeout, {"selector": "cgroup", "cgroup": str(directory)})


def select_all(timeout: float = 5.0) -> Selection:
    """``--all``: every agent of this user on this node (those listening in our runtime directory)."""
    agents = [ref.pid for ref in all_agents(timeout)]
    if not agents:
        raise NothingToHibernateError(
            f"no hibernate agents of yours on this node (none listening in {runtime_dir()})",
            hint=NO_AGENT_HINT + "; a program started with another HIBERNATE_RUNTIME_DIR listens elsewhere",
        )
    roots = tree_roots(agents, set(agents), procinfo.parent_pid, procinfo.owner_uid)
    return Selection(roots, agents, [{"selector": "all", "agents": agents}])


def select(
    pids: Sequence[int] | None,
    *,
    every: bool = False,
    job: str | None = None,
    cgroup: str | Path | None = None,
    timeout: float = 5.0,
    sleeping: bool = False,
) -> Selection:
    """The targets named by pids and selectors together (each selector must find something).

    Explicit pids are kept as given (errors about them come from ``resolve``);
    the union is reduced to its topmost processes so no tree is named twice.
    For a sleep (``sleeping``) a pid named whose tree holds this command is
    refused (refuse_own_tree); a selector's trees may hold it (a job's batch
    script running ``hibernate sleep --job``): they hold only the job's own
    processes, and this command has no agent to put to sleep.
    """
    pids = list(pids or [])
    if sleeping:
        for pid in pids:
            refuse_own_tree(pid)
    parts: list[Selection] = []
    if every:
        parts.append(select_all(timeout))
    if job is not None:
        parts.append(select_job(job, timeout))
    if cgroup is not None:
        parts.append(select_cgroup(cgroup, timeout))
    if not parts:
        if not pids:
            raise UsageError(
                "no targets named",
                hint="give PIDs, or select them: --all, --job ID (Slurm), --cgroup PATH",
            )
        return Selection(pids, [], [{"selector": "pids", "pids": pids}])
    chosen = topmost([*pids, *(p for part in parts for p in part.pids)], procinfo.parent_pid)
    sources = ([{"selector": "pids", "pids": pids}] if pids else []) + [
        s for part in parts for s in part.sources
    ]
    agents = list(dict.fromkeys(a for part in parts for a in part.agents))
    return Selection(chosen, agents, sources)


def agent_state(pid: int, start_time: int, pid_namespace: int) -> str | None:
    """What the agent of this very process says its state is; None if it cannot be asked.

    For ``gc --awake``: only an agent that answers for the same pid, start
    time and pid namespace counts, so a reused pid is never taken for it.
    """
    if pid_namespace != procinfo.pid_namespace():
        return None
    ref = find_agent(pid)
    if ref is None or ref.identity.start_time != start_time:
        return None
    state = ref.status.get("state")
    return state if isinstance(state, str) else None
