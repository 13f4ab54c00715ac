"""A checkpoint or restore is never cut: not by its timeout, not by a SIGKILL of the command.

A checkpoint or restore stopped half-way can leave the process in the driver's
failed state (lost). The stand-in driver shows it: a call the test holds in
progress (``World.hold``) whose caller dies before it ends leaves the process
``failed`` for good. Each call runs in a process of its own session and is
journaled before it is waited for; the command stops waiting at the timeout and
says so, and ``hibernate recover`` waits for the call, reads the real state and
completes the operation from it (a sleep whose checkpoint succeeded stays
asleep). Every event is ordered by a state: the stand-in's, the journal's, a
line the command prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hibernate import orchestrator, procinfo
from hibernate.checkpoint.base import (
    Checkpointer,
    CheckpointStepError,
    DetachedCall,
    StepTimeouts,
    StillRunningError,
)
from hibernate.checkpoint.binary import BinaryCheckpointer
from hibernate.checkpoint.detect import survey
from hibernate.checkpoint.driver import DriverCheckpointer
from hibernate.checkpoint.group import GroupCheckpoint
from hibernate.errors import ExitCode
from tests.conftest import REPO, wait_until
from tests.standins.world import World


def make(kind: str, timeouts: StepTimeouts) -> Checkpointer:
    return (
        DriverCheckpointer(timeouts=timeouts) if kind == "driver" else BinaryCheckpointer(timeouts=timeouts)
    )


@pytest.fixture
def sleeper(world: World) -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "600"])
    world.register(proc.pid)
    yield proc.pid
    proc.kill()
    proc.wait()


def test_a_checkpoint_past_its_timeout_runs_on_in_a_process_of_its_own_and_ends(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    checkpointer = make(checkpointer_kind, StepTimeouts(checkpoint=0.2))
    journaled: list[DetachedCall] = []
    checkpointer.on_detach = journaled.append
    checkpointer.lock(sleeper, 1000)
    world.hold("checkpoint", sleeper)
    with pytest.raises(CheckpointStepError) as late:
        checkpointer.checkpoint(sleeper)
    running = late.value.running
    assert late.value.timed_out and running is not None and journaled == [running]
    assert "is still running in process" in late.value.message and "it was not cut" in late.value.message
    assert procinfo.is_alive(running.helper) and running.helper.pid != os.getpid()
    assert world.state(sleeper) == "checkpointing"
    progress = world.in_progress(sleeper)
    assert progress is not None and progress[1] == running.helper.pid  # the helper makes the call
    world.release("checkpoint", sleeper)
    wait_until(lambda: world.state(sleeper) == "checkpointed", 30, "the checkpoint to end")
    checkpointer.restore(sleeper)  # waits for nothing: the call has returned
    assert world.state(sleeper) == "locked"


def test_a_checkpoint_starts_only_once_journaled_and_not_at_all_if_that_fails(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    checkpointer = make(checkpointer_kind, StepTimeouts())
    checkpointer.lock(sleeper, 1000)
    seen: list[str] = []

    def journal(call: DetachedCall) -> None:
        seen.append(world.state(sleeper))  # the call has not begun while it is being journaled
        raise OSError(28, "No space left on device")

    checkpointer.on_detach = journal
    world.hold("checkpoint", sleeper)  # a checkpoint that began would show as checkpointing
    with pytest.raises(OSError):
        checkpointer.checkpoint(sleeper)
    assert seen == ["locked"] and world.state(sleeper) == "locked"
    assert [s for _, s, _, _ in world.calls()] == ["lock"]  # no checkpoint call was made


def test_a_call_that_returns_within_its_timeout_leaves_nothing_behind(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    checkpointer = make(checkpointer_kind, StepTimeouts())
    journaled: list[DetachedCall] = []
    checkpointer.on_detach = journaled.append
    checkpointer.lock(sleeper, 1000)
    checkpointer.checkpoint(sleeper)
    checkpointer.restore(sleeper)
    assert [call.step for call in journaled] == ["checkpoint", "restore"]
    assert not any(procinfo.is_alive(call.helper) for call in journaled)
    assert checkpointer.waits() == []
    assert world.state(sleeper) == "locked"


def test_a_group_stops_at_a_checkpoint_still_running_and_calls_nothing_over_it(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    other = subprocess.Popen(["sleep", "600"])
    try:
        world.register(other.pid)
        timeouts = StepTimeouts(checkpoint=0.3, query=0.3)
        checkpointer = make(checkpointer_kind, timeouts)
        holders = survey([sleeper, other.pid], checkpointer).holders
        world.hold("checkpoint", sleeper)
        world.clear_calls()
        with pytest.raises(StillRunningError) as late:
            GroupCheckpoint(checkpointer, timeouts).sleep(holders)
        assert late.value.exit_code == ExitCode.TIMEOUT and late.value.keeps_journal
        assert f"process {sleeper} (checkpoint)" in late.value.message
        assert f"process {other.pid} finished that step" in late.value.message
        assert f"hibernate recover {sleeper}" in (late.value.hint or "")
        # No undo: nothing was restored or unlocked, so nothing acted on the process mid-call.
        assert sorted(s for _, s, _, _ in world.calls()) == ["checkpoint", "lock", "lock"]
        assert world.state(sleeper) == "checkpointing" and world.state(other.pid) == "checkpointed"
        world.release("checkpoint", sleeper)
        wait_until(lambda: world.state(sleeper) == "checkpointed", 30, "the checkpoint to end")
    finally:
        other.kill()
        other.wait()


def test_a_caller_holding_over_a_thousand_descriptors_waits_for_its_calls(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    """``serve`` holds its proxy's sockets: a pidfd numbered past 1024 is beyond select()."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 1200
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"the hard limit on open files here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, wanted), hard))
    held: list[int] = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.dup(0))
        checkpointer = make(checkpointer_kind, StepTimeouts())
        checkpointer.lock(sleeper, 1000)
        checkpointer.checkpoint(sleeper)
        checkpointer.restore(sleeper)
        assert world.state(sleeper) == "locked"
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def interruptible() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here, as in a terminal (not where it was ignored at start)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_a_checkpoint_leaves_it_running_and_nothing_is_called_over_it(
    world: World, checkpointer_kind: str, sleeper: int, interruptible: None
) -> None:
    checkpointer = make(checkpointer_kind, StepTimeouts(checkpoint=120, query=0.3))
    checkpointer.lock(sleeper, 1000)
    world.hold("checkpoint", sleeper)
    main = threading.main_thread().ident or 0

    def interrupt_once_under_way() -> None:
        # The call begins only once its helper has been told to go, just before the wait.
        wait_until(lambda: world.state(sleeper) == "checkpointing", 30, "the checkpoint to begin")
        signal.pthread_kill(main, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_under_way)
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpointer.checkpoint(sleeper)
    finally:
        interrupter.join()
    world.clear_calls()
    # What an undo does first: read the state. It must not run over the checkpoint in flight.
    with pytest.raises(CheckpointStepError) as refused:
        checkpointer.state(sleeper)
    assert "which was still running, had not returned 0.3s later" in refused.value.message
    assert "was not called over it" in refused.value.message
    assert world.calls(("state", "restore", "unlock")) == [] and world.state(sleeper) == "checkpointing"
    world.release("checkpoint", sleeper)
    wait_until(lambda: world.state(sleeper) == "checkpointed", 30, "the checkpoint to end")
    assert checkpointer.state(sleeper).value == "checkpointed"
    (waited,) = checkpointer.waits()
    assert "which was still running, to return" in waited


