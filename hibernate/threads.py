"""Calls that must not hold the CLI hostage: a timeout on a blocking call, and work run side by side.

A driver call (ctypes) cannot be interrupted, and a concurrent.futures worker
is joined at interpreter exit, so one stuck call would keep ``hibernate`` from
ever exiting. These helpers use daemon threads: a call abandoned on timeout
dies with the process instead. Until then it runs on: :class:`Call` is its
handle, so the next call for the same process can wait for it rather than
overlap it. Only calls that may be cut so run here (a lock, an unlock, a
query); a checkpoint or restore must never be cut and runs in a process of its
own (:mod:`hibernate.checkpoint.detached`).

:func:`run_each` is the one fan-out: a checkpointer's step over every process,
an agent request over every agent of an operation, a direct wake of every
vLLM worker. Each outcome keeps its own error, so a caller decides what one
failure among many means.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")
K = TypeVar("K")


@dataclass
class CallResult(Generic[T]):
    """How one call ended: what it returned or raised, and how long it took (``run_each``, per item)."""

    value: T | None = None
    error: BaseException | None = None
    seconds: float = 0.0


class Call(Generic[T]):
    """``func()`` running in a daemon thread of its own; it can be waited for past any timeout."""

    def __init__(self, func: Callable[[], T], name: str) -> None:
        self.name = name
        self.outcome: CallResult[T] = CallResult()
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


class CallTimedOutError(Exception):
    """The call did not return within its time; it is still running in a daemon thread (``call``)."""

    def __init__(self, message: str, call: Call[Any]) -> None:
        super().__init__(message)
        self.call = call


def call_with_timeout(func: Callable[[], T], timeout: float | None, name: str = "call") -> T:
    """``func()``, or CallTimedOutError after ``timeout`` seconds (None: wait for ever)."""
    if timeout is None:
        return func()
    call = Call(func, name)
    if not call.wait(timeout):
        raise CallTimedOutError(f"{name} did not return within {timeout:g}s", call)
    return call.result()


def run_each(
    items: Sequence[K], work: Callable[[K], T], *, at_once: int | None = None
) -> list[CallResult[T]]:
    """Run ``work(item)`` for every item, ``at_once`` at a time (default: all), and wait for all.

    The outcomes are in the order of ``items``, each with its own value or error and seconds;
    items start in their order. An interrupt (Ctrl-C) waits for the work in flight to end before it
    goes on, so that no undo overlaps it (an agent mid-spill on the same connection, a driver call
    mid-checkpoint); items not yet started are not started, their outcome the interrupt. A second
    interrupt is not held back.

    A single item runs in a worker thread too: in the caller's own thread an interrupt would cut
    it mid-call (an agent request whose answer never arrives while the agent goes on with it).
    """
    outcomes: list[CallResult[T]] = [CallResult() for _ in items]
    pending = iter(range(len(items)))
    take = threading.Lock()
    interrupted = threading.Event()

    def run(index: int) -> None:
        started = time.perf_counter()
        try:
            outcomes[index].value = work(items[index])
        except BaseException as exc:  # kept in its outcome for the caller to judge
            outcomes[index].error = exc
        finally:
            outcomes[index].seconds = time.perf_counter() - started

    def worker(finished: threading.Event) -> None:
        try:
            while True:
                with take:
                    index = next(pending, None)
                if index is None:
                    return
                if interrupted.is_set():
                    outcomes[index].error = KeyboardInterrupt()
                else:
                    run(index)
        finally:
            finished.set()

    # Waited for by events of their own, not Thread.join: a join cut by an interrupt may mark a
    # thread still running as stopped (CPython 3.11), and a second join then returns at once.
    workers: list[tuple[threading.Thread, threading.Event]] = []
    try:
        for _ in range(min(len(items), max(1, at_once or len(items)))):
            finished = threading.Event()
            workers.append((threading.Thread(target=worker, args=(finished,), daemon=True), finished))
            workers[-1][0].start()
        for _, finished in workers:
            finished.wait()
    except KeyboardInterrupt:
        interrupted.set()  # a worker not yet running now starts no item
        for thread, finished in workers:
            if thread.ident is not None:  # it runs: it may have an item in flight
                finished.wait()
        raise
    return outcomes


def raise_first_error(outcomes: Iterable[CallResult[T]]) -> None:
    """Raise the first error among ``outcomes`` (in their order), if any: all have finished by then."""
    for outcome in outcomes:
        if outcome.error is not None:
            raise outcome.error
