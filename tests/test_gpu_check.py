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


def load_script() -> ModuleType:
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
        return namespace

    assert gpu_check.not_asked(args("binary,group", "tmpfs")) == {
        "binary": "--skip",
        "group": "--skip",
        "tmpfs": "--skip",
        "cumem": "no --vllm-cumem given",
        "vllm": "no --vllm-model given (a local model directory or a cached name)",
    }
    with pytest.raises(SystemExit, match="--skip nonsense: not a section"):
        gpu_check.not_asked(args("nonsense"))
    result = {
        "sections": {
            "driver": {"checks": {"a": True, "b": False}},
            "group": {"cycles": [{"checks": {"c": False}}]},
        }
    }
    assert gpu_check.failed_checks(result) == ["driver.b", "group[0].c"]


@pytest.mark.slow
def test_the_dry_run_walks_every_check_and_writes_its_json(tmp_path: Path, runtime_dir: Path) -> None:
    returncode, document = dry_run(tmp_path)
    assert returncode == 0 and document["ok"], document.get("checks_failed") or document["not_run"]
    environment = document["environment"]
    assert {"kernel", "container_runtime", "driver", "cuda", "torch", "torch_cuda", "gpu_models"} <= set(
        environment
    )
    assert environment["driver"] == "580.95.05" and environment["gpu_models"] == ["StandIn-H200"]
    sections = document["sections"]
    assert list(sections) == [s for s in load_script().SECTIONS if s != "cumem"]
    assert document["not_run"] == [{"section": "cumem", "why": "no --vllm-cumem given", "asked": False}]
    cycles = demo_cycles(document)
    assert set(cycles) == {
        "pools-only", "driver", "binary", "tmpfs", "pools[0]", "pools[1]", "expandable[0]",
        "expandable[1]", "group[0]", "group[1]", "background[0]",
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
    assert len({sections[n]["snapshot_dir"] for n in ("pools-only", "driver", "binary", "tmpfs")}) == 4
    assert sections["refusal"]["checks"] == {
        "sleep": True, "refused": True, "stays_asleep": True, "wake": True, "bit_exact": True,
        "pools_wrote": True, "pools_read_back": True, "pools_zeroed": True,
    }  # fmt: skip
    assert sections["refusal"]["refused_wake"]["exit"] == 12
    pools = sections["pools"]  # hibernate.pool() over the stand-in torch_memory_saver, a stand-in graph
    assert pools["demo"]["pooled"] and pools["demo"]["graphs"] and pools["reference"]["graph_digest"]
    for entry in pools["cycles"]:
        assert entry["checks"]["same_pointers"] and entry["checks"]["graph_bit_exact"], entry["checks"]
    assert [c["checkpointer"] for c in pools["cycles"]] == ["none", "driver"]
    assert pools["checks"] == {
        "refused": True, "refusal_stays_running": True, "refusal_changed_nothing": True,
        "allow_moves_slept": True, "allow_moves_woke": True,
    }  # fmt: skip
    refusal = pools["graphs_refusal"]
    assert refusal["refused_sleep"]["exit"] == 15
    assert "captured CUDA graphs" in refusal["refused_sleep"]["report"]["error"]["message"]
    assert "after_moves" in refusal  # what the graph replays after a wake that moved its memory: recorded
    speeds = pools["speeds"]
    assert speeds["spill_of_disk_write"] and speeds["restore_of_disk_read"], speeds
    assert abs(speeds["bytes"] - pools["disk_same_bytes"]["bytes"]) < 8 << 20  # the disk's 8 MiB requests
    assert pools["provider_backups"] == {
        "skipped": "dry run: the stand-in torch_memory_saver has no CPU or disk backup"
    }
    assert sections["group"]["cycles"][0]["checks"]["cuda_checkpointed"]  # the three together
    assert [c["checkpointer"] for c in sections["group"]["cycles"]] == ["driver", "binary"]
    probe = sections["binary-probe"]
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
        "end of the run", "group", "vllm worker", "killed checkpointer", "pools", "graphs",
    }  # fmt: skip
    assert document["total_seconds"] < 8 * 60


