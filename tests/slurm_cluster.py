"""A private, real Slurm cluster for the scheduler tests: one controller and two nodes on this machine.

Debian's ``slurm-wlm`` and ``munge`` run a controller (slurmctld) and several
node daemons (``slurmd -N <name>``) on one host; each node daemon starts the
tasks of its node under its own slurmstepd, in its own freezer cgroup
(``/sys/fs/cgroup/freezer/slurm_<node>/uid_<uid>/job_<id>/step_<n>``, the
layout of several slurmd on one host). So ``sbatch``, ``srun``, ``scontrol
suspend`` and preemption are Slurm's own here, not a reading of its manual.

Each pytest process (each xdist worker) starts its own cluster once, the first
time a test asks for it, and stops it at the end of its session. Per-worker
clusters rather than one shared: a preemption test suspends every
lower-priority job on its nodes, and a test of one worker must not suspend the
jobs of a test the other worker runs; and a cluster that belongs to one
process is torn down by that process alone, with no count of users to keep.
The clusters cannot clash: each has its own directory (state, spool, logs,
pids, its munged's socket and key), ports found free, a cluster and node names
drawn at random (node names name the cgroups on this host), and job ids
starting at a number of its own.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import re
import secrets
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import pytest

from tests.demo_control import DemoControl

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts" / "slurm"
FREEZER = Path("/sys/fs/cgroup/freezer")
INSTALL = "apt-get install -y slurm-wlm munge"
# The unprivileged second user whose job root hibernates (created when missing).
JOB_USER = "hbslurm"
DAEMONS = ("slurmctld", "slurmd", "munged")
# Safety nets for a cluster's start, not claims: on a loaded machine slurmd registers in tens of seconds.
START_TIMEOUT = 180.0
# Set: the cluster tracks job processes as where cgroup v1 is not mounted (to check that case here).
LINUXPROC_ENV = "HIBERNATE_TEST_SLURM_LINUXPROC"


def missing_reason() -> str | None:
    """Why no private cluster can run on this machine (None when one can)."""
    absent = [d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()]
    if absent:
        return f"Slurm is not installed ({', '.join(absent)} missing): as root, run `{INSTALL}`"
    if os.getuid() != 0:
        return "a private Slurm cluster needs root (slurmd starts each job's tasks as the job's owner)"
    return None


def daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def cgroup_v1_freezer() -> bool:
    """Whether the cgroup v1 freezer hierarchy is mounted (what proctrack/cgroup uses here)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[2] == "cgroup" and "freezer" in fields[3].split(","):
                return fields[1] == str(FREEZER)
    return False


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports free on this machine now."""
    for _ in range(200):
        base = random.randrange(20000, 60000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError(f"found no {count} consecutive free ports")


def job_user() -> pwd.struct_passwd:
    """The unprivileged user for jobs of another owner, created (no home, no login) when missing."""
    try:
        return pwd.getpwnam(JOB_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell", "/bin/sh", JOB_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(JOB_USER)


@dataclass
class SlurmCluster:
    """One running private cluster: where its files are, its node names, the processes it started."""

    root: Path
    name: str
    nodes: list[str]
    proctrack: str
    daemons: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def bin(self) -> Path:
        return self.root / "bin"

    @property
    def scratch(self) -> Path:
        """World-writable: job scripts, outputs, ready files and sockets of the tests' jobs."""
        return self.root / "scratch"

    @property
    def env(self) -> dict[str, str]:
        """A login shell on this cluster: its slurm.conf, its ``hibernate`` wrapper first on PATH."""
        return {
            **os.environ,
            "SLURM_CONF": str(self.conf),
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
        }

    def outside_env(self) -> dict[str, str]:
        """``env`` without any SLURM_* of a job this process might run in (a login node's shell)."""
        return {k: v for k, v in self.env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}

    def run(
        self,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        timeout: float = 180,
        cwd: Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(command),
            env=dict(env if env is not None else self.outside_env()),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or self.scratch,
        )

    def check(self, *command: str, timeout: float = 60) -> str:
        result = self.run(command, timeout=timeout)
        if result.returncode != 0:
            raise AssertionError(f"{' '.join(command)} exited {result.returncode}: {result.stderr}")
        return result.stdout

    # -- jobs -------------------------------------------------------------------------------

    def submit(self, *args: str, env: Mapping[str, str] | None = None) -> int:
        """``sbatch --parsable ARGS`` from the scratch directory; the job id."""
        result = self.run(["sbatch", "--parsable", *args], env=env)
        if result.returncode != 0:
            raise AssertionError(f"sbatch {' '.join(args)} exited {result.returncode}: {result.stderr}")
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol -o show job``'s fields (empty once the controller has forgotten the job)."""
        result = self.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=30)
        if result.returncode != 0:
            return {}
        return dict(re.findall(r"(\w+)=(\S*)", result.stdout))

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: int, *states: str, timeout: float = 240) -> dict[str, str]:
        """Wait until the job is in one of ``states`` (as the controller reports it); its fields."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {job_id} is {info.get('JobState')!r}, not {'/'.join(states)} after {timeout:g}s; "
                    f"{info.get('Reason', '')}\n{self.logs_tail()}"
                )
            time.sleep(0.1)

    def cancel(self, job_id: int) -> None:
        """Cancel a job and wait until it has ended (a suspended one is resumed so that it can die)."""
        if self.state(job_id) == "SUSPENDED":
            self.run(["scontrol", "resume", str(job_id)], timeout=30)
        self.run(["scancel", str(job_id)], timeout=30)
        self.wait_state(job_id, "CANCELLED", "COMPLETED", "FAILED", "TIMEOUT", "PREEMPTED", "")

    def cancel_all(self) -> None:
        listed = self.run(["squeue", "-h", "-o", "%i"], timeout=30).stdout.split()
        for job_id in listed:
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                self.cancel(int(job_id))

    # -- on the nodes -----------------------------------------------------------------------

    def job_cgroup(self, node: str, job_id: int, uid: int = 0) -> Path:
        return FREEZER / f"slurm_{node}" / f"uid_{uid}" / f"job_{job_id}"

    def runtime_dir(self, node: str, uid: int = 0) -> Path:
        """Where the hibernate agents of user ``uid`` on ``node`` listen (on a real node, its /run/user)."""
        return self.root / "nodes" / node / f"run-{uid}"

    def logs_tail(self, lines: int = 15) -> str:
        parts = []
        for log in sorted((self.root / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            parts.append(f"== {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def our_cgroups(self) -> list[Path]:
        return [FREEZER / f"slurm_{node}" for node in self.nodes if (FREEZER / f"slurm_{node}").is_dir()]

    def stop(self) -> None:
        """Cancel every job, stop the daemons this cluster started, then anything left in its cgroups."""
        with contextlib.suppress(Exception):
            if all(d.poll() is None for d in self.daemons):
                self.cancel_all()
        for process in reversed(self.daemons):  # slurmd, slurmctld, munged last
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in reversed(self.daemons):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        for top in self.our_cgroups():  # slurmstepd and tasks of this cluster's nodes only
            for _ in range(20):
                members = [
                    int(pid) for procs in top.rglob("cgroup.procs") for pid in procs.read_text().split()
                ]
                if not members:
                    break
                for state in top.rglob("freezer.state"):
                    with contextlib.suppress(OSError):
                        state.write_text("THAWED")
                for pid in members:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                time.sleep(0.1)
            for directory in sorted((p for p in [top, *top.rglob("*")] if p.is_dir()), reverse=True):
                with contextlib.suppress(OSError):
                    directory.rmdir()
        shutil.rmtree(self.root, ignore_errors=True)


def slurm_conf(cluster: SlurmCluster, ctld_port: int, node_port: int, first_job: int) -> str:
    """The cluster's slurm.conf: the site settings the tests run against (docs/schedulers.md)."""
    root = cluster.root
    cgroup = cluster.proctrack == "proctrack/cgroup"
    return "\n".join(
        [
            f"ClusterName={cluster.name}",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root}/munge/munge.socket",
            f"StateSaveLocation={root}/state",
            f"SlurmdSpoolDir={root}/spool/%n",
            f"SlurmctldPidFile={root}/run/slurmctld.pid",
            f"SlurmdPidFile={root}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={root}/log/slurmctld.log",
            f"SlurmdLogFile={root}/log/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"ProctrackType={cluster.proctrack}",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=SUSPEND,GANG",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "InactiveLimit=0",
            "KillWait=5",
            # Batch jobs are requeued only when they ask (sbatch --requeue, as requeue-resume.sbatch
            # does), as on sites that turn Slurm's default (1) off.
            "JobRequeue=0",
            "MinJobAge=600",
            f"FirstJobId={first_job}",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            *([] if cgroup else ["# cgroup v1 freezer not mounted here: processes tracked by parentage"]),
            f"NodeName={','.join(cluster.nodes)} NodeAddr=127.0.0.1 Port={node_port}-{node_port + 1} "
            "CPUs=2 State=UNKNOWN",
            # A job of "low" is suspended while a job of "high" needs its CPUs (PreemptMode=SUSPEND,GANG).
            "PartitionName=low Nodes=ALL Default=YES PriorityTier=1 PreemptMode=SUSPEND "
            "OverSubscribe=FORCE:1 MaxTime=INFINITE State=UP",
            "PartitionName=high Nodes=ALL PriorityTier=10 PreemptMode=OFF OverSubscribe=NO "
            "MaxTime=INFINITE State=UP",
            # A job of "requeue" is killed and requeued instead (requeue-resume.sbatch): SIGTERM to its
            # batch shell, SIGKILL KillWait seconds later. Slurm 22.05 gives a REQUEUE preemption no
            # GraceTime (seen here: killed at once); later releases do (read in their preempt.c).
            "PartitionName=requeue Nodes=ALL PriorityTier=1 PreemptMode=REQUEUE GraceTime=30 "
            "OverSubscribe=NO MaxTime=INFINITE State=UP",
            "",
        ]
    )


