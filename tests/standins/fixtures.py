"""STAND-IN fixtures: import them into a test module to use the fake driver.

from tests.standins.fixtures import checkpointer_kind, standin_build, start_tree, world  # noqa: F401
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hibernate.checkpoint.nccl import NCCL_SAFE
from tests.conftest import REPO, wait_until
from tests.standins.world import Build, Tree, World, build

TREE_TARGET = Path(__file__).resolve().parent / "tree_target.py"


@pytest.fixture(scope="session")
def standin_build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    return build(tmp_path_factory.mktemp("standins"))


@pytest.fixture
def world(standin_build: Build, monkeypatch: pytest.MonkeyPatch) -> Iterator[World]:
    """A fresh fake driver with one 80 GiB GPU; this process and every child it starts use it."""
    directory = Path(tempfile.mkdtemp(prefix="hb-world-", dir="/tmp"))
    fake = World(standin_build, directory)
    fake.add_gpu()
    for name, value in fake.env.items():
        monkeypatch.setenv(name, value)
    for name in ("HIBERNATE_STANDIN_FAULTS", "HIBERNATE_STANDIN_CUDA_VERSION", "HIBERNATE_STANDIN_HANG_S"):
        monkeypatch.delenv(name, raising=False)
    # Multi-process targets run as a real NCCL job must for a checkpoint (a sleep refuses it otherwise):
    # tests of that refusal start their processes without these.
    for name, value in NCCL_SAFE.items():
        monkeypatch.setenv(name, value)
    yield fake
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(params=["driver", "binary"])
def checkpointer_kind(request: pytest.FixtureRequest) -> str:
    """Every CUDA test runs against both checkpointers."""
    kind: str = request.param
    return kind


@pytest.fixture
def start_tree(runtime_dir: Path) -> Iterator[Callable[..., Tree]]:
    """Start tree_target.py (``agent=True`` makes the parent a hibernate agent)."""
    started: list[Tree] = []
    scratch = Path(tempfile.mkdtemp(prefix="hb-tree-", dir="/tmp"))

    def start(children: int = 2, agent: bool = False) -> Tree:
        ready = scratch / f"tree{len(started)}.json"
        command = [sys.executable, str(TREE_TARGET), "--ready", str(ready), "--children", str(children)]
        if agent:
            command.append("--agent")
        proc = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            wait_until(ready.exists, 120, "the tree target to start", process=proc)
        except AssertionError:
            proc.kill()
            raise
        tree = Tree(proc, json.loads(ready.read_text())["children"])
        started.append(tree)
        return tree

    yield start
    for tree in started:
        tree.stop()
    shutil.rmtree(scratch, ignore_errors=True)
