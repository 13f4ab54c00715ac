"""`--if-needed`: a script asks for a state and gets exit 0 where the targets already hold it.

A resume hook runs `hibernate wake --job $ID` whether or not the job slept;
without the flag that is exit 6 for an awake job (as it stays: a pid named
by hand and found in the wrong state is worth a refusal), with it the hook
needs no `|| [ $? = 6 ]`, and the report says what it left alone.
"""

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
from hibernate.errors import ExitCode
from tests.conftest import REPO, wait_until

SCHEMAS = REPO / "docs" / "json-schema"


def valid(name: str, result: Any) -> dict[str, Any]:
    assert result.returncode == 0, result.stderr + result.stdout
    document: dict[str, Any] = json.loads(result.stdout)
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    assert list(jsonschema.Draft202012Validator(schema).iter_errors(document)) == []
    return document


def state_of(cli: Callable[..., Any], pid: int) -> str:
    state: str = cli("status", str(pid), "--json").json()["agents"][0]["state"]
    return state


@pytest.mark.slow
def test_a_wake_of_a_running_process_succeeds_with_if_needed_and_says_so(
    start_demo: Callable[..., Any], cli: Callable[..., Any]
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    assert cli("wake", str(demo.pid)).returncode == ExitCode.WRONG_STATE  # unchanged without the flag

    woken = valid("wake", cli("wake", str(demo.pid), "--if-needed", "--json"))
    assert woken["processes"] == []
    (skipped,) = woken["skipped"]
    assert skipped["pid"] == demo.pid and skipped["state"] == "running"

    human = cli("wake", str(demo.pid), "--if-needed")
    assert human.returncode == 0, human.stderr
    assert f"skipped: pid {demo.pid} (" in human.stdout and "is already awake" in human.stdout
    assert state_of(cli, demo.pid) == "running" and demo.infer()["digest"] == reference


@pytest.mark.slow
def test_a_sleep_of_a_sleeping_process_succeeds_with_if_needed(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    snapshot = cli("status", str(demo.pid), "--json").json()["agents"][0]["snapshot"]["path"]

    again = valid("sleep", cli("sleep", str(demo.pid), "--to", str(work_dir), "--if-needed", "--json"))
    assert again["processes"] == []
    (skipped,) = again["skipped"]
    assert skipped == {"pid": demo.pid, "name": skipped["name"], "state": "asleep", "snapshot": snapshot}
    human = cli("sleep", str(demo.pid), "--to", str(work_dir), "--if-needed")
    assert human.returncode == 0 and f"skipped: pid {demo.pid}" in human.stdout
    assert state_of(cli, demo.pid) == "asleep"
    assert cli("wake", str(demo.pid), "-q").returncode == 0


@pytest.mark.slow
def test_if_needed_acts_on_the_others_and_lists_the_one_already_there(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    asleep, awake = start_demo(size_mb=16), start_demo(size_mb=16)
    assert cli("sleep", str(asleep.pid), "--to", str(work_dir), "-q").returncode == 0
    pids = (str(asleep.pid), str(awake.pid))

    slept = valid("sleep", cli("sleep", *pids, "--to", str(work_dir), "--if-needed", "--json"))
    assert [p["pid"] for p in slept["processes"]] == [awake.pid]
    assert [s["pid"] for s in slept["skipped"]] == [asleep.pid]

    assert cli("wake", str(awake.pid), "-q").returncode == 0
    woken = valid("wake", cli("wake", *pids, "--if-needed", "--json"))
    assert [p["pid"] for p in woken["processes"]] == [asleep.pid]
    assert [s["pid"] for s in woken["skipped"]] == [awake.pid]
    assert state_of(cli, asleep.pid) == state_of(cli, awake.pid) == "running"


def refused(result: Any, code: ExitCode, wire: str) -> dict[str, Any]:
    assert result.returncode == code, result.stderr + result.stdout
    error: dict[str, Any] = json.loads(result.stdout)["error"]
    assert error["code"] == wire, error
    return error


@pytest.mark.slow
def test_a_target_left_half_way_is_never_already_there(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    """A sleep killed after its release leaves the agent asleep, the rest (the CUDA stage) undone:
    --if-needed must name the recover, not call it skipped; a selector must not skip it either."""
    half, other = start_demo(size_mb=16), start_demo(size_mb=16)
    killed = cli("sleep", str(half.pid), "--to", str(work_dir), env={faults.ENV: "sleep.after-release:kill"})
    assert killed.returncode == -signal.SIGKILL
    assert state_of(cli, half.pid) == "asleep"
    to = ("--to", str(work_dir))
    for args in ([str(half.pid)], [str(half.pid), str(other.pid)], ["--all"]):
        error = refused(
            cli("sleep", *args, *to, "--if-needed", "--json"), ExitCode.NEEDS_RECOVERY, "needs-recovery"
        )
        assert f"process {half.pid} was left half-way" in error["message"]
        assert error["hint"] == f"run `hibernate recover {half.pid}` to finish or undo it"
    assert state_of(cli, other.pid) == "running"  # nothing was changed
    assert cli("recover", str(half.pid), "-q").returncode == 0  # finishes that sleep
    assert cli("wake", str(half.pid), "-q").returncode == 0

    # A sleep killed after its spill: the agent rolls back to running, the journal still says half-way.
    killed = cli("sleep", str(half.pid), "--to", str(work_dir), env={faults.ENV: "sleep.after-spill:kill"})
    assert killed.returncode == -signal.SIGKILL
    wait_until(lambda: state_of(cli, half.pid) == "running", 30, "the agent to roll back by itself")
    for args in ([str(half.pid)], [str(half.pid), str(other.pid)]):
        error = refused(
            cli("wake", *args, "--if-needed", "--json"), ExitCode.NEEDS_RECOVERY, "needs-recovery"
        )
        assert f"run `hibernate recover {half.pid}`" in error["hint"]
    assert cli("recover", str(half.pid), "-q").returncode == 0
    assert valid("wake", cli("wake", str(half.pid), "--if-needed", "--json"))["processes"] == []


@pytest.mark.slow
def test_a_target_another_command_is_still_putting_to_sleep_is_busy(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, tmp_path: Path
) -> None:
    demo = start_demo(size_mb=16)
    trace = tmp_path / "points"
    trace.touch()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        faults.ENV: "sleep.after-release:hang",
        faults.TRACE_ENV: str(trace),
    }
    other = subprocess.Popen(
        [sys.executable, "-m", "hibernate", "sleep", str(demo.pid), "--to", str(work_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=REPO,
    )
    try:
        wait_until(
            lambda: "sleep.after-release" in trace.read_text().split(), 60, "the other sleep's release"
        )
        assert state_of(cli, demo.pid) == "asleep"
        error = refused(
            cli("sleep", str(demo.pid), "--to", str(work_dir), "--if-needed", "--json"), ExitCode.BUSY, "busy"
        )
        assert f"process {demo.pid} is asleep, but hibernate (pid {other.pid}" in error["message"]
    finally:
        other.kill()
        other.wait()
    assert cli("recover", str(demo.pid), "-q").returncode == 0


def test_if_needed_does_not_hide_a_target_that_cannot_be_acted_on(
    cli: Callable[..., Any], runtime_dir: Path
) -> None:
    result = cli("wake", "4194303", "--if-needed", "--json")
    assert result.returncode == ExitCode.NO_SUCH_PROCESS
    assert result.json()["error"]["code"] == "no-such-process"


def test_the_schemas_take_the_skipped_of_a_wake_and_refuse_one_asleep() -> None:
    schema = json.loads((SCHEMAS / "wake.schema.json").read_text())
    base = {
        "ok": True,
        "operation": "wake",
        "seconds": 0.0,
        "processes": [],
        "cuda": {"status": "x", "processes": []},
    }
    running = {"pid": 7, "name": "proc-7", "state": "running", "snapshot": None}
    validator = jsonschema.Draft202012Validator(schema)
    assert list(validator.iter_errors({**base, "skipped": [running]})) == []
    assert list(validator.iter_errors({**base, "skipped": [{**running, "state": "asleep"}]})) != []
