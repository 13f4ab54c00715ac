"""Run a transfer's worker threads together; the first failure stops them all.

Copy, hash and disk I/O all release the GIL, so plain threads overlap device
copies, checksums and disk requests. Each transfer is a few workers sharing a
bounded set of staging buffers; this class only starts them, propagates the
first exception, and makes sure none is left running. The callbacks a
transfer takes, the writer's and the reader's alike, are typed here too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

from hibernate.store.directio import Fence, PipelineAbortedError

ProgressFn = Callable[[int, int], None]  # (bytes done, bytes in all)
CancelledFn = Callable[[], bool]  # whether the transfer was called off
# Page-locks a staging buffer; returns its unpin, or None where it could not (the buffer then works
# pageable, only slower, and a later transfer that takes it again tries again).
PinFn = Callable[[memoryview], Callable[[], None] | None]


class Queued:
    """What a deferral block queued (see DeviceStaging): its fence once the block ended, or None
    where nothing it copied is still in flight."""

    __slots__ = ("fence",)

    def __init__(self) -> None:
        self.fence: Fence | None = None


Defer = Callable[[], AbstractContextManager[Queued]]


@contextlib.contextmanager
def copies_done_on_return() -> Iterator[Queued]:
    """The deferral of regions whose copies are done when they return (host memory): nothing to wait for."""
    yield Queued()


@dataclass(frozen=True)
class DeviceStaging:
    """A pool's page-locking (a PinFn like any other) that also brackets its asynchronous device copies.

    The contract between the store and a pool whose device copies run on
    streams. Waiting for each copy costs a synchronization per region (one
    per tensor, 100,000 for as many small tensors), and serialises the device
    copy with the verify or hash beside it; so the store's workers bracket
    the copies of one staging chunk in ``with staging.defer() as queued:``.
    Inside the block, a region's copy_in and copy_out only queue their device
    copies (every copy the thread queues there, whichever pool's region it
    is); when the block ends, ``queued.fence`` covers them all, and until its
    ``wait()`` returned:

    * a copy_out's staging holds nothing yet: a writer waits before hashing;
    * a copy_in's staging is still being read: it must be neither reused nor
      unmapped. The reader registers the fence with the buffer
      (StagingPool.fence), which waits for it only when the buffer is taken
      again, or at the end, so the next chunk is verified meanwhile.

    A block left by an exception has waited for what it queued before the
    exception goes on, so the staging may be unmapped at once. It is offered
    as the pin (Pool.pinner) so that it reaches the store the way the pin
    always did; a plain PinFn means copies done when they return.
    """

    pin: PinFn
    defer: Defer

    def __call__(self, view: memoryview) -> Callable[[], None] | None:
        return self.pin(view)


def deferral(pin: PinFn | None) -> Defer:
    """How a transfer's workers bracket a staging chunk's copies: the pool's where it defers them."""
    return pin.defer if isinstance(pin, DeviceStaging) else copies_done_on_return


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

    def stop(self) -> None:
        """Stop every worker and wait for it, whatever happened: on the way out of a transfer that
        did not reach join (a start that failed, Ctrl-C in an in-process sleep), before its staging
        is unmapped or kept for the next transfer, which a worker still running would write into.
        After join, nothing is left to wait for."""
        self.abort.set()
        for thread in self._threads:
            thread.join()

    def join(self) -> None:
        """Wait for every worker; re-raise the first failure."""
        for thread in self._threads:
            thread.join()
        if self._error is not None:
            raise self._error
