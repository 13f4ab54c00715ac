"""Read a snapshot back: validate everything first, then stream and verify every chunk.

A reader refuses before any memory is touched whatever can be found wrong
without reading the data (manifest, missing or truncated or symlinked files, a
record that does not match the process). Data is then read with direct I/O
into bounded staging, and each chunk's checksum is verified *before* its bytes
are copied into the region: a corrupted weight is never handed back.

Chunks are read in file order, and chunks that lie back to back in a file are
read with one request of up to 32 MiB (or one chunk, if larger), into staging
buffers allocated as needed. One thread keeps the disk busy; workers verify and
copy meanwhile; another faults the destination memory in a step ahead of them.
"""

from __future__ import annotations

import bisect
import errno
import itertools
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
from hibernate.store.arena import ARENAS, arena_bytes_for
from hibernate.store.directio import (
    DIRECT,
    DataFile,
    DirectIORefused,
    StagingBuffer,
    StagingPool,
    open_data_file,
    populate,
    read_views,
)
from hibernate.store.hugepages import huge_pages_pay_off
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import (
    ALIGNMENT,
    ChunkColumns,
    Columns,
    Manifest,
    Record,
    WrittenRecords,
    meta_text,
    plain_meta,
)
from hibernate.store.parse import check_meta
from hibernate.store.pipeline import CancelledFn, PinFn, Pipeline, ProgressFn
from hibernate.store.regions import Region

# One read request and one staging buffer (or the largest chunk, if larger). With
# huge-page staging (see StagingBuffer) the disk gets its largest requests whatever
# the size of ours, so ours need not be large; small buffers taken as needed keep
# what a restore faults in small: the workers keep up with the disk, so three were
# allocated (96 MiB of a 256 MiB budget) where 2 x 128 MiB used to be. Paired with
# raw reads, 32 MiB restored at 1.90 GB/s (median of 8), 64 MiB at 1.70.
_READ_REQUEST_BYTES = 32 << 20
# A worker takes the small chunks of a request in groups of about this many bytes (a large
# chunk is a group of its own): handing them out one by one cost more than verifying them.
_GROUP_BYTES = 4 << 20
# Regions smaller than this are not faulted in ahead of the copies (see fault_in).
_POPULATE_MIN_BYTES = 64 << 10


def read_request_bytes(arena: int, largest_chunk: int) -> int:
    """A restore's request and staging buffer size: the writer's staging budget (two arenas of
    ``arena`` bytes) as smaller buffers allocated only when none is free (see _READ_REQUEST_BYTES),
    never smaller than the largest chunk."""
    return max(largest_chunk, min(_READ_REQUEST_BYTES, arena))


def _groups(chunks: list[int], lengths: Sequence[int]) -> list[list[int]]:
    """A request's chunks as the workers take them: consecutive runs of about _GROUP_BYTES."""
    if len(chunks) == 1:
        return [chunks]
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for chunk in chunks:
        current.append(chunk)
        size += lengths[chunk]
        if size >= _GROUP_BYTES:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def _destinations(columns: Columns) -> tuple[Sequence[int], Sequence[int]]:
    """Each chunk's region (record index) and offset in it, by chunk index; in bulk, not per chunk."""
    counts = columns.counts
    if counts.count(1) == len(counts):  # one chunk per record, as with most tensors
        return range(len(counts)), [0] * len(counts)
    region_of = list(itertools.chain.from_iterable(map(itertools.repeat, range(len(counts)), counts)))
    covered = list(itertools.accumulate(columns.chunks.lengths, initial=0))
    starts = [covered[first] for first in columns.first_chunks()]
    return region_of, list(map(operator.sub, covered, map(starts.__getitem__, region_of)))


def _targets(
    regions: Sequence[Region], regions_of: Sequence[int], region_offsets: Sequence[int]
) -> list[int]:
    """Each chunk's address in host memory, by chunk index; 0 where its region has none (device memory).

    Asked of each region once per wake, so that verifying and copying a group of
    chunks is one call with no Python per chunk (bulk.verify_copy_at): asking for
    a view of each chunk's destination cost about 1 us a chunk, under the GIL.
    """
    bases = [region.host_address() or 0 for region in regions]
    if isinstance(regions_of, range):  # one chunk per region, at its start (see _destinations)
        return bases
    placed = zip(regions_of, region_offsets, strict=True)
    return [bases[region] + offset if bases[region] else 0 for region, offset in placed]


def _file_order(chunks: ChunkColumns) -> Sequence[int]:
    """The chunks' indices in file order (file, then offset): the order they are read in.

    A snapshot that one sleep wrote whole is in that order already, which is
    checked in bulk rather than sorted.
    """
    files, offsets = chunks.files, chunks.offsets
    if len(set(files)) > 1:
        return sorted(range(len(offsets)), key=list(zip(files, offsets, strict=True)).__getitem__)
    if all(map(operator.lt, offsets, itertools.islice(offsets, 1, None))):
        return range(len(offsets))
    # Two stagers fill the arenas side by side, so packed runs of small chunks interleave.
    return sorted(range(len(offsets)), key=offsets.__getitem__)


