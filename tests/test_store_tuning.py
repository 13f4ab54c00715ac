"""A transfer's requests in flight and threads, chosen from the machine and the filesystem."""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hibernate.limits import MAX_IO_DEPTH
from hibernate.store import directio, tuning
from hibernate.store.directio import BUFFERED, DataFile, ParallelReads, PipelineAbortedError
from hibernate.store.layout import SpillRoot
from hibernate.store.reader import SnapshotReader
from hibernate.store.readplan import read_request_bytes
from hibernate.store.tuning import LOCAL, MEMORY, NETWORK
from tests.test_store_roundtrip import BytesRegion, small_options, write


@pytest.fixture
def tmp_fd(tmp_path: Path) -> Iterator[int]:
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


@pytest.mark.parametrize(("cores", "workers"), [(1, 2), (2, 2), (4, 2), (8, 4), (16, 8), (128, 8)])
def test_workers_are_half_the_cores_within_two_and_eight(cores: int, workers: int) -> None:
    assert tuning.default_workers(cores) == workers


def test_a_network_filesystem_gets_eight_requests_in_flight_a_local_disk_one_memory_one_per_worker() -> None:
    assert tuning.default_io_depth(NETWORK, 2) == 8
    assert tuning.default_io_depth(LOCAL, 8) == 1
    assert tuning.default_io_depth(MEMORY, 6) == 6


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm here")
def test_tmpfs_is_memory() -> None:
    fd = os.open("/dev/shm", os.O_RDONLY | os.O_DIRECTORY)
    try:
        name, kind = tuning.filesystem_of(fd)
    finally:
        os.close(fd)
    assert (name, kind) == ("tmpfs", MEMORY)


def test_what_is_given_is_used_and_the_rest_chosen(tmp_fd: int) -> None:
    chosen = tuning.choose(tmp_fd, io_depth=5, cores=16)
    assert (chosen.io_depth, chosen.workers) == (5, 8)
    assert tuning.choose(tmp_fd, workers=3, io_depth=1).workers == 3
    assert tuning.choose(tmp_fd, io_depth=10_000).io_depth == MAX_IO_DEPTH


def test_a_report_names_the_choice(tmp_fd: int) -> None:
    wire = tuning.choose(tmp_fd, io_depth=3, workers=2).to_wire()
    assert wire["io_depth"] == 3 and wire["workers"] == 2
    assert wire["kind"] in (LOCAL, NETWORK, MEMORY) and wire["filesystem"]


def test_read_requests_shrink_so_every_holder_can_hold_one() -> None:
    arena = 128 << 20  # two arenas: 256 MiB of staging
    assert read_request_bytes(arena, 4096, holders=3) == 32 << 20  # two readers and a buffer verified
    assert read_request_bytes(16 << 10, 4096, holders=2) == 16 << 10  # one reader: as it always was
    assert read_request_bytes(16 << 10, 4096, holders=3) == 8 << 10
    assert read_request_bytes(arena, 4096, holders=10) == (256 << 20) // 10 // 4096 * 4096
    assert read_request_bytes(arena, 64 << 20, holders=10) == 64 << 20  # never below the largest chunk


@pytest.mark.parametrize(("io_depth", "workers"), [(1, 1), (2, 2), (8, 3)])
def test_a_snapshot_reads_back_whole_with_any_number_of_requests_in_flight(
    tmp_path: Path, io_depth: int, workers: int
) -> None:
    rng = random.Random(io_depth)
    regions = [
        BytesRegion(f"r{i}", "weights", rng.randbytes(rng.randrange(1, 40_000)), host=i % 3 != 0)
        for i in range(60)
    ]
    written = write(tmp_path / "root", regions, small_options(chunk=8192, buffer=64 * 1024))
    blanks = [region.blank() for region in regions]
    with SpillRoot(tmp_path / "root") as root, SnapshotReader(root, written.snapshot) as reader:
        result = reader.read_into(blanks, buffer_bytes=64 * 1024, io_depth=io_depth, threads=workers)
    assert [bytes(b.data) for b in blanks] == [bytes(r.data) for r in regions]
    assert result.tuning is not None
    assert (result.tuning.io_depth, result.tuning.workers) == (io_depth, workers)
    assert result.to_wire()["tuning"]["io_depth"] == io_depth


