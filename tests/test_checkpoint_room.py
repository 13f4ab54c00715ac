"""The wake's free-memory check cannot pass silently.

Each GPU must hold what comes back: the CUDA state (the drop of the GPU's
``used`` memory between the sleep's lock and checkpoint, kept in each
process's record, or what NVML saw the process hold) plus what the pools map
back. Not enough: refused, the target stays asleep, the message says how much
is missing on which GPU. Unknown: refused unless forced.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import pytest

from hibernate import orchestrator, procinfo
from hibernate.checkpoint import nvml, records, room
from hibernate.checkpoint.detect import survey
from hibernate.checkpoint.driver import DriverCheckpointer
from hibernate.checkpoint.group import HEADROOM_BYTES, GroupCheckpoint
from hibernate.errors import ExitCode, UnsupportedError, UsageError
from hibernate.operation.cuda import CudaStage
from tests.standins.world import GIB, Tree, World

A, B, C = "GPU-a", "GPU-b", "GPU-c"


# -- the pure parts ------------------------------------------------------------------


def test_device_drop_is_none_when_nothing_fell() -> None:
    assert room.device_drop({A: 10, B: 5}, {A: 4, B: 5}) == {A: 6}
    assert room.device_drop({A: 10}, {A: 10}) is None  # measured nothing: unknown, not zero
    assert room.device_drop({}, {A: 1}) is None


def test_cuda_needs_takes_the_larger_of_drop_and_what_nvml_saw_once_per_cohort() -> None:
    cohort = [1, 2]
    found: dict[int, Any] = {
        1: {"gpus": {A: 3 * GIB}, "drop": {A: 10 * GIB, B: 2 * GIB}, "cohort": cohort},
        2: {"gpus": {A: 4 * GIB}, "drop": {A: 10 * GIB, B: 2 * GIB}, "cohort": cohort},
        3: {"gpus": None, "drop": None, "cohort": [3]},
        4: None,
        5: {"gpus": {C: 1 * GIB}, "drop": None, "cohort": [5]},
    }
    needs, unknown = room.cuda_needs(found)
    assert unknown == [3, 4]
    # GPU-a: the drop (10) beats what NVML saw (3 + 4); the drop is counted once for the pair.
    assert needs[1] == {A: 6 * GIB, B: 2 * GIB} and needs[2] == {A: 4 * GIB}
    assert sum(n.get(A, 0) for n in needs.values()) == 10 * GIB
    assert needs[5] == {C: 1 * GIB}
    seen_more = {1: {"gpus": {A: 12 * GIB}, "drop": {A: 10 * GIB}, "cohort": [1]}}
    assert room.cuda_needs(seen_more)[0] == {1: {A: 12 * GIB}}


def test_a_cuda_device_is_placed_through_cuda_visible_devices() -> None:
    gpus = ["GPU-0000aaaa-1", "GPU-0000bbbb-2", "GPU-0000cccc-3"]
    assert room.device_uuid("cuda:1", {}, gpus) == gpus[1]
    assert room.device_uuid("cuda:0", {"CUDA_VISIBLE_DEVICES": "2,0"}, gpus) == gpus[2]
    assert room.device_uuid("cuda:1", {"CUDA_VISIBLE_DEVICES": "2,0"}, gpus) == gpus[0]
    assert room.device_uuid("cuda:0", {"CUDA_VISIBLE_DEVICES": "GPU-0000bbbb"}, gpus) == gpus[1]
    assert room.device_uuid("cuda:0", {"CUDA_VISIBLE_DEVICES": "GPU-0000"}, gpus) is None  # ambiguous
    assert room.device_uuid("cuda:0", {"CUDA_VISIBLE_DEVICES": "MIG-1234"}, gpus) is None
    assert room.device_uuid("cuda:2", {"CUDA_VISIBLE_DEVICES": "0,1"}, gpus) is None
    assert room.device_uuid("cuda:5", {}, gpus) is None
    needs, unknown = room.pool_needs(
        {7: {"cuda:0": 5, "cuda:1": 6}, 8: {"cuda:0": 1}}, {8: {"CUDA_VISIBLE_DEVICES": "MIG-x"}}, gpus
    )
    assert needs == {7: {gpus[0]: 5, gpus[1]: 6}} and unknown == [8]


def test_needs_combine_and_follow_a_device_map() -> None:
    total = room.combine({1: {A: 5}}, {1: {A: 2, B: 1}, 2: {B: 3}})
    assert total == {1: {A: 7, B: 1}, 2: {B: 3}}
    assert room.remap(total, {A: C}) == {1: {C: 7, B: 1}, 2: {B: 3}}
    assert room.remap(total, None) is total


# -- the check, on the stand-in --------------------------------------------------------


@pytest.fixture
def tree(world: World, start_tree: Callable[..., Tree], runtime_dir: Any) -> Tree:
    target = start_tree(children=1)
    for pid in target.pids:
        world.register(pid, nbytes=4 * GIB)
    return target


def nvml_without_pids() -> Any:
    """NVML as inside a container: each GPU's used memory is read, the process list is empty."""
    snapshot = nvml.read_gpus()
    assert snapshot is not None
    return nvml.DeviceReading(
        snapshot.driver_version, [dataclasses.replace(g, processes={}) for g in snapshot.gpus]
    )


