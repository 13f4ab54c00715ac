"""A group checkpoint across a real process tree (a parent and two children), with both checkpointers.

Sleep locks every process before checkpointing any; a failure injected at any
step of any process is undone from the real states, so every process runs
again, and the error names the process and the step. Wake restores every
process before unlocking any; a failed restore puts the restored ones back to
sleep, so the target stays asleep as a whole and the wake can be retried.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from hibernate import procinfo
from hibernate.checkpoint import detect, nvml, records
from hibernate.checkpoint.base import Checkpointer, CheckpointStepError, CudaState, StepTimeouts
from hibernate.checkpoint.binary import BinaryCheckpointer
from hibernate.checkpoint.detect import Holder, survey
from hibernate.checkpoint.driver import DriverCheckpointer
from hibernate.checkpoint.group import GroupCheckpoint
from hibernate.errors import (
    CudaCheckpointError,
    ExitCode,
    HibernateError,
    HibernateTimeoutError,
    NeedsRecoveryError,
    UnsupportedError,
)
from hibernate.procinfo import ProcessIdentity
from tests.standins.world import GIB, Tree, World, spec


def make(kind: str, timeouts: StepTimeouts | None = None) -> Checkpointer:
    return (
        DriverCheckpointer(timeouts=timeouts) if kind == "driver" else BinaryCheckpointer(timeouts=timeouts)
    )


@pytest.fixture
def tree(world: World, start_tree: Callable[..., Tree], runtime_dir: Path) -> Tree:
    target = start_tree(children=2)
    for pid in target.pids:
        world.register(pid, nbytes=2 * GIB)
    return target


def holders_of(tree: Tree, cp: Checkpointer) -> list[Holder]:
    found = survey(tree.pids, cp)
    assert [h.pid for h in found.holders] == tree.pids
    return found.holders


def states(world: World, tree: Tree) -> list[str]:
    return [world.state(pid) for pid in tree.pids]


def asleep(world: World, tree: Tree, kind: str) -> GroupCheckpoint:
    group = GroupCheckpoint(make(kind))
    group.sleep(holders_of(tree, group.checkpointer))
    assert states(world, tree) == ["checkpointed"] * 3
    world.clear_calls()
    return group


def test_sleep_locks_every_process_then_checkpoints_every_process(
    world: World, tree: Tree, checkpointer_kind: str
) -> None:
    group = GroupCheckpoint(make(checkpointer_kind))
    holders = holders_of(tree, group.checkpointer)
    assert {h.evidence for h in holders} == {"driver"}  # no GPU here: the driver answering is the sign
    report = group.sleep(holders)
    assert states(world, tree) == ["checkpointed"] * 3
    steps = [step for _, step, _, _ in world.calls()]
    assert sorted(steps[:3]) == ["lock"] * 3 and sorted(steps[3:]) == ["checkpoint"] * 3
    assert {pid for _, _, pid, _ in world.calls()} == set(tree.pids)
    assert report["status"] == "checkpointed" and report["checkpointer"]["name"] == checkpointer_kind
    for entry, pid in zip(report["processes"], tree.pids, strict=True):
        assert entry["pid"] == pid and entry["state"] == "checkpointed"
        assert set(entry["steps"]) == {"lock", "checkpoint"} and entry["seconds"] >= 0
        assert entry["gpus"] == {world.gpus[0].uuid: 2 * GIB}  # what NVML saw it hold, for the wake
    record = records.load(holders[0].identity)
    assert record is not None and record["gpus"] == {world.gpus[0].uuid: 2 * GIB}


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize(
    ("step", "code", "error"),
    [
        ("lock", "CUDA_ERROR_NOT_PERMITTED", CudaCheckpointError),
        ("checkpoint", "CUDA_ERROR_OPERATING_SYSTEM", CudaCheckpointError),
        ("checkpoint", "CUDA_ERROR_NOT_SUPPORTED", UnsupportedError),
    ],
)
def test_a_failure_at_any_sleep_step_of_any_process_is_undone(
    world: World,
    tree: Tree,
    checkpointer_kind: str,
    monkeypatch: pytest.MonkeyPatch,
    index: int,
    step: str,
    code: str,
    error: type[HibernateError],
) -> None:
    victim = tree.pids[index]
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec((step, victim, code)))
    group = GroupCheckpoint(make(checkpointer_kind))
    with pytest.raises(HibernateError) as failed:
        group.sleep(holders_of(tree, group.checkpointer))
    assert type(failed.value) is error
    assert failed.value.message.startswith(f"process {victim} ({step}): ")
    assert code in failed.value.message and "undone: every CUDA process runs again" in failed.value.message
    assert states(world, tree) == ["running"] * 3
    calls = world.calls()
    if step == "checkpoint":  # the others were checkpointed: restored, then unlocked
        others = [p for p in tree.pids if p != victim]
        assert sorted(p for _, s, p, r in calls if s == "restore" and r == "CUDA_SUCCESS") == sorted(others)
    assert all(records.load(h.identity) is None for h in holders_of(tree, group.checkpointer))


def test_a_lock_that_times_out_is_undone(
    world: World, tree: Tree, checkpointer_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("lock", tree.children[0], "hang")))
    group = GroupCheckpoint(make(checkpointer_kind), StepTimeouts(lock=0.3))
    with pytest.raises(HibernateTimeoutError) as timed_out:
        group.sleep(holders_of(tree, group.checkpointer))
    assert timed_out.value.exit_code == ExitCode.TIMEOUT
    assert f"process {tree.children[0]} (lock)" in timed_out.value.message
    assert "CUDA_ERROR_NOT_READY" in timed_out.value.message and "lock timeout" in timed_out.value.message
    assert states(world, tree) == ["running"] * 3


def test_when_the_undo_fails_too_it_says_what_is_left(
    world: World, tree: Tree, checkpointer_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, _, last = tree.pids
    faults = spec(
        ("checkpoint", last, "CUDA_ERROR_OPERATING_SYSTEM"), ("restore", first, "CUDA_ERROR_UNKNOWN")
    )
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", faults)
    group = GroupCheckpoint(make(checkpointer_kind))
    with pytest.raises(NeedsRecoveryError) as stuck:
        group.sleep(holders_of(tree, group.checkpointer))
    message = stuck.value.message
    assert f"process {last} (checkpoint)" in message and f"process {first} (restore)" in message
    assert states(world, tree) == ["checkpointed", "running", "running"]
    assert stuck.value.exit_code == ExitCode.NEEDS_RECOVERY


def test_wake_restores_every_process_then_unlocks_every_process(
    world: World, tree: Tree, checkpointer_kind: str
) -> None:
    group = asleep(world, tree, checkpointer_kind)
    report = group.wake(holders_of(tree, group.checkpointer))
    assert states(world, tree) == ["running"] * 3
    steps = [step for _, step, _, _ in world.calls()]
    assert sorted(steps[:3]) == ["restore"] * 3 and sorted(steps[3:]) == ["unlock"] * 3
    assert report["status"] == "restored" and report["memory"]["checked"]
    assert report["memory"]["shortfalls"] == [] and report["memory"]["unknown"] == []
    assert all(records.load(h.identity) is None for h in holders_of(tree, group.checkpointer))


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_failed_restore_puts_the_target_back_to_sleep(
    world: World, tree: Tree, checkpointer_kind: str, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    group = asleep(world, tree, checkpointer_kind)
    victim = tree.pids[index]
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("restore", victim, "CUDA_ERROR_NOT_PERMITTED")))
    with pytest.raises(CudaCheckpointError) as failed:
        group.wake(holders_of(tree, group.checkpointer))
    assert failed.value.message.startswith(f"process {victim} (restore): ")
    assert failed.value.message.endswith("the target stays asleep")
    assert states(world, tree) == ["checkpointed"] * 3
    assert not [c for c in world.calls() if c[1] == "unlock"]
    monkeypatch.delenv("HIBERNATE_STANDIN_FAULTS")
    group.wake(holders_of(tree, group.checkpointer))
    assert states(world, tree) == ["running"] * 3


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_failed_unlock_leaves_the_others_running_and_a_retry_finishes(
    world: World, tree: Tree, checkpointer_kind: str, monkeypatch: pytest.MonkeyPatch, index: int
) -> None:
    group = asleep(world, tree, checkpointer_kind)
    victim = tree.pids[index]
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("unlock", victim, "CUDA_ERROR_UNKNOWN")))
    with pytest.raises(CudaCheckpointError) as failed:
        group.wake(holders_of(tree, group.checkpointer))
    assert failed.value.message.startswith(f"process {victim} (unlock): ")
    assert [world.state(p) for p in tree.pids] == ["locked" if p == victim else "running" for p in tree.pids]
    monkeypatch.delenv("HIBERNATE_STANDIN_FAULTS")
    world.clear_calls()
    group.wake(holders_of(tree, group.checkpointer))
    assert states(world, tree) == ["running"] * 3
    assert [(s, p) for _, s, p, _ in world.calls()] == [("unlock", victim)]


def test_wake_finishes_an_interrupted_sleep_from_the_real_states(
    world: World, tree: Tree, checkpointer_kind: str
) -> None:
    for pid, state in zip(tree.pids, ("checkpointed", "locked", "running"), strict=True):
        world.set_state(pid, state)
    # Checkpointed without a record of what it held: only forced past the free-memory check.
    with pytest.raises(UnsupportedError, match=f"nothing measured what process {tree.pids[0]} will need"):
        GroupCheckpoint(make(checkpointer_kind)).wake(holders_of(tree, make(checkpointer_kind)))
    assert world.calls() == []
    group = GroupCheckpoint(make(checkpointer_kind), force=True)
    group.wake(holders_of(tree, group.checkpointer))
    assert states(world, tree) == ["running"] * 3
    parent, locked, _ = tree.pids
    calls = [(s, p) for _, s, p, _ in world.calls()]
    assert calls[0] == ("restore", parent) and sorted(calls[1:]) == sorted(
        [("unlock", parent), ("unlock", locked)]
    )
    assert group.wake(holders_of(tree, group.checkpointer))["status"] == "running (nothing to restore)"


def test_wake_checks_free_gpu_memory_before_restoring(
    world: World, tree: Tree, checkpointer_kind: str
) -> None:
    group = asleep(world, tree, checkpointer_kind)
    world.set_other_use(0, 76 * GIB)  # 4 GiB free; the three processes held 6 GiB
    with pytest.raises(UnsupportedError) as short:
        group.wake(holders_of(tree, group.checkpointer))
    assert (
        "not enough free GPU memory" in short.value.message and "nothing was changed" in short.value.message
    )
    assert f"processes {', '.join(map(str, tree.pids))} need 6.2 GiB" in short.value.message
    assert short.value.exit_code == ExitCode.UNSUPPORTED
    assert states(world, tree) == ["checkpointed"] * 3 and world.calls() == []
    assert not any(world.wedged(p) for p in tree.pids)
    world.set_other_use(0, 0)
    group.wake(holders_of(tree, group.checkpointer))
    assert states(world, tree) == ["running"] * 3


def test_restore_out_of_memory_without_nvml_needs_recovery(
    world: World, tree: Tree, checkpointer_kind: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    asleep(world, tree, checkpointer_kind)
    monkeypatch.setenv("HIBERNATE_LIBNVML", str(tmp_path / "absent.so"))
    world.set_other_use(0, 77 * GIB)  # room for one process of three
    with pytest.raises(UnsupportedError) as blind:  # free memory unknown: refused unless forced
        GroupCheckpoint(make(checkpointer_kind)).wake(holders_of(tree, make(checkpointer_kind)))
    assert "NVML (libnvidia-ml.so.1) cannot be loaded or started" in blind.value.message
    assert "--force" in (blind.value.hint or "") and blind.value.exit_code == ExitCode.UNSUPPORTED
    assert states(world, tree) == ["checkpointed"] * 3 and world.calls() == []
    group = GroupCheckpoint(make(checkpointer_kind), force=True)
    with pytest.raises(NeedsRecoveryError) as oom:
        group.wake(holders_of(tree, group.checkpointer))
    assert "CUDA_ERROR_OUT_OF_MEMORY" in oom.value.message and "cuda-checkpoint#44" in (oom.value.hint or "")
    assert states(world, tree) == ["checkpointed"] * 3  # the one restored is checkpointed again
    assert sum(world.wedged(p) for p in tree.pids) == 2


def test_wake_of_a_failed_process_changes_nothing(world: World, tree: Tree, checkpointer_kind: str) -> None:
    group = asleep(world, tree, checkpointer_kind)
    world.set_state(tree.children[1], "failed")
    with pytest.raises(NeedsRecoveryError, match="failed state") as failed:
        group.wake(holders_of(tree, group.checkpointer))
    assert failed.value.exit_code == ExitCode.NEEDS_RECOVERY and world.calls() == []


# -- who holds CUDA -------------------------------------------------------------


def test_survey_without_a_checkpointer_goes_by_device_files(
    monkeypatch: pytest.MonkeyPatch, tree: Tree
) -> None:
    monkeypatch.setattr(
        detect, "nvidia_device_files", lambda pid: ["/dev/nvidia0"] if pid == tree.pid else []
    )
    found = survey(tree.pids, None)
    assert [(h.pid, h.state, h.evidence) for h in found.holders] == [(tree.pid, None, "device files")]


def test_survey_sets_nvml_only_processes_aside_and_stops_on_doubt(
    world: World, tree: Tree, checkpointer_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, nvml_only, _ = tree.pids
    (world.dir / f"pid-{nvml_only}").unlink()  # device files, but no CUDA state in the driver
    monkeypatch.setattr(
        detect, "nvidia_device_files", lambda pid: ["/dev/nvidiactl"] if pid != tree.pids[2] else []
    )
    cp = make(checkpointer_kind)
    found = survey(tree.pids, cp)
    assert [(h.pid, h.evidence, h.state) for h in found.holders] == [
        (parent, "device files and driver", CudaState.RUNNING),
        (tree.pids[2], "driver", CudaState.RUNNING),
    ]
    assert [s["pid"] for s in found.skipped] == [nvml_only] and "NVML-only" in found.skipped[0]["reason"]
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("state", parent, "CUDA_ERROR_NOT_PERMITTED")))
    with pytest.raises(CheckpointStepError, match=f"process {parent} \\(state\\)"):
        survey(tree.pids, cp)


def test_survey_never_takes_the_caller_itself(world: World, checkpointer_kind: str) -> None:
    world.register(os.getpid())
    assert survey([os.getpid()], make(checkpointer_kind)).holders == []


def test_records_of_dead_processes_are_dropped(world: World, runtime_dir: Path) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    ghost = ProcessIdentity(dead.pid, 1)
    records.save(ghost, {"GPU-x": 1}, "driver")
    assert records.load(ghost) is not None
    me = procinfo.identity(os.getpid())
    assert me is not None
    records.save(me, None, "driver")
    mine = records.load(me)
    assert records.load(ghost) is None and mine is not None and mine["gpus"] is None
    records.drop(me)
    assert records.load(me) is None


def test_an_undo_that_would_run_out_of_gpu_memory_restores_nothing(
    world: World, tree: Tree, checkpointer_kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU filled up between the checkpoint and the undo: no restore is attempted (it would wedge)."""
    full = nvml.DeviceReading(
        "test",
        [
            nvml.Gpu(
                0, "GPU-full", "x", 80 * GIB, 0, 80 * GIB, True, False, 0, {p: 2 * GIB for p in tree.pids}
            )
        ],
    )
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("checkpoint", tree.pids[2], "CUDA_ERROR_UNKNOWN")))
    group = GroupCheckpoint(make(checkpointer_kind), gpus=lambda: full)
    with pytest.raises(NeedsRecoveryError) as stuck:
        group.sleep(holders_of(tree, group.checkpointer))
    message = stuck.value.message
    assert "not restored, GPU-full has 0 B free" in message and "(unlock)" not in message
    assert states(world, tree) == ["checkpointed", "checkpointed", "running"]
    assert not [c for c in world.calls() if c[1] == "restore"]


