"""Hibernating on a scheduler's signal: the `hibernate run` wrapper and the agent's own option."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.agent.triggers import parse_signal
from hibernate.errors import ExitCode, UsageError
from tests.conftest import REPO, wait_until
from tests.slurm_cluster import JobDemo, SlurmCluster, agent_state, ready_demos


def wait_for_state(cli: Callable[..., Any], pid: int, state: str, timeout: float = 60) -> None:
    def reached() -> bool:
        result = cli("status", str(pid), "--json")
        return result.returncode == 0 and result.json()["agents"][0]["state"] == state

    wait_until(reached, timeout, f"process {pid} to become {state}", 0.2)


def signal_pending(pid: int, sig: int) -> bool:
    """Whether ``sig``, sent to process ``pid``, is still waiting to be delivered (/proc/PID/status)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    pending = 0
    for line in status.splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")):
            pending |= int(line.split()[1], 16)
    return bool(pending >> (sig - 1) & 1)


@pytest.mark.slow
def test_run_hibernates_on_usr1_and_wakes_on_hibernate_wake(
    cli: Callable[..., Any], work_dir: Path, runtime_dir: Path
) -> None:
    from hibernate.demo import request

    control, ready = work_dir / "demo.sock", work_dir / "ready.json"
    wrapper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hibernate",
            "run",
            "--on-signal",
            "USR1",
            "--to",
            str(work_dir / "snap"),
            "--",
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "hibernate.demo",
            "serve",
            "--size-mb",
            "16",
            "--control",
            str(control),
            "--ready-file",
            str(ready),
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(ready.exists, 120, "the wrapped demo to become ready", 0.1, process=wrapper)
        child = json.loads(ready.read_text())["pid"]
        reference = request(str(control), "infer")["digest"]

        wrapper.send_signal(signal.SIGUSR1)
        wait_for_state(cli, child, "asleep")
        asleep = cli("status", str(child), "--json").json()["agents"][0]
        assert asleep["snapshot"]["path"].startswith(str(work_dir / "snap"))

        os.kill(child, signal.SIGUSR1)  # sent to every process of the step: must not kill the child
        wait_until(lambda: not signal_pending(child, signal.SIGUSR1), 30, "the child to take its SIGUSR1")
        assert cli("wake", str(child), "-q").returncode == 0
        assert request(str(control), "infer")["digest"] == reference

        request(str(control), "quit")
        assert wrapper.wait(timeout=60) == 0
    finally:
        if wrapper.poll() is None:
            wrapper.kill()
    log = wrapper.stderr.read() if wrapper.stderr else ""
    assert f"asleep: pid {child}" in log


def test_run_passes_on_the_childs_exit_status(cli: Callable[..., Any]) -> None:
    result = cli("run", "--to", "/tmp/unused", "--", sys.executable, "-c", "raise SystemExit(7)")
    assert result.returncode == 7


def test_run_without_a_command_is_a_usage_error(cli: Callable[..., Any]) -> None:
    assert cli("run", "--to", "/tmp/unused").returncode == ExitCode.USAGE


