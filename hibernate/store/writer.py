"""Write a snapshot: copy, checksum and stream regions to disk through bounded staging.

The staging memory (the only host memory a spill adds, whatever its size) is
split into a few large *arenas* (arena.py). Two kinds of worker share them
(stream.py):

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

Nothing becomes visible until the manifest is written and the temporary
directory is renamed (see layout.py): a failure anywhere leaves the temporary
directory removed and the memory untouched.

Release only after proof: a snapshot's every byte is either written now
(checksummed from memory, fsynced) or reused from the previous snapshot and
read back by this sleep, its checksum checked. Candidates for reuse are the
previous snapshot's files whose identity (device, inode, size, mtime, ctime)
is still the one recorded when they were verified; they are hard-linked into
the new snapshot's own directory before anything is streamed (reuse.py), so
the new snapshot is self-contained; a file that changed, vanished or cannot
be linked is not reused, and its bytes are written again. Identity cannot see
bytes that changed below the file system, so every chunk the stream reuses is
read back beside it (reusecheck.ReuseCheck, within the same staging budget),
and one that no longer matches, or cannot be read, is written again in a
second pass (stream.Stream.rewrite) before the manifest is written.
``check_reuse=False`` (--skip-reuse-check) trusts identity alone; the result
then says how many bytes were reused unread.
"""

from __future__ import annotations

import contextlib
import operator
import os
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate import faults
from hibernate.errors import SnapshotInvalidError, StorageError, UnsupportedError
from hibernate.fsutil import free_bytes, write_file_atomic
from hibernate.gcpause import gc_paused
from hibernate.store.directio import KeptStaging
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import (
    MANIFEST_NAME,
    MAX_RECORDS,
    ChunkRef,
    Columns,
    FileIdentity,
    Manifest,
    PlainMeta,
    manifest_digest,
    meta_text,
    snapshot_name,
)
from hibernate.store.options import WriteOptions
from hibernate.store.parse import check_region, regions_plain
from hibernate.store.pipeline import CancelledFn, PinFn, ProgressFn
from hibernate.store.regions import Region
from hibernate.store.reuse import (
    ReuseSource,
    link_reusable,
    previous_snapshot,
    rewritten_warnings,
    trim_to_used,
    unread_warning,
)
from hibernate.store.reusecheck import ReuseCheck, plan_staging
from hibernate.store.stream import Segments, Stream
from hibernate.store.tuning import Tuning, choose

