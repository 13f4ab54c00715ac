"""Selecting targets the way a batch scheduler sees them: --all, --job ID, --cgroup PATH.

A scheduler's script rarely knows pids. It knows "everything of mine on this
node" (--all), "my job" (--job ID, Slurm) or "this cgroup" (--cgroup PATH).
Each selector yields a set of processes; the agents among them are the
processes to hibernate, and each agent is handed to the orchestrator through
its topmost ancestor in the same set and of the same owner, so that the CUDA
holders of that process tree (which need not run an agent) are checkpointed
with it, and a tree is never named twice.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.agent.paths import (
    runtime_dir,
)
from hibernate.errors import (
    NothingToHibernateError,
    PermissionDeniedError,
    UsageError,
)
from hibernate.operation.targets import NO_AGENT_HINT, all_agents, find_agent, refuse_own_tree

CGROUP_ROOT_ENV = "HIBERNATE_CGROUP_ROOT"
DEFAULT_CGROUP_ROOT = Path("/sys/fs/cgroup")
# Deep enough for Slurm's cgroup v1 layout (<controller>/slurm[_<node>]/uid_<uid>/job_<id>) and
# v2 layout (system.slice/[<node>_]slurmstepd.scope/job_<id>), shallow enough to stay fast on a
# node with thousands of cgroups.
JOB_CGROUP_DEPTH = 4
_JOB_ID_RE = re.compile(r"^[0-9]+$")
JOB_ENV_NAMES = ("SLURM_JOB_ID", "SLURM_JOBID")
NODE_ENV = "SLURMD_NODENAME"
# Slurm's step daemon: it sits in the job's own cgroup (v1: job_<id>/cgroup.procs), runs as root,
# and is never one of the job's processes.
STEPD_COMM = "slurmstepd"


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


def slurmd_of(path: Path, root: Path) -> str | None:
    """The node whose slurmd made a job cgroup, where several slurmd share one host; else None.

    Several slurmd on one host keep their jobs apart in directories named after
    their node: ``slurm_<node>`` (v1: ``freezer/slurm_node0/uid_0/job_42``) and
    ``<node>_slurmstepd.scope`` (v2). A single slurmd uses ``slurm`` and
    ``slurmstepd.scope``, which name no node.
    """
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        parts = path.parts
    for part in parts:
        if part.startswith("slurm_"):
            return part[len("slurm_") :]
        if part.endswith("_slurmstepd.scope"):
            return part[: -len("_slurmstepd.scope")]
    return None


def on_this_node(found: Sequence[Path], root: Path, node: str | None) -> list[Path]:
    """Of a job's cgroup directories on this host, those of node ``node`` (all when it is unknown).

    A job spread over two slurmd of one host has a ``job_<id>`` directory under
    each; the processes under the other's belong to the other node, whose own
    step hibernates them.
    """
    if not node:
        return list(found)
    return [path for path in found if slurmd_of(path, root) in (None, node)]


def job_cgroups(
    job_id: str, root: Path, environ: Mapping[str, str] | None = None, own_cgroup: str | None = None
) -> list[Path]:
    """The cgroup directories of Slurm job ``job_id`` on this node (none if Slurm is not there).

    Looks for ``job_<id>`` directories (Slurm's v1 and v2 layouts), keeping
    only this node's where several slurmd share the host (``$SLURMD_NODENAME``,
    set in every task of a job, names this node); and, when this command itself
    runs inside that job (``srun --overlap``), takes the job directory from its
    own cgroup, which also finds jobs whose directory is named by a SLUID
    (Slurm 26.05 and later, without CgroupJobIdPaths).
    """
    env = os.environ if environ is None else environ
    found = on_this_node(find_named_cgroups(root, f"job_{job_id}"), root, env.get(NODE_ENV))
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
    job_id: str, environments: Iterable[tuple[int, Mapping[str, str]]], node: str | None = None
) -> list[int]:
    """The processes whose environment says they belong to Slurm job ``job_id`` (on node ``node``).

    Where several slurmd share a host, the job's tasks of every node run on it;
    a task's environment names its node (``SLURMD_NODENAME``), so a node known
    keeps its own.
    """
    return [
        pid
        for pid, env in environments
        if any(env.get(name) == job_id for name in JOB_ENV_NAMES)
        and (not node or env.get(NODE_ENV) in (None, node))
    ]


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
    return procinfo.topmost(roots, parent_of)


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


def is_stepd(pid: int) -> bool:
    """Whether ``pid`` is Slurm's slurmstepd (by its command name in /proc/PID/comm)."""
    return _read_text(Path(f"/proc/{pid}/comm")).strip() == STEPD_COMM


def _from_members(what: str, members: list[int], timeout: float, source: dict[str, Any]) -> Selection:
    """The agents among ``members`` (the processes a --job or --cgroup found), as tree roots.

    slurmstepd is left out: in a job's cgroup it is Slurm's, not the job's, and
    for a job of root's (same owner) the climb to a tree root would reach it.
    """
    members = [p for p in members if not is_stepd(p)]
    mine = [p for p in members if _may_act(p)]
    if members and not mine:
        owners = sorted({u for u in (procinfo.owner_uid(p) for p in members) if u is not None})
        raise PermissionDeniedError(
            f"{what}: its {len(members)} process(es) belong to "
            + ", ".join(f"{procinfo.describe_user(u)}" for u in owners),
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
        env = os.environ if environ is None else environ
        members = pids_with_job_environment(job_id, _all_environments(), env.get(NODE_ENV))
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
    chosen = procinfo.topmost([*pids, *(p for part in parts for p in part.pids)], procinfo.parent_pid)
    sources = ([{"selector": "pids", "pids": pids}] if pids else []) + [
        s for part in parts for s in part.sources
    ]
    agents = list(dict.fromkeys(a for part in parts for a in part.agents))
    return Selection(chosen, agents, sources)
