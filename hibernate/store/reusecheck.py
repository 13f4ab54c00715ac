"""Read back, before a re-sleep releases anything, the chunks of the previous snapshot it reuses.

A re-sleep refers to a chunk of the previous snapshot instead of writing it
again when the process still holds the same bytes (equal checksum) and the
file that holds them is the very file the last wake read (its identity, see
manifest.FileIdentity, is unchanged). The identity proves that nobody changed
the file through the filesystem; it proves nothing of the medium. Bytes that
change below the filesystem (a failing sector, a write to the block device or
to a disk image) leave the identity as it was, and a re-sleep that trusted
them would release memory that no wake can bring back. So every reused chunk
is read back and checked against its recorded checksum before anything is
published; the writer writes one that no longer matches, or cannot be read,
again from memory (see writer._write_locked).

The check runs beside the stream that hashes the process's memory, so that an
unchanged re-sleep costs about the larger of reading the reused bytes and
hashing the memory, not their sum:

* the stream hands over, batch by batch, the previous chunks it has decided
  to reuse (``marks``; ``news`` is set after each batch, ``decided`` once
  every chunk is decided);
* the previous chunks, in file order, are cut into blocks of up to one read
  request, as a wake reads them; a block all of whose chunks are reused is
  read whole as soon as the stream has said so, so an unchanged re-sleep
  reads its files sequentially, in large requests, right behind the stream;
* once every chunk is decided, each remaining block is read for the chunks in
  it that are reused, and only those: a mostly changed model pays reads only
  for what it reuses.

One thread reads (direct I/O where the filesystem allows it, as a wake does)
while another checks what was read (bulk.verify_copy_at, without the GIL
where the compiled helper is built). Their staging is two buffers of one
request each, allocated as needed, and counts in the sleep's staging budget
(see plan_staging).
"""

from __future__ import annotations

import heapq
import itertools
import operator
import queue
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from hibernate.errors import AbortedError
from hibernate.store import bulk
from hibernate.store.arena import ARENAS
from hibernate.store.directio import (
    DataFile,
    KeptStaging,
    PipelineAbortedError,
    StagingBuffer,
    StagingPool,
    open_data_file,
    read_views,
    take,
)
from hibernate.store.manifest import ALIGNMENT, ChunkRef, align_up
from hibernate.store.pipeline import Pipeline

# One read request (or one chunk's pages, if larger), as a wake's (see readplan._READ_REQUEST_BYTES).
# Half of it measured slower on the 2-core VM while the stream hashed beside the reads: 1.5-1.9
# GB/s against 1.9-2.4 (512 MiB in tensors of 8 MiB).
READ_REQUEST_BYTES = 32 << 20
# After the stream has decided, the reused chunks of a block are read in runs; a run reads
# through a gap of chunks it does not reuse up to this size rather than pay one more request
# (a request costs a fixed latency, about what the disk reads of this many bytes meanwhile).
GAP_BYTES = 128 << 10
# Host chunks up to this size are packed at any 64-byte boundary (stream._SMALL_COPY), so their
# pages may reach one page past their rounded-up length; larger chunks start on a page.
_PACKED_UP_TO = 256 << 10


def pages_bound(largest_chunk: int) -> int:
    """The most pages (in bytes) a chunk of at most ``largest_chunk`` bytes can lie in."""
    return align_up(largest_chunk) + (ALIGNMENT if largest_chunk <= _PACKED_UP_TO else 0)


