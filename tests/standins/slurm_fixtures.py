"""STAND-IN Slurm fixtures: a pretend cluster, its srun/sbatch/scontrol on PATH, demo targets on its nodes.

from tests.standins.slurm_fixtures import slurm  # noqa: F401
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Demo, wait_until
from tests.standins.slurm_world import World, install_commands

SCRIPTS = REPO / "scripts" / "slurm"


@dataclass
class Cluster:
    """A pretend cluster: its world, a bin directory with the stand-ins (and the real hibernate CLI)."""

    world: World
    bin: Path
    scratch: Path
    demos: list[Demo] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        """The environment of a login shell on this cluster: stand-ins first on PATH."""
        return {
            **os.environ,
            **self.world.env,
            "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
        }

    def allocate(self, nodes: int, name: str = "job") -> dict[str, Any]:
        """A running job on the first ``nodes`` nodes, submitted from the scratch directory."""
        return self.world.allocate(nodes, name, submit_dir=str(self.scratch))

    def job_env(self, job: Mapping[str, Any], node: str | None = None) -> dict[str, str]:
        """The environment of the batch script of ``job`` (for running a script as if inside it)."""
        node = node or job["nodes"][0]
        return self.world.task_env(job, node, 0, "batch", job["nodes"], self.env)

    def run(
        self, command: Sequence[str], env: Mapping[str, str] | None = None, timeout: float = 180
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            list(command),
            env=dict(env or self.env),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.scratch,
        )

    def start_demos(
        self,
        placements: Sequence[tuple[str, int | None]],
        size_mb: int = 16,
        env: Mapping[str, str] | None = None,
    ) -> list[Demo]:
        """Start one demo per (node, job) at once; each in its node's environment and job cgroup.

        The test plays slurmstepd here: it puts each demo's pid in the job's
        cgroup on its node, in the ``extern`` step where Slurm puts processes it
        adopts into a job (``job`` None: in no job). The demos start in
        parallel, as importing torch is most of their start-up time.
        """
        started = []
        for node, job_id in placements:
            index = len(self.demos)
            control = self.scratch / f"demo{index}.sock"
            ready = self.scratch / f"demo{index}.ready"
            log = self.scratch / f"demo{index}.log"
            command = [
                sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve",
                "--size-mb", str(size_mb), "--control", str(control), "--ready-file", str(ready),
            ]  # fmt: skip
            environment = {**self.env, **self.world.node_env(node), **(env or {})}
            with open(log, "wb") as log_file:
                proc = subprocess.Popen(
                    command, stdout=log_file, stderr=subprocess.STDOUT, cwd=REPO, env=environment
                )
            demo = Demo(proc, str(control), {}, log, {"node": node, "job": job_id, "ready": ready})
            started.append(demo)
            self.demos.append(demo)
        wait_until(lambda: all(ready_or_exited(demo) for demo in started), 180, "the demos to be ready", 0.05)
        for demo in started:
            demo.info = json.loads(demo.extra["ready"].read_text())
            if demo.extra["job"] is not None:
                self.world.place(demo.extra["node"], demo.extra["job"], "extern", [demo.pid])
        return started

    def state(self, demo: Demo) -> str:
        """The agent state of ``demo``, asked on its node."""
        env = {**self.env, **self.world.node_env(demo.extra["node"])}
        result = self.run([sys.executable, "-m", "hibernate", "status", str(demo.pid), "--json"], env)
        assert result.returncode == 0, result.stderr
        state: str = result.stdout and json.loads(result.stdout)["agents"][0]["state"]
        return state


def ready_or_exited(demo: Demo) -> bool:
    """Whether ``demo`` has written its ready file; a failure with its log if it exited first."""
    if demo.extra["ready"].exists():
        return True
    if demo.proc.poll() is not None:
        raise AssertionError(f"demo {demo.pid} exited ({demo.proc.returncode}):\n{demo.log.read_text()}")
    return False


def install_hibernate(bin_dir: Path) -> None:
    """``hibernate`` on PATH, as `pip install` would put it (the real CLI of this checkout)."""
    path = bin_dir / "hibernate"
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hibernate "$@"\n')
    path.chmod(0o755)


@contextlib.contextmanager
def pretend_cluster(nodes: int = 3) -> Iterator[Cluster]:
    """A pretend Slurm cluster of ``nodes`` nodes; every process it started is killed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="hb-slurm-", dir="/tmp"))
    world = World(root / "w").create(nodes=nodes)
    bin_dir = install_commands(root / "bin")
    install_hibernate(bin_dir)
    scratch = root / "scratch"
    scratch.mkdir()
    cluster = Cluster(world, bin_dir, scratch)
    try:
        yield cluster
    finally:
        world.cleanup()
        for demo in cluster.demos:
            with contextlib.suppress(ProcessLookupError):
                os.kill(demo.pid, signal.SIGCONT)
            demo.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def slurm(runtime_dir: Path) -> Iterator[Cluster]:
    """A pretend three-node Slurm cluster for one test."""
    with pretend_cluster() as cluster:
        yield cluster
