"""Ctrl-C during a sleep or wake: exit 130 with one line on the state everything was left in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from hibernate import faults
from hibernate.cli.render import interruption
from hibernate.errors import ExitCode
from tests.conftest import REPO, wait_until


def test_targets_back_as_they_were_are_said_to_have_lost_nothing() -> None:
    entries = [{"pid": 7, "state": "running", "busy": None, "interrupted": None}]
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
    start_demo, cli, work_dir: Path, tmp_path: Path
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
