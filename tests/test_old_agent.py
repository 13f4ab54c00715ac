"""A CLI of this hibernate sleeps and wakes a target that runs the agent of an older one (commit 5a727c1).

A target is a long-running process: it keeps the hibernate it was started with
after the command's is upgraded. Its status lacks what came later (``graphs``),
and the command reads it through ``hibernate.agent.wire`` all the same.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, Demo, wait_until

OLD_COMMIT = "5a727c1"


@pytest.fixture
def old_source() -> Iterator[Path]:
    """The ``hibernate/`` package of OLD_COMMIT, extracted into a directory of its own."""
    found = subprocess.run(
        ["git", "-C", str(REPO), "cat-file", "-e", f"{OLD_COMMIT}^{{commit}}"], capture_output=True
    )
    if found.returncode != 0:
        pytest.skip(f"commit {OLD_COMMIT} is not in this checkout's history (a shallow clone)")
    root = Path(tempfile.mkdtemp(prefix="hb-old-"))
    archive = root / "old.tar"
    subprocess.run(
        ["git", "-C", str(REPO), "archive", "--output", str(archive), OLD_COMMIT, "hibernate"], check=True
    )
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    archive.unlink()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def start_old_demo(source: Path, scratch: Path) -> Demo:
    """``python -m hibernate.demo serve`` of the old package: run from its directory, so that its
    ``hibernate`` (not this checkout's) is the one imported."""
    control, ready, log = scratch / "demo.sock", scratch / "demo.ready", scratch / "demo.log"
    argv = [sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve", "--size-mb", "8"]
    argv += ["--dtype", "float32", "--control", str(control), "--ready-file", str(ready)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=source,
            env={**os.environ, "PYTHONPATH": str(source)},
        )
    demo = Demo(proc, str(control), {}, log)
    try:
        wait_until(
            ready.exists, 120, "the old demo to become ready", 0.05, process=proc, detail=log.read_text
        )
    except BaseException:
        demo.stop()
        raise
    demo.info = json.loads(ready.read_text())
    return demo


@pytest.mark.slow
def test_this_cli_sleeps_and_wakes_a_target_running_the_agent_of_5a727c1(
    old_source: Path, runtime_dir: Path, cli: Callable[..., Any], work_dir: Path
) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="hb-old-demo-"))
    demo = start_old_demo(old_source, scratch)
    try:
        status = cli("status", str(demo.pid), "--json")
        assert status.returncode == 0, status.stderr
        (agent,) = status.json()["agents"]
        assert "graphs" not in agent, "the target runs the agent of 5a727c1, from before graphs"
        assert os.readlink(f"/proc/{demo.pid}/cwd") == str(old_source)  # `-m` imports from there first
        before = demo.infer()["digest"]

        slept = cli("sleep", str(demo.pid), "--to", str(work_dir))
        assert slept.returncode == 0, slept.stderr
        asleep = cli("status", str(demo.pid), "--json").json()["agents"][0]
        assert asleep["state"] == "asleep" and asleep["snapshot"]["dir"].startswith(str(work_dir))

        woken = cli("wake", str(demo.pid))
        assert woken.returncode == 0, woken.stderr
        assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
        assert demo.infer()["digest"] == before, "the weights came back bit for bit"
    finally:
        demo.stop()
        shutil.rmtree(scratch, ignore_errors=True)