CGROUP_CONF = "".join(
    f"{line}\n"
    for line in (
        "CgroupPlugin=cgroup/v1",
        "CgroupAutomount=no",
        "ConstrainCores=no",
        "ConstrainRAMSpace=no",
        "ConstrainDevices=no",
    )
)

HIBERNATE_WRAPPER = """#!/bin/sh
# hibernate as installed on this cluster's nodes: each node's agents listen in the node's own
# runtime directory of their user (on real nodes, /run/user on each host).
if [ -n "${{SLURMD_NODENAME:-}}" ]; then
    HIBERNATE_RUNTIME_DIR="{root}/nodes/$SLURMD_NODENAME/run-$(id -u)"
    export HIBERNATE_RUNTIME_DIR
fi
PYTHONPATH="{source}${{PYTHONPATH:+:$PYTHONPATH}}"
export PYTHONPATH
if [ ! -x "{python}" ] && [ -x "{copy}/bin/{version}" ]; then
    # A user who cannot reach this interpreter: the copy made for them (python_for).
    PYTHONHOME="{copy}" LD_LIBRARY_PATH="{copy}/lib" PYTHONPATH="{site}:$PYTHONPATH"
    export PYTHONHOME LD_LIBRARY_PATH PYTHONPATH
    exec "{copy}/bin/{version}" {module} "$@"
fi
exec "{python}" {module} "$@"
"""
VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"


