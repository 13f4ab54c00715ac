"""Break hibernate on purpose at every phase boundary and check nothing is ever lost.

For each enumerated point of sleep and of wake, the real CLI is SIGKILLed
there (HIBERNATE_FAULT=<point>:kill) while acting on a real demo target that
the stand-in driver sees as a CUDA process, so the CUDA points are reached too.
Then `hibernate status` must show the interrupted operation with the command
that resolves it, `hibernate recover` (and, when that leaves it asleep,
`hibernate wake`) must end with the target running and bit-exact, every
published snapshot must be whole, and nothing may be left that a user would
have to clean by hand.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate import faults
from hibernate.agent.controller import AGENT_POINTS
from hibernate.errors import ExitCode
from hibernate.flows.agents import AgentsUnit
from hibernate.flows.vllm import VllmServerUnit
from hibernate.operation.engine import sleep_points, wake_points
from hibernate.store.layout import SpillRoot
from hibernate.store.reader import SnapshotReader
from tests.conftest import process_state, wait_until
from tests.standins.world import GIB, World

SLEEP_POINTS = sleep_points(AgentsUnit)
WAKE_POINTS = wake_points(AgentsUnit)


def test_every_step_boundary_is_a_fault_point_and_the_readme_counts_them() -> None:
    """The points come from the declared steps; the README's figures are regenerated from them."""
    assert SLEEP_POINTS == [
        "sleep.after-lock",
        "sleep.after-connect",
        "sleep.after-leases",
        "sleep.after-quiesce",
        "sleep.during-spill",
        "sleep.after-spill",
        "sleep.after-release",
        "sleep.after-cuda-lock",
        "sleep.after-cuda",
    ]
    assert WAKE_POINTS == [
        "wake.after-lock",
        "wake.after-connect",
        "wake.after-cuda-restore",
        "wake.after-cuda",
        "wake.during-restore",
        "wake.after-restore",
        "wake.after-resume",
    ]
    vllm = len(sleep_points(VllmServerUnit)) + len(wake_points(VllmServerUnit))
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert (
        f"{len(SLEEP_POINTS) + len(WAKE_POINTS)} step boundaries ({len(SLEEP_POINTS)} of sleep, "
        f"{len(WAKE_POINTS)} of wake), {vllm} of a vLLM server's sleep and wake, "
        f"plus {len(AGENT_POINTS)} inside the agent (one per transition), "
        f"{len(faults.STORE_POINTS)} in the store and {len(faults.POOL_POINTS)} in an address-preserving pool"
    ) in readme


def test_a_sleep_and_a_wake_pass_every_point_in_order(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, tmp_path: Path
) -> None:
    demo = start_demo(size_mb=8)
    world.register(demo.pid, nbytes=GIB)
    trace = tmp_path / "trace"
    env = {faults.TRACE_ENV: str(trace)}
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q", env=env).returncode == 0
    assert cli("wake", str(demo.pid), "-q", env=env).returncode == 0
    assert trace.read_text().split() == [*SLEEP_POINTS, *WAKE_POINTS]


def published_snapshots_are_whole(directory: Path) -> None:
    for manifest in directory.rglob("manifest.json"):
        root = SpillRoot(manifest.parent.parent, inspect=True)
        with root, SnapshotReader(root, manifest.parent.name) as reader:
            assert reader.manifest.records, manifest
    leftovers = [p for p in directory.rglob(".tmp-*")]
    assert not leftovers, f"unfinished snapshot directories left behind: {leftovers}"


def nothing_left_to_clean(runtime_dir: Path) -> None:
    journal = runtime_dir / "journal"
    assert not (journal.exists() and any(journal.iterdir())), list(journal.iterdir())


def interrupted(cli: Callable[..., Any], pid: int) -> dict[str, Any] | None:
    result = cli("status", str(pid), "--json")
    assert result.returncode == 0, result.stderr
    value: dict[str, Any] | None = result.json()["agents"][0]["interrupted"]
    return value


def kill_at(cli: Callable[..., Any], point: str, *args: str) -> None:
    result = cli(*args, env={faults.ENV: f"{point}:kill"})
    assert result.returncode == -signal.SIGKILL, f"{point}: {result.returncode} {result.stderr}"


def resolve_and_check(
    cli: Callable[..., Any],
    pid: int,
    point: str,
    reference: str,
    demo: Any,
    world: World,
    dirs: tuple[Path, Path],
) -> None:
    work_dir, runtime_dir = dirs
    info = interrupted(cli, pid)
    if point != "sleep.after-lock" or info is not None:
        assert info is not None, f"{point}: status shows no interrupted operation"
        assert info["resolve"] == f"hibernate recover {pid}", info
    recovered = cli("recover", str(pid), "--json")
    assert recovered.returncode == 0, f"{point}: {recovered.stderr}"
    state = cli("status", str(pid), "--json").json()["agents"][0]["state"]
    if state == "asleep":  # recover finished the sleep: now wake it for real
        assert world.state(pid) == "checkpointed", point
        woken = cli("wake", str(pid), "-q")
        assert woken.returncode == 0, f"{point}: {woken.stderr}"
    assert cli("status", str(pid), "--json").json()["agents"][0]["state"] == "running", point
    assert world.state(pid) == "running", point
    assert demo.infer()["digest"] == reference, f"{point}: output differs after recovery"
    published_snapshots_are_whole(work_dir)
    nothing_left_to_clean(runtime_dir)
    assert interrupted(cli, pid) is None, point


@pytest.mark.slow
def test_the_cli_killed_at_every_point_of_sleep_and_wake(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, nbytes=2 * GIB)
    reference = demo.infer()["digest"]
    pid = str(demo.pid)
    for point in SLEEP_POINTS:
        kill_at(cli, point, "sleep", pid, "--to", str(work_dir), "-q")
        resolve_and_check(cli, demo.pid, point, reference, demo, world, (work_dir, runtime_dir))
    for point in WAKE_POINTS:
        assert cli("sleep", pid, "--to", str(work_dir), "-q").returncode == 0
        kill_at(cli, point, "wake", pid, "-q")
        resolve_and_check(cli, demo.pid, point, reference, demo, world, (work_dir, runtime_dir))


@pytest.mark.slow
def test_a_command_refused_on_a_target_left_half_way_keeps_what_recover_needs(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    """A plain sleep of a target an interrupted sleep left asleep is refused; the interrupted sleep's
    journal entry, which its refusal replaced while it ran, is put back whole for `recover`."""
    demo = start_demo(size_mb=8)
    world.register(demo.pid, nbytes=GIB)
    reference = demo.infer()["digest"]
    pid = str(demo.pid)
    kill_at(cli, "sleep.after-release", "sleep", pid, "--to", str(work_dir), "-q")
    left = interrupted(cli, demo.pid)
    assert left is not None and left["phases"][-1] == "release", left
    refused = cli("sleep", pid, "--to", str(work_dir))
    assert refused.returncode == ExitCode.WRONG_STATE, refused.stderr
    assert interrupted(cli, demo.pid) == left
    failed = cli("wake", pid, env={faults.ENV: "wake.after-connect"})  # a wake that fails, undone
    assert failed.returncode == ExitCode.FAILURE, failed.stderr
    assert interrupted(cli, demo.pid) == left
    resolve_and_check(cli, demo.pid, "sleep.after-release", reference, demo, world, (work_dir, runtime_dir))


@pytest.mark.slow
def test_a_failure_at_every_point_is_undone_cleanly(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, nbytes=GIB)
    reference = demo.infer()["digest"]
    pid = str(demo.pid)
    for point in SLEEP_POINTS:
        result = cli("sleep", pid, "--to", str(work_dir), "-q", env={faults.ENV: point})
        assert result.returncode == ExitCode.FAILURE, f"{point}: {result.stderr}"
        assert f"fault injected at {point}" in result.stderr
        assert cli("status", pid, "--json").json()["agents"][0]["state"] == "running", point
        assert world.state(demo.pid) == "running", point
        assert demo.infer()["digest"] == reference, point
        nothing_left_to_clean(runtime_dir)
    published_snapshots_are_whole(work_dir)


@pytest.mark.slow
def test_the_agent_killed_during_a_wake(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, runtime_dir: Path
) -> None:
    demo = start_demo(size_mb=16, env={faults.ENV: "agent.restore:kill"})
    world.register(demo.pid, nbytes=GIB)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    result = cli("wake", str(demo.pid))
    assert result.returncode == ExitCode.NO_SUCH_PROCESS, result.stderr
    assert f"process {demo.pid} died during its wake (killed by SIGKILL" in result.stderr
    demo.proc.wait(timeout=10)
    assert cli("ls", "--json").json()["agents"] == []
    nothing_left_to_clean(runtime_dir)
    assert not list((runtime_dir / "locks").glob("*.lock")), "the dead process's lock file was swept"
    published_snapshots_are_whole(work_dir)


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="choosing the next pid (ns_last_pid) needs root")
def test_a_reused_pid_is_never_mistaken_for_the_hibernated_process(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, runtime_dir: Path
) -> None:
    first = start_demo(size_mb=8, fork=False)  # this test is about creating processes: no fork server
    assert cli("sleep", str(first.pid), "--to", str(work_dir), "-q").returncode == 0
    old_pid = first.pid
    first.stop()
    # The next process created gets the same pid.
    with open("/proc/sys/kernel/ns_last_pid", "w") as last:
        last.write(str(old_pid - 1))
    second = start_demo(size_mb=8, fork=False)
    if second.pid != old_pid:
        pytest.skip("another process took the pid first")
    reference = second.infer()["digest"]
    status = cli("status", str(old_pid), "--json").json()["agents"]
    assert [(a["pid"], a["state"]) for a in status] == [(old_pid, "running")]
    assert status[0]["start_time"] != 0 and status[0]["snapshot"] is None
    woken = cli("wake", str(old_pid))
    assert woken.returncode == ExitCode.WRONG_STATE, woken.stderr
    assert second.infer()["digest"] == reference
    # the old process's socket was recognised as stale and removed
    assert len(list(runtime_dir.glob(f"agent-{old_pid}-*.sock"))) == 1


