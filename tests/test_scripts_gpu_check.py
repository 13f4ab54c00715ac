"""scripts/gpu-check --dry-run walks every check against the stand-ins and prints the real run's JSON shape.

The script is what validates hibernate on a real GPU; its dry run is how CI
keeps it working without one. Its checks must not pass by accident: a dry run
whose demos track nothing (their pools move no byte) fails every cycle on what
the pools did, while the checkpoint alone would still free the GPU and give
the same output; and a section asked for that did not run fails the run.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import REPO, wait_until

SCRIPT = REPO / "scripts" / "gpu-check"
GIB = 1 << 30
# What a demo's pools did, as each cycle judges it: all of them fail when the pools move nothing.
POOL_CHECKS = ("pools_wrote", "pools_read_back", "pools_zeroed", "dropped_zeroed")


def load_script() -> Any:  # the script's module: its names are known only once it has run
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def dry_run(tmp_path: Path, *flags: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    out, shm = tmp_path / "gpu-check.json", tmp_path / "shm"  # /dev/shm may be small where CI runs
    shm.mkdir()
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--tmpfs", str(shm), *flags],
        capture_output=True,
        text=True,
        timeout=480,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )
    document = json.loads(out.read_text())
    assert json.loads(proc.stdout) == document
    assert "error" not in document, document["error"]
    return proc.returncode, document


def demo_cycles(document: dict[str, Any]) -> dict[str, dict[str, bool]]:
    """Every cycle of a demo, by where it is (``driver``, ``group[1]``), with its checks."""
    found = {}
    for name, entry in document["sections"].items():
        if "marked" in entry:
            found[name] = entry["checks"]
        for index, sub in enumerate(entry.get("cycles") or []):
            found[f"{name}[{index}]"] = sub["checks"]
    return found


def test_a_check_that_measured_nothing_fails() -> None:
    gpu_check = load_script()
    reading = {"used_before_bytes": 0, "used_after_bytes": 0, "given_back_bytes": 0, "tracked_bytes": 0}
    assert not gpu_check.judge_freed([reading], lambda g: True)  # before-reading 0: measured nothing
    assert not gpu_check.judge_freed(None, lambda g: True)  # no NVML: nothing measured either
    assert gpu_check.judge_freed([{**reading, "used_before_bytes": 1}], lambda g: True)
    assert not gpu_check.judge_freed([{**reading, "used_before_bytes": 1}], lambda g: False)


def gpu(uuid: str, before: int, after: int, tracked: int | None) -> dict[str, Any]:
    return {
        "uuid": uuid,
        "used_before_bytes": before,
        "used_after_bytes": after,
        "given_back_bytes": before - after,
        "tracked_bytes": tracked,
    }


def test_pools_freed_counts_only_the_pools_own_gpu_bytes() -> None:
    pools_freed = load_script().pools_freed
    # Pools-only: 8 GiB tracked on GPU-A, 8 GiB given back there.
    report: dict[str, Any] = {"gpus": [gpu("GPU-A", 10 * GIB, 2 * GIB, 8 * GIB)], "cuda": {}}
    assert pools_freed(report, "cuda")
    # A pool that is not on the GPU (tracked 0, or unknown) proves nothing, whatever was given back.
    assert not pools_freed({**report, "gpus": [gpu("GPU-A", 10 * GIB, 2 * GIB, 0)]}, "cuda")
    assert not pools_freed({**report, "gpus": [gpu("GPU-A", 10 * GIB, 2 * GIB, None)]}, "cuda")
    # The checkpoint alone frees every byte: its own drop does not count for the pools.
    checkpointed = {"gpus": [gpu("GPU-A", 10 * GIB, 1 * GIB, 8 * GIB)], "cuda": {"drop": {"GPU-A": 9 * GIB}}}
    assert not pools_freed(checkpointed, "cuda")
    released_first = {"gpus": [gpu("GPU-A", 10 * GIB, 1 * GIB, 8 * GIB)], "cuda": {"drop": {"GPU-A": GIB}}}
    assert pools_freed(released_first, "cuda")
    # Judged on the GPU the pools live on: bytes given back on another GPU do not count.
    elsewhere = {"gpus": [gpu("GPU-A", 10 * GIB, 10 * GIB, 8 * GIB), gpu("GPU-B", 9 * GIB, GIB, 0)]}
    assert not pools_freed(elsewhere, "cuda")
    assert not pools_freed({"gpus": [gpu("GPU-A", 0, 0, 8 * GIB)]}, "cuda")  # NVML read nothing
    # A CPU demo (a dry run): the process's RSS around the release, against its pools' bytes.
    process = {"pools": [{"bytes": 100}, {"bytes": 20}], "rss_before": 1000, "rss_after": 880}
    assert pools_freed({"processes": [process]}, "cpu")
    assert not pools_freed({"processes": [{**process, "rss_after": 990}]}, "cpu")
    assert not pools_freed({"processes": [{**process, "pools": []}]}, "cpu")


def test_pools_moved_wants_this_cycles_bytes_written_read_back_and_zeroed() -> None:
    pools_moved = load_script().pools_moved
    spill = {"pid": 7, "total_bytes": 1000, "written_bytes": 990, "reused_bytes": 10, "dropped_bytes": 50}
    restore = {"pid": 7, "restored_bytes": 1000, "zeroed_bytes": 50}
    every = {"pools_wrote": True, "pools_read_back": True, "pools_zeroed": True}
    assert pools_moved({"processes": [spill]}, {"processes": [restore]}, 7) == every
    # The last snapshot reused (the checkpoint did the work): nothing written in this cycle.
    reused = {**spill, "written_bytes": 0, "reused_bytes": 1000}
    assert not pools_moved({"processes": [reused]}, {"processes": [restore]}, 7)["pools_wrote"]
    # Pools that track nothing move nothing: every check fails, not passes on 0 == 0.
    empty = {"pid": 7, "total_bytes": 0, "written_bytes": 0, "reused_bytes": 0, "dropped_bytes": 0}
    nothing = {"pid": 7, "restored_bytes": 0, "zeroed_bytes": 0}
    assert not any(pools_moved({"processes": [empty]}, {"processes": [nothing]}, 7).values())
    # Another process's report is not this one's.
    assert not any(pools_moved({"processes": [spill]}, {"processes": [restore]}, 8).values())


def test_sections_not_asked_for_are_the_skipped_and_those_without_input(tmp_path: Path) -> None:
    gpu_check = load_script()

    def args(*flags: str) -> Any:
        namespace = type("Args", (), {})()
        namespace.skip, namespace.vllm_cumem, namespace.vllm_model, namespace.dry_run = (
            list(flags),
            None,
            None,
            False,
        )
        namespace.only = []
        return namespace

    assert gpu_check.not_asked(args("binary,group", "ceiling")) == {
        "binary": "--skip",
        "group": "--skip",
        "ceiling": "--skip",
        "cumem": "no --vllm-cumem given",
        "vllm": "no --vllm-model given (a local model directory or a cached name)",
    }
    with pytest.raises(SystemExit, match="--skip nonsense: not a section"):
        gpu_check.not_asked(args("nonsense"))
    # A rerun of what a run missed: every other section is left out, not asked for.
    rerun = args()
    rerun.only, rerun.vllm_cumem = ["ceiling", "cumem,pools"], Path("cumem_allocator.abi3.so")
    why = gpu_check.not_asked(rerun)
    assert set(gpu_check.SECTIONS) - set(why) == {"ceiling", "cumem", "pools"}
    assert why["binary"] == "not in --only" and why["vllm"] == "not in --only"
    rerun.only = ["tmpfs"]
    with pytest.raises(SystemExit, match="--only tmpfs: not a section"):
        gpu_check.not_asked(rerun)
    result = {
        "sections": {
            "driver": {"checks": {"a": True, "b": False}},
            "group": {"cycles": [{"checks": {"c": False}}]},
        }
    }
    assert gpu_check.failed_checks(result) == ["driver.b", "group[0].c"]


# -- the whole dry run, as the GPU machine takes it -------------------------------------------------

PYTHON_TAGS = ("cp310", "cp311", "cp312", "cp313")


def fake_wheel(directory: Path, dist: str, version: str, tag: str, files: dict[str, bytes],
               requires: tuple[str, ...] = ()) -> Path:  # fmt: skip
    """A wheel pip takes as it takes any: its files, METADATA, WHEEL and RECORD."""
    import zipfile

    info = f"{dist}-{version}.dist-info"
    metadata = "".join(
        [
            f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
            *(f"Requires-Dist: {r}\n" for r in requires),
        ]
    )
    content = {
        **files,
        f"{info}/METADATA": metadata.encode(),
        f"{info}/WHEEL": f"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: {tag}\n".encode(),
    }
    record = "".join(f"{name},,\n" for name in [*content, f"{info}/RECORD"])
    path = directory / f"{dist}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in {**content, f"{info}/RECORD": record.encode()}.items():
            archive.writestr(name, data)
    return path


def fake_index(directory: Path) -> Path:
    """Wheels standing for every package gpu-vendor fetches, for CPython 3.10 to 3.13: pip finds them
    with --no-index, so the assembly needs no network. numpy's shared library is the same in each."""
    directory.mkdir(parents=True, exist_ok=True)
    init = b"# a stand-in of the package, for gpu-vendor's tests\n"
    fake_wheel(directory, "torch_memory_saver", "0.0.10", "cp39-abi3-manylinux2014_x86_64",
               {"torch_memory_saver/__init__.py": init})  # fmt: skip
    extension = b"\x7fELF the extension"
    fake_wheel(directory, "vllm", "0.33.0", "py3-none-any",
               {"vllm/__init__.py": init, "vllm/cumem_allocator.abi3.so": extension})  # fmt: skip
    fake_wheel(directory, "typer", "0.29.1", "py3-none-any", {"typer/__init__.py": init}, ("rich>=13",))
    fake_wheel(directory, "rich", "15.0.0", "py3-none-any", {"rich/__init__.py": init})
    fake_wheel(directory, "psutil", "7.2.2", "cp36-abi3-manylinux2014_x86_64", {"psutil/__init__.py": init})
    for tag in PYTHON_TAGS:
        platform = f"{tag}-{tag}-manylinux2014_x86_64"
        for dist, version in (("orjson", "3.13.0"), ("xxhash", "4.1.0")):
            own = {f"{dist}/_{dist}.{tag}.so": tag.encode() * 64}
            fake_wheel(directory, dist, version, platform, {f"{dist}/__init__.py": init, **own})
        fake_wheel(directory, "numpy", "2.2.6", platform, {
            "numpy/__init__.py": init, "numpy.libs/libopenblas.so": b"the same in every wheel" * 256,
            f"numpy/_core/_multiarray_umath.{tag}.so": tag.encode() * 256,
        })  # fmt: skip
    return directory