@dataclass(frozen=True)
class Plan:
    """The chunks to check, in file order, and the blocks they are read in.

    ``refs[p]`` is the chunk at position ``p``; ``firsts``/``stops`` are
    where its pages start and end; block ``b`` holds positions
    ``starts[b]`` up to ``starts[b + 1]`` (the last one up to the end).
    """

    refs: list[ChunkRef]
    offsets: list[int]
    lengths: list[int]
    checksums: str
    firsts: list[int]
    stops: list[int]
    starts: list[int]

    @classmethod
    def of(cls, refs: Iterable[ChunkRef], request_bytes: int) -> Plan:
        ordered = sorted(refs)  # by file, then offset: no two chunks of the index share both
        if not ordered:
            return cls([], [], [], "", [], [], [])
        # A column at a time: zip(*ordered) takes a hundred thousand arguments, and took 0.1 s.
        files, offsets, lengths, checksums = (list(map(operator.itemgetter(n), ordered)) for n in range(4))
        firsts = [offset - offset % ALIGNMENT for offset in offsets]
        stops = [align_up(offset + length) for offset, length in zip(offsets, lengths, strict=True)]
        return cls(
            ordered,
            offsets,
            lengths,
            "".join(checksums),
            firsts,
            stops,
            block_starts(files, firsts, stops, request_bytes),
        )

    @property
    def blocks(self) -> int:
        return len(self.starts)

    def block(self, index: int) -> range:
        end = self.starts[index + 1] if index + 1 < len(self.starts) else len(self.refs)
        return range(self.starts[index], end)

    def largest_pages(self) -> int:
        return max(map(operator.sub, self.stops, self.firsts), default=ALIGNMENT)


def block_starts(files: Sequence[str], firsts: Sequence[int], stops: Sequence[int], size: int) -> list[int]:
    """Where each block starts: a block holds chunks of one file whose pages follow on from each
    other (or share one), spanning at most ``size`` bytes (or one chunk, if larger)."""
    starts: list[int] = []
    file, begin, end = "", -1, -1
    for position, (name, first, stop) in enumerate(zip(files, firsts, stops, strict=True)):
        if name != file or first > end or max(end, stop) - begin > size:
            starts.append(position)
            file, begin, end = name, first, stop
        elif stop > end:
            end = stop
    return starts


@dataclass(frozen=True)
class Read:
    """One request: ``size`` bytes at ``offset`` of ``file``, holding the chunks ``group`` (positions)."""

    file: str
    offset: int
    size: int
    group: list[int]


def whole_block(plan: Plan, block: int) -> Read:
    """The one request that reads every chunk of ``block`` (in C, not a step per chunk)."""
    positions = plan.block(block)
    first = plan.firsts[positions.start]
    end = max(plan.stops[positions.start : positions.stop])
    return Read(plan.refs[positions.start].file, first, end - first, list(positions))


def reads_of(plan: Plan, positions: Sequence[int], request_bytes: int) -> list[Read]:
    """The requests that read the chunks at ``positions`` (sorted, all in one block) and little else.

    Neighbours are read together; a gap of up to GAP_BYTES between them is read
    through rather than split into two requests.
    """
    reads: list[Read] = []
    file = ""
    begin = end = -1
    group: list[int] = []
    for position in positions:
        ref = plan.refs[position]
        first, stop = plan.firsts[position], plan.stops[position]
        if (
            group
            and ref.file == file
            and first <= end + GAP_BYTES
            and max(end, stop) - begin <= request_bytes
        ):
            group.append(position)
            end = max(end, stop)
            continue
        if group:
            reads.append(Read(file, begin, end - begin, group))
        file, begin, end, group = ref.file, first, stop, [position]
    if group:
        reads.append(Read(file, begin, end - begin, group))
    return reads


@dataclass
class CheckFindings:
    """What the check found: the reused chunks the disk no longer holds, and what it read."""

    failed: list[ChunkRef] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)  # by file: the first thing that went wrong
    read_bytes: int = 0
    staging_bytes: int = 0