@pytest.mark.slow
def test_every_cycle_fails_when_the_demos_pools_do_nothing(tmp_path: Path, runtime_dir: Path) -> None:
    # The pools section's demos allocate in hibernate.pool(), which --demo-untracked does not change.
    skip = "vllm,binary-probe,driver-probe,pools"
    returncode, document = dry_run(tmp_path, "--demo-untracked", "--skip", skip)
    assert returncode == 1 and not document["ok"]
    cycles = demo_cycles(document)
    assert len(cycles) == 9
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
    skip = "refusal,pools,tmpfs,driver-probe,expandable,group,background,vllm,destructive,driver"
    missing = tmp_path / "no-such-cuda-checkpoint"
    returncode, document = dry_run(tmp_path, "--skip", skip, "--cuda-checkpoint", str(missing))
    assert document["checks_failed"] == [] and list(document["sections"]) == ["pools-only"]
    asked = [entry for entry in document["not_run"] if entry["asked"]]
    assert [entry["section"] for entry in asked] == ["binary", "binary-probe"]
    assert "no cuda-checkpoint found" in asked[0]["why"]
    assert returncode == 1 and not document["ok"]


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
def test_the_pools_section_fails_when_a_sleep_under_a_graph_is_not_refused(
    tmp_path: Path, runtime_dir: Path
) -> None:
    """With HIBERNATE_ALLOW_MOVES=1 every sleep moves memory under graphs: the refusal does not happen."""
    others = ",".join(s for s in load_script().SECTIONS if s != "pools")
    returncode, document = dry_run(tmp_path, "--skip", others, env={"HIBERNATE_ALLOW_MOVES": "1"})
    assert returncode == 1 and not document["ok"]
    failed = document["checks_failed"]
    assert {"pools.refused", "pools.refusal_stays_running"} <= set(failed), failed
    # Besides: what the graph's replay did after that unrefused sleep, whatever moved (recorded).
    assert set(failed) <= {"pools.refused", "pools.refusal_stays_running", "pools.refusal_changed_nothing"}
    refusal = document["sections"]["pools"]["graphs_refusal"]
    assert refusal["refused_sleep"]["exit"] == 0 and refusal["unrefused_wake"]["exit"] == 0
    # The pooled demo is not concerned: its pools keep every address, with or without the flag.
    for entry in document["sections"]["pools"]["cycles"]:
        assert all(entry["checks"].values()), entry["checks"]


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
    """A copy of scripts/gpu-run in a checkout whose vendor/ holds ``files`` (empty ones)."""
    scripts = tmp_path / "checkout" / "scripts"
    scripts.mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "gpu-run", scripts / "gpu-run")
    (tmp_path / "checkout" / "vendor").mkdir()
    for name in files:
        (tmp_path / "checkout" / "vendor" / name).write_text("")
    return scripts / "gpu-run"


def wheel(path: Path, files: dict[str, str]) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)


TMS_WHEEL = "torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl"


def test_gpu_run_stops_at_once_without_the_torch_memory_saver_wheel(tmp_path: Path) -> None:
    gpu_run = checkout_with_vendor(tmp_path, "cuda-checkpoint", "cumem_allocator.abi3.so")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    env.pop("GPU_CHECK_WITHOUT_VENDOR", None)
    proc = subprocess.run([str(gpu_run)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "missing vendor/torch_memory_saver-0.0.10-*.whl (see the head of scripts/gpu-run)" in proc.stderr
    assert not out.exists()


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
    env = {**os.environ, "OUT": str(out)}
    proc = subprocess.run([str(gpu_run)], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    value, where = (out / "gpu-check.stdout").read_text().split()
    assert value == "7" and where.endswith("torch_memory_saver/__init__.py")
    assert not where.startswith(str(vendor))  # unpacked elsewhere: the checkout is left as it was
    assert sorted(p.name for p in vendor.iterdir()) == sorted(
        [TMS_WHEEL, "carried-1.0-py3-none-any.whl", "cuda-checkpoint", "cumem_allocator.abi3.so"]
    )
    log = (out / "gpu-run.log").read_text()
    assert "--cuda-checkpoint" in log and "--vllm-cumem" in log and "torch_memory_saver" in log


def test_gpu_run_stops_at_once_when_a_vendor_file_is_missing(tmp_path: Path) -> None:
    """Without cuda-checkpoint or vLLM's cumem extension the run would miss sections: it refuses first."""
    scripts = tmp_path / "checkout" / "scripts"
    scripts.mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "gpu-run", scripts / "gpu-run")
    (tmp_path / "checkout" / "vendor").mkdir()
    (tmp_path / "checkout" / "vendor" / "cuda-checkpoint").write_text("")
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out)}
    env.pop("GPU_CHECK_WITHOUT_VENDOR", None)
    proc = subprocess.run([str(scripts / "gpu-run")], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert (
        "missing vendor/cumem_allocator.abi3.so" in proc.stderr
        and "GPU_CHECK_WITHOUT_VENDOR=1" in proc.stderr
    )
    assert "cuda-checkpoint" not in proc.stderr.split("(")[0]  # only what is missing is named
    assert not out.exists()  # nothing was started
