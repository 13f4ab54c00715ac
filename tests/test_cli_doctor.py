"""``hibernate doctor``: on this GPU-less machine, and against the stand-in driver with real targets."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import vllm

from hibernate.checkpoint.nccl import COMM_SUSPEND_OFF, NCCL_SAFE
from hibernate.errors import ExitCode
from hibernate.store import bulk
from tests.conftest import NOBODY, REPO, is_root, wait_until
from tests.standins.world import GIB, Tree, World
from tests.test_vllm_server import FakeServer, start_server  # noqa: F401 (the stand-in vLLM server's fixture)


def checks(result: Any) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in result.json()["checks"]}


def no_driver_env(tmp_path: Path) -> dict[str, str]:
    return {
        "HIBERNATE_LIBCUDA": str(tmp_path / "libcuda.so.1"),
        "HIBERNATE_LIBNVML": str(tmp_path / "libnvidia-ml.so.1"),
        "HIBERNATE_CUDA_CHECKPOINT": "",
        "HIBERNATE_STANDIN_DIR": "",
        "PATH": str(tmp_path),
    }


def test_doctor_on_a_machine_without_a_gpu(cli: Callable[..., Any], tmp_path: Path) -> None:
    result = cli("doctor", "--json", env=no_driver_env(tmp_path))
    assert result.returncode == 0, result.stderr
    found = checks(result)
    assert result.json()["ok"] is True
    assert found["driver"]["status"] == "warn" and "no NVIDIA driver" in found["driver"]["detail"]
    assert "570" in found["driver"]["fix"]
    assert found["cuda-checkpoint"]["status"] == "warn" and found["checkpointer"]["status"] == "warn"
    assert found["gpus"]["status"] == "ok" and "no NVIDIA GPU" in found["gpus"]["detail"]
    assert found["mig"]["status"] == found["mps"]["status"] == found["user"]["status"] == "ok"
    assert found["store-helper"]["status"] == ("ok" if bulk.NATIVE else "warn")
    assert {c["status"] for c in found.values()} <= {"ok", "warn"}
    human = cli("doctor", env=no_driver_env(tmp_path))
    assert human.returncode == 0 and "verdict: ready" in human.stdout
    assert "fix: install the NVIDIA driver, 580 or newer" in human.stdout


def test_doctor_says_whether_chunks_are_handled_in_c(cli: Callable[..., Any], tmp_path: Path) -> None:
    off = checks(cli("doctor", "--json", env={**no_driver_env(tmp_path), "HIBERNATE_NATIVE": "0"}))
    assert off["store-helper"]["status"] == "warn" and "HIBERNATE_NATIVE=0" in off["store-helper"]["detail"]
    if bulk.NATIVE:
        on = checks(cli("doctor", "--json", env=no_driver_env(tmp_path)))
        assert on["store-helper"]["status"] == "ok" and "compiled" in on["store-helper"]["detail"]


def test_doctor_with_the_stand_in_driver(world: World, cli: Callable[..., Any]) -> None:
    result = cli("doctor", "--json")
    assert result.returncode == 0, result.stderr
    found = checks(result)
    assert found["driver"]["status"] == "ok"
    assert found["driver"]["detail"].startswith(
        "CUDA 13.0 (driver 580.95.05): checkpoint driver API available"
    )
    assert found["cuda-checkpoint"]["status"] == "ok" and "--device-map" in found["cuda-checkpoint"]["detail"]
    assert found["checkpointer"]["detail"].startswith("driver (in-process driver API)")
    assert (
        world.gpus[0].uuid in found["gpus"]["detail"]
        and "80.0 GiB free of 80.0 GiB" in found["gpus"]["detail"]
    )
    assert found["persistence"]["status"] == "ok" and found["mig"]["status"] == "ok"
    binary = checks(cli("doctor", "--json", "--checkpointer", "binary"))
    assert binary["checkpointer"]["detail"].startswith("binary (a cuda-checkpoint run per step)")


def test_doctor_sees_an_old_driver(world: World, cli: Callable[..., Any]) -> None:
    env = {"HIBERNATE_LIBCUDA": str(world.built.libcuda_old), "HIBERNATE_STANDIN_CUDA_VERSION": "12040"}
    plain = cli("doctor", "--json", env=env)
    assert plain.returncode == 0  # nothing fails until a CUDA target is asked about
    found = checks(plain)
    assert found["driver"]["status"] == "warn" and "no checkpoint driver API" in found["driver"]["detail"]
    assert (
        found["cuda-checkpoint"]["status"] == "warn" and "only --toggle" in found["cuda-checkpoint"]["detail"]
    )
    assert found["checkpointer"]["status"] == "warn"
    explicit = cli("doctor", "--json", "--checkpointer", "driver", env=env)
    assert (
        explicit.returncode == ExitCode.UNSUPPORTED and checks(explicit)["checkpointer"]["status"] == "fail"
    )


def test_doctor_names_drivers_570_and_575_as_not_validated(world: World, cli: Callable[..., Any]) -> None:
    found = checks(cli("doctor", "--json", env={"HIBERNATE_STANDIN_CUDA_VERSION": "12090"}))
    assert found["driver"]["status"] == "warn"
    assert "not validated below CUDA 13.0 (drivers 570 and 575)" in found["driver"]["detail"]
    assert found["checkpointer"]["detail"].startswith("binary (a cuda-checkpoint run per step)")


@pytest.mark.slow
def test_doctor_of_a_multi_process_target(
    world: World,
    start_tree: Callable[..., Tree],
    cli: Callable[..., Any],
    work_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in NCCL_SAFE:
        monkeypatch.delenv(name)  # a multi-process job started without the settings a checkpoint needs
    tree = start_tree(children=2, agent=True)
    for pid in tree.pids:
        world.register(pid, nbytes=2 * GIB)
    result = cli("doctor", str(tree.pid), "--to", str(work_dir / "snaps"), "--json")
    assert result.returncode == ExitCode.UNSUPPORTED, result.stdout + result.stderr  # the nccl check fails
    found = checks(result)
    assert found["agents"]["status"] == "ok" and f"process {tree.pid} (running)" in found["agents"]["detail"]
    holders = found["cuda holders"]
    assert holders["status"] == "ok"
    assert [h["pid"] for h in holders["data"]["holders"]] == tree.pids
    assert all(
        h["state"] == "running" and h["gpus"] == {world.gpus[0].uuid: 2 * GIB}
        for h in holders["data"]["holders"]
    )
    nccl = found["nccl"]
    assert nccl["status"] == "fail" and "NCCL_P2P_DISABLE is not 1" in nccl["detail"]
    assert "`hibernate sleep` refuses it without --force" in nccl["detail"]
    assert "NCCL_P2P_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_SHM_DISABLE=1" in nccl["fix"]
    assert found["snapshot dir"]["status"] == "ok" and found["free space"]["status"] == "ok"
    assert found["free space"]["data"]["needed_bytes"] == 1 << 18  # the tracked tensor, kept
    assert found["direct I/O"]["status"] in ("ok", "warn")
    assert found["torch"]["status"] == "ok"
    assert found["torch"]["detail"] == f"process {tree.pid}: torch {torch_version()} (CPU only)"

    world.set_state(tree.children[0], "checkpointed")
    found = checks(cli("doctor", str(tree.pid), "--json"))
    assert (
        found["cuda holders"]["status"] == "warn"
        and f"hibernate wake {tree.pid}" in found["cuda holders"]["fix"]
    )
    world.set_state(tree.children[0], "failed")
    failed = cli("doctor", str(tree.pid))
    assert failed.returncode == ExitCode.UNSUPPORTED and "not ready (cuda holders, nccl)" in failed.stdout


def test_doctor_finds_nothing_to_fear_in_a_tree_started_with_safe_nccl_settings(
    world: World, start_tree: Callable[..., Tree], cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_SHM_DISABLE": "1"}.items():
        monkeypatch.setenv(name, value)
    tree = start_tree(children=1)  # no agent: the doctor says so, and still checks the rest
    for pid in tree.pids:
        world.register(pid)
    result = cli("doctor", str(tree.pid), "--json")
    found = checks(result)
    assert found["nccl"]["status"] == "ok" and "2 CUDA processes" in found["nccl"]["detail"]
    assert found["agents"]["status"] == "fail" and result.returncode == ExitCode.UNSUPPORTED


def test_doctor_flags_mig_mps_persistence_and_a_ram_snapshot_dir(
    world: World, cli: Callable[..., Any]
) -> None:
    world.gpus[0].persistence = False
    world.add_gpu(mig=1)
    mps = subprocess.Popen(["bash", "-c", "exec -a nvidia-cuda-mps-control sleep 600"])
    try:
        result = cli("doctor", "--to", "/dev/shm/hibernate-doctor-test", "--json")
    finally:
        mps.kill()
        mps.wait()
    assert result.returncode == ExitCode.UNSUPPORTED
    found = checks(result)
    assert found["persistence"]["status"] == "warn" and found["persistence"]["fix"] == "sudo nvidia-smi -pm 1"
    assert found["mig"]["status"] == "fail" and "GPU 1" in found["mig"]["detail"]
    assert found["mps"]["status"] == "fail" and str(mps.pid) in found["mps"]["detail"]
    assert found["snapshot dir"]["status"] == "warn" and "it is RAM" in found["snapshot dir"]["detail"]
    assert not Path("/dev/shm/hibernate-doctor-test").exists()  # the doctor changes nothing


def test_doctor_bad_input(cli: Callable[..., Any], tmp_path: Path) -> None:
    assert cli("doctor", "999999999").returncode == ExitCode.NO_SUCH_PROCESS
    bad = cli("doctor", "--checkpointer", "nope")
    assert bad.returncode == ExitCode.USAGE and "--checkpointer must be one of" in bad.stderr
    missing = cli("doctor", "--json", "--checkpointer", "binary", env=no_driver_env(tmp_path))
    assert missing.returncode == ExitCode.UNSUPPORTED and checks(missing)["checkpointer"]["status"] == "fail"


@pytest.mark.slow
@pytest.mark.skipif(not is_root(), reason="needs root to run as another user")
def test_doctor_as_another_user(cli: Callable[..., Any], tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    env = {k: v for k, v in no_driver_env(tmp_path).items() if k != "PATH"}  # setpriv is found on PATH
    result = cli("doctor", str(os.getpid()), "--json", uid=NOBODY, env=env)
    assert result.returncode == ExitCode.UNSUPPORTED
    user = checks(result)["user"]
    assert user["status"] == "fail" and f"you are uid {NOBODY}" in user["detail"]


def torch_version() -> str:
    """The version of this environment's torch, as its package says (``torch.__version__`` is the same)."""
    return importlib.metadata.version("torch")


