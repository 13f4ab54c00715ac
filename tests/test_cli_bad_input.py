"""Each bad input gets a clear message, its own exit code, and leaves the target as it was."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate import faults
from hibernate.errors import ExitCode
from tests.conftest import NOBODY, is_root, run_cli, wait_until


def reached_points(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Callable[[], list[str]]:
    """Trace the fault points that targets started from now on, and the CLI, reach.

    Returns a function giving the points reached so far: tests wait on it to know
    where a concurrent sleep is, instead of sleeping and hoping it got there.
    """
    trace = tmp_path / "points"
    trace.touch()
    monkeypatch.setenv(faults.TRACE_ENV, str(trace))
    return lambda: trace.read_text().split()


def assert_untouched(demo: Any, cli: Callable[..., Any], reference: str) -> None:
    """The target still runs, awake, and computes exactly what it did before."""
    assert demo.alive()
    status = cli("status", str(demo.pid), "--json").json()["agents"][0]
    assert status["state"] == "running"
    assert demo.infer()["digest"] == reference


def test_nonexistent_pid(cli: Callable[..., Any], runtime_dir: Path) -> None:
    result = cli("sleep", "4194303", "--to", "/tmp/never-used")
    assert result.returncode == ExitCode.NO_SUCH_PROCESS
    assert "no process with pid 4194303" in result.stderr


def test_pid_without_agent_says_what_to_do(
    cli: Callable[..., Any], runtime_dir: Path, work_dir: Path
) -> None:
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        result = cli("sleep", str(plain.pid), "--to", str(work_dir))
        assert result.returncode == ExitCode.NOTHING_TO_HIBERNATE
        assert f"no hibernate agent in process {plain.pid}" in result.stderr
        assert "hibernate.track" in result.stderr
        assert plain.poll() is None
        assert not any(work_dir.iterdir())
    finally:
        plain.kill()


@pytest.mark.slow
def test_another_users_process_is_refused(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    if is_root():
        demo = start_demo(size_mb=16)
        reference = demo.infer()["digest"]
        result = cli("sleep", str(demo.pid), "--to", "/tmp/hb-nobody-never", uid=NOBODY)
        assert result.returncode == ExitCode.PERMISSION_DENIED, result.stderr
        assert f"process {demo.pid} belongs to root" in result.stderr
        assert_untouched(demo, cli, reference)
    else:
        result = cli("sleep", "1", "--to", str(work_dir))
        assert result.returncode == ExitCode.PERMISSION_DENIED
        assert "process 1 belongs to" in result.stderr


@pytest.mark.slow
def test_sleep_of_a_sleeping_process(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    again = cli("sleep", str(demo.pid), "--to", str(work_dir))
    assert again.returncode == ExitCode.WRONG_STATE
    assert f"process {demo.pid} is already asleep" in again.stderr
    assert f"hibernate wake {demo.pid}" in again.stderr
    assert cli("wake", str(demo.pid), "-q").returncode == 0


def test_wake_of_an_awake_process(start_demo: Callable[..., Any], cli: Callable[..., Any]) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    result = cli("wake", str(demo.pid))
    assert result.returncode == ExitCode.WRONG_STATE
    assert f"process {demo.pid} is not asleep, it is running" in result.stderr
    assert_untouched(demo, cli, reference)


def test_to_is_a_file(start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    a_file = work_dir / "a-file"
    a_file.write_text("not a directory")
    result = cli("sleep", str(demo.pid), "--to", str(a_file), "--json")
    assert result.returncode == ExitCode.USAGE
    error = result.json()["error"]
    assert error["code"] == "usage" and "is a file, not a directory" in error["message"]
    assert_untouched(demo, cli, reference)


@pytest.mark.slow
def test_to_not_writable(start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path) -> None:
    # As root every directory is writable, so both the target and the CLI run as nobody.
    uid = NOBODY if is_root() else None
    demo = start_demo(size_mb=16, uid=uid)
    reference = demo.infer()["digest"]
    locked = work_dir / "locked"
    locked.mkdir(mode=0o755)
    if not is_root():
        locked.chmod(0o555)
    os.chmod(work_dir, 0o755)
    result = cli("sleep", str(demo.pid), "--to", str(locked), uid=uid)
    assert result.returncode == ExitCode.IO_ERROR, result.stderr
    assert "is not writable by you" in result.stderr
    assert_untouched(demo, lambda *a, **k: cli(*a, uid=uid, **k), reference)


@pytest.mark.skipif(not is_root(), reason="mounting a small filesystem needs root")
def test_to_on_a_full_filesystem(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=32)
    reference = demo.infer()["digest"]
    small = work_dir / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(small)], check=True)
    try:
        result = cli("sleep", str(demo.pid), "--to", str(small))
        assert result.returncode == ExitCode.IO_ERROR, result.stderr
        assert "not enough space" in result.stderr and "are free" in result.stderr
        assert_untouched(demo, cli, reference)
        assert not list(small.rglob("manifest.json"))
    finally:
        subprocess.run(["umount", str(small)], check=True)


@pytest.mark.slow
def test_two_sleeps_at_once_one_wins_the_other_is_busy(
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = reached_points(monkeypatch, tmp_path)
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    # The first sleep waits in quiesce for this step to finish: it is released once the second
    # sleep has been refused.
    demo.hold(60)
    first: list = []
    winner = threading.Thread(target=lambda: first.append(cli("sleep", str(demo.pid), "--to", str(work_dir))))
    winner.start()
    wait_until(lambda: "agent.quiesce" in trace(), 60, "the first sleep to reach quiesce in the target")
    second = cli("sleep", str(demo.pid), "--to", str(work_dir))
    demo.release()
    winner.join(timeout=60)
    assert second.returncode == ExitCode.BUSY, second.stderr
    assert f"process {demo.pid} is busy: hibernate sleep (pid" in second.stderr
    assert first[0].returncode == 0, first[0].stderr
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    assert demo.infer()["digest"] == reference


def test_guard_held_past_timeout_leaves_target_untouched(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    demo.hold(60)
    result = cli("sleep", str(demo.pid), "--to", str(work_dir), "--timeout", "0.5")
    demo.release()
    assert result.returncode == ExitCode.TIMEOUT, result.stderr
    assert "held hibernate.guard() for more than 0.5s" in result.stderr
    assert not list(work_dir.rglob("manifest.json"))
    assert_untouched(demo, cli, reference)


def test_target_dying_in_the_middle_of_a_sleep(
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = reached_points(monkeypatch, tmp_path)
    demo = start_demo(size_mb=16)
    demo.hold(60)  # killed long before it ends: the sleep is still in quiesce then
    outcome: list = []
    sleeper = threading.Thread(
        target=lambda: outcome.append(cli("sleep", str(demo.pid), "--to", str(work_dir)))
    )
    sleeper.start()
    wait_until(lambda: "agent.quiesce" in trace(), 60, "the sleep to reach quiesce in the target")
    demo.proc.kill()
    demo.proc.wait()
    sleeper.join(timeout=60)
    assert outcome[0].returncode == ExitCode.NO_SUCH_PROCESS, outcome[0].stderr
    assert f"process {demo.pid} exited during quiesce" in outcome[0].stderr
    # Its socket is recognised as stale and removed, never trusted.
    assert cli("ls", "--json").json()["agents"] == []
    assert not list(runtime_dir.glob("agent-*.sock"))


def test_bad_options_are_usage_errors(cli: Callable[..., Any], runtime_dir: Path) -> None:
    assert run_cli("sleep").returncode == ExitCode.USAGE
    assert run_cli("sleep", "not-a-pid", "--to", "/tmp/x").returncode == ExitCode.USAGE
    result = run_cli("sleep", "1", "--to", "/tmp/x", "--io-mode", "sideways")
    assert result.returncode == ExitCode.USAGE
    assert "--io-mode must be auto, direct or buffered" in result.stderr
    unnamed = run_cli("recover")
    assert unnamed.returncode == ExitCode.USAGE and "no targets named" in unnamed.stderr


@pytest.mark.slow
def test_numbers_out_of_range_are_usage_errors_that_say_the_range(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    """inf, 1e10, NaN, negatives, a TiB of staging: refused at once (exit 2), never a traceback."""
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    target = [str(demo.pid), "--to", str(work_dir)]
    barrier = work_dir / "barrier"
    cases = [
        (["sleep", *target, "--timeout", "inf"], "--timeout must be between 0 and 86400 seconds"),
        (["sleep", *target, "--timeout", "1e10"], "--timeout must be between 0 and 86400 seconds"),
        (["sleep", *target, "--timeout", "nan"], "--timeout must be between 0 and 86400 seconds"),
        (["wake", str(demo.pid), "--timeout", "inf"], "--timeout must be between 0 and 86400 seconds"),
        (["sleep", *target, "--buffer-mb", "1099511627776"], "--buffer-mb must be between 16 and"),
        (["sleep", *target, "--buffer-mb", "8"], "--buffer-mb must be between 16 and"),
        (
            ["node-step", "sleep", *target, "--barrier", str(barrier), "--nodes", "1", "--node-index", "0",
             "--barrier-timeout", "inf"],
            "--barrier-timeout must be between 0 and 86400 seconds",
        ),
        (
            ["node-step", "sleep", *target, "--barrier", str(barrier), "--nodes", "0", "--node-index", "0"],
            "--nodes must be between 1 and 65536",
        ),
    ]  # fmt: skip
    for args, words in cases:
        result = cli(*args)
        assert result.returncode == ExitCode.USAGE, (args, result.stderr)
        assert words in result.stderr and "Traceback" not in result.stderr, (args, result.stderr)
    big = cli("sleep", *target, "--buffer-mb", "1099511627776", "--json")
    assert big.returncode == ExitCode.USAGE
    error = big.json()["error"]
    assert error["code"] == "usage" and "half of this machine's" in error["message"]
    assert not list(work_dir.rglob("manifest.json")) and not barrier.exists()
    assert_untouched(demo, cli, reference)


def test_run_refuses_a_bad_timeout_before_starting_the_job(cli: Callable[..., Any], work_dir: Path) -> None:
    started = work_dir / "started"
    job = [sys.executable, "-c", f"open({str(started)!r}, 'w').close()"]
    result = cli("run", "--timeout", "inf", "--to", str(work_dir), "--", *job)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "--timeout must be between 0 and 86400 seconds" in result.stderr
    assert not started.exists()


def test_an_empty_to_is_refused_not_taken_for_the_current_directory(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    result = cli("sleep", str(demo.pid), "--to", "", cwd=work_dir)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "an empty string names no directory" in result.stderr and "--to ." in result.stderr
    assert not any(work_dir.iterdir())
    assert_untouched(demo, cli, reference)


@pytest.mark.slow
def test_sleep_all_skips_targets_already_asleep_and_says_so(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    """As ``wake --all`` skips those awake; pids named one by one are still refused (above)."""
    first, second = start_demo(size_mb=16), start_demo(size_mb=16)
    reference = second.infer()["digest"]
    assert cli("sleep", str(first.pid), "--to", str(work_dir), "-q").returncode == 0
    snapshot = cli("status", str(first.pid), "--json").json()["agents"][0]["snapshot"]["path"]

    result = cli("sleep", "--all", "--to", str(work_dir))
    assert result.returncode == 0, result.stderr
    assert f"asleep: pid {second.pid}" in result.stdout
    skipped = f"skipped: pid {first.pid} (proc-{first.pid}) is already asleep (snapshot {snapshot})"
    assert skipped in result.stdout
    states = {a["pid"]: a for a in cli("status", "--all", "--json").json()["agents"]}
    assert {pid: a["state"] for pid, a in states.items()} == {first.pid: "asleep", second.pid: "asleep"}
    assert states[first.pid]["snapshot"]["path"] == snapshot  # left alone: not slept again

    again = cli("sleep", "--all", "--to", str(work_dir), "--json")
    assert again.returncode == ExitCode.WRONG_STATE, again.stderr
    message = again.json()["error"]["message"]
    assert message.startswith("nothing to put to sleep: ")
    assert f"process {first.pid} is already asleep" in message and f"process {second.pid}" in message

    assert cli("wake", "--all", "-q").returncode == 0
    assert second.infer()["digest"] == reference


def test_a_name_longer_than_the_filesystem_allows_is_refused_in_one_line_by_every_command(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    """A --to (or gc's DIR) no directory could have: exit 2 and one line (a JSON document under --json),
    from sleep, gc, doctor and run alike, before anything is touched; not ENAMETOOLONG's traceback."""
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    long = work_dir / ("n" * 300) / "snap"
    started = work_dir / "started"
    job = [sys.executable, "-c", f"open({str(started)!r}, 'w').close()"]
    named = f"has a name of 300 bytes ('{'n' * 24}...'), more than the 255 a name may have on the filesystem"
    cases = [
        (["sleep", str(demo.pid), "--to", str(long)], "--to"),
        (["gc", str(long)], "DIR"),
        (["doctor", str(demo.pid), "--to", str(long)], "--to"),
    ]
    for args, label in cases:
        plain = cli(*args)
        assert plain.returncode == ExitCode.USAGE, plain.stderr
        line = f"hibernate: error: {label} {named} of {work_dir}; nothing was changed"
        assert plain.stderr.splitlines() == [line], plain.stderr
        as_json = cli(*args, "--json")
        assert as_json.returncode == ExitCode.USAGE, as_json.stderr
        error = as_json.json()["error"]
        assert error["code"] == "usage" and error["message"].startswith(f"{label} {named}"), error
    ran = cli("run", "--to", str(long), "--", *job)
    assert ran.returncode == ExitCode.USAGE and ran.stderr.startswith(f"hibernate: error: --to {named}")
    assert not started.exists()
    too_deep = Path("/", *(["d" * 200] * 25))  # each name allowed, the whole past PATH_MAX
    deep = cli("gc", str(too_deep), "--json")
    assert deep.returncode == ExitCode.USAGE, deep.stderr
    assert deep.json()["error"]["message"].startswith("DIR is 5025 bytes long, more than the 4095 a path may")
    assert not any(work_dir.iterdir())
    assert_untouched(demo, cli, reference)


def test_a_runtime_directory_with_a_name_too_long_is_refused_in_one_line(
    cli: Callable[..., Any], tmp_path: Path
) -> None:
    """ls, status, recover: the runtime directory the environment names is checked as a --to is."""
    env = {"HIBERNATE_RUNTIME_DIR": str(tmp_path / ("r" * 300))}
    words = "the runtime directory (HIBERNATE_RUNTIME_DIR) has a name of 300 bytes"
    for args in (["ls"], ["status"], ["recover", "1"]):
        result = cli(*args, env=env)
        assert result.returncode == ExitCode.USAGE, result.stderr
        assert result.stderr.splitlines()[0].startswith(f"hibernate: error: {words}"), result.stderr
        assert result.stderr.splitlines()[1:] == ["  hint: set HIBERNATE_RUNTIME_DIR to a shorter directory"]
    as_json = cli("status", "--json", env=env)
    assert as_json.returncode == ExitCode.USAGE and as_json.json()["error"]["message"].startswith(words)
