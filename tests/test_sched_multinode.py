"""scripts/slurm/hibernate-job on a real two-node Slurm cluster: all asleep and back, or all awake.

The job's demos run as a job step, one task per node (tests/slurm_cluster.py);
hibernate-job's `srun --overlap` starts one `hibernate node-step` per node,
each in the job's cgroup of its node, so `--job` on a node finds that node's
demo only, although both nodes' slurmd share this host.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import wait_until
from tests.slurm_cluster import SCRIPTS, JobDemo, SlurmCluster, agent_state, demo_job

HIBERNATE_JOB = str(SCRIPTS / "hibernate-job")


@pytest.fixture(scope="module")
def cluster(slurm_cluster: SlurmCluster) -> Iterator[tuple[SlurmCluster, int, list[JobDemo], JobDemo]]:
    """A job on both nodes with a demo each, and a demo of another job on the first node.

    Shared by the tests of this module (starting demos is most of their time);
    each test leaves every demo awake.
    """
    nodes = slurm_cluster.nodes
    job_id, demos = demo_job(slurm_cluster, "train", nodes)
    other_id, (bystander,) = demo_job(slurm_cluster, "other", nodes[:1])
    try:
        yield slurm_cluster, job_id, demos, bystander
    finally:
        slurm_cluster.cancel(job_id)
        slurm_cluster.cancel(other_id)


def inside(slurm: SlurmCluster, job_id: int, *command: str) -> Any:
    """Run ``command`` in a step of the job on its first node, as a shell opened in the job would.

    Its output goes to files, read back after: passed on by this step's srun, lines longer than
    1024 bytes would come back cut in pieces.
    """
    step = [
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        "--nodes=1",
        "--ntasks=1",
        f"--nodelist={slurm.nodes[0]}",
    ]
    out, err = (slurm.scratch / f"inside.{stream}" for stream in ("out", "err"))
    redirected = ["sh", "-c", f'exec "$@" >{out} 2>{err}', "sh", *command]
    result = slurm.run([*step, *redirected])
    result.stdout, result.stderr = out.read_text(), err.read_text() + result.stderr
    return result


def hibernate_job(slurm: SlurmCluster, job_id: int, *args: str, env: dict[str, str] | None = None) -> Any:
    """hibernate-job in the job, with ``env`` set for it alone (not for the step it runs in)."""
    settings = [f"{name}={value}" for name, value in (env or {}).items()]
    return inside(slurm, job_id, "env", *settings, HIBERNATE_JOB, *args)


def node_reports(stdout: str) -> list[dict[str, Any]]:
    """The JSON documents the nodes printed, one line each, whole however long (hibernate-job has each
    node write its own to a file: srun would forward a line of over 1024 bytes in pieces)."""
    documents = [json.loads(line) for line in stdout.splitlines() if line.strip()]
    return sorted(documents, key=lambda d: d["node_index"])


def states(slurm: SlurmCluster, demos: list[JobDemo]) -> list[str]:
    return [agent_state(slurm, d) for d in demos]


def assert_serving(demos: list[JobDemo]) -> None:
    for demo in demos:
        assert demo.infer() == demo.reference, demo.node


def test_sinfo_lists_two_nodes(slurm_cluster: SlurmCluster) -> None:
    listed = slurm_cluster.check("sinfo", "-h", "-o", "%n").split()
    assert sorted(listed) == sorted(slurm_cluster.nodes) and len(listed) == 2


@pytest.mark.slow
def test_every_node_sleeps_and_wakes_as_one(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo], work_dir: Path
) -> None:
    slurm, job_id, demos, bystander = cluster
    asleep = hibernate_job(slurm, job_id, "sleep", "--to", str(work_dir), "--json")
    assert asleep.returncode == 0, asleep.stderr + asleep.stdout
    reports = node_reports(asleep.stdout)
    assert [r["node"] for r in reports] == slurm.nodes
    for report, demo in zip(reports, demos, strict=True):
        assert report["ok"] and report["decision"]["verdict"] == "commit"
        assert [p["pid"] for p in report["report"]["processes"]] == [demo.pid]
        source = report["selection"]["sources"][0]
        if slurm.proctrack == "proctrack/cgroup":
            assert source["cgroups"] == [str(slurm.job_cgroup(demo.node, job_id))]  # its own node's only
        else:
            assert source["via"] == "environment"
        snapshot = Path(report["report"]["processes"][0]["snapshot"])
        assert snapshot.is_relative_to(work_dir / report["node"])
    assert states(slurm, demos) == ["asleep"] * 2
    assert agent_state(slurm, bystander) == "running"  # same node, another job
    assert not list((slurm.scratch / ".hibernate").glob(f"job{job_id}-*")), "barrier kept"

    woken = hibernate_job(slurm, job_id, "wake", "--json")
    assert woken.returncode == 0, woken.stderr + woken.stdout
    assert all(r["ok"] for r in node_reports(woken.stdout))
    assert states(slurm, demos) == ["running"] * 2
    assert_serving(demos)


@pytest.mark.slow
def test_one_failing_node_leaves_every_node_awake(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo], work_dir: Path
) -> None:
    slurm, job_id, demos, _ = cluster
    # node1's program is in a long step (longer than a loaded machine takes to start the node steps):
    # its sleep times out after 1 s
    demos[1].hold(60)
    try:
        result = hibernate_job(
            slurm, job_id, "sleep", "--to", str(work_dir), "--json", "--", "--timeout", "1"
        )
    finally:
        demos[1].release()  # the demos are shared: the next test finds no step running
    assert result.returncode == ExitCode.TIMEOUT, result.stderr + result.stdout
    reports = node_reports(result.stdout)
    assert [r["ok"] for r in reports] == [False, False]
    assert {r["error"]["exit_code"] for r in reports} == {int(ExitCode.TIMEOUT)}  # every node says the same
    assert reports[1]["error"]["message"].startswith(f"node 1 ({slurm.nodes[1]}): process")
    assert reports[0]["undo"]["operation"] == "wake"  # slept, then woke again
    assert "woken again" in reports[0]["error"]["message"]
    assert states(slurm, demos) == ["running"] * 2
    assert_serving(demos)
    assert "each node's result is in" in result.stderr


@pytest.mark.slow
def test_a_node_late_past_the_barrier_timeout_wakes_with_the_others(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo], work_dir: Path
) -> None:
    slurm, job_id, demos, _ = cluster
    barriers = slurm.scratch / ".hibernate"  # hibernate-job's default: in the job's submit directory
    earlier = set(barriers.glob("*/decision"))
    # node1's sleep waits for the step to end: it reports after the others gave up (at 4 s)
    demos[1].hold(120)
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            hibernate_job, slurm, job_id, "sleep", "--to", str(work_dir), "--barrier-timeout", "4", "--json"
        )
        wait_until(lambda: set(barriers.glob("*/decision")) - earlier, 60, "the others to give up")
        demos[1].release()
        result = running.result(timeout=180)
    assert result.returncode == ExitCode.TIMEOUT, result.stderr + result.stdout
    reports = node_reports(result.stdout)
    assert re.search(r"node\(s\) [0-9, ]*\b1 of 2 did not report within 4s", reports[0]["decision"]["reason"])
    assert reports[1]["results"][1]["ok"]  # it did sleep, late
    assert all(r["undo"] is not None for r in reports)  # node1 too: it slept, saw the abort, woke
    assert states(slurm, demos) == ["running"] * 2
    assert_serving(demos)


def broken_hibernate(slurm: SlurmCluster, node_index: int, how: str) -> str:
    """A ``hibernate`` that fails on one node without a word to the barrier (``kill -9 $$`` or ``exit 3``)."""
    path = slurm.scratch / f"hibernate-{how.split()[0]}-on-node{node_index}"
    path.write_text(f'#!/bin/sh\n[ "$SLURM_NODEID" = {node_index} ] && {how}\nexec hibernate "$@"\n')
    path.chmod(0o755)
    return str(path)


@pytest.mark.slow
def test_a_node_that_dies_times_out_and_the_others_wake(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo], work_dir: Path
) -> None:
    slurm, job_id, demos, _ = cluster
    dying = broken_hibernate(slurm, 1, "kill -9 $$")
    result = hibernate_job(
        slurm, job_id, "sleep", "--to", str(work_dir), "--barrier-timeout", "5", env={"HIBERNATE": dying}
    )
    assert result.returncode == 128 + signal.SIGKILL, result.stderr  # srun: the highest task status
    assert re.search(r"node\(s\) [0-9, ]*\b1\b[0-9, ]* of 2 did not report within 5s", result.stderr)
    assert states(slurm, demos) == ["running"] * 2
    assert_serving(demos)


def test_the_script_refuses_to_run_outside_a_job(slurm_cluster: SlurmCluster, work_dir: Path) -> None:
    result = slurm_cluster.run([HIBERNATE_JOB, "sleep", "--to", str(work_dir)])
    assert result.returncode == 2 and "SLURM_JOB_ID is unset" in result.stderr


@pytest.mark.slow
def test_from_outside_the_job_it_attaches_with_jobid(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo], work_dir: Path
) -> None:
    slurm, job_id, demos, _ = cluster
    outside = {**slurm.outside_env(), "HIBERNATE_BARRIER_DIR": str(slurm.scratch / "barriers")}
    command = [HIBERNATE_JOB, "sleep", "--job", str(job_id), "--to", str(work_dir), "-q"]
    asleep = slurm.run(command, outside)
    assert asleep.returncode == 0, asleep.stderr
    assert states(slurm, demos) == ["asleep"] * 2
    woken = slurm.run([HIBERNATE_JOB, "wake", "--job", str(job_id), "-q"], outside)
    assert woken.returncode == 0, woken.stderr
    assert states(slurm, demos) == ["running"] * 2
    assert_serving(demos)


def test_a_second_wake_agrees_that_everything_is_awake(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo],
) -> None:
    slurm, job_id, _, _ = cluster
    result = hibernate_job(slurm, job_id, "wake", "--json")
    assert result.returncode == 0, result.stderr
    assert [r["results"][r["node_index"]]["detail"] for r in node_reports(result.stdout)] == [
        {"already_awake": True}
    ] * 2


@pytest.mark.slow
def test_without_overlap_a_step_waits_for_the_running_one(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo],
) -> None:
    """The demos' step holds the job's CPUs: a second step waits for them unless it passes --overlap."""
    slurm, job_id, _, _ = cluster
    step = ["srun", f"--jobid={job_id}", "--nodes=1", "--ntasks=1", "--immediate=3", "true"]
    waiting = slurm.run(step)
    assert waiting.returncode != 0, waiting.stderr
    assert "Unable to create step" in waiting.stderr or "temporarily disabled" in waiting.stderr, (
        waiting.stderr
    )
    overlapping = slurm.run([*step[:1], "--overlap", *step[1:]])
    assert overlapping.returncode == 0, overlapping.stderr


@pytest.mark.slow
@pytest.mark.parametrize("site", [{"SLURM_KILL_BAD_EXIT": "1"}, {"SLURM_WAIT": "1"}])
def test_a_strict_site_configuration_does_not_cut_the_agreement_short(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo], work_dir: Path, site: dict[str, str]
) -> None:
    """With KillOnBadExit or a short WaitTime (here through srun's environment, which a site's profile
    may set), srun would end the nodes still waiting at the barrier (asleep) once node0 exits; the
    script's --kill-on-bad-exit=0 --wait=0 keep them to the end."""
    slurm, job_id, demos, _ = cluster
    result = hibernate_job(
        slurm, job_id, "sleep", "--to", str(work_dir), "--barrier-timeout", "4",
        env={"HIBERNATE": broken_hibernate(slurm, 0, "exit 3"), **site},
    )  # fmt: skip
    assert result.returncode == ExitCode.TIMEOUT, result.stderr  # max(3, 10): the others timed out and woke
    assert "Terminating" not in result.stderr and "aborted" not in result.stderr
    assert states(slurm, demos) == ["running"] * 2
    assert_serving(demos)


