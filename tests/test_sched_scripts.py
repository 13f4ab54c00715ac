"""The example scripts of scripts/slurm/, run on the pretend cluster as Slurm would run them.

Every script is shell-checked; each example runs end to end with the demo as
its GPU program: a preemptible server suspended and resumed by Slurm's own
signals, a training job that sleeps between phases on two nodes, and the
site's suspend/resume pair.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import process_state, wait_until
from tests.standins.slurm_fixtures import SCRIPTS, Cluster

SHELL_SCRIPTS = sorted(p for p in SCRIPTS.iterdir() if p.is_file())


def demo_command(scratch: Path, name: str, size_mb: int = 16) -> str:
    """The demo as a script's server or trainer; ``$SLURMD_NODENAME`` in paths is expanded per node."""
    return (
        f"{sys.executable} -W ignore -m hibernate.demo serve --size-mb {size_mb} "
        f"--control {scratch}/{name}.sock --ready-file {scratch}/{name}.ready"
    )


def test_there_are_scripts_to_check() -> None:
    names = {p.name for p in SHELL_SCRIPTS}
    assert {"hibernate-job", "hibernate-suspend", "hibernate-resume"} <= names
    assert {"vllm-preemptible.sbatch", "train-phases.sbatch"} <= names


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_every_script_passes_shellcheck(script: Path) -> None:
    result = subprocess.run(["shellcheck", "--external-sources", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", ["hibernate-job", "hibernate-suspend", "hibernate-resume"])
def test_the_commands_explain_themselves(script: str) -> None:
    result = subprocess.run([str(SCRIPTS / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith(script), result.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["sleep", "--job", "12_3", "--to", "/tmp"], "not a numeric Slurm job id"),
        (["sleep", "--job", "12"], "sleep needs --to DIR"),
        (["hover", "--job", "12"], "hibernate-job sleep --to DIR"),
        (["wake", "--job", "12", "--barrier-timeout", "soon"], "not a number of seconds"),
    ],
)
def test_hibernate_job_refuses_bad_input_with_usage(args: list[str], words: str) -> None:
    result = subprocess.run([str(SCRIPTS / "hibernate-job"), *args], capture_output=True, text=True)
    assert result.returncode == ExitCode.USAGE and words in result.stderr


def submit(slurm: Cluster, script: str, env: dict[str, str]) -> tuple[int, Path]:
    result = slurm.run(["sbatch", "--parsable", str(SCRIPTS / script)], {**slurm.env, **env})
    assert result.returncode == 0, result.stderr
    job_id = int(result.stdout.strip())
    return job_id, slurm.scratch / f"slurm-{job_id}.out"


@dataclass
class ScriptDemo:
    """A demo a script started (not our child): found through its ready file, killed with the job."""

    pid: int
    control: str
    extra: dict[str, Any] = field(default_factory=dict)

    def request(self, command: str) -> dict[str, Any]:
        from hibernate.demo import request

        return request(self.control, command, 120)

    def infer(self) -> dict[str, Any]:
        return self.request("infer")


def ready_demo(slurm: Cluster, name: str, node: str) -> ScriptDemo:
    ready = slurm.scratch / f"{name}.ready"
    info = json.loads(wait_until(lambda: ready.exists() and ready.read_text(), 90, f"{name} to start", 0.1))
    return ScriptDemo(info["pid"], str(slurm.scratch / f"{name}.sock"), {"node": node})


@pytest.mark.slow
def test_the_preemptible_server_sleeps_through_a_slurm_suspend(slurm: Cluster, work_dir: Path) -> None:
    slurm.world.configure(suspend_grace_time=8)  # the site gives a sleep this long before SIGSTOP
    job_id, output = submit(
        slurm,
        "vllm-preemptible.sbatch",
        {"VLLM_COMMAND": demo_command(slurm.scratch, "server"), "SNAPSHOTS": str(work_dir)},
    )
    server = ready_demo(slurm, "server", "node0")
    reference = server.infer()["digest"]
    wrapper = slurm.world.task_pid(job_id)
    assert "hibernate run" in Path(f"/proc/{wrapper}/cmdline").read_text().replace("\0", " ")  # exec'd

    assert slurm.run(["scontrol", "suspend", str(job_id)]).returncode == 0
    # Stopped as the kernel sees it (T), not as the stand-in's record says: its flag is set once
    # the SIGSTOP is sent, which is before either process has been scheduled to stop. Nothing else
    # stops them: the wrapper and its server ignore the SIGTSTP that comes first.
    wait_until(
        lambda: process_state(server.pid) == "T" and process_state(wrapper) == "T",
        120,
        "both processes stopped by the SIGSTOP after the grace time",
        0.1,
        detail=lambda: {pid: process_state(pid) for pid in (server.pid, wrapper)},
    )
    log = output.read_text()
    assert f"asleep: pid {server.pid}" in log, log  # asleep before the grace time ran out
    assert list(work_dir.glob("*/snap-*/manifest.json"))

    assert slurm.run(["scontrol", "resume", str(job_id)]).returncode == 0
    wait_until(lambda: f"awake: pid {server.pid}" in output.read_text(), 90, "the wake on SIGCONT", 0.1)
    assert slurm.state(server) == "running"
    assert server.infer()["digest"] == reference


@pytest.mark.slow
def test_a_training_job_sleeps_between_phases_on_every_node(slurm: Cluster) -> None:
    evals = slurm.scratch / "evals"
    evals.mkdir()
    job_id, output = submit(
        slurm,
        "train-phases.sbatch",
        {
            "TRAIN_COMMAND": demo_command(slurm.scratch, "trainer-$SLURMD_NODENAME"),
            # the evaluation records what hibernate says about the trainer on its node
            "EVAL_COMMAND": f"hibernate status --job $SLURM_JOB_ID --json >{evals}/$SLURMD_NODENAME-$PHASE",
            "PHASES": "2",
            "PHASE_SECONDS": "0",
            "SNAPSHOTS": str(slurm.scratch / "snapshots"),
            "HIBERNATE_JOB": str(SCRIPTS / "hibernate-job"),
            "READY_TIMEOUT": "120",
        },
    )
    trainers = [ready_demo(slurm, f"trainer-node{i}", f"node{i}") for i in range(2)]
    wait_until(lambda: "phase 2: trainer awake" in output.read_text(), 180, "both phases", 0.1)
    for trainer in trainers:
        trainer.request("quit")
    wait_until(
        lambda: (slurm.world.job(job_id) or {}).get("exit_code") is not None, 90, "the job to end", 0.1
    )
    assert slurm.world.job(job_id)["exit_code"] == 0, output.read_text()
    for node in ("node0", "node1"):
        for phase in (1, 2):
            agents = json.loads((evals / f"{node}-{phase}").read_text())["agents"]
            assert [a["state"] for a in agents] == ["asleep"], (node, phase)
    assert sorted(p.name for p in (slurm.scratch / "snapshots").iterdir()) == ["node0", "node1"]


def train_two_phases_ending_early(slurm: Cluster, wrapper: Path) -> Path:
    """train-phases.sbatch over two phases with ``wrapper`` as its hibernate-job; it must end in failure.

    Returns the job's output file.
    """
    wrapper.chmod(0o755)
    job_id, output = submit(
        slurm,
        "train-phases.sbatch",
        {
            "TRAIN_COMMAND": demo_command(slurm.scratch, "trainer-$SLURMD_NODENAME"),
            "EVAL_COMMAND": "true",
            "PHASES": "2",
            "PHASE_SECONDS": "0",
            "SNAPSHOTS": str(slurm.scratch / "snapshots"),
            "HIBERNATE_JOB": str(wrapper),
            "READY_TIMEOUT": "120",
        },
    )
    wait_until(
        lambda: (slurm.world.job(job_id) or {}).get("exit_code") is not None, 180, "the job to end", 0.1
    )
    assert slurm.world.job(job_id)["exit_code"] != 0
    return output


@pytest.mark.slow
def test_a_training_job_ended_early_puts_its_woken_trainer_to_sleep_before_killing_it(slurm: Cluster) -> None:
    """A restored CUDA process killed can hang its node: the job's ending sleeps it first."""
    calls, wrapper = slurm.scratch / "job-calls", slurm.scratch / "hibernate-job-third-fails"
    # The third call (phase 2's sleep) fails, with the trainer woken once: the job ends early.
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$1" >> {calls}\n'
        f'[ "$(wc -l < {calls})" -eq 3 ] && exit 1\n'
        f'exec {SCRIPTS / "hibernate-job"} "$@"\n'
    )
    output = train_two_phases_ending_early(slurm, wrapper)
    assert "phase 1: trainer awake" in output.read_text()
    assert calls.read_text().split() == ["sleep", "wake", "sleep", "sleep"]  # the last: the ending's
    for node in ("node0", "node1"):  # each trainer's second snapshot: the sleep before it was killed
        assert list((slurm.scratch / "snapshots" / node).glob("*/snap-000002/manifest.json")), node


@pytest.mark.slow
def test_the_site_pair_frees_the_gpus_before_suspending_and_wakes_after_resuming(
    slurm: Cluster, work_dir: Path
) -> None:
    slurm.world.configure(suspend_grace_time=0.5)
    job = slurm.allocate(2, "serving")
    demos = slurm.start_demos([("node0", job["job_id"]), ("node1", job["job_id"])])
    reference = [d.infer()["digest"] for d in demos]
    resident = [d.rss() for d in demos]
    operator = {**slurm.env, "HIBERNATE_BARRIER_DIR": str(slurm.scratch / "barriers")}
    job_id = str(job["job_id"])

    suspended = slurm.run([str(SCRIPTS / "hibernate-suspend"), job_id, "--to", str(work_dir)], operator)
    assert suspended.returncode == 0, suspended.stderr
    assert slurm.world.job(job["job_id"])["state"] == "SUSPENDED"
    wait_until(
        lambda: all(process_state(d.pid) == "T" for d in demos), 90, "both demos stopped by the suspend", 0.1
    )
    for demo, before in zip(demos, resident, strict=True):
        assert demo.rss() < before - 12 * 2**20  # its 16 MiB of weights are on disk, not in memory
    assert sorted(p.name for p in work_dir.iterdir()) == ["node0", "node1"]

    resumed = slurm.run([str(SCRIPTS / "hibernate-resume"), job_id], operator)
    assert resumed.returncode == 0, resumed.stderr
    assert [slurm.state(d) for d in demos] == ["running", "running"]
    assert [d.infer()["digest"] for d in demos] == reference


@pytest.mark.slow
def test_the_site_pair_does_not_suspend_a_job_that_cannot_sleep(slurm: Cluster, work_dir: Path) -> None:
    job = slurm.allocate(2, "serving")
    demos = slurm.start_demos([("node0", job["job_id"]), ("node1", job["job_id"])])
    demos[1].hold(6)  # node1's program is in a long step: its sleep times out
    operator = {**slurm.env, "HIBERNATE_BARRIER_DIR": str(slurm.scratch / "barriers")}
    command = [
        str(SCRIPTS / "hibernate-suspend"),
        str(job["job_id"]),
        "--to",
        str(work_dir),
        "--",
        "--timeout",
        "1",
    ]
    result = slurm.run(command, operator)
    assert result.returncode == ExitCode.TIMEOUT, result.stderr
    assert "was not suspended" in result.stderr
    assert slurm.world.job(job["job_id"])["state"] == "RUNNING"
    assert [slurm.state(d) for d in demos] == ["running", "running"]


def test_resume_refuses_a_job_that_is_not_there(slurm: Cluster) -> None:
    result = slurm.run([str(SCRIPTS / "hibernate-resume"), "99999"])
    assert result.returncode != 0 and "Invalid job id" in result.stderr


@pytest.mark.slow
def test_a_training_job_whose_wake_failed_part_way_sleeps_its_trainer_before_killing_it(
    slurm: Cluster,
) -> None:
    """A wake that failed may have restored the trainer on some nodes: the ending sleeps it all the same."""
    calls, wrapper = slurm.scratch / "job-calls", slurm.scratch / "hibernate-job-wake-fails"
    # The second call (phase 1's wake) wakes every node, then reports a failure: the job ends early.
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$1" >> {calls}\n'
        f'{SCRIPTS / "hibernate-job"} "$@" || exit\n'
        f'[ "$(wc -l < {calls})" -ne 2 ]\n'
    )
    output = train_two_phases_ending_early(slurm, wrapper)
    assert "phase 1: trainer awake" not in output.read_text()
    assert calls.read_text().split() == ["sleep", "wake", "sleep"]  # the last: the ending's
    for node in ("node0", "node1"):  # each trainer's second snapshot: the sleep before it was killed
        assert list((slurm.scratch / "snapshots" / node).glob("*/snap-000002/manifest.json")), node
