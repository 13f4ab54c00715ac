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
from hibernate.sched import slurm
from hibernate.sched.cgroups import cgroup_members, cgroup_root, resolve_cgroup_path


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


def _from_members(what: str, members: list[int], timeout: float, source: dict[str, Any]) -> Selection:
    """The agents among ``members`` (the processes a --job or --cgroup found), as tree roots.

    slurmstepd is left out: in a job's cgroup it is Slurm's, not the job's, and
    for a job of root's (same owner) the climb to a tree root would reach it.
    """
    members = [p for p in members if not slurm.is_own_process(p)]
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
    """``--job ID``: the processes of the scheduler's job ID on this node (:mod:`.slurm` finds them)."""
    found = slurm.job_members(job_id, cgroup_root(environ), environ)
    members = [p for p in found.pids if p != os.getpid()]
    if not members:
        raise NothingToHibernateError(
            f"{found.what} has no processes on this node ({found.looked})",
            hint=slurm.missing_job_hint(found.source["job"]),
        )
    return _from_members(found.what, members, timeout, found.source)


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
