"""Read a snapshot back: validate everything first, then stream and verify every chunk.

A reader refuses before any memory is touched whatever can be found wrong
without reading the data (manifest, missing or truncated or symlinked files, a
record that does not match the process). Data is then read with direct I/O
into bounded staging, and each chunk's checksum is verified *before* its bytes
are copied into the region: a corrupted weight is never handed back.

Chunks are read in file order, and chunks that lie back to back in a file are
read with one request of up to 32 MiB (or one chunk, if larger: readplan.py),
into staging buffers allocated as needed. One or two reader threads keep the
requests in flight (``io_depth``: one on a local disk; eight on a network or
FUSE filesystem, where each request waits a round trip, as pieces of each
reader's request: see tuning.py and directio.ParallelReads); workers verify
and copy meanwhile; another thread faults the destination memory in a step
ahead of them.
"""

from __future__ import annotations

import bisect
import errno
import operator
import os
import queue
import stat
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from hibernate.errors import (
    AbortedError,
    BusyError,
    PermissionDeniedError,
    SnapshotInvalidError,
    StorageError,
)
from hibernate.fsutil import open_dir
from hibernate.gcpause import gc_paused
from hibernate.store import bulk
from hibernate.store.directio import (
    CACHED,
    DIRECT,
    DataFile,
    DirectIORefusedError,
    KeptStaging,
    ParallelReads,
    StagingBuffer,
    StagingPool,
    follow_page_cache,
    open_data_file,
    populate,
    read_views,
)
from hibernate.store.hugepages import huge_pages_pay_off
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import (
    Columns,
    Manifest,
    Record,
    WrittenRecords,
    meta_text,
    plain_meta,
)
from hibernate.store.parse import check_meta
from hibernate.store.pipeline import CancelledFn, Defer, PinFn, Pipeline, ProgressFn, deferral
from hibernate.store.readplan import (
    Request,
    chunk_addresses,
    destinations,
    plan_reads,
    worker_groups,
)
from hibernate.store.regions import Region
from hibernate.store.tuning import Tuning, choose

# Regions smaller than this are not faulted in ahead of the copies (see _to_populate).
_POPULATE_MIN_BYTES = 64 << 10
# Reader threads, each with a staging buffer: more requests in flight than this are pieces of
# their requests (directio.ParallelReads), so deep queues need no more staging.
_READERS = 2


@dataclass
class ReadResult:
    snapshot: str
    total_bytes: int
    seconds: float
    io_mode: str
    staging_bytes: int
    tuning: Tuning | None = None  # what the read ran with (None: nothing was read)

    def to_wire(self) -> dict[str, Any]:
        return {
            "snapshot": self.snapshot,
            "total_bytes": self.total_bytes,
            "seconds": round(self.seconds, 6),
            "io_mode": self.io_mode,
            "staging_bytes": self.staging_bytes,
            "tuning": self.tuning.to_wire() if self.tuning is not None else None,
        }


def _first_difference(saved: Any, live: Any, path: str) -> str | None:
    """Where two plain-JSON values first differ, as ``path is X in the snapshot, Y in the process``."""
    if isinstance(saved, Mapping) and isinstance(live, Mapping):
        for name in sorted(set(saved) | set(live), key=str):
            found = _first_difference(
                saved.get(name), live.get(name), f"{path}.{name}" if path else str(name)
            )
            if found is not None:
                return found
        return None
    if isinstance(saved, list) and isinstance(live, list) and len(saved) == len(live):
        for index, (a, b) in enumerate(zip(saved, live, strict=True)):
            found = _first_difference(a, b, f"{path}[{index}]")
            if found is not None:
                return found
        return None
    if saved != live or type(saved) is not type(live):
        return f"{path} is {saved!r} in the snapshot, {live!r} in the process"
    return None


