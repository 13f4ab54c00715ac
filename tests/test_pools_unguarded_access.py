"""A tracked tensor touched outside ``guard()`` while asleep raises HibernatingError, never crashes.

Before this, ``t.sum()`` on a released tensor read its null data pointer and the
target died of SIGSEGV. The end-to-end checks run the target in its own process,
so a crash shows as a failed exit status rather than a crashed pytest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import hibernate
from hibernate.agent.local import local_agent
from hibernate.errors import HibernatingError
from hibernate.pools import tensors as tensor_pool
from hibernate.pools.device import POISON_STORAGE, UNPOISON_STORAGE
from hibernate.pools.tensors import StorageRegion
from tests.conftest import wait_until

REPO = Path(__file__).resolve().parent.parent

# The target: a model, a tracked tensor and a view of it; a worker thread that touches them
# outside guard() once the process is asleep; then a wake and a bit-exact comparison.
TARGET = r"""
import json, sys, threading, time
from pathlib import Path

import torch

import hibernate
from hibernate.errors import HibernatingError

mode, snap, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4))
cache = torch.randn(6, 32)
row = cache[2]  # a view of a tracked tensor, itself tracked below
hibernate.track(model, name="model")
hibernate.track({"cache": cache, "row": row}, tag="kv", name="state")
expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
expected_cache = cache.clone()
weight_type, cache_type = type(model[0].weight), type(cache)
report = {}


def until(state):
    while hibernate.state() != state:  # the agent's own state, set by the other process
        time.sleep(0.01)


def touch():
    ops = {
        "sum": lambda: model[0].weight.sum(),
        "clone": lambda: cache.clone(),
        "mul_": lambda: cache.mul_(2),
        "view": lambda: row.add_(1),
        "forward": lambda: model(torch.ones(1, 16)),
        "copy_from": lambda: torch.zeros(6, 32).copy_(cache),
    }
    for label, op in ops.items():
        try:
            op()
            report[label] = None
        except HibernatingError as exc:
            report[label] = exc.message
    report["metadata"] = [list(model[0].weight.shape), str(cache.dtype), cache.is_contiguous()]


worker = threading.Thread(target=touch, name="unguarded-worker")
if mode == "in-process":
    hibernate.sleep(snap)
    worker.start()
    worker.join()
    hibernate.wake()
else:  # the CLI sleeps and wakes this process from outside
    out.with_suffix(".ready").write_text("ready")
    until("asleep")
    worker.start()
    worker.join()
    out.with_suffix(".touched").write_text(json.dumps(report))
    until("running")

