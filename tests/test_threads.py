"""The one fan-out (``hibernate.threads.run_each``): order, errors kept apart, a limit, and an interrupt."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest

from hibernate.threads import raise_first_error, run_each


def test_outcomes_keep_the_order_of_the_items_and_each_its_own_error() -> None:
    def work(item: int) -> int:
        if item == 2:
            raise ValueError("two")
        return item * 10

    outcomes = run_each([3, 2, 1], work)
    assert [o.value for o in outcomes] == [30, None, 10]
    assert [type(o.error) for o in outcomes] == [type(None), ValueError, type(None)]
    with pytest.raises(ValueError, match="two"):
        raise_first_error(outcomes)


def test_at_once_bounds_how_many_run_together() -> None:
    lock = threading.Lock()
    running, most = 0, 0
    release = threading.Event()

    def work(item: int) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
            if running == 2:
                release.set()
        release.wait(10)
        with lock:
            running -= 1

    run_each(list(range(6)), work, at_once=2)
    assert most == 2


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt here, as in a terminal.

    Python installs that handler only where SIGINT was not ignored when it
    started: a background job of a non-interactive shell starts with it ignored.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("sigint_raises")
def test_an_interrupt_waits_for_the_work_in_flight_before_it_goes_on() -> None:
    interrupted = threading.Event()
    both_running = threading.Barrier(2, timeout=10)
    finished: list[int] = []

    def work(item: int) -> None:
        both_running.wait()
        if item == 0:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
            interrupted.set()
            return
        interrupted.wait(10)
        assert not finished  # still in flight when the main thread got its interrupt
        finished.append(item)

    with pytest.raises(KeyboardInterrupt):
        run_each([0, 1], work)
    assert finished == [1]


def test_with_a_limit_items_start_in_their_order() -> None:
    begun: list[int] = []
    run_each(list(range(8)), begun.append, at_once=1)
    assert begun == list(range(8))


@pytest.mark.parametrize("items", [["only"], ["one", "two"]])
@pytest.mark.usefixtures("sigint_raises")
def test_an_interrupt_goes_on_only_once_every_item_in_flight_has_ended(items: list[str]) -> None:
    """One item too (in the caller's thread an interrupt would cut its call), and however the
    interrupt meets the wait (a cut Thread.join may take a running thread for stopped)."""
    interrupted = threading.Event()
    returned = threading.Event()
    in_flight = threading.Barrier(len(items), timeout=10)
    seen_returned: list[bool] = []

    def work(item: str) -> None:
        in_flight.wait()
        if item == items[0]:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        interrupted.wait(10)
        # run_each must not have returned while this item is in flight: it would have by now.
        seen_returned.append(returned.wait(0.5))

    def on_interrupt(signum: int, frame: object) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_each(items, work)
    returned.set()
    assert seen_returned == [False] * len(items)


def test_no_items_no_outcomes() -> None:
    assert run_each([], lambda _: os.getpid()) == []
