"""The store seen from outside: the real CLI against a real target process.

A snapshot damaged while its process sleeps makes ``hibernate wake`` fail with
SNAPSHOT_INVALID and leaves the process asleep, its memory still given back,
so the user can repair the disk and wake it again, bit-exact. A disk that fills
up during ``hibernate sleep`` fails it with IO_ERROR and leaves the process
running with its weights, nothing published.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import REPO, flip_a_bit_in_a_chunk


def sleep_json(cli: Any, pid: int, directory: Path) -> dict[str, Any]:
    result = cli("sleep", str(pid), "--to", str(directory), "--json")
    assert result.returncode == 0, result.stderr
    process: dict[str, Any] = result.json()["processes"][0]
    return process


def state(cli: Any, pid: int) -> str:
    value: str = cli("status", str(pid), "--json").json()["agents"][0]["state"]
    return value


DAMAGE = {
    "bit-flip": (flip_a_bit_in_a_chunk, r"checksum mismatch; the data on disk is corrupted"),
    "truncated": (lambda p: os.truncate(p, p.stat().st_size // 2), r"is truncated: \d+ bytes, but"),
    "missing": (lambda p: p.unlink(), r"is missing \(needed by"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_snapshot_keeps_the_process_asleep_until_repaired(
    start_demo: Any, cli: Any, work_dir: Path, damage: str
) -> None:
    demo = start_demo(size_mb=64)
    reference = demo.infer()["digest"]
    spill = sleep_json(cli, demo.pid, work_dir)
    target = Path(spill["snapshot"]) / "data-000.bin"
    original = target.read_bytes()
    rss_asleep = demo.rss()
    action, problem = DAMAGE[damage]
    action(target)

    failed = cli("wake", str(demo.pid), "--json")
    assert failed.returncode == ExitCode.SNAPSHOT_INVALID, failed.stdout + failed.stderr
    error = failed.json()["error"]
    assert error["code"] == "snapshot-invalid"
    assert error["message"].startswith(f"process {demo.pid} stays asleep: {target}"), error["message"]
    assert re.search(problem, error["message"]), error["message"]
    assert error["hint"] == f"fix the cause, then run `hibernate wake {demo.pid}` again"
    assert demo.alive()
    assert state(cli, demo.pid) == "asleep"
    assert demo.rss() < rss_asleep + spill["total_bytes"] // 2, "the failed wake gave the memory back"

    target.write_bytes(original)  # the user repairs the disk
    woken = cli("wake", str(demo.pid), "--json")
    assert woken.returncode == 0, woken.stderr
    assert woken.json()["processes"][0]["restored_bytes"] == spill["total_bytes"]
    assert demo.infer()["digest"] == reference


# Loaded by the target at start-up (PYTHONPATH): its data writes run out of space after a
# number of bytes, as on a nearly full disk. The manifest and everything else are untouched.
ENOSPC_AFTER = """
import errno, os

_limit = int(os.environ["HIBERNATE_TEST_ENOSPC_AFTER"])
_real = os.pwritev
_written = [0]


def _pwritev(fd, buffers, offset, *rest):
    size = sum(memoryview(b).nbytes for b in buffers)
    if _written[0] + size > _limit:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    done = _real(fd, buffers, offset, *rest)
    _written[0] += done
    return done


os.pwritev = _pwritev
"""


@pytest.mark.slow
def test_a_disk_filling_up_during_sleep_leaves_the_process_running(
    start_demo: Any, cli: Any, work_dir: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ENOSPC_AFTER)
    demo = start_demo(
        size_mb=32, env={"PYTHONPATH": f"{site}:{REPO}", "HIBERNATE_TEST_ENOSPC_AFTER": str(12 << 20)}
    )
    reference = demo.infer()["digest"]
    rss = demo.rss()
    result = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json")
    assert result.returncode == ExitCode.IO_ERROR, result.stdout + result.stderr
    error = result.json()["error"]
    root_name = rf"{re.escape(str(work_dir))}/proc-{demo.pid}-[0-9a-f]{{12}}"
    named = re.match(
        rf"process {demo.pid} \(spill\): no space left on the device of ({root_name}) ", error["message"]
    )
    assert named, error["message"]
    root = Path(named.group(1))
    assert "nothing was published and the process keeps its memory" in error["message"]
    assert state(cli, demo.pid) == "running"
    assert demo.infer()["digest"] == reference
    assert demo.rss() > rss * 0.9, "the weights stayed in memory"
    assert not root.exists(), "nothing published, no temporary and no empty directory left"