@pytest.mark.parametrize("writers", [1, 4])
def test_each_writer_appends_to_a_data_file_of_its_own_and_the_snapshot_reads_back(
    tmp_path: Path, writers: int
) -> None:
    rng = random.Random(writers)
    regions = [BytesRegion(f"r{i}", "weights", rng.randbytes(rng.randrange(1, 30_000))) for i in range(80)]
    options = small_options(chunk=8192, buffer=64 * 1024, io_threads=writers, stage_threads=2)
    written = write(tmp_path / "root", regions, options)
    assert written.tuning is not None and written.tuning.io_depth == writers
    assert written.to_wire()["tuning"]["io_depth"] == writers
    files = set(written.manifest.columns.chunks.files)
    assert 1 <= len(files) <= writers, files  # a file per writer that wrote (segments of 1 GiB)
    blanks = [region.blank() for region in regions]
    with SpillRoot(tmp_path / "root") as root, SnapshotReader(root, written.snapshot) as reader:
        reader.read_into(blanks, buffer_bytes=64 * 1024)
    assert [bytes(b.data) for b in blanks] == [bytes(r.data) for r in regions]


def test_writers_are_as_many_as_the_staging_holds_arenas_of_the_largest_chunk() -> None:
    from hibernate.store.arena import arenas_for

    assert arenas_for(1, 256 << 20, 32 << 20) == 2
    assert arenas_for(8, 256 << 20, 4096) == 9
    assert arenas_for(8, 256 << 20, 32 << 20) == 8  # 8 arenas of 32 MiB: 7 writers and one filling
    assert arenas_for(8, 64 << 20, 64 << 20) == 2  # never fewer than two


def test_a_writer_appends_to_its_own_file_and_another_writer_starts_the_next(tmp_path: Path) -> None:
    from hibernate.store.stream import Segments

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    segments = Segments(SpillRoot.__new__(SpillRoot), fd, "tmp", small_options(segment_bytes=3 * 4096))
    try:
        places = [
            segments.allocate(4096, lane=0)[1:],
            segments.allocate(4096, lane=1)[1:],
            segments.allocate(4096, lane=0)[1:],
            segments.allocate(8192, lane=0)[1:],  # past the segment's size: a new file
        ]
    finally:
        segments.close()
        os.close(fd)
    assert places == [
        ("data-000.bin", 0),
        ("data-001.bin", 0),
        ("data-000.bin", 4096),
        ("data-002.bin", 0),
    ]


def parallel_file(tmp_path: Path, data: bytes) -> DataFile:
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return DataFile(os.open(path, os.O_RDONLY), BUFFERED)


def test_a_request_read_as_pieces_is_the_request_read_whole(tmp_path: Path) -> None:
    data = random.Random(1).randbytes(1 << 20)
    file = parallel_file(tmp_path, data)
    abort = threading.Event()
    pieces = ParallelReads(8, abort, piece_bytes=64 << 10)
    try:
        into = memoryview(bytearray(600_000))
        assert pieces.read(file, into, 8192) == 600_000 and bytes(into) == data[8192 : 8192 + 600_000]
        past_the_end = memoryview(bytearray(300_000))  # the file ends 150,000 bytes in
        assert pieces.read(file, past_the_end, len(data) - 150_000) == 150_000
        assert bytes(past_the_end[:150_000]) == data[-150_000:]
    finally:
        pieces.close()
        file.close()


def test_each_piece_is_read_once_whichever_thread_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = random.Random(2).randbytes(1 << 20)
    file = parallel_file(tmp_path, data)
    asked: list[tuple[int, int]] = []
    lock = threading.Lock()
    read_views = directio.read_views

    def recording(file: DataFile, views: list[memoryview], offset: int) -> int:
        with lock:
            asked.append((offset, sum(len(view) for view in views)))
        return read_views(file, views, offset)

    monkeypatch.setattr(directio, "read_views", recording)
    pieces = ParallelReads(3, threading.Event(), piece_bytes=64 << 10)
    try:
        into = memoryview(bytearray(700_000))
        assert pieces.read(file, into, 4096) == 700_000 and bytes(into) == data[4096 : 4096 + 700_000]
    finally:
        pieces.close()
        file.close()
    step = 64 << 10
    assert sorted(asked) == [(4096 + at, min(step, 700_000 - at)) for at in range(0, 700_000, step)]


def test_a_failed_piece_fails_its_request_and_an_aborted_transfer_reads_nothing_more(
    tmp_path: Path,
) -> None:
    file = parallel_file(tmp_path, bytes(1 << 20))
    abort = threading.Event()
    pieces = ParallelReads(4, abort, piece_bytes=64 << 10)
    try:
        directory = DataFile(os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY), BUFFERED)
        try:
            with pytest.raises(IsADirectoryError):  # every piece's read fails
                pieces.read(directory, memoryview(bytearray(256 << 10)), 0)
        finally:
            directory.close()
        abort.set()
        with pytest.raises(PipelineAbortedError):
            pieces.read(file, memoryview(bytearray(256 << 10)), 0)
    finally:
        pieces.close()
        file.close()
