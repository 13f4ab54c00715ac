"""One spill's chunks through stagers, arenas and writers, into the snapshot's data files.

Stagers take the next chunks of the regions, copy each into the current arena
(arena.py) and checksum the copy; a writer takes full arenas in order and
writes each one's live chunks with one vectored request, appended to the
current data file (Segments). A chunk whose bytes the previous snapshot holds
(the index reuse.link_reusable made) or this sleep has written already is not
written again: it refers to those bytes. For host memory that test runs on
the region in place, before any copy. The reuse check (reusecheck.ReuseCheck)
may run beside the stream in the same pipeline; a second pass
(Stream.rewrite) writes again what it found the disk no longer holds.
"""

from __future__ import annotations

import errno
import functools
import itertools
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from hibernate.errors import AbortedError, StorageError
from hibernate.store import bulk
from hibernate.store.arena import PACKED_ALIGNMENT, Arena, Packer, Slot, arena_bytes_for, arenas_for
from hibernate.store.directio import (
    BUFFERED,
    DIRECT,
    DataFile,
    DirectIORefusedError,
    KeptStaging,
    PipelineAbortedError,
    StagingPool,
    create_data_file,
    finish_write,
    take,
    write_views,
)
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import ALIGNMENT, ChunkRef, align_up, checksum
from hibernate.store.options import WriteOptions
from hibernate.store.pipeline import (
    CancelledFn,
    Defer,
    PinFn,
    Pipeline,
    ProgressFn,
    copies_done_on_return,
    deferral,
)
from hibernate.store.regions import Region, memory_at
from hibernate.store.tuning import Tuning

_BATCH_TASKS = 256  # a stager takes up to this many chunks at once (see Stream._take_tasks)
_BATCH_BYTES = 8 << 20  # or this many bytes, so the stagers still share large regions
# Host chunks up to this size are staged in runs, one bulk.stage call per run (without the
# compiled helper a slice assignment each, which holds the GIL but takes less time than the
# region's call); larger ones, and device chunks, through copy_out (which releases it), each on
# a page of its own, an arena's run at a time (see Stream._stage_copied).
_SMALL_COPY = 256 << 10
_ZEROS = memoryview(bytes(ALIGNMENT))  # padding: a chunk's last page, past its end
_LENGTH = operator.itemgetter(2)  # of a task (region index, offset, length)


def _segment_name(index: int) -> str:
    return f"data-{index:03d}.bin"


@dataclass
class _Lane:
    """The data file one writer appends to, and where its next bytes go."""

    file: DataFile
    name: str
    offset: int = 0


class Segments:
    """Data files of the snapshot being written, each appended to in order by one writer.

    Each writer (``lane``) appends to a file of its own: ext4 serialises
    direct writes that extend a file, so writers sharing one would take turns.
    """

    def __init__(self, root: SpillRoot, dir_fd: int, tmp_name: str, options: WriteOptions):
        self._root = root
        self._dir_fd = dir_fd
        self._tmp_name = tmp_name
        self._segment_bytes = options.segment_bytes
        self._io_mode = options.io_mode
        self._lock = threading.Lock()
        self.files: list[DataFile] = []
        self.names: list[str] = []  # of the files, in the manifest; each holds chunks written to it
        self._lanes: dict[int, _Lane] = {}

    def allocate(self, nbytes: int, lane: int = 0) -> tuple[DataFile, str, int]:
        """Where writer ``lane``'s next ``nbytes`` go: (file, its name in the manifest, offset)."""
        with self._lock:
            current = self._lanes.get(lane)
            if current is None or (current.offset and current.offset + nbytes > self._segment_bytes):
                name = _segment_name(len(self.files))
                current = _Lane(create_data_file(self._dir_fd, name, self._io_mode), name)
                self.files.append(current.file)
                self.names.append(name)
                self._lanes[lane] = current
            offset = current.offset
            current.offset += nbytes
            return current.file, current.name, offset

    def next_path(self) -> Path:
        """Where the data file being created lies (for messages when creating it fails)."""
        return self._root.path / self._tmp_name / _segment_name(len(self.files))

    def path_of(self, name: str) -> Path:
        """Where data file ``name`` lies while it is being written."""
        return self._root.path / self._tmp_name / name

    @property
    def mode(self) -> str:
        if not self.files:
            return BUFFERED if self._io_mode == BUFFERED else DIRECT
        return DIRECT if all(f.mode == DIRECT for f in self.files) else BUFFERED

    def finish(self) -> None:
        for file in self.files:
            finish_write(file)

    def close(self) -> None:
        for file in self.files:
            file.close()
        self.files.clear()


