"""Calls that must not hold the CLI hostage: a timeout on a blocking call, and steps run side by side.

A driver call (ctypes) cannot be interrupted, and a concurrent.futures worker
is joined at interpreter exit, so one stuck call would keep ``hibernate`` from
ever exiting. These helpers use daemon threads: a call abandoned on timeout
dies with the process instead. Until then it runs on: :class:`Call` is its
handle, so the next call for the same process can wait for it rather than
overlap it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


@dataclass
class Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class Call(Generic[T]):
    """``func()`` running in a daemon thread of its own; it can be waited for past any timeout."""

    def __init__(self, func: Callable[[], T], name: str) -> None:
        self.name = name
        self.outcome: Outcome[T] = Outcome()
        self._done = threading.Event()
        self._started = time.perf_counter()

        def run() -> None:
            try:
                self.outcome.value = func()
            except BaseException as exc:  # handed to whoever waits for it
                self.outcome.error = exc
            finally:
                self.outcome.seconds = time.perf_counter() - self._started
                self._done.set()

        threading.Thread(target=run, name=f"hibernate-{name}", daemon=True).start()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None) -> bool:
        """Whether it returned within ``timeout`` seconds (None: wait for ever)."""
        return self._done.wait(timeout)

    def result(self) -> T:
        if self.outcome.error is not None:
            raise self.outcome.error
        return self.outcome.value  # type: ignore[return-value]


class CallTimedOut(Exception):
    """The call did not return within its time; it is still running in a daemon thread (``call``)."""

    def __init__(self, message: str, call: Call[Any]) -> None:
        super().__init__(message)
        self.call = call


def call_with_timeout(func: Callable[[], T], timeout: float | None, name: str = "call") -> T:
    """``func()``, or CallTimedOut after ``timeout`` seconds (None: wait for ever)."""
    if timeout is None:
        return func()
    call = Call(func, name)
    if not call.wait(timeout):
        raise CallTimedOut(f"{name} did not return within {timeout:g}s", call)
    return call.result()


def run_each(keys: Sequence[K], work: Callable[[K], T]) -> dict[K, Outcome[T]]:
    """Run ``work(key)`` for every key at once and wait for all; each outcome keeps its own error."""
    outcomes: dict[K, Outcome[T]] = {key: Outcome() for key in keys}

    def run(key: K) -> None:
        started = time.perf_counter()
        try:
            outcomes[key].value = work(key)
        except BaseException as exc:
            outcomes[key].error = exc
        finally:
            outcomes[key].seconds = time.perf_counter() - started

    if len(keys) == 1:
        run(keys[0])
        return outcomes
    threads = [threading.Thread(target=run, args=(key,), daemon=True) for key in keys]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes
