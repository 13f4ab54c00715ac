"""scripts/gpu-check --dry-run walks every check against the stand-ins and prints the real run's JSON shape.

The script is what validates hibernate on a real GPU; its dry run is how CI
keeps it working without one (issue 12, item 10).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "gpu-check"


def load_script() -> ModuleType:
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_a_check_that_measured_nothing_fails() -> None:
    gpu_check = load_script()
    reading = {"used_before_bytes": 0, "used_after_bytes": 0, "given_back_bytes": 0, "tracked_bytes": 0}
    assert not gpu_check.judge_freed([reading], lambda g: True)  # before-reading 0: measured nothing
    assert not gpu_check.judge_freed(None, lambda g: True)  # no NVML: nothing measured either
    assert gpu_check.judge_freed([{**reading, "used_before_bytes": 1}], lambda g: True)
    assert not gpu_check.judge_freed([{**reading, "used_before_bytes": 1}], lambda g: False)


@pytest.mark.slow
def test_the_dry_run_walks_every_check_and_writes_its_json(tmp_path: Path, runtime_dir: Path) -> None:
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=480,
        cwd=REPO,
    )
    document = json.loads(out.read_text())
    assert json.loads(proc.stdout) == document
    assert proc.returncode == 0 and document["ok"], document.get("error") or document.get("checks_failed")
    environment = document["environment"]
    assert {"kernel", "container_runtime", "driver", "cuda", "torch", "torch_cuda", "gpu_models"} <= set(
        environment
    )
    assert environment["driver"] == "580.95.05" and environment["gpu_models"] == ["StandIn-H200"]
    assert [c["checkpointer"] for c in document["cycles"]] == ["none", "driver", "binary"]
    for entry in document["cycles"]:
        assert entry["checks"]["gpu_freed"] and entry["checks"]["bit_exact"], entry["checks"]
        assert entry["sleep"]["report"]["gpus"][0]["used_before_bytes"] > 0
        assert {"spill_gb_per_s", "restore_of_disk_read", "restore_of_host_to_device"} <= set(entry["speeds"])
    assert (
        document["cycles"][0]["sleep"]["report"]["cuda"]["status"] == "left on the GPU (--checkpointer none)"
    )
    refusal = document["refusal"]
    assert refusal["checks"] == {
        "sleep": True,
        "refused": True,
        "stays_asleep": True,
        "wake": True,
        "bit_exact": True,
    }
    assert refusal["refused_wake"]["exit"] == 12
    assert document["reference_speeds"]["disk"]["write_gb_per_s"] > 0
    assert document["reference_speeds"]["host_to_device"] == {"skipped": "dry run: no GPU"}
    vllm = document["vllm"]  # the stand-in vLLM server, with one worker
    assert vllm["checks"] == {"sleep": True, "gpu_freed": True, "wake": True, "same_output": True}
    assert vllm["sleep"]["report"]["gpus"][0]["tracked_bytes"] > 0  # its worker's pools are on the GPU
    assert set(document["steps_seconds"]) >= {
        "environment",
        "doctor",
        "disk_speed",
        "demo_start",
        "refusal",
        "vllm",
    }
    assert document["total_seconds"] < 8 * 60
