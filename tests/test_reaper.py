"""The suite's reaper (tests/reaper.py): no process a test starts outlives it unnoticed.

The pytest process running these tests is itself a subreaper, so the first
tests watch it directly; the others run pytest on a small test file of their
own, in a process of its own, and read its verdict.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import reaper
from tests.conftest import REPO, wait_until


def alive(pid: int, start: int) -> bool:
    entry = reaper.read_entry(pid)
    return entry is not None and entry.start == start and entry.alive


def test_a_stat_line_is_read_whatever_the_command_name_holds() -> None:
    raw = "4242 (a) (b) c) S 17 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 3 0 987654 1 2 3\n"
    assert reaper.parse_stat(raw) == reaper.Entry(4242, 17, "S", 987654, 3)


def test_descendants_are_found_through_every_generation_and_a_skipped_subtree_is_left_out() -> None:
    table = {
        pid: reaper.Entry(pid, ppid, "S", pid, 1)
        for pid, ppid in [(1, 0), (10, 1), (11, 10), (12, 11), (13, 10), (20, 1), (21, 20)]
    }
    assert sorted(e.pid for e in reaper.descendants(table, 10)) == [11, 12, 13]
    assert sorted(e.pid for e in reaper.descendants(table, 1, skip={20})) == [10, 11, 12, 13]


def test_an_orphan_in_a_session_of_its_own_is_handed_to_this_process_and_reaped_once_it_exits() -> None:
    shell = subprocess.run(
        ["sh", "-c", "setsid sleep 0.3 </dev/null >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = reaper.read_entry(int(shell.stdout))
    assert orphan is not None and orphan.ppid == os.getpid()  # not init's: this process is its reaper
    # Once it exits it is reaped here, not left a zombie (a subreaper must wait for what it inherits).
    wait_until(lambda: reaper.same(orphan) is None, 30, "the orphan to be reaped")


def test_a_child_started_here_keeps_its_exit_status_for_whoever_waits_for_it() -> None:
    assert reaper.REAPER is not None
    child = subprocess.Popen(["sh", "-c", "exit 3"])
    wait_until(lambda: not reaper.read_entry(child.pid).alive, 30, "the child to exit")  # type: ignore[union-attr]
    reaper.REAPER.reap_orphans(0)  # reaps the zombies this process inherited, at once: not this one
    assert child.wait(timeout=30) == 3


def inner_run(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest with the reaper, on ``source`` as a test file of its own, in a process of its own.

    Its output is the same wherever it runs: pytest writes its short summary whole on a CI machine
    (CI or BUILD_NUMBER set) and cut to the terminal's width elsewhere, so neither reaches it.
    """
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "BUILD_NUMBER")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.reaper", "-p", "no:cacheprovider", "-q", *args],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO), "HIBERNATE_TEST_LINGER_S": "2", "COLUMNS": "80"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def started(tmp_path: Path, name: str) -> tuple[int, int]:
    """The (pid, start time) an inner test wrote to ``name``."""
    pid, start = (tmp_path / name).read_text().split()
    return int(pid), int(start)


# Helpers of the inner tests: a process's (pid, start time) to a file, read back by the test above.
INNER_HELPERS = """
    import pathlib, subprocess
    from tests import reaper

    def note(name, pid):
        entry = reaper.read_entry(pid)
        pathlib.Path(name).write_text(f"{entry.pid} {entry.start}")

    def setsid_sleeper(name, seconds=600):
        # Started by a shell that exits at once: an orphan, in a session of its own.
        shell = f"setsid sleep {seconds} </dev/null >/dev/null 2>&1 & echo $!"
        note(name, int(subprocess.run(["sh", "-c", shell], capture_output=True, check=True).stdout))
"""


