"""STAND-IN Slurm for tests: a pretend cluster of several nodes on this one machine.

Real Slurm runs a slurmd on every node; the tasks of a job step are started on
their node by a slurmstepd, inside the job's cgroup there, with the SLURM_*
environment that srun(1) and sbatch(1) document. Here a *node* is a directory
with its own ``HIBERNATE_RUNTIME_DIR`` (so ``hibernate --all`` on a node sees
that node's agents only) and its own cgroup root (``HIBERNATE_CGROUP_ROOT``)
holding Slurm's cgroup v2 layout::

    system.slice/slurmstepd.scope/job_<id>/step_<step>/user/task_0/cgroup.procs

The stand-in commands (``slurm_srun.py``, ``slurm_sbatch.py``,
``slurm_scontrol.py``, installed by :func:`install_commands` as ``srun``,
``sbatch``, ``scontrol``) keep their state in one directory, named by
``HIBERNATE_STANDIN_SLURM``: the nodes, the jobs, the site's configuration.
Tasks are started by ``slurm_stepd.py``, detached from the launching command
(a task on another node is nobody's child here either), which keeps the
step's ``cgroup.procs`` up to date with the task's process tree, as the kernel
does for a real cgroup. What follows Slurm's documented behaviour, and where
the stand-ins knowingly differ, is listed in tests/standins/slurm_README.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hibernate import procinfo

HERE = Path(__file__).resolve().parent
WORLD_ENV = "HIBERNATE_STANDIN_SLURM"
COMMANDS = {"srun": "slurm_srun.py", "sbatch": "slurm_sbatch.py", "scontrol": "slurm_scontrol.py"}
# slurm.conf defaults that matter here (slurm.conf(5)): WaitTime=0 (unlimited), KillOnBadExit=0, and
# PreemptParameters=suspend_grace_time=2 (SIGTSTP, wait, then SIGSTOP on suspend).
DEFAULT_CONFIG = {"WaitTime": 0, "KillOnBadExit": 0, "suspend_grace_time": 2.0}
CLUSTER = "standin"


def install_commands(bin_dir: Path, python: str = sys.executable) -> Path:
    """Write ``srun``, ``sbatch`` and ``scontrol`` into ``bin_dir``: tiny wrappers around the stand-ins."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, script in COMMANDS.items():
        path = bin_dir / name
        path.write_text(
            f'#!/bin/sh\n# STAND-IN for Slurm\'s {name}\nexec "{python}" "{HERE / script}" "$@"\n'
        )
        path.chmod(0o755)
    return bin_dir


def compress_hostlist(names: Sequence[str]) -> str:
    """``node0,node1,node2`` as Slurm prints it, ``node[0-2]`` (only the forms the stand-in makes)."""
    groups: dict[str, list[int]] = {}
    plain: list[str] = []
    for name in names:
        match = re.match(r"^(.*?)(\d+)$", name)
        if match:
            groups.setdefault(match.group(1), []).append(int(match.group(2)))
        else:
            plain.append(name)
    parts = list(plain)
    for prefix, numbers in groups.items():
        numbers.sort()
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]}")
            continue
        ranges: list[str] = []
        start = prev = numbers[0]
        for n in [*numbers[1:], None]:
            if n is not None and n == prev + 1:
                prev = n
                continue
            ranges.append(str(start) if start == prev else f"{start}-{prev}")
            if n is not None:
                start = prev = n
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)


