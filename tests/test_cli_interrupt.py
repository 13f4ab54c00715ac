"""Ctrl-C during a sleep or wake: exit 130 with one line on the state everything was left in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from hibernate import faults
from hibernate.cli.render import interruption
from hibernate.errors import ExitCode, describe_cause
from hibernate.flows.agents import undo_requests
from hibernate.operation.reports import SleepReport
from tests.conftest import REPO, wait_until


def test_targets_back_as_they_were_are_said_to_have_lost_nothing() -> None:
    entries: list[dict[str, Any]] = [{"pid": 7, "state": "running", "busy": None, "interrupted": None}]
    assert interruption("sleep", entries) == (
        "interrupted: the sleep stopped; process 7 is running, nothing was lost",
        None,
    )
    asleep = [*entries, {"pid": 8, "state": "asleep", "busy": None, "interrupted": None}]
    message, hint = interruption("wake", asleep)
    assert message.endswith("process 7 is running; process 8 is asleep, nothing was lost") and hint is None


def test_a_target_left_half_way_is_named_with_the_command_that_resolves_it() -> None:
    left = {"op": "sleep", "phases": ["lock"], "resolve": "hibernate recover 9"}
    entries = [
        {"pid": 7, "state": "running", "busy": None, "interrupted": None},
        {"pid": 9, "state": "spilled", "busy": None, "interrupted": left},
    ]
    message, hint = interruption("sleep", entries)
    assert (
        message
        == "interrupted: the sleep stopped; process 7 is running; process 9 was left half-way (spilled)"
    )
    assert hint == "run `hibernate recover 9`"
    busy = [{"pid": 5, "state": "quiesced", "busy": "hibernate sleep (pid 1)", "interrupted": None}]
    message, hint = interruption("sleep", busy)
    assert "process 5 is quiesced, still busy (hibernate sleep (pid 1))" in message
    assert "nothing was lost" not in message and hint == "run `hibernate status 5`"


def test_an_agent_busy_with_this_command_s_own_undo_is_said_to_be_so() -> None:
    mine = [{"pid": 5, "state": "quiesced", "busy": "hibernate (pid 41, uid 0)", "interrupted": None}]
    message, hint = interruption("sleep", mine, me=41)
    assert message.endswith("process 5 is quiesced, its undo is still running in the agent")
    assert "pid 41" not in message and hint == "run `hibernate status 5`"
    message, _ = interruption("sleep", mine, me=410)  # another command's
    assert message.endswith("process 5 is quiesced, still busy (hibernate (pid 41, uid 0))")


def test_the_undo_goes_by_the_agent_s_own_state_over_the_last_answer_seen() -> None:
    # A release cut in flight ended in the agent: the command saw `spill` last, the agent is asleep.
    assert undo_requests("asleep", "spill") == ("restore", "resume")
    assert undo_requests("spilled", "spill") == ("resume",)
    assert undo_requests("running", "quiesce") == ()
    # An agent that cannot say: the last answer seen decides.
    assert undo_requests(None, "release") == ("restore", "resume")
    assert undo_requests(None, "quiesce") == ("resume",)
    assert undo_requests(None, "close_leases") == ()


def test_a_ctrl_c_is_named_as_the_cause_of_a_failed_undo() -> None:
    assert describe_cause(KeyboardInterrupt()) == "interrupted (Ctrl-C)"
    assert describe_cause(RuntimeError()) == "RuntimeError"


def test_a_ctrl_c_whose_undo_failed_is_reported_as_the_interruption(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from hibernate import orchestrator
    from hibernate.cli.operations import _operate_and_report
    from hibernate.errors import InterruptedByUserError, NeedsRecoveryError

    left = {"op": "sleep", "phases": ["lock"], "resolve": "hibernate recover 9"}
    monkeypatch.setattr(
        orchestrator,
        "status",
        lambda pids, all_users: [{"pid": 9, "state": "asleep", "busy": None, "interrupted": left}],
    )

    def operate(progress: object) -> SleepReport:
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt as cause:
            raise NeedsRecoveryError("interrupted (Ctrl-C); undoing it failed too: ...") from cause

    with pytest.raises(InterruptedByUserError) as raised:
        _operate_and_report(
            operate,
            print,
            SimpleNamespace(pids=[9]),  # type: ignore[arg-type]
            False,
            True,
            operation="sleep",
            all_users=False,
        )
    assert raised.value.message == "interrupted: the sleep stopped; process 9 was left half-way (asleep)"
    assert raised.value.hint == "run `hibernate recover 9`"


def interrupted_cli(args: list[str], point: str, trace: Path) -> subprocess.CompletedProcess[str]:
    """Run the CLI until it reaches ``point`` (where it hangs), then send it SIGINT, as Ctrl-C does."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        faults.ENV: f"{point}:hang",
        faults.TRACE_ENV: str(trace),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "hibernate", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        # A shell's child gets SIGINT's default disposition whatever the test runner's is.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_until(lambda: point in trace.read_text().split(), 60, f"the CLI to reach {point}")
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_ctrl_c_during_a_sleep_says_the_process_runs_and_nothing_was_lost(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, tmp_path: Path
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    trace = tmp_path / "points"
    trace.touch()
    result = interrupted_cli(["sleep", str(demo.pid), "--to", str(work_dir)], "sleep.after-spill", trace)
    assert result.returncode == ExitCode.INTERRUPTED == 130
    line = f"interrupted: the sleep stopped; process {demo.pid} is running, nothing was lost"
    assert line in result.stderr.splitlines()[-1], result.stderr
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
    assert demo.infer()["digest"] == reference

    trace.write_text("")
    as_json = interrupted_cli(
        ["sleep", str(demo.pid), "--to", str(work_dir), "--json"], "sleep.after-quiesce", trace
    )
    assert as_json.returncode == 130
    document = json.loads(as_json.stdout)
    schema = json.loads((REPO / "docs" / "json-schema" / "error.schema.json").read_text())
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(document)) == []
    assert document["error"]["code"] == "interrupted" and document["error"]["exit_name"] == "INTERRUPTED"
    assert "nothing was lost" in document["error"]["message"]
    assert demo.infer()["digest"] == reference