def _describe_mismatch(record: _Described, region: Region, where: str) -> str | None:
    """What differs between a record and its region, or None; refuses a record's meta that breaks the rules.

    Meta is checked here, not when the manifest is parsed: equal to the
    process's own, it is as plain as that (its pool built it plain, or the
    writer checked it); one that differs is checked before it is walked to
    say where.
    """
    if record.key != region.key:
        return f"holds {record.key!r} where the process has {region.key!r}"
    if record.tag != region.tag:
        return f"{record.key!r}: tag {record.tag!r} in the snapshot, {region.tag!r} in the process"
    if record.nbytes != region.nbytes:
        return f"{record.key!r}: {record.nbytes} bytes in the snapshot, {region.nbytes} in the process"
    if record.meta == region.meta:
        return None
    check_meta(record.meta, f"{where} ({record.key!r})")
    difference = _first_difference(dict(record.meta), plain_meta(region.meta), "")
    return f"{record.key!r}: {difference}" if difference is not None else None


class _Described(NamedTuple):
    """What a record says of its region: what a wake compares with the process."""

    key: str
    tag: str
    nbytes: int
    meta: Mapping[str, Any]


_KEY_TAG_SIZE = operator.attrgetter("key", "tag", "nbytes")
_NBYTES = operator.attrgetter("nbytes")


def _as_written(columns: Columns, written: WrittenRecords, regions: Sequence[Region]) -> bool:
    """Whether a snapshot's records are those ``written`` says were written, at the regions' sizes."""
    return (
        columns.stored_meta_text == written.meta_text
        and columns.sizes == written.sizes
        and columns.keys == written.keys
        and columns.tags == written.tags
        and list(map(_NBYTES, regions)) == columns.sizes
    )


@dataclass
class _Loaded:
    """A request's bytes in a staging buffer, shared by the workers that verify its pieces."""

    request: Request
    buffer: StagingBuffer
    got: int
    remaining: int


@dataclass
class _Transfer:
    """What the threads of one read_into share: the plan and staging, and what passes between them."""

    regions: Sequence[Region]
    requests: list[Request]
    pool: StagingPool
    workers: int
    readers: int
    total: int
    progress: ProgressFn | None
    cancelled: CancelledFn | None
    defer: Defer  # brackets a group's device copies (pipeline.DeviceStaging)
    pipeline: Pipeline = field(default_factory=Pipeline)
    loaded: queue.Queue[tuple[_Loaded, list[int]] | None] = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: int = 0  # bytes verified and copied in, under ``lock``
    next_request: int = 0  # the index of the next request a reader takes, under ``lock``
    readers_left: int = 0  # readers still reading, under ``lock``: the last one stops the workers
    pieces: ParallelReads | None = None  # where more requests are in flight than readers
    reading: threading.Event = field(default_factory=threading.Event)  # the reader has its first buffer
    # Every chunk's destination is known (see SnapshotReader._fault_in).
    placed: threading.Event = field(default_factory=threading.Event)


def _to_populate(
    requests: Sequence[Request], regions: Sequence[Region], regions_of: Sequence[int]
) -> list[memoryview]:
    """The host memory of the regions to fault in ahead of the copies, in the order the requests reach them.

    Small regions are left to fault as they are copied into: one system call
    each would cost more than the faults it saves (a wake of 100,000 tensors).
    """
    order: dict[int, memoryview] = {}
    for request in requests:
        for chunk in request.chunks:
            index = regions_of[chunk]
            region = regions[index]
            if region.nbytes >= _POPULATE_MIN_BYTES and index not in order:
                view = region.host_view(0, region.nbytes)
                if view is not None and not view.readonly:
                    order[index] = view
    return list(order.values())


