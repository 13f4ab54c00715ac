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
from hibernate.checkpoint.phase import CudaPhase
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


def test_the_undo_waits_for_a_timed_out_checkpoint_before_calling_the_driver(
    world: World, holder: int, monkeypatch: pytest.MonkeyPatch, runtime_dir: object
) -> None:
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("checkpoint", holder, "hang")))
    monkeypatch.setenv("HIBERNATE_STANDIN_HANG_S", "1.5")
    driver = DriverCheckpointer(timeouts=StepTimeouts(checkpoint=0.3, query=30))
    found = survey([holder], driver).holders
    world.clear_calls()
    with pytest.raises(HibernateTimeoutError) as late:
        CudaPhase(driver).sleep(found)
    message = late.value.message
    assert "cuCheckpointProcessCheckpoint did not return within 0.3s" in message
    assert "undone: every CUDA process runs again" in message
    assert (
        f"cuCheckpointProcessGetState({holder}) waited" in message
        and f"for cuCheckpointProcessCheckpoint({holder}), which had timed out, "
        "to return (CUDA_ERROR_UNKNOWN)"
        in message
    )
    calls = [(step, result) for _, step, pid, result in world.calls(EVERY_STEP) if pid == holder]
    assert calls == [
        ("lock", "CUDA_SUCCESS"),
        ("checkpoint", "CUDA_ERROR_UNKNOWN"),  # returned (after its hang) before the undo asked anything
        ("state", "CUDA_SUCCESS"),
        ("unlock", "CUDA_SUCCESS"),
    ]
    assert world.state(holder) == "running"


def test_a_call_still_running_past_the_bound_is_not_overlapped_and_both_are_named(
    world: World, holder: int, monkeypatch: pytest.MonkeyPatch, runtime_dir: object
) -> None:
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("checkpoint", holder, "hang")))
    monkeypatch.setenv("HIBERNATE_STANDIN_HANG_S", "3")
    driver = DriverCheckpointer(timeouts=StepTimeouts(checkpoint=0.2, query=0.5))
    found = survey([holder], driver).holders
    world.clear_calls()
    with pytest.raises(NeedsRecoveryError) as stuck:
        CudaPhase(driver).sleep(found)
    message = stuck.value.message
    stray = f"cuCheckpointProcessCheckpoint({holder}), which had timed out"
    assert f"{stray}, was still running 0.5s later" in message
    assert f"cuCheckpointProcessGetState({holder}) was not called over it" in message
    assert [s for _, s, pid, _ in world.calls(EVERY_STEP) if pid == holder] == ["lock"]  # nothing overlapped
    assert world.state(holder) == "locked" and os.getpid() != holder
