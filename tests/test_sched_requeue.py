"""Requeued batch jobs resume from their snapshot: requeue-resume.sbatch on a real Slurm.

The shipped script runs its program with HIBERNATE_ON_SIGNAL=TERM,
HIBERNATE_EXIT_AFTER_SLEEP=1 and, when the job runs again, HIBERNATE_ADOPT
(test_agent_exit_after_sleep.py tests those without Slurm). On the private
cluster (tests/slurm_cluster.py) a job is preempted in the ``requeue``
partition (PreemptMode=REQUEUE), requeued with ``scontrol requeue``, and warned
with USR1 (``--signal=B:USR1``, sent here with ``scancel --batch``, the same
delivery), on which it requeues itself. The program (tests/requeue_program.py)
tracks its step counter with its model and optimizer: every run says the step
it resumed at, so an adoption that did nothing cannot pass for one, and its
final digest must be an uninterrupted run's.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import pytest

from tests.conftest import REPO, wait_until
from tests.requeue_program import FAULT_ENV, command, results
from tests.requeue_program import uninterrupted as run_uninterrupted
from tests.slurm_cluster import SCRIPTS, SlurmCluster

SCRIPT = SCRIPTS / "requeue-resume.sbatch"
STEPS = 6
# What a task of a job of several does before its program (docs/schedulers.md): its own directory.
RANK_DIRECTORIES = (
    'export HIBERNATE_DIR="$HIBERNATE_DIR/rank-$SLURM_PROCID"; '
    '[[ -z ${HIBERNATE_ADOPT:-} ]] || export HIBERNATE_ADOPT="$HIBERNATE_DIR";'
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest of the program's model and optimizer after STEPS steps in one go."""
    runtime = tmp_path_factory.mktemp("run")
    runtime.chmod(0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HIBERNATE_"))}
    return run_uninterrupted(
        STEPS, {**env, "PYTHONPATH": str(REPO), "HIBERNATE_RUNTIME_DIR": str(runtime)}, str(REPO)
    )


def digest_in(output: str) -> str:
    (done,) = results(output)
    assert done["steps"] == STEPS, output
    return str(done["digest"])


# -- under a real Slurm (tests/slurm_cluster.py) ------------------------------------------------------


class RequeuedJob:
    """requeue-resume.sbatch running the program in the ``requeue`` partition: on the first node, or
    on ``nodes`` nodes as a step (srun), each rank in a directory of its own."""

    def __init__(self, slurm: SlurmCluster, name: str, *waits: str, fault: str = "", nodes: int = 1) -> None:
        self.slurm = slurm
        self.output = slurm.scratch / f"{name}.out"
        env = {k: v for k, v in slurm.outside_env().items() if not k.startswith("HIBERNATE_")}
        env["HIBERNATE_RUNTIME_DIR"] = str(slurm.runtime_dir(slurm.nodes[0]))  # one host: one will do
        if fault:
            env[FAULT_ENV] = fault
        program = command(STEPS, *waits)
        if nodes == 1:
            where = [f"--nodelist={slurm.nodes[0]}"]
        else:  # each rank in a directory of its own, as docs/schedulers.md shows
            where = [f"--nodes={nodes}", "--ntasks-per-node=1", f"--ntasks={nodes}"]
            program = ["srun", "bash", "-c", f"{RANK_DIRECTORIES} exec {' '.join(program)}"]
        self.id = slurm.submit(
            "--partition=requeue", *where, "--cpus-per-task=2", "--gpus-per-node=0",
            f"--output={self.output}", str(SCRIPT), *program, env=env,
        )  # fmt: skip
        self.snapshots = slurm.scratch / ".hibernate" / f"requeue-{self.id}"

    def text(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def wait_for(self, words: str, count: int = 1) -> None:
        """Until the job's output holds ``words`` ``count`` times (failing at once if the job ends)."""

        def there() -> bool:
            if self.text().count(words) >= count:
                return True
            state = self.slurm.state(self.id)
            assert state in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"), (
                f"job is {state}:\n{self.text()}"
            )
            return False

        wait_until(there, 180, f"{words!r} in the job's output", 0.1, detail=self.text)

    def requeued(self, restarts: int, *, release: bool = True) -> None:
        """Wait until Slurm holds the job requeued for the ``restarts``-th time; then let it start."""
        info = self.slurm.wait_state(self.id, "PENDING", "COMPLETED", "FAILED", "CANCELLED")
        assert info["JobState"] == "PENDING" and info["Restarts"] == str(restarts), (info, self.text())
        if release:
            self.release()

    def release(self) -> None:
        """Let the requeued job start now rather than after the credential lifetime (AuthInfo's
        cred_expire, 120 s by default), but in a later second than its kill: a node takes a
        credential issued in the second its job was killed for a revoked one (slurmd compares
        seconds) and the job fails to launch ("Job credential revoked", seen here). The requeue
        (SubmitTime) comes after the kill, so the next second after it will do."""
        requeued = time.mktime(time.strptime(self.slurm.job(self.id)["SubmitTime"], "%Y-%m-%dT%H:%M:%S"))
        wait_until(lambda: time.time() >= requeued + 1, 5, "the second after the requeue")
        self.slurm.check("scontrol", "update", f"JobId={self.id}", "StartTime=now")

    def runs(self) -> list[str]:
        """The output of each run of the job, in order (the script's first line starts each)."""
        return re.split(r"(?m)^(?=requeue-resume: job \d+, run \d+:)", self.text())[1:]

    def cancel(self) -> None:
        if self.slurm.state(self.id) not in ("COMPLETED", "FAILED", "CANCELLED", ""):
            self.slurm.cancel(self.id)


@pytest.fixture
def jobs(slurm_cluster: SlurmCluster) -> Iterator[list[RequeuedJob]]:
    started: list[RequeuedJob] = []
    try:
        yield started
    finally:
        for job in started:
            job.cancel()


def assert_finished(job: RequeuedJob, resumed_at: list[int], uninterrupted: str) -> None:
    info = job.slurm.wait_state(job.id, "COMPLETED", "FAILED", "CANCELLED")
    runs = job.runs()
    assert info["JobState"] == "COMPLETED", job.text()
    assert len(runs) == len(resumed_at) + 1, job.text()
    assert "started at step 0" in runs[0]
    for run, step in zip(runs[1:], resumed_at, strict=True):
        assert f"resumed at step {step}\n" in run, job.text()
        assert f"hibernate: adopted 1 tensor storage(s), 8 bytes (8 read), from {job.snapshots}/" in run
    assert digest_in(runs[-1]) == uninterrupted
    assert "the program has finished" in runs[-1]
    assert not job.snapshots.exists()


@pytest.mark.slow
def test_a_job_preempted_by_a_higher_partition_resumes_from_its_snapshot(
    slurm_cluster: SlurmCluster, jobs: list[RequeuedJob], uninterrupted: str
) -> None:
    """PreemptMode=REQUEUE: a job of the higher partition needs the node's CPUs; Slurm kills the job
    (SIGTERM to its batch shell, SIGKILL KillWait later) and requeues it."""
    slurm = slurm_cluster
    job = RequeuedJob(slurm, "preempted", "0:3")
    jobs.append(job)
    job.wait_for("waiting at step 3")
    preemptor = slurm.submit(
        "--partition=high", f"--nodelist={slurm.nodes[0]}", "--cpus-per-task=1", "--gpus-per-node=0",
        "--output=/dev/null", "--wrap=true",
    )  # fmt: skip
    try:
        job.requeued(1)
        assert "DUE TO PREEMPTION" in job.text()
        assert "exiting with status 143" in job.runs()[0]
        slurm.wait_state(preemptor, "COMPLETED")
    finally:
        if slurm.state(preemptor) not in ("COMPLETED", "FAILED", "CANCELLED", ""):
            slurm.cancel(preemptor)
    assert_finished(job, [3], uninterrupted)


@pytest.mark.slow
def test_a_job_requeued_by_scontrol_and_then_by_its_time_limit_warning_resumes_each_time(
    slurm_cluster: SlurmCluster, jobs: list[RequeuedJob], uninterrupted: str
) -> None:
    """``scontrol requeue`` from outside, then the warning signal (``--signal=B:USR1``, here through
    ``scancel --batch``, the same delivery): the script has the program sleep and requeues the job."""
    slurm = slurm_cluster
    job = RequeuedJob(slurm, "requeued", "0:2", "1:4")
    jobs.append(job)
    job.wait_for("waiting at step 2")
    slurm.check("scontrol", "requeue", str(job.id))
    job.requeued(1)
    job.wait_for("waiting at step 4")
    slurm.check("scancel", "--batch", "--signal=USR1", str(job.id))
    job.requeued(2)
    assert f"requeueing job {job.id} before its time limit" in job.runs()[1]
    assert_finished(job, [2, 4], uninterrupted)


@pytest.mark.slow
def test_a_sleep_cut_short_by_slurms_sigkill_is_never_adopted(
    slurm_cluster: SlurmCluster, jobs: list[RequeuedJob], uninterrupted: str
) -> None:
    """The second run's sleep hangs with its manifest written, before the rename that publishes it,
    until Slurm's SIGKILL (KillWait after the SIGTERM): the third run must not take that half."""
    slurm = slurm_cluster
    job = RequeuedJob(slurm, "cut-short", "0:2", "1:4", fault="1:store.publish:hang")
    jobs.append(job)
    job.wait_for("waiting at step 2")
    slurm.check("scontrol", "requeue", str(job.id))
    job.requeued(1)
    job.wait_for("waiting at step 4")
    slurm.check("scontrol", "requeue", str(job.id))
    job.requeued(2, release=False)
    assert list(job.snapshots.glob("*/.tmp-snap-*/manifest.json")), "the second run's sleep was not cut short"
    assert "sleep on signal" not in job.runs()[1]  # it never ended: SIGKILL came first
    job.release()
    info = slurm.wait_state(job.id, "COMPLETED", "FAILED", "CANCELLED")
    last = job.runs()[-1]
    assert info["JobState"] == "COMPLETED", job.text()
    assert "resumed at step 4" not in last  # never the half snapshot
    assert digest_in(last) == uninterrupted
    assert "resumed at step 2" in last, job.text()  # the first run's complete snapshot, adopted
    assert not job.snapshots.exists()


@pytest.mark.slow
def test_a_job_of_two_nodes_resumes_each_rank_from_its_own_snapshot(
    slurm_cluster: SlurmCluster, jobs: list[RequeuedJob], uninterrupted: str
) -> None:
    """An srun program: Slurm sends SIGTERM to its tasks itself at the requeue (the script must not
    pass it to srun, which would kill them at once), and each rank adopts its own directory."""
    slurm = slurm_cluster
    job = RequeuedJob(slurm, "two-nodes", "0:2", nodes=2)
    jobs.append(job)
    job.wait_for("waiting at step 2", count=2)
    slurm.check("scontrol", "requeue", str(job.id))
    job.requeued(1)
    info = slurm.wait_state(job.id, "COMPLETED", "FAILED", "CANCELLED")
    assert info["JobState"] == "COMPLETED", job.text()
    first, second = job.runs()
    assert first.count("hibernate: sleep on signal: done") == 2, job.text()
    assert second.count("resumed at step 2\n") == 2, job.text()
    for rank in (0, 1):
        assert f"from {job.snapshots}/rank-{rank}/proc-" in second, job.text()
    assert [done["digest"] for done in results(second)] == [uninterrupted] * 2, job.text()
    assert not job.snapshots.exists()
