"""Calls that must not hold the CLI hostage: a timeout on a blocking call, and steps run side by side.

A driver call (ctypes) cannot be interrupted, and a concurrent.futures worker
is joined at interpreter exit, so one stuck call would keep ``hibernate`` from
ever exiting. These helpers use daemon threads: a call abandoned on timeout
dies with the process instead.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


class CallTimedOut(Exception):
    """The call did not return within its time; it is still running in a daemon thread."""


@dataclass
class Outcome(Generic[T]):
    value: T | None = None
    error: BaseException | None = None
    seconds: float = 0.0


def call_with_timeout(func: Callable[[], T], timeout: float | None, name: str = "call") -> T:
    """``func()``, or CallTimedOut after ``timeout`` seconds (None: wait for ever)."""
    if timeout is None:
        return func()
    box: Outcome[T] = Outcome()
    done = threading.Event()

    def run() -> None:
        try:
            box.value = func()
        except BaseException as exc:  # handed to the caller's thread
            box.error = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"hibernate-{name}", daemon=True).start()
    if not done.wait(timeout):
        raise CallTimedOut(f"{name} did not return within {timeout:g}s")
    if box.error is not None:
        raise box.error
    return box.value  # type: ignore[return-value]


def run_each(keys: Sequence[K], work: Callable[[K], T]) -> dict[K, Outcome[T]]:
    """Run ``work(key)`` for every key at once and wait for all; each outcome keeps its own error."""
    import time

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