class ReuseCheck:
    """Check the reused chunks of ``candidates`` (the writer's reuse index) against the disk.

    ``marks``: the chunks the stream reuses, appended as it decides (a chunk
    may appear more than once); ``news`` is set after each batch of marks and
    ``decided`` once there will be no more. The files are opened in
    ``dir_fd`` (the new snapshot's directory, which holds links to them).
    """

    def __init__(
        self,
        dir_fd: int,
        candidates: Iterable[ChunkRef],
        marks: list[ChunkRef],
        news: threading.Event,
        decided: threading.Event,
        *,
        io_mode: str,
        cancelled: Callable[[], bool] | None = None,
        kept: KeptStaging | None = None,
    ) -> None:
        self._dir_fd = dir_fd
        self._kept = kept  # the process's staging kept between transfers (directio.KeptStaging)
        self._candidates = list(candidates)
        self._marks = marks
        self._news = news
        self._decided = decided
        self._io_mode = io_mode
        self._cancelled = cancelled
        self._files: dict[str, DataFile | OSError] = {}
        self._pool: StagingPool | None = None
        self._lock = threading.Lock()
        self.outcome = CheckFindings()

    def start(self, pipeline: Pipeline, budget: int, request_bytes: int) -> None:
        """Start reading and checking in ``pipeline``'s threads, with ``budget`` bytes of staging.

        The plan is made by the reading thread, beside the stream, not before it
        starts. Call :meth:`close` once the pipeline has been joined.
        """
        loaded: queue.Queue[tuple[Read, StagingBuffer, int] | None] = queue.Queue()
        planned: list[Plan] = []  # made by the reader; the checker waits for it
        made = threading.Event()

        def read() -> None:
            try:
                plan = Plan.of(self._candidates, request_bytes)
                self._candidates = []
                size = max(request_bytes, plan.largest_pages())
                self._pool = pool = StagingPool(
                    max(budget, 2 * size), size, lazy=True, huge=True, kept=self._kept
                )
                planned.append(plan)
                made.set()
                for request in self._requests(plan, pipeline.abort, size):
                    self._read(plan, pool, request, loaded, pipeline.abort)
            finally:
                made.set()
                loaded.put(None)

        def check() -> None:
            while not made.wait(0.05):
                if pipeline.abort.is_set():
                    return
            if planned and self._pool is not None:  # else the reader failed before it had a plan
                # The buffers are faulted in here, the first while the stream decides the first
                # block, the second while the first is read (see reader.SnapshotReader._fault_in).
                self._pool.prefill(2)
                self._check_loaded(planned[0], self._pool, loaded, pipeline.abort)

        pipeline.start("reuse-read", read)
        pipeline.start("reuse-check", check)

    def run(self, budget: int, request_bytes: int) -> None:
        """Check on its own (the stream has finished): its own threads, the first failure raised."""
        pipeline = Pipeline()
        self.start(pipeline, budget, request_bytes)
        try:
            pipeline.join()
        finally:
            pipeline.stop()
            self.close()

    def close(self) -> None:
        """Free the staging and close the files (once no thread of the check runs)."""
        if self._pool is not None:
            self.outcome.staging_bytes = self._pool.total_bytes
            self._pool.close()
            self._pool = None
        for file in self._files.values():
            if isinstance(file, DataFile):
                file.close()
        self._files.clear()

    # -- reading ---------------------------------------------------------------------------

    def _read(
        self,
        plan: Plan,
        pool: StagingPool,
        request: Read,
        loaded: queue.Queue[tuple[Read, StagingBuffer, int] | None],
        abort: threading.Event,
    ) -> None:
        """Read one request into a free buffer and pass it on; a file that cannot be read fails its chunks."""
        if self._cancelled is not None and self._cancelled():
            raise AbortedError("the spill was called off before it finished; nothing was published")
        buffer = pool.take(abort)
        try:
            got = self._read_request(request, buffer)
        except OSError as exc:
            pool.give(buffer)
            self._failed(plan, request.group, request.file, exc.strerror or str(exc))
            return
        except BaseException:
            pool.give(buffer)
            raise
        with self._lock:
            self.outcome.read_bytes += got
        loaded.put((request, buffer, got))

    def _read_request(self, request: Read, buffer: StagingBuffer) -> int:
        file = self._files.get(request.file)
        if file is None:
            try:
                # The disk's bytes, not a cached copy of them: the new snapshot will refer to them.
                file = open_data_file(self._dir_fd, request.file, self._io_mode, page_cache=False)
            except OSError as exc:
                file = exc  # each of its requests fails the same way, without trying again
            self._files[request.file] = file
        if isinstance(file, OSError):
            raise file
        return read_views(file, [buffer.view[: request.size]], request.offset)

    def _requests(self, plan: Plan, abort: threading.Event, request_bytes: int) -> Iterator[Read]:
        """The reads, in the order the stream's decisions allow (see the module's docstring).

        Every chunk the stream reuses is in exactly one of them, which is
        checked once every chunk is decided.
        """
        position = dict(zip(map(id, plan.refs), itertools.count()))
        sizes = [len(plan.block(block)) for block in range(plan.blocks)]
        block_of = list(itertools.chain.from_iterable(map(itertools.repeat, range(plan.blocks), sizes)))
        remaining = list(sizes)  # chunks of each block not yet known to be reused
        known: set[int] = set()
        ready: list[int] = []  # blocks every chunk of which is reused, lowest first
        pending = set(range(plan.blocks))  # blocks not read yet
        seen = covered = 0

        def take_marks() -> None:
            nonlocal seen
            count = len(self._marks)
            fresh = set(map(position.__getitem__, map(id, self._marks[seen:count]))) - known
            seen = count
            known.update(fresh)
            for block, found in Counter(map(block_of.__getitem__, fresh)).items():
                remaining[block] -= found
                if remaining[block] == 0:
                    heapq.heappush(ready, block)

        while pending:
            decided = self._decided.is_set()  # asked before the marks are taken: none is missed
            self._news.clear()
            take_marks()
            if ready:
                block = heapq.heappop(ready)
                pending.discard(block)
                request = whole_block(plan, block)
                covered += len(request.group)
                yield request
                continue
            if decided:
                for block in sorted(pending):
                    used = [p for p in plan.block(block) if p in known]
                    for request in reads_of(plan, used, request_bytes):
                        covered += len(request.group)
                        yield request
                break
            while not self._news.wait(0.05):
                if abort.is_set():
                    raise PipelineAbortedError()
                if self._decided.is_set():
                    break
        if covered != len(known):
            raise AssertionError(f"{len(known)} reused chunks, {covered} of them read back")

    # -- checking --------------------------------------------------------------------------

    def _check_loaded(
        self,
        plan: Plan,
        pool: StagingPool,
        loaded: queue.Queue[tuple[Read, StagingBuffer, int] | None],
        abort: threading.Event,
    ) -> None:
        zeros: list[int] = []  # a target of 0 for every position: verify, copy nothing
        while True:
            item = take(loaded, abort)
            if item is None:
                return
            request, buffer, got = item
            try:
                if not zeros:
                    zeros = [0] * len(plan.refs)
                self._verify(plan, request, buffer.view, got, zeros)
            finally:
                pool.give(buffer)

    def _verify(self, plan: Plan, request: Read, view: memoryview, got: int, zeros: list[int]) -> None:
        group = request.group
        while group:
            failed, truncated = bulk.verify_copy_at(
                view, request.offset, got, group, plan.offsets, plan.lengths, plan.checksums, zeros
            )
            if failed < 0:
                break
            if truncated:
                self._failed(plan, group[failed:], request.file, "the file ends before them")
                break
            self._failed(plan, [group[failed]], request.file, "checksum mismatch")
            group = group[failed + 1 :]

    def _failed(self, plan: Plan, positions: Sequence[int], file: str, problem: str) -> None:
        with self._lock:
            self.outcome.failed.extend(map(plan.refs.__getitem__, positions))
            self.outcome.problems.setdefault(file, problem)


