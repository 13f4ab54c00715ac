"""No overlapping driver calls.

A lock, unlock or query that timed out keeps running in its thread (ctypes
cannot be interrupted). The undo that follows must not call the driver for the
same process until it has returned: it waits, bounded by the query timeout, and
the outcome names both calls. (A checkpoint or restore that times out runs on in
a process of its own and stops the group instead: tests/test_checkpoint_uncut.py.)
The stand-in logs each call when it returns, and a hanging call returns only at
the end of its hang, so the log's order shows whether a later call overlapped it.
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


def test_the_undo_waits_for_a_timed_out_lock_before_calling_the_driver(
    world: World, holder: int, monkeypatch: pytest.MonkeyPatch, runtime_dir: object
) -> None:
    # A lock whose driver call outlives its own timeoutMs and hibernate's grace (lock + query).
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("lock", holder, "stuck")))
    monkeypatch.setenv("HIBERNATE_STANDIN_HANG_S", "3")
    timeouts = StepTimeouts(lock=0.1, query=2.0)
    driver = DriverCheckpointer(timeouts=timeouts)
    found = survey([holder], driver).holders
    world.clear_calls()
    with pytest.raises(HibernateTimeoutError) as late:
        GroupCheckpoint(driver, timeouts).sleep(found)
    message = late.value.message
    assert "cuCheckpointProcessLock did not return within" in message
    assert "undone: every CUDA process runs again" in message
    assert (
        f"cuCheckpointProcessGetState({holder}) waited" in message
        and f"for cuCheckpointProcessLock({holder}), which was still running, to return (CUDA_ERROR_UNKNOWN)"
        in message
    )
    calls = [(s, result) for _, s, pid, result in world.calls(EVERY_STEP) if pid == holder]
    # The timed-out call returned (after its hang) before the undo asked anything.
    assert calls == [("lock", "CUDA_ERROR_UNKNOWN"), ("state", "CUDA_SUCCESS")]
    assert world.state(holder) == "running"


def test_a_call_still_running_past_the_bound_is_not_overlapped_and_both_are_named(
    world: World, holder: int, monkeypatch: pytest.MonkeyPatch, runtime_dir: object
) -> None:
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("lock", holder, "stuck")))
    monkeypatch.setenv("HIBERNATE_STANDIN_HANG_S", "3")
    timeouts = StepTimeouts(lock=0.1, query=0.5)
    driver = DriverCheckpointer(timeouts=timeouts)
    found = survey([holder], driver).holders
    world.clear_calls()
    with pytest.raises(NeedsRecoveryError) as stuck:
        GroupCheckpoint(driver, timeouts).sleep(found)
    message = stuck.value.message
    stray = f"cuCheckpointProcessLock({holder}), which was still running"
    assert f"{stray}, had not returned 0.5s later" in message
    assert f"cuCheckpointProcessGetState({holder}) was not called over it" in message
    assert [s for _, s, pid, _ in world.calls(EVERY_STEP) if pid == holder] == []  # nothing overlapped
    assert world.state(holder) == "running" and os.getpid() != holder
    # The stray call still hangs in a thread of this process: let it return here, not in the next test.
    world.wait_for_call("lock", holder)