def _pidfds_and_unlinked_files() -> set[tuple[int, str]]:
    """This process's pidfds and open unlinked files (a helper's output), as /proc/self/fd shows them."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            target = os.readlink(f"/proc/self/fd/{name}")
            if target == "anon_inode:[pidfd]" or target.endswith(" (deleted)"):
                found.add((int(name), target))
    return found


def test_a_call_that_outlived_its_timeout_leaves_no_zombie_nor_descriptor_once_it_ends(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    """A long-lived caller (``serve``) must not keep a zombie, a pidfd or its files per such call."""
    checkpointer = make(checkpointer_kind, StepTimeouts(checkpoint=0.2))
    checkpointer.lock(sleeper, 1000)
    before = _pidfds_and_unlinked_files()
    world.hold("checkpoint", sleeper)
    with pytest.raises(CheckpointStepError) as late:
        checkpointer.checkpoint(sleeper)
    running = late.value.running
    assert running is not None and procinfo.is_alive(running.helper)
    # Those of the call (an earlier test's may close meanwhile: they are not counted).
    opened = _pidfds_and_unlinked_files() - before
    assert len(opened) == 3  # its pidfd, its stdout and its stderr
    world.release("checkpoint", sleeper)
    wait_until(
        lambda: (
            world.state(sleeper) == "checkpointed"
            and not os.path.exists(f"/proc/{running.helper.pid}")  # not even a zombie: reaped
            and not opened & _pidfds_and_unlinked_files()
        ),
        30,
        "the helper to end and be reaped, and its descriptors closed",
        detail=lambda: (procinfo.zombie_wait_status(running.helper), opened & _pidfds_and_unlinked_files()),
    )


# A command whose checkpoint gives up after half a second (the CLI's own is 600 s): it exits then.
SLEEP_COMMAND = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    from hibernate import orchestrator
    from hibernate.checkpoint.base import StepTimeouts
    from hibernate.errors import HibernateError

    pid, kind, directory = int(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    options = orchestrator.Options(
        checkpointer_kind=kind, cuda_timeouts=StepTimeouts(checkpoint=0.5, query=0.5)
    )
    try:
        orchestrator.sleep([pid], directory, options)
    except HibernateError as exc:
        print(exc)
        sys.exit(int(exc.exit_code))
    """
)


