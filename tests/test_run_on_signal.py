"""Hibernating on a scheduler's signal: the `hibernate run` wrapper and the agent's own option."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hibernate.agent.triggers import parse_signal
from hibernate.errors import ExitCode, UsageError
from tests.conftest import REPO, wait_until


def wait_for_state(cli, pid: int, state: str, timeout: float = 60) -> None:
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
def test_run_hibernates_on_usr1_and_wakes_on_hibernate_wake(cli, work_dir: Path, runtime_dir: Path) -> None:
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


def test_run_passes_on_the_childs_exit_status(cli) -> None:
    result = cli("run", "--to", "/tmp/unused", "--", sys.executable, "-c", "raise SystemExit(7)")
    assert result.returncode == 7


def test_run_without_a_command_is_a_usage_error(cli) -> None:
    assert cli("run", "--to", "/tmp/unused").returncode == ExitCode.USAGE


@pytest.mark.slow
def test_the_agent_sleeps_on_its_own_signal(start_demo, cli, work_dir: Path) -> None:
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
    cli, work_dir: Path, flag: str, name: str
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