class SnapshotReader:
    """A published snapshot opened for reading (shared lock on its root)."""

    def __init__(self, root: SpillRoot, name: str, *, io_mode: str = "auto", page_cache: bool = True) -> None:
        """``page_cache``: read a file mostly in memory already through the page cache (CACHED), as
        any read of the bytes may; not a check of what the disk holds (verify_snapshot)."""
        self.root = root
        self._page_cache = page_cache and io_mode != DIRECT
        if not root.lock(exclusive=False):
            raise BusyError(f"{root.path} is being written or collected by another hibernate")
        self._files: dict[str, DataFile] = {}
        # The regions check_matches last accepted, as they were then: a list changed in between
        # is checked again, since the copies go to the addresses of the regions it holds.
        self._matched: tuple[Region, ...] | None = None
        # Each chunk's region and offset in it, by chunk index (see readplan.destinations), once reading.
        self._regions_of: Sequence[int] = ()
        self._region_offsets: Sequence[int] = ()
        self._targets: list[int] = []  # see readplan.chunk_addresses
        self._all_host = True
        try:
            self.manifest: Manifest = root.read_manifest(name)
            self._open_files(io_mode)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()
        self.root.unlock()

    @property
    def io_mode(self) -> str:
        """How the data files are read: direct, buffered or cached; their modes joined by "+" where
        they differ (``cached+direct``: a snapshot partly in the page cache)."""
        modes = sorted({file.mode for file in self._files.values()})
        return "+".join(modes) if modes else DIRECT

    def __enter__(self) -> SnapshotReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open_files(self, io_mode: str) -> None:
        chunks = self.manifest.columns.chunks
        ends = list(map(operator.add, chunks.offsets, chunks.lengths))
        needed: dict[str, int] = {}
        if len(set(chunks.files)) == 1:
            needed[chunks.files[0]] = max(ends)
        else:
            for name, end in zip(chunks.files, ends, strict=True):
                if end > needed.get(name, 0):
                    needed[name] = end
        directory = self.manifest.snapshot
        try:
            dir_fd = open_dir(directory, dir_fd=self.root.fd)
        except FileNotFoundError as exc:
            raise SnapshotInvalidError(f"{self.root.path / directory} is missing") from exc
        except PermissionDeniedError as exc:
            raise SnapshotInvalidError(
                f"{self.root.path / directory} is a symbolic link or not a directory; refusing to follow it"
            ) from exc
        except PermissionError as exc:
            raise StorageError(f"cannot open {self.root.path / directory}: permission denied") from exc
        try:
            for name, end in sorted(needed.items()):
                self._open_file(dir_fd, name, end, io_mode)
        finally:
            os.close(dir_fd)

    def _key_needing(self, name: str, end: int) -> str:
        """The key of a record with a chunk in file ``name`` that ends at ``end`` (for a refusal)."""
        columns = self.manifest.columns
        chunks = columns.chunks
        for index, (file, offset, length) in enumerate(
            zip(chunks.files, chunks.offsets, chunks.lengths, strict=True)
        ):
            if file == name and offset + length == end:
                return columns.keys[bisect.bisect_right(columns.first_chunks(), index) - 1]
        raise AssertionError(f"no chunk of {name} ends at {end}")

    def _open_file(self, dir_fd: int, name: str, end: int, io_mode: str) -> None:
        path = self.root.path / self.manifest.snapshot / name
        try:
            data = open_data_file(dir_fd, name, io_mode, page_cache=self._page_cache)
        except DirectIORefusedError as exc:
            raise StorageError(
                f"the filesystem of {path} refuses direct I/O (O_DIRECT), which --io-mode direct requires",
                hint="use --io-mode auto (it falls back to buffered I/O there) or --io-mode buffered",
            ) from exc
        except FileNotFoundError as exc:
            raise SnapshotInvalidError(
                f"{path} is missing (needed by {self._key_needing(name, end)!r})"
            ) from exc
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SnapshotInvalidError(
                    f"{path} is a symbolic link; refusing to follow it out of the snapshot"
                ) from exc
            raise StorageError(f"cannot open {path}: {exc.strerror}") from exc
        self._files[name] = data
        info = os.fstat(data.fd)
        if not stat.S_ISREG(info.st_mode):
            raise SnapshotInvalidError(f"{path} is not a regular file")
        if info.st_size < end:
            raise SnapshotInvalidError(
                f"{path} is truncated: {info.st_size} bytes, but {self._key_needing(name, end)!r} needs {end}"
            )

    def check_matches(self, regions: Sequence[Region], *, written: WrittenRecords | None = None) -> None:
        """The snapshot must describe exactly these regions, in this order.

        ``written``: what the caller's own sleep wrote of these very regions
        (WrittenRecords.of its manifest's columns), as an agent keeps it. The
        snapshot's records are then compared with that, list by list, and only
        the sizes with the regions themselves: the sizes are what the copies'
        bounds rest on, so they never depend on the caller's word (7 ms at
        100,000 regions, where the whole comparison below took 0.15 s).

        Otherwise, or where they differ, all records are compared with the
        regions at once (tuples compared in C, 1 us a record where one
        comparison each cost 40); only when they differ is each record looked
        at, to say where. The meta is first compared as text: a format-4
        manifest stores it as the text :func:`meta_text` makes, so the
        process's, encoded the same way, is the same text unless something
        differs, and the stored one need not be parsed at all. Where the
        texts differ (or a format-3 manifest holds values), the values are
        compared. Equal meta has the process's own depth and values, which
        the writer checked when it wrote them; the meta of a record that
        differs is checked before it is described.
        """
        columns = self.manifest.columns
        where = self.root.path / self.manifest.snapshot / "manifest.json"
        if len(columns.keys) != len(regions):
            raise SnapshotInvalidError(
                f"{where}: {len(columns.keys)} records in the snapshot, {len(regions)} regions in the process"
            )
        with gc_paused():
            same = written is not None and _as_written(columns, written, regions)
            if not same:
                same = list(zip(columns.keys, columns.tags, columns.sizes, strict=True)) == list(
                    map(_KEY_TAG_SIZE, regions)
                )
                if same:
                    live = [region.meta for region in regions]
                    text = columns.stored_meta_text
                    same = (text is not None and text == meta_text(live)) or columns.metas == live
        if not same:
            records = zip(columns.keys, columns.tags, columns.sizes, columns.metas, strict=True)
            for index, (record, region) in enumerate(zip(records, regions, strict=True)):
                problem = _describe_mismatch(_Described(*record), region, f"{where}: record {index}")
                if problem is not None:
                    raise SnapshotInvalidError(f"{where}: record {index} {problem}")
        self._matched = tuple(regions)

    def read_into(
        self,
        regions: Sequence[Region],
        *,
        buffer_bytes: int = 256 << 20,
        threads: int | None = None,
        io_depth: int | None = None,
        progress: ProgressFn | None = None,
        cancelled: CancelledFn | None = None,
        pin: PinFn | None = None,
        kept: KeptStaging | None = None,
    ) -> ReadResult:
        """Fill every region from the snapshot, verifying each chunk before it is copied in.

        ``threads`` workers verify and copy while ``io_depth`` more threads
        read ahead, each with one request in flight (None: chosen from the
        machine and the snapshot's filesystem, see tuning.py); the staging
        memory is at most ``buffer_bytes`` (or two of the snapshot's largest
        chunks if that is more), and no more than the snapshot needs; buffers
        are allocated as the reads need them. On any failure the regions hold
        partial data: the caller releases them again. Regions
        :meth:`check_matches` already accepted (the same sequence, unchanged
        since) are not compared again. ``kept``: the process's staging
        kept between transfers, taken from and given back to (KeptStaging).
        """
        if self._page_cache:  # asked again: the destination's memory may have pushed the files out since
            for file in self._files.values():
                follow_page_cache(file)
        in_memory = bool(self._files) and all(file.mode == CACHED for file in self._files.values())
        tuning = choose(self.root.fd, io_depth=io_depth, workers=threads, in_memory=in_memory)
        with gc_paused():  # one object per chunk below: see gc_paused
            return self._read_into(regions, buffer_bytes, tuning, progress, cancelled, pin, kept)

    def _read_into(
        self,
        regions: Sequence[Region],
        buffer_bytes: int,
        tuning: Tuning,
        progress: ProgressFn | None,
        cancelled: CancelledFn | None,
        pin: PinFn | None,
        kept: KeptStaging | None,
    ) -> ReadResult:
        if self._matched != tuple(regions):  # the caller may have checked them already
            self.check_matches(regions)
        started = time.perf_counter()
        self._regions_of, self._region_offsets = destinations(self.manifest.columns)
        unread = [isinstance(region, Unread) for region in regions]
        wanted = [not unread[index] for index in self._regions_of] if any(unread) else None
        # Each reader holds a buffer, and at least one more is being verified meanwhile.
        plan = plan_reads(
            self.manifest.columns.chunks, buffer_bytes, min(tuning.io_depth, _READERS) + 1, wanted
        )
        total = self.manifest.total_bytes
        if wanted is not None:
            total = sum(region.nbytes for region, left in zip(regions, unread, strict=True) if not left)
        pool = StagingPool(plan.staging_bytes, plan.request_bytes, pin, lazy=True, huge=True, kept=kept)
        readers = max(1, min(tuning.io_depth, _READERS, len(plan.requests)))
        transfer = _Transfer(
            regions, plan.requests, pool, tuning.workers, readers, total, progress, cancelled, deferral(pin)
        )
        try:
            self._run(transfer, tuning.io_depth)
            pool.settle()  # the last device copies, and a failure found only when one ran
        finally:
            staging = pool.total_bytes
            pool.close()
        return ReadResult(
            snapshot=self.manifest.snapshot,
            total_bytes=total,
            seconds=time.perf_counter() - started,
            io_mode=self.io_mode,
            staging_bytes=staging,
            tuning=tuning,
        )

    def _run(self, transfer: _Transfer, io_depth: int) -> None:
        """One thread faults memory in, readers read, the workers verify and copy; a failure stops all.

        With more requests in flight than readers (``io_depth``), each reader's
        request is read as pieces on threads of their own (ParallelReads).
        """
        pipeline = transfer.pipeline
        transfer.readers_left = transfer.readers
        if io_depth > transfer.readers:
            transfer.pieces = ParallelReads(io_depth, pipeline.abort)
        try:
            pipeline.start("fault-in", lambda: self._fault_in(transfer))
            for n in range(transfer.readers):
                pipeline.start(f"read-{n}", lambda: self._read_requests(transfer))
            for n in range(transfer.workers):
                pipeline.start(f"verify-{n}", lambda: self._verify_loaded(transfer))
            pipeline.join()
        finally:
            pipeline.stop()  # before the staging goes (see Pipeline.stop)
            if transfer.pieces is not None:
                transfer.pieces.close()

    def _take_request(self, transfer: _Transfer) -> Request | None:
        """The next request in file order, for one of the readers; None once all are taken."""
        with transfer.lock:
            if transfer.next_request >= len(transfer.requests):
                return None
            transfer.next_request += 1
            return transfer.requests[transfer.next_request - 1]

    def _read_requests(self, transfer: _Transfer) -> None:
        """Read requests into staging buffers, the next not yet taken each time, and hand each one's
        chunks to the workers in groups; the last reader to finish stops the workers."""
        lengths = self.manifest.columns.chunks.lengths
        pool, loaded, cancelled = transfer.pool, transfer.loaded, transfer.cancelled
        try:
            while (request := self._take_request(transfer)) is not None:
                if cancelled is not None and cancelled():
                    raise AbortedError("the wake was called off before it finished")
                buffer = pool.take(transfer.pipeline.abort)
                transfer.reading.set()
                try:
                    got = self._read_request(request, buffer, transfer.pieces)
                except BaseException:
                    pool.give(buffer)
                    raise
                groups = worker_groups(request.chunks, lengths)
                batch = _Loaded(request, buffer, got, len(groups))
                for group in groups:
                    loaded.put((batch, group))
        finally:
            transfer.reading.set()  # also when there was nothing to read, or the first take failed
            with transfer.lock:
                transfer.readers_left -= 1
                last = transfer.readers_left == 0
            if last:
                for _ in range(transfer.workers):
                    loaded.put(None)

    def _verify_loaded(self, transfer: _Transfer) -> None:
        """Verify and copy in the groups the reader hands over, once every chunk's destination is
        known; the last group of a request gives its buffer back.

        A group's device copies are only queued: their fence goes with the
        buffer, waited for when a reader takes it again (StagingPool.fence),
        so this worker verifies the next group while the device copies this one.
        """
        abort, defer = transfer.pipeline.abort, transfer.defer
        while not transfer.placed.wait(0.05):
            if abort.is_set():
                return
        while True:
            item = transfer.loaded.get()
            if item is None or abort.is_set():
                return
            batch, group = item
            copied = 0
            try:
                with defer() as queued:
                    copied = self._verify_and_copy(batch, group, transfer.regions)
                transfer.pool.fence(batch.buffer, queued.fence)
            finally:
                with transfer.lock:
                    batch.remaining -= 1
                    last = batch.remaining == 0
                    transfer.done += copied
                    done = transfer.done
                if last:
                    transfer.pool.give(batch.buffer)
            if transfer.progress is not None:
                transfer.progress(done, transfer.total)

    def _fault_in(self, transfer: _Transfer) -> None:
        """Find where each chunk goes, then fault in staging and the regions' host memory, in the
        order the reads and copies need it.

        The destinations (asked of every region: 0.05-0.07 s at 100,000
        tensors) are worked out here while the first reads are in flight,
        not before them. The first reader allocates its first buffer; one more for each
        worker and each other reader (each holds at most one at a time) is
        allocated here once that reader has its own: faulting huge pages
        in took up to 0.3 s for three buffers, time the disk idled when
        the reader allocated them itself, and faulting them in alongside
        the reader's first one delayed it (0.17 s instead of 0.09).
        """
        abort = transfer.pipeline.abort
        self._targets = chunk_addresses(transfer.regions, self._regions_of, self._region_offsets)
        self._all_host = all(self._targets)
        transfer.placed.set()
        while not transfer.reading.wait(0.05):
            if abort.is_set():
                return
        transfer.pool.prefill(transfer.workers + transfer.readers - 1)
        views = _to_populate(transfer.requests, transfer.regions, self._regions_of)
        huge = huge_pages_pay_off(sum(len(view) for view in views))
        for view in views:
            populate(view, abort, huge=huge)

    def _read_request(self, request: Request, buffer: StagingBuffer, pieces: ParallelReads | None) -> int:
        try:
            if pieces is not None:
                return pieces.read(self._files[request.file], buffer.view[: request.size], request.offset)
            return read_views(self._files[request.file], [buffer.view[: request.size]], request.offset)
        except OSError as exc:
            raise StorageError(
                f"cannot read {self.root.path / self.manifest.snapshot / request.file}: {exc.strerror}"
            ) from exc

    def _verify_and_copy(self, batch: _Loaded, group: list[int], regions: Sequence[Region]) -> int:
        """Verify each chunk of ``group`` where it lies in the buffer, then copy it in; the bytes copied.

        A group at a time, in one call (bulk.verify_copy_at) that copies each
        verified chunk to its address in host memory: a wake of 100,000 tensors
        verifies 100,000 chunks, and Python per chunk cost more than its copy.
        Chunks whose region has no host memory (device memory) are verified in
        that call and then copied by their region (only queued, where its pool
        defers device copies: see _verify_loaded).
        """
        chunks = self.manifest.columns.chunks
        offsets, lengths = chunks.offsets, chunks.lengths
        view, base, got, targets = batch.buffer.view, batch.request.offset, batch.got, self._targets
        failed, truncated = bulk.verify_copy_at(
            view, base, got, group, offsets, lengths, chunks.checksums, targets
        )
        if failed >= 0:
            chunk = group[failed]
            if truncated:
                raise SnapshotInvalidError(
                    f"{self._where(chunk)}: file is truncated "
                    f"({max(0, got - (offsets[chunk] - base))} of {lengths[chunk]} bytes read)"
                )
            raise SnapshotInvalidError(
                f"{self._where(chunk)}: checksum mismatch; the data on disk is corrupted"
            )
        if not self._all_host:
            regions_of, region_offsets = self._regions_of, self._region_offsets
            for chunk in group:
                if not targets[chunk]:
                    start = offsets[chunk] - base
                    regions[regions_of[chunk]].copy_in(
                        region_offsets[chunk], view[start : start + lengths[chunk]]
                    )
        return sum(map(lengths.__getitem__, group))

    def _where(self, chunk: int) -> str:
        """A chunk named for a refusal (built only then: a wake verifies one chunk per tensor)."""
        columns = self.manifest.columns
        file, offset, length = (
            columns.chunks.files[chunk],
            columns.chunks.offsets[chunk],
            columns.chunks.lengths[chunk],
        )
        key = columns.keys[self._regions_of[chunk]]
        at = self._region_offsets[chunk]
        return (
            f"{self.root.path / self.manifest.snapshot / file}: record {key!r} bytes "
            f"{at}..{at + length} (file offset {offset})"
        )


