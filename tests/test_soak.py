"""Soak: many sleep/wake cycles of the demo target, bit-exact every cycle, resources flat.

Not in the default suite (marked ``soak``); ``scripts/soak`` runs it:
    ./scripts/soak               # 200 cycles
    SOAK_CYCLES=50 ./scripts/soak
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import spill_root_of

CYCLES = int(os.environ.get("SOAK_CYCLES", "200"))
WARMUP = 5


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


@pytest.mark.slow
@pytest.mark.soak
def test_soak_cycles_stay_exact_and_flat(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=64)
    reference = demo.infer()["digest"]
    samples: dict[str, list[int]] = {"rss": [], "fds": [], "threads": [], "disk": []}
    root: Path | None = None  # the agent names its snapshot root at its first sleep
    mismatches = 0
    for cycle in range(CYCLES):
        asleep = cli("sleep", str(demo.pid), "--to", str(work_dir), "--quiet")
        assert asleep.returncode == 0, f"cycle {cycle}: {asleep.stderr}"
        woken = cli("wake", str(demo.pid), "--quiet")
        assert woken.returncode == 0, f"cycle {cycle}: {woken.stderr}"
        # Resources are sampled after the wake, before the demo's own inference allocates
        # (and fragments) activation memory of its own.
        samples["rss"].append(demo.rss())
        samples["fds"].append(demo.open_fds())
        samples["threads"].append(thread_count(demo.pid))
        if root is None:
            root = spill_root_of(work_dir, demo.pid)
            assert root.is_dir(), f"no snapshot root under {work_dir} after a sleep"
        samples["disk"].append(sum(f.stat().st_size for f in root.rglob("*") if f.is_file()))
        mismatches += demo.infer()["digest"] != reference
    summary = {
        name: (min(values[WARMUP:]), statistics.median(values[WARMUP:]), max(values[WARMUP:]))
        for name, values in samples.items()
    }
    print(f"\nsoak: {CYCLES} cycles, {mismatches} mismatches; (min, median, max) after warm-up: {summary}")
    assert mismatches == 0
    # A leak shows as a trend: the median of the last cycles above that of the first ones.
    # Single samples may catch a request's connection thread or socket still closing.
    window = max(5, (CYCLES - WARMUP) // 10)

    def trend(name: str) -> float:
        values = samples[name]
        return statistics.median(values[-window:]) - statistics.median(values[WARMUP : WARMUP + window])

    assert trend("rss") < 16 << 20, "RSS grew"
    assert trend("fds") <= 0, "file descriptors grew"
    assert trend("threads") <= 0, "threads grew"
    for name in ("fds", "threads"):
        assert max(samples[name]) <= statistics.median(samples[name]) + 2, f"{name} spiked"
    assert min(samples["disk"]) >= 64 << 20, "the snapshot is missing from the disk samples"
    assert max(samples["disk"][WARMUP:]) - min(samples["disk"][WARMUP:]) <= 1 << 16, "disk use grew"