@dataclass
class ReadResult:
    snapshot: str
    total_bytes: int
    seconds: float
    io_mode: str
    staging_bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "snapshot": self.snapshot,
            "total_bytes": self.total_bytes,
            "seconds": round(self.seconds, 6),
            "io_mode": self.io_mode,
            "staging_bytes": self.staging_bytes,
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
class _Request:
    """Chunks (by index) lying back to back in one file, read with one request into one buffer."""

    file: str
    offset: int
    chunks: list[int] = field(default_factory=list)
    size: int = 0


def _split(request: _Request, at: int, firsts: Sequence[int], stops: Sequence[int]) -> list[_Request]:
    """``request`` as two requests, the first holding its first ``at`` chunks."""
    parts = []
    for chunks in (request.chunks[:at], request.chunks[at:]):
        part = _Request(request.file, firsts[chunks[0]], chunks)
        part.size = max(stops[chunk] for chunk in chunks) - part.offset
        parts.append(part)
    return parts


@dataclass
class _Loaded:
    """A request's bytes in a staging buffer, shared by the workers that verify its pieces."""

    request: _Request
    buffer: StagingBuffer
    got: int
    remaining: int


class SnapshotReader:
    """A published snapshot opened for reading (shared lock on its root)."""

    def __init__(self, root: SpillRoot, name: str, *, io_mode: str = "auto") -> None:
        self.root = root
        if not root.lock(exclusive=False):
            raise BusyError(f"{root.path} is being written or collected by another hibernate")
        self._files: dict[str, DataFile] = {}
        # The regions check_matches last accepted, as they were then: a list changed in between
        # is checked again, since the copies go to the addresses of the regions it holds.
        self._matched: tuple[Region, ...] | None = None
        # Each chunk's region and offset in it, by chunk index (see _destinations), once reading.
        self._regions_of: Sequence[int] = ()
        self._region_offsets: Sequence[int] = ()
        self._targets: list[int] = []  # see _targets
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
            data = open_data_file(dir_fd, name, io_mode)
        except DirectIORefused as exc:
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

    def _requests(
        self, order: Sequence[int], firsts: Sequence[int], stops: Sequence[int], largest: int
    ) -> list[_Request]:
        """The chunks in file ``order``, read in requests of whole pages of at most ``largest`` bytes.

        ``firsts`` and ``stops`` are where each chunk's pages start and end. A
        request takes the next chunk while it starts within or right after
        the request's last page: chunks packed back to back share pages, and
        a chunk named twice (equal bytes, written once) is read once.
        """
        files = self.manifest.columns.chunks.files
        requests: list[_Request] = []
        last = _Request("", -1)
        end = -1  # where the last request's pages end
        for chunk in order:
            first_page, stop = firsts[chunk], stops[chunk]
            if first_page > end or files[chunk] != last.file or max(end, stop) - last.offset > largest:
                last = _Request(files[chunk], first_page)
                requests.append(last)
                end = first_page
            last.chunks.append(chunk)
            if stop > end:
                end = stop
                last.size = end - last.offset
        # A short first request gets the workers going sooner; a short last one leaves
        # them less to do once the disk has finished.
        if requests and len(requests[0].chunks) > 1:
            requests[0:1] = _split(requests[0], 1, firsts, stops)
        if requests and len(requests[-1].chunks) > 1:
            requests[-1:] = _split(requests[-1], len(requests[-1].chunks) - 1, firsts, stops)
        return requests

    def read_into(
        self,
        regions: Sequence[Region],
        *,
        buffer_bytes: int = 256 << 20,
        threads: int = 2,
        progress: ProgressFn | None = None,
        cancelled: CancelledFn | None = None,
        pin: PinFn | None = None,
    ) -> ReadResult:
        """Fill every region from the snapshot, verifying each chunk before it is copied in.

        ``threads`` workers verify and copy while one more thread reads ahead;
        the staging memory is at most ``buffer_bytes`` (or two of the
        snapshot's largest chunks if that is more), and no more than the
        snapshot needs; buffers are allocated as the reads need them. On any
        failure the regions hold partial data: the caller releases them again.
        Regions :meth:`check_matches` already accepted (the same sequence,
        unchanged since) are not compared again.
        """
        with gc_paused():  # one object per chunk below: see gc_paused
            return self._read_into(regions, buffer_bytes, threads, progress, cancelled, pin)

    def _read_into(
        self,
        regions: Sequence[Region],
        buffer_bytes: int,
        threads: int,
        progress: ProgressFn | None,
        cancelled: CancelledFn | None,
        pin: PinFn | None,
    ) -> ReadResult:
        if self._matched != tuple(regions):  # the caller may have checked them already
            self.check_matches(regions)
        started = time.perf_counter()
        chunks = self.manifest.columns.chunks
        # Where each chunk's pages start and end (align_up written out: once per chunk), worked
        # out once for planning; reading one chunk alone takes the difference.
        firsts = [offset - offset % ALIGNMENT for offset in chunks.offsets]
        stops = [
            (offset + length + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
            for offset, length in zip(chunks.offsets, chunks.lengths, strict=True)
        ]
        pages = list(map(operator.sub, stops, firsts))
        largest = max(pages, default=ALIGNMENT)
        arena = arena_bytes_for(buffer_bytes, sum(pages), largest)
        size = read_request_bytes(arena, largest)
        requests = self._requests(_file_order(chunks), firsts, stops, size)
        self._regions_of, self._region_offsets = _destinations(self.manifest.columns)
        total = self.manifest.total_bytes
        pool = StagingPool(ARENAS * arena, size, pin, lazy=True, huge=True)
        pipeline = Pipeline()
        loaded: queue.Queue[tuple[_Loaded, list[int]] | None] = queue.Queue()
        lock = threading.Lock()
        state = {"done": 0}
        reading = threading.Event()  # the reader has its first buffer
        placed = threading.Event()  # every chunk's destination is known (see fault_in)
        workers = max(1, threads)

        def read() -> None:
            try:
                for request in requests:
                    if cancelled is not None and cancelled():
                        raise AbortedError("the wake was called off before it finished")
                    buffer = pool.take(pipeline.abort)
                    reading.set()
                    try:
                        got = self._read_request(request, buffer)
                    except BaseException:
                        pool.give(buffer)
                        raise
                    groups = _groups(request.chunks, chunks.lengths)
                    batch = _Loaded(request, buffer, got, len(groups))
                    for group in groups:
                        loaded.put((batch, group))
            finally:
                reading.set()  # also when there was nothing to read, or the first take failed
                for _ in range(workers):
                    loaded.put(None)

        def work() -> None:
            while not placed.wait(0.05):
                if pipeline.abort.is_set():
                    return
            while True:
                item = loaded.get()
                if item is None or pipeline.abort.is_set():
                    return
                batch, group = item
                copied = 0
                try:
                    copied = self._verify_and_copy(batch, group, regions)
                finally:
                    with lock:
                        batch.remaining -= 1
                        last = batch.remaining == 0
                        state["done"] += copied
                        done = state["done"]
                    if last:
                        pool.give(batch.buffer)
                if progress is not None:
                    progress(done, total)

        def fault_in() -> None:
            """Find where each chunk goes, then fault in staging and the regions' host memory, in the
            order the reads and copies need it.

            The destinations (asked of every region: 0.05-0.07 s at 100,000
            tensors) are worked out here while the first reads are in flight,
            not before them. The reader allocates its first buffer; one more for each worker
            (each holds at most one while the reader fills the next) is
            allocated here once the reader has its own: faulting huge pages
            in took up to 0.3 s for three buffers, time the disk idled when
            the reader allocated them itself, and faulting them in alongside
            the reader's first one delayed it (0.17 s instead of 0.09).
            """
            self._targets = _targets(regions, self._regions_of, self._region_offsets)
            self._all_host = all(self._targets)
            placed.set()
            while not reading.wait(0.05):
                if pipeline.abort.is_set():
                    return
            pool.prefill(workers)
            # Small regions are left to fault as they are copied into: one system call
            # each would cost more than the faults it saves (a wake of 100,000 tensors).
            order: dict[int, memoryview] = {}
            regions_of = self._regions_of
            for request in requests:
                for chunk in request.chunks:
                    index = regions_of[chunk]
                    region = regions[index]
                    if region.nbytes >= _POPULATE_MIN_BYTES and index not in order:
                        view = region.host_view(0, region.nbytes)
                        if view is not None and not view.readonly:
                            order[index] = view
            huge = huge_pages_pay_off(sum(len(view) for view in order.values()))
            for view in order.values():
                populate(view, pipeline.abort, huge=huge)

        try:
            pipeline.start("fault-in", fault_in)
            pipeline.start("read", read)
            for n in range(workers):
                pipeline.start(f"verify-{n}", work)
            pipeline.join()
        finally:
            staging = pool.total_bytes
            pool.close()
        modes = {f.mode for f in self._files.values()}
        return ReadResult(
            snapshot=self.manifest.snapshot,
            total_bytes=total,
            seconds=time.perf_counter() - started,
            io_mode=DIRECT if modes <= {DIRECT} else "buffered",
            staging_bytes=staging,
        )

    def _read_request(self, request: _Request, buffer: StagingBuffer) -> int:
        try:
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
        that call and then copied by their region.
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
        with SnapshotReader(root, name, io_mode=io_mode) as reader:
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
