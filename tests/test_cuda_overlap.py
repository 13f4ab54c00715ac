"""No overlapping driver calls (issue 12, item 6).

A driver call that timed out keeps running in its thread (ctypes cannot be
interrupted). The undo that follows must not call the driver for the same
process until it has returned: it waits, bounded by the query timeout, and
the outcome names both calls. The stand-in logs each call when it returns, and
a hanging call returns only at the end of its hang, so the log's order shows
whether a later call overlapped it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from hibernate.checkpoint.base import StepTimeouts
from hibernate.checkpoint.detect import survey
from hibernate.checkpoint.driver import DriverCheckpointer
from hibernate.checkpoint.group import GroupCheckpoint
from hibernate.errors import HibernateTimeoutError, NeedsRecoveryError
from tests.standins.world import World, spec

EVERY_STEP = ("state", "lock", "checkpoint", "restore", "unlock")


@pytest.fixture
def holder(world: World) -> Iterator[int]:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    world.register(proc.pid)
    yield proc.pid
    proc.kill()
    proc.wait()


# step -> (fault, timeouts that give up on it first, what the undo does once it has returned)
CASES = {
    # A lock whose driver call outlives its own timeoutMs and hibernate's grace (lock + query).
    "lock": ("stuck", StepTimeouts(lock=0.1, query=2.0), []),
    "checkpoint": ("hang", StepTimeouts(checkpoint=0.3, query=30), [("unlock", "CUDA_SUCCESS")]),
}
SYMBOL = {"lock": "cuCheckpointProcessLock", "checkpoint": "cuCheckpointProcessCheckpoint"}


@pytest.mark.parametrize("step", list(CASES))
def test_the_undo_waits_for_a_timed_out_call_before_calling_the_driver(
    world: World, holder: int, monkeypatch: pytest.MonkeyPatch, runtime_dir: object, step: str
) -> None:
    fault, timeouts, undo = CASES[step]
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec((step, holder, fault)))
    monkeypatch.setenv("HIBERNATE_STANDIN_HANG_S", "3" if step == "lock" else "1.5")
    driver = DriverCheckpointer(timeouts=timeouts)
    found = survey([holder], driver).holders
    world.clear_calls()
    with pytest.raises(HibernateTimeoutError) as late:
        GroupCheckpoint(driver, timeouts).sleep(found)
    message = late.value.message
    assert f"{SYMBOL[step]} did not return within" in message
    assert "undone: every CUDA process runs again" in message
    assert (
        f"cuCheckpointProcessGetState({holder}) waited" in message
        and f"for {SYMBOL[step]}({holder}), which had timed out, to return (CUDA_ERROR_UNKNOWN)" in message
    )
    calls = [(s, result) for _, s, pid, result in world.calls(EVERY_STEP) if pid == holder]
    before = [("lock", "CUDA_SUCCESS")] if step == "checkpoint" else []
    # The timed-out call returned (after its hang) before the undo asked anything.
    assert calls == [*before, (step, "CUDA_ERROR_UNKNOWN"), ("state", "CUDA_SUCCESS"), *undo]
    assert world.state(holder) == "running"


def test_a_call_still_running_past_the_bound_is_not_overlapped_and_both_are_named(
    world: World, holder: int, monkeypatch: pytest.MonkeyPatch, runtime_dir: object
) -> None:
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("checkpoint", holder, "hang")))
    monkeypatch.setenv("HIBERNATE_STANDIN_HANG_S", "3")
    timeouts = StepTimeouts(checkpoint=0.2, query=0.5)
    driver = DriverCheckpointer(timeouts=timeouts)
    found = survey([holder], driver).holders
    world.clear_calls()
    with pytest.raises(NeedsRecoveryError) as stuck:
        GroupCheckpoint(driver, timeouts).sleep(found)
    message = stuck.value.message
    stray = f"cuCheckpointProcessCheckpoint({holder}), which had timed out"
    assert f"{stray}, was still running 0.5s later" in message
    assert f"cuCheckpointProcessGetState({holder}) was not called over it" in message
    assert [s for _, s, pid, _ in world.calls(EVERY_STEP) if pid == holder] == ["lock"]  # nothing overlapped
    assert world.state(holder) == "locked" and os.getpid() != holder
    # The stray call still hangs in a thread of this process: let it return here, not in the next test.
    world.wait_for_call("checkpoint", holder)
