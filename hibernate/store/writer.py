"""Write a snapshot: copy, checksum and stream regions to disk through bounded staging.

The staging memory (the only host memory a spill adds, whatever its size) is
split into a few large *arenas*. Two kinds of worker share them:

* stagers take the next chunk of a region, copy it into the current arena
  right after the previous one, and checksum the copy: a run of small chunks
  is packed back to back (64-byte aligned), a large chunk and each run start
  on a page (4 KiB), as direct I/O needs. A chunk
  whose checksum the previous snapshot already holds is not written again: the
  new snapshot refers to the old bytes. For host memory that test runs on the
  region in place, before any copy, so an unchanged model costs one hashing
  pass and no writes (its reused bytes are read back beside it: see below);
* a writer takes full arenas in the order they were filled and writes each
  one's live chunks with a single vectored request, appending to the current
  data file.

Why arenas and not one write per chunk: a chunk ends where its region ends, so
a model of many tensors makes many short chunks, and on the disks we measured
each request costs a fixed latency on top of its transfer. Packing chunks into
64 MiB requests reaches the raw O_DIRECT limit; one request per chunk did not.

Nothing becomes visible until the manifest is written and the temporary
directory is renamed (see layout.py): a failure anywhere leaves the temporary
directory removed and the memory untouched.

Release only after proof: a snapshot's every byte is either written now
(checksummed from memory, fsynced) or reused from the previous snapshot and
read back by this sleep, its checksum checked. Candidates for reuse are the
previous snapshot's files whose identity (device, inode, size, mtime, ctime)
is still the one recorded when they were verified; they are hard-linked into
the new snapshot's own directory before anything is streamed, so the new
snapshot is self-contained; a file that changed, vanished or cannot be linked
is not reused, and its bytes are written again. Identity cannot see bytes that
changed below the file system, so every chunk the stream reuses is read back
beside it (reusecheck.ReuseCheck, within the same staging budget), and one
that no longer matches, or cannot be read, is written again in a second pass
(_Stream.rewrite) before the manifest is written. ``check_reuse=False``
(--skip-reuse-check) trusts identity alone; the result then says how many
bytes were reused unread.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import operator
import os
import queue
import secrets
import stat
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from hibernate import faults
from hibernate.errors import AbortedError, SnapshotInvalidError, StorageError, UnsupportedError
from hibernate.fsutil import free_bytes, write_file_atomic
from hibernate.gcpause import gc_paused
from hibernate.store import bulk
from hibernate.store.directio import (
    BUFFERED,
    DIRECT,
    DataFile,
    DirectIORefused,
    PipelineAborted,
    StagingBuffer,
    StagingPool,
    create_data_file,
    finish_write,
    write_views,
)
from hibernate.store.layout import SpillRoot, punch_unused
from hibernate.store.manifest import (
    ALIGNMENT,
    MANIFEST_NAME,
    MAX_CHUNK_BYTES,
    MAX_RECORDS,
    ChunkColumns,
    ChunkRef,
    Columns,
    FileIdentity,
    Manifest,
    PlainMeta,
    align_up,
    checksum,
    meta_text,
    snapshot_name,
)
from hibernate.store.parse import check_region, regions_plain
from hibernate.store.pipeline import Pipeline
from hibernate.store.regions import Region
from hibernate.store.reusecheck import READ_REQUEST_BYTES, Outcome, ReuseCheck, pages_bound
from hibernate.units import human_bytes

ProgressFn = Callable[[int, int], None]
CancelledFn = Callable[[], bool]
PinFn = Callable[[memoryview], Callable[[], None]]
# Each region's key, tag and meta, in order: what a snapshot's records hold of a region but its chunks.
Described = tuple[list[str], list[str], list[Mapping[str, Any]]]
_LENGTH = operator.itemgetter(2)  # of a ChunkRef

IO_MODES = ("auto", "direct", "buffered")
ARENAS = 2  # staging is split in two arenas: one is written while the other is filled
MAX_REQUEST_BYTES = 128 << 20  # one I/O request; requests cost a fixed latency, so fewer is faster
MIN_BUFFER_BYTES = 4 * ARENAS * ALIGNMENT
FREE_SPACE_MARGIN = 1 << 20  # the manifest and the filesystem's own bookkeeping
_BATCH_TASKS = 256  # a stager takes up to this many chunks at once (see _Stream._take_tasks)
_BATCH_BYTES = 8 << 20  # or this many bytes, so the stagers still share large regions
# Host chunks up to this size are staged in runs, one bulk.stage call per run (without the
# compiled helper a slice assignment each, which holds the GIL but takes less time than the
# region's call); larger ones one by one through copy_out, which releases it.
_SMALL_COPY = 256 << 10
_ZEROS = memoryview(bytes(ALIGNMENT))  # padding: a chunk's last page, past its end
# Where a packed chunk may start within its run (see _Packer.reserve): a cache line, so the
# copies and checksums of a wake read whole lines; it costs 32 bytes a chunk on average.
PACKED_ALIGNMENT = 64


def arena_bytes(buffer_bytes: int) -> int:
    """The size of one staging arena (and of the largest I/O request) for ``buffer_bytes`` of staging."""
    return max(ALIGNMENT, min(MAX_REQUEST_BYTES, buffer_bytes // ARENAS // ALIGNMENT * ALIGNMENT))


def arena_bytes_for(buffer_bytes: int, data_bytes: int, largest_chunk: int) -> int:
    """An arena size for moving ``data_bytes``: no more staging than the data needs.

    Staging is faulted in before the I/O starts, so a small snapshot should
    not pay for 256 MiB of it; an arena still holds the largest chunk.
    """
    needed = align_up(-(-data_bytes // ARENAS))
    return max(align_up(largest_chunk), min(arena_bytes(buffer_bytes), needed))


@dataclass(frozen=True)
class WriteOptions:
    """How a snapshot is written; the defaults are what the benchmark tuned on a 2-core machine."""

    buffer_bytes: int = 256 << 20  # all staging memory together
    chunk_bytes: int = 32 << 20  # unit of checksum and reuse; capped at one arena
    segment_bytes: int = 1 << 30  # start a new data file past this size
    io_mode: str = "auto"  # auto | direct | buffered
    stage_threads: int = 2  # copy + checksum workers (and in-place hashing of unchanged chunks)
    io_threads: int = 1  # writers; ext4 serialises appending direct writes, so more did not help
    reuse: bool = True  # refer to unchanged chunks of the previous snapshot
    # Read every reused chunk back and check it before anything is released (see reusecheck);
    # False trusts the previous snapshot's files as the last wake left them (--skip-reuse-check).
    check_reuse: bool = True
    verify: bool = False  # read the published snapshot back before returning (see verify_snapshot)

    def __post_init__(self) -> None:
        if self.io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {IO_MODES}, not {self.io_mode!r}")
        if self.chunk_bytes < ALIGNMENT or self.chunk_bytes % ALIGNMENT or self.chunk_bytes > MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGNMENT} between 4 KiB and 1 GiB")
        if self.buffer_bytes < MIN_BUFFER_BYTES:
            raise ValueError(f"buffer_bytes must be at least {MIN_BUFFER_BYTES} bytes")
        if self.segment_bytes < ALIGNMENT:
            raise ValueError("segment_bytes must be at least 4 KiB")
        if self.stage_threads < 1 or self.io_threads < 1:
            raise ValueError("stage_threads and io_threads must be at least 1")

    @property
    def effective_chunk_bytes(self) -> int:
        """The chunk size used: ``chunk_bytes``, unless one staging arena is smaller."""
        return min(self.chunk_bytes, arena_bytes(self.buffer_bytes))


@dataclass
class WriteResult:
    snapshot: str
    path: Path
    total_bytes: int
    written_bytes: int
    reused_bytes: int
    seconds: float
    io_mode: str
    staging_bytes: int
    data_files: int
    manifest: Manifest
    warnings: list[str] = field(default_factory=list)
    # Of written_bytes, the bytes the previous snapshot held but the disk no longer gave back as
    # written (or could not read): found by the reuse check, written again from memory.
    rewritten_bytes: int = 0
    reuse_read_bytes: int = 0  # read back from the previous snapshot's files to check what is reused
    reused_unread_bytes: int = 0  # reused without being read back (the check was skipped)

    def to_wire(self) -> dict[str, Any]:
        return {
            "snapshot": self.snapshot,
            "path": str(self.path),
            "total_bytes": self.total_bytes,
            "written_bytes": self.written_bytes,
            "reused_bytes": self.reused_bytes,
            "seconds": round(self.seconds, 6),
            "io_mode": self.io_mode,
            "staging_bytes": self.staging_bytes,
            "data_files": self.data_files,
            "warnings": self.warnings,
            "rewritten_bytes": self.rewritten_bytes,
            "reuse_read_bytes": self.reuse_read_bytes,
            "reused_unread_bytes": self.reused_unread_bytes,
        }


REUSED_PREFIX = "reused-"


@dataclass(frozen=True)
class ReuseSource:
    """What a sleep needs of the previous snapshot to reuse its bytes: its name, files and chunks.

    Not the whole manifest: an agent keeps this between a wake and the next
    sleep (see write_snapshot's ``known``), and the keys and meta of 100,000
    records held 128 MiB where their chunks hold 15-25 (measured by RSS and tracemalloc).
    """

    snapshot: str
    files: Mapping[str, FileIdentity]
    chunks: ChunkColumns

    @classmethod
    def of(cls, manifest: Manifest) -> ReuseSource:
        return cls(manifest.snapshot, dict(manifest.files), manifest.columns.chunks)


def _unchanged(root: SpillRoot, previous: ReuseSource, name: str) -> bool:
    """The previous snapshot's file ``name`` is the very file that was verified when it was written."""
    try:
        info = os.stat(f"{previous.snapshot}/{name}", dir_fd=root.fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and FileIdentity.of(info) == previous.files.get(name)


@dataclass
class Linked:
    """What :func:`link_reusable` made of the previous snapshot."""

    index: dict[tuple[str, int], ChunkRef]  # its chunks by (checksum, length), naming the links
    links: list[str]  # the links made, in the new snapshot's directory
    origins: dict[str, str]  # each link's file in the previous snapshot (for messages)
    warnings: list[str]  # files that could not be linked: their bytes are written again


def link_reusable(root: SpillRoot, previous: ReuseSource | None, tmp_fd: int) -> Linked:
    """Hard-link the previous snapshot's unchanged files into the new one; index their chunks.

    A file that cannot be linked (a file system without hard links) is not
    reused: its bytes are written again, and a warning says so.
    """
    index: dict[tuple[str, int], ChunkRef] = {}
    links: list[str] = []
    warnings: list[str] = []
    renamed: dict[str, str] = {}
    if previous is None:
        return Linked(index, links, {}, warnings)
    for name in sorted(previous.files):
        if not _unchanged(root, previous, name):
            continue
        link = f"{REUSED_PREFIX}{len(links):03d}.bin"
        try:
            os.link(
                f"{previous.snapshot}/{name}",
                link,
                src_dir_fd=root.fd,
                dst_dir_fd=tmp_fd,
                follow_symlinks=False,
            )
        except OSError as exc:
            warnings.append(
                f"{root.path / previous.snapshot / name} could not be linked into the new snapshot "
                f"({exc.strerror or exc}); its bytes were written again"
            )
            continue
        renamed[name] = link
        links.append(link)
    # Built with map and one dict rather than a statement per chunk (an unchanged re-sleep reuses
    # every chunk); in reverse, so that of chunks with equal bytes the first is the one kept.
    chunks = previous.chunks
    digests, lengths = chunks.digests(), chunks.lengths
    linked_as = [renamed.get(file, "") for file in chunks.files]  # "": a file not linked
    refs = list(map(ChunkRef, linked_as, chunks.offsets, lengths, digests))
    if len(renamed) < len(previous.files):  # the chunks of a file not linked are not offered
        refs = [ref for ref in refs if ref.file]
        digests, lengths = [ref.checksum for ref in refs], [ref.length for ref in refs]
    keys = zip(reversed(digests), reversed(lengths), strict=True)
    index.update(zip(keys, reversed(refs), strict=True))
    return Linked(index, links, {link: name for name, link in renamed.items()}, warnings)


def _uses_every_chunk(
    chunks: list[ChunkRef],
    reusable: Mapping[tuple[str, int], ChunkRef],
    previous: ReuseSource | None,
) -> bool:
    """Whether the new snapshot refers to every chunk of the previous one, each through its link.

    A previous snapshot's data file holds its chunks' pages and holes punched
    before, nothing else; so if every one of its chunks was linked and indexed
    (none in a file left unlinked, no two with the same bytes) and every one is
    used now, its link has nothing to trim. That is an unchanged re-sleep, for
    which walking the chunks to find the pages in use took 10-18 ms at 20,000
    tensors.
    """
    if previous is None or len(reusable) != len(previous.chunks.files):
        return False
    return set(map(id, chunks)).issuperset(map(id, reusable.values()))


def _used_ranges(chunks: Sequence[ChunkRef], links: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Per linked data file the chunks use, the sorted and merged pages they use, padding included.

    Only a link can hold bytes the new snapshot does not use (a file this
    sleep wrote holds only what it wrote), so only links are walked chunk by
    chunk; at 100,000 tensors that walk took 0.1 s of a first sleep.
    """
    linked = set(links)
    spans: dict[str, list[tuple[int, int]]] = {}
    if linked:
        for file, offset, length, _ in chunks:
            if file in linked:  # the pages it lies in (align_up written out: once per chunk)
                spans.setdefault(file, []).append(
                    (
                        offset - offset % ALIGNMENT,
                        (offset + length + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT,
                    )
                )
    merged: dict[str, list[tuple[int, int]]] = {}
    for file, ranges in spans.items():
        out: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        merged[file] = out
    return merged


def _trim_links(tmp_fd: int, links: list[str], used: dict[str, list[tuple[int, int]]]) -> None:
    """Links the new snapshot does not use go; in those it partly uses, the rest is punched out.

    The punch changes the shared file under the previous snapshot too: that one is
    deleted next, before this one is published, and a crash in between leaves it
    with a changed identity, so no later sleep reuses it.
    """
    for link in links:
        if link not in used:
            os.unlink(link, dir_fd=tmp_fd)
        else:
            punch_unused(tmp_fd, link, used[link])


def _identities(tmp_fd: int, names: set[str]) -> dict[str, FileIdentity]:
    """Each data file as it is now, at the end of writing: what a later sleep may trust."""
    return {name: FileIdentity.of(os.stat(name, dir_fd=tmp_fd, follow_symlinks=False)) for name in names}


def check_regions(regions: Sequence[Region]) -> Described:
    """Refuse, before anything is written, regions whose manifest no wake would accept.

    Returns what it checked, each region's key, tag and meta as its record
    keeps them (see _described), so that a re-sleep need not ask every region
    again (10-20 ms at 20,000 tensors).
    """
    if len(regions) > MAX_RECORDS:
        raise UnsupportedError(
            f"{len(regions)} regions to hibernate, more than the {MAX_RECORDS} a snapshot may hold; "
            "nothing was written and the process keeps its memory",
            hint="track fewer, larger tensors",
        )
    described = _described(regions)
    if regions_plain(*described):
        return described  # all good, checked in bulk; otherwise each region is checked below, to say which
    seen: set[str] = set()
    for index, region in enumerate(regions):
        try:
            check_region(region.key, region.tag, region.meta, f"region {index}")
        except SnapshotInvalidError as exc:
            raise UnsupportedError(
                f"{exc.message}; a wake could not read it back, so nothing was written and the process "
                "keeps its memory",
                hint="rename the tensor (hibernate.track(..., name=...)) or untrack it",
            ) from exc
        if region.key in seen:
            raise UnsupportedError(
                f"two regions share the key {region.key!r}; nothing was written and the process keeps "
                "its memory",
                hint="give the tracked objects distinct names",
            )
        seen.add(region.key)
    return described


def _segment_name(index: int) -> str:
    return f"data-{index:03d}.bin"


class _Segments:
    """Data files of the snapshot being written, appended to in order."""

    def __init__(self, root: SpillRoot, dir_fd: int, tmp_name: str, options: WriteOptions):
        self._root = root
        self._dir_fd = dir_fd
        self._tmp_name = tmp_name
        self._segment_bytes = options.segment_bytes
        self._io_mode = options.io_mode
        self._lock = threading.Lock()
        self.files: list[DataFile] = []
        self.names: list[str] = []  # of the files, in the manifest; each holds chunks written to it
        self._offset = 0

    def allocate(self, nbytes: int) -> tuple[DataFile, str, int]:
        """Where the next ``nbytes`` go: (file, its name in the manifest, offset)."""
        with self._lock:
            if not self.files or (self._offset and self._offset + nbytes > self._segment_bytes):
                name = _segment_name(len(self.files))
                self.files.append(create_data_file(self._dir_fd, name, self._io_mode))
                self.names.append(name)
                self._offset = 0
            offset = self._offset
            self._offset += nbytes
            return self.files[-1], self.names[-1], offset

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


@dataclass(slots=True)
class _Slot:
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
class _Arena:
    """A staging buffer filled with chunks back to back, then written as one request."""

    buffer: StagingBuffer
    used: int = 0
    pending: int = 0
    sealed: bool = False
    slots: list[_Slot] = field(default_factory=list)
    filled: threading.Event = field(default_factory=threading.Event)

    def live_spans(self) -> list[tuple[int, int]]:
        """The pages that hold live slots, neighbours merged: what the writer hands the kernel.

        Whole pages, for direct I/O: a slot packed beside a live one in a
        page is written with it, live or not (a few KiB at most, which no
        chunk refers to).
        """
        spans: list[tuple[int, int]] = []
        for slot in self.slots:
            if not slot.live:
                continue
            start = slot.position - slot.position % ALIGNMENT
            end = align_up(slot.position + slot.padded)
            if spans and start <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(end, spans[-1][1]))
            else:
                spans.append((start, end))
        return spans


class _Packer:
    """Hands out arena space in order and passes each full arena on to the writers, in order.

    The first arena is passed on after its first chunk, so the disk starts
    working while the rest of the staging memory is still being filled.
    """

    def __init__(self, pool: StagingPool, abort: threading.Event) -> None:
        self._pool = pool
        self._abort = abort
        self._lock = threading.Lock()
        self._current: _Arena | None = None
        self._started = False
        self.sealed: queue.Queue[_Arena | None] = queue.Queue()

    def _fits(self, arena: _Arena, size: int) -> bool:
        """Whether ``size`` more bytes fit in ``arena`` (the first arena takes one chunk: see above)."""
        if not self._started:
            return not arena.slots
        return arena.used + size <= arena.buffer.size

    def reserve(self, chunks: Sequence[tuple[int, int]]) -> tuple[_Arena, list[_Slot]]:
        """Places in one arena for the first of ``chunks`` (task, length), as many as fit there.

        The run's chunks are packed back to back (each at a multiple of
        PACKED_ALIGNMENT), and the run ends on a page, where the next starts:
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
                    slots: list[_Slot] = []
                    first = position = arena.used
                    for task, length in chunks:
                        if slots and not self._fits(arena, align_up(position + length) - first):
                            break
                        slots.append(_Slot(task, position, length, 0))
                        arena.slots.append(slots[-1])
                        position = align_up(position + length, PACKED_ALIGNMENT)
                    # Each slot pads up to the next; the last one up to the page, where the next run starts.
                    for slot, following in itertools.pairwise(slots):
                        slot.padded = following.position - slot.position
                    slots[-1].padded = align_up(slots[-1].position + slots[-1].length) - slots[-1].position
                    arena.used = slots[-1].position + slots[-1].padded
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
                    self._current = _Arena(fresh)
            if not installed:
                self._pool.give(fresh)  # another stager installed one first

    def finish(self, arena: _Arena, slots: Sequence[_Slot]) -> None:
        """``slots`` are staged (their digest and liveness set) or given up (left not live)."""
        with self._lock:
            for slot in slots:
                if not slot.done:
                    slot.done = True
                    arena.pending -= 1
            if arena.sealed and arena.pending == 0:
                arena.filled.set()

    def _seal(self, arena: _Arena) -> None:
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


def _io_error(exc: OSError, root: SpillRoot, where: Path | None, done: int, total: int) -> StorageError:
    target = f" ({where})" if where is not None else ""
    if isinstance(exc, DirectIORefused):
        return StorageError(
            f"the filesystem of {root.path}{target} refuses direct I/O (O_DIRECT), which --io-mode direct "
            "requires; nothing was published and the process keeps its memory",
            hint="use --io-mode auto (it falls back to buffered I/O there) or --io-mode buffered",
        )
    if exc.errno == errno.ENOSPC:
        return StorageError(
            f"no space left on the device of {root.path}{target} after writing {done} of {total} bytes; "
            "nothing was published and the process keeps its memory",
            hint="free space or choose another --to directory, then sleep again",
        )
    return StorageError(
        f"I/O error writing the snapshot in {root.path}{target}: {exc.strerror or exc}; "
        "nothing was published and the process keeps its memory"
    )


def write_snapshot(
    root: SpillRoot,
    regions: Sequence[Region],
    *,
    producer: Mapping[str, Any],
    options: WriteOptions | None = None,
    progress: ProgressFn | None = None,
    cancelled: CancelledFn | None = None,
    pin: PinFn | None = None,
    known: ReuseSource | None = None,
) -> WriteResult:
    """Write ``regions`` as a new published snapshot of ``root``; all or nothing.

    A root left with nothing in it (the first sleep of a process failed) is
    removed, so failed sleeps leave no empty directories behind.

    ``known``: the root's newest snapshot as the caller holds it already
    (from the manifest its last wake read), which saves parsing the manifest
    again for reuse (a fifth of an unchanged sleep of 20,000 tensors). It is
    used only if it names the newest snapshot; whatever it says, a chunk is
    reused only from a file whose identity is still the one it records (see
    link_reusable).
    """
    options = options or WriteOptions()
    started = time.perf_counter()
    root.lock_for_write()
    try:
        with gc_paused():  # a few objects per region and per chunk: see gc_paused
            return _write_locked(root, regions, producer, options, progress, cancelled, pin, started, known)
    except BaseException:
        with contextlib.suppress(OSError):
            if root.is_empty():
                root.remove()
        raise
    finally:
        root.unlock()


def _write_locked(
    root: SpillRoot,
    regions: Sequence[Region],
    producer: Mapping[str, Any],
    options: WriteOptions,
    progress: ProgressFn | None,
    cancelled: CancelledFn | None,
    pin: PinFn | None,
    started: float,
    known: ReuseSource | None,
) -> WriteResult:
    described: Described | None = check_regions(regions)
    try:
        root.sweep_unfinished()
    except OSError as exc:
        raise StorageError(
            f"cannot clear unfinished snapshots in {root.path}: {exc.strerror or exc}"
        ) from exc
    previous = _previous(root, known) if options.reuse else None
    chunk_bytes = options.effective_chunk_bytes
    # Read once: a region's size is a property, and four steps below need every one of them.
    sizes = [region.nbytes for region in regions]
    total = sum(sizes)
    sequence = root.next_sequence()
    name = snapshot_name(sequence)
    with root.staging_dir(sequence, secrets.token_hex(4)) as (tmp_name, tmp_fd):
        linked = link_reusable(root, previous, tmp_fd)
        reusable, links, warnings = linked.index, linked.links, linked.warnings
        _check_free_space(root, sizes, reusable)
        segments = _Segments(root, tmp_fd, tmp_name, options)
        check: ReuseCheck | None = None
        try:
            if not reusable:
                # A first sleep stages all it writes: the regions' descriptions (20 MiB at 100,000
                # tensors) would add to its peak memory, so they are dropped now, taken again after.
                described = None
            stream = _Stream(regions, sizes, segments, reusable, options, total, progress, cancelled, root)
            if reusable and options.check_reuse:
                check = ReuseCheck(
                    tmp_fd,
                    reusable.values(),
                    stream.marks,
                    stream.news,
                    stream.decided,
                    io_mode=options.io_mode,
                    cancelled=cancelled,
                )
                staging = _stream_then_check(stream, check, options, sizes, reusable, pin)
                if check.outcome.failed:
                    for ref in check.outcome.failed:  # out of the index: the links are trimmed of them
                        if reusable.get((ref.checksum, ref.length)) is ref:
                            del reusable[(ref.checksum, ref.length)]
                    stream.rewrite(check.outcome.failed, pin, options.buffer_bytes)
                    staging = max(staging, stream.staging_bytes)
                    assert previous is not None  # a chunk was checked: there was a previous snapshot
                    warnings += _rewritten(check.outcome, linked.origins, root.path / previous.snapshot)
            else:
                stream.run(pin, options.buffer_bytes)
                staging = stream.staging_bytes
            chunks = stream.resolve()
            unread = 0 if check is not None else sum(map(_LENGTH, stream.marks))
            if unread:
                assert previous is not None  # a chunk was reused: there was a previous snapshot
                warnings.append(_unread_warning(unread, root.path / previous.snapshot))
            keys, tags, metas = described or _described(regions)
            segments.finish()
            if _uses_every_chunk(chunks, reusable, previous):
                in_use = set(links)  # each link holds only chunks this snapshot uses: nothing to trim
            else:
                used = _used_ranges(chunks, links)
                _trim_links(tmp_fd, links, used)
                in_use = set(used)
            # The older snapshots go now, not after the publish: removing a link changes the
            # change time of the file it shares with ours, which must be final when recorded.
            # They were a cache of bytes the process still holds, so nothing is lost if the
            # publish then fails.
            root.retire_all_but(None)
            # The files the chunks use: those this sleep wrote (one is created only to write
            # chunks into it) and the links they use.
            files = _identities(tmp_fd, {*segments.names, *in_use})
            faults.point("store.write")  # data durable, nothing published yet
        except OSError as exc:
            raise _io_error(exc, root, None, stream.written, total) from exc
        finally:
            io_mode = segments.mode
            data_files = len(segments.files)
            segments.close()
        try:
            manifest = Manifest(
                snapshot=name,
                producer=dict(producer),
                chunk_bytes=chunk_bytes,
                columns=Columns.build(
                    keys, tags, sizes, metas, stream.counts(), chunks, text=meta_text(metas)
                ),
                owner=root.owner,
                files=files,
                created_unix=time.time(),
            )
            encoded = manifest.encode()
        except SnapshotInvalidError as exc:
            raise UnsupportedError(
                f"{exc.message}: no wake could read it, so nothing was published and the process keeps "
                "its memory",
                hint=exc.hint,
            ) from exc
        try:
            write_file_atomic(tmp_fd, MANIFEST_NAME, encoded)
            faults.point("store.publish")  # the manifest is in place, the rename is next
            root.publish(tmp_name, name)
        except OSError as exc:
            raise _io_error(exc, root, root.path / tmp_name / MANIFEST_NAME, stream.written, total) from exc
    return WriteResult(
        snapshot=name,
        path=root.path / name,
        total_bytes=total,
        written_bytes=stream.written,
        reused_bytes=stream.reused,
        seconds=time.perf_counter() - started,
        io_mode=io_mode,
        staging_bytes=staging,
        data_files=data_files,
        manifest=manifest,
        warnings=warnings,
        rewritten_bytes=stream.rewritten,
        reuse_read_bytes=check.outcome.read_bytes if check is not None else 0,
        reused_unread_bytes=unread,
    )


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


def _stream_then_check(
    stream: _Stream,
    check: ReuseCheck,
    options: WriteOptions,
    sizes: Sequence[int],
    reusable: Mapping[tuple[str, int], ChunkRef],
    pin: PinFn | None,
) -> int:
    """Stream every chunk with the reuse check beside it (or after it, where the budget is too
    small for both); the staging allocated at most at once."""
    largest_task = min(options.effective_chunk_bytes, max(sizes, default=0))
    plan = plan_staging(options.buffer_bytes, largest_task, max(map(_LENGTH, reusable.values())))
    if not plan.check_bytes:
        stream.run(pin, options.buffer_bytes)
        check.run(options.buffer_bytes, plan.request_bytes)
        return max(stream.staging_bytes, check.outcome.staging_bytes)
    try:
        stream.run(
            pin,
            plan.stream_bytes,
            lambda pipeline: check.start(pipeline, plan.check_bytes, plan.request_bytes),
        )
    finally:
        check.close()
    return stream.staging_bytes + check.outcome.staging_bytes


def _rewritten(outcome: Outcome, origins: Mapping[str, str], previous: Path) -> list[str]:
    """One warning per file of the previous snapshot whose reused chunks the disk no longer held."""
    lost: dict[str, list[int]] = {}
    for ref in outcome.failed:
        lost.setdefault(ref.file, []).append(ref.length)
    return [
        f"{previous / origins.get(link, link)}: {len(lengths)} chunk(s) to reuse, "
        f"{human_bytes(sum(lengths))}, no longer read back as written "
        f"({outcome.problems.get(link, 'unreadable')}); written again from memory. "
        "Check the disk (dmesg, smartctl)"
        for link, lengths in sorted(lost.items())
    ]


def _unread_warning(unread: int, previous: Path) -> str:
    return (
        f"{human_bytes(unread)} reused from {previous} without reading them back (the reuse check "
        "was skipped): a change on the disk since the last wake read them goes unnoticed until the "
        "next wake"
    )


def _previous(root: SpillRoot, known: ReuseSource | None) -> ReuseSource | None:
    """The newest snapshot, to reuse from: ``known`` if it is that one, else as read from disk."""
    published = root.published()
    if known is not None and published and published[-1] == known.snapshot:
        return known
    latest = root.latest_manifest()
    return ReuseSource.of(latest) if latest is not None else None


def _described(regions: Sequence[Region]) -> Described:
    """The regions' keys, tags and meta: what the manifest's records need of them but their chunks."""
    metas = [_own_meta(region.meta) for region in regions]
    return [region.key for region in regions], [region.tag for region in regions], metas


def _own_meta(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """A region's meta as its record keeps it: a copy, but for a PlainMeta, which its maker built for this.

    A PlainMeta stays one, so the manifest's meta text takes the fast encoding (see manifest.meta_text).
    """
    return meta if type(meta) is PlainMeta else dict(meta)


def _check_free_space(
    root: SpillRoot,
    sizes: Sequence[int],
    reusable: Mapping[tuple[str, int], ChunkRef],
) -> None:
    """Refuse before writing anything when even the best reuse could not make the snapshot fit.

    What the regions need at the least: their bytes. Small chunks are packed
    (see _Packer.reserve), so a page per region would refuse a model of many
    small tensors that fits: 711 MB asked for at 100,000 tensors of 512 MiB,
    540 MB written. A disk that fills up while writing is still caught, and
    nothing is published then either.
    """
    needed = max(0, sum(sizes) - sum(chunk.length for chunk in reusable.values()))
    free = free_bytes(root.path)
    if needed + FREE_SPACE_MARGIN > free:
        raise StorageError(
            f"not enough space in {root.path}: the snapshot needs {needed + FREE_SPACE_MARGIN} bytes "
            f"({_mib(needed + FREE_SPACE_MARGIN)}), {free} are free ({_mib(free)})",
            hint="free space or choose another --to directory",
        )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class _Stream:
    """One spill's chunks through stagers, arenas and writers; the refs of every chunk at the end."""

    def __init__(
        self,
        regions: Sequence[Region],
        sizes: Sequence[int],
        segments: _Segments,
        reusable: dict[tuple[str, int], ChunkRef],
        options: WriteOptions,
        total: int,
        progress: ProgressFn | None,
        cancelled: CancelledFn | None,
        root: SpillRoot,
    ) -> None:
        chunk = options.effective_chunk_bytes
        self._regions = regions
        self._segments = segments
        self._previous = reusable
        self._options = options
        self._total = total
        self._progress = progress
        self._cancelled = cancelled
        self._root = root
        self._tasks = [
            (index, offset, min(chunk, size - offset))
            for index, size in enumerate(sizes)
            for offset in range(0, size, chunk)
        ]
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

    def run(self, pin: PinFn | None, budget: int, beside: Callable[[Pipeline], None] | None = None) -> None:
        """Stage, hash and write every task of this pass, within ``budget`` bytes of staging.

        ``beside`` starts more work in the same pipeline (the reuse check): the
        first failure of either stops both.
        """
        padded = [align_up(self._tasks[task][2]) for task in self._queue]
        arena = arena_bytes_for(budget, sum(padded), max(padded, default=ALIGNMENT))
        pool = StagingPool(ARENAS * arena, arena, pin)
        pipeline = Pipeline()
        packer = _Packer(pool, pipeline.abort)
        remaining = [self._options.stage_threads]

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
                    packer.close(self._options.io_threads)

        try:
            if beside is not None:
                beside(pipeline)
            for n in range(self._options.io_threads):
                pipeline.start(f"write-{n}", lambda: self._write(packer, pool, pipeline.abort))
            for n in range(self._options.stage_threads):
                pipeline.start(f"stage-{n}", stage_then_close)
            pipeline.join()
        finally:
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
        """How many chunks each region has, in order (what the manifest's records.chunks holds)."""
        counts = [0] * len(self._regions)
        for index, _, _ in self._tasks:
            counts[index] += 1
        return counts

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

    def _stage(self, packer: _Packer, abort: threading.Event) -> None:
        cancelled = self._cancelled
        while tasks := self._take_tasks(abort):
            if cancelled is not None and cancelled():
                raise AbortedError("the spill was called off before it finished; nothing was published")
            small: list[tuple[int, memoryview]] = []
            reused = 0
            for task in tasks:
                index, offset, length = self._tasks[task]
                view = self._regions[index].host_view(offset, length) if length <= _SMALL_COPY else None
                if view is not None:
                    small.append((task, view))
                else:
                    reused += self._stage_one(packer, task)
            if small:
                reused += self._stage_small(packer, small)
            if reused:
                self._advance(0, reused)  # written bytes count once the writer has written them
                self.news.set()

    def _stage_small(self, packer: _Packer, chunks: list[tuple[int, memoryview]]) -> int:
        """Stage a run of small host chunks; the bytes found already written (nothing is copied for them).

        Hashed in place and copied a run at a time (bulk.checksums and
        bulk.stage), not through the region's call per chunk; each checksum
        is of the staged copy, the very bytes written.
        """
        reused = 0
        if self._hash_in_place:
            changed = []
            digests = bulk.checksums([view for _, view in chunks])
            for (task, view), digest in zip(chunks, digests, strict=True):
                if self._reuse(task, (digest, len(view)), claim=False):
                    reused += len(view)
                else:
                    changed.append((task, view))
            chunks = changed
        start = 0
        while start < len(chunks):
            arena, slots = packer.reserve([(task, len(view)) for task, view in chunks[start:]])
            try:
                run = chunks[start : start + len(slots)]  # what fits in this arena
                staged = [(s.position, s.padded, view) for s, (_, view) in zip(slots, run, strict=True)]
                for slot, digest in zip(slots, bulk.stage(arena.buffer.view, staged), strict=True):
                    if not self._claim(slot, digest):
                        reused += slot.length
            finally:
                packer.finish(arena, slots)
            start += len(slots)
        return reused

    def _stage_one(self, packer: _Packer, task: int) -> int:
        """Stage one chunk through its region's copy; its bytes if found already written, else 0."""
        index, offset, length = self._tasks[task]
        region = self._regions[index]
        if self._hash_in_place:
            in_place = region.host_view(offset, length)
            if in_place is not None and self._reuse(task, (checksum(in_place), length), claim=False):
                return length
            del in_place
        arena, slots = packer.reserve([(task, length)])
        try:
            region.copy_out(offset, arena.buffer.view[slots[0].position : slots[0].position + length])
            live = self._hash_staged(arena.buffer.view, slots[0])
        finally:
            packer.finish(arena, slots)
        return 0 if live else length

    def _hash_staged(self, buffer: memoryview, slot: _Slot) -> bool:
        """A chunk copied into its slot: pad it to its page, checksum it, and say whether it is written."""
        end = slot.position + slot.length
        if slot.padded > slot.length:
            buffer[end : slot.position + slot.padded] = _ZEROS[: slot.padded - slot.length]
        return self._claim(slot, checksum(buffer[slot.position : end]))

    def _claim(self, slot: _Slot, digest: str) -> bool:
        """Record a staged chunk's checksum; whether it is written (live), not found written already.

        The checksum is of the staged copy, the very bytes the writer writes.
        """
        slot.digest = digest
        slot.live = not self._reuse(slot.task, (digest, slot.length), claim=True)
        return slot.live

    def _write(self, packer: _Packer, pool: StagingPool, abort: threading.Event) -> None:
        while True:
            try:
                arena = packer.sealed.get(timeout=0.05)
            except queue.Empty:
                if abort.is_set():
                    raise PipelineAborted() from None
                continue
            if arena is None:
                return
            try:
                while not arena.filled.wait(0.05):
                    if abort.is_set():
                        raise PipelineAborted()
                if abort.is_set():
                    raise PipelineAborted()
                self._write_arena(arena)
            finally:
                pool.give(arena.buffer)

    def _write_arena(self, arena: _Arena) -> None:
        live = [slot for slot in arena.slots if slot.live]
        if not live:
            return
        spans = arena.live_spans()
        size = sum(end - start for start, end in spans)
        views = [arena.buffer.view[start:end] for start, end in spans]
        try:
            file, name, offset = self._segments.allocate(size)
        except OSError as exc:
            raise _io_error(exc, self._root, self._segments.next_path(), self.written, self._total) from exc
        try:
            write_views(file, views, offset)
        except OSError as exc:
            raise _io_error(exc, self._root, self._segments.path_of(name), self.written, self._total) from exc
        # Each live slot lies in one span; the spans lie back to back in the file from ``offset``.
        span = 0
        span_at = offset  # where spans[span] starts in the file
        for slot in live:
            while slot.position >= spans[span][1]:
                span_at += spans[span][1] - spans[span][0]
                span += 1
            position = span_at + slot.position - spans[span][0]
            self._placed[slot.task] = ChunkRef(name, position, slot.length, slot.digest)
        self._advance(sum(slot.length for slot in live), 0)