report["bit_exact"] = all(
    torch.equal(v, expected[k]) for k, v in model.state_dict().items()
) and torch.equal(cache, expected_cache)
report["same_storage"] = row.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
report["types_back"] = type(model[0].weight) is weight_type and type(cache) is cache_type
report["works_again"] = list(model(torch.ones(1, 16)).shape)
out.write_text(json.dumps(report))
"""


def _start_target(tmp_path: Path, mode: str, snapshot: Path, env: dict[str, str]) -> tuple[Any, Path]:
    script = tmp_path / "target.py"
    script.write_text(TARGET)
    out = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-W", "ignore", str(script), mode, str(snapshot), str(out)],
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, out


def _wait_for(path: Path, proc: Any, timeout: float = 120) -> None:
    # Its output is read once it has exited (reading it before would wait for that).
    output = lambda: proc.stdout.read() if proc.poll() is not None else "(still running)"  # noqa: E731
    wait_until(path.exists, timeout, f"the target to write {path.name}", process=proc, detail=output)


def _check(report: dict[str, Any]) -> None:
    for label in ("sum", "clone", "mul_", "view", "forward", "copy_from"):
        message = report[label]
        assert message is not None, f"{label} ran on released memory without an error"
        assert "is asleep" in message and "'unguarded-worker'" in message, message
        assert "guard()" in message, message
    assert "'model.0.weight'" in report["sum"] and "torch.Tensor.sum" in report["sum"]
    assert "'state.cache'" in report["clone"] and "'state.row'" in report["view"]
    assert report["metadata"] == [[8, 16], "torch.float32", True]
    assert report["bit_exact"], "a tensor touched while asleep came back different"
    assert report["same_storage"] and report["types_back"]
    assert report["works_again"] == [1, 4]


@pytest.mark.slow
def test_in_process_sleep_unguarded_access_raises_and_wake_is_bit_exact(
    tmp_path: Path, work_dir: Path, runtime_dir: Path
) -> None:
    proc, out = _start_target(tmp_path, "in-process", work_dir, {"HIBERNATE_AGENT": "0"})
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"target died with {proc.returncode} (-11 is SIGSEGV):\n{output}"
    _check(json.loads(out.read_text()))


@pytest.mark.slow
def test_cli_sleep_unguarded_access_raises_and_wake_is_bit_exact(
    tmp_path: Path, work_dir: Path, runtime_dir: Path, cli: Any
) -> None:
    proc, out = _start_target(tmp_path, "cli", work_dir, {})
    try:
        _wait_for(out.with_suffix(".ready"), proc)
        result = cli("sleep", str(proc.pid), "--to", str(work_dir), "--json")
        assert result.returncode == 0, result.stderr
        _wait_for(out.with_suffix(".touched"), proc)
        assert proc.poll() is None, "the target died touching its tensors while asleep"
        result = cli("wake", str(proc.pid), "--json")
        assert result.returncode == 0, result.stderr
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"target died with {proc.returncode} (-11 is SIGSEGV):\n{output}"
    _check(json.loads(out.read_text()))


# -- in this process: only tracked objects are touched, and those raise ----------------------------


def test_asleep_tensor_answers_metadata_and_refuses_data(fresh_agent: None, work_dir: Path) -> None:
    module = torch.nn.Linear(4, 3)
    module.weight.grad = torch.ones(3, 4)
    hibernate.track(module, name="m")
    hibernate.sleep(work_dir)
    weight = module.weight
    assert isinstance(weight, torch.nn.Parameter) and type(weight) is not torch.nn.Parameter
    assert weight.shape == (3, 4) and weight.dtype == torch.float32 and weight.requires_grad
    assert weight.size() == (3, 4) and weight.numel() == 12 and weight.stride() == (4, 1)
    module.zero_grad(set_to_none=True)  # only metadata: allowed
    with pytest.raises(HibernatingError, match=r"'m\.weight' is asleep.*torch\.Tensor\.__repr__"):
        repr(weight)
    with pytest.raises(HibernatingError, match="is asleep"):
        weight.data_ptr()
    with pytest.raises(HibernatingError, match="is asleep"):
        torch.cat([torch.ones(1, 4), weight])
    with pytest.raises(HibernatingError, match="is asleep"):
        _ = weight.T
    hibernate.track(torch.nn.Linear(2, 2), name="late")  # tracking while asleep still inspects layouts
    hibernate.wake()
    assert type(weight) is torch.nn.Parameter
    assert weight.grad is None
    repr(weight)


def test_guarded_code_waits_and_then_works(fresh_agent: None, work_dir: Path) -> None:
    tensor = torch.arange(10.0)
    hibernate.track(tensor, name="t")
    hibernate.sleep(work_dir)
    with pytest.raises(HibernatingError, match="hibernating"), hibernate.guard(wait=False):
        pass
    hibernate.wake()
    with hibernate.guard(wait=False):
        assert tensor.sum().item() == 45.0


def test_failed_release_leaves_tensors_awake() -> None:
    data = bytearray(64)
    tensor = torch.frombuffer(data, dtype=torch.uint8)  # memory torch cannot resize
    storage = tensor.untyped_storage()
    region = StorageRegion("t/x", "t", True, storage, [], [(tensor, "x")])
    with pytest.raises(RuntimeError):
        region.release()
    assert type(tensor) is torch.Tensor and not region.released
    assert tensor.sum().item() == 0


def test_storage_poison_is_set_after_release_and_cleared_before_reallocation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where torch can make a storage raise (CUDA builds), views made before the sleep raise too."""
    tensor = torch.arange(8, dtype=torch.float32)
    storage = tensor.untyped_storage()
    seen: list[tuple[str, int]] = []  # (call, the storage's size when it was made)
    monkeypatch.setattr(tensor_pool, "_poison_storage", lambda _p, _m: seen.append(("set", storage.nbytes())))
    monkeypatch.setattr(tensor_pool, "_unpoison_storage", lambda _p: seen.append(("clear", storage.nbytes())))
    region = StorageRegion("t/x", "t", True, storage, [], [(tensor, "x")])
    region.release()
    region.release()  # idempotent
    region.reallocate()
    assert seen == [("set", 0), ("clear", 0)]
    assert storage.nbytes() == 32 and type(tensor) is torch.Tensor


# -- a CUDA build of torch that cannot poison a storage (2.11): said in every sleep --------------------


def untracked_views_warning_of(version: str) -> str:
    return (
        f"torch {version} (CUDA 13.0) cannot make released memory raise: a view of a tracked tensor that "
        "was not tracked itself, used outside hibernate.guard() while the process sleeps, reaches freed "
        "memory (a crash or an illegal address) instead of raising a RuntimeError as torch 2.12 and newer do"
    )


def as_cuda_build(monkeypatch: pytest.MonkeyPatch, poisons: bool) -> None:
    """This CPU torch as a CUDA 13 build: 2.11 (the setter only, so no poisoning) or one with both."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch._C, POISON_STORAGE, lambda _p, _m: None, raising=False)
    if poisons:
        monkeypatch.setattr(torch._C, UNPOISON_STORAGE, lambda _p: None, raising=False)
        monkeypatch.setattr(tensor_pool, "_poison_storage", getattr(torch._C, POISON_STORAGE))
        monkeypatch.setattr(tensor_pool, "_unpoison_storage", getattr(torch._C, UNPOISON_STORAGE))


def test_every_sleep_on_a_torch_that_cannot_poison_storages_says_what_that_costs(
    fresh_agent: None, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    as_cuda_build(monkeypatch, poisons=False)
    tensor = torch.arange(64, dtype=torch.float32)
    hibernate.track(tensor, name="t")
    for _ in range(2):
        result = hibernate.sleep(work_dir)
        assert result["spill"]["warnings"] == [untracked_views_warning_of(str(torch.__version__))]
        hibernate.wake()
    assert local_agent().status()["torch"] == {
        "version": str(torch.__version__),
        "cuda": "13.0",
        "warning": untracked_views_warning_of(str(torch.__version__)),
    }


def test_a_torch_that_poisons_storages_and_a_cpu_only_one_add_no_warning(
    fresh_agent: None, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tensor = torch.arange(64, dtype=torch.float32)
    hibernate.track(tensor, name="t")
    assert hibernate.sleep(work_dir)["spill"]["warnings"] == [], "CPU only: the README says what it cannot do"
    hibernate.wake()
    assert local_agent().status()["torch"]["warning"] is None
    as_cuda_build(monkeypatch, poisons=True)
    assert hibernate.sleep(work_dir)["spill"]["warnings"] == []
    hibernate.wake()
    assert local_agent().status()["torch"]["warning"] is None