class Discard:
    """A region read back only to be verified: its bytes go nowhere.

    The reader wants every record of a snapshot; this stands for one whose
    bytes must not land (a ``--verify`` read, or a region a partial wake
    leaves for later, whose memory is not even mapped).
    """

    def __init__(self, region: Region | Record) -> None:
        self.key, self.tag, self.nbytes, self.meta = region.key, region.tag, region.nbytes, region.meta

    def copy_out(self, offset: int, dst: memoryview) -> None:
        raise AssertionError("a verification never writes")

    def copy_in(self, offset: int, src: memoryview) -> None:
        pass

    def host_view(self, offset: int, length: int) -> memoryview | None:
        return None

    def host_address(self) -> int | None:
        return None


class Unread(Discard):
    """A record nobody asked for, left unread: its chunks are not even requested.

    An adoption of one object (``track`` under HIBERNATE_ADOPT) wants only its
    records; the others' come with the calls that track them, each read and
    verified then. Only for a caller that does not need the snapshot whole.
    """


def verify_snapshot(
    root: SpillRoot, name: str, *, io_mode: str = "auto", buffer_bytes: int = 256 << 20
) -> ReadResult:
    """Read snapshot ``name`` back whole and check every chunk, touching no memory of the process.

    ``--verify``: proof that the disk gives back what was written, before the
    memory is released, for those who want it over speed (it costs a read of
    the whole snapshot). A snapshot that fails is deleted, so no later sleep
    reuses its bytes, and the error says the memory was kept.
    """
    try:
        with SnapshotReader(root, name, io_mode=io_mode, page_cache=False) as reader:
            records = [Discard(record) for record in reader.manifest.records]
            reader._matched = tuple(records)  # the manifest's own records: nothing to compare them with
            return reader.read_into(records, buffer_bytes=buffer_bytes)
    except (SnapshotInvalidError, StorageError) as exc:
        if root.lock(exclusive=True):
            try:
                root.delete_snapshot(name)
            finally:
                root.unlock()
        raise type(exc)(
            f"the snapshot did not read back as written ({exc.message}); it was deleted, "
            "and the process keeps its memory",
            hint="check the disk (dmesg, smartctl), then sleep again",
        ) from exc