def test_a_process_nvml_cannot_see_is_unknown_not_free(
    world: World, tree: Tree, checkpointer_kind: str
) -> None:
    """In another pid namespace NVML lists no usage for the pid: the wake must not take that for zero."""
    blind = nvml.DeviceReading("test", [nvml.Gpu(0, "GPU-x", "x", 80 * GIB, 80 * GIB, 0, True, False, 0, {})])
    group = GroupCheckpoint(make(checkpointer_kind), gpus=lambda: blind)
    report = group.sleep(holders_of(tree, group.checkpointer))
    assert [p["gpus"] for p in report["processes"]] == [None, None, None]
    assert report["drop"] is None  # the GPU's used memory did not move either: nothing was measured
    with pytest.raises(UnsupportedError, match="nothing measured what processes"):
        GroupCheckpoint(make(checkpointer_kind)).wake(holders_of(tree, group.checkpointer))
    assert states(world, tree) == ["checkpointed"] * 3
    woken = GroupCheckpoint(make(checkpointer_kind), force=True).wake(holders_of(tree, group.checkpointer))
    assert woken["memory"]["checked"] and woken["memory"]["unknown"] == tree.pids


def test_after_step_hook_sees_each_step_and_a_failure_there_is_undone(
    world: World, tree: Tree, checkpointer_kind: str
) -> None:
    seen: list[str] = []

    def hook(step: str) -> None:
        seen.append(step)
        if step == "lock" and len(seen) == 1:
            raise InjectedError("after every lock")

    group = GroupCheckpoint(make(checkpointer_kind), after_step=hook)
    with pytest.raises(InjectedError):
        group.sleep(holders_of(tree, group.checkpointer))
    assert states(world, tree) == ["running"] * 3
    group.sleep(holders_of(tree, group.checkpointer))
    group.wake(holders_of(tree, group.checkpointer))
    assert seen == ["lock", "lock", "checkpoint", "restore", "unlock"]


class InjectedError(HibernateError):
    pass
