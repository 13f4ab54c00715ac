"""Write a snapshot: copy, checksum and stream regions to disk through bounded staging.

Two kinds of worker share a fixed set of staging buffers (the only host memory
a spill adds, whatever its size):

* stagers take the next chunk, checksum it (in place when the region is host
  memory), and skip it entirely when the previous snapshot already holds the
  same bytes; otherwise they copy it into a staging buffer;
* writers append staged chunks to the current data file with direct I/O.

Chunks are written in the order they are staged, so each data file grows
sequentially, which is what this kind of disk does fastest.
"""

from __future__ import annotations

import errno
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate.errors import AbortedError, StorageError
from hibernate.fsutil import free_bytes, write_file_atomic
from hibernate.store.directio import (
    BUFFERED,
    DIRECT,
    DataFile,
    PipelineAborted,
    StagingBuffer,
    StagingPool,
    create_data_file,
    direct_io_supported,
    finish_write,
    write_at,
)
from hibernate.store.format import (
    MANIFEST_NAME,
    ChunkRef,
    Manifest,
    Record,
    align_up,
    checksum,
    snapshot_name,
)
from hibernate.store.layout import SpillRoot
from hibernate.store.pipeline import Pipeline
from hibernate.store.regions import Region

ProgressFn = Callable[[int, int], None]
CancelledFn = Callable[[], bool]
PinFn = Callable[[memoryview], Callable[[], None]]

IO_MODES = ("auto", "direct", "buffered")


@dataclass(frozen=True)
class WriteOptions:
    buffer_bytes: int = 256 << 20  # all staging memory together
    chunk_bytes: int = 32 << 20  # unit of copy, checksum, reuse and I/O
    segment_bytes: int = 1 << 30  # start a new data file past this size
    io_mode: str = "auto"  # auto | direct | buffered
    stage_threads: int = 2
    io_threads: int = 2
    reuse: bool = True  # refer to unchanged chunks of the previous snapshot

    def __post_init__(self) -> None:
        if self.io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {IO_MODES}, not {self.io_mode!r}")
        if self.chunk_bytes < 4096 or self.chunk_bytes % 4096:
            raise ValueError("chunk_bytes must be a positive multiple of 4096")
        if self.buffer_bytes < 2 * self.chunk_bytes:
            raise ValueError("buffer_bytes must hold at least two chunks")


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
        }


def _reusable_chunks(root: SpillRoot, previous: Manifest | None) -> dict[tuple[str, int], ChunkRef]:
    """Chunks of the previous snapshot whose data file is present and long enough."""
    if previous is None:
        return {}
    sizes: dict[str, int] = {}
    for file in previous.files():
        try:
            sizes[file] = os.stat(file, dir_fd=root.fd, follow_symlinks=False).st_size
        except OSError:
            sizes[file] = -1
    index: dict[tuple[str, int], ChunkRef] = {}
    for record in previous.records:
        for chunk in record.chunks:
            if chunk.offset + chunk.length <= sizes[chunk.file]:
                index.setdefault((chunk.checksum, chunk.length), chunk)
    return index


class _Segments:
    """Data files of the snapshot being written, appended to in order."""

    def __init__(self, dir_fd: int, snapshot: str, segment_bytes: int, direct: bool) -> None:
        self._dir_fd = dir_fd
        self._snapshot = snapshot
        self._segment_bytes = segment_bytes
        self._direct = direct
        self._lock = threading.Lock()
        self.files: list[DataFile] = []
        self._offset = 0

    def allocate(self, padded: int) -> tuple[DataFile, str, int]:
        with self._lock:
            if not self.files or (self._offset and self._offset + padded > self._segment_bytes):
                name = f"data-{len(self.files):03d}.bin"
                self.files.append(create_data_file(self._dir_fd, name, self._direct))
                self._offset = 0
            offset = self._offset
            self._offset += padded
            return self.files[-1], f"{self._snapshot}/data-{len(self.files) - 1:03d}.bin", offset

    @property
    def mode(self) -> str:
        if not self.files:
            return DIRECT if self._direct else BUFFERED
        return DIRECT if all(f.mode == DIRECT for f in self.files) else BUFFERED

    def finish(self) -> None:
        for file in self.files:
            finish_write(file)

    def close(self) -> None:
        for file in self.files:
            file.close()
        self.files.clear()