# A target whose torch says what a CUDA 13 build of torch 2.11 says: the storage poisoning setter, no clearer.
TORCH_211_TARGET = r"""
import os, sys, time
import torch
torch.__version__ = "2.11.0+cu130"
torch.version.cuda = "13.0"
torch._C._set_storage_data_ptr_access_error_msg = lambda storage, message: None
import hibernate
hibernate.track(torch.arange(1024, dtype=torch.float32), tag="weights")
open(sys.argv[1] + ".tmp", "w").close()
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
while True:
    time.sleep(3600)
"""


@pytest.fixture
def torch_211_target(runtime_dir: Path, tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-c", TORCH_211_TARGET, str(ready)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        wait_until(ready.exists, 120, "the target to track its tensor", process=proc)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_doctor_warns_of_a_torch_that_cannot_make_untracked_views_raise(
    world: World, torch_211_target: subprocess.Popen[bytes], cli: Callable[..., Any]
) -> None:
    result = cli("doctor", str(torch_211_target.pid), "--json")
    found = checks(result)
    assert found["torch"]["status"] == "warn", found["torch"]
    assert found["torch"]["detail"] == (
        f"process {torch_211_target.pid}: torch 2.11.0+cu130 (CUDA 13.0) cannot make released memory raise: "
        "a view of a tracked tensor that was not tracked itself, used outside hibernate.guard() while the "
        "process sleeps, reaches freed memory (a crash or an illegal address) instead of raising a "
        "RuntimeError as torch 2.12 and newer do"
    )
    assert "upgrade torch" in found["torch"]["fix"]
    assert found["torch"]["data"]["versions"] == {str(torch_211_target.pid): "2.11.0+cu130"}
    assert result.returncode == 0, "a warning: the sleep itself works"
    human = cli("doctor", str(torch_211_target.pid))
    assert "torch 2.11.0+cu130" in human.stdout