@dataclass(frozen=True)
class StagingPlan:
    """How a re-sleep shares its staging budget between the stream and the reuse check beside it."""

    stream_bytes: int  # the stream's arenas
    check_bytes: int  # the check's read buffers; 0: the check runs after the stream, with the whole budget
    request_bytes: int  # one read of the check


def plan_staging(buffer_bytes: int, largest_task: int, largest_reused: int) -> StagingPlan:
    """Share ``buffer_bytes`` between the stream (two arenas of at least its largest chunk) and the
    reuse check beside it (two buffers of one read request: at least one chunk's pages).

    A check's request is READ_REQUEST_BYTES, or an eighth of the budget if less, or the largest
    chunk's pages if more: with the default 256 MiB and 32 MiB chunks it takes 64 MiB, and the
    stream's arenas stay large. Where both do not fit (a budget of about four chunks or less),
    the check runs after the stream with the whole budget, and the sleep costs the sum of its
    reading and hashing rather than the larger.
    """
    least = pages_bound(largest_reused)
    request = max(least, min(READ_REQUEST_BYTES, buffer_bytes // 8 // ALIGNMENT * ALIGNMENT))
    if buffer_bytes - ARENAS * request >= ARENAS * align_up(largest_task):
        return StagingPlan(buffer_bytes - ARENAS * request, ARENAS * request, request)
    alone = max(least, min(READ_REQUEST_BYTES, buffer_bytes // ARENAS // ALIGNMENT * ALIGNMENT))
    return StagingPlan(buffer_bytes, 0, alone)
