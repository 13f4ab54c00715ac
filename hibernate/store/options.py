"""How a snapshot is written: the options of write_snapshot, refused when out of range."""

from __future__ import annotations

from dataclasses import dataclass

from hibernate.store.arena import ARENAS, arena_bytes
from hibernate.store.manifest import ALIGNMENT, MAX_CHUNK_BYTES

IO_MODES = ("auto", "direct", "buffered")
MIN_BUFFER_BYTES = 4 * ARENAS * ALIGNMENT


@dataclass(frozen=True)
class WriteOptions:
    """How a snapshot is written; sizes are what the benchmark tuned, threads follow the machine."""

    buffer_bytes: int = 256 << 20  # all staging memory together
    chunk_bytes: int = 32 << 20  # unit of checksum and reuse; capped at one arena
    segment_bytes: int = 1 << 30  # start a new data file past this size
    io_mode: str = "auto"  # auto | direct | buffered
    # Copy + checksum workers (and in-place hashing of unchanged chunks), and writers (requests in
    # flight, each to a data file of its own); None: chosen from the machine and the filesystem
    # (store.tuning).
    stage_threads: int | None = None
    io_threads: int | None = None
    reuse: bool = True  # refer to unchanged chunks of the previous snapshot
    # Read every reused chunk back and check it before anything is released (see reusecheck);
    # False trusts the previous snapshot's files as the last wake left them (--skip-reuse-check).
    check_reuse: bool = True
    verify: bool = False  # read the published snapshot back before returning (see verify_snapshot)
    # Staging the process may keep when the transfer ends, for its next ones (directio.KeptStaging);
    # 0: all of it is given back.
    keep_staging_bytes: int = 0

    def __post_init__(self) -> None:
        if self.io_mode not in IO_MODES:
            raise ValueError(f"io_mode must be one of {IO_MODES}, not {self.io_mode!r}")
        if self.chunk_bytes < ALIGNMENT or self.chunk_bytes % ALIGNMENT or self.chunk_bytes > MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be a multiple of {ALIGNMENT} between 4 KiB and 1 GiB")
        if self.buffer_bytes < MIN_BUFFER_BYTES:
            raise ValueError(f"buffer_bytes must be at least {MIN_BUFFER_BYTES} bytes")
        if self.keep_staging_bytes < 0:
            raise ValueError("keep_staging_bytes must be 0 or more")
        if self.segment_bytes < ALIGNMENT:
            raise ValueError("segment_bytes must be at least 4 KiB")
        if (self.stage_threads is not None and self.stage_threads < 1) or (
            self.io_threads is not None and self.io_threads < 1
        ):
            raise ValueError("stage_threads and io_threads must be at least 1")

    @property
    def effective_chunk_bytes(self) -> int:
        """The chunk size used: ``chunk_bytes``, unless one staging arena is smaller."""
        return min(self.chunk_bytes, arena_bytes(self.buffer_bytes))
