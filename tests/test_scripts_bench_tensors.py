"""scripts/bench-tensors, run tiny: it sleeps and wakes a real target through the CLI beside
safetensors, and prints each step's share of the wall time, the ratios against the goals and the
CPU cost."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCH = REPO / "scripts" / "lib" / "bench_tensors.py"
TINY = ("--tensors", "2000", "--reps", "1")


@pytest.mark.slow
def test_a_tiny_run_prints_every_steps_share_the_ratios_and_the_cpu_cost(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(BENCH), *TINY, "--dir", str(tmp_path), "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    # Exit 1 is a goal not met (a tiny run is all process start); anything else is a failure.
    assert done.returncode in (0, 1), done.stdout + done.stderr
    text = done.stdout
    for step in (
        "begin",
        "spill",
        "release",
        "restore",
        "resume",
        "between the steps",
        "the command's start and exit",
    ):
        assert re.search(rf"^  {re.escape(step)} .* of the wall time", text, re.M), text + done.stderr
    assert re.search(r"^sleep / peer: [0-9.]+ \(", text, re.M), text
    assert re.search(r"^wake / peer: [0-9.]+ \(", text, re.M), text
    assert re.search(r"^CPU, core-seconds per GiB .*: sleep [0-9.]+ \([0-9.]+\), wake [0-9.]+", text, re.M), (
        text
    )
    assert re.search(r"^(PASS|FAIL)  sleep <= 0\.5x safetensors save_file \+ fsync", text, re.M), text
    assert re.search(r"^(PASS|FAIL)  wake <= 0\.5x cold safetensors load_file", text, re.M), text

    document = json.loads(out.read_text())
    assert document["all_pass"] == (done.returncode == 0)
    for operation in ("sleep", "wake"):
        (rep,) = document["repetitions"]
        steps = rep[f"{operation}_steps"]
        # The steps and what lies outside them add up to the command's wall time.
        assert sum(steps.values()) == pytest.approx(rep[f"{operation}_seconds"])
        assert document["core_seconds_per_gib"][operation] > 0
    assert document["repetitions"][0]["written_bytes"] == 2000 * 1024
    assert document["repetitions"][0]["restored_bytes"] == 2000 * 1024
    assert not list(tmp_path.glob("hibernate-bench-tensors-*")), "the run's directory was left behind"