def offline_pip() -> dict[str, str]:
    """An environment whose pip reads no configuration: only the wheels it is pointed at."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


def vendored_checkout(
    tmp_path: Path, binary: Path, *flags: str
) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """A checkout (its scripts the repository's) whose vendor/ scripts/gpu-vendor assembled offline."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "scripts").symlink_to(REPO / "scripts")
    index = fake_index(tmp_path / "index")
    proc = subprocess.run(
        [sys.executable, str(checkout / "scripts" / "gpu-vendor"), str(checkout / "vendor"),
         "--cuda-checkpoint", str(binary), "--find-links", str(index), "--offline", *flags],
        capture_output=True, text=True, timeout=600, env=offline_pip(), cwd=checkout,
    )  # fmt: skip
    return checkout, proc


@pytest.mark.slow
def test_gpu_vendor_assembles_what_gpu_run_carries_from_wheels_at_hand(
    tmp_path: Path, standin_build: Any
) -> None:
    import zipfile

    checkout, proc = vendored_checkout(tmp_path, standin_build.binary)
    assert proc.returncode == 0, proc.stderr
    vendor = checkout / "vendor"
    assert (vendor / "cuda-checkpoint").read_bytes() == standin_build.binary.read_bytes()
    assert os.access(vendor / "cuda-checkpoint", os.X_OK)
    assert (vendor / "cumem_allocator.abi3.so").read_bytes() == b"\x7fELF the extension"
    assert [p.name for p in vendor.glob("*.whl")] == [
        "torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl"
    ]
    assert not list(vendor.rglob("vllm-*"))  # only the extension is kept of vLLM's wheel
    manifest = json.loads((vendor / "vendor.json").read_text())
    assert manifest["tags"] == list(PYTHON_TAGS)
    packages = {p["dist"]: p for p in manifest["packages"]}
    assert set(packages) == {"torch_memory_saver", "typer", "rich", "psutil", "orjson", "xxhash", "numpy"}
    assert packages["typer"]["group"] == packages["rich"]["group"] == "cli"
    assert packages["orjson"]["min"] == "3.10" and packages["typer"]["module"] == "typer"
    # numpy's files common to every Python are carried once, the rest per Python.
    numpy = packages["numpy"]
    with zipfile.ZipFile(vendor / numpy["files"][0]) as common:
        assert "numpy.libs/libopenblas.so" in common.namelist()
        assert not any("_multiarray_umath" in name for name in common.namelist())
    assert sorted(numpy["per_python"]) == list(PYTHON_TAGS)
    with zipfile.ZipFile(vendor / numpy["per_python"]["cp312"]) as own:
        assert "numpy/_core/_multiarray_umath.cp312.so" in own.namelist()
        assert "numpy.libs/libopenblas.so" not in own.namelist()
    assert packages["psutil"]["files"] == ["wheels/any/psutil-7.2.2-cp36-abi3-manylinux2014_x86_64.whl"]
    # What to ask the device for, with the directory as the checkout names it.
    assert 'run(command="OUT=\\"$OUT\\" scripts/gpu-run", carry=["vendor"], timeout_s=480)' in proc.stdout
    # Over the limit: said, with what weighs most, and a failure.
    over = tmp_path / "over"
    over.mkdir()
    _, proc = vendored_checkout(over, standin_build.binary, "--limit-mib", "0.01", "--pythons", "3.12")
    assert proc.returncode == 1 and "over 0.01 MiB" in proc.stderr and "--pythons" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)  # the whole dry run, on 2 cores shared with the rest of the suite
