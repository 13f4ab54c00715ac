"""``hibernate sleep/wake`` with the CUDA stage, end to end: real CLI, real targets, the stand-in driver.

Each target process is registered with the stand-in, so the driver answers for
it as for a CUDA process; the sleep and wake reports, the stand-in's states,
the agents' states and the exit codes are all checked, with both checkpointers.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate import orchestrator
from hibernate.checkpoint import detect
from hibernate.errors import ExitCode, UnsupportedError
from hibernate.operation.cuda import CudaStage
from tests.standins.world import GIB, Tree, World, spec


def agent_state(cli: Callable[..., Any], pid: int) -> str:
    state: str = cli("status", str(pid), "--json").json()["agents"][0]["state"]
    return state


@pytest.mark.slow
def test_sleep_and_wake_of_a_demo_with_each_checkpointer(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    checkpointer_kind: str,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, nbytes=3 * GIB)
    reference = demo.infer()["digest"]
    flag = ("--checkpointer", checkpointer_kind)
    asleep = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json", *flag)
    assert asleep.returncode == 0, asleep.stderr
    cuda = asleep.json()["cuda"]
    assert cuda["status"] == "checkpointed" and cuda["checkpointer"]["name"] == checkpointer_kind
    (entry,) = cuda["processes"]
    assert entry["pid"] == demo.pid and entry["state"] == "checkpointed"
    assert set(entry["steps"]) == {"lock", "checkpoint"} and entry["gpus"] == {world.gpus[0].uuid: 3 * GIB}
    assert world.state(demo.pid) == "checkpointed" and agent_state(cli, demo.pid) == "asleep"

    human = cli("status", str(demo.pid))
    assert "asleep" in human.stdout

    woken = cli("wake", str(demo.pid), "--json", *flag)
    assert woken.returncode == 0, woken.stderr
    cuda = woken.json()["cuda"]
    assert cuda["status"] == "restored" and cuda["processes"][0]["state"] == "running"
    assert set(cuda["processes"][0]["steps"]) == {"restore", "unlock"} and cuda["memory"]["checked"]
    assert world.state(demo.pid) == "running" and agent_state(cli, demo.pid) == "running"
    assert demo.infer()["digest"] == reference
    assert [s for c, s, _, _ in world.calls() if c == checkpointer_kind] == [
        "lock",
        "checkpoint",
        "restore",
        "unlock",
    ]


@pytest.mark.slow
def test_auto_takes_the_driver_api_and_falls_back_to_the_binary(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    asleep = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json")
    assert asleep.returncode == 0, asleep.stderr
    assert asleep.json()["cuda"]["checkpointer"]["name"] == "driver"
    old_driver = {"HIBERNATE_LIBCUDA": str(world.built.libcuda_old)}  # libcuda without cuCheckpoint*
    woken = cli("wake", str(demo.pid), "--json", env=old_driver)
    assert woken.returncode == 0, woken.stderr
    assert woken.json()["cuda"]["checkpointer"]["name"] == "binary"
    human = cli("sleep", str(demo.pid), "--to", str(work_dir))
    assert human.returncode == 0 and f"cuda: checkpointed: {demo.pid} checkpointed" in human.stdout
    assert cli("wake", str(demo.pid), "-q").returncode == 0


@pytest.mark.slow
def test_a_tree_of_three_processes_locks_all_then_checkpoints_all_and_undoes_a_failure(
    world: World,
    start_tree: Callable[..., Tree],
    cli: Callable[..., Any],
    work_dir: Path,
    checkpointer_kind: str,
) -> None:
    tree = start_tree(children=2, agent=True)
    for pid in tree.pids:
        world.register(pid)
    flag = ("--checkpointer", checkpointer_kind)
    victim = tree.children[1]
    failed = cli(
        "sleep",
        str(tree.pid),
        "--to",
        str(work_dir),
        *flag,
        env={"HIBERNATE_STANDIN_FAULTS": spec(("checkpoint", victim, "CUDA_ERROR_OPERATING_SYSTEM"))},
    )
    assert failed.returncode == ExitCode.CUDA_CHECKPOINT, failed.stderr
    assert (
        f"process {victim} (checkpoint)" in failed.stderr and "CUDA_ERROR_OPERATING_SYSTEM" in failed.stderr
    )
    assert [world.state(p) for p in tree.pids] == ["running"] * 3
    assert agent_state(cli, tree.pid) == "running"  # the agent's spill was undone too

    world.clear_calls()
    asleep = cli("sleep", str(tree.pid), "--to", str(work_dir), "--json", *flag)
    assert asleep.returncode == 0, asleep.stderr
    steps = [s for _, s, _, _ in world.calls()]
    assert steps == ["lock"] * 3 + ["checkpoint"] * 3
    assert [p["pid"] for p in asleep.json()["cuda"]["processes"]] == tree.pids
    woken = cli("wake", str(tree.pid), "--json", *flag)
    assert woken.returncode == 0, woken.stderr
    assert [s for _, s, _, _ in world.calls()][6:] == ["restore"] * 3 + ["unlock"] * 3
    assert [world.state(p) for p in tree.pids] == ["running"] * 3 and agent_state(cli, tree.pid) == "running"


def test_lock_timeout_exits_timeout_and_leaves_everything_running(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    checkpointer_kind: str,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    result = cli(
        "sleep",
        str(demo.pid),
        "--to",
        str(work_dir),
        "--timeout",
        "0.5",
        "--json",
        "--checkpointer",
        checkpointer_kind,
        env={"HIBERNATE_STANDIN_FAULTS": spec(("lock", demo.pid, "hang"))},
    )
    assert result.returncode == ExitCode.TIMEOUT
    error = result.json()["error"]
    assert error["exit_name"] == "TIMEOUT" and f"process {demo.pid} (lock)" in error["message"]
    assert world.state(demo.pid) == "running" and agent_state(cli, demo.pid) == "running"


@pytest.mark.slow
def test_missing_checkpointers_and_old_drivers_are_refused_before_anything_changes(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, tmp_path: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    sleep = ("sleep", str(demo.pid), "--to", str(work_dir))
    cases = [
        (
            ("--checkpointer", "binary", "--cuda-checkpoint", str(tmp_path / "none")),
            {},
            "not an executable file",
        ),
        (
            ("--checkpointer", "binary"),
            {"HIBERNATE_CUDA_CHECKPOINT": "", "PATH": str(tmp_path)},
            "no cuda-checkpoint",
        ),
        (("--checkpointer", "driver"), {"HIBERNATE_LIBCUDA": str(world.built.libcuda_old)}, "driver 570"),
        (("--checkpointer", "binary"), {"HIBERNATE_STANDIN_CUDA_VERSION": "12020"}, "Insufficient driver"),
        (("--checkpointer", "binary"), {"HIBERNATE_STANDIN_CUDA_VERSION": "12040"}, "only --toggle"),
    ]
    for flags, env, words in cases:
        result = cli(*sleep, *flags, env=env)
        assert result.returncode == ExitCode.UNSUPPORTED, (flags, result.stderr)
        assert words in result.stderr, (flags, result.stderr)
    bad = cli(*sleep, "--checkpointer", "magic")
    assert bad.returncode == ExitCode.USAGE and "--checkpointer must be one of" in bad.stderr
    assert world.state(demo.pid) == "running" and agent_state(cli, demo.pid) == "running"
    assert world.calls() == [] and not list(work_dir.iterdir())


def test_neither_checkpointer_with_a_cuda_holder_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HIBERNATE_LIBCUDA", str(tmp_path / "libcuda.so.1"))
    monkeypatch.delenv("HIBERNATE_CUDA_CHECKPOINT", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(detect, "nvidia_device_files", lambda pid: ["/dev/nvidia0"])
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with pytest.raises(UnsupportedError) as neither:
            CudaStage(orchestrator.Options()).require([holder.pid])
    finally:
        holder.kill()
        holder.wait()
    message = neither.value.message
    assert f"process(es) {holder.pid} hold a CUDA context and neither" in message
    assert "driver API: cannot load" in message and "no cuda-checkpoint executable" in message
    assert neither.value.exit_code == ExitCode.UNSUPPORTED


def test_failed_state_is_refused_by_sleep_and_wake(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    checkpointer_kind: str,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, state="failed")
    flag = ("--checkpointer", checkpointer_kind)
    asleep = cli("sleep", str(demo.pid), "--to", str(work_dir), *flag)
    assert (
        asleep.returncode == ExitCode.CUDA_CHECKPOINT and "failed state; nothing was changed" in asleep.stderr
    )
    assert agent_state(cli, demo.pid) == "running"
    woken = cli("wake", str(demo.pid), *flag)
    assert woken.returncode == ExitCode.NEEDS_RECOVERY and "only restarting" in woken.stderr


@pytest.mark.slow
def test_restore_without_enough_gpu_memory(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, tmp_path: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, nbytes=10 * GIB)
    reference = demo.infer()["digest"]
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    world.set_other_use(0, 75 * GIB)
    refused = cli("wake", str(demo.pid))
    assert refused.returncode == ExitCode.UNSUPPORTED
    assert "not enough free GPU memory" in refused.stderr and "the target stays asleep" in refused.stderr
    assert world.state(demo.pid) == "checkpointed" and not world.wedged(demo.pid)
    assert agent_state(cli, demo.pid) == "asleep"
    no_nvml = {"HIBERNATE_LIBNVML": str(tmp_path / "none.so")}
    blind = cli("wake", str(demo.pid), env=no_nvml)  # free memory unknown: refused unless forced
    assert (
        blind.returncode == ExitCode.UNSUPPORTED and "cannot tell whether the GPUs have room" in blind.stderr
    )
    assert world.state(demo.pid) == "checkpointed" and not world.wedged(demo.pid)
    blind = cli("wake", str(demo.pid), "--force", env=no_nvml)
    assert blind.returncode == ExitCode.NEEDS_RECOVERY and "CUDA_ERROR_OUT_OF_MEMORY" in blind.stderr
    assert world.state(demo.pid) == "checkpointed" and world.wedged(demo.pid)
    assert agent_state(cli, demo.pid) == "asleep"
    assert demo.alive()
    # What the driver does to such a process (cuda-checkpoint#44) is beyond repair; start afresh.
    world.register(demo.pid, nbytes=10 * GIB, state="checkpointed")
    world.set_other_use(0, 0)
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    assert demo.infer()["digest"] == reference


@pytest.mark.slow
def test_wake_decides_from_real_states_whatever_the_agent_says(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, state="checkpointed")  # CUDA checkpointed, agent running
    refused = cli("sleep", str(demo.pid), "--to", str(work_dir))
    assert refused.returncode == ExitCode.WRONG_STATE and "is CUDA-checkpointed" in refused.stderr
    assert f"hibernate wake {demo.pid}" in refused.stderr
    unmeasured = cli("wake", str(demo.pid))  # checkpointed by another tool: nothing says what it needs
    assert unmeasured.returncode == ExitCode.UNSUPPORTED and "pass --force" in unmeasured.stderr
    assert world.state(demo.pid) == "checkpointed"
    woken = cli("wake", str(demo.pid), "--json", "--force")
    assert woken.returncode == 0, woken.stderr
    assert woken.json()["processes"] == [] and woken.json()["cuda"]["status"] == "restored"
    assert world.state(demo.pid) == "running"
    nothing = cli("wake", str(demo.pid))
    assert nothing.returncode == ExitCode.WRONG_STATE and "nothing to wake" in nothing.stderr

    reference = demo.infer()["digest"]
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    world.set_state(demo.pid, "running")  # an interrupted wake: CUDA back, agent still asleep
    woken = cli("wake", str(demo.pid), "--json")
    assert woken.returncode == 0, woken.stderr
    assert woken.json()["cuda"]["status"] == "running (nothing to restore)"
    assert demo.infer()["digest"] == reference


@pytest.mark.slow
def test_when_cuda_cannot_be_undone_the_agents_stay_asleep_for_a_later_wake(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    checkpointer_kind: str,
) -> None:
    demo = start_demo(size_mb=16)
    helper = start_demo(size_mb=16)
    world.register(demo.pid)
    world.register(helper.pid)
    reference = demo.infer()["digest"]
    faults = spec(
        ("checkpoint", helper.pid, "CUDA_ERROR_OPERATING_SYSTEM"), ("restore", demo.pid, "CUDA_ERROR_UNKNOWN")
    )
    flag = ("--checkpointer", checkpointer_kind)
    stuck = cli(
        "sleep",
        str(demo.pid),
        str(helper.pid),
        "--to",
        str(work_dir),
        *flag,
        env={"HIBERNATE_STANDIN_FAULTS": faults},
    )
    assert stuck.returncode == ExitCode.NEEDS_RECOVERY, stuck.stderr
    assert (
        f"process {helper.pid} (checkpoint)" in stuck.stderr
        and f"process {demo.pid} (restore)" in stuck.stderr
    )
    assert world.state(demo.pid) == "checkpointed" and agent_state(cli, demo.pid) == "asleep"
    woken = cli("wake", str(demo.pid), str(helper.pid), *flag)
    assert woken.returncode == 0, woken.stderr
    assert world.state(demo.pid) == world.state(helper.pid) == "running"
    assert demo.infer()["digest"] == reference


@pytest.mark.slow
def test_wake_without_a_checkpointer_after_a_cuda_sleep_is_refused(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, tmp_path: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    gone = {
        "HIBERNATE_LIBCUDA": str(tmp_path / "x.so"),
        "HIBERNATE_CUDA_CHECKPOINT": "",
        "PATH": str(tmp_path),
    }
    refused = cli("wake", str(demo.pid), env=gone)
    assert refused.returncode == ExitCode.UNSUPPORTED
    assert "checkpointed by `hibernate sleep`" in refused.stderr and agent_state(cli, demo.pid) == "asleep"
    assert cli("wake", str(demo.pid), "-q").returncode == 0