@pytest.mark.slow
def test_a_forgotten_process_fails_the_run_naming_it_and_its_test_and_is_ended(tmp_path: Path) -> None:
    result = inner_run(
        tmp_path,
        INNER_HELPERS
        + """
    import pytest

    @pytest.fixture(scope="module")
    def server():
        proc = subprocess.Popen(["sleep", "600"])
        note("server", proc.pid)
        yield proc
        proc.kill()
        proc.wait()

    def test_a_module_fixture_s_process_outlives_one_test(server):
        assert server.poll() is None

    def test_and_serves_the_next(server):
        assert server.poll() is None

    def test_ends_what_it_starts():
        proc = subprocess.Popen(["sleep", "600"])
        note("ended", proc.pid)
        proc.kill()
        proc.wait()

    def test_leaves_one_that_ends_on_its_own_soon():
        setsid_sleeper("soon", 0.5)

    def test_starts_one_kept_for_the_session():
        proc = subprocess.Popen(["sleep", "600"])
        note("kept", proc.pid)
        reaper.keep(proc.pid, "a kept sleeper", lambda: (proc.kill(), proc.wait()))

    def test_forgets_one():
        setsid_sleeper("forgotten")

    @pytest.fixture(scope="class")
    def leaky():
        proc = subprocess.Popen(["sleep", "600"])
        note("leaky", proc.pid)
        yield proc  # and never ends it

    class TestShared:
        def test_one(self, leaky):
            assert leaky.poll() is None

        def test_two(self, leaky):
            assert leaky.poll() is None
    """,
        "-n",
        "0",
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    pid, _ = started(tmp_path, "forgotten")
    assert "8 passed, 2 errors in" in output, output
    assert "ERROR at teardown of test_forgets_one" in output, output
    named = f"pid {pid} `sleep 600`, started during test_inner.py::test_forgets_one (call): left running by"
    assert output.count(f"{named} test test_inner.py::test_forgets_one; ended by SIGTERM") == 2, output
    # A class's fixture may keep its process through its tests, not past its own teardown.
    assert "ERROR at teardown of TestShared.test_two" in output, output
    leaky, _ = started(tmp_path, "leaky")
    named = f"pid {leaky} `sleep 600`, started during test_inner.py::TestShared::test_one (setup)"
    assert output.count(f"{named}: left running by fixture 'leaky' (class scope); ended by SIGTERM") == 2
    assert "processes left running" in output, output  # the summary, where the run names them all
    for other in ("server", "ended", "soon", "kept"):
        assert f"pid {started(tmp_path, other)[0]} " not in output, output
    for name in ("forgotten", "leaky", "server", "ended", "soon", "kept"):
        assert not alive(*started(tmp_path, name)), name


TIMES_OUT = """
    def test_times_out_with_a_child_running():
        # As scripts/gpu-check does: the child it runs starts a process in a session of its own.
        shell = "setsid sleep 600 </dev/null >/dev/null 2>&1 & cat /proc/$!/stat > child; wait"
        subprocess.run(["sh", "-c", shell])
"""


def timed_out_child(tmp_path: Path) -> reaper.Entry:
    return reaper.parse_stat((tmp_path / "child").read_text())


@pytest.mark.slow
def test_a_test_that_times_out_still_has_its_child_ended(tmp_path: Path) -> None:
    result = inner_run(tmp_path, INNER_HELPERS + TIMES_OUT, "-n", "0", "--timeout", "5")
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "Failed: Timeout (>5.0s) from pytest-timeout" in output, output
    child = timed_out_child(tmp_path)
    named = f"pid {child.pid} `sleep 600`, started during test_inner.py::test_times_out_with_a_child_running"
    assert f"{named} (call): left running by test test_inner.py::" in output, output
    assert reaper.ended(child)


@pytest.mark.slow
def test_a_worker_ended_by_the_thread_timeout_has_its_children_ended_by_the_controller(
    tmp_path: Path,
) -> None:
    result = inner_run(
        tmp_path, INNER_HELPERS + TIMES_OUT, "-n", "1", "--timeout", "5", "--timeout-method", "thread"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "crashed while running 'test_inner.py::test_times_out_with_a_child_running'" in output, output
    child = timed_out_child(tmp_path)
    named = f"pid {child.pid} `sleep 600`, started during test_inner.py::test_times_out_with_a_child_running"
    assert f"{named} (call): left running by xdist worker gw0, which went down" in output, output
    assert reaper.ended(child)
