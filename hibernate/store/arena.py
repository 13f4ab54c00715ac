"""Staging arenas: chunks packed back to back, each arena written as one request.

The staging memory (the only host memory a spill adds, whatever its size) is
split into a few large arenas. Stagers take places in the current arena in
order (Packer.reserve) and fill them; a writer takes full arenas in the order
they were filled and writes each one's live chunks with a single vectored
request (see stream.py). A run of small chunks is packed back to back (64-byte
aligned), a large chunk and each run start on a page (4 KiB), as direct I/O
needs.

Why arenas and not one write per chunk: a chunk ends where its region ends, so
a model of many tensors makes many short chunks, and on the disks we measured
each request costs a fixed latency on top of its transfer. Packing chunks into
64 MiB requests reaches the raw O_DIRECT limit; one request per chunk did not.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from hibernate.store.directio import StagingBuffer, StagingPool
from hibernate.store.manifest import ALIGNMENT, align_up

# Staging is split in two arenas at least: one is written while the other is filled (more where
# several writers keep requests in flight: arenas_for).
ARENAS = 2
MAX_REQUEST_BYTES = 128 << 20  # one I/O request; requests cost a fixed latency, so fewer is faster
# Where a packed chunk may start within its run (see Packer.reserve): a cache line, so the
# copies and checksums of a wake read whole lines; it costs 32 bytes a chunk on average.
PACKED_ALIGNMENT = 64


def arena_bytes(buffer_bytes: int, arenas: int = ARENAS) -> int:
    """The size of one of ``arenas`` staging arenas (and of the largest I/O request) for
    ``buffer_bytes`` of staging."""
    return max(ALIGNMENT, min(MAX_REQUEST_BYTES, buffer_bytes // arenas // ALIGNMENT * ALIGNMENT))


def arena_bytes_for(buffer_bytes: int, data_bytes: int, largest_chunk: int, arenas: int = ARENAS) -> int:
    """An arena size for moving ``data_bytes`` through ``arenas`` arenas: no more staging than the
    data needs.

    Staging is faulted in before the I/O starts, so a small snapshot should
    not pay for 256 MiB of it; an arena still holds the largest chunk.
    """
    needed = align_up(-(-data_bytes // arenas))
    return max(align_up(largest_chunk), min(arena_bytes(buffer_bytes, arenas), needed))


def arenas_for(writers: int, buffer_bytes: int, largest_chunk: int) -> int:
    """How many arenas a spill with ``writers`` requests in flight splits its staging into: one
    being filled and one for each writer (two at least), as many as ``buffer_bytes`` holds
    arenas of the largest chunk."""
    fit = buffer_bytes // max(ALIGNMENT, align_up(largest_chunk))
    return max(ARENAS, min(writers + 1, fit))


@dataclass(slots=True)
class Slot:
    """One chunk's place in an arena; ``live`` is False once it turned out to be reusable.

    ``padded`` (its length and the zeros after it, up to the next slot or page) is a field, not a
    property: it is read three times per chunk, and a model of 100,000
    tensors has as many chunks.
    """

    task: int
    position: int
    length: int
    padded: int
    digest: str = ""
    live: bool = False  # set once staged; a slot given up midway is not written
    done: bool = False


@dataclass
class Arena:
    """A staging buffer filled with chunks back to back, then written as one request."""

    buffer: StagingBuffer
    used: int = 0
    pending: int = 0
    sealed: bool = False
    slots: list[Slot] = field(default_factory=list)
    filled: threading.Event = field(default_factory=threading.Event)

    def live_spans(self) -> tuple[list[tuple[int, int]], list[tuple[Slot, int]]]:
        """The pages that hold live slots, neighbours merged: what the writer hands the kernel; and
        each live slot with where it lies once those spans are written back to back.

        Whole pages, for direct I/O: a slot packed beside a live one in a
        page is written with it, live or not (a few KiB at most, which no
        chunk refers to). One pass with the page arithmetic inline: at
        100,000 small chunks, a call of align_up per bound and a second
        pass to place the slots were a third of the writer's time.
        """
        page = ALIGNMENT - 1  # a power of two: the bits below a page
        spans: list[tuple[int, int]] = []
        placed: list[tuple[Slot, int]] = []
        first = last = -1  # the span being grown
        written = 0  # the bytes of the spans before it
        for slot in self.slots:
            if not slot.live:
                continue
            start = slot.position & ~page
            end = (slot.position + slot.padded + page) & ~page
            if start > last:  # a gap: the span so far is done
                if last >= 0:
                    spans.append((first, last))
                    written += last - first
                first, last = start, end
            elif end > last:
                last = end
            placed.append((slot, written + slot.position - first))
        if last >= 0:
            spans.append((first, last))
        return spans, placed


class Packer:
    """Hands out arena space in order and passes each full arena on to the writers, in order.

    The first arena is passed on after its first chunk, so the disk starts
    working while the rest of the staging memory is still being filled.
    """

    def __init__(self, pool: StagingPool, abort: threading.Event) -> None:
        self._pool = pool
        self._abort = abort
        self._lock = threading.Lock()
        self._current: Arena | None = None
        self._started = False
        self.sealed: queue.Queue[Arena | None] = queue.Queue()

    def _fits(self, arena: Arena, size: int) -> bool:
        """Whether ``size`` more bytes fit in ``arena`` (the first arena takes one chunk: see above)."""
        if not self._started:
            return not arena.slots
        return arena.used + size <= arena.buffer.size

    def reserve(
        self, chunks: Sequence[tuple[int, int]], alignment: int = PACKED_ALIGNMENT
    ) -> tuple[Arena, list[Slot]]:
        """Places in one arena for the first of ``chunks`` (task, length), as many as fit there.

        The run's chunks are packed back to back (each at a multiple of
        ``alignment``: PACKED_ALIGNMENT, or a page for chunks that each start
        on one), and the run ends on a page, where the next starts:
        at 100,000 tensors of 2.6-74 KiB, a page per chunk made the data a
        third larger than the tensors, and a wake read all of it.

        A stager reserves a run of small chunks at once and finishes them
        together: a lock and a wakeup per chunk cost more than copying and
        hashing a small tensor. It finishes them before reserving the next
        run, so it never holds unfinished places in an arena while it waits
        for another.
        """
        while True:
            with self._lock:
                arena = self._current
                if arena is not None and self._fits(arena, align_up(chunks[0][1])):
                    # What _fits says of each further chunk, with the arithmetic inline (both
                    # alignments are powers of two): a call or two per chunk of 100,000 told.
                    # The first arena takes one chunk (see above).
                    size = arena.buffer.size if self._started else -1
                    page, step = ALIGNMENT - 1, alignment - 1
                    slots: list[Slot] = []
                    position = arena.used
                    for task, length in chunks:
                        if slots and (position + length + page) & ~page > size:
                            break
                        following = (position + length + step) & ~step
                        # Each slot pads up to the next; the last one up to the page (below).
                        slots.append(Slot(task, position, length, following - position))
                        position = following
                    last = slots[-1]
                    last.padded = ((last.position + last.length + page) & ~page) - last.position
                    arena.slots.extend(slots)
                    arena.used = last.position + last.padded
                    arena.pending += len(slots)
                    return arena, slots
                if arena is not None:
                    self._seal(arena)
                    self._current = None
            # Wait for a free buffer without the lock: the writer frees one only after
            # stagers finish their slots, and finishing a slot takes the lock.
            fresh = self._pool.take(self._abort)
            with self._lock:
                installed = self._current is None
                if installed:
                    self._current = Arena(fresh)
            if not installed:
                self._pool.give(fresh)  # another stager installed one first

    def finish(self, arena: Arena, slots: Sequence[Slot]) -> None:
        """``slots`` are staged (their digest and liveness set) or given up (left not live)."""
        with self._lock:
            for slot in slots:
                if not slot.done:
                    slot.done = True
                    arena.pending -= 1
            if arena.sealed and arena.pending == 0:
                arena.filled.set()

    def _seal(self, arena: Arena) -> None:
        self._started = True
        arena.sealed = True
        self.sealed.put(arena)
        if arena.pending == 0:
            arena.filled.set()

    def close(self, writers: int) -> None:
        """No more chunks: pass on the last arena and tell every writer to stop."""
        with self._lock:
            if self._current is not None:
                self._seal(self._current)
                self._current = None
        for _ in range(writers):
            self.sealed.put(None)
