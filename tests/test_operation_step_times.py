"""A report's step times and GB/s cover the whole step, not the store's transfer inside it.

With many small tensors most of a spill or a restore is work around the
store's reads and writes (enumerating, matching, re-allocating, zero-filling,
one message per region), so a time taken from the store alone made a restore
look up to four times faster than it was. These tests time each step from
outside, by when the orchestrator announces it and the next one, and hold the
reported time to that.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hibernate import orchestrator
from tests.conftest import REPO, wait_until

TENSORS = 20000

# A target of TENSORS small tensors (kept) and as many dropped ones, each its own storage.
TARGET = """
import json, os, sys, time
import torch
import hibernate

kept = [torch.full((64,), float(i)) for i in range({count})]
dropped = [torch.ones(64) for _ in range({count})]
hibernate.track(kept, tag="weights")
hibernate.track(dropped, tag="scratch", keep=False)
ready = sys.argv[1]
with open(ready + ".tmp", "w") as f:
    json.dump({{"pid": os.getpid()}}, f)
os.rename(ready + ".tmp", ready)
while True:
    time.sleep(3600)
"""


class StepClock(orchestrator.ProgressSink):
    """When each step was announced; a step ends when the next one begins."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, float]] = []

    def step(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def wall(self, name: str) -> float:
        """Seconds from the announcement of ``name`` to that of the step after it."""
        names = [n for n, _ in self.marks]
        index = names.index(name)
        return self.marks[index + 1][1] - self.marks[index][1]


@pytest.fixture
def many_tensors(runtime_dir: Path, tmp_path: Path) -> Iterator[int]:
    ready = tmp_path / "ready.json"
    proc = subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", TARGET.format(count=TENSORS), str(ready)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        # The target writes it once its tensors are tracked.
        wait_until(ready.exists, 120, "the target to become ready", 0.05, process=proc)
        yield int(json.loads(ready.read_text())["pid"])
    finally:
        proc.kill()
        proc.wait()


def covers(reported: float, wall: float) -> bool:
    """The reported time is the step's own: at least 90% of it as seen from outside, never more."""
    return 0.9 * wall <= reported <= wall


@pytest.mark.slow
def test_spill_and_restore_times_cover_the_whole_phase(many_tensors: int, work_dir: Path) -> None:
    options = orchestrator.Options()
    asleep_clock = StepClock()
    asleep = orchestrator.sleep([many_tensors], work_dir, options, asleep_clock)
    (process,) = asleep.to_wire()["processes"]
    spill_wall = asleep_clock.wall("spill")
    assert covers(process["phases"]["spill"], spill_wall), (process["phases"], spill_wall)
    assert process["io_seconds"] <= process["phases"]["spill"]
    assert process["gb_per_s"] == round(process["written_bytes"] / process["phases"]["spill"] / 1e9, 3)

    woken_clock = StepClock()
    woken = orchestrator.wake([many_tensors], options, woken_clock)
    (process,) = woken.to_wire()["processes"]
    restore_wall = woken_clock.wall("restore")
    assert covers(process["phases"]["restore"], restore_wall), (process["phases"], restore_wall)
    assert process["io_seconds"] <= process["phases"]["restore"]
    assert process["gb_per_s"] == round(process["restored_bytes"] / process["phases"]["restore"] / 1e9, 3)
    assert process["restored_bytes"] == TENSORS * 64 * 4 and process["zeroed_bytes"] == TENSORS * 64 * 4
