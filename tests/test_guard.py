"""The guard: sleeps wait for it, it waits for wakes, and nothing deadlocks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

import hibernate
from hibernate.agent.guard import Guard
from hibernate.errors import HibernateTimeoutError, HibernatingError, UsageError


def test_close_waits_for_holders_then_blocks_new_entries() -> None:
    guard = Guard()
    left = threading.Event()

    def hold_briefly() -> None:
        with guard.hold():
            time.sleep(0.3)
        left.set()

    holder = threading.Thread(target=hold_briefly)
    holder.start()
    time.sleep(0.05)
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
    time.sleep(0.1)
    with pytest.raises(HibernatingError):
        guard.enter(wait=False)  # a new holder is held back while the sleep waits
    proceed.set()
    closer.join(5)
    holder.join(5)
    assert nested_ok.is_set() and guard.closed


def test_sleeping_from_inside_the_guard_is_refused(fresh_agent, work_dir: Path) -> None:
    weights = hibernate.track(torch.ones(1024), name="w")
    with hibernate.guard(), pytest.raises(UsageError, match=r"inside hibernate\.guard"):
        hibernate.sleep(work_dir)
    assert hibernate.state() == "running"
    assert torch.equal(weights, torch.ones(1024))


def test_guard_blocks_until_wake(fresh_agent, work_dir: Path) -> None:
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
    time.sleep(0.2)
    assert not seen
    hibernate.wake()
    user.join(5)
    assert seen == [float(torch.arange(4096, dtype=torch.float32).sum())]


def test_in_process_sleep_waits_for_a_holder(fresh_agent, work_dir: Path) -> None:
    weights = hibernate.track(torch.full((1024,), 7.0), name="w")
    started = threading.Event()

    def step() -> None:
        with hibernate.guard():
            started.set()
            time.sleep(0.3)
            weights.add_(1)

    worker = threading.Thread(target=step)
    worker.start()
    started.wait()
    hibernate.sleep(work_dir, timeout=5)
    worker.join()
    hibernate.wake()
    assert torch.equal(weights, torch.full((1024,), 8.0))
