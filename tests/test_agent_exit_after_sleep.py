"""A program that sleeps on SIGTERM and then exits (HIBERNATE_EXIT_AFTER_SLEEP), and its next run.

With HIBERNATE_ON_SIGNAL=TERM and HIBERNATE_EXIT_AFTER_SLEEP=1 a process
writes its snapshot on SIGTERM and exits as the signal would have ended it,
done or failed; run again under HIBERNATE_ADOPT, a new process goes on from
the snapshot. This is what requeue-resume.sbatch runs (its Slurm tests are in
test_sched_requeue.py); here without Slurm, each run started as the script
starts it. The program (tests/requeue_program.py) tracks its step counter with
its model and optimizer, so each run says the step it resumed at, and its
final digest must be an uninterrupted run's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hibernate.agent import signals as agent_signals
from hibernate.errors import StorageError, UsageError
from tests.conftest import REPO, wait_until
from tests.requeue_program import FAULT_ENV, command, results
from tests.requeue_program import uninterrupted as run_uninterrupted

STEPS = 6


# -- the agent's side: exit after a sleep on the signal ------------------------------------------


class FakeAgent:
    """What signals.install asks of an agent: a sleep that does what the test says."""

    default_dir = None

    def __init__(self, outcome: BaseException | None = None) -> None:
        self.outcome = outcome
        self.slept = threading.Event()
        self.sleeps = 0

    def sleep_here(self, directory: Path, timeout: float, args: dict[str, Any]) -> dict[str, Any]:
        self.sleeps += 1
        self.slept.set()
        if self.outcome is not None:
            raise self.outcome
        return {}


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The statuses the signal thread would have ended this process with; SIGUSR1's handler restored."""
    statuses: list[int] = []
    monkeypatch.setattr(agent_signals.os, "_exit", statuses.append)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        yield statuses
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize(
    "outcome",
    [None, StorageError("the disk is full"), RuntimeError("a bug")],
    ids=["slept", "sleep-failed", "unexpected-error"],
)
def test_after_a_sleep_on_the_signal_the_process_exits_as_the_signal_would_have_ended_it(
    exits: list[int], work_dir: Path, capfd: pytest.CaptureFixture[str], outcome: BaseException | None
) -> None:
    """Done or failed, the job must end: Slurm requeues it, and a failed sleep left the last snapshot."""
    agent = FakeAgent(outcome)
    agent_signals.install(agent, "USR1", None, work_dir, exit_after_sleep=True)  # type: ignore[arg-type]
    os.kill(os.getpid(), signal.SIGUSR1)
    wait_until(lambda: exits, 30, "the signal thread to exit")
    assert agent.slept.is_set()
    assert exits == [128 + signal.SIGUSR1]
    err = capfd.readouterr().err
    assert "exiting with status 138 (HIBERNATE_EXIT_AFTER_SLEEP)" in err
    if outcome is not None:
        assert "sleep on signal failed" in err and str(outcome) in err


def test_without_exit_after_sleep_the_process_stays_asleep(exits: list[int], work_dir: Path) -> None:
    agent = FakeAgent()
    agent_signals.install(agent, "USR1", None, work_dir)  # type: ignore[arg-type]
    os.kill(os.getpid(), signal.SIGUSR1)
    wait_until(agent.slept.is_set, 30, "the sleep on the signal")
    # One thread runs the work in order: once the second sleep has started, the first has ended.
    os.kill(os.getpid(), signal.SIGUSR1)
    wait_until(lambda: agent.sleeps == 2, 30, "the second sleep")
    assert exits == []


def test_exit_after_sleep_is_a_yes_or_no(work_dir: Path) -> None:
    environ = {
        "HIBERNATE_ON_SIGNAL": "USR1",
        "HIBERNATE_DIR": str(work_dir),
        "HIBERNATE_EXIT_AFTER_SLEEP": "soon",
    }
    with pytest.raises(UsageError, match="HIBERNATE_EXIT_AFTER_SLEEP='soon' is not a yes/no value"):
        agent_signals.install_from_environment(FakeAgent(), environ)  # type: ignore[arg-type]


def test_track_refuses_exit_after_sleep_without_a_signal() -> None:
    import hibernate

    with pytest.raises(UsageError, match="exit_after_sleep=True needs on_signal"):
        hibernate.track([], exit_after_sleep=True)


# -- the program, run as a job script runs it, without Slurm -------------------------------------------