def io_error(
    exc: OSError,
    root: SpillRoot,
    where: Path | None,
    *,
    written: int,
    reused: int,
    total: int,
    pending: int | None = None,
) -> StorageError:
    """The error a write that failed with ``exc`` reports: where, and for a full disk how far it got.

    ``written`` counts the bytes written whole, ``reused`` those referred to the previous snapshot so
    far (a re-sleep writes only what changed), ``total`` the snapshot's size, ``pending`` what the
    failed write was to add (None where no data was being written). So a re-sleep that had a few
    MiB to write says so, not that it had written nothing of the whole snapshot.
    """
    target = f" ({where})" if where is not None else ""
    if isinstance(exc, DirectIORefusedError):
        return StorageError(
            f"the filesystem of {root.path}{target} refuses direct I/O (O_DIRECT), which --io-mode direct "
            "requires; nothing was published and the process keeps its memory",
            hint="use --io-mode auto (it falls back to buffered I/O there) or --io-mode buffered",
        )
    if exc.errno == errno.ENOSPC:
        how_far = space_words(written, reused, total, pending)
        return StorageError(
            f"no space left on the device of {root.path}{target}{how_far}; "
            "nothing was published and the process keeps its memory",
            hint="free space or choose another --to directory, then sleep again",
        )
    return StorageError(
        f"I/O error writing the snapshot in {root.path}{target}: {exc.strerror or exc}; "
        "nothing was published and the process keeps its memory"
    )


def space_words(written: int, reused: int, total: int, pending: int | None) -> str:
    """How far a write that ran out of space got: `` for the next 4194304 bytes, after writing 0 of the
    snapshot's 25703936 bytes (21509632 of them reused from the previous snapshot so far)``."""
    wanted = f" for the next {pending} bytes," if pending else ""
    kept = f" ({reused} of them reused from the previous snapshot so far)" if reused else ""
    return f"{wanted} after writing {written} of the snapshot's {total} bytes{kept}"


