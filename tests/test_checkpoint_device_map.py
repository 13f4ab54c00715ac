"""``hibernate wake --device-map OLD=NEW`` restores onto other GPUs.

The map reaches the driver API's ``CUcheckpointRestoreArgs.gpuPairs`` and the
binary's ``--action restore --device-map`` (then ``--action unlock``): the
stand-in moves the process to the GPU the pairs name, and refuses pairs that
miss one of its GPUs, as the driver does. An incomplete map is refused before
anything changes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.checkpoint import room
from hibernate.errors import ExitCode, UsageError
from tests.standins.world import GIB, World


def test_a_map_is_resolved_to_uuids_and_checked_for_completeness() -> None:
    gpus = ["GPU-00000000-1111-2222-3333-000000000000", "GPU-00000001-1111-2222-3333-000000000001"]
    assert room.resolve_device_map({"0": "1"}, gpus) == {gpus[0]: gpus[1]}
    assert room.resolve_device_map({gpus[1]: "0"}, gpus) == {gpus[1]: gpus[0]}
    with pytest.raises(UsageError, match="there is no GPU 2"):
        room.resolve_device_map({"0": "2"}, gpus)
    with pytest.raises(UsageError, match="needs NVML"):
        room.resolve_device_map({"0": "1"}, None)
    with pytest.raises(UsageError, match="not a GPU of this machine"):
        room.resolve_device_map({"0": "GPU-ffffffff-1111-2222-3333-000000000000"}, gpus)
    with pytest.raises(UsageError, match="onto the same one"):
        room.resolve_device_map({"0": "1", gpus[1]: "1"}, gpus)
    with pytest.raises(UsageError, match="neither a GPU UUID"):
        room.resolve_device_map({"first": "1"}, gpus)
    assert room.uncovered({"GPU-a": "GPU-b"}, {1: ["GPU-a"], 2: ["GPU-a", "GPU-c"]}) == {2: ["GPU-c"]}
    assert room.gpus_of({"gpus": {"GPU-a": 1}, "drop": {"GPU-a": 2, "GPU-c": 3}}) == ["GPU-a", "GPU-c"]
    assert room.gpus_of({"gpus": None, "drop": None}) is None and room.gpus_of(None) is None


@pytest.mark.slow
def test_wake_onto_another_gpu_with_each_checkpointer(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    checkpointer_kind: str,
) -> None:
    world.add_gpu()
    demo = start_demo(size_mb=16)
    world.register(demo.pid, gpu=0, nbytes=3 * GIB)
    reference = demo.infer()["digest"]
    flag = ("--checkpointer", checkpointer_kind)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q", *flag).returncode == 0
    world.clear_calls()

    incomplete = cli("wake", str(demo.pid), "--device-map", "1=0", *flag)  # GPU 0 is not named
    assert incomplete.returncode == ExitCode.USAGE
    assert f"process {demo.pid} was on {world.gpus[0].uuid}" in incomplete.stderr
    assert "nothing was changed" in incomplete.stderr
    assert world.state(demo.pid) == "checkpointed" and world.calls() == []

    world.set_other_use(1, 78 * GIB)  # the new GPU is too full: the check counts the need there
    full = cli("wake", str(demo.pid), "--device-map", "0=1", *flag)
    assert full.returncode == ExitCode.UNSUPPORTED and f"{world.gpus[1].uuid} has 2.0 GiB free" in full.stderr
    assert world.state(demo.pid) == "checkpointed" and world.calls() == []
    world.set_other_use(1, 0)

    woken = cli("wake", str(demo.pid), "--device-map", f"{world.gpus[0].uuid}=1", "--json", *flag)
    assert woken.returncode == 0, woken.stderr
    assert world.gpu_of(demo.pid) == 1 and world.state(demo.pid) == "running"
    assert [(c, s) for c, s, _, _ in world.calls()] == [
        (checkpointer_kind, "restore"),
        (checkpointer_kind, "unlock"),
    ]
    assert woken.json()["cuda"]["memory"]["needed"] == {str(demo.pid): {world.gpus[1].uuid: 3 * GIB}}
    assert demo.infer()["digest"] == reference


def test_a_map_without_anything_checkpointed_is_refused(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0  # no CUDA holder
    refused = cli("wake", str(demo.pid), "--device-map", "0=0")
    assert (
        refused.returncode == ExitCode.USAGE
        and "no process of the targets is CUDA-checkpointed" in refused.stderr
    )
    assert cli("wake", str(demo.pid), "-q").returncode == 0