def clean_environment() -> dict[str, str]:
    """This environment without Slurm's job variables and hibernate's own settings."""
    return {
        k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HIBERNATE_")) and k != FAULT_ENV
    } | {"PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The digest of the program's model and optimizer after STEPS steps in one go."""
    runtime = tmp_path_factory.mktemp("run")
    runtime.chmod(0o700)
    return run_uninterrupted(STEPS, {**clean_environment(), "HIBERNATE_RUNTIME_DIR": str(runtime)}, str(REPO))


def digest_in(output: str) -> str:
    (done,) = results(output)
    assert done["steps"] == STEPS, output
    return str(done["digest"])


class LocalRun:
    """One run of the program as requeue-resume.sbatch starts it (its run number, its snapshots)."""

    def __init__(self, snapshots: Path, run: int, *waits: str, fault: str = "") -> None:
        env = {
            **clean_environment(),
            "HIBERNATE_RUNTIME_DIR": os.environ["HIBERNATE_RUNTIME_DIR"],
            "HIBERNATE_ON_SIGNAL": "TERM",
            "HIBERNATE_DIR": str(snapshots),
            "HIBERNATE_EXIT_AFTER_SLEEP": "1",
            "SLURM_RESTART_COUNT": str(run),
        }
        if run > 0:
            env["HIBERNATE_ADOPT"] = str(snapshots)
        if fault:
            env[FAULT_ENV] = f"{run}:{fault}"
        self.output = snapshots.parent / f"run-{run}.out"
        with open(self.output, "w") as out:
            self.process = subprocess.Popen(
                command(STEPS, *waits), cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def text(self) -> str:
        return self.output.read_text()

    def wait_for(self, words: str) -> None:
        wait_until(lambda: words in self.text(), 120, words, 0.05, process=self.process, detail=self.text)

    def finish(self) -> int:
        return self.process.wait(timeout=120)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def local_runs(work_dir: Path, runtime_dir: Path) -> Iterator[list[LocalRun]]:
    started: list[LocalRun] = []
    try:
        yield started
    finally:
        for run in started:
            run.close()


def published(snapshots: Path) -> list[Path]:
    return sorted(snapshots.glob("*/snap-*/manifest.json"))


def terminated_at_step_2(snapshots: Path, local_runs: list[LocalRun]) -> None:
    """A first run, sent SIGTERM at step 2: it ends as the signal would end it, its snapshot written."""
    first = LocalRun(snapshots, 0, "0:2")
    local_runs.append(first)
    first.wait_for("waiting at step 2")
    first.process.send_signal(signal.SIGTERM)
    assert first.finish() == 128 + signal.SIGTERM, first.text()
    assert "sleep on signal: done" in first.text()
    assert len(published(snapshots)) == 1


@pytest.mark.slow
def test_term_writes_the_snapshot_and_ends_and_the_next_run_goes_on_from_it(
    work_dir: Path, local_runs: list[LocalRun], uninterrupted: str
) -> None:
    snapshots = work_dir / "snapshots"
    terminated_at_step_2(snapshots, local_runs)

    second = LocalRun(snapshots, 1, "1:4", fault="store.publish:fail")
    local_runs.append(second)
    second.wait_for("waiting at step 4")
    assert "resumed at step 2" in second.text()
    second.process.send_signal(signal.SIGTERM)  # its sleep fails: it ends all the same
    assert second.finish() == 128 + signal.SIGTERM, second.text()
    assert "sleep on signal failed" in second.text()
    assert len(published(snapshots)) == 1  # the first run's, still the newest complete one

    third = LocalRun(snapshots, 2)
    local_runs.append(third)
    assert third.finish() == 0, third.text()
    assert "resumed at step 2" in third.text()
    assert digest_in(third.text()) == uninterrupted


@pytest.mark.slow
def test_a_sleep_cut_short_by_sigkill_leaves_the_previous_snapshot_to_adopt(
    work_dir: Path, local_runs: list[LocalRun], uninterrupted: str
) -> None:
    snapshots = work_dir / "snapshots"
    terminated_at_step_2(snapshots, local_runs)

    second = LocalRun(snapshots, 1, "1:4", fault="store.publish:kill")  # killed, its manifest written
    local_runs.append(second)
    second.wait_for("waiting at step 4")
    second.process.send_signal(signal.SIGTERM)
    assert second.finish() == -signal.SIGKILL
    assert list(snapshots.glob("*/.tmp-snap-*/manifest.json"))  # the half snapshot is there
    assert len(published(snapshots)) == 1

    third = LocalRun(snapshots, 2)
    local_runs.append(third)
    assert third.finish() == 0, third.text()
    assert "resumed at step 4" not in third.text()  # never the half one
    assert digest_in(third.text()) == uninterrupted
    assert "resumed at step 2" in third.text(), third.text()
