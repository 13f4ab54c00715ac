"""scripts/slurm/hibernate-job on a pretend three-node cluster: all asleep and back, or all awake.

The stand-in srun (tests/standins/slurm_srun.py) starts one `hibernate
node-step` per pretend node, each with that node's runtime directory and
cgroup root, so `--job` on a node finds that node's demo only.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import Demo
from tests.standins.slurm_fixtures import SCRIPTS, Cluster, pretend_cluster

HIBERNATE_JOB = str(SCRIPTS / "hibernate-job")


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, dict[str, Any], list[Demo], Demo]]:
    """Three nodes, a job on all of them with a demo each, and a demo of another job on node0.

    Shared by the tests of this module (starting demos is most of their time);
    each test leaves every demo awake.
    """
    with pretend_cluster(3) as slurm:
        job = slurm.allocate(3, "train")
        other = slurm.allocate(1, "other")
        demos = slurm.start_demos([(n, job["job_id"]) for n in job["nodes"]] + [("node0", other["job_id"])])
        for demo in demos:
            demo.extra["reference"] = demo.infer()["digest"]
        yield slurm, job, demos[:3], demos[3]


def hibernate_job(slurm: Cluster, job: dict[str, Any], *args: str, env: dict[str, str] | None = None) -> Any:
    """Run the script as the job's batch script would (inside the allocation, on its first node)."""
    return slurm.run([HIBERNATE_JOB, *args], {**slurm.job_env(job), **(env or {})})


def node_reports(stdout: str) -> list[dict[str, Any]]:
    """The JSON documents the nodes printed (srun passes every task's output on)."""
    decoder, documents, text = json.JSONDecoder(), [], stdout.strip()
    while text:
        document, end = decoder.raw_decode(text)
        documents.append(document)
        text = text[end:].strip()
    return sorted(documents, key=lambda d: d["node_index"])


def states(slurm: Cluster, demos: list[Demo]) -> list[str]:
    return [slurm.state(d) for d in demos]


def assert_serving(demos: list[Demo]) -> None:
    for demo in demos:
        assert demo.infer()["digest"] == demo.extra["reference"], demo.extra["node"]


@pytest.mark.slow
def test_every_node_sleeps_and_wakes_as_one(cluster, work_dir: Path) -> None:
    slurm, job, demos, bystander = cluster
    asleep = hibernate_job(slurm, job, "sleep", "--to", str(work_dir), "--json")
    assert asleep.returncode == 0, asleep.stderr + asleep.stdout
    reports = node_reports(asleep.stdout)
    assert [r["node"] for r in reports] == ["node0", "node1", "node2"]
    for report, demo in zip(reports, demos, strict=True):
        assert report["ok"] and report["decision"]["verdict"] == "commit"
        assert [p["pid"] for p in report["report"]["processes"]] == [demo.pid]
        assert report["selection"]["sources"][0]["via"] == "cgroup"
        snapshot = Path(report["report"]["processes"][0]["snapshot"])
        assert snapshot.is_relative_to(work_dir / report["node"])
    assert states(slurm, demos) == ["asleep"] * 3
    assert slurm.state(bystander) == "running"  # same node, another job
    assert not list((Path(slurm.job_env(job)["SLURM_SUBMIT_DIR"]) / ".hibernate").glob("job*")), (
        "barrier kept"
    )

    woken = hibernate_job(slurm, job, "wake", "--json")
    assert woken.returncode == 0, woken.stderr + woken.stdout
    assert all(r["ok"] for r in node_reports(woken.stdout))
    assert states(slurm, demos) == ["running"] * 3
    assert_serving(demos)