# Each region's key, tag and meta, in order: what a snapshot's records hold of a region but its chunks.
Described = tuple[list[str], list[str], list[Mapping[str, Any]]]
_LENGTH = operator.itemgetter(2)  # of a ChunkRef
FREE_SPACE_MARGIN = 1 << 20  # the manifest and the filesystem's own bookkeeping


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
    manifest_digest: str  # of the published manifest's bytes (see RememberedManifest)
    warnings: list[str] = field(default_factory=list)
    # Of written_bytes, the bytes the previous snapshot held but the disk no longer gave back as
    # written (or could not read): found by the reuse check, written again from memory.
    rewritten_bytes: int = 0
    reuse_read_bytes: int = 0  # read back from the previous snapshot's files to check what is reused
    reused_unread_bytes: int = 0  # reused without being read back (the check was skipped)
    tuning: Tuning | None = None  # what the writes ran with

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
            "tuning": self.tuning.to_wire() if self.tuning is not None else None,
        }


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
    kept: KeptStaging | None = None,
) -> WriteResult:
    """Write ``regions`` as a new published snapshot of ``root``; all or nothing.

    A root left with nothing in it (the first sleep of a process failed) is
    removed, so failed sleeps leave no empty directories behind.

    ``known``: the root's newest snapshot as the caller holds it already
    (from the manifest its last wake read), which saves parsing the manifest
    again for reuse (a fifth of an unchanged sleep of 20,000 tensors). It is
    used only if it names the newest snapshot; whatever it says, a chunk is
    reused only from a file whose identity is still the one it records (see
    link_reusable). ``kept``: the process's staging kept between
    transfers, taken from and given back to (directio.KeptStaging).
    """
    options = options or WriteOptions()
    started = time.perf_counter()
    root.lock_for_write()
    try:
        with gc_paused():  # a few objects per region and per chunk: see gc_paused
            return _write_locked(
                root, regions, producer, options, progress, cancelled, pin, started, known, kept
            )
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
    kept: KeptStaging | None,
) -> WriteResult:
    described: Described | None = check_regions(regions)
    try:
        root.sweep_unfinished()
    except OSError as exc:
        raise StorageError(
            f"cannot clear unfinished snapshots in {root.path}: {exc.strerror or exc}"
        ) from exc
    previous = previous_snapshot(root, known) if options.reuse else None
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
        segments = Segments(root, tmp_fd, tmp_name, options)
        check: ReuseCheck | None = None
        try:
            if not reusable and not _shares_metas(described):
                # A first sleep stages all it writes: copies of the regions' meta (20 MiB at 100,000
                # tensors) would add to its peak memory, so they are dropped now, taken again after.
                # Kept where every meta is the region's own (a PlainMeta): three lists of references,
                # where describing the regions again took 0.05-0.1 s at 100,000 tensors.
                described = None
            tuning = choose(tmp_fd, io_depth=options.io_threads, workers=options.stage_threads)
            stream = Stream(
                regions, sizes, segments, reusable, options, tuning, total, progress, cancelled, root, kept
            )
            if reusable and options.check_reuse:
                check = ReuseCheck(
                    tmp_fd,
                    reusable.values(),
                    stream.marks,
                    stream.news,
                    stream.decided,
                    io_mode=options.io_mode,
                    cancelled=cancelled,
                    kept=kept,
                )
                staging = _stream_then_check(stream, check, options, sizes, reusable, pin)
                if check.outcome.failed:
                    for ref in check.outcome.failed:  # out of the index: the links are trimmed of them
                        if reusable.get((ref.checksum, ref.length)) is ref:
                            del reusable[(ref.checksum, ref.length)]
                    stream.rewrite(check.outcome.failed, pin, options.buffer_bytes)
                    staging = max(staging, stream.staging_bytes)
                    assert previous is not None  # a chunk was checked: there was a previous snapshot
                    warnings += rewritten_warnings(
                        check.outcome, linked.origins, root.path / previous.snapshot
                    )
            else:
                stream.run(pin, options.buffer_bytes)
                staging = stream.staging_bytes
            chunks = stream.resolve()
            unread = 0 if check is not None else sum(map(_LENGTH, stream.marks))
            if unread:
                assert previous is not None  # a chunk was reused: there was a previous snapshot
                warnings.append(unread_warning(unread, root.path / previous.snapshot))
            keys, tags, metas = described or _described(regions)
            segments.finish()
            in_use = trim_to_used(tmp_fd, links, chunks, reusable, previous)
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
            raise stream.io_error(exc, None) from exc
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
            raise stream.io_error(exc, root.path / tmp_name / MANIFEST_NAME) from exc
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
        manifest_digest=manifest_digest(encoded),
        warnings=warnings,
        rewritten_bytes=stream.rewritten,
        reuse_read_bytes=check.outcome.read_bytes if check is not None else 0,
        reused_unread_bytes=unread,
        tuning=stream.tuning,
    )


def _stream_then_check(
    stream: Stream,
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


def _described(regions: Sequence[Region]) -> Described:
    """The regions' keys, tags and meta: what the manifest's records need of them but their chunks."""
    metas = [_own_meta(region.meta) for region in regions]
    return [region.key for region in regions], [region.tag for region in regions], metas


def _shares_metas(described: Described | None) -> bool:
    """Whether every meta of ``described`` is the region's own object, not a copy (see _own_meta)."""
    return described is not None and all(type(meta) is PlainMeta for meta in described[2])


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
    (see arena.Packer.reserve), so a page per region would refuse a model of many
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
