"""The pool's own fault points, through the CLI, on a demo whose memory is all in hibernate.pool().

The demo runs on CPU with the stand-ins of tests/standins/site (torch_memory_saver
over host memory, torch.cuda graphs by raw address), as gpu-check's dry run
starts it: ``--pool --graphs``, so every byte is in a pool and a graph
captured before the sleep is replayed after it. A failure at a pool's step
is undone like every other step's; the target killed there is reported and
leaves nothing behind.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate import faults
from hibernate.errors import ExitCode
from tests.conftest import REPO
from tests.standins.world import World
from tests.test_faults import nothing_left_to_clean, published_snapshots_are_whole

SITE = REPO / "tests" / "standins" / "site"


@pytest.fixture
def pooled_demo(start_demo: Callable[..., Any], cudart_path: Path, world: World) -> Callable[[str], Any]:
    """Start a pooled demo with a graph, HIBERNATE_FAULT set to ``spec`` in it.

    The stand-in world gives the CLI its NVML, which a wake asks for the GPUs' free memory: the
    pool's bytes come back on cuda:0.
    """

    def start(spec: str) -> Any:
        env = {
            "PYTHONPATH": f"{SITE}:{REPO}",
            "HIBERNATE_STANDIN_CUDART": str(cudart_path),
            faults.ENV: spec,
        }
        return start_demo(size_mb=8, env=env, args=("--pool", "--graphs"))

    return start


def same(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return all(before[key] == after[key] for key in ("digest", "graph_digest", "pointers"))


def agent_state(cli: Callable[..., Any], pid: int) -> str:
    return str(cli("status", str(pid), "--json").json()["agents"][0]["state"])


@pytest.mark.slow
def test_a_failed_pause_is_undone_with_every_address_and_byte_in_place(
    pooled_demo: Callable[[str], Any], cli: Callable[..., Any], work_dir: Path, runtime_dir: Path
) -> None:
    demo = pooled_demo("pool.pause")
    before = demo.infer()
    assert before["graph_digest"] is not None and before["pointers"]
    result = cli("sleep", str(demo.pid), "--to", str(work_dir), "-q")
    assert result.returncode == ExitCode.FAILURE, result.stderr
    assert "fault injected at pool.pause" in result.stderr
    assert agent_state(cli, demo.pid) == "running"
    assert same(before, demo.infer())
    nothing_left_to_clean(runtime_dir)
    published_snapshots_are_whole(work_dir)


@pytest.mark.slow
def test_a_failed_resume_leaves_the_process_asleep_and_the_next_wake_is_exact(
    pooled_demo: Callable[[str], Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = pooled_demo("pool.resume#1")
    before = demo.infer()
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    result = cli("wake", str(demo.pid), "-q")
    assert result.returncode == ExitCode.FAILURE, result.stderr
    assert "fault injected at pool.resume" in result.stderr
    assert agent_state(cli, demo.pid) == "asleep"
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    assert same(before, demo.infer())


@pytest.mark.slow
@pytest.mark.parametrize("point", faults.POOL_POINTS)
def test_the_target_killed_at_a_pool_step_is_reported_and_leaves_nothing_behind(
    point: str,
    pooled_demo: Callable[[str], Any],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    demo = pooled_demo(f"{point}:kill")
    if point == "pool.resume":
        assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    result = cli("sleep" if point == "pool.pause" else "wake", str(demo.pid), *(
        ("--to", str(work_dir)) if point == "pool.pause" else ()
    ))  # fmt: skip
    assert result.returncode == ExitCode.NO_SUCH_PROCESS, result.stderr
    assert f"process {demo.pid} died" in result.stderr or f"process {demo.pid} exited" in result.stderr
    demo.proc.wait(timeout=10)
    assert cli("ls", "--json").json()["agents"] == []
    nothing_left_to_clean(runtime_dir)
    published_snapshots_are_whole(work_dir)