def test_the_dry_run_walks_every_section_of_the_device_run(
    tmp_path: Path, runtime_dir: Path, standin_build: Any
) -> None:
    """The device's run, on the stand-ins: scripts/gpu-run over a vendor/ that scripts/gpu-vendor
    assembled (the stand-in's cuda-checkpoint in place of NVIDIA's). Every section of the device run
    runs here, none is left out for want of a carried file, with the same verdicts."""
    checkout, proc = vendored_checkout(tmp_path, standin_build.binary)
    assert proc.returncode == 0, proc.stderr
    out, shm, snapshots = tmp_path / "out", tmp_path / "shm", tmp_path / "snapshots"
    shm.mkdir()  # /dev/shm may be small where CI runs
    flags = f"--dry-run --tmpfs {shm} --to {snapshots}"
    env = {
        **os.environ, "OUT": str(out), "GPU_CHECK_ARGS": flags, "GPU_CHECK_SIZE_MB": "16",
        "GPU_CHECK_BUDGET_S": "900", "GPU_CHECK_TIMEOUT_S": "1200",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # python3: this one
    }  # fmt: skip
    env.pop("GPU_CHECK_WITHOUT_VENDOR", None)
    run = subprocess.run([str(checkout / "scripts" / "gpu-run")], capture_output=True, text=True,
                         timeout=1500, env=env, cwd=checkout)  # fmt: skip
    document = json.loads((out / "gpu-check.json").read_text())
    assert json.loads((out / "gpu-check.stdout").read_text()) == document
    assert "error" not in document, document["error"]
    log = (out / "gpu-run.log").read_text()
    assert f'"python": "cp{sys.version_info[0]}{sys.version_info[1]}"' in log
    assert "torch_memory_saver 0.0.10" in log  # what this image lacks was unpacked, and only that
    assert "orjson" not in log.split("== unpacked")[1].split("== imports")[0]
    assert run.returncode == 0 and document["ok"], document.get("checks_failed") or document["not_run"]
    sections = document["sections"]
    assert list(sections) == list(load_script().SECTIONS) and document["not_run"] == []
    assert document["over_budget"] == []  # a dry run's sections fit their budgets with room
    assert all(entry["budget_s"] > 0 for entry in sections.values())
    assert snapshots.is_dir() and list(snapshots.iterdir()) == []  # each section's snapshots removed
    environment = document["environment"]
    assert {"kernel", "container_runtime", "driver", "cuda", "torch", "torch_cuda", "gpu_models"} <= set(
        environment
    )
    assert environment["driver"] == "580.95.05" and environment["gpu_models"] == ["StandIn-H200"]
    cycles = demo_cycles(document)
    assert set(cycles) == {
        "pools-only", "driver", "binary", "group[0]", "group[1]", "pools", "pools-checkpoint",
        "ceiling[0]", "ceiling[1]", "ceiling[2]", "kept-staging[0]", "kept-staging[1]", "background[0]",
        "expandable[0]", "expandable[1]",
    }  # fmt: skip
    for where, checks in cycles.items():
        wanted = {f"{prefix}{name}" for name in POOL_CHECKS for prefix in ("", "0.", "1.", "2.")}
        assert wanted & set(checks) and all(checks.values()), (where, checks)
    for name in ("pools-only", "driver", "binary"):
        entry = sections[name]
        assert entry["checks"]["pools_freed"] and entry["checks"]["side_kept"], entry["checks"]
        assert entry["sleep"]["report"]["gpus"][0]["used_before_bytes"] > 0
        assert entry["sleep"]["report"]["processes"][0]["written_bytes"] > 0  # a fresh directory each
        assert {"spill_gb_per_s", "restore_of_disk_read", "restore_of_host_to_device"} <= set(entry["speeds"])
    assert (
        sections["pools-only"]["sleep"]["report"]["cuda"]["status"] == "left on the GPU (--checkpointer none)"
    )
    assert len({sections[n]["snapshot_dir"] for n in ("pools-only", "driver", "binary")}) == 3
    assert sections["refusal"]["checks"] == {
        "sleep": True, "refused": True, "stays_asleep": True, "wake": True, "bit_exact": True,
        "pools_wrote": True, "pools_read_back": True, "pools_zeroed": True,
    }  # fmt: skip
    assert sections["refusal"]["refused_wake"]["exit"] == 12
    # hibernate.pool() over the stand-in torch_memory_saver, a stand-in graph; then the driver's
    # checkpoint over its paused ranges.
    for name, kind in (("pools", "none"), ("pools-checkpoint", "driver")):
        pools = sections[name]
        assert pools["demo"]["pooled"] and pools["demo"]["graphs"] and pools["reference"]["graph_digest"]
        assert pools["checkpointer"] == kind
        assert pools["checks"]["same_pointers"] and pools["checks"]["graph_bit_exact"], pools["checks"]
    assert sections["pools"]["demo"]["pid"] == sections["pools-checkpoint"]["demo"]["pid"]
    speeds = sections["pools"]["speeds"]
    assert speeds["spill_of_disk_write"] and speeds["restore_of_disk_read"], speeds
    assert abs(speeds["bytes"] - sections["pools"]["disk_same_bytes"]["bytes"]) < 8 << 20  # 8 MiB requests
    assert sections["pools"]["provider_backups"] == {
        "skipped": "dry run: the stand-in torch_memory_saver has no CPU or disk backup"
    }
    # Both graphs over tracked weights refused, the one that allocates nothing too, each named.
    graphs = sections["graph-refusal"]
    assert set(graphs["checks"]) == {
        f"{variant}.{check}"
        for variant in ("forward", "static")
        for check in ("status_lists_graph", "refused", "refusal_names_capture", "refusal_stays_running",
                      "refusal_changed_nothing", "allow_moves_slept", "allow_moves_woke")
    } | {"static.graph_allocated_nothing"}  # fmt: skip
    static = graphs["variants"]["static"]
    assert static["demo"]["graph_kind"] == "static" and static["demo"]["graph_pool_bytes"] == 0
    assert graphs["variants"]["forward"]["demo"]["graph_pool_bytes"] > 0  # what memory_snapshot() sees
    for variant in graphs["variants"].values():
        assert variant["refused_sleep"]["exit"] == 15
        assert "after_moves" in variant  # what the graph replays after a wake that moved its memory
    sharing = sections["graph-pool-sharing"]
    assert sharing["checks"] == {
        "answered": True, "graphs_replayed": True, "hibernate_separate": True, "status_lists_graphs": True,
    }  # fmt: skip
    assert isinstance(sharing["plain_shares"], bool)  # torch's own pool: recorded, not judged
    # The ceiling: the page cache's wake read what was cached, the disk's what was not.
    ceiling = sections["ceiling"]
    cached, disk, tmpfs = ceiling["cycles"]
    assert cached["before_wake"]["page_cache"]["share"] >= 0.9 and "io_mode" not in cached  # the default auto
    assert cached["checks"]["read_through_page_cache"], cached["wake"]["report"]
    assert disk["before_wake"]["page_cache"]["share"] <= 0.1 and "io_mode" not in disk
    assert Path(tmpfs["snapshot_dir"]).parent == shm
    assert ceiling["speeds"]["page_cache_restore_gb_per_s"] and ceiling["speeds"]["disk_restore_gb_per_s"]
    assert ceiling["host_to_device_same_bytes"] == {"skipped": "dry run: no GPU"}
    # Kept staging: the second cycle took its sleep's and its wake's staging from what the first kept.
    kept = sections["kept-staging"]
    assert kept["checks"] == {
        "first_sleep_kept": True,
        "second_sleep_reused": True,
        "second_wake_reused": True,
    }
    assert kept["kept"]["second.wake"]["reused_bytes"] > 0 and kept["cycles"][1]["checks"]["bit_exact"]
    # vLLM's extension: carried, and driven here over the stand-ins of its allocator.
    cumem = sections["cumem"]
    assert cumem["path"] == str(checkout / "vendor" / "cumem_allocator.abi3.so")
    assert cumem["checks"] == {
        "answered": True, "released": True, "cuda_cycle": True, "bit_exact": True, "dropped_zeroed": True,
        "graph_replay": True,
    }  # fmt: skip
    assert sections["group"]["cycles"][0]["checks"]["cuda_checkpointed"]  # the three together
    assert [c["checkpointer"] for c in sections["group"]["cycles"]] == ["driver", "binary"]
    probe = sections["binary-probe"]
    assert probe["path"] == str(checkout / "vendor" / "cuda-checkpoint")  # the carried binary
    assert probe["help"]["exit"] == 0 and "--action" in probe["help"]["stdout"]
    assert probe["unlock_running"]["exit"] != 0 and probe["mapped_unlock"]["error"] == "CheckpointStepError"
    driver = sections["driver-probe"]
    assert set(driver["states"]) == {"plain", "nvml", "cuinit", "missing_pid"}
    assert driver["lock_timeout"]["name"] == "CUDA_ERROR_NOT_READY", driver["lock_timeout"]
    assert sections["vllm"]["checks"] == {
        "sleep": True, "gpu_freed": True, "pools_wrote": True, "wake": True, "pools_read_back": True,
        "same_output": True,
    }  # fmt: skip
    # The process making the driver call was killed inside it: the stand-in's cut call leaves "failed".
    killed = sections["destructive"]["killed_checkpointer"]
    assert killed["state_at_kill"] == "checkpointing" and not killed["call_ended_before_kill"], killed
    assert killed["caller_exit"] == -signal.SIGKILL and killed["state_after_kill"] == {"value": "failed"}
    assert sections["destructive"]["checks"]["killed_mid_call"]
    # The identity GPU map as users run it: a driver sleep, a wake with --device-map GPU-x=GPU-x.
    identity = driver["identity_map"]
    assert (
        identity["restored"] and identity["wake"]["exit"] == 0 and driver["checks"]["identity_map_restored"]
    )
    assert identity["wake"]["report"]["cuda"]["status"] == "restored", identity["wake"]["report"]["cuda"]
    # Every cycle records its CUDA stage's time, and each driver step's, per process.
    steps = sections["driver"]["speeds"]
    assert steps["cuda_wake_seconds"] > 0, steps
    assert set(steps["cuda_wake_steps"][str(document["demo"]["pid"])]) >= {"restore", "unlock"}, steps
    assert set(steps["cuda_sleep_steps"][str(document["demo"]["pid"])]) >= {"lock", "checkpoint"}, steps
    assert document["reference_speeds"]["host_to_device"] == {"skipped": "dry run: no GPU"}
    # Every CUDA process the run started and did not end otherwise was checkpointed before it was killed.
    retired = document["retired"]
    cut = [r for r in retired if r["why"] == "killed checkpointer"]  # its checkpoint cut: failed for good
    assert [r.get("state_after") for r in cut] == ["failed"], retired
    ended = [r for r in retired if r not in cut]
    assert ended and all(r.get("state_after") == "checkpointed" for r in ended), retired
    assert {r["why"] for r in retired} >= {
        "end of the run", "group", "vllm worker", "killed checkpointer", "pools", "graphs", "cumem",
        "graph-pool-sharing",
    }  # fmt: skip
    assert document["total_seconds"] < 8 * 60


