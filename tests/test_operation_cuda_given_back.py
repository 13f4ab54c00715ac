"""Reports say what each sleep really gave back per GPU, beside the tracked bytes.

NVML's ``used`` of the whole GPU before and after the sleep is the witness
that works in containers too; per process where NVML lists the pid.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate import orchestrator
from hibernate.checkpoint import nvml
from hibernate.operation.cuda import CudaStage
from tests.standins.world import GIB, World


def gpu(index: int, used: int, processes: dict[int, int]) -> nvml.Gpu:
    return nvml.Gpu(
        index, f"GPU-{index}", "G", 80 * GIB, 80 * GIB - used, used, True, False, index, processes
    )


def test_given_back_per_gpu_and_per_listed_process() -> None:
    before = nvml.DeviceReading("d", [gpu(0, 30 * GIB, {7: 20 * GIB, 99: 10 * GIB}), gpu(1, 5 * GIB, {})])
    after = nvml.DeviceReading("d", [gpu(0, 11 * GIB, {99: 10 * GIB}), gpu(1, 6 * GIB, {})])
    first, second = nvml.given_back(before, after, [7, 8], {"GPU-0": 18 * GIB})
    assert first == {
        "index": 0,
        "uuid": "GPU-0",
        "name": "G",
        "used_before_bytes": 30 * GIB,
        "used_after_bytes": 11 * GIB,
        "given_back_bytes": 19 * GIB,
        "tracked_bytes": 18 * GIB,
        "processes": [{"pid": 7, "before_bytes": 20 * GIB, "after_bytes": None}],  # 99 is not the target's
    }
    assert second["given_back_bytes"] == -GIB and second["tracked_bytes"] == 0 and second["processes"] == []
    assert nvml.given_back(before, after, [7], None)[0]["tracked_bytes"] is None


def test_the_stage_places_the_tracked_bytes_on_their_gpu(world: World) -> None:
    world.add_gpu()

    def process(visible: str) -> subprocess.Popen[bytes]:
        code = "import sys; sys.stdin.read()"
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
        return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, env=env)

    second, mig = process("1"), process("MIG-1")  # their environ is what places their cuda:0
    try:
        stage = CudaStage(orchestrator.Options())
        assert stage.given_back([second.pid], {}) is None  # nothing was read before
        stage.read_gpus_before()
        world.set_other_use(1, 2 * GIB)
        report = stage.given_back([second.pid], {second.pid: {"cuda:0": 5 * GIB}})
        assert report is not None
        assert [(g["uuid"], g["tracked_bytes"], g["given_back_bytes"]) for g in report] == [
            (world.gpus[0].uuid, 0, 0),
            (world.gpus[1].uuid, 5 * GIB, -2 * GIB),
        ]
        unplaced = stage.given_back([mig.pid], {mig.pid: {"cuda:0": 1}}) or []
        assert {g["tracked_bytes"] for g in unplaced} == {None}  # cannot be placed: said, not guessed
    finally:
        for proc in (second, mig):
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sleep_reports_what_each_gpu_gave_back(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, tmp_path: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, nbytes=3 * GIB)
    world.set_other_use(0, GIB)
    asleep = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json")
    assert asleep.returncode == 0, asleep.stderr
    (entry,) = asleep.json()["gpus"]
    assert entry["used_before_bytes"] == 4 * GIB and entry["used_after_bytes"] == GIB
    assert entry["given_back_bytes"] == 3 * GIB and entry["tracked_bytes"] == 0  # the demo's pools are on CPU
    assert entry["processes"] == [{"pid": demo.pid, "before_bytes": 3 * GIB, "after_bytes": None}]
    assert asleep.json()["cuda"]["drop"] == {world.gpus[0].uuid: 3 * GIB}
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    table = cli("sleep", str(demo.pid), "--to", str(work_dir))
    assert table.returncode == 0, table.stderr
    assert (
        f"gpu 0 ({world.gpus[0].uuid}): used 4.0 GiB -> 1.0 GiB, 3.0 GiB given back (tracked 0 B); "
        f"pid {demo.pid} 3.0 GiB -> none" in table.stdout
    )
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    blind = cli(
        "sleep",
        str(demo.pid),
        "--to",
        str(work_dir),
        "--json",
        env={"HIBERNATE_LIBNVML": str(tmp_path / "x")},
    )
    assert blind.returncode == 0 and blind.json()["gpus"] is None
    assert (
        cli("wake", str(demo.pid), "-q", "--force", env={"HIBERNATE_LIBNVML": str(tmp_path / "x")}).returncode
        == 0
    )


def test_a_sleep_places_the_bytes_its_spills_counted() -> None:
    """A sleep's hello leaves the pools uncounted: what each GPU's tracked bytes are compared with is
    what the spill counted on each device, kept out of the JSON report (which shows the GPUs)."""
    from hibernate.operation.engine import _spilled_bytes
    from hibernate.operation.reports import ProcessSleep, UnitReport

    spills = {7: {"cuda:0": 5 * GIB, "cuda:1": GIB}, 8: {}}
    sleeps = [
        ProcessSleep.from_answers(pid, "p", {"spill": {"device_bytes": b}}) for pid, b in spills.items()
    ]
    assert _spilled_bytes([], [UnitReport(sleeps=sleeps)]) == {7: {"cuda:0": 5 * GIB, "cuda:1": GIB}}
    assert "device_bytes" not in sleeps[0].to_wire()
    older = ProcessSleep.from_answers(9, "p", {"spill": {"device_bytes": "?"}})  # not counted: unknown
    assert older.device_bytes == {}