@pytest.mark.slow
def test_doctor_and_the_refusal_name_the_comm_suspend_flag_where_the_servers_vllm_has_it(
    world: World,
    start_server: Callable[..., FakeServer],  # noqa: F811 (the fixture imported above)
    cli: Callable[..., Any],
    work_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in NCCL_SAFE:
        monkeypatch.delenv(name)  # so the sleep is refused, and says what the server's vLLM offers
    package = str(Path(vllm.__file__).parent)  # what the stand-in workers map, as vLLM workers do
    server = start_server(workers=2)
    peers = checks(cli("doctor", str(server.pid), "--json"))["vllm peers"]
    assert peers["status"] == "warn"
    assert peers["detail"].startswith(
        f"the vLLM at {package} tears down FlashInfer's all-reduce and all-to-all workspaces for a "
        "checkpoint (hibernate asks it to), and nothing else: vLLM's custom all-reduce is on"
    )
    assert "--enable-nccl-comm-suspend is not on the command line" in peers["detail"]
    assert "VLLM_ALLREDUCE_USE_SYMM_MEM" not in peers["detail"]  # the stand-in server runs with it 0
    assert peers["fix"] == (
        "serve with --disable-custom-all-reduce and VLLM_ALLREDUCE_USE_SYMM_MEM=0; "
        "serve with --enable-nccl-comm-suspend (NCCL 2.29.7 or newer)"
    )
    assert peers["data"] == {
        "package": package,
        "distributed_checkpoint": True,
        "comm_suspend": True,
        "comm_suspend_on": False,
    }
    refused = cli("sleep", str(server.pid), "--to", str(work_dir))
    assert refused.returncode == ExitCode.UNSUPPORTED, refused.stderr
    assert COMM_SUSPEND_OFF in refused.stderr and "nothing was changed" in refused.stderr
    assert world.calls() == [] and not server.is_sleeping()

    suspending = start_server(
        workers=2,
        args=("--enable_nccl_comm_suspend", "--disable-custom-all-reduce"),  # either spelling
    )
    peers = checks(cli("doctor", str(suspending.pid), "--json"))["vllm peers"]
    assert peers["status"] == "ok" and "--enable-nccl-comm-suspend is on" in peers["detail"]
    assert "custom and symmetric-memory all-reduces are off" in peers["detail"]
    refused = cli("sleep", str(suspending.pid), "--to", str(work_dir))
    assert refused.returncode == ExitCode.UNSUPPORTED and COMM_SUSPEND_OFF not in refused.stderr