def _choose_direct(root: SpillRoot, io_mode: str) -> bool:
    if io_mode == "auto":
        return direct_io_supported(root.path)
    return io_mode == "direct"


def _io_error(exc: OSError, root: SpillRoot, done: int, total: int) -> StorageError:
    if exc.errno == errno.ENOSPC:
        return StorageError(
            f"no space left on the device of {root.path} after {done} of {total} bytes; "
            "nothing was published and the process keeps its memory",
            hint="free space or choose another --to directory, then sleep again",
        )
    return StorageError(f"I/O error writing the snapshot in {root.path}: {exc.strerror or exc}")


def write_snapshot(
    root: SpillRoot,
    regions: Sequence[Region],
    *,
    producer: Mapping[str, Any],
    options: WriteOptions | None = None,
    progress: ProgressFn | None = None,
    cancelled: CancelledFn | None = None,
    pin: PinFn | None = None,
) -> WriteResult:
    """Write ``regions`` as a new published snapshot of ``root``; all or nothing."""
    options = options or WriteOptions()
    started = time.perf_counter()
    root.lock_for_write()
    try:
        previous = root.latest_manifest() if options.reuse else None
        reusable = _reusable_chunks(root, previous)
        total = sum(r.nbytes for r in regions)
        _check_free_space(root, regions, options.chunk_bytes, previous)
        sequence = root.next_sequence()
        name = snapshot_name(sequence)
        direct = _choose_direct(root, options.io_mode)
        root.sweep(
            referenced=previous.files() if previous else set(),
            keep_dir=previous.snapshot if previous else None,
        )
        with root.staging_dir(sequence, secrets.token_hex(4)) as (tmp_name, tmp_fd):
            segments = _Segments(tmp_fd, name, options.segment_bytes, direct)
            try:
                chunks, written, reused, staging = _stream(
                    regions, segments, reusable, options, total, progress, cancelled, pin, root
                )
                segments.finish()
            except OSError as exc:
                raise _io_error(exc, root, 0, total) from exc
            finally:
                io_mode = segments.mode
                data_files = len(segments.files)
                segments.close()
            records = []
            for index, region in enumerate(regions):
                records.append(
                    Record(
                        region.key,
                        region.tag,
                        region.nbytes,
                        dict(region.meta),
                        tuple(chunks[index]),
                    )
                )
            manifest = Manifest(
                snapshot=name,
                producer={**producer, "hostname": socket.gethostname()},
                chunk_bytes=options.chunk_bytes,
                records=tuple(records),
                created_unix=time.time(),
            )
            try:
                write_file_atomic(tmp_fd, MANIFEST_NAME, manifest.encode())
                root.publish(tmp_name, name)
            except OSError as exc:
                raise _io_error(exc, root, written, total) from exc
        warnings = []
        try:
            root.retire_all_but(manifest)
        except OSError as exc:
            warnings.append(f"older snapshots in {root.path} could not be removed: {exc}")
        return WriteResult(
            snapshot=name,
            path=root.path / name,
            total_bytes=total,
            written_bytes=written,
            reused_bytes=reused,
            seconds=time.perf_counter() - started,
            io_mode=io_mode,
            staging_bytes=staging,
            data_files=data_files,
            manifest=manifest,
            warnings=warnings,
        )
    finally:
        root.unlock()


def _check_free_space(
    root: SpillRoot, regions: Sequence[Region], chunk_bytes: int, previous: Manifest | None
) -> None:
    """Refuse early when even full reuse of the previous snapshot could not make it fit."""
    needed = sum(
        align_up(min(r.nbytes - o, chunk_bytes)) for r in regions for o in range(0, r.nbytes, chunk_bytes)
    )
    if previous is not None:
        needed = max(0, needed - previous.total_bytes)
    free = free_bytes(root.path)
    if needed + (1 << 20) > free:
        raise StorageError(
            f"not enough space in {root.path}: the snapshot needs {needed} bytes, {free} are free",
            hint="free space or choose another --to directory",
        )