@pytest.mark.slow
def test_every_cycle_fails_when_the_demos_pools_do_nothing(tmp_path: Path, runtime_dir: Path) -> None:
    # The pools sections' demos allocate in hibernate.pool(), which --demo-untracked contradicts; the
    # graphs' demos read untracked weights then, which nothing refuses.
    skip = "vllm,binary-probe,driver-probe,pools,pools-checkpoint,graph-refusal,graph-pool-sharing"
    returncode, document = dry_run(tmp_path, "--demo-untracked", "--skip", skip)
    assert returncode == 1 and not document["ok"]
    cycles = demo_cycles(document)
    assert len(cycles) == 13
    for where, checks in cycles.items():
        pool_checks = {name: ok for name, ok in checks.items() if name.split(".")[-1] in POOL_CHECKS}
        assert len(pool_checks) >= 4 and not any(pool_checks.values()), (where, checks)
        # What the checks were before: these still pass, the checkpoint alone gives them.
        assert checks["sleep"] and checks["wake"] and checks["bit_exact"], (where, checks)
        assert checks.get("gpu_freed", True) and checks.get("cuda_checkpointed", True), (where, checks)
        if "pools_freed" in checks:
            assert not checks["pools_freed"], where
    assert not any(document["sections"]["refusal"]["checks"][name] for name in POOL_CHECKS[:3])


@pytest.mark.slow
def test_a_section_asked_for_and_not_run_fails_the_run(tmp_path: Path, runtime_dir: Path) -> None:
    missing = tmp_path / "no-such-cuda-checkpoint"
    only = "pools-only,binary,binary-probe"
    returncode, document = dry_run(tmp_path, "--only", only, "--cuda-checkpoint", str(missing))
    assert document["checks_failed"] == [] and list(document["sections"]) == ["pools-only"]
    asked = [entry for entry in document["not_run"] if entry["asked"]]
    assert [entry["section"] for entry in asked] == ["binary", "binary-probe"]
    assert "no cuda-checkpoint found" in asked[0]["why"]
    assert returncode == 1 and not document["ok"]