def agent_state(cli: Callable[..., Any], pid: int) -> str:
    state: str = cli("status", str(pid), "--json").json()["agents"][0]["state"]
    return state


def journaled_calls(runtime_dir: Path) -> list[dict[str, Any]]:
    """Every detached call in every journal entry under ``runtime_dir``."""
    calls: list[dict[str, Any]] = []
    for path in runtime_dir.rglob("journal/*.json"):
        try:
            calls.extend(json.loads(path.read_text()).get("calls", []))
        except (OSError, ValueError):
            continue  # being replaced: read it again
    return calls


def completes_the_sleep_then_wakes(
    cli: Callable[..., Any], world: World, demo: Any, kind: str, reference: str | None
) -> None:
    """``hibernate recover`` after a sleep whose checkpoint ended checkpointed: the sleep stands."""
    recovered = cli("recover", str(demo.pid), "--checkpointer", kind, "--json")
    assert recovered.returncode == 0, recovered.stderr
    assert recovered.json()["action"] == "finished the interrupted sleep"
    status = cli("status", str(demo.pid), "--json").json()["agents"][0]
    assert world.state(demo.pid) == "checkpointed" and status["state"] == "asleep"
    assert status["interrupted"] is None
    assert cli("wake", str(demo.pid), "--checkpointer", kind).returncode == 0
    assert world.state(demo.pid) == "running" and agent_state(cli, demo.pid) == "running"
    if reference is not None:
        assert demo.infer()["digest"] == reference


