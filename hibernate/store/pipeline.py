"""Run a transfer's worker threads together; the first failure stops them all.

Copy, hash and disk I/O all release the GIL, so plain threads overlap device
copies, checksums and disk requests. Each transfer is a few workers sharing a
bounded set of staging buffers; this class only starts them, propagates the
first exception, and makes sure none is left running. The callbacks a
transfer takes, the writer's and the reader's alike, are typed here too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from hibernate.store.directio import PipelineAbortedError

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)
CancelledFn = Callable[[], bool]  # whether the transfer was called off
PinFn = Callable[[memoryview], Callable[[], None]]  # pins a staging buffer; returns its unpin


class Pipeline:
    """Worker threads of one transfer, stopped together by the first failure."""

    def __init__(self) -> None:
        self.abort = threading.Event()
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def start(self, name: str, work: Callable[[], None]) -> None:
        def run() -> None:
            try:
                work()
            except PipelineAbortedError:
                pass
            except BaseException as exc:
                with self._lock:
                    if self._error is None:
                        self._error = exc
                self.abort.set()

        thread = threading.Thread(target=run, name=f"hibernate-{name}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def join(self) -> None:
        """Wait for every worker; re-raise the first failure."""
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error