@pytest.mark.slow
def test_a_section_whose_budget_no_longer_fits_is_not_started_and_fails_the_run(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """A section starts only while its whole budget fits in what is left: one started ends in time."""
    returncode, document = dry_run(tmp_path, "--only", "driver", "--budget-s", "10")
    assert document["sections"] == {} and returncode == 1 and not document["ok"]
    asked = [entry for entry in document["not_run"] if entry["asked"]]
    assert [entry["section"] for entry in asked] == ["driver"]
    assert asked[0]["why"].startswith("out of time: its budget is 25 s, "), asked[0]


@pytest.mark.slow
def test_a_terminated_run_checkpoints_what_it_started_before_ending_it(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """SIGTERM (a timeout's) mid-run: the JSON so far is kept, and every demo is checkpointed, then killed."""
    out = tmp_path / "gpu-check.json"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out), "--skip", "vllm"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=REPO,
    )
    try:
        wait_until(
            lambda: out.exists() and "driver" in json.loads(out.read_text() or "{}").get("sections", {}),
            240,
            "the driver cycle to end",
            0.2,
        )
        demo = json.loads(out.read_text())["demo"]["pid"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    document = json.loads(out.read_text())
    assert document["error"].startswith("stopped") and not document["ok"]
    retired = {entry["pid"]: entry for entry in document["retired"]}
    assert retired[demo]["state_after"] == "checkpointed", retired[demo]  # whatever step the stop came in
    assert retired[demo]["exit"] == -signal.SIGKILL
    assert not Path(f"/proc/{demo}").exists()


def test_a_pooled_wake_must_leave_every_pointer_and_the_graphs_replay_as_they_were() -> None:
    same_place = load_script().same_place
    before = {"digest": "d", "graph_digest": "g", "pointers": {"embed.weight": 4096, "kv_cache": 8192}}
    assert same_place(before, dict(before)) == {"same_pointers": True, "graph_bit_exact": True}
    moved = {
        **before,
        "pointers": {"embed.weight": 4096, "kv_cache": 12288},
    }  # one tensor came back elsewhere
    assert same_place(before, moved) == {"same_pointers": False, "graph_bit_exact": True}
    assert not same_place(before, {**before, "graph_digest": "h"})["graph_bit_exact"]
    assert not any(same_place(before, {"error": "no answer"}).values())
    # Answers without pointers or a graph (a demo without --pool --graphs) prove nothing: they fail.
    assert not any(same_place({"digest": "d", "graph_digest": None, "pointers": {}}, before).values())


def test_a_wake_that_moved_memory_under_a_graph_is_recorded_as_it_answered() -> None:
    moved_by = load_script().moved_by
    before = {"digest": "d", "graph_digest": "g", "pointers": {"a": 1, "b": 2, "c": 3}}
    after = {"digest": "d", "graph_digest": "x", "pointers": {"a": 1, "b": 20, "c": 30}}
    assert moved_by(before, after) == {
        "answered": True, "digest_same": True, "graph_digest_same": False, "pointers": 3, "pointers_moved": 2,
    }  # fmt: skip
    assert moved_by(before, {"error": "no answer to 'infer'"}) == {
        "answered": False,
        "error": "no answer to 'infer'",
    }


def test_pool_speeds_set_the_spill_and_restore_beside_the_disk_and_the_providers_backups() -> None:
    pool_speeds = load_script().pool_speeds
    spill, restore = {"gb_per_s": 2.0, "total_bytes": 1 << 30}, {"gb_per_s": 1.5}
    disk = {"write_gb_per_s": 2.5, "read_gb_per_s": 3.0}
    backups = {
        "cpu_backup": {"pause_gb_per_s": 4.0, "resume_gb_per_s": 6.0},
        "disk_backup": {"pause_gb_per_s": 8.0, "pause_and_sync_gb_per_s": 1.0, "resume_gb_per_s": 0.5},
    }
    speeds = pool_speeds(spill, restore, disk, backups)
    assert speeds["bytes"] == 1 << 30
    assert (speeds["spill_of_disk_write"], speeds["restore_of_disk_read"]) == (0.8, 0.5)
    assert (speeds["spill_of_tms_cpu_pause"], speeds["restore_of_tms_cpu_resume"]) == (0.5, 0.25)
    # The disk backup counts once its bytes are durable, as a sleep's snapshot is when it returns.
    assert speeds["spill_of_tms_disk_pause"] == 2.0 and speeds["tms_disk_pause_of_disk_write"] == 0.4
    assert speeds["restore_of_tms_disk_resume"] == 3.0 and speeds["tms_disk_resume_of_disk_read"] == 0.167
    # Backups not measured (a dry run, a failed child): their ratios are None, not 0 or an error.
    unmeasured = pool_speeds(spill, restore, disk, {"skipped": "dry run"})
    assert unmeasured["spill_of_tms_cpu_pause"] is None and unmeasured["spill_of_disk_write"] == 0.8


def test_torch_memory_saver_not_installed_is_an_input_not_given_and_a_broken_one_a_failure(
    tmp_path: Path,
) -> None:
    provider_unusable = load_script().provider_unusable
    run = type("Run", (), {"env": {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}})()
    empty = tmp_path / "empty"
    empty.mkdir()
    why, installed = provider_unusable(run, {"PYTHONPATH": str(empty)})
    assert not installed and why == "torch_memory_saver is not installed (pip install 'hibernate[pools]')"
    broken = tmp_path / "broken" / "torch_memory_saver"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("import numpy_that_is_not_there\n")
    why, installed = provider_unusable(run, {"PYTHONPATH": str(broken.parent)})
    assert installed and why.startswith("torch_memory_saver is installed but cannot be imported: ")
    assert "numpy_that_is_not_there" in why
    (broken / "__init__.py").write_text("torch_memory_saver = object()\n")
    assert provider_unusable(run, {"PYTHONPATH": str(broken.parent)}) is None


def test_the_backups_answer_is_found_among_what_the_library_prints(tmp_path: Path) -> None:
    """torch_memory_saver's C++ core prints its own lines on stdout: the child's JSON is found after them."""
    gpu_check = load_script()
    child = tmp_path / "child.py"
    child.write_text(
        "import json, sys\n"
        "print('[torch_memory_saver.cpp] something the library says', flush=True)\n"
        "print(json.dumps({'cpu_backup': {'pause_gb_per_s': 3.0}, 'argv': sys.argv[1:]}), flush=True)\n"
    )
    gpu_check.POOLS_CHILD = child
    args = type("Args", (), {"dry_run": False, "to": tmp_path})()
    run = type(
        "Run",
        (),
        {
            "args": args,
            "scratch": tmp_path,
            "env": dict(os.environ),
            "fresh_dir": lambda self, name: tmp_path / name,
        },
    )()
    found = gpu_check.provider_backups(run, 1 << 20, {})
    assert found["cpu_backup"] == {"pause_gb_per_s": 3.0} and found["exit"] == 0
    assert found["argv"] == ["--bytes", str(1 << 20), "--disk-dir", str(tmp_path / "tms-disk-backup")]
    assert found["stdout"] == "[torch_memory_saver.cpp] something the library says"


@pytest.mark.slow
def test_the_graph_refusal_fails_when_a_sleep_under_a_graph_is_not_refused(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """With HIBERNATE_ALLOW_MOVES=1 every sleep moves memory under graphs: the refusal does not happen."""
    env = {"HIBERNATE_ALLOW_MOVES": "1"}
    returncode, document = dry_run(tmp_path, "--only", "graph-refusal,pools,pools-checkpoint", env=env)
    assert returncode == 1 and not document["ok"]
    failed = set(document["checks_failed"])
    wanted = {
        f"graph-refusal.{v}.{c}" for v in ("forward", "static") for c in ("refused", "refusal_stays_running")
    }
    assert wanted <= failed, failed
    # Besides: whatever the graph's replay did after that unrefused sleep (recorded), and the names.
    assert {f.split(".")[-1] for f in failed} <= {
        "refused", "refusal_stays_running", "refusal_changed_nothing", "refusal_names_capture",
    }, failed  # fmt: skip
    for variant in document["sections"]["graph-refusal"]["variants"].values():
        assert variant["refused_sleep"]["exit"] == 0 and variant["unrefused_wake"]["exit"] == 0
    # The pooled demo is not concerned: its pools keep every address, with or without the flag.
    for name in ("pools", "pools-checkpoint"):
        assert all(document["sections"][name]["checks"].values()), document["sections"][name]["checks"]


def test_a_section_starts_only_while_its_budget_fits_and_the_pools_demo_is_capped() -> None:
    gpu_check = load_script()
    assert set(gpu_check.SECTION_BUDGETS) == set(gpu_check.SECTIONS)
    assert gpu_check.section_budget("binary-probe", 2048) == 15
    assert gpu_check.section_budget("driver", 2048) == 25 + 6 * 2
    assert gpu_check.section_budget("driver", 8192) == 25 + 6 * 8  # the main demo's weights
    assert gpu_check.section_budget("pools", 8192) == gpu_check.section_budget("pools", 2048)  # capped


def test_a_refusal_must_say_where_the_graph_was_captured() -> None:
    gpu_check = load_script()
    said = "this process has captured CUDA graphs (a CUDA graph captured at /x/hibernate/demo.py:512 (in f))"
    assert gpu_check.capture_named(said)
    assert not gpu_check.capture_named("this process has captured CUDA graphs (memory pool (1, 0))")
    assert not gpu_check.capture_named("a CUDA graph captured at <frozen runpy>:88 (in _run_code)")
    assert not gpu_check.capture_named("demo.py:12 named, but not as where it was captured")
    status = {"agents": [{"graphs": [
        {"captured_at": "/x/demo.py:512 (in f)", "hibernate_pool": False, "pool": [1, 0]},
        {"captured_at": "/x/other.py:3", "hibernate_pool": True, "pool": [0, 2]},
    ]}]}  # fmt: skip
    graphs = gpu_check.agent_graphs(status)
    assert gpu_check.graphs_seen(graphs, "demo.py") == [False]
    assert gpu_check.graphs_seen(graphs, "other.py") == [True]
    assert gpu_check.agent_graphs({"agents": [{"state": "running"}]}) == []  # an agent that lists none
    assert gpu_check.agent_graphs({}) == []


def test_a_tensor_in_the_graphs_pool_after_its_capture_is_judged_only_for_hibernates_pools() -> None:
    sharing_checks = load_script().sharing_checks
    graphs = [
        {
            "captured_at": "/r/scripts/lib/gpu_check_graph_pool.py:106 (in plain_capture)",
            "hibernate_pool": False,
        },
        {
            "captured_at": "/r/scripts/lib/gpu_check_graph_pool.py:114 (in pooled_capture)",
            "hibernate_pool": True,
        },
    ]
    apart = {"replay_correct": True, "overlap": False, "clobbered": False}
    shared = {"replay_correct": True, "overlap": True, "clobbered": True}
    every = {"graphs_replayed": True, "hibernate_separate": True, "status_lists_graphs": True}
    # torch's own pool handing the graph's memory out again is torch's behaviour: recorded, not judged.
    assert sharing_checks({"plain": shared, "hibernate": apart}, graphs) == every
    assert not sharing_checks({"plain": apart, "hibernate": shared}, graphs)["hibernate_separate"]
    clobbered_only = {**apart, "clobbered": True}  # a replay wrote it, whatever the ranges said
    assert not sharing_checks({"plain": apart, "hibernate": clobbered_only}, graphs)["hibernate_separate"]
    refused = {"replay_correct": True, "refused": "UsageError: a graph was captured into this tag"}
    assert sharing_checks({"plain": apart, "hibernate": refused}, graphs)["hibernate_separate"]
    # A capture that computed nothing proves nothing; graphs the agent did not list fail.
    assert not sharing_checks({"plain": apart, "hibernate": {**apart, "replay_correct": False}}, graphs)[
        "hibernate_separate"
    ]
    assert not sharing_checks({"plain": apart, "hibernate": apart}, graphs[1:])["status_lists_graphs"]
    assert not sharing_checks({}, graphs)["graphs_replayed"]


def test_the_ceiling_sets_each_wake_beside_the_pinned_copy() -> None:
    ceiling_speeds = load_script().ceiling_speeds

    def entry(spill: float, restore: float) -> dict[str, Any]:
        return {
            "sleep": {"report": {"processes": [{"gb_per_s": spill}]}},
            "wake": {"report": {"processes": [{"gb_per_s": restore}]}},
        }

    speeds = ceiling_speeds({"gb_per_s": 50.0}, entry(10.0, 25.0), entry(2.0, 2.5), None)
    assert speeds["host_to_device_gb_per_s"] == 50.0
    assert (
        speeds["page_cache_restore_gb_per_s"] == 25.0
        and speeds["page_cache_restore_of_host_to_device"] == 0.5
    )
    assert speeds["disk_restore_of_host_to_device"] == 0.05 and speeds["disk_spill_gb_per_s"] == 2.0
    assert speeds["tmpfs_restore_gb_per_s"] is None and speeds["tmpfs_restore_of_host_to_device"] is None
    unmeasured = ceiling_speeds({"skipped": "dry run: no GPU"}, entry(1.0, 2.0), entry(1.0, 1.0), None)
    assert unmeasured["page_cache_restore_gb_per_s"] == 2.0
    assert unmeasured["page_cache_restore_of_host_to_device"] is None
    assert unmeasured["goals"]["memory_restore_of_host_to_device"]["met"] is None


def test_the_ceiling_judges_its_goals_and_names_each_wake_s_tuning_and_wall_time() -> None:
    ceiling_speeds = load_script().ceiling_speeds
    tuning = {"io_depth": 2, "workers": 8, "filesystem": "ext4", "kind": "local"}

    def entry(restore: float, of_read: float | None = None) -> dict[str, Any]:
        return {
            "sleep": {"report": {"processes": [{"gb_per_s": 1.0}]}, "wall_seconds": 3.0},
            "wake": {"report": {"processes": [{"gb_per_s": restore, "tuning": tuning}]}, "wall_seconds": 2.0},
            "speeds": {"restore_of_disk_read": of_read},
        }

    speeds = ceiling_speeds({"gb_per_s": 50.0}, entry(20.0), entry(5.0, 0.95), entry(30.0))
    assert speeds["goals"]["memory_restore_of_host_to_device"] == {"value": 0.6, "goal": 0.5, "met": True}
    assert speeds["goals"]["disk_restore_of_disk_read"] == {"value": 0.95, "goal": 0.9, "met": True}
    assert speeds["disk_restore_tuning"] == tuning and speeds["disk_wake_wall_seconds"] == 2.0
    slow = ceiling_speeds({"gb_per_s": 50.0}, entry(20.0), entry(5.0, 0.5), None)
    assert slow["goals"]["memory_restore_of_host_to_device"]["met"] is False  # 0.4 of the copy
    assert slow["goals"]["disk_restore_of_disk_read"]["met"] is False


def test_a_snapshot_is_read_into_the_page_cache_or_dropped_from_it_as_its_wake_needs(tmp_path: Path) -> None:
    gpu_check = load_script()
    snapshot = tmp_path / "snapshot"
    (snapshot / "pools").mkdir(parents=True)
    (snapshot / "pools" / "data").write_bytes(os.urandom(8 << 20))
    (snapshot / "manifest").write_bytes(b"")  # an empty file counts for nothing
    dropped = gpu_check.evicted(snapshot)["page_cache"]
    assert dropped["bytes"] == 8 << 20 and dropped["share"] <= gpu_check.COLD_SHARE, dropped
    warm = gpu_check.warmed(snapshot)
    assert warm["page_cache"]["share"] >= gpu_check.CACHED_SHARE and warm["warm_seconds"] >= 0, warm
    assert gpu_check.page_cache(tmp_path / "nothing-here") == {"bytes": 0, "resident_bytes": 0, "share": None}


def test_a_side_write_counts_only_if_it_landed_once_the_sleep_had_begun() -> None:
    probes_checks = load_script().probes_checks
    after = {"scratch_zeroed": True, "side_kept": True, "side_stream": True}
    landed = probes_checks({**after, "side_landed": {"state": "quiesced", "seconds": 3.2}}, {}, [])
    assert landed == {"dropped_zeroed": True, "side_kept": True, "side_in_sleep": True}
    # Landed before the sleep began: kept whatever the spill did, so it proves nothing.
    early = probes_checks({**after, "side_landed": {"state": "running", "seconds": 0.1}}, {}, [])
    assert early["side_kept"] and not early["side_in_sleep"]
    assert not probes_checks({**after, "side_landed": None}, {}, [])["side_in_sleep"]  # never landed
    # No side stream (a CPU demo): its write is synchronous, there is nothing to judge.
    assert "side_in_sleep" not in probes_checks({**after, "side_stream": False}, {}, [])


def test_a_child_that_does_not_answer_is_given_up_on_at_its_deadline(tmp_path: Path) -> None:
    """The cumem child's answers are awaited with a deadline: a child hung in a call does not hold the run."""
    read_line = load_script().read_line
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; print('one', flush=True); sys.stdout.write('tw'); "
         "sys.stdout.flush(); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        fd = child.stdout.fileno()
        assert read_line(fd, time.monotonic() + 60) == "one\n"
        started = time.monotonic()
        assert read_line(fd, started + 1) is None  # half a line, then nothing: given up on
        assert time.monotonic() - started < 30
    finally:
        child.kill()
        child.wait()
    assert read_line(fd, time.monotonic() + 60) is None  # it ended: no line


@pytest.mark.slow
def test_a_stop_during_a_long_step_goes_on_after_the_grace(tmp_path: Path) -> None:
    """A stop waits for the CLI step in flight a bounded while, then goes on: the run's ending (every
    demo checkpointed, then killed) must fit before the hard stop's SIGKILL."""
    began = tmp_path / "step-began"
    code = (
        "import importlib.machinery, importlib.util, os, signal, sys\n"
        f"loader = importlib.machinery.SourceFileLoader('gpu_check', {str(SCRIPT)!r})\n"
        "spec = importlib.util.spec_from_loader('gpu_check', loader)\n"
        "module = importlib.util.module_from_spec(spec); loader.exec_module(module)\n"
        "signal.signal(signal.SIGTERM, module._terminated)\n"
        "step = [sys.executable, '-c', 'import os, sys, time; "
        'open(sys.argv[1], "w").write(str(os.getpid())); time.sleep(300)\', sys.argv[1]]\n'
        "try:\n"
        "    module.cli_step(step, dict(os.environ), stop_grace=1)\n"
        "except KeyboardInterrupt:\n"
        "    sys.exit(7)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, str(began)], cwd=REPO)
    step_pid = 0
    try:
        wait_until(
            lambda: proc.poll() is not None or (began.exists() and began.read_text() != ""),
            60,
            "the step to begin",
            0.05,
        )
        assert proc.poll() is None, "the stopped process ended before its step began"
        step_pid = int(began.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 7  # not the step's own 240 s
        assert Path(f"/proc/{step_pid}").exists()  # the step, in a session of its own, is left to end
    finally:
        if proc.poll() is None:
            proc.kill()
        if step_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(step_pid, signal.SIGKILL)


def checkout_with_vendor(tmp_path: Path, *files: str) -> Path:
    """A checkout whose scripts are the repository's and whose vendor/ holds ``files`` (empty ones)."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts" / "lib").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "gpu-run", checkout / "scripts" / "gpu-run")
    shutil.copy(
        REPO / "scripts" / "lib" / "gpu_run_site.py", checkout / "scripts" / "lib" / "gpu_run_site.py"
    )
    (checkout / "vendor").mkdir()
    for name in files:
        (checkout / "vendor" / name).write_text("")
    return checkout / "scripts" / "gpu-run"


def gpu_run_env(out: Path, **more: str) -> dict[str, str]:
    """What gpu-run runs with here: this interpreter as python3, a dry run's imports (torch without CUDA)."""
    env = {
        **os.environ, "OUT": str(out), "GPU_CHECK_ARGS": "--dry-run",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **more,
    }  # fmt: skip
    env.pop("GPU_CHECK_WITHOUT_VENDOR", None)
    return env


def wheel(path: Path, files: dict[str, str]) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)


TMS_WHEEL = "torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl"


def test_gpu_run_stops_at_once_without_the_torch_memory_saver_wheel(tmp_path: Path) -> None:
    gpu_run = checkout_with_vendor(tmp_path, "cuda-checkpoint", "cumem_allocator.abi3.so")
    out = tmp_path / "out"
    proc = subprocess.run([str(gpu_run)], capture_output=True, text=True, env=gpu_run_env(out), timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "missing vendor/torch_memory_saver-0.0.10-*.whl (see the head of scripts/gpu-run" in proc.stderr
    assert not out.exists()
    # A carried wheel that is no zip (cut short on its way): said, before anything starts.
    (gpu_run.parent.parent / "vendor" / TMS_WHEEL).write_text("not a zip")
    proc = subprocess.run([str(gpu_run)], capture_output=True, text=True, env=gpu_run_env(out), timeout=60)
    assert proc.returncode == 3 and "could not unpack what vendor/ carries" in proc.stderr, proc.stderr
    assert "BadZipFile" in proc.stderr and not (out / "gpu-check.stdout").exists()


@pytest.mark.slow
def test_gpu_run_unpacks_every_carried_wheel_onto_the_pythonpath(tmp_path: Path) -> None:
    """Nothing can be installed on the GPU machine: each vendor/*.whl is unpacked and importable."""
    gpu_run = checkout_with_vendor(tmp_path, "cuda-checkpoint", "cumem_allocator.abi3.so")
    vendor = gpu_run.parent.parent / "vendor"
    wheel(vendor / TMS_WHEEL, {"torch_memory_saver/__init__.py": "where = __file__\n"})
    wheel(vendor / "carried-1.0-py3-none-any.whl", {"carried.py": "VALUE = 7\n"})
    # gpu-check's stand-in: it reports what it can import, as the real one's pools section would.
    (gpu_run.parent / "gpu-check").write_text(
        "import sys, carried, torch_memory_saver\n"
        "print(carried.VALUE, torch_memory_saver.where)\n"
        "print(' '.join(sys.argv[1:]), file=sys.stderr)\n"
    )
    out = tmp_path / "out"
    proc = subprocess.run([str(gpu_run)], capture_output=True, text=True, env=gpu_run_env(out), timeout=120)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    value, where = (out / "gpu-check.stdout").read_text().split()
    assert value == "7" and where.endswith("torch_memory_saver/__init__.py")
    assert not where.startswith(str(vendor))  # unpacked elsewhere: the checkout is left as it was
    assert sorted(p.name for p in vendor.iterdir()) == sorted(
        [TMS_WHEEL, "carried-1.0-py3-none-any.whl", "cuda-checkpoint", "cumem_allocator.abi3.so"]
    )
    log = (out / "gpu-run.log").read_text()
    assert "--cuda-checkpoint" in log and "--vllm-cumem" in log and "torch_memory_saver" in log
    assert "--size-mb 2048 --budget-s 380" in log  # 2 GiB, and no section starts that would end past 380 s


@pytest.mark.slow
def test_gpu_run_stops_before_anything_starts_when_an_import_the_run_needs_fails(tmp_path: Path) -> None:
    gpu_run = checkout_with_vendor(tmp_path, "cuda-checkpoint", "cumem_allocator.abi3.so")
    wheel(gpu_run.parent.parent / "vendor" / TMS_WHEEL, {"torch_memory_saver/__init__.py": ""})
    broken = gpu_run.parent.parent / "vendor" / "site" / "orjson"
    broken.mkdir(parents=True)  # vendor/site comes first on PYTHONPATH: an orjson that cannot be imported
    (broken / "__init__.py").write_text("raise ImportError('no orjson for this Python')\n")
    (gpu_run.parent / "gpu-check").write_text("raise SystemExit('gpu-check must not start')\n")
    out = tmp_path / "out"
    proc = subprocess.run([str(gpu_run)], capture_output=True, text=True, env=gpu_run_env(out), timeout=120)
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "cannot import orjson (ImportError: no orjson for this Python)" in proc.stderr
    assert "torch_memory_saver" not in proc.stderr.split("cannot import")[1]  # only what fails is named
    assert not (out / "gpu-check.stdout").exists()


def test_gpu_run_stops_at_once_when_a_vendor_file_is_missing(tmp_path: Path) -> None:
    """Without cuda-checkpoint or vLLM's cumem extension the run would miss sections: it refuses first."""
    gpu_run = checkout_with_vendor(tmp_path, "cuda-checkpoint")
    out = tmp_path / "out"
    proc = subprocess.run([str(gpu_run)], capture_output=True, text=True, env=gpu_run_env(out), timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert (
        "missing vendor/cumem_allocator.abi3.so" in proc.stderr
        and "GPU_CHECK_WITHOUT_VENDOR=1" in proc.stderr
    )
    assert "cuda-checkpoint" not in proc.stderr.split("(")[0]  # only what is missing is named
    assert not out.exists()  # nothing was started


def load_site() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gpu_run_site", REPO / "scripts" / "lib" / "gpu_run_site.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_what_the_image_lacks_is_unpacked_for_its_own_python_and_a_group_goes_whole(tmp_path: Path) -> None:
    import zipfile

    site = load_site()
    vendor = tmp_path / "vendor"
    for name, files in {
        "wheels/common/fastjson-1.0.zip": {"fastjson/__init__.py": "SHARED = 1\n"},
        "wheels/cp311/fastjson-1.0.zip": {"fastjson/_speed.cp311.so": "311"},
        "wheels/cp312/fastjson-1.0.zip": {"fastjson/_speed.cp312.so": "312"},
        "wheels/any/clitool-2.0-py3-none-any.whl": {"clitool/__init__.py": ""},
        "wheels/any/clidep-1.0-py3-none-any.whl": {"clidep/__init__.py": ""},
        "wheels/common/onlyold-1.0.zip": {"onlyold/__init__.py": ""},
        "loose-1.0-py3-none-any.whl": {"loose.py": ""},
    }.items():
        (vendor / name).parent.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(vendor / name, "w") as archive:
            for member, text in files.items():
                archive.writestr(member, text)
    manifest = {
        "tags": ["cp311", "cp312"],
        "packages": [
            {"dist": "fastjson", "module": "fastjson", "files": ["wheels/common/fastjson-1.0.zip"],
             "per_python": {tag: f"wheels/{tag}/fastjson-1.0.zip" for tag in ("cp311", "cp312")}},
            {"dist": "clitool", "module": "clitool", "group": "cli",
             "files": ["wheels/any/clitool-2.0-py3-none-any.whl"], "per_python": {}},
            {"dist": "clidep", "module": "json", "group": "cli",  # the image has it, the group does not
             "files": ["wheels/any/clidep-1.0-py3-none-any.whl"], "per_python": {}},
            {"dist": "onlyold", "module": "onlyold", "pythons": ["cp311"],  # a marker's: 3.11 only
             "files": ["wheels/common/onlyold-1.0.zip"], "per_python": {}},
            {"dist": "pip", "module": "json", "files": [], "per_python": {}},  # the image has it
        ],
    }  # fmt: skip
    (vendor / "vendor.json").write_text(json.dumps(manifest))
    done = site.unpack(vendor, tmp_path / "site312", tag="cp312")
    assert done["unpacked"] == ["fastjson", "clitool", "clidep"] and done["wheels"] == [
        "loose-1.0-py3-none-any.whl"
    ]
    unpacked = {p.relative_to(tmp_path / "site312").as_posix() for p in (tmp_path / "site312").rglob("*.*")}
    assert unpacked == {
        "fastjson/__init__.py", "fastjson/_speed.cp312.so", "clitool/__init__.py", "clidep/__init__.py",
        "loose.py",
    }  # fmt: skip
    assert site.unpack(vendor, tmp_path / "site311", tag="cp311")["unpacked"] == [
        "fastjson", "clitool", "clidep", "onlyold",
    ]  # fmt: skip
    # A Python no compiled file was carried for: those packages named (the run's import check stops
    # it then), the pure ones unpacked all the same.
    other = site.unpack(vendor, tmp_path / "site313", tag="cp313")
    assert other["no_files_for_this_python"] == ["fastjson"] and other["unpacked"] == ["clitool", "clidep"]


def test_an_image_package_older_than_hibernate_needs_counts_as_lacking() -> None:
    site = load_site()
    assert site.version_key("3.10.18") > site.version_key("3.9") and site.version_key("2.13.0+cu130") == (
        2,
        13,
        0,
    )
    installed = importlib.metadata.version("psutil")
    assert site.image_has({"dist": "psutil", "module": "psutil", "min": installed})
    assert not site.image_has({"dist": "psutil", "module": "psutil", "min": "999"})
    assert not site.image_has({"dist": "nothere", "module": "no_module_of_that_name"})
    assert site.import_problem("no_module_of_that_name", dry_run=True).startswith(
        "no_module_of_that_name (ModuleNotFoundError"
    )
    assert site.import_problem("json", dry_run=False) is None


def test_gpu_vendor_carries_the_files_every_python_shares_once(tmp_path: Path) -> None:
    import zipfile

    loader = importlib.machinery.SourceFileLoader("gpu_vendor", str(REPO / "scripts" / "gpu-vendor"))
    spec = importlib.util.spec_from_loader("gpu_vendor", loader)
    assert spec is not None
    vendor = importlib.util.module_from_spec(spec)
    loader.exec_module(vendor)
    wheels = {}
    for tag in ("cp311", "cp312"):
        wheels[tag] = tmp_path / f"thing-1.0-{tag}-{tag}-manylinux2014_x86_64.whl"
        wheel(wheels[tag], {"thing/__init__.py": "", "thing.libs/blas.so": "same", f"thing/_c.{tag}.so": tag})
    entry = vendor.split_common(wheels, tmp_path / "common", tmp_path)
    with zipfile.ZipFile(entry["files"][0]) as common:
        assert sorted(common.namelist()) == ["thing.libs/blas.so", "thing/__init__.py"]
    for tag in wheels:
        with zipfile.ZipFile(entry["per_python"][tag]) as own:
            assert own.namelist() == [f"thing/_c.{tag}.so"]
    assert vendor.top_module(wheels["cp311"]) == "thing"
    assert vendor.normalized("Markdown-It.Py") == "markdown_it_py"


def test_the_demos_static_graph_is_a_graph_over_tracked_weights_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from hibernate.demo import main

    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--pool", "--graphs", "static"])
    assert stopped.value.code == 2  # a pool keeps its graph's addresses: no refusal to show there
    assert (
        "--graphs static is a graph over tracked weights; with --pool use --graphs" in capsys.readouterr().err
    )