@pytest.mark.slow
def test_the_agent_sleeps_on_its_own_signal(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    snap = work_dir / "snap"
    demo = start_demo(
        size_mb=16,
        env={"HIBERNATE_ON_SIGNAL": "USR1", "HIBERNATE_WAKE_SIGNAL": "USR2", "HIBERNATE_DIR": str(snap)},
    )
    reference = demo.infer()["digest"]
    os.kill(demo.pid, signal.SIGUSR1)
    wait_for_state(cli, demo.pid, "asleep")
    assert list(snap.glob("*/snap-*/manifest.json"))
    os.kill(demo.pid, signal.SIGUSR2)
    wait_for_state(cli, demo.pid, "running")
    assert demo.infer()["digest"] == reference
    # ... and `hibernate wake` works on a process that slept on its signal
    os.kill(demo.pid, signal.SIGUSR1)
    wait_for_state(cli, demo.pid, "asleep")
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    assert demo.infer()["digest"] == reference


@pytest.mark.parametrize(
    "name, expected", [("USR1", signal.SIGUSR1), ("sigusr2", signal.SIGUSR2), ("15", signal.SIGTERM)]
)
def test_signal_names(name: str, expected: signal.Signals) -> None:
    assert parse_signal(name) == expected


def test_unknown_signal_names_are_refused() -> None:
    with pytest.raises(UsageError, match="not a signal name"):
        parse_signal("USR9")


@pytest.mark.parametrize(
    "flag, name",
    [("--on-signal", "KILL"), ("--on-signal", "STOP"), ("--wake-signal", "SIGKILL"), ("--on-signal", "SEGV")],
)
def test_run_refuses_a_signal_that_cannot_trigger_before_starting_the_job(
    cli: Callable[..., Any], work_dir: Path, flag: str, name: str
) -> None:
    started = work_dir / "started"
    result = cli("run", flag, name, "--to", str(work_dir / "snap"), "--", "touch", str(started))
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "Traceback" not in result.stderr and "Errno" not in result.stderr
    assert f"{flag} {name}" in result.stderr
    assert not started.exists()  # refused before the job was started


def test_an_agent_refuses_a_sleep_signal_it_could_never_receive(fresh_agent: None, work_dir: Path) -> None:
    import hibernate

    with pytest.raises(UsageError, match="sleep signal STOP: SIGSTOP cannot be caught"):
        hibernate.track([], on_signal="STOP", to=work_dir)


# -- under a real Slurm (tests/slurm_cluster.py) ------------------------------------------------


def wrapped_server_job(slurm: SlurmCluster, work_dir: Path, name: str, *sbatch: str) -> tuple[int, JobDemo]:
    """A batch job whose shell is `hibernate run` (USR1 sleeps, USR2 wakes) around a demo server."""
    node = slurm.nodes[0]
    files = slurm.scratch / f"{name}-{node}"
    script = slurm.scratch / f"{name}.sbatch"
    script.write_text(
        "#!/bin/sh\n"
        f"exec hibernate run --on-signal USR1 --wake-signal USR2 --to {work_dir} -- "
        f"hibernate-demo serve --size-mb 4 --control {files}.sock --ready-file {files}.ready\n"
    )
    job_id = slurm.submit(f"--nodelist={node}", f"--output={slurm.scratch}/{name}.out", *sbatch, str(script))
    (demo,) = ready_demos(slurm, job_id, name, [node])
    return job_id, demo


def log_says(slurm: SlurmCluster, name: str, words: str) -> bool:
    return words in (slurm.scratch / f"{name}.out").read_text()


@pytest.mark.slow
def test_scancel_signals_to_the_batch_shell_put_the_job_to_sleep_and_wake_it(
    slurm_cluster: SlurmCluster, work_dir: Path
) -> None:
    """`scancel --signal=USR1 --batch JOB` lends the job's GPUs, `--signal=USR2` takes them back."""
    slurm = slurm_cluster
    job_id, demo = wrapped_server_job(slurm, work_dir, "lender")
    try:
        assert slurm.run(["scancel", "--signal=USR1", "--batch", str(job_id)]).returncode == 0
        wait_until(lambda: log_says(slurm, "lender", f"asleep: pid {demo.pid}"), 60, "the sleep on USR1", 0.1)
        assert agent_state(slurm, demo) == "asleep"
        assert slurm.run(["scancel", "--signal=USR2", "--batch", str(job_id)]).returncode == 0
        wait_until(lambda: log_says(slurm, "lender", f"awake: pid {demo.pid}"), 60, "the wake on USR2", 0.1)
        assert demo.infer() == demo.reference
    finally:
        slurm.cancel(job_id)


@pytest.mark.slow
def test_the_time_limit_warning_of_signal_b_usr1_puts_the_job_to_sleep(
    slurm_cluster: SlurmCluster, work_dir: Path
) -> None:
    """`--signal=B:USR1@115` with a 2-minute limit: the warning is due 5 s after the start (the
    controller sends it at its next periodic check, within about 30 s more)."""
    slurm = slurm_cluster
    job_id, demo = wrapped_server_job(slurm, work_dir, "warned", "--time=2", "--signal=B:USR1@115")
    try:
        wait_until(
            lambda: log_says(slurm, "warned", f"asleep: pid {demo.pid}"),
            90,
            "the warning's sleep",
            0.1,
            detail=lambda: (slurm.scratch / "warned.out").read_text()[-3000:],  # did the signal come?
        )
        assert list(work_dir.glob("*/snap-*/manifest.json"))
        assert slurm.run(["scancel", "--signal=USR2", "--batch", str(job_id)]).returncode == 0
        wait_until(lambda: log_says(slurm, "warned", f"awake: pid {demo.pid}"), 60, "the wake on USR2", 0.1)
        assert demo.infer() == demo.reference
    finally:
        slurm.cancel(job_id)