def sleep_that_gives_up(pid: int, kind: str, work_dir: Path) -> subprocess.CompletedProcess[str]:
    """SLEEP_COMMAND run to its end: its checkpoint gives up waiting after half a second."""
    return subprocess.run(
        [sys.executable, "-c", SLEEP_COMMAND, str(pid), kind, str(work_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.slow
def test_a_checkpoint_that_outlives_its_timeout_ends_checkpointed_and_recover_completes_the_sleep(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    checkpointer_kind: str,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    reference = demo.infer()["digest"]
    world.hold("checkpoint", demo.pid)
    command = sleep_that_gives_up(demo.pid, checkpointer_kind, work_dir)
    assert command.returncode == ExitCode.TIMEOUT, command.stdout + command.stderr
    assert "did not return within 0.5s and is still running" in command.stdout
    assert f"hibernate recover {demo.pid}" in command.stdout
    assert "completes the sleep if every checkpoint succeeded" in command.stdout
    # The command has exited; the checkpoint it started was not cut.
    assert world.state(demo.pid) == "checkpointing"
    status = cli("status", str(demo.pid), "--json").json()["agents"][0]
    assert status["state"] == "asleep" and status["interrupted"]["resolve"] == f"hibernate recover {demo.pid}"
    (running,) = status["interrupted"]["running"]
    assert running.startswith(("cuCheckpointProcessCheckpoint", "cuda-checkpoint --action checkpoint"))
    world.release("checkpoint", demo.pid)
    wait_until(lambda: world.state(demo.pid) == "checkpointed", 30, "the checkpoint to end")
    completes_the_sleep_then_wakes(cli, world, demo, checkpointer_kind, reference)


@pytest.mark.slow
def test_a_wake_killed_mid_restore_does_not_cut_it_and_recover_waits_and_finishes(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
    checkpointer_kind: str,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    reference = demo.infer()["digest"]
    flag = ("--checkpointer", checkpointer_kind)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), *flag).returncode == 0
    assert world.state(demo.pid) == "checkpointed"
    world.hold("restore", demo.pid)
    environment = {**os.environ, "PYTHONPATH": str(REPO)}
    wake = subprocess.Popen(
        [sys.executable, "-m", "hibernate", "wake", str(demo.pid), *flag],
        cwd=REPO,
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(
        lambda: (
            world.state(demo.pid) == "restoring"
            and [c["step"] for c in journaled_calls(runtime_dir)] == ["restore"]
        ),
        60,
        "the wake's restore to be under way and journaled",
        process=wake,
    )
    wake.send_signal(signal.SIGKILL)
    wake.wait()
    assert world.state(demo.pid) == "restoring"  # not cut: its own process runs on
    recover = subprocess.Popen(
        [sys.executable, "-m", "hibernate", "recover", str(demo.pid), *flag],
        cwd=REPO,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert recover.stderr is not None
        said = []
        for line in recover.stderr:  # ordered by what recover says, not by time
            said.append(line)
            if "waiting" in line and "a restore is never cut" in line:
                break
        else:
            pytest.fail(f"recover did not wait for the restore: {''.join(said)}")
        assert world.state(demo.pid) == "restoring"
        world.release("restore", demo.pid)
        assert recover.wait(timeout=120) == 0, recover.stderr.read()
    finally:
        if recover.poll() is None:
            recover.kill()
            recover.wait()
    assert world.state(demo.pid) == "running" and agent_state(cli, demo.pid) == "running"
    assert demo.infer()["digest"] == reference


@pytest.mark.slow
def test_recover_waits_for_a_call_still_running_no_longer_than_its_bound(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    world.hold("checkpoint", demo.pid)
    command = sleep_that_gives_up(demo.pid, "driver", work_dir)
    assert command.returncode == ExitCode.TIMEOUT, command.stdout + command.stderr
    (call,) = journaled_calls(runtime_dir)
    try:
        options = orchestrator.Options(checkpointer_kind="driver", cuda_timeouts=StepTimeouts(checkpoint=0.3))
        with pytest.raises(StillRunningError) as still:
            orchestrator.recover([demo.pid], options)
        message = still.value.message
        assert f"cuCheckpointProcessCheckpoint({demo.pid}) in process {call['helper']['pid']}" in message
        assert "started by an earlier hibernate command, is still running after 0.3s" in message
        assert f"hibernate recover {demo.pid}" in (still.value.hint or "")
        # Nothing was done, and the journal still names the call for the next try.
        assert world.state(demo.pid) == "checkpointing" and journaled_calls(runtime_dir) == [call]
    finally:
        world.release("checkpoint", demo.pid)
    wait_until(lambda: world.state(demo.pid) == "checkpointed", 30, "the checkpoint to end")
    completes_the_sleep_then_wakes(cli, world, demo, "driver", None)


@pytest.mark.slow
def test_recover_finishing_a_sleep_journals_its_checkpoint_and_stops_at_one_still_running(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    killed = cli(
        "sleep", str(demo.pid), "--to", str(work_dir), env={"HIBERNATE_FAULT": "sleep.after-release:kill"}
    )
    assert killed.returncode == -signal.SIGKILL and world.state(demo.pid) == "running"
    world.hold("checkpoint", demo.pid)
    try:
        options = orchestrator.Options(
            checkpointer_kind="driver", cuda_timeouts=StepTimeouts(checkpoint=0.3, query=0.3)
        )
        with pytest.raises(StillRunningError) as still:
            orchestrator.recover([demo.pid], options)  # finishes the sleep: only its CUDA stage was left
        assert "did not return within 0.3s and is still running" in still.value.message
        # The interrupted sleep's entry carries the call (and its marks) for the next recover.
        assert [c["step"] for c in journaled_calls(runtime_dir)] == ["checkpoint"]
        assert world.state(demo.pid) == "checkpointing"
    finally:
        world.release("checkpoint", demo.pid)
    wait_until(lambda: world.state(demo.pid) == "checkpointed", 30, "the checkpoint to end")
    completes_the_sleep_then_wakes(cli, world, demo, "driver", None)
