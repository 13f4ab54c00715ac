"""``--checkpointer none`` (``--no-cuda``): the pools are freed, every CUDA context stays on the GPU.

The stand-in driver logs every call it answers (state queries and cuInit
included), so "no checkpoint call at all" is checked on that log, not assumed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate import orchestrator
from hibernate.checkpoint import detect
from hibernate.errors import ExitCode, UsageError
from hibernate.operation.cuda import CudaStage
from hibernate.operation.options import options_from_flags
from tests.standins.world import GIB, World

EVERY_STEP = ("init", "state", "lock", "checkpoint", "restore", "unlock", "restore-tid")


def agent_state(cli: Callable[..., Any], pid: int) -> str:
    state: str = cli("status", str(pid), "--json").json()["agents"][0]["state"]
    return state


def test_no_cuda_is_checkpointer_none_and_conflicts_are_refused() -> None:
    assert options_from_flags(no_cuda=True).checkpointer_kind == "none"
    assert options_from_flags(checkpointer="none").checkpointer_kind == "none"
    with pytest.raises(UsageError, match="--no-cuda means --checkpointer none"):
        options_from_flags(no_cuda=True, checkpointer="driver")
    with pytest.raises(UsageError, match="cannot be used with --checkpointer none"):
        options_from_flags(checkpointer="none", cuda_checkpoint=Path("/bin/true"))


def test_pools_only_stage_lists_holders_as_left_and_asks_no_driver(
    world: World, monkeypatch: pytest.MonkeyPatch, start_tree: Callable[..., Any]
) -> None:
    tree = start_tree(children=1)
    for pid in tree.pids:
        world.register(pid)
    monkeypatch.setattr(detect, "nvidia_device_files", lambda pid: ["/dev/nvidia0", "/dev/nvidiactl"])
    stage = CudaStage(orchestrator.Options(checkpointer_kind="none"))
    stage.require(tree.pids)
    assert stage.holders == [] and stage.left == tree.pids and stage.checkpointer is None
    report = stage.sleep([], after_lock=lambda: pytest.fail("nothing is locked"))
    assert report == {"status": "left on the GPU (--checkpointer none)", "processes": [], "left": tree.pids}
    assert stage.wake(tree.pids, after_restore=lambda: None)["left"] == tree.pids
    assert world.calls(EVERY_STEP) == []
    assert [world.state(pid) for pid in tree.pids] == ["running", "running"]


def test_pools_only_refuses_workers_that_checkpoint_themselves(world: World) -> None:
    stage = CudaStage(orchestrator.Options(checkpointer_kind="none"))
    with pytest.raises(UsageError, match=r"HIBERNATE_SELF_CHECKPOINT=1\).*nothing was changed"):
        stage.require([], themselves=[4242])


@pytest.mark.slow
def test_sleep_and_wake_with_no_cuda_make_no_driver_call(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, nbytes=3 * GIB)
    reference = demo.infer()["digest"]
    asleep = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json", "--checkpointer", "none")
    assert asleep.returncode == 0, asleep.stderr
    document = asleep.json()
    assert document["cuda"]["status"] == "left on the GPU (--checkpointer none)"
    assert document["processes"][0]["released_bytes"] >= 16 << 20
    assert agent_state(cli, demo.pid) == "asleep" and world.state(demo.pid) == "running"
    human = cli("wake", str(demo.pid), "--no-cuda")
    assert human.returncode == 0, human.stderr
    assert "left on the GPU (--checkpointer none)" in human.stdout
    assert agent_state(cli, demo.pid) == "running" and demo.infer()["digest"] == reference
    assert world.calls(EVERY_STEP) == []


@pytest.mark.slow
def test_a_checkpointed_process_is_not_woken_with_no_cuda(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    refused = cli("wake", str(demo.pid), "--no-cuda")
    assert refused.returncode == ExitCode.USAGE
    assert "--checkpointer none cannot restore it; nothing was changed" in refused.stderr
    assert world.state(demo.pid) == "checkpointed" and agent_state(cli, demo.pid) == "asleep"
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    assert world.state(demo.pid) == "running"
