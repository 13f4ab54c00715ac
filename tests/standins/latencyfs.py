"""A stand-in for a latency-bound filesystem (tests and benches only): a FUSE passthrough with a delay.

Nothing real: it stands for a network or parallel filesystem whose every request
pays a round trip, so that only requests in flight at once bring throughput. It
passes every operation through to a backing directory, and sleeps a fixed delay
(``--delay-ms``, 2 ms by default) before serving each read and each write
request. Requests are served on many threads at once (libfuse's multithreaded
loop, which adds threads while all are busy, up to ``--threads``, 64: libfuse's
own default is 10), and are at most 1 MiB
(``max_read``/``max_write``). Metadata requests (lookups, getattr, create,
rename, fsync, ...) pay no delay.

    python -m tests.standins.latencyfs BACKING MOUNTPOINT [--delay-ms 2] [--ready-file F]

runs in the foreground, prints ``ready`` (and creates ``--ready-file``) once the
mount serves requests, and unmounts and exits on SIGTERM or SIGINT, or when the
mount is taken away (``fusermount3 -u MOUNTPOINT``).

Built on mfusepy (ctypes over Debian's libfuse3, ``libfuse3-3``; ``fuse3`` brings
``fusermount3``): one pure-Python file, where pyfuse3 needs a C build against
``libfuse3-dev`` and trio. Bytes go through Python (``os.pread`` into a bytes
object, copied into libfuse's reply): handing libfuse file-backed buffers
instead (``read_buf``/``write_buf``) measured slower here and took more CPU.

**O_DIRECT.** ``--direct-io odirect`` (the default) opens the files asked for
with O_DIRECT as FOPEN_DIRECT_IO (what the ``direct_io`` mount option does for
every file, ``--direct-io all``). O_DIRECT then works, and the kernel sends the
requests of one ``read`` or ``write`` call one at a time, each after the last
is answered: a reader has as many requests in flight as it has calls in flight
(threads, or Linux AIO), which is what this stand-in is for. With ``--direct-io
none`` an ``open(O_DIRECT)`` is served by FUSE's ``direct_IO`` path instead,
whose asynchronous direct I/O sends all the requests of one large call at once
(as NFS does with a large direct read): one 64 MiB ``pread`` had 7 requests in
flight, one ``pwrite`` 20. Buffered opens use the page cache in every mode. The
backing files are opened without O_DIRECT: the latency is the delay, not the
backing disk's.

**Writes to one file are serialised by the kernel**, whatever the mode: a
``write`` call into a FUSE file holds the inode's lock throughout (Debian 12's
libfuse 3.14 cannot ask for FOPEN_PARALLEL_DIRECT_WRITES, and the kernel takes
the lock anyway for a write past the end of the file), so eight threads writing
one file have one request in flight. Eight files written at once, or Linux AIO
writes within a file's size (``io_submit``: the lock is let go once the
requests are sent), have eight.

**Locks.** No ``flock``/``lock`` handler: the kernel then keeps flock and POSIX
locks on the mount locally, which is what one machine needs (the store's root
lock, ``fcntl.flock``). **Attributes** are not cached (libfuse's high-level API
gives each name of a hard-linked file a node of its own, so a cached attribute
would miss a change made through another name); inode numbers are the backing
files' (``use_ino``), and a file unlinked while open is gone (``hard_remove``).

**State.** The filesystem counts the requests it serves, and the path
``/.latencyfs`` at the root of the mount (never listed, no file behind it) reads
as JSON: ``reads``, ``writes`` (requests), ``largest_read``, ``largest_write``
(bytes), ``in_flight_max`` (the most read and write requests being served at
once, their delay included), ``in_flight_max_read``, ``in_flight_max_write``,
``bytes_read``, ``bytes_written``, ``delay_ms`` and ``threads`` (libfuse's worker
threads that served a read or write). Writing ``reset`` to it zeroes the counts.
Tests check parallelism by this state, not by timing; :class:`Server` mounts it
from a test or a bench.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import importlib.util
import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MiB = 1 << 20
MAX_REQUEST = MiB
CONTROL = "/.latencyfs"
CONTROL_HANDLES = 1 << 40  # handles of the control path count from here: no file descriptor is as high
DIRECT_IO_MODES = ("none", "odirect", "all")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


class Stats:
    """What the filesystem served: counts, the largest requests, the most in flight at once."""

    def __init__(self, delay_ms: float) -> None:
        self.delay_ms = delay_ms
        self._lock = threading.Lock()
        self._in_flight = {"read": 0, "write": 0}
        self._threads: set[int] = set()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.counts = {
                "reads": 0,
                "writes": 0,
                "largest_read": 0,
                "largest_write": 0,
                "in_flight_max": 0,
                "in_flight_max_read": 0,
                "in_flight_max_write": 0,
                "bytes_read": 0,
                "bytes_written": 0,
            }

    @contextlib.contextmanager
    def serving(self, kind: str, size: int) -> Any:
        """Count one ``kind`` request ("read" or "write") of ``size`` bytes while it is served."""
        with self._lock:
            counts = self.counts
            counts[f"{kind}s"] += 1
            counts[f"largest_{kind}"] = max(counts[f"largest_{kind}"], size)
            self._in_flight[kind] += 1
            counts[f"in_flight_max_{kind}"] = max(counts[f"in_flight_max_{kind}"], self._in_flight[kind])
            total = self._in_flight["read"] + self._in_flight["write"]
            counts["in_flight_max"] = max(counts["in_flight_max"], total)
            self._threads.add(threading.get_ident())
        try:
            yield
        finally:
            with self._lock:
                self._in_flight[kind] -= 1

    def add_bytes(self, kind: str, size: int) -> None:
        with self._lock:
            self.counts[f"bytes_{kind}"] += size

    def document(self) -> bytes:
        with self._lock:
            doc = {**self.counts, "delay_ms": self.delay_ms, "threads": len(self._threads)}
        return (json.dumps(doc, sort_keys=True) + "\n").encode()


def make_operations(backing: Path, delay_ms: float, direct_io: str, ready: Any) -> Any:
    """The passthrough's operations (an ``mfusepy.Operations``), imported late: libfuse3 may be missing."""
    import mfusepy

    delay = delay_ms / 1000.0
    stats = Stats(delay_ms)
    documents: dict[int, bytes] = {}  # what each open of the control path reads
    handle_numbers = itertools.count()
    handles_lock = threading.Lock()
    root_fd = os.open(backing, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def rel(path: str) -> str:
        return path.lstrip("/") or "."

    def fail(exc: OSError) -> Any:
        return mfusepy.FuseOSError(exc.errno or errno.EIO)

    def attrs(info: os.stat_result) -> dict[str, Any]:
        keys = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_rdev")
        out: dict[str, Any] = {key: getattr(info, key) for key in keys}
        out.update(st_atime=info.st_atime_ns, st_mtime=info.st_mtime_ns, st_ctime=info.st_ctime_ns)
        out["st_blksize"] = info.st_blksize
        return out

    class LatencyFS(mfusepy.Operations):
        use_ns = True

        def init_with_config(self, conn: Any, config: Any) -> None:
            if conn is not None:
                conn.max_write = MAX_REQUEST
                conn.max_read = MAX_REQUEST
                conn.max_readahead = MAX_REQUEST
                conn.max_background = 64  # async direct I/O requests of one call in flight at once
                conn.congestion_threshold = 48
            if config is not None:
                config.use_ino = 1  # the backing inode numbers: hibernate checks a file's identity
                config.hard_remove = 1  # an unlinked open file is gone (st_nlink 0), not renamed away
                config.nullpath_ok = 0
                config.attr_timeout = 0.0  # see "Attributes" above: hibernate links files

                config.entry_timeout = 1.0
                config.negative_timeout = 0.0
            ready()

        # -- the state --------------------------------------------------------------------------------

        def _control_attrs(self) -> dict[str, Any]:
            now = time.time_ns()
            return {
                "st_mode": stat.S_IFREG | 0o666,
                "st_nlink": 1,
                "st_size": 0,
                "st_uid": os.getuid(),
                "st_gid": os.getgid(),
                "st_atime": now,
                "st_mtime": now,
                "st_ctime": now,
            }

        # -- metadata ---------------------------------------------------------------------------------

        def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
            if path == CONTROL:
                return self._control_attrs()
            try:
                if fh is not None and fh.fh < CONTROL_HANDLES:
                    return attrs(os.fstat(fh.fh))
                return attrs(os.stat(rel(path), dir_fd=root_fd, follow_symlinks=False))
            except OSError as exc:
                raise fail(exc) from None

        def access(self, path: str, amode: int) -> int:
            if path == CONTROL:
                return 0
            try:
                if not os.access(rel(path), amode, dir_fd=root_fd, follow_symlinks=False):
                    raise mfusepy.FuseOSError(errno.EACCES)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def readlink(self, path: str) -> str:
            try:
                return os.readlink(rel(path), dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None

        def readdir(self, path: str, fh: Any) -> list[tuple[str, dict[str, int], int]]:
            # Each entry with its inode number and type: with use_ino, an entry whose inode is 0 is
            # skipped by readdir(3).
            try:
                fd = os.open(rel(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
                try:
                    here = os.fstat(fd)
                    entries = [(".", {"st_mode": here.st_mode, "st_ino": here.st_ino}, 0)]
                    entries.append(("..", {"st_mode": stat.S_IFDIR, "st_ino": here.st_ino}, 0))
                    with os.scandir(fd) as listing:
                        for entry in listing:
                            mode = entry.stat(follow_symlinks=False).st_mode
                            entries.append((entry.name, {"st_mode": mode, "st_ino": entry.inode()}, 0))
                    return entries
                finally:
                    os.close(fd)
            except OSError as exc:
                raise fail(exc) from None

        def mknod(self, path: str, mode: int, dev: int) -> int:
            try:
                os.mknod(rel(path), mode, dev, dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def mkdir(self, path: str, mode: int) -> int:
            try:
                os.mkdir(rel(path), mode, dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def rmdir(self, path: str) -> int:
            try:
                os.rmdir(rel(path), dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def unlink(self, path: str) -> int:
            try:
                os.unlink(rel(path), dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def symlink(self, target: str, source: str) -> int:
            try:
                os.symlink(source, rel(target), dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def rename(self, old: str, new: str) -> int:
            try:
                os.rename(rel(old), rel(new), src_dir_fd=root_fd, dst_dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def link(self, target: str, source: str) -> int:
            try:
                os.link(
                    rel(source), rel(target), src_dir_fd=root_fd, dst_dir_fd=root_fd, follow_symlinks=False
                )
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def chmod(self, path: str, mode: int) -> int:
            try:
                os.chmod(rel(path), mode, dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def chown(self, path: str, uid: int, gid: int) -> int:
            try:
                os.chown(rel(path), uid, gid, dir_fd=root_fd, follow_symlinks=False)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def truncate(self, path: str, length: int, fh: Any = None) -> int:
            if path == CONTROL or (fh is not None and fh.fh >= CONTROL_HANDLES):
                return 0
            try:
                if fh is not None:
                    os.ftruncate(fh.fh, length)
                else:
                    fd = os.open(rel(path), os.O_WRONLY | os.O_CLOEXEC, dir_fd=root_fd)
                    try:
                        os.ftruncate(fd, length)
                    finally:
                        os.close(fd)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def utimens(self, path: str, times: Any = None) -> int:
            try:
                os.utime(rel(path), ns=times, dir_fd=root_fd, follow_symlinks=False)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def statfs(self, path: str) -> dict[str, int]:
            info = os.statvfs(backing)
            keys = (
                "f_bsize",
                "f_frsize",
                "f_blocks",
                "f_bfree",
                "f_bavail",
                "f_files",
                "f_ffree",
                "f_favail",
            )
            return {**{key: getattr(info, key) for key in keys}, "f_namemax": info.f_namemax}

        # -- files ------------------------------------------------------------------------------------

        def _mark(self, fi: Any, flags: int) -> None:
            if direct_io == "all" or (direct_io == "odirect" and flags & os.O_DIRECT):
                fi.direct_io = 1

        def open(self, path: str, fi: Any) -> int:
            if path == CONTROL:
                # Each open reads the counts of one moment: a reader's reads at growing offsets
                # must not stitch two documents together.
                with handles_lock:
                    fi.fh = CONTROL_HANDLES + next(handle_numbers)
                    documents[fi.fh] = stats.document()
                fi.direct_io = 1  # its size is not known ahead
                return 0
            try:
                fi.fh = os.open(rel(path), (fi.flags & ~os.O_DIRECT) | os.O_CLOEXEC, dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            self._mark(fi, fi.flags)
            return 0

        def create(self, path: str, mode: int, fi: Any) -> int:
            if path == CONTROL:
                raise mfusepy.FuseOSError(errno.EEXIST)
            try:
                flags = (fi.flags & ~os.O_DIRECT) | os.O_CREAT | os.O_CLOEXEC
                fi.fh = os.open(rel(path), flags, mode, dir_fd=root_fd)
            except OSError as exc:
                raise fail(exc) from None
            self._mark(fi, fi.flags)
            return 0

        def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
            if fi.fh >= CONTROL_HANDLES:
                return documents[fi.fh][offset : offset + size]
            with stats.serving("read", size):
                time.sleep(delay)
                try:
                    data = os.pread(fi.fh, size, offset)
                except OSError as exc:
                    raise fail(exc) from None
            stats.add_bytes("read", len(data))
            return data

        def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
            if fi.fh >= CONTROL_HANDLES:
                if data.strip() == b"reset":
                    stats.reset()
                return len(data)
            with stats.serving("write", len(data)):
                time.sleep(delay)
                try:
                    written = os.pwrite(fi.fh, data, offset)
                except OSError as exc:
                    raise fail(exc) from None
            stats.add_bytes("written", written)
            return written

        def fsync(self, path: str, datasync: int, fi: Any) -> int:
            if fi.fh >= CONTROL_HANDLES:
                return 0
            try:
                (os.fdatasync if datasync else os.fsync)(fi.fh)
            except OSError as exc:
                raise fail(exc) from None
            return 0

        def fsyncdir(self, path: str, datasync: int, fi: Any) -> int:
            fd = os.open(rel(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=root_fd)
            try:
                os.fsync(fd)
            except OSError as exc:
                raise fail(exc) from None
            finally:
                os.close(fd)
            return 0

        def fallocate(self, path: str, mode: int, offset: int, size: int, fi: Any) -> int:
            if _libc.fallocate(fi.fh, mode, offset, size) != 0:
                raise mfusepy.FuseOSError(ctypes.get_errno())
            return 0

        def flush(self, path: str, fi: Any) -> int:
            return 0

        def release(self, path: str, fi: Any) -> int:
            if fi.fh >= CONTROL_HANDLES:
                with handles_lock:
                    documents.pop(fi.fh, None)
            else:
                os.close(fi.fh)
            return 0

    return LatencyFS()


# -- mounting it from a test or a bench ----------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


def unavailable() -> str | None:
    """Why this filesystem cannot be mounted here (a reason to skip), or None."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse: FUSE is not available on this machine"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse cannot be opened by this user"
    if shutil.which("fusermount3") is None or ctypes.util.find_library("fuse3") is None:
        return "libfuse3 is not installed (Debian: apt-get install fuse3; ./scripts/test installs it as root)"
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed (pip install -e '.[dev]')"
    return None


def mounted_at(mountpoint: Path) -> bool:
    """Whether something is mounted at ``mountpoint`` (a FUSE mount whose server died included)."""
    where = os.path.abspath(mountpoint)
    with open("/proc/self/mounts", encoding="utf-8", errors="replace") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) > 1 and fields[1].encode().decode("unicode_escape") == where:
                return True
    return False


class MountRefusedError(RuntimeError):
    """The kernel or fusermount3 refused the mount (no permission to mount, say): not the server's fault."""


class Server:
    """The filesystem served by a child process at ``mountpoint``, over ``backing``; ``close`` unmounts it.

    ``log`` receives the server's output (libfuse's messages). Raises
    MountRefusedError where mounting is refused, RuntimeError where the server
    failed otherwise.
    """

    def __init__(
        self,
        backing: Path,
        mountpoint: Path,
        *,
        delay_ms: float = 2.0,
        direct_io: str = "odirect",
        log: Path | None = None,
    ) -> None:
        self.backing = backing
        self.mountpoint = mountpoint
        self.control = mountpoint / CONTROL.lstrip("/")
        self.log = log if log is not None else mountpoint.parent / f"{mountpoint.name}.log"
        ready = mountpoint.parent / f"{mountpoint.name}.ready"
        with contextlib.suppress(FileNotFoundError):
            ready.unlink()
        backing.mkdir(parents=True, exist_ok=True)
        mountpoint.mkdir(parents=True, exist_ok=True)
        argv = [
            sys.executable, "-m", "tests.standins.latencyfs", str(backing), str(mountpoint),
            "--delay-ms", str(delay_ms), "--direct-io", direct_io, "--ready-file", str(ready),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                output = self.log.read_text(errors="replace").strip()
                self.close()
                if "fusermount3:" in output or "fuse:" in output:
                    raise MountRefusedError(f"the mount was refused: {output[-2000:]}")
                status = self.process.poll()
                raise RuntimeError(f"latencyfs did not start (exit status {status}): {output[-2000:]}")
            time.sleep(0.01)

    def stats(self) -> dict[str, Any]:
        """What the filesystem served since it started or was last reset (see the module's doc)."""
        with open(self.control, "rb") as control:
            result: dict[str, Any] = json.loads(control.read())
            return result

    def reset(self) -> None:
        """Zero the counts."""
        with open(self.control, "wb") as control:
            control.write(b"reset")

    def close(self) -> None:
        """Unmount (lazily if busy) and end the server; safe to call again."""
        if mounted_at(self.mountpoint) and not self._unmount() and mounted_at(self.mountpoint):
            self._unmount("-z")  # busy (a process still holds a file there): detach it now
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.terminate()  # libfuse's handler ends the loop and unmounts
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if mounted_at(self.mountpoint):  # the server was killed: its mount is left, not connected
            self._unmount("-z")

    def _unmount(self, *flags: str) -> bool:
        argv = ["fusermount3", "-u", *flags, str(self.mountpoint)]
        return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.standins.latencyfs",
        description="A FUSE passthrough of BACKING at MOUNTPOINT that delays every read and write request.",
    )
    parser.add_argument("backing", type=Path, help="the directory whose files the mount shows")
    parser.add_argument("mountpoint", type=Path, help="an empty directory to mount on")
    parser.add_argument("--delay-ms", type=float, default=2.0, help="delay per read or write request (2)")
    parser.add_argument(
        "--direct-io",
        choices=DIRECT_IO_MODES,
        default="odirect",
        help="FOPEN_DIRECT_IO for the files opened with O_DIRECT (odirect, the default), every file, or none",
    )
    parser.add_argument("--threads", type=int, default=64, help="most requests served at once (64)")
    parser.add_argument("--ready-file", type=Path, help="created once the mount serves requests")
    parser.add_argument("--debug", action="store_true", help="libfuse's request log on stderr")
    args = parser.parse_args(argv)

    def ready() -> None:
        print("ready", flush=True)
        if args.ready_file is not None:
            args.ready_file.write_text(f"{os.getpid()}\n")

    try:
        import mfusepy
    except (ImportError, OSError) as exc:  # mfusepy raises OSError where libfuse is missing
        print(f"latencyfs: no FUSE library: {exc}", file=sys.stderr)
        return 2
    operations = make_operations(args.backing.resolve(), args.delay_ms, args.direct_io, ready)
    # SIGTERM: libfuse's own handler ends the loop and unmounts (it installs one where the default is set).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        mfusepy.FUSE(
            operations,
            str(args.mountpoint),
            raw_fi=True,
            foreground=True,
            debug=args.debug,
            fsname="latencyfs",
            subtype="latencyfs",
            max_read=MAX_REQUEST,
            # libfuse 3.14 serves at most 10 requests at once unless told; its max_idle_threads, left
            # unset, is passed on as -1 and refused with a message ("Ignoring invalid max threads").
            max_threads=args.threads,
            max_idle_threads=args.threads,
            default_permissions=True,
            allow_other=os.getuid() == 0,
        )
    except RuntimeError as exc:  # libfuse's status: a loop ended by a signal is one too (8)
        if mounted_at(args.mountpoint):
            print(f"latencyfs: libfuse failed with status {exc}", file=sys.stderr)
            return 1
        print(f"latencyfs: stopped and unmounted (libfuse status {exc})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