def run_state(pid: int) -> str:
    """The kernel's one-letter state of ``pid`` (``T``: stopped)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0]


def sigint_pending(pid: int) -> bool:
    """Whether a SIGINT sent to ``pid`` waits to be delivered (it is not, once a thread took it)."""
    with open(f"/proc/{pid}/status") as f:
        masks = dict(line.split(":", 1) for line in f if line.startswith(("SigPnd", "ShdPnd")))
    return any(int(mask, 16) >> (signal.SIGINT - 1) & 1 for mask in masks.values())


@pytest.mark.slow
def test_ctrl_c_while_the_agent_releases_waits_for_the_release_then_undoes_the_sleep(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    """A Ctrl-C with a request in flight: the command waits for the agent's answer (its release
    ends), then undoes the whole sleep, so the target runs with its weights, and says so."""
    demo = start_demo(size_mb=16, env={faults.ENV: "agent.release:SIGSTOP"})  # stops in its release
    reference = demo.infer()["digest"]
    env = {key: value for key, value in os.environ.items() if key != faults.ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hibernate", "sleep", str(demo.pid), "--to", str(work_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONPATH": str(REPO)},
        cwd=REPO,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        wait_until(lambda: run_state(demo.pid) == "T", 60, "the target to stop inside its release")
        proc.send_signal(signal.SIGINT)
        wait_until(lambda: not sigint_pending(proc.pid), 60, "the CLI to take its SIGINT")
        os.kill(demo.pid, signal.SIGCONT)  # the release goes on, and answers
        _, stderr = proc.communicate(timeout=60)
    finally:
        os.kill(demo.pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.INTERRUPTED, stderr
    line = f"interrupted: the sleep stopped; process {demo.pid} is running, nothing was lost"
    assert line in stderr.splitlines()[-1], stderr
    agent = cli("status", str(demo.pid), "--json").json()["agents"][0]
    assert agent["state"] == "running" and not agent.get("interrupted"), agent
    assert demo.infer()["digest"] == reference


def connections_to(socket_path: Path) -> int:
    """How many unix sockets carry ``socket_path``: its listener and those waiting to be accepted."""
    with open("/proc/net/unix") as f:
        return sum(1 for line in f if line.split()[-1:] == [str(socket_path)])


@pytest.mark.slow
def test_ctrl_c_outside_an_operation_still_prints_its_error_document(
    start_demo: Callable[..., Any], runtime_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    (socket_path,) = runtime_dir.rglob("*.sock")
    listening = connections_to(socket_path)
    os.kill(demo.pid, signal.SIGSTOP)  # its agent accepts no more: status waits on it
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hibernate", "status", str(demo.pid), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        try:
            wait_until(lambda: connections_to(socket_path) > listening, 60, "status to wait on the agent")
            proc.send_signal(signal.SIGINT)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        os.kill(demo.pid, signal.SIGCONT)
    assert proc.returncode == ExitCode.INTERRUPTED, stderr
    document = json.loads(stdout)
    schema = json.loads((REPO / "docs" / "json-schema" / "error.schema.json").read_text())
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(document)) == []
    assert document["error"]["code"] == "interrupted"
    assert document["error"]["message"] == "interrupted (Ctrl-C)"