@pytest.mark.slow
def test_fault_switch_actions() -> None:
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); from hibernate import faults; faults.point('x.y');"
        "print('passed')"
    )
    from tests.conftest import REPO

    def run(spec: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", probe, str(REPO)],
            capture_output=True,
            text=True,
            env={**os.environ, faults.ENV: spec},
            timeout=30,
        )

    assert run("other.point:kill").stdout.strip() == "passed"
    assert run("x.y:kill").returncode == -signal.SIGKILL
    failed = run("x.y")
    assert failed.returncode == 1 and "fault injected at x.y" in failed.stderr
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run(
            [sys.executable, "-c", probe, str(REPO)],
            env={**os.environ, faults.ENV: "x.y:hang"},
            timeout=2,
            capture_output=True,
        )


@pytest.mark.slow
def test_an_agent_that_stops_answering_times_out_and_rolls_back_by_itself(
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import threading

    trace = tmp_path / "points"
    trace.touch()
    monkeypatch.setenv(faults.TRACE_ENV, str(trace))  # the demo's agent appends the points it reaches
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    # The sleep waits in quiesce... (for the demo's step, released once the sleep has given up)
    demo.hold(60)
    outcome: list[Any] = []
    sleeper = threading.Thread(
        target=lambda: outcome.append(cli("sleep", str(demo.pid), "--to", str(work_dir), "--timeout", "1"))
    )
    sleeper.start()
    wait_until(lambda: "agent.quiesce" in trace.read_text().split(), 60, "the agent to start quiescing")
    os.kill(demo.pid, signal.SIGSTOP)  # ...and the process stops answering altogether
    try:
        wait_until(lambda: process_state(demo.pid) == "T", 30, "the SIGSTOP to stop the demo")
        sleeper.join(timeout=60)
        result = outcome[0]
        assert result.returncode == ExitCode.TIMEOUT, result.stderr
        assert "did not answer 'quiesce' within" in result.stderr
        assert "goes back to running by itself" in result.stderr
    finally:
        os.kill(demo.pid, signal.SIGCONT)
    demo.release()  # its quiesce ends: the agent finds the sleep gone and rolls back by itself
    wait_until(
        lambda: not cli("status", str(demo.pid), "--json").json()["agents"][0]["busy"],
        30,
        "the agent to roll back and end the sleep's session by itself",
        interval=0.2,
    )
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
    assert cli("recover", str(demo.pid), "-q").returncode == 0
    assert demo.infer()["digest"] == reference


@pytest.mark.slow
def test_status_tells_a_person_how_to_resolve_an_interrupted_sleep(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=8)
    kill_at(cli, "sleep.after-release", "sleep", str(demo.pid), "--to", str(work_dir), "-q")
    human = cli("status", str(demo.pid)).stdout
    assert (
        f"pid {demo.pid}: a `hibernate sleep` was interrupted after: lock, connect, leases, quiesce, spill, "
        in human
    )
    assert f"run `hibernate recover {demo.pid}` to finish or undo it" in human
    recovered = cli("recover", str(demo.pid))
    assert recovered.returncode == 0 and "finished the interrupted sleep" in recovered.stdout
    assert cli("wake", str(demo.pid), "-q").returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("point", faults.STORE_POINTS)
def test_the_store_failing_before_publishing_leaves_the_process_running(
    point: str, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=8, env={faults.ENV: point})
    reference = demo.infer()["digest"]
    result = cli("sleep", str(demo.pid), "--to", str(work_dir))
    assert result.returncode == ExitCode.FAILURE, result.stderr
    assert f"fault injected at {point}" in result.stderr
    assert demo.infer()["digest"] == reference
    assert not list(work_dir.rglob("manifest.json")), "nothing was published"
    published_snapshots_are_whole(work_dir)  # and the unfinished one was removed


@pytest.mark.slow
@pytest.mark.parametrize("point", faults.STORE_POINTS)
def test_the_target_killed_while_writing_leaves_only_what_gc_removes(
    point: str, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=8, env={faults.ENV: f"{point}:kill"})
    result = cli("sleep", str(demo.pid), "--to", str(work_dir))
    assert result.returncode == ExitCode.NO_SUCH_PROCESS, result.stderr
    assert not list(work_dir.rglob("manifest.json")) or point == "store.publish"
    collected = cli("gc", str(work_dir), "--json")
    assert collected.returncode == 0, collected.stderr
    assert not list(work_dir.iterdir()), "gc removed the dead process's directory whole"