def site_packages() -> str:
    """This virtual environment's site-packages (torch and the rest of what hibernate needs)."""
    return next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))


def write_wrappers(cluster: SlurmCluster) -> None:
    """``hibernate`` and ``hibernate-demo`` in the cluster's bin/ (what a site installs on its nodes)."""
    cluster.bin.mkdir()
    for name, module in (("hibernate", "-m hibernate"), ("hibernate-demo", "-W ignore -m hibernate.demo")):
        path = cluster.bin / name
        path.write_text(
            HIBERNATE_WRAPPER.format(
                root=cluster.root,
                source=REPO,
                python=sys.executable,
                module=module,
                copy=cluster.root / "python",
                version=VERSION,
                site=site_packages(),
            )
        )
        path.chmod(0o755)


def wait_for(predicate: object, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        for process in cluster.daemons:
            if process.poll() is not None:
                command = cast(list[str], process.args)  # popen() starts each daemon from a list of str
                raise RuntimeError(f"{command[0]} exited ({process.returncode}):\n{cluster.logs_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}:\n{cluster.logs_tail()}")
        time.sleep(0.1)


def nodes_idle(cluster: SlurmCluster) -> bool:
    listing = cluster.run(["sinfo", "-h", "-N", "-p", "low", "-o", "%N %t"], timeout=30).stdout.split("\n")
    states = dict(line.split() for line in listing if line.strip())
    return all(states.get(node) == "idle" for node in cluster.nodes)


def start_cluster() -> SlurmCluster:
    """Start munged, slurmctld and two slurmd in a fresh private directory; wait until both nodes are idle."""
    root = Path(tempfile.mkdtemp(prefix="hb-slurm-", dir="/tmp"))
    root.chmod(0o755)  # the job's owner reads slurm.conf and reaches the munge socket
    tag = "".join(secrets.choice(string.ascii_lowercase) for _ in range(5))
    cgroup = cgroup_v1_freezer() and not os.environ.get(LINUXPROC_ENV)
    cluster = SlurmCluster(
        root,
        f"hb{tag}",
        [f"hb{tag}n0", f"hb{tag}n1"],
        "proctrack/cgroup" if cgroup else "proctrack/linuxproc",
    )
    if not cgroup:
        why = (
            f"${LINUXPROC_ENV} is set"
            if os.environ.get(LINUXPROC_ENV)
            else f"no cgroup v1 freezer at {FREEZER}"
        )
        warnings.warn(
            f"private Slurm cluster: {why}; job processes are tracked with proctrack/linuxproc "
            "(a suspension stops them with SIGSTOP instead of freezing them)",
            stacklevel=1,
        )
    for sub in ("state", "spool", "log", "run", "munge"):
        (root / sub).mkdir()
    (root / "munge").chmod(0o755)
    cluster.scratch.mkdir()
    cluster.scratch.chmod(0o1777)
    for node in cluster.nodes:
        (root / "spool" / node).mkdir()
        # Every user's agents make their own 0700 runtime directory in it.
        cluster.runtime_dir(node).parent.mkdir(parents=True)
        cluster.runtime_dir(node).parent.chmod(0o1777)
    write_wrappers(cluster)
    key = root / "munge" / "munge.key"
    key.write_bytes(secrets.token_bytes(1024))
    key.chmod(0o600)
    ctld_port = free_ports(1)
    node_port = free_ports(2)
    first_job = random.randrange(1000, 60_000_000, 1000)
    cluster.conf.write_text(slurm_conf(cluster, ctld_port, node_port, first_job))
    (root / "cgroup.conf").write_text(CGROUP_CONF)
    log = root / "log"
    try:
        cluster.daemons.append(
            popen(
                [
                    daemon("munged"),
                    "-F",
                    f"--socket={root}/munge/munge.socket",
                    f"--key-file={key}",
                    f"--log-file={log}/munged.log",
                    f"--pid-file={root}/run/munged.pid",
                    f"--seed-file={root}/munge/seed",
                ],
                log / "munged.out",
                cluster.conf,
            )
        )
        wait_for((root / "munge" / "munge.socket").exists, START_TIMEOUT, "munged's socket", cluster)
        cluster.daemons.append(
            popen([daemon("slurmctld"), "-D", "-f", str(cluster.conf)], log / "ctld.out", cluster.conf)
        )
        pinged = lambda: cluster.run(["scontrol", "ping"], timeout=30).returncode == 0  # noqa: E731
        wait_for(pinged, START_TIMEOUT, "slurmctld", cluster)
        for node in cluster.nodes:
            cluster.daemons.append(
                popen(
                    [daemon("slurmd"), "-D", "-N", node, "-f", str(cluster.conf)],
                    log / f"{node}.out",
                    cluster.conf,
                )
            )
        wait_for(lambda: nodes_idle(cluster), START_TIMEOUT, "both nodes idle in sinfo", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def popen(command: list[str], output: Path, conf: Path) -> subprocess.Popen[bytes]:
    """A daemon of the cluster, its output to ``output``; it reads cgroup.conf beside ``conf``."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    with open(output, "wb") as out:
        return subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C at the terminal reaches pytest, which stops them in order
            env={**environment, "SLURM_CONF": str(conf)},
        )


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    """This process's private two-node Slurm cluster, started on first use, stopped at the end."""
    reason = missing_reason()
    if reason is not None:
        pytest.skip(reason)
    for attempt in range(3):
        try:
            cluster = start_cluster()
            break
        except RuntimeError as exc:  # a port found free was taken before a daemon bound it: others
            if "Address already in use" not in str(exc) or attempt == 2:
                raise
    try:
        yield cluster
    finally:
        cluster.stop()


# -- demo programs in jobs --------------------------------------------------------------------


@dataclass
class JobDemo(DemoControl):
    """A demo server started by a job on one node (a task of the job: not this process's child)."""

    pid: int
    control: str
    node: str
    reference: str = ""

    def infer(self) -> str:
        """The digest of the demo's weights as it computes them now (bit-exact checks compare these)."""
        return str(self.request("infer")["digest"])


def demo_command(cluster: SlurmCluster, name: str, size_mb: int = 16) -> str:
    """The demo server as a job runs it; ``$SLURMD_NODENAME`` in its file names is expanded per node."""
    files = f"{cluster.scratch}/{name}-$SLURMD_NODENAME"
    return f"hibernate-demo serve --size-mb {size_mb} --control {files}.sock --ready-file {files}.ready"


def ready_demos(
    cluster: SlurmCluster, job_id: int, name: str, nodes: Sequence[str], timeout: float = 180
) -> list[JobDemo]:
    """Wait for the demo named ``name`` on each of ``nodes`` to be ready (failing early if the job ends)."""
    import json

    files = [cluster.scratch / f"{name}-{node}.ready" for node in nodes]
    deadline = time.monotonic() + timeout
    while not all(f.exists() for f in files):
        state = cluster.state(job_id)
        if state not in ("PENDING", "RUNNING", "CONFIGURING"):
            outputs = "\n".join(p.read_text() for p in cluster.scratch.glob(f"slurm-{job_id}.out"))
            raise AssertionError(f"job {job_id} is {state!r} before its demos were ready:\n{outputs}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {name}'s demos in job {job_id}")
        time.sleep(0.1)
    demos = []
    for node, ready in zip(nodes, files, strict=True):
        info = json.loads(ready.read_text())
        demo = JobDemo(int(info["pid"]), str(ready.with_suffix(".sock")), node)
        demo.reference = demo.infer()
        demos.append(demo)
    return demos


def demo_job(
    cluster: SlurmCluster,
    name: str,
    nodes: Sequence[str],
    *sbatch: str,
    size_mb: int = 16,
    env: Mapping[str, str] | None = None,
) -> tuple[int, list[JobDemo]]:
    """A batch job whose one step runs a demo on each of ``nodes``; its id and its ready demos."""
    script = cluster.scratch / f"{name}.sbatch"
    script.write_text(
        f"#!/bin/sh\nexec srun --ntasks-per-node=1 sh -c 'exec {demo_command(cluster, name, size_mb)}'\n"
    )
    job_id = cluster.submit(
        f"--job-name={name}", f"--nodes={len(nodes)}", f"--nodelist={','.join(nodes)}",
        "--ntasks-per-node=1", *sbatch, str(script), env=env,
    )  # fmt: skip
    return job_id, ready_demos(cluster, job_id, name, nodes)


def agent_state(cluster: SlurmCluster, demo: JobDemo) -> str:
    """The state of ``demo``'s agent, asked on its node (where its agent listens)."""
    import json

    env = {**cluster.outside_env(), "SLURMD_NODENAME": demo.node}
    result = cluster.run(["hibernate", "status", str(demo.pid), "--json"], env)
    assert result.returncode == 0, result.stderr + result.stdout
    return str(json.loads(result.stdout)["agents"][0]["state"])


def stopped_by_slurm(pid: int) -> bool:
    """Whether Slurm has stopped process ``pid`` for a suspension: frozen in its freezer cgroup
    (proctrack/cgroup), or stopped by SIGSTOP (state ``T``, proctrack/linuxproc)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
    except OSError:
        return False
    if raw[raw.rindex(")") + 2] == "T":
        return True
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            with contextlib.suppress(OSError):
                return (FREEZER / path.lstrip("/") / "freezer.state").read_text().strip() == "FROZEN"
    return False


# -- a job of another user ------------------------------------------------------------------------


def as_user(user: pwd.struct_passwd) -> list[str]:
    """Command prefix that runs a program as ``user`` (this process is root)."""
    return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]


def python_for(cluster: SlurmCluster, user: pwd.struct_passwd) -> tuple[str, dict[str, str]]:
    """An interpreter ``user`` can run with hibernate and torch importable, and the environment it needs.

    This interpreter first; where its installation is out of the user's reach
    (a Python under root's 0700 home), a copy of the installation without its
    site-packages, made once per cluster, with this virtual environment's
    site-packages on PYTHONPATH. Skips the test when neither imports torch as
    ``user``: the machine cannot run it.
    """
    candidates: list[tuple[str, dict[str, str]]] = [(sys.executable, {"PYTHONPATH": str(REPO)})]
    base, copy = Path(sys.base_prefix), cluster.root / "python"
    if not copy.exists():
        (copy / "bin").mkdir(parents=True)
        shutil.copy2(Path(sys.executable).resolve(), copy / "bin" / VERSION)
        (copy / "lib").mkdir()
        for library in base.glob("lib/libpython*.so*"):
            shutil.copy2(library, copy / "lib" / library.name)
        shutil.copytree(
            base / "lib" / VERSION,
            copy / "lib" / VERSION,
            ignore=shutil.ignore_patterns("site-packages", "test", "__pycache__"),
        )
    copied = {
        "PYTHONPATH": f"{site_packages()}:{REPO}",
        "LD_LIBRARY_PATH": str(copy / "lib"),
        "PYTHONHOME": str(copy),
    }
    candidates.append((str(copy / "bin" / VERSION), copied))
    failures = []
    for python, env in candidates:
        probe = subprocess.run(  # runuser sets the user's groups too, as slurmstepd does
            ["runuser", "-u", user.pw_name, "--", python, "-c", "import hibernate, torch"],
            env={"PATH": os.environ.get("PATH", ""), **env},
            capture_output=True,
            text=True,
            cwd="/",
        )
        if probe.returncode == 0:
            return python, env
        failures.append(f"{python}: {probe.stderr.strip()[-200:]}")
    pytest.skip(f"no interpreter with torch that {user.pw_name} can run here: {'; '.join(failures)}")