def is_stepd(pid: int) -> bool:
    """True for a stand-in slurmstepd (another step's: on a real cluster, not below this one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"slurm_stepd.py" in f.read()
    except OSError:
        return False


def descendants(pid: int, prune: Callable[[int], bool] = lambda p: False) -> list[int]:
    """``pid`` and its live descendants, from /proc, not descending into those ``prune`` picks.

    (No hibernate import: the stand-ins stand alone.)
    """
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                raw = f.read().decode("ascii", "replace")
            ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    ordered, frontier = [pid], [pid]
    while frontier:
        frontier = [c for p in frontier for c in sorted(children.get(p, [])) if not prune(c)]
        ordered.extend(frontier)
    return ordered


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
        return raw[raw.rindex(")") + 2 :].split()[0] != "Z"
    except (OSError, ValueError, IndexError):
        return False


def write_json(path: Path, document: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=1, sort_keys=True))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


# Beside each stand-in cgroup.procs, its members with their start times ("PID START_TIME" per line).
# The kernel lists only live members; a file written earlier may name a pid that exited and was given
# to another process since (pids wrap at 32768 on small machines): that one is no member, never killed.
MEMBERS = ".members"


def write_members(directory: Path, pids: Sequence[int]) -> None:
    """Set a cgroup's members (those still alive), its cgroup.procs as hibernate reads it."""
    members = [m for m in (procinfo.identity(pid) for pid in dict.fromkeys(pids)) if m is not None]
    for name, text in (
        (MEMBERS, "".join(f"{m.pid} {m.start_time}\n" for m in members)),
        ("cgroup.procs", "".join(f"{m.pid}\n" for m in members)),
    ):
        tmp = directory / f".{name}.tmp"
        tmp.write_text(text)
        os.replace(tmp, directory / name)


def cgroup_pids(directory: Path) -> list[int]:
    """The live members of the cgroups at and under ``directory`` (a reused pid is not one)."""
    found: list[int] = []
    for current, _dirs, files in os.walk(directory):
        if MEMBERS in files:
            with contextlib.suppress(OSError, ValueError):
                for line in (Path(current) / MEMBERS).read_text().splitlines():
                    pid, started = (int(x) for x in line.split())
                    if procinfo.start_time(pid) == started:
                        found.append(pid)
    return list(dict.fromkeys(found))


