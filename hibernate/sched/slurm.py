"""Slurm, as a node sees it: a job's processes, this node's name and place, Slurm's own processes.

Everything hibernate knows of one scheduler lives here, so that another
(PBS, a Kubernetes job) would be a module beside this one, not edits across
the selectors, the node step and the CLI. What the rest of ``sched`` asks of
a scheduler:

    job_members(job_id, root)   the processes of a job on this node, and how they were found
    is_own_process(pid)         a process of the scheduler's, never one of the job's (slurmstepd)
    node_name() / NODE_COUNT_ENV / NODE_INDEX_ENV
                                this node as the job's launcher names and numbers it
    scripts_directory()         the shell scripts that drive hibernate from the scheduler's side
                                (hibernate-job, hibernate-suspend, hibernate-resume, examples)

Nothing here imports torch or acts on a process: it reads /proc, the cgroup
filesystem and the environment.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.errors import UsageError
from hibernate.sched.cgroups import cgroup_members, find_named_cgroups, read_text, unified_cgroup_path

_JOB_ID_RE = re.compile(r"^[0-9]+$")
JOB_ENV_NAMES = ("SLURM_JOB_ID", "SLURM_JOBID")
NODE_ENV = "SLURMD_NODENAME"
# How srun tells each task of a step how many nodes take part and which one it runs on.
NODE_COUNT_ENV = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES")
NODE_INDEX_ENV = ("SLURM_NODEID",)
# Slurm's step daemon: it sits in the job's own cgroup (v1: job_<id>/cgroup.procs), runs as root,
# and is never one of the job's processes.
STEPD_COMM = "slurmstepd"
# The shell scripts, under the install prefix (pyproject.toml, data-files).
SCRIPTS = "share/hibernate/slurm"


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


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This node as Slurm names it ($SLURMD_NODENAME), else the host name."""
    env = os.environ if environ is None else environ
    return env.get(NODE_ENV) or socket.gethostname()


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
        text = own_cgroup if own_cgroup is not None else read_text(Path("/proc/self/cgroup"))
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


@dataclass
class JobMembers:
    """What ``--job ID`` found on this node: the job's processes, how, and where it looked."""

    what: str
    pids: list[int]
    source: dict[str, Any]
    looked: str  # said when nothing was found


def job_members(job_id: str, root: Path, environ: Mapping[str, str] | None = None) -> JobMembers:
    """The processes of Slurm job ``job_id`` on this node: from its cgroups, else from environments."""
    job_id = check_job_id(job_id)
    cgroups = job_cgroups(job_id, root, environ)
    if cgroups:
        members = list(dict.fromkeys(p for c in cgroups for p in cgroup_members(c)))
        source: dict[str, Any] = {"selector": "job", "job": job_id, "via": "cgroup"}
        source["cgroups"] = [str(c) for c in cgroups]
        looked = f"its cgroup(s) {', '.join(map(str, cgroups))} are empty"
    else:
        env = os.environ if environ is None else environ
        members = pids_with_job_environment(job_id, _all_environments(), env.get(NODE_ENV))
        source = {"selector": "job", "job": job_id, "via": "environment"}
        looked = (
            f"no job_{job_id} cgroup under {root}, and no process with SLURM_JOB_ID={job_id} "
            "in its environment"
        )
    return JobMembers(f"Slurm job {job_id}", members, source, looked)


def missing_job_hint(job_id: str) -> str:
    """What to do when a job has no processes on the node the command ran on."""
    return (
        f"run this on a node of the job, e.g. `srun --jobid {job_id} --overlap "
        "--ntasks-per-node=1 hibernate ...`, and check the job id (squeue --me)"
    )


def is_own_process(pid: int) -> bool:
    """Whether ``pid`` is Slurm's slurmstepd (by its command name in /proc/PID/comm)."""
    return read_text(Path(f"/proc/{pid}/comm")).strip() == STEPD_COMM


def scripts_directory() -> Path | None:
    """Where the Slurm scripts lie: those installed with the package (found through its file list,
    whatever the install scheme: a venv, --user, a prefix), else a source checkout's scripts/slurm."""
    from importlib import metadata

    try:
        files = metadata.distribution("hibernate").files or []
        installed = next((f for f in files if str(f).endswith(f"{SCRIPTS}/hibernate-job")), None)
        if installed is not None:
            directory = Path(str(installed.locate())).resolve().parent
            if directory.is_dir():
                return directory
    except metadata.PackageNotFoundError:
        pass
    checkout = Path(__file__).resolve().parents[2] / "scripts" / "slurm"
    return checkout if (checkout / "hibernate-job").is_file() else None