@pytest.mark.slow
def test_one_failing_node_leaves_every_node_awake(cluster, work_dir: Path) -> None:
    slurm, job, demos, _ = cluster
    demos[1].hold(6)  # node1's program is in a long step: its sleep times out after 1 s
    result = hibernate_job(slurm, job, "sleep", "--to", str(work_dir), "--json", "--", "--timeout", "1")
    assert result.returncode == ExitCode.TIMEOUT, result.stderr + result.stdout
    reports = node_reports(result.stdout)
    assert [r["ok"] for r in reports] == [False, False, False]
    assert {r["error"]["exit_code"] for r in reports} == {int(ExitCode.TIMEOUT)}  # every node says the same
    assert reports[1]["error"]["message"].startswith("node 1 (node1): process")
    for index in (0, 2):
        assert reports[index]["undo"]["operation"] == "wake"  # slept, then woke again
        assert "woken again" in reports[index]["error"]["message"]
    assert states(slurm, demos) == ["running"] * 3
    assert_serving(demos)
    assert "each node's result is in" in result.stderr


@pytest.mark.slow
def test_a_node_late_past_the_barrier_timeout_wakes_with_the_others(cluster, work_dir: Path) -> None:
    slurm, job, demos, _ = cluster
    demos[2].hold(8)  # node2's sleep waits for the step to end: it reports after the others gave up
    result = hibernate_job(slurm, job, "sleep", "--to", str(work_dir), "--barrier-timeout", "4", "--json")
    assert result.returncode == ExitCode.TIMEOUT, result.stderr + result.stdout
    reports = node_reports(result.stdout)
    assert re.search(r"node\(s\) [0-9, ]*\b2 of 3 did not report within 4s", reports[0]["decision"]["reason"])
    assert reports[2]["results"][2]["ok"]  # it did sleep, late
    assert all(r["undo"] is not None for r in reports)  # node2 too: it slept, saw the abort, woke
    assert states(slurm, demos) == ["running"] * 3
    assert_serving(demos)


@pytest.mark.slow
def test_a_node_that_dies_times_out_and_the_others_wake(cluster, work_dir: Path) -> None:
    slurm, job, demos, _ = cluster
    dying = broken_hibernate(slurm, 1, "kill -9 $$")
    result = hibernate_job(
        slurm, job, "sleep", "--to", str(work_dir), "--barrier-timeout", "5", env={"HIBERNATE": dying}
    )
    assert result.returncode == 128 + signal.SIGKILL, result.stderr  # srun: the highest task status
    assert re.search(r"node\(s\) [0-9, ]*\b1\b[0-9, ]* of 3 did not report within 5s", result.stderr)
    assert states(slurm, demos) == ["running"] * 3
    assert_serving(demos)


def test_the_script_refuses_to_run_outside_a_job(cluster, work_dir: Path) -> None:
    slurm, _, _, _ = cluster
    environment = {k: v for k, v in slurm.env.items() if not k.startswith("SLURM_")}
    result = slurm.run([HIBERNATE_JOB, "sleep", "--to", str(work_dir)], environment)
    assert result.returncode == 2 and "SLURM_JOB_ID is unset" in result.stderr


@pytest.mark.slow
def test_from_outside_the_job_it_attaches_with_jobid(cluster, work_dir: Path) -> None:
    slurm, job, demos, _ = cluster
    outside = {k: v for k, v in slurm.env.items() if not k.startswith("SLURM_")}
    command = [HIBERNATE_JOB, "sleep", "--job", str(job["job_id"]), "--to", str(work_dir), "-q"]
    asleep = slurm.run(command, {**outside, "HIBERNATE_BARRIER_DIR": str(slurm.scratch / "barriers")})
    assert asleep.returncode == 0, asleep.stderr
    assert states(slurm, demos) == ["asleep"] * 3
    woken = slurm.run([HIBERNATE_JOB, "wake", "--job", str(job["job_id"]), "-q"], outside)
    assert woken.returncode == 0, woken.stderr
    assert states(slurm, demos) == ["running"] * 3


def test_a_second_wake_agrees_that_everything_is_awake(cluster) -> None:
    slurm, job, _, _ = cluster
    result = hibernate_job(slurm, job, "wake", "--json")
    assert result.returncode == 0, result.stderr
    assert [r["results"][r["node_index"]]["detail"] for r in node_reports(result.stdout)] == [
        {"already_awake": True}
    ] * 3