def _stream(
    regions: Sequence[Region],
    segments: _Segments,
    reusable: dict[tuple[str, int], ChunkRef],
    options: WriteOptions,
    total: int,
    progress: ProgressFn | None,
    cancelled: CancelledFn | None,
    pin: PinFn | None,
    root: SpillRoot,
) -> tuple[list[list[ChunkRef]], int, int, int]:
    tasks = [
        (index, offset, min(options.chunk_bytes, region.nbytes - offset))
        for index, region in enumerate(regions)
        for offset in range(0, region.nbytes, options.chunk_bytes)
    ]
    placed: list[ChunkRef | None] = [None] * len(tasks)
    pool = StagingPool(options.buffer_bytes, options.chunk_bytes, pin)
    pipeline = Pipeline()
    staged: queue.Queue[tuple[int, StagingBuffer, int, str] | None] = queue.Queue()
    lock = threading.Lock()
    counters = {"next": 0, "done": 0, "written": 0, "reused": 0}

    def advance(length: int, *, wrote: bool) -> None:
        with lock:
            counters["done"] += length
            counters["written" if wrote else "reused"] += length
            done = counters["done"]
        if progress is not None:
            progress(done, total)

    def take_task() -> int | None:
        with lock:
            if counters["next"] >= len(tasks) or pipeline.abort.is_set():
                return None
            counters["next"] += 1
            return counters["next"] - 1

    def reuse(task: int, digest: str, length: int) -> bool:
        with lock:
            hit = reusable.get((digest, length))
        if hit is None:
            return False
        placed[task] = hit
        advance(length, wrote=False)
        return True

    def stage() -> None:
        while (task := take_task()) is not None:
            if cancelled is not None and cancelled():
                raise AbortedError("the spill was called off before it finished; nothing was published")
            index, offset, length = tasks[task]
            region = regions[index]
            in_place = region.host_view(offset, length)
            digest = checksum(in_place) if in_place is not None else None
            if digest is not None and reuse(task, digest, length):
                continue
            buffer = pool.take(pipeline.abort)
            region.copy_out(offset, buffer.view[:length])
            if digest is None:
                digest = checksum(buffer.view[:length])
                if reuse(task, digest, length):
                    pool.give(buffer)
                    continue
            padded = align_up(length)
            if padded > length:
                buffer.view[length:padded] = bytes(padded - length)
            staged.put((task, buffer, length, digest))

    def write() -> None:
        while True:
            try:
                item = staged.get(timeout=0.1)
            except queue.Empty:
                if pipeline.abort.is_set():
                    raise PipelineAborted() from None
                continue
            if item is None:
                return
            task, buffer, length, digest = item
            try:
                file, name, offset = segments.allocate(align_up(length))
                write_at(file, buffer.view[: align_up(length)], offset)
            finally:
                pool.give(buffer)
            ref = ChunkRef(name, offset, length, digest)
            placed[task] = ref
            with lock:
                reusable.setdefault((digest, length), ref)
            advance(length, wrote=True)

    try:
        for n in range(max(1, options.io_threads)):
            pipeline.start(f"write-{n}", write)
        remaining = [max(1, options.stage_threads)]

        def stage_then_signal() -> None:
            """The last stager to finish tells every writer there is no more."""
            try:
                stage()
            finally:
                with lock:
                    remaining[0] -= 1
                    last = remaining[0] == 0
                if last:
                    for _ in range(max(1, options.io_threads)):
                        staged.put(None)

        for n in range(remaining[0]):
            pipeline.start(f"stage-{n}", stage_then_signal)
        try:
            pipeline.join()
        except OSError as exc:
            raise _io_error(exc, root, counters["written"], total) from exc
    finally:
        staging_bytes = pool.total_bytes
        pool.close()
    chunks: list[list[ChunkRef]] = [[] for _ in regions]
    for (index, _, _), ref in zip(tasks, placed, strict=True):
        assert ref is not None, "every chunk is placed once the pipeline finished cleanly"
        chunks[index].append(ref)
    return chunks, counters["written"], counters["reused"], staging_bytes
