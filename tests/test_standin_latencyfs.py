"""The latency-bound filesystem (tests/standins/latencyfs.py) keeps its contract: bytes, sizes, parallelism.

Parallelism is checked by the state the server counts (the most requests it
served at once), while readers keep it busy, never by a duration.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import spill_root_of, wait_until
from tests.latencyfs_fixture import mount_or_skip
from tests.standins.latencyfs import MAX_REQUEST, Server, mounted_at

MiB = 1 << 20


def aligned(size: int) -> mmap.mmap:
    """A page-aligned buffer, as O_DIRECT needs."""
    return mmap.mmap(-1, size)


def pattern(size: int, seed: int) -> bytes:
    block = bytes((seed * 131 + i * 7) % 251 for i in range(4096))
    return (block * (size // len(block) + 1))[:size]


@contextlib.contextmanager
def opened(path: Path, flags: int) -> Iterator[int]:
    fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def busy_readers(path: Path, threads: int) -> Iterator[None]:
    """``threads`` threads reading 1 MiB with O_DIRECT from ``path`` over and over, until the block ends."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def read(index: int) -> None:
        buffer = aligned(MiB)
        try:
            with opened(path, os.O_RDONLY | os.O_DIRECT) as fd:
                size = os.fstat(fd).st_size
                offset = index * MiB % size
                while not stop.is_set():
                    assert os.preadv(fd, [buffer], offset) == MiB
                    offset = (offset + threads * MiB) % size
        except BaseException as exc:
            errors.append(exc)
        finally:
            buffer.close()

    workers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(threads)]
    for worker in workers:
        worker.start()
    try:
        yield
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    assert not errors, errors


def write_file(path: Path, data: bytes) -> None:
    buffer = aligned(len(data))
    try:
        buffer[:] = data
        with opened(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT) as fd:
            assert os.pwritev(fd, [buffer], 0) == len(data)
            os.fsync(fd)
    finally:
        buffer.close()


def test_bytes_written_read_back_equal_buffered_and_direct(latency_fs: Server) -> None:
    mount = latency_fs.mountpoint
    (mount / "dir").mkdir()
    buffered, direct = mount / "dir" / "buffered.bin", mount / "dir" / "direct.bin"
    first, second = pattern(3 * MiB + 4096, 1), pattern(4 * MiB, 2)

    buffered.write_bytes(first)  # buffered, read back with O_DIRECT
    buffer = aligned(len(first))
    with opened(buffered, os.O_RDONLY | os.O_DIRECT) as fd:
        assert os.preadv(fd, [buffer], 0) == len(first)
    assert buffer[:] == first
    buffer.close()

    write_file(direct, second)  # O_DIRECT, read back buffered
    assert direct.read_bytes() == second
    # The bytes are the backing directory's, where the mount put them.
    assert (latency_fs.backing / "dir" / "direct.bin").read_bytes() == second
    assert sorted(p.name for p in (mount / "dir").iterdir()) == ["buffered.bin", "direct.bin"]

    direct.rename(mount / "dir" / "renamed.bin")
    os.link(mount / "dir" / "renamed.bin", mount / "dir" / "linked.bin")
    assert os.stat(mount / "dir" / "linked.bin").st_nlink == 2
    assert (mount / "dir" / "linked.bin").stat().st_ino == (mount / "dir" / "renamed.bin").stat().st_ino
    os.chmod(mount / "dir" / "linked.bin", 0o640)
    assert (mount / "dir" / "renamed.bin").stat().st_mode & 0o777 == 0o640
    os.utime(buffered, ns=(1_000_000_000, 2_000_000_000))
    assert buffered.stat().st_mtime_ns == 2_000_000_000
    for name in ("buffered.bin", "renamed.bin", "linked.bin"):
        (mount / "dir" / name).unlink()
    (mount / "dir").rmdir()
    assert list(mount.iterdir()) == []  # the control path is never listed
    assert os.statvfs(mount).f_blocks > 0


def test_a_hole_punched_reads_as_zeros(latency_fs: Server) -> None:
    path = latency_fs.mountpoint / "holes.bin"
    path.write_bytes(pattern(2 * MiB, 3))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    with opened(path, os.O_WRONLY) as fd:
        punch_hole_keep_size = 0x02 | 0x01
        assert libc.fallocate(fd, punch_hole_keep_size, 0, MiB) == 0, os.strerror(ctypes.get_errno())
    data = path.read_bytes()
    assert len(data) == 2 * MiB and data[:MiB] == bytes(MiB) and data[MiB:] == pattern(2 * MiB, 3)[MiB:]


