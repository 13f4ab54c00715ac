"""A sleep of several CUDA processes without the NCCL settings a checkpoint needs is refused (item 4).

cuda-checkpoint cannot checkpoint CUDA IPC memory (NCCL P2P/NVLS/SHM buffers,
vLLM's custom all-reduce), so such a job fails or hangs: hibernate reads each
holder's /proc/PID/environ and refuses, with the exact fix, unless --force.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.checkpoint.nccl import NCCL_SAFE, VLLM_SAFE, multi_process_traps
from hibernate.errors import ExitCode
from tests.standins.world import World


def test_multi_process_traps_reads_each_environment() -> None:
    envs: dict[int, dict[str, str]] = {1: dict(NCCL_SAFE), 2: {"NCCL_P2P_DISABLE": "1"}}
    lines = {1: "python train.py", 2: "python train.py"}
    traps = multi_process_traps([1, 2], envs.__getitem__, lines.__getitem__)
    assert traps == {2: ["NCCL_NVLS_ENABLE is not 0", "NCCL_SHM_DISABLE is not 1"]}
    assert multi_process_traps([2], envs.__getitem__, lines.__getitem__) == {}  # one process shares nothing
    vllm = {1: "vllm serve m", 2: "vllm serve m --disable-custom-all-reduce"}
    both_safe = {1: {**NCCL_SAFE, **VLLM_SAFE}, 2: {**NCCL_SAFE, **VLLM_SAFE}}
    assert multi_process_traps([1, 2], both_safe.__getitem__, vllm.__getitem__) == {
        1: ["vLLM custom all-reduce is on (CUDA IPC buffers cannot be checkpointed)"]
    }


@pytest.mark.slow
def test_two_cuda_processes_without_the_nccl_settings_are_refused_unless_forced(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in NCCL_SAFE:
        monkeypatch.delenv(name)  # the targets below start as an unprepared NCCL job would
    # An env of their own: real processes (not forks), whose /proc/PID/environ is this one, without NCCL_*.
    first, second = (start_demo(size_mb=16, env={"NCCL_DEBUG": "WARN"}) for _ in range(2))
    world.register(first.pid)
    world.register(second.pid)
    refused = cli("sleep", str(first.pid), str(second.pid), "--to", str(work_dir))
    assert refused.returncode == ExitCode.UNSUPPORTED
    assert "2 CUDA processes would be checkpointed together" in refused.stderr
    assert f"process {first.pid}: NCCL_P2P_DISABLE is not 1, NCCL_NVLS_ENABLE is not 0" in refused.stderr
    assert "NCCL_P2P_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_SHM_DISABLE=1" in refused.stderr
    assert "--disable-custom-all-reduce" in refused.stderr and "nothing was changed" in refused.stderr
    assert world.calls() == [] and [world.state(d.pid) for d in (first, second)] == ["running"] * 2
    status = cli("status", str(first.pid), str(second.pid), "--json").json()
    assert [a["state"] for a in status["agents"]] == ["running", "running"]
    assert os.environ.get("NCCL_P2P_DISABLE") is None

    alone = cli("sleep", str(first.pid), "--to", str(work_dir), "-q")  # one CUDA process: no NCCL to share
    assert alone.returncode == 0, alone.stderr
    assert cli("wake", str(first.pid), "-q").returncode == 0

    forced = cli("sleep", str(first.pid), str(second.pid), "--to", str(work_dir), "--force", "-q")
    assert forced.returncode == 0, forced.stderr
    assert [world.state(d.pid) for d in (first, second)] == ["checkpointed"] * 2
    assert cli("wake", str(first.pid), str(second.pid), "-q").returncode == 0