@pytest.mark.slow
@pytest.mark.parametrize(
    "site, status",
    [({"SLURM_KILL_BAD_EXIT": "1"}, 128 + signal.SIGTERM), ({"SLURM_WAIT": "1"}, 128 + signal.SIGKILL)],
)
def test_srun_applies_the_site_configuration(
    cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo], site: dict[str, str], status: int
) -> None:
    """Without the script's flags srun does cut a step short (so the test above can fail): with
    KillOnBadExit it sends the other tasks SIGTERM, after WaitTime SIGKILL."""
    slurm, job_id, _, _ = cluster
    command = ["srun", f"--jobid={job_id}", "--overlap", "-N2", "-n2", "--ntasks-per-node=1"]
    # The other task sleeps far longer than the step may take when cut short, even on a loaded
    # machine (a 50-second limit ran out once, in a full run with the cores busy).
    result = slurm.run(
        [*command, "sh", "-c", '[ "$SLURM_NODEID" = 0 ] && exit 3; sleep 900'],
        {**slurm.outside_env(), **site},
        timeout=240,
    )
    assert result.returncode == status and "Terminating" in result.stderr, result.stderr


def test_environment_of_a_node_step(cluster: tuple[SlurmCluster, int, list[JobDemo], JobDemo]) -> None:
    """What srun gives every task (the node-step reads these), and what a step attached from outside
    the job lacks: SLURM_JOB_NUM_NODES (hibernate-job asks scontrol then), and SLURM_JOB_NODELIST
    names the step's nodes, not the job's (hibernate-job unsets it before its own srun)."""
    slurm, job_id, _, _ = cluster
    result = slurm.run(
        ["srun", f"--jobid={job_id}", "--overlap", "-N1", f"--nodelist={slurm.nodes[1]}", "sh", "-c",
         'echo "$SLURM_NODEID $SLURMD_NODENAME $SLURM_STEP_NUM_NODES $SLURM_JOB_ID'
         ' ${SLURM_JOB_NUM_NODES-unset} $SLURM_JOB_NODELIST"'],
    )  # fmt: skip
    assert result.stdout.split("\n")[0] == f"0 {slurm.nodes[1]} 1 {job_id} unset {slurm.nodes[1]}", (
        result.stderr
    )
    both = slurm.run(
        ["srun", f"--jobid={job_id}", "--overlap", "-N2", "--ntasks-per-node=1", "sh", "-c",
         'echo "$SLURM_NODEID $SLURMD_NODENAME $SLURM_STEP_NUM_NODES $SLURM_JOB_ID"'],
    )  # fmt: skip
    assert sorted(both.stdout.split("\n")[:2]) == [f"{i} {slurm.nodes[i]} 2 {job_id}" for i in range(2)], (
        both.stderr
    )