def test_flock_is_kept_by_the_kernel(latency_fs: Server) -> None:
    """No flock handler: the kernel keeps flocks on the mount locally, as the store's root lock needs."""
    path = latency_fs.mountpoint / ".lock"
    path.write_bytes(b"")
    with opened(path, os.O_RDWR) as first, opened(path, os.O_RDWR) as second:
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(BlockingIOError):
            fcntl.flock(second, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(first, fcntl.LOCK_UN)
        fcntl.flock(second, fcntl.LOCK_SH | fcntl.LOCK_NB)


def test_requests_are_at_most_one_mib(latency_fs: Server) -> None:
    path = latency_fs.mountpoint / "big.bin"
    data = pattern(8 * MiB, 4)
    latency_fs.reset()
    write_file(path, data)  # one O_DIRECT write of 8 MiB
    buffer = aligned(len(data))
    with opened(path, os.O_RDONLY | os.O_DIRECT) as fd:
        assert os.preadv(fd, [buffer], 0) == len(data)  # one O_DIRECT read of 8 MiB
    assert buffer[:] == data
    buffer.close()
    assert path.read_bytes() == data  # buffered: through the page cache and its readahead
    stats = latency_fs.stats()
    assert stats["largest_write"] == MAX_REQUEST == MiB, stats
    assert stats["largest_read"] == MAX_REQUEST, stats
    assert stats["writes"] >= 8 and stats["reads"] >= 8, stats
    assert stats["bytes_written"] == len(data), stats


def test_one_large_direct_read_is_served_one_request_at_a_time(latency_fs: Server) -> None:
    """FOPEN_DIRECT_IO (the default, for files opened with O_DIRECT): a read call's requests go one by one."""
    path = latency_fs.mountpoint / "big.bin"
    write_file(path, pattern(16 * MiB, 5))
    latency_fs.reset()
    buffer = aligned(16 * MiB)
    with opened(path, os.O_RDONLY | os.O_DIRECT) as fd:
        assert os.preadv(fd, [buffer], 0) == 16 * MiB
    buffer.close()
    stats = latency_fs.stats()
    assert stats["reads"] == 16 and stats["in_flight_max_read"] == 1, stats


def test_reads_of_eight_threads_are_served_in_parallel(latency_fs: Server) -> None:
    path = latency_fs.mountpoint / "shared.bin"
    write_file(path, pattern(16 * MiB, 6))
    latency_fs.reset()
    with busy_readers(path, threads=8):
        wait_until(
            lambda: latency_fs.stats()["in_flight_max_read"] >= 2,
            timeout=120,
            what="two read requests served at once",
            detail=latency_fs.stats,
        )
    stats = latency_fs.stats()
    assert stats["largest_read"] <= MiB and stats["threads"] >= 2, stats


def test_more_than_libfuses_default_of_ten_requests_are_served_at_once(latency_fs: Server) -> None:
    path = latency_fs.mountpoint / "shared.bin"
    write_file(path, pattern(16 * MiB, 8))
    latency_fs.reset()
    with busy_readers(path, threads=16):
        wait_until(
            lambda: latency_fs.stats()["in_flight_max_read"] > 10,
            timeout=120,
            what="more than ten read requests served at once",
            detail=latency_fs.stats,
        )


def test_without_fopen_direct_io_one_large_read_is_split_in_parallel(tmp_path: Path) -> None:
    """``--direct-io none``: the kernel's asynchronous direct I/O sends one read call's requests together."""
    server = mount_or_skip(tmp_path / "backing", tmp_path / "mount", direct_io="none")
    with server:
        path = server.mountpoint / "big.bin"
        write_file(path, pattern(16 * MiB, 7))
        buffer = aligned(16 * MiB)

        def one_read() -> bool:
            with opened(path, os.O_RDONLY | os.O_DIRECT) as fd:
                assert os.preadv(fd, [buffer], 0) == 16 * MiB
            return server.stats()["in_flight_max_read"] >= 2

        server.reset()
        wait_until(one_read, timeout=120, what="one read call served as requests in flight at once")
        buffer.close()
        assert server.stats()["largest_read"] == MiB


def test_close_unmounts_even_after_the_server_was_killed(tmp_path: Path) -> None:
    server = mount_or_skip(tmp_path / "backing", tmp_path / "mount")
    try:
        assert mounted_at(server.mountpoint)
        server.process.kill()
        server.process.wait()
        with pytest.raises(OSError) as failed:
            os.stat(server.mountpoint / "anything")
        assert failed.value.errno == errno.ENOTCONN
    finally:
        server.close()
    assert not mounted_at(server.mountpoint)
    assert server.process.returncode is not None


@pytest.mark.slow
def test_sleep_and_wake_on_it_are_bit_exact(
    latency_fs: Server, start_demo: Callable[..., Any], cli: Callable[..., Any]
) -> None:
    demo = start_demo(size_mb=32)
    reference = demo.infer()["digest"]
    snapshots = latency_fs.mountpoint / "snapshots"
    for cycle in range(2):  # the second sleep reuses the first's files: hard links, reads back, holes
        latency_fs.reset()
        asleep = cli("sleep", str(demo.pid), "--to", str(snapshots), "--json")
        assert asleep.returncode == 0, asleep.stderr
        process = asleep.json()["processes"][0]
        assert process["io_mode"] == "direct", process  # O_DIRECT was accepted, not fallen back from
        assert process["warnings"] == [], process
        if cycle == 0:
            assert (
                latency_fs.stats()["bytes_written"] >= process["written_bytes"] >= demo.info["weight_bytes"]
            )
        else:
            assert process["reused_bytes"] >= demo.info["weight_bytes"], process
        woken = cli("wake", str(demo.pid), "--json")
        assert woken.returncode == 0, woken.stderr
        assert woken.json()["processes"][0]["io_mode"] == "direct"
        assert latency_fs.stats()["bytes_read"] >= demo.info["weight_bytes"]
        assert demo.infer()["digest"] == reference, f"cycle {cycle} differs"
    root = spill_root_of(snapshots, demo.pid)
    assert root.is_dir() and list(root.glob("snap-*/manifest.json"))
    assert (latency_fs.backing / "snapshots" / root.name).is_dir()
    demo.stop()


@pytest.mark.slow
def test_a_buffered_io_mode_sleep_also_works(
    latency_fs: Server, start_demo: Callable[..., Any], cli: Callable[..., Any]
) -> None:
    demo = start_demo(size_mb=8)
    reference = demo.infer()["digest"]
    asleep = cli(
        "sleep", str(demo.pid), "--to", str(latency_fs.mountpoint), "--io-mode", "buffered", "--json"
    )
    assert asleep.returncode == 0, asleep.stderr
    assert asleep.json()["processes"][0]["io_mode"] == "buffered"
    woken = cli("wake", str(demo.pid), "--json")
    assert woken.returncode == 0, woken.stderr
    assert demo.infer()["digest"] == reference
    demo.stop()


def test_in_parallel_threads_see_each_others_writes(latency_fs: Server) -> None:
    """Eight threads write their own files at once; every byte lands where it was written."""
    datas = [pattern(2 * MiB, 10 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: write_file(latency_fs.mountpoint / f"f{i}.bin", datas[i]), range(8)))
    for i, data in enumerate(datas):
        assert (latency_fs.mountpoint / f"f{i}.bin").read_bytes() == data


@pytest.mark.slow
def test_a_wake_from_a_filesystem_gone_away_is_an_io_error_and_the_process_stays_asleep(
    latency_fs: Server, start_demo: Callable[..., Any], cli: Callable[..., Any]
) -> None:
    """A network filesystem's server gone (ENOTCONN, as NFS's ESTALE or EIO): exit 9 naming the
    snapshot directory, not an internal error, and the process can be woken once it is back."""
    demo = start_demo(size_mb=16)
    assert cli("sleep", str(demo.pid), "--to", str(latency_fs.mountpoint / "snap"), "-q").returncode == 0
    latency_fs.process.kill()
    latency_fs.process.wait()
    woken = cli("wake", str(demo.pid))
    assert woken.returncode == ExitCode.IO_ERROR, woken.stderr
    assert "stays asleep" in woken.stderr and "Transport endpoint is not connected" in woken.stderr
    assert "OSError" not in woken.stderr, woken.stderr
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "asleep"


def test_doctor_says_how_a_transfer_to_a_network_filesystem_would_run(
    latency_fs: Server, cli: Callable[..., Any]
) -> None:
    """What the store will choose there (by statfs, as it chooses): eight requests in flight on a
    filesystem where each is a round trip, not on the machine's own filesystem beside it."""
    far = cli("doctor", "--to", str(latency_fs.mountpoint / "snap"), "--json").json()
    transfer = {c["name"]: c for c in far["checks"]}["transfer"]
    assert transfer["data"]["kind"] == "network" and transfer["data"]["io_depth"] == 8
    assert "fuse is a network filesystem" in transfer["detail"]
    assert "8 requests in flight" in transfer["detail"]
    near = cli("doctor", "--to", str(latency_fs.backing), "--json").json()
    local = {c["name"]: c for c in near["checks"]}["transfer"]
    assert local["data"]["kind"] in ("local", "memory") and local["data"]["filesystem"] != "fuse"
