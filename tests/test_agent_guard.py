"""The guard: sleeps wait for it, it waits for wakes, and nothing deadlocks."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import hibernate
from hibernate.agent import guard as guard_module
from hibernate.agent.guard import Guard
from hibernate.errors import HibernateTimeoutError, HibernatingError, UsageError
from tests.conftest import wait_until


def waiting_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is now inside the guard's ``function`` (waiting there, as it cannot go on)."""
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function and frame.f_code.co_filename == guard_module.__file__:
            return True
        frame = frame.f_back
    return False


def test_close_waits_for_holders_then_blocks_new_entries() -> None:
    guard = Guard()
    entered, left = threading.Event(), threading.Event()

    def hold_until_a_sleep_waits() -> None:
        with guard.hold():
            entered.set()
            wait_until(lambda: guard._closing, 5, "close() to start waiting for the holder", interval=0.01)
        left.set()

    holder = threading.Thread(target=hold_until_a_sleep_waits)
    holder.start()
    assert entered.wait(5)
    guard.close(timeout=5)
    assert left.is_set() and guard.closed
    with pytest.raises(HibernatingError):
        guard.enter(wait=False)
    with pytest.raises(HibernateTimeoutError):
        guard.enter(timeout=0.05)
    guard.open()
    with guard.hold(wait=False):
        assert guard.holders == 1
    holder.join()


def test_close_times_out_and_reopens() -> None:
    guard = Guard()
    entered, release = threading.Event(), threading.Event()

    def hold_long() -> None:
        with guard.hold():
            entered.set()
            release.wait(5)

    holder = threading.Thread(target=hold_long)
    holder.start()
    entered.wait()
    with pytest.raises(HibernateTimeoutError, match=r"more than 0\.1s"):
        guard.close(timeout=0.1)
    assert not guard.closed
    with guard.hold(wait=False):  # others may enter again at once
        pass
    release.set()
    holder.join()


def test_a_waiting_sleep_stops_new_holders_but_not_reentry() -> None:
    guard = Guard()
    entered, nested_ok = threading.Event(), threading.Event()
    proceed = threading.Event()

    def nested_holder() -> None:
        with guard.hold():
            entered.set()
            proceed.wait(5)
            with guard.hold():  # re-entry while a sleep waits must not deadlock
                nested_ok.set()

    holder = threading.Thread(target=nested_holder)
    holder.start()
    entered.wait()
    closer = threading.Thread(target=lambda: guard.close(timeout=5))
    closer.start()
    wait_until(lambda: guard._closing, 5, "close() to start waiting for the holder", interval=0.01)
    with pytest.raises(HibernatingError):
        guard.enter(wait=False)  # a new holder is held back while the sleep waits
    proceed.set()
    closer.join(5)
    holder.join(5)
    assert nested_ok.is_set() and guard.closed


def test_sleeping_from_inside_the_guard_is_refused(fresh_agent: None, work_dir: Path) -> None:
    weights = hibernate.track(torch.ones(1024), name="w")
    with hibernate.guard(), pytest.raises(UsageError, match=r"inside hibernate\.guard"):
        hibernate.sleep(work_dir)
    assert hibernate.state() == "running"
    assert torch.equal(weights, torch.ones(1024))


def test_guard_blocks_until_wake(fresh_agent: None, work_dir: Path) -> None:
    weights = hibernate.track(torch.arange(4096, dtype=torch.float32), name="w")
    hibernate.sleep(work_dir)
    assert hibernate.state() == "asleep"
    with pytest.raises(HibernatingError), hibernate.guard(wait=False):
        pass
    seen: list[float] = []

    def use() -> None:
        with hibernate.guard():
            seen.append(float(weights.sum()))

    user = threading.Thread(target=use)
    user.start()
    wait_until(lambda: waiting_in(user, "enter"), 5, "the user to wait at the guard")
    assert not seen
    hibernate.wake()
    user.join(5)
    assert seen == [float(torch.arange(4096, dtype=torch.float32).sum())]


def test_in_process_sleep_waits_for_a_holder(fresh_agent: None, work_dir: Path) -> None:
    weights = hibernate.track(torch.full((1024,), 7.0), name="w")
    started = threading.Event()

    sleeper = threading.current_thread()

    def step() -> None:
        with hibernate.guard():
            started.set()
            wait_until(lambda: waiting_in(sleeper, "close"), 5, "the sleep to wait for this step")
            weights.add_(1)

    worker = threading.Thread(target=step)
    worker.start()
    started.wait()
    hibernate.sleep(work_dir, timeout=5)
    worker.join()
    hibernate.wake()
    assert torch.equal(weights, torch.full((1024,), 8.0))
