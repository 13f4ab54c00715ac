"""A live demo process, put to sleep and woken by the real CLI: memory given back, outputs bit-exact."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from hibernate.operation.options import share_staging
from tests.conftest import spill_root_of, stays_false


def kept_bytes(report: dict) -> int:
    return sum(p["total_bytes"] for p in report["processes"])


@pytest.mark.slow
def test_sleep_gives_back_memory_and_wake_is_bit_exact(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=256)
    reference = demo.infer()
    rss_awake = demo.rss()

    result = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json")
    assert result.returncode == 0, result.stderr
    report = result.json()
    keep = kept_bytes(report)
    assert keep >= demo.info["weight_bytes"]

    rss_asleep = demo.rss()
    assert rss_awake - rss_asleep >= 0.9 * keep, (rss_awake, rss_asleep, keep)
    snapshot = Path(report["processes"][0]["snapshot"])
    process = report["processes"][0]
    # Every kept byte is on disk: written now, or identical to a chunk already written.
    assert process["written_bytes"] + process["reused_bytes"] == keep
    on_disk = sum(f.stat().st_size for f in snapshot.iterdir() if f.name.startswith("data-"))
    assert on_disk >= process["written_bytes"] >= 0.95 * keep
    assert report["cuda"] == {"status": "none (skipped)", "processes": []}

    woken = cli("wake", str(demo.pid), "--json")
    assert woken.returncode == 0, woken.stderr
    assert woken.json()["processes"][0]["restored_bytes"] == keep
    assert demo.infer()["digest"] == reference["digest"]


@pytest.mark.slow
def test_twenty_cycles_stay_bit_exact_without_growing(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=48)
    reference = demo.infer()["digest"]
    fds, rss, disk = [], [], []
    for cycle in range(20):
        asleep = cli("sleep", str(demo.pid), "--to", str(work_dir), "--quiet")
        assert asleep.returncode == 0, f"cycle {cycle}: {asleep.stderr}"
        woken = cli("wake", str(demo.pid), "--quiet")
        assert woken.returncode == 0, f"cycle {cycle}: {woken.stderr}"
        root = spill_root_of(work_dir, demo.pid)
        # Sampled before the demo's inference allocates (and fragments) activation memory of its own.
        fds.append(demo.open_fds())
        rss.append(demo.rss())
        disk.append(sum(f.stat().st_size for f in root.rglob("data-*.bin")))
        assert demo.infer()["digest"] == reference, f"cycle {cycle} differs"
    # A leak grows by one or more per cycle; the demo's own request socket may add one transiently.
    assert min(fds[-5:]) <= min(fds[:5]) and max(fds) - min(fds) <= 1, f"open file descriptors grew: {fds}"
    # A leak stays and repeats every cycle, so the lowest of the last three readings is 13+ cycles
    # of it above cycle 4's: more than the tracked 48 MiB for a leak of 4 MiB a cycle, or of one
    # copy of the weights. The lowest, not the highest: on a loaded machine a reading may catch a
    # transient peak (up to 43 MiB seen with six runs at once) that the next reading has given back.
    # The heap alone may step up once (glibc moving its mmap threshold: steps of 20-31 MiB seen,
    # then flat), which is not growth. Slower leaks are the soak's to find: 200 cycles, by trend.
    assert min(rss[-3:]) - rss[4] < 48 << 20, f"resident memory grew: {rss}"
    # Only the newest snapshot stays published, and its unchanged data is shared, not copied.
    assert len(list(root.glob("snap-*/manifest.json"))) == 1
    assert disk[-1] == disk[1], f"disk use grew: {disk}"


@pytest.mark.slow
def test_infer_during_sleep_waits_for_wake(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    import threading

    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "--quiet").returncode == 0
    answers: list[dict] = []
    waiter = threading.Thread(target=lambda: answers.append(demo.infer()))
    waiter.start()
    stays_false(lambda: not waiter.is_alive(), 1.0, "inference ran while the process was asleep")
    assert cli("wake", str(demo.pid), "--quiet").returncode == 0
    waiter.join(timeout=60)
    assert answers and answers[0]["digest"] == reference


def test_status_and_ls_show_the_agent_and_its_snapshot(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    listed = cli("ls", "--json").json()["agents"]
    assert [a["pid"] for a in listed] == [demo.pid]
    assert listed[0]["state"] == "running"
    tags = {(p["tag"], p["keep"]) for p in listed[0]["pools"]}
    assert tags == {("weights", True), ("kv_cache", False)}

    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    status = cli("status", str(demo.pid), "--json").json()["agents"][0]
    assert status["state"] == "asleep"
    assert status["snapshot"]["path"].startswith(str(work_dir))
    human = cli("status", str(demo.pid))
    assert "asleep" in human.stdout and str(demo.pid) in human.stdout


def test_second_sleep_of_unchanged_model_writes_no_data(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=32)
    first = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json").json()["processes"][0]
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    second = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json").json()["processes"][0]
    assert first["written_bytes"] >= first["total_bytes"] - (1 << 20)
    assert second["written_bytes"] == 0
    assert second["reused_bytes"] == second["total_bytes"]
    assert cli("wake", str(demo.pid), "-q").returncode == 0


def test_relative_to_directory_is_created_private(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    result = cli("sleep", str(demo.pid), "--to", "snaps/today", "--json", cwd=work_dir)
    assert result.returncode == 0, result.stderr
    target = work_dir / "snaps" / "today"
    assert result.json()["directory"] == str(target)
    assert target.stat().st_mode & 0o777 == 0o700
    assert spill_root_of(target, demo.pid).stat().st_mode & 0o777 == 0o700
    assert cli("wake", str(demo.pid), "-q").returncode == 0


@pytest.mark.parametrize("exit_code", list(ExitCode))
def test_exit_codes_are_stable(exit_code: ExitCode) -> None:
    documented = {
        "OK": 0,
        "FAILURE": 1,
        "USAGE": 2,
        "NO_SUCH_PROCESS": 3,
        "NOTHING_TO_HIBERNATE": 4,
        "PERMISSION_DENIED": 5,
        "WRONG_STATE": 6,
        "BUSY": 7,
        "SNAPSHOT_INVALID": 8,
        "IO_ERROR": 9,
        "TIMEOUT": 10,
        "CUDA_CHECKPOINT": 11,
        "UNSUPPORTED": 12,
        "NEEDS_RECOVERY": 13,
        "SERVER_FAILED": 14,
        "ADDRESSES_WOULD_MOVE": 15,
        "INTERRUPTED": 130,
    }
    assert documented[exit_code.name] == exit_code.value


@pytest.mark.parametrize(
    ("budget_mb", "processes", "each_mb", "at_once"),
    [
        (256, 1, 256, 1),  # one process has the whole budget, as before
        (256, 8, 32, 8),  # eight workers of one node share it
        (256, 3, 85, 3),
        (64, 8, 16, 4),  # shares below the floor: fewer at once, never more than the budget
        (16, 5, 16, 1),
    ],
)
def test_one_staging_budget_is_shared_by_the_processes_moving_together(
    budget_mb: int, processes: int, each_mb: int, at_once: int
) -> None:
    share = share_staging(budget_mb, processes)
    assert (share.buffer_mb, share.at_once) == (each_mb, at_once)
    assert share.buffer_mb * share.at_once <= budget_mb


@pytest.mark.slow
def test_processes_sleeping_together_stage_within_one_budget(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demos = [start_demo(size_mb=64) for _ in range(3)]
    references = [demo.infer()["digest"] for demo in demos]
    pids = [str(demo.pid) for demo in demos]

    slept = cli("sleep", *pids, "--to", str(work_dir), "--buffer-mb", "48", "--json")
    assert slept.returncode == 0, slept.stderr
    spills = slept.json()["processes"]
    assert sorted(p["pid"] for p in spills) == sorted(demo.pid for demo in demos)
    assert all(0 < p["staging_bytes"] <= 16 << 20 for p in spills), [p["staging_bytes"] for p in spills]

    woken = cli("wake", *pids, "--buffer-mb", "48", "--json")
    assert woken.returncode == 0, woken.stderr
    restores = woken.json()["processes"]
    assert all(0 < p["staging_bytes"] <= 16 << 20 for p in restores), [p["staging_bytes"] for p in restores]
    assert [demo.infer()["digest"] for demo in demos] == references


def test_the_io_depth_and_workers_given_are_those_a_sleep_and_a_wake_run_with(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    slept = cli(
        "sleep", str(demo.pid), "--to", str(work_dir), "--io-depth", "3", "--io-workers", "1", "--json"
    )
    assert slept.returncode == 0, slept.stderr
    assert {**slept.json()["processes"][0]["tuning"], "filesystem": None, "kind": None} == {
        "io_depth": 3, "workers": 1, "filesystem": None, "kind": None,
    }  # fmt: skip
    woken = cli("wake", str(demo.pid), "--json", env={"HIBERNATE_IO_DEPTH": "5"})
    assert woken.returncode == 0, woken.stderr
    tuning = woken.json()["processes"][0]["tuning"]
    assert tuning["io_depth"] == 5 and tuning["workers"] >= 2  # the workers chosen from the machine
    assert demo.infer()["digest"] == reference


def test_a_bad_keep_staging_setting_in_the_target_refuses_the_sleep_and_leaves_it_running(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16, env={"HIBERNATE_KEEP_STAGING_MB": "lots"})
    reference = demo.infer()["digest"]
    refused = cli("sleep", str(demo.pid), "--to", str(work_dir))
    assert refused.returncode == ExitCode.USAGE, refused.stderr
    assert "HIBERNATE_KEEP_STAGING_MB='lots' is not a size in MiB" in refused.stderr
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
    slept = cli("sleep", str(demo.pid), "--to", str(work_dir), "--keep-staging-mb", "0", "--json")
    assert slept.returncode == 0, slept.stderr  # the command's word goes before the process's
    assert slept.json()["processes"][0]["kept_staging"] == {
        "reused_bytes": 0, "kept_bytes": 0, "given_back_bytes": 0,
    }  # fmt: skip
    assert cli("wake", str(demo.pid), "--keep-staging-mb", "0").returncode == 0
    assert demo.infer()["digest"] == reference


def test_a_target_that_keeps_its_staging_takes_it_again_at_its_next_sleep_and_gives_it_back_when_asked(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16, env={"HIBERNATE_KEEP_STAGING_MB": "64"})  # the process's own setting
    reference = demo.infer()["digest"]
    slept = cli("sleep", str(demo.pid), "--to", str(work_dir / "first"), "--json")
    assert slept.returncode == 0, slept.stderr
    kept = slept.json()["processes"][0]["kept_staging"]
    assert kept["kept_bytes"] > 0 and kept["reused_bytes"] == 0
    assert cli("wake", str(demo.pid)).returncode == 0
    slept = cli("sleep", str(demo.pid), "--to", str(work_dir / "second"), "--json")  # writes it all again
    assert slept.json()["processes"][0]["kept_staging"]["reused_bytes"] == kept["kept_bytes"]
    woken = cli("wake", str(demo.pid), "--keep-staging-mb", "0")  # the command's word goes first
    assert woken.returncode == 0, woken.stderr
    assert "staging   0 B kept for the next sleep or wake" in woken.stdout
    assert "B given back)" in woken.stdout and "(0 B given back)" not in woken.stdout
    assert demo.infer()["digest"] == reference


def test_an_io_depth_out_of_range_is_refused_before_anything_is_touched(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    refused = cli("sleep", str(demo.pid), "--to", str(work_dir), "--io-depth", "0")
    assert refused.returncode == ExitCode.USAGE, refused.stderr
    assert "--io-depth must be between 1 and 64, not 0" in refused.stderr
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
