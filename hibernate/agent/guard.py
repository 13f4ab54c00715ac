"""The guard: a program's promise not to touch tracked memory while hibernate moves it.

Many threads may hold the guard at once (it is shared, like a read lock). A
sleep *closes* it: it stops new entries, waits until current holders leave (up
to its timeout, after which it reopens and fails cleanly), and keeps it closed
while the process is asleep. Entering a closed guard waits for the wake, or
raises :class:`HibernatingError` when the caller asked not to wait.

A thread may re-enter a guard it already holds even while a sleep waits:
otherwise nested ``with hibernate.guard():`` blocks would deadlock.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from hibernate.errors import AbortedError, HibernateTimeoutError, HibernatingError, UsageError


class Guard:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holders = 0
        self._waiting = 0  # threads blocked in enter() until the guard opens
        self._closing = False
        self._closed = False
        self._local = threading.local()

    @property
    def holders(self) -> int:
        with self._cond:
            return self._holders

    @property
    def waiting(self) -> int:
        """Threads waiting to enter (for the wake): a test orders itself on this, not on time."""
        with self._cond:
            return self._waiting

    @property
    def closed(self) -> bool:
        with self._cond:
            return self._closed

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def held_by_current_thread(self) -> bool:
        return self._depth() > 0

    def enter(self, *, wait: bool = True, timeout: float | None = None) -> None:
        depth = self._depth()
        if depth:
            self._local.depth = depth + 1
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._closing or self._closed:
                if not wait:
                    raise HibernatingError("the process is hibernating; tracked memory is not available")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise HibernateTimeoutError(
                        f"the process stayed asleep for more than {timeout:g}s; guard not entered"
                    )
                self._waiting += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._waiting -= 1
            self._holders += 1
        self._local.depth = 1

    def exit(self) -> None:
        depth = self._depth()
        if depth <= 0:
            raise UsageError("guard exited more times than it was entered")
        self._local.depth = depth - 1
        if depth == 1:
            with self._cond:
                self._holders -= 1
                self._cond.notify_all()

    @contextmanager
    def hold(self, *, wait: bool = True, timeout: float | None = None) -> Iterator[None]:
        self.enter(wait=wait, timeout=timeout)
        try:
            yield
        finally:
            self.exit()

    def close(self, timeout: float, cancelled: Callable[[], bool] | None = None) -> None:
        """Stop new entries and wait for holders to leave; on timeout reopen and raise."""
        if self.held_by_current_thread():
            raise UsageError("cannot hibernate from inside hibernate.guard() on the same thread")
        deadline = time.monotonic() + timeout
        with self._cond:
            if self._closed:
                return
            self._closing = True
            try:
                while self._holders:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise HibernateTimeoutError(
                            f"the program held hibernate.guard() for more than {timeout:g}s; "
                            "nothing was changed",
                            hint="retry when the program is idle, or raise --timeout",
                        )
                    if cancelled is not None and cancelled():
                        raise AbortedError("the sleep was called off while waiting for the guard")
                    self._cond.wait(min(remaining, 0.1))
                self._closed = True
            finally:
                self._closing = False
                self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._closed = False
            self._closing = False
            self._cond.notify_all()