def _staged_bytes(lengths: Sequence[int]) -> int:
    """About what chunks of these lengths take in the arenas: a small one packed (PACKED_ALIGNMENT), as
    a host chunk is, each run of them ending on a page; a larger one on pages of its own.

    What the staging is sized to (arena.arena_bytes_for), which is faulted in whole before the first
    write: at 100,000 chunks of 1 KiB, a page each counted 400 MB and faulted in the whole 256 MiB
    budget (0.1 s) for 110 MB. Small device chunks, staged a page each, are counted short, which
    only makes their arenas smaller: they take turns, as when the budget is smaller than the data.
    """
    packed = sum(align_up(n, PACKED_ALIGNMENT) if n <= _SMALL_COPY else align_up(n) for n in lengths)
    return packed + -(-len(lengths) // _BATCH_TASKS) * ALIGNMENT


def _tasks(sizes: Sequence[int], chunk: int) -> list[tuple[int, int, int]]:
    """Every chunk of the regions, in record order: (region index, offset, length), none for an empty
    region. Where no region is larger than a chunk (a model of many small tensors), each is one
    chunk, and the tuples are made by zip, without a Python loop: 60 ms at 100,000 regions."""
    if max(sizes, default=0) <= chunk:
        return list(filter(_LENGTH, zip(itertools.count(), itertools.repeat(0), sizes)))
    return [
        (index, offset, min(chunk, size - offset))
        for index, size in enumerate(sizes)
        for offset in range(0, size, chunk)
    ]


class Stream:
    """One spill's chunks through stagers, arenas and writers; the refs of every chunk at the end."""

    def __init__(
        self,
        regions: Sequence[Region],
        sizes: Sequence[int],
        segments: Segments,
        reusable: dict[tuple[str, int], ChunkRef],
        options: WriteOptions,
        tuning: Tuning,
        total: int,
        progress: ProgressFn | None,
        cancelled: CancelledFn | None,
        root: SpillRoot,
        kept: KeptStaging | None = None,
    ) -> None:
        chunk = options.effective_chunk_bytes
        self.tuning = tuning
        self._regions = regions
        self._segments = segments
        self._previous = reusable
        self._options = options
        self._total = total
        self._progress = progress
        self._cancelled = cancelled
        self._root = root
        self._kept = kept  # the process's staging kept between transfers
        self._chunk_bytes = chunk
        self._sizes = sizes
        self._tasks = _tasks(sizes, chunk)
        self._queue: Sequence[int] = range(len(self._tasks))  # the tasks this pass stages, in order
        # Each task ends up a ChunkRef, or the index of an earlier task with the same bytes.
        self._placed: list[ChunkRef | int | None] = [None] * len(self._tasks)
        self._owners: dict[tuple[str, int], int] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._done = 0
        self.written = 0
        self.reused = 0
        self.rewritten = 0
        self.staging_bytes = 0
        # Hashing in place first pays only when there is something to reuse.
        self._hash_in_place = bool(reusable)
        # For the reuse check (see reusecheck.ReuseCheck): every previous chunk reused, as it is
        # decided (an append per chunk reused, no more), a wakeup after each batch of them, and
        # the end of the decisions.
        self.marks: list[ChunkRef] = []
        self.news = threading.Event()
        self.decided = threading.Event()
        self._defer: Defer = copies_done_on_return  # the pool's, once a pass runs (pipeline.DeviceStaging)

    def run(self, pin: PinFn | None, budget: int, beside: Callable[[Pipeline], None] | None = None) -> None:
        """Stage, hash and write every task of this pass, within ``budget`` bytes of staging.

        ``beside`` starts more work in the same pipeline (the reuse check): the
        first failure of either stops both.
        """
        self._defer = deferral(pin)
        lengths = [self._tasks[task][2] for task in self._queue]
        largest = align_up(max(lengths, default=ALIGNMENT))
        arenas = arenas_for(self.tuning.io_depth, budget, largest)
        writers = min(self.tuning.io_depth, arenas - 1)  # arenas_for gives two at least
        stagers = self.tuning.workers
        arena = arena_bytes_for(budget, _staged_bytes(lengths), largest, arenas)
        pool = StagingPool(arenas * arena, arena, pin, kept=self._kept)
        pipeline = Pipeline()
        packer = Packer(pool, pipeline.abort)
        remaining = [stagers]

        def stage_then_close() -> None:
            """The last stager to finish passes on the last arena and stops the writers."""
            try:
                self._stage(packer, pipeline.abort)
            finally:
                with self._lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    self.decided.set()
                    packer.close(writers)

        try:
            if beside is not None:
                beside(pipeline)
            for n in range(writers):
                pipeline.start(f"write-{n}", functools.partial(self._write, packer, pool, pipeline.abort, n))
            for n in range(stagers):
                pipeline.start(f"stage-{n}", stage_then_close)
            pipeline.join()
        finally:
            pipeline.stop()
            self.staging_bytes = max(self.staging_bytes, pool.total_bytes)
            pool.close()

    def rewrite(self, failed: Sequence[ChunkRef], pin: PinFn | None, budget: int) -> None:
        """Stage and write again every task that was referred to one of the ``failed`` previous chunks.

        A second, small pass through the same machinery, once the reuse check
        found chunks the disk no longer holds. It reuses nothing of the previous
        snapshot (nothing it could reuse now was read back), so each of their
        tasks is copied from memory, checksummed and written, or referred to a
        task of this sleep that wrote the same bytes.
        """
        bad = set(map(id, failed))
        redo = [task for task, ref in enumerate(self._placed) if id(ref) in bad]
        self._previous = {}
        for task in redo:
            self._placed[task] = None
        again = sum(self._tasks[task][2] for task in redo)
        with self._lock:
            self.reused -= again
            self._done -= again
            written = self.written
        self._queue, self._next = redo, 0
        self.run(pin, budget)
        self.rewritten += self.written - written

    def resolve(self) -> list[ChunkRef]:
        """Every chunk's ref in record order (the tasks' order), a task with another's bytes given its ref."""
        placed = self._placed
        chunks = [ref if type(ref) is ChunkRef else placed[cast(int, ref)] for ref in placed]
        if not all(type(ref) is ChunkRef for ref in chunks):
            raise AssertionError("every chunk is placed once the pipeline finished cleanly")
        return cast("list[ChunkRef]", chunks)

    def counts(self) -> list[int]:
        """How many chunks each region has, in order (what the manifest's records.chunks holds): its
        size in chunks, rounded up, as _tasks cuts it (a loop over the tasks took 0.1 s at 100,000)."""
        chunk = self._chunk_bytes
        return [-(-size // chunk) for size in self._sizes]

    def io_error(self, exc: OSError, where: Path | None, pending: int | None = None) -> StorageError:
        """:func:`io_error` with how far this stream got."""
        with self._lock:
            written, reused = self.written, self.reused
        return io_error(
            exc, self._root, where, written=written, reused=reused, total=self._total, pending=pending
        )

    def _advance(self, wrote: int, reused: int) -> None:
        with self._lock:
            self._done += wrote + reused
            self.written += wrote
            self.reused += reused
            done = self._done
        if self._progress is not None:
            self._progress(done, self._total)

    def _take_tasks(self, abort: threading.Event) -> Sequence[int]:
        """The next run of tasks for one stager: up to _BATCH_TASKS chunks or _BATCH_BYTES bytes.

        Taken in runs, not one by one: with many small regions, a lock, a
        cancellation check and a progress report per chunk cost more than
        the chunk's copy and hash.
        """
        with self._lock:
            first = self._next
            if first >= len(self._queue) or abort.is_set():
                return range(0)
            last = min(len(self._queue), first + _BATCH_TASKS)
            nbytes = 0
            for at in range(first, last):
                nbytes += self._tasks[self._queue[at]][2]
                if nbytes >= _BATCH_BYTES:
                    last = at + 1
                    break
            self._next = last
            return self._queue[first:last]

    def _reuse(self, task: int, key: tuple[str, int], *, claim: bool) -> bool:
        """Refer ``task`` to a chunk with these bytes if there is one; else maybe claim the bytes.

        Without a lock: the index is only read, and ``setdefault`` claims
        atomically (one dict operation), so two stagers with the same bytes
        agree on which of them writes them.
        """
        previous = self._previous.get(key)
        if previous is not None:
            self._placed[task] = previous
            self.marks.append(previous)
            return True
        owner = self._owners.setdefault(key, task) if claim else self._owners.get(key)
        if owner is None or owner == task:
            return False
        self._placed[task] = owner
        return True

    def _stage(self, packer: Packer, abort: threading.Event) -> None:
        cancelled = self._cancelled
        while tasks := self._take_tasks(abort):
            if cancelled is not None and cancelled():
                raise AbortedError("the spill was called off before it finished; nothing was published")
            small: list[tuple[int, int, int]] = []
            copied: list[int] = []
            for task in tasks:
                index, offset, length = self._tasks[task]
                address = self._regions[index].host_address() if length <= _SMALL_COPY else None
                if address is not None:
                    small.append((task, address + offset, length))
                else:
                    copied.append(task)
            reused = self._stage_copied(packer, copied) if copied else 0
            if small:
                reused += self._stage_small(packer, small)
            if reused:
                self._advance(0, reused)  # written bytes count once the writer has written them
                self.news.set()

    def _stage_small(self, packer: Packer, chunks: list[tuple[int, int, int]]) -> int:
        """Stage a run of small host chunks (task, address, length); the bytes found already written once
        staged (those found in place, of which nothing is copied, are counted at once).

        Hashed in place and copied a run at a time (bulk.checksums and
        bulk.stage_at), not through the region's call per chunk; each checksum
        is of the staged copy, the very bytes written. A chunk is read at its
        region's host address (Region.host_address, asked once per chunk): a
        view of each region to copy from was a quarter of the staging at
        100,000 tensors. The process is paused, so its memory stays there.
        """
        reused = 0
        if self._hash_in_place:
            changed = []
            digests = bulk.checksums([memory_at(address, length) for _, address, length in chunks])
            found = 0
            for chunk, digest in zip(chunks, digests, strict=True):
                if self._reuse(chunk[0], (digest, chunk[2]), claim=False):
                    found += chunk[2]
                else:
                    changed.append(chunk)
            chunks = changed
            if found:  # counted before the changed chunks are staged: a write of theirs that fails says it
                self._advance(0, found)
                self.news.set()
        start = 0
        while start < len(chunks):
            arena, slots = packer.reserve([(task, length) for task, _, length in chunks[start:]])
            try:
                run = chunks[start : start + len(slots)]  # what fits in this arena
                digests = bulk.stage_at(
                    arena.buffer.view,
                    [slot.position for slot in slots],
                    [slot.padded for slot in slots],
                    [address for _, address, _ in run],
                    [length for _, _, length in run],
                )
                for slot, digest in zip(slots, digests, strict=True):
                    if not self._claim(slot, digest):
                        reused += slot.length
            finally:
                packer.finish(arena, slots)
            start += len(slots)
        return reused

    def _stage_copied(self, packer: Packer, tasks: list[int]) -> int:
        """Stage chunks through their regions' copies; the bytes found already written.

        Each chunk starts on a page, as one staged on its own always did. The
        chunks that fit in an arena are copied as one run: every copy queued
        (the pool's deferral: pipeline.DeviceStaging), then one wait, then each
        checksummed. Waiting for each copy of device memory cost a
        synchronization per region, 100,000 for as many small tensors; the
        other stagers hash their runs while this one waits. Host chunks are
        hashed in place first where that may find them written already.
        """
        reused = 0
        if self._hash_in_place:
            changed = []
            for task in tasks:
                index, offset, length = self._tasks[task]
                in_place = self._regions[index].host_view(offset, length)
                if in_place is not None and self._reuse(task, (checksum(in_place), length), claim=False):
                    reused += length
                else:
                    changed.append(task)
                del in_place
            tasks = changed
        start = 0
        while start < len(tasks):
            arena, slots = packer.reserve([(task, self._tasks[task][2]) for task in tasks[start:]], ALIGNMENT)
            try:
                with self._defer() as queued:
                    for slot in slots:
                        index, offset, length = self._tasks[slot.task]
                        at = slot.position
                        self._regions[index].copy_out(offset, arena.buffer.view[at : at + length])
                if queued.fence is not None:
                    queued.fence.wait()
                for slot in slots:
                    if not self._hash_staged(arena.buffer.view, slot):
                        reused += slot.length
            finally:
                packer.finish(arena, slots)
            start += len(slots)
        return reused

    def _hash_staged(self, buffer: memoryview, slot: Slot) -> bool:
        """A chunk copied into its slot: pad it to its page, checksum it, and say whether it is written."""
        end = slot.position + slot.length
        if slot.padded > slot.length:
            buffer[end : slot.position + slot.padded] = _ZEROS[: slot.padded - slot.length]
        return self._claim(slot, checksum(buffer[slot.position : end]))

    def _claim(self, slot: Slot, digest: str) -> bool:
        """Record a staged chunk's checksum; whether it is written (live), not found written already.

        The checksum is of the staged copy, the very bytes the writer writes.
        """
        slot.digest = digest
        slot.live = not self._reuse(slot.task, (digest, slot.length), claim=True)
        return slot.live

    def _write(self, packer: Packer, pool: StagingPool, abort: threading.Event, lane: int) -> None:
        while True:
            arena = take(packer.sealed, abort)
            if arena is None:
                return
            try:
                while not arena.filled.wait(0.05):
                    if abort.is_set():
                        raise PipelineAbortedError()
                if abort.is_set():
                    raise PipelineAbortedError()
                self._write_arena(arena, lane)
            finally:
                pool.give(arena.buffer)

    def _write_arena(self, arena: Arena, lane: int) -> None:
        spans, live = arena.live_spans()
        if not live:
            return
        size = sum(end - start for start, end in spans)
        views = [arena.buffer.view[start:end] for start, end in spans]
        try:
            file, name, offset = self._segments.allocate(size, lane)
        except OSError as exc:
            raise self.io_error(exc, self._segments.next_path(), size) from exc
        try:
            write_views(file, views, offset)
        except OSError as exc:
            raise self.io_error(exc, self._segments.path_of(name), size) from exc
        # The spans lie back to back in the file from ``offset``.
        placed = self._placed
        for slot, at in live:
            placed[slot.task] = ChunkRef(name, offset + at, slot.length, slot.digest)
        self._advance(sum(slot.length for slot, _ in live), 0)
