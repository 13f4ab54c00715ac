"""Graphs seen at their capture, from outside: ``doctor PID`` lists them, ``sleep`` names them in its refusal.

The demo runs on CPU with the stand-ins of tests/standins/site (tracked
tensors as device storages of cuda:0, torch.cuda graphs by raw address), as
gpu-check's dry run starts it: ``--graphs`` captures the prompt's forward pass
over the tracked weights, after the demo's first ``hibernate.track``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import REPO
from tests.standins.world import World

SITE = REPO / "tests" / "standins" / "site"
DEMO = str(REPO / "hibernate" / "demo.py")


@pytest.mark.slow
def test_a_graph_over_tracked_weights_is_named_by_doctor_and_by_the_refused_sleep(
    start_demo: Callable[..., Any], cli: Callable[..., Any], cudart_path: Path, world: World, work_dir: Path
) -> None:
    env = {"PYTHONPATH": f"{SITE}:{REPO}", "HIBERNATE_STANDIN_CUDART": str(cudart_path)}
    demo = start_demo(size_mb=4, env=env, args=("--graphs",))
    before = demo.infer()

    doctor = cli("doctor", str(demo.pid), "--json").json()
    [graphs] = [check for check in doctor["checks"] if check["name"] == "graphs"]
    assert graphs["status"] == "warn" and "hibernate.pool()" in graphs["fix"]
    [seen] = graphs["data"]["graphs"]
    assert seen["pid"] == demo.pid and seen["captured_at"].startswith(f"{DEMO}:")
    assert seen["hibernate_pool"] is False and seen["pool"] is not None

    refused = cli("sleep", str(demo.pid), "--to", str(work_dir), "--checkpointer", "none", "--json")
    assert refused.returncode == ExitCode.ADDRESSES_WOULD_MOVE, refused.stdout + refused.stderr
    message = refused.json()["error"]["message"]
    assert f"a CUDA graph captured at {seen['captured_at']}" in message
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
    after = demo.infer()
    assert all(after[key] == before[key] for key in ("digest", "graph_digest", "pointers"))