def test_the_drop_at_checkpoint_is_kept_and_refuses_a_wake_that_would_not_fit(
    world: World, tree: Tree
) -> None:
    phase = GroupCheckpoint(DriverCheckpointer(), gpus=nvml_without_pids)
    report = phase.sleep(survey(tree.pids, phase.checkpointer).holders)
    uuid = world.gpus[0].uuid
    assert report["drop"] == {uuid: 8 * GIB} and [p["gpus"] for p in report["processes"]] == [None, None]
    for pid in tree.pids:
        record = records.load(procinfo.identity(pid))  # type: ignore[arg-type]
        assert record is not None and record["drop"] == {uuid: 8 * GIB} and record["cohort"] == tree.pids
    world.set_other_use(0, 75 * GIB)  # 5 GiB free, 8 GiB (+ headroom) needed
    wake = GroupCheckpoint(DriverCheckpointer(), gpus=nvml_without_pids)
    with pytest.raises(UnsupportedError) as short:
        wake.wake(survey(tree.pids, wake.checkpointer).holders)
    message = short.value.message
    assert short.value.exit_code == ExitCode.UNSUPPORTED
    missing = 8 * GIB + HEADROOM_BYTES - 5 * GIB  # the pair's drop is counted once, with its headroom
    assert f"{uuid} has 5.0 GiB free" in message and f"{missing / GIB:.1f} GiB missing" in message
    assert "the target stays asleep" in message
    assert [world.state(p) for p in tree.pids] == ["checkpointed"] * 2 and world.calls(("restore",)) == []
    world.set_other_use(0, 70 * GIB)
    woken = wake.wake(survey(tree.pids, wake.checkpointer).holders)
    assert woken["memory"]["needed"] == {tree.pids[0]: {uuid: 8 * GIB}}
    assert [world.state(p) for p in tree.pids] == ["running"] * 2


def test_the_pools_count_with_the_cuda_state(world: World, tree: Tree) -> None:
    phase = GroupCheckpoint(DriverCheckpointer())
    phase.sleep(survey(tree.pids, phase.checkpointer).holders)
    world.set_other_use(0, 64 * GIB)  # 16 GiB free: the CUDA state (8) fits, with 10 of pools it does not
    stage = CudaStage(orchestrator.Options(checkpointer_kind="driver"))
    with pytest.raises(UnsupportedError, match="not enough free GPU memory to restore") as short:
        stage.wake(tree.pids, after_restore=lambda: None, pool_bytes={tree.pid: {"cuda:0": 10 * GIB}})
    assert "GiB missing" in short.value.message
    assert [world.state(p) for p in tree.pids] == ["checkpointed"] * 2
    woken = stage.wake(tree.pids, after_restore=lambda: None, pool_bytes={tree.pid: {"cuda:0": 6 * GIB}})
    assert woken["status"] == "restored"
    assert woken["memory"]["needed"][tree.pid] == {world.gpus[0].uuid: 4 * GIB + 6 * GIB}


def test_the_pools_own_remap_is_checked_without_a_cuda_restore(world: World, runtime_dir: Any) -> None:
    me = os.getpid()  # not a CUDA process of the stand-in: nothing to restore, only the pools
    stage = CudaStage(orchestrator.Options(checkpointer_kind="none"))
    with pytest.raises(UnsupportedError, match="GiB missing"):
        stage.wake([me], after_restore=lambda: None, pool_bytes={me: {"cuda:0": 81 * GIB}})
    report = stage.wake([me], after_restore=lambda: None, pool_bytes={me: {"cuda:0": 1 * GIB}})
    assert report["memory"]["checked"] and report["memory"]["needed"] == {me: {world.gpus[0].uuid: GIB}}
    # No GPU bytes at all (a CPU target): nothing to check, and no NVML needed.
    assert "memory" not in stage.wake([me], after_restore=lambda: None, pool_bytes={me: {}})


def test_unknown_free_memory_is_refused_unless_forced(
    world: World, runtime_dir: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    monkeypatch.setenv("HIBERNATE_LIBNVML", str(tmp_path / "absent.so"))
    me = os.getpid()
    stage = CudaStage(orchestrator.Options(checkpointer_kind="none"))
    with pytest.raises(UnsupportedError, match="cannot tell whether the GPUs have room") as blind:
        stage.wake([me], after_restore=lambda: None, pool_bytes={me: {"cuda:0": GIB}})
    assert "pass --force" in (blind.value.hint or "")
    forced = CudaStage(orchestrator.Options(checkpointer_kind="none", force=True))
    report = forced.wake([me], after_restore=lambda: None, pool_bytes={me: {"cuda:0": GIB}})
    assert report["memory"] == {
        "checked": False,
        "reason": "NVML is not available",
        "needed": {},
        "shortfalls": [],
        "unknown": [me],
    }


def test_device_map_must_be_well_formed() -> None:
    from hibernate.operation.options import options_from_flags, parse_device_map

    assert parse_device_map("0=1, GPU-a=GPU-b") == {"0": "1", "GPU-a": "GPU-b"}
    for bad in ("0", "0=", "=1", "0=1,0=2"):
        with pytest.raises(UsageError, match="--device-map"):
            parse_device_map(bad)
    with pytest.raises(UsageError, match="--checkpointer none restores none"):
        options_from_flags(no_cuda=True, device_map="0=1")
