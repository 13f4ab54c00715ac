"""scripts/bench-store --page-cache, run tiny: a real target slept and woken through the CLI, its
snapshot warmed into the page cache, woken with the defaults (through the cache) and with
--io-mode direct (from the disk), the two set side by side."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

BENCH = REPO / "scripts" / "lib" / "bench_store.py"


@pytest.mark.slow
def test_a_tiny_page_cache_run_reads_the_warmed_snapshot_through_the_cache(
    tmp_path: Path, work_dir: Path
) -> None:
    out = tmp_path / "bench.json"
    tiny = ("--page-cache", "--size-mb", "64", "--reps", "1")
    done = subprocess.run(
        # work_dir: a short path, as the target's agent socket (in the bench's directory) needs.
        [sys.executable, "-W", "ignore", str(BENCH), *tiny, "--dir", str(work_dir), "--json-out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = done.stdout
    assert re.search(r"^wake \(wall\), s .* [0-9.]+ \([0-9.]+-[0-9.]+\)$", text, re.M), text
    assert re.search(r"^a buffered read of the cached files into fresh memory: [0-9.]+ GB/s", text, re.M), (
        text
    )
    assert "PASS  every wake with --io-mode auto read the cached snapshot through the page cache" in text

    document = json.loads(out.read_text())
    (rep,) = document["repetitions"]
    assert (rep["cached"]["io_mode"], rep["cached"]["kind"]) == ("cached", "memory")
    assert rep["direct"]["io_mode"] == "direct"
    assert document["all_pass"] is True
