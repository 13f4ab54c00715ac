"""scripts/bench-latency, run tiny: it mounts the latency-bound filesystem, measures raw transfers
and a real sleep and wake of a demo target on it, and prints its ratios against the target."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.standins.latencyfs import MAX_REQUEST, unavailable

BENCH = REPO / "scripts" / "lib" / "bench_latency.py"


@pytest.mark.slow
def test_a_tiny_run_prints_its_ratios(tmp_path: Path) -> None:
    reason = unavailable()
    if reason is not None:
        pytest.skip(f"latency-bound filesystem: {reason}")
    out = tmp_path / "bench.json"
    argv = [
        "--size-mb",
        "16",
        "--reps",
        "1",
        "--dir",
        str(tmp_path),
        "--no-drop-caches",
        "--json-out",
        str(out),
    ]
    done = subprocess.run(
        [sys.executable, "-W", "ignore", str(BENCH), *argv],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    # Exit 1 is a target not met (a tiny run is mostly the commands' start); anything else is a failure.
    assert done.returncode in (0, 1), done.stdout + done.stderr
    text = done.stdout + done.stderr
    for header in ("machine", "filesystem", "options", "page cache"):
        assert re.search(rf"^{header}: +\S", text, re.M), text
    assert "NOT dropped" in text, text  # --no-drop-caches says so
    for row in ("raw read, 1 x 1 MiB in flight", "raw read, 8 x 1 MiB in flight", "wake: restore step"):
        assert re.search(rf"^{re.escape(row)} +\d+ MB/s", text, re.M), text
    for row in ("raw write, 1 x 1 MiB in flight", "raw write, 8 x 1 MiB in flight", "sleep: spill step"):
        assert re.search(rf"^{re.escape(row)} +\d+ MB/s", text, re.M), text
    for key, raw in (("wake", "raw read"), ("sleep", "raw write")):
        ratio = r"[0-9.]+ \(repetitions [0-9.]+-[0-9.]+\)"
        pattern = rf"^{key} x {raw}, 8 in flight: {ratio}, target 0\.80: (PASS|FAIL)"
        assert re.search(pattern, text, re.M), text

    document = json.loads(out.read_text())
    steps = document["steps"]
    # What the filesystem counted, not a timing: one thread has one request in flight, none over 1 MiB.
    assert steps["read_1"]["in_flight_max"] == 1 and steps["write_1"]["in_flight_max"] == 1, steps
    assert all(0 < step["largest_request"] <= MAX_REQUEST for step in steps.values()), steps
    # The CPU the server and the client took, per GiB (clock ticks: a tiny run's may be 0).
    assert all(step["server_cpu_s_per_gib"] >= 0 <= step["client_cpu_s_per_gib"] for step in steps.values())
    assert document["io_modes"] == ["direct"], document
    assert (done.returncode == 0) == all(
        r["median"] >= document["target"] for r in document["ratios"].values()
    )
    assert list(tmp_path.iterdir()) == [out], "the run left its work directory behind"