class World:
    """One pretend cluster: nodes, jobs and site configuration in a directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def from_environment(cls) -> World:
        value = os.environ.get(WORLD_ENV)
        if not value:
            sys.stderr.write(f"stand-in Slurm: {WORLD_ENV} is not set (no pretend cluster to talk to)\n")
            raise SystemExit(1)
        return cls(Path(value))

    # -- layout -----------------------------------------------------------------

    def create(self, nodes: int, config: Mapping[str, Any] | None = None) -> World:
        for sub in ("nodes", "jobs", "steps"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        write_json(self.root / "config.json", {**DEFAULT_CONFIG, **(config or {})})
        write_json(self.root / "counter.json", {"next_job": 4200})
        for index in range(nodes):
            self.add_node(f"node{index}")
        return self

    @property
    def env(self) -> dict[str, str]:
        return {WORLD_ENV: str(self.root)}

    @property
    def config(self) -> dict[str, Any]:
        document: dict[str, Any] = read_json(self.root / "config.json")
        return document

    def configure(self, **settings: Any) -> None:
        write_json(self.root / "config.json", {**self.config, **settings})

    def add_node(self, name: str) -> None:
        node = self.root / "nodes" / name
        (node / "run").mkdir(parents=True, exist_ok=True)
        (node / "cgroup").mkdir(exist_ok=True)
        (node / "run").chmod(0o700)

    def node_names(self) -> list[str]:
        names = os.listdir(self.root / "nodes")
        return sorted(names, key=lambda n: (len(n), n))

    def node_env(self, name: str) -> dict[str, str]:
        """What differs from node to node for a process: where its agents listen, its cgroup root."""
        node = self.root / "nodes" / name
        return {"HIBERNATE_RUNTIME_DIR": str(node / "run"), "HIBERNATE_CGROUP_ROOT": str(node / "cgroup")}

    def cgroup_root(self, node: str) -> Path:
        return self.root / "nodes" / node / "cgroup"

    def job_cgroup(self, node: str, job_id: int) -> Path:
        return self.cgroup_root(node) / "system.slice" / "slurmstepd.scope" / f"job_{job_id}"

    def task_cgroup(self, node: str, job_id: int, step: str) -> Path:
        return self.job_cgroup(node, job_id) / f"step_{step}" / "user" / "task_0"

    def place(self, node: str, job_id: int, step: str, pids: Sequence[int]) -> Path:
        """Put ``pids`` in a step's cgroup on ``node`` (what slurmstepd does for the tasks it starts)."""
        directory = self.task_cgroup(node, job_id, step)
        directory.mkdir(parents=True, exist_ok=True)
        write_members(directory, [*cgroup_pids(directory), *pids])
        return directory

    # -- jobs -------------------------------------------------------------------

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with open(self.root / "lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def allocate(self, nodes: int, name: str = "job", **details: Any) -> dict[str, Any]:
        """A new RUNNING job on the first ``nodes`` nodes (what the controller does for sbatch/salloc)."""
        names = self.node_names()
        if nodes > len(names):
            raise ValueError(f"the pretend cluster has {len(names)} nodes, not {nodes}")
        with self.locked():
            counter = read_json(self.root / "counter.json")
            job_id = int(counter["next_job"])
            write_json(self.root / "counter.json", {"next_job": job_id + 1})
            job = {
                "job_id": job_id,
                "name": name,
                "user": os.getuid(),
                "state": "RUNNING",
                "nodes": names[:nodes],
                "next_step": 0,
                "steps": {},
                "exit_code": None,
                "submit_dir": os.getcwd(),
                **details,
            }
            write_json(self._job_path(job_id), job)
        for node in job["nodes"]:
            self.job_cgroup(node, job_id).mkdir(parents=True, exist_ok=True)
        return job

    def _job_path(self, job_id: int) -> Path:
        return self.root / "jobs" / f"{job_id}.json"

    def job(self, job_id: int) -> dict[str, Any] | None:
        path = self._job_path(job_id)
        if not path.exists():
            return None
        document: dict[str, Any] = read_json(path)
        return document

    def update_job(self, job_id: int, change: Callable[[dict[str, Any]], Any]) -> Any:
        with self.locked():
            job = self.job(job_id)
            if job is None:
                raise KeyError(job_id)
            value = change(job)
            write_json(self._job_path(job_id), job)
            return value

    def job_pids(self, job_id: int) -> dict[str, list[int]]:
        job = self.job(job_id)
        if job is None:
            return {}
        return {node: cgroup_pids(self.job_cgroup(node, job_id)) for node in job["nodes"]}

    def signal_job(self, job_id: int, sig: int) -> int:
        sent = 0
        for pids in self.job_pids(job_id).values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
                    sent += 1
        return sent

    def end_job(self, job_id: int, exit_code: int) -> None:
        """The batch script ended: kill what is left of the job everywhere, as Slurm does, and clean up."""
        for _ in range(3):
            if not self.signal_job(job_id, signal.SIGKILL):
                break
            time.sleep(0.1)
        job = self.job(job_id)
        for node in job["nodes"] if job else []:
            shutil.rmtree(self.job_cgroup(node, job_id), ignore_errors=True)

        def finish(record: dict[str, Any]) -> None:
            record["state"] = "COMPLETED" if exit_code == 0 else "FAILED"
            record["exit_code"] = exit_code

        self.update_job(job_id, finish)

    # -- steps --------------------------------------------------------------------

    def task_env(
        self,
        job: Mapping[str, Any],
        node: str,
        index: int,
        step: str,
        step_nodes: Sequence[str],
        base: Mapping[str, str],
    ) -> dict[str, str]:
        """A task's environment: the caller's (srun's --export=ALL default), the node's, and SLURM_*."""
        job_id = str(job["job_id"])
        env = dict(base)
        env.update(self.node_env(node))
        env.update(
            {
                "SLURM_CLUSTER_NAME": CLUSTER,
                "SLURM_JOB_ID": job_id,
                "SLURM_JOBID": job_id,
                "SLURM_JOB_NAME": str(job["name"]),
                "SLURM_JOB_NUM_NODES": str(len(job["nodes"])),
                "SLURM_JOB_NODELIST": compress_hostlist(job["nodes"]),
                "SLURM_SUBMIT_DIR": str(job["submit_dir"]),
                "SLURMD_NODENAME": node,
                "SLURM_NODEID": str(index),
                "SLURM_PROCID": str(index),
                "SLURM_LOCALID": "0",
                "SLURM_TOPOLOGY_ADDR": node,
            }
        )
        if step == "batch":
            env.update({"SLURM_NNODES": str(len(job["nodes"])), "SLURM_NODELIST": env["SLURM_JOB_NODELIST"]})
        else:
            env.update(
                {
                    "SLURM_STEP_ID": step,
                    "SLURM_STEPID": step,
                    "SLURM_NNODES": str(len(step_nodes)),
                    "SLURM_STEP_NUM_NODES": str(len(step_nodes)),
                    "SLURM_NTASKS": str(len(step_nodes)),
                    "SLURM_NPROCS": str(len(step_nodes)),
                    "SLURM_STEP_NUM_TASKS": str(len(step_nodes)),
                    "SLURM_STEP_NODELIST": compress_hostlist(step_nodes),
                    "SLURM_NODELIST": compress_hostlist(step_nodes),
                    "SLURM_STEP_TASKS_PER_NODE": f"1(x{len(step_nodes)})",
                }
            )
        return env

    def kill_request_path(self, node: str, job_id: int, step: str) -> Path:
        return self.root / "steps" / f"{job_id}.{step}.{node}.kill"

    def kill_step(self, node: str, job_id: int, step: str) -> None:
        """SIGKILL every process of a step on ``node``, as slurmstepd does when srun ends a step.

        The request is also left for the step's daemon: a task it has not yet
        listed in ``cgroup.procs`` (or not yet started) is killed by the daemon
        itself, so the kill never depends on how far the daemon had got.
        """
        self.kill_request_path(node, job_id, step).touch()
        for pid in cgroup_pids(self.task_cgroup(node, job_id, step)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)

    def status_path(self, job_id: int, step: str, index: int) -> Path:
        return self.root / "steps" / f"{job_id}.{step}.{index}.status"

    def task_pid_path(self, job_id: int, step: str, index: int) -> Path:
        return self.root / "steps" / f"{job_id}.{step}.{index}.task"

    def task_pid(self, job_id: int, step: str = "batch", index: int = 0) -> int | None:
        """The pid of a step's task (for the batch step: the batch script's shell)."""
        try:
            return int(self.task_pid_path(job_id, step, index).read_text())
        except (OSError, ValueError):
            return None

    def stepd_pid_path(self, job_id: int, step: str, index: int) -> Path:
        return self.root / "steps" / f"{job_id}.{step}.{index}.stepd"

    def launch(
        self,
        job: Mapping[str, Any],
        step: str,
        nodes: Sequence[str],
        command: Sequence[str],
        base_env: Mapping[str, str],
        *,
        stdout: int | None = None,
        stderr: int | None = None,
        cwd: str | None = None,
    ) -> list[int]:
        """Start ``command`` once on each of ``nodes`` through a detached stand-in slurmstepd.

        Returns the node indexes; :meth:`step_status` tells when each task ended.
        """
        indexes = []
        for index, node in enumerate(nodes):
            env = self.task_env(job, node, index, step, nodes, base_env)
            env[WORLD_ENV] = str(self.root)
            subprocess.run(
                [
                    sys.executable,
                    str(HERE / "slurm_stepd.py"),
                    str(job["job_id"]),
                    step,
                    node,
                    str(index),
                    "--",
                    *command,
                ],
                env=env,
                stdout=stdout,
                stderr=stderr,
                cwd=cwd,
                check=True,
            )
            indexes.append(index)
        return indexes

    def step_status(self, job_id: int, step: str, index: int) -> int | None:
        path = self.status_path(job_id, step, index)
        if not path.exists():
            return None
        return int(read_json(path)["exit_code"])

    def stepd_pid(self, job_id: int, step: str, index: int) -> int | None:
        """The step's stand-in slurmstepd while it runs (not a pid its ended one left and another took)."""
        path = self.stepd_pid_path(job_id, step, index)
        try:
            pid = int(path.read_text())
        except (OSError, ValueError):
            return None
        return pid if is_stepd(pid) else None

    def cleanup(self) -> None:
        """Kill every process of every job and every stand-in slurmstepd (test teardown)."""
        for path in (self.root / "steps").glob("*.stepd"):
            with contextlib.suppress(OSError, ValueError):
                pid = int(path.read_text())
                if is_stepd(pid):  # a stepd that ended left its file: its pid may be another's now
                    os.kill(pid, signal.SIGKILL)
        for path in (self.root / "jobs").glob("*.json"):
            job_id = int(path.stem)
            for _ in range(3):
                if not self.signal_job(job_id, signal.SIGKILL):
                    break
                time.sleep(0.05)
