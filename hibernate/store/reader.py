"""Read a snapshot back: validate everything first, then stream and verify every chunk.

A reader refuses before any memory is touched whatever can be found wrong
without reading the data (manifest, missing or truncated or symlinked files, a
record that does not match the process). Data is then read with direct I/O
into bounded staging, and each chunk's checksum is verified *before* its bytes
are copied into the region: a corrupted weight is never handed back.
"""

from __future__ import annotations

import errno
import os
import stat
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hibernate.errors import (
    AbortedError,
    BusyError,
    PermissionDeniedError,
    SnapshotInvalidError,
    StorageError,
)
from hibernate.fsutil import open_dir
from hibernate.store.directio import DIRECT, DataFile, StagingPool, open_data_file, read_at
from hibernate.store.format import ChunkRef, Manifest, Record, align_up, checksum
from hibernate.store.layout import SpillRoot
from hibernate.store.pipeline import Pipeline
from hibernate.store.regions import Region
from hibernate.store.writer import CancelledFn, PinFn, ProgressFn


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


def _describe_mismatch(record: Record, region: Region) -> str | None:
    if record.key != region.key:
        return f"holds {record.key!r} where the process has {region.key!r}"
    if record.tag != region.tag:
        return f"{record.key!r}: tag {record.tag!r} in the snapshot, {region.tag!r} in the process"
    if record.nbytes != region.nbytes:
        return f"{record.key!r}: {record.nbytes} bytes in the snapshot, {region.nbytes} in the process"
    live = dict(region.meta)
    for name in sorted(set(record.meta) | set(live)):
        if record.meta.get(name) != live.get(name):
            return (
                f"{record.key!r}: {name} is {record.meta.get(name)!r} in the snapshot, "
                f"{live.get(name)!r} in the process"
            )
    return None


class SnapshotReader:
    """A published snapshot opened for reading (shared lock on its root)."""

    def __init__(self, root: SpillRoot, name: str, *, io_mode: str = "auto") -> None:
        self.root = root
        if not root.lock(exclusive=False):
            raise BusyError(f"{root.path} is being written or collected by another hibernate")
        self._files: dict[str, DataFile] = {}
        try:
            self.manifest: Manifest = root.read_manifest(name)
            self._open_files(io_mode != "buffered")
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

    def _open_files(self, prefer_direct: bool) -> None:
        needed: dict[str, tuple[int, Record]] = {}
        for record in self.manifest.records:
            for chunk in record.chunks:
                if chunk.length > self.manifest.chunk_bytes:
                    raise SnapshotInvalidError(
                        f"{self.root.path / chunk.file}: record {record.key!r} has a chunk of "
                        f"{chunk.length} bytes, more than the snapshot's chunk size"
                    )
                end = chunk.offset + chunk.length
                if end > needed.get(chunk.file, (0, record))[0]:
                    needed[chunk.file] = (end, record)
        for file, (end, record) in sorted(needed.items()):
            path = self.root.path / file
            directory, name = file.split("/")
            try:
                dir_fd = open_dir(directory, dir_fd=self.root.fd)
            except FileNotFoundError as exc:
                raise SnapshotInvalidError(f"{path} is missing (needed by {record.key!r})") from exc
            except PermissionDeniedError as exc:
                raise SnapshotInvalidError(f"{self.root.path / directory}: {exc.message}") from exc
            try:
                data = open_data_file(dir_fd, name, prefer_direct)
            except FileNotFoundError as exc:
                raise SnapshotInvalidError(f"{path} is missing (needed by {record.key!r})") from exc
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise SnapshotInvalidError(
                        f"{path} is a symbolic link; refusing to follow it out of the snapshot"
                    ) from exc
                raise StorageError(f"cannot open {path}: {exc.strerror}") from exc
            finally:
                os.close(dir_fd)
            self._files[file] = data
            info = os.fstat(data.fd)
            if not stat.S_ISREG(info.st_mode):
                raise SnapshotInvalidError(f"{path} is not a regular file")
            if info.st_size < end:
                raise SnapshotInvalidError(
                    f"{path} is truncated: {info.st_size} bytes, but {record.key!r} needs {end}"
                )

    def check_matches(self, regions: Sequence[Region]) -> None:
        """The snapshot must describe exactly these regions, in this order."""
        records = self.manifest.records
        if len(records) != len(regions):
            raise SnapshotInvalidError(
                f"{self.root.path / self.manifest.snapshot}: {len(records)} records in the snapshot, "
                f"{len(regions)} regions in the process"
            )
        for record, region in zip(records, regions, strict=True):
            problem = _describe_mismatch(record, region)
            if problem is not None:
                raise SnapshotInvalidError(f"{self.root.path / self.manifest.snapshot}: record {problem}")

    def read_into(
        self,
        regions: Sequence[Region],
        *,
        buffer_bytes: int = 256 << 20,
        threads: int = 3,
        progress: ProgressFn | None = None,
        cancelled: CancelledFn | None = None,
        pin: PinFn | None = None,
    ) -> ReadResult:
        """Fill every region from the snapshot, verifying each chunk before it is copied in."""
        self.check_matches(regions)
        started = time.perf_counter()
        tasks: list[tuple[int, int, ChunkRef]] = []
        for index, record in enumerate(self.manifest.records):
            offset = 0
            for chunk in record.chunks:
                tasks.append((index, offset, chunk))
                offset += chunk.length
        total = self.manifest.total_bytes
        chunk_bytes = align_up(self.manifest.chunk_bytes)
        pool = StagingPool(max(buffer_bytes, 2 * chunk_bytes), chunk_bytes, pin)
        pipeline = Pipeline()
        lock = threading.Lock()
        state = {"next": 0, "done": 0}

        def take_task() -> int | None:
            with lock:
                if state["next"] >= len(tasks) or pipeline.abort.is_set():
                    return None
                state["next"] += 1
                return state["next"] - 1

        def work() -> None:
            while (task := take_task()) is not None:
                if cancelled is not None and cancelled():
                    raise AbortedError("the wake was called off before it finished")
                index, region_offset, chunk = tasks[task]
                buffer = pool.take(pipeline.abort)
                try:
                    self._read_chunk(chunk, buffer.view, self.manifest.records[index], region_offset)
                    regions[index].copy_in(region_offset, buffer.view[: chunk.length])
                finally:
                    pool.give(buffer)
                with lock:
                    state["done"] += chunk.length
                    done = state["done"]
                if progress is not None:
                    progress(done, total)

        try:
            for n in range(max(1, threads)):
                pipeline.start(f"read-{n}", work)
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

    def _read_chunk(self, chunk: ChunkRef, view: memoryview, record: Record, region_offset: int) -> None:
        path = self.root.path / chunk.file
        try:
            got = read_at(self._files[chunk.file], view[: align_up(chunk.length)], chunk.offset)
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror}") from exc
        where = f"{path}: record {record.key!r} bytes {region_offset}..{region_offset + chunk.length}"
        if got < chunk.length:
            raise SnapshotInvalidError(f"{where}: file is truncated ({got} of {chunk.length} bytes read)")
        if checksum(view[: chunk.length]) != chunk.checksum:
            raise SnapshotInvalidError(f"{where}: checksum mismatch; the data on disk is corrupted")