@pytest.mark.slow
def test_without_overlap_the_step_would_wait_for_the_running_one(cluster) -> None:
    """The stand-in refuses a second step without --overlap, as real srun holds it back."""
    slurm, job, _, _ = cluster
    environment = slurm.job_env(job)
    running = slurm.run(
        ["sh", "-c", "srun -N1 sleep 2 & sleep 0.7; srun -N1 true; echo rc=$?; wait"], environment
    )
    assert "rc=1" in running.stdout and "pass --overlap" in running.stderr
    overlapping = slurm.run(
        ["sh", "-c", "srun -N1 sleep 1.5 & sleep 0.7; srun --overlap -N1 true; echo rc=$?"], environment
    )
    assert "rc=0" in overlapping.stdout


def broken_hibernate(slurm: Cluster, node_index: int, how: str) -> str:
    """A ``hibernate`` that fails on one node without a word to the barrier (``kill -9 $$`` or ``exit 3``)."""
    path = slurm.scratch / f"hibernate-{how.split()[0]}-on-node{node_index}"
    path.write_text(f'#!/bin/sh\n[ "$SLURM_NODEID" = {node_index} ] && {how}\nexec hibernate "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("site", [{"KillOnBadExit": 1}, {"WaitTime": 1}])
def test_a_strict_site_configuration_does_not_cut_the_agreement_short(cluster, work_dir: Path, site) -> None:
    """With KillOnBadExit=1 or a short WaitTime, srun would kill the nodes still waiting at the barrier
    (asleep) once node0 exits; the script's --kill-on-bad-exit=0 --wait=0 keep them to the end."""
    slurm, job, demos, _ = cluster
    saved = slurm.world.config
    slurm.world.configure(**site)
    try:
        result = hibernate_job(
            slurm, job, "sleep", "--to", str(work_dir), "--barrier-timeout", "4",
            env={"HIBERNATE": broken_hibernate(slurm, 0, "exit 3")},
        )  # fmt: skip
    finally:
        slurm.world.configure(**saved)
    assert result.returncode == ExitCode.TIMEOUT, result.stderr  # max(3, 10): the others timed out and woke
    assert "terminating" not in result.stderr
    assert states(slurm, demos) == ["running"] * 3


@pytest.mark.slow
@pytest.mark.parametrize("site", [{"KillOnBadExit": 1}, {"WaitTime": 1}])
def test_the_stand_in_applies_the_site_configuration(cluster, site) -> None:
    """Without the script's flags the stand-in srun does cut a step short (so the test above can fail)."""
    slurm, job, _, _ = cluster
    saved = slurm.world.config
    slurm.world.configure(**site)
    try:
        result = slurm.run(
            ["srun", "--overlap", "-N2", "sh", "-c", '[ "$SLURM_NODEID" = 0 ] && exit 3; sleep 20'],
            slurm.job_env(job),
            timeout=15,
        )
    finally:
        slurm.world.configure(**saved)
    assert result.returncode == 128 + signal.SIGKILL and "terminating" in result.stderr


def test_environment_of_a_node_step(cluster) -> None:
    """What srun gives every task, as srun(1) documents it (the node-step reads these)."""
    slurm, job, _, _ = cluster
    result = slurm.run(
        ["srun", "--overlap", "-N3", "--ntasks-per-node=1", "sh", "-c",
         'echo "$SLURM_NODEID $SLURMD_NODENAME $SLURM_STEP_NUM_NODES $SLURM_JOB_ID $SLURM_JOB_NUM_NODES"'],
        slurm.job_env(job),
    )  # fmt: skip
    assert sorted(result.stdout.split("\n")[:3]) == [f"{i} node{i} 3 {job['job_id']} 3" for i in range(3)], (
        result.stderr
    )
