"""Direct I/O with page-aligned staging buffers, and its buffered fallback.

O_DIRECT moves bytes between our staging buffers and the disk without the
page cache: it reaches the disk's own speed and does not grow host memory that
batch schedulers charge to the job. Filesystems that refuse it (the kernel
answers EINVAL to ``open(O_DIRECT)``: tmpfs before Linux 6.6, some network and
FUSE filesystems) get buffered I/O with periodic ``fdatasync`` and
``POSIX_FADV_DONTNEED`` so the cache stays small there too. A file that is
in memory already (on tmpfs, or in the page cache) is read through the cache
and left there (CACHED): the disk would only give the same bytes slower.
Callers report which mode was used.

Requests are vectored (``pwritev``/``preadv``): several staged chunks that lie
back to back in a file move in one request. On the disks we measured, the
number of requests costs more than their size (a request has a fixed latency
on top of its transfer time), so fewer, larger requests are what reaches the
raw limit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import queue
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from hibernate.fsutil import PRIVATE_FILE_MODE
from hibernate.store.hugepages import HUGE_PAGE_BYTES
from hibernate.store.manifest import ALIGNMENT
from hibernate.store.pagecache import mostly_cached

T = TypeVar("T")

DIRECT = "direct"
BUFFERED = "buffered"
# A file read through the page cache because its pages were there already (pagecache.py): read
# buffered, and left in the cache as it was found.
CACHED = "cached"
_EVICT_EVERY_BYTES = 64 << 20
_MAX_IOVECS = 512  # well under IOV_MAX (1024) on Linux


class Fence(Protocol):
    """Device copies queued on staging memory, done once :meth:`wait` returned (pipeline.DeviceStaging)."""

    def wait(self) -> None:
        """Block until every copy it covers ran; raise (once) if one of them failed."""
        ...


Unpin = Callable[[], None]


class StagingBuffer:
    """One page-aligned anonymous mapping, faulted in at once; freed (unmapped) by :meth:`close`.

    Every page is faulted in before any I/O: on the VM this was tuned on, page
    faults taken while requests were in flight slowed the disk by a quarter
    (the host backs fresh guest pages as they are touched).

    ``huge`` asks for transparent huge pages (MADV_HUGEPAGE). The block layer
    makes one segment of each physically contiguous run of a direct read's
    buffer and caps the segments per request, so scattered 4 KiB pages split a
    read into 512 KiB requests, and that disk's limit on requests per second
    held reads to 1.25 GB/s; 2 MiB pages let it take 4 MiB requests, and reads
    ran at 2.2 GB/s. Huge pages cost more to fault in where the host must back
    them afresh (0.6 s for 256 MiB, against 0.07 s), so they pay off for
    buffers reused many times and kept few: the reader's, not the writer's (a
    spill with huge-page staging measured slower, 1.5 against 2.0 GB/s).
    Where huge pages are off or none is free, the kernel uses small pages.

    ``size`` is what the transfer holding it uses; a buffer that may be kept
    between transfers (KeptStaging) maps a little more (``mapped_bytes``):
    rounded up to a huge page, or made for a transfer that needed more.
    ``unpin`` undoes its page-locking, None while it is not page-locked (never
    asked to be, or refused: a transfer that takes it again asks again).
    """

    def __init__(self, size: int, *, huge: bool = False, mapped_bytes: int | None = None) -> None:
        self.size = size
        self.mapped_bytes = size if mapped_bytes is None else mapped_bytes
        self.huge = huge
        self.unpin: Unpin | None = None
        # Device copies still reading or writing it: waited for before it is handed out again or
        # unmapped (StagingPool.fence), under the pool's lock.
        self.fences: list[Fence] = []
        if not huge:
            flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
            self._map = mmap.mmap(-1, self.mapped_bytes, flags=flags)
            self.view = memoryview(self._map)
            return
        self._map = mmap.mmap(-1, self.mapped_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self._map)
        with contextlib.suppress(OSError):  # a kernel without THP: small pages it is
            self._map.madvise(mmap.MADV_HUGEPAGE)
        start, end = _pages(self.view)
        if not _madvise(start, end - start, _MADV_POPULATE_WRITE):
            ctypes.memset(start, 0, end - start)  # before Linux 5.14: touch every page

    def close(self) -> None:
        """Unpin it, and give the memory back now, even if a slice of the buffer is still referenced
        (unmap_now)."""
        if self.unpin is not None:
            self.unpin()
            self.unpin = None
        unmap_now(self._map, self.view)


def unmap_now(mapping: mmap.mmap, view: memoryview) -> None:
    """Give an anonymous mapping's memory back now, even if a slice of ``view`` is still referenced.

    After a failure, the traceback's frames may hold slices of the buffer,
    which keeps the mapping from being unmapped until they are collected;
    MADV_DONTNEED frees its pages at once regardless.
    """
    mapping.madvise(mmap.MADV_DONTNEED)
    try:
        view.release()
        mapping.close()
    except BufferError:
        pass  # unmapped when the last slice goes


# A kept buffer serves a transfer that needs up to a fifth less than it maps (beyond its rounding up
# to a huge page, see _rounded): what it wastes stays small, and a buffer much larger than asked for
# is left to a transfer that needs it.
_KEPT_SLACK = 4


def _rounded(size: int) -> int:
    """What a buffer that may be kept maps for ``size`` bytes: up to the next huge page."""
    return -(-size // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES


class KeptStaging:
    """Staging a process keeps from one transfer to the next, within a bound it is given.

    Every sleep and wake that allocates its own staging pays again for
    allocating it, faulting it in and, on a GPU target, page-locking it
    (cudaHostRegister): tens of milliseconds for 256 MiB on a GPU node, against
    a wake from memory of a few GiB that takes a few hundred, and 0.2 s on a
    VM whose host backs fresh pages as they are touched. A process that keeps
    its staging pays it once; the price is that memory (locked, on a GPU
    target), held while the process runs and while it sleeps, beside what the
    sleep gives back, which is why nothing is kept unless a bound is given
    (:meth:`begin`, 0 by default). A transfer takes a kept buffer of the kind
    it would have allocated, of its size or a little more (a sleep's arenas
    and a wake's read buffers differ, so both are kept where the bound allows;
    a snapshot smaller than the staging sizes them to what it holds, which
    moves by a few pages from one sleep to the next), still pinned where it
    was, pinned then where it was not and the transfer pins.
    One operation at a time (the agent's session): :meth:`begin` and
    :meth:`end` bracket it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[StagingBuffer] = []  # the oldest first
        self._held_bytes = 0
        self._bound_bytes = 0
        self._reused_bytes = 0

    @property
    def keeping(self) -> bool:
        """Whether the operation under way may keep anything."""
        return self._bound_bytes > 0

    def begin(self, bound_bytes: int) -> None:
        """An operation starts that may keep up to ``bound_bytes`` when it ends."""
        with self._lock:
            self._bound_bytes = bound_bytes
            self._reused_bytes = 0

    def end(self) -> dict[str, int]:
        """The operation ended: what is kept beyond its bound is unpinned and unmapped (all of it at
        0). Returns what it reused, what stays kept and what was given back, in bytes."""
        freed: list[StagingBuffer] = []
        with self._lock:
            while self._held and self._held_bytes > self._bound_bytes:
                freed.append(self._held.pop(0))
                self._held_bytes -= freed[-1].mapped_bytes
            account = {"reused_bytes": self._reused_bytes, "kept_bytes": self._held_bytes}
        for buffer in freed:
            buffer.close()
        account["given_back_bytes"] = sum(buffer.mapped_bytes for buffer in freed)
        return account

    @contextlib.contextmanager
    def bracket(self, bound_bytes: int) -> Iterator[dict[str, int]]:
        """:meth:`begin` and :meth:`end` around one operation, whatever happens in it; the dict it
        yields holds :meth:`end`'s account once the block is left."""
        account: dict[str, int] = {}
        self.begin(bound_bytes)
        try:
            yield account
        finally:
            account.update(self.end())

    def take(self, size: int, huge: bool) -> StagingBuffer | None:
        """A kept buffer of that kind mapping ``size`` bytes or a little more (see _KEPT_SLACK), used
        as ``size`` bytes, still page-locked where it was; the smallest, page-locked first; None if
        none fits."""
        with self._lock:
            fits = [
                (buffer.mapped_bytes, buffer.unpin is None, index)
                for index, buffer in enumerate(self._held)
                if buffer.huge == huge and size <= buffer.mapped_bytes <= _rounded(size) + size // _KEPT_SLACK
            ]
            if not fits:
                return None
            buffer = self._held.pop(min(fits)[2])
            self._held_bytes -= buffer.mapped_bytes
            buffer.size = size
            self._reused_bytes += buffer.mapped_bytes
            return buffer

    def offer(self, buffer: StagingBuffer) -> bool:
        """Keep a buffer a transfer is done with (no device copy on it still running), page-locked
        if it is, if the bound has room for it; False: the caller closes it."""
        with self._lock:
            if self._held_bytes + buffer.mapped_bytes > self._bound_bytes:
                return False
            self._held.append(buffer)
            self._held_bytes += buffer.mapped_bytes
            return True


class StagingPool:
    """A fixed set of buffers: the whole of the staging memory a transfer may use.

    The buffers are allocated when the first one is taken, so a transfer that
    stages nothing (an unchanged model's second sleep) allocates nothing.
    A ``lazy`` pool allocates one only when none is free, so it ends up with
    as many as the transfer kept busy at once: faulting staging in costs time
    too (a 256 MiB huge-page staging took 0.6 s where the host had to back the
    pages afresh), and a pool of small buffers whose workers keep up needs
    only a few. ``huge``: see :class:`StagingBuffer`. ``pin`` lets a device
    pool page-lock the buffers (e.g.
    cudaHostRegister) so device copies into them run at full speed; it returns
    the matching unpin. A buffer given back while device copies queued on it
    may still run carries their fence (:meth:`fence`): it is handed out again,
    and unmapped, only once they ran. With ``kept``, buffers come from the
    process's kept staging where it has them, and go back to it at the end of
    a transfer whose copies all ran (see KeptStaging).
    """

    def __init__(
        self,
        total_bytes: int,
        buffer_bytes: int,
        pin: Callable[[memoryview], Unpin | None] | None = None,
        *,
        lazy: bool = False,
        huge: bool = False,
        kept: KeptStaging | None = None,
    ) -> None:
        self.buffer_bytes = buffer_bytes
        self._count = max(2, total_bytes // buffer_bytes)
        self._pin = pin
        self._lazy = lazy
        self._huge = huge
        self._kept = kept
        self._reserved = 0  # buffers allocated or being allocated
        self._all: list[StagingBuffer] = []
        self._settled_well = False  # settle() found every device copy done and none failed
        self._copy_failed = False  # a device copy on one of the buffers failed, whoever waited for it
        self._lock = threading.Lock()
        self._free: queue.LifoQueue[StagingBuffer] = queue.LifoQueue()

    @property
    def total_bytes(self) -> int:
        """The staging memory the transfer holds (none until a buffer was first taken)."""
        return sum(buffer.mapped_bytes for buffer in self._all)

    def _allocate(self, count: int) -> list[StagingBuffer]:
        """Up to ``count`` more buffers, fewer if that would pass the pool's size."""
        with self._lock:
            count = min(count, self._count - self._reserved)
            self._reserved += count
        made = []
        for done in range(count):
            try:
                buffer = self._kept.take(self.buffer_bytes, self._huge) if self._kept is not None else None
                if buffer is None:
                    buffer = self._new_buffer()
            except BaseException:
                with self._lock:
                    self._reserved -= count - done  # else a lazy take would wait for it forever
                raise
            if buffer.unpin is None and self._pin is not None:
                try:
                    buffer.unpin = self._pin(buffer.view)
                except BaseException:
                    buffer.close()  # neither this pool's nor kept: unmapped now
                    with self._lock:
                        self._reserved -= count - done
                    raise
            with self._lock:
                self._all.append(buffer)
            made.append(buffer)
        return made

    def _new_buffer(self) -> StagingBuffer:
        """A buffer of ``buffer_bytes``; one that may be kept maps up to a huge page more, so that a
        later transfer needing a few pages more than this one (a small snapshot's staging moves with
        its layout) can still take it."""
        if self._kept is None or not self._kept.keeping:
            return StagingBuffer(self.buffer_bytes, huge=self._huge)
        return StagingBuffer(self.buffer_bytes, huge=self._huge, mapped_bytes=_rounded(self.buffer_bytes))

    def prefill(self, count: int) -> None:
        """Allocate up to ``count`` more buffers now (within the pool's size) and make them free.

        For a lazy pool: another thread allocates what the transfer will soon
        need while the disk works, instead of the reader when it needs one.
        """
        for _ in range(count):
            for buffer in self._allocate(1):
                self._free.put(buffer)  # usable while the next is faulted in

    def take(self, abort: threading.Event) -> StagingBuffer:
        """The next free buffer (the most recently returned first), once the device is done with it."""
        if self._lazy:
            try:
                return self._settled(self._free.get_nowait())
            except queue.Empty:
                with self._lock:
                    busy = self._reserved > len(self._all)
                if not busy:  # else one is being faulted in: waiting for it is sooner
                    for buffer in self._allocate(1):
                        return buffer
        elif not self._reserved:
            for buffer in self._allocate(self._count):
                self._free.put(buffer)
        return self._settled(take(self._free, abort))

    def give(self, buffer: StagingBuffer) -> None:
        self._free.put(buffer)

    def fence(self, buffer: StagingBuffer, fence: Fence | None) -> None:
        """Device copies queued on ``buffer`` that may still run: it is handed out again, or unmapped,
        only once ``fence`` completed.

        Waited for when the buffer is needed again, not when the copies are
        queued: the worker that queued them goes on to verify the next chunk
        while the device copies this one. Registered as soon as the copies are
        queued, before the buffer is given back, so that a transfer that fails
        first still waits for them before unmapping it (see close).
        """
        if fence is not None:
            with self._lock:
                buffer.fences.append(fence)

    def _settled(self, buffer: StagingBuffer) -> StagingBuffer:
        """``buffer`` once the device copies queued on it ran (see fence); every fence is waited
        for, whichever failed (the copies of another stream may still read the buffer), then the
        first failure is raised, and the pool keeps none of its buffers (see close)."""
        with self._lock:
            fences, buffer.fences = buffer.fences, []
        failure: BaseException | None = None
        for fence in fences:
            try:
                fence.wait()
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            self._copy_failed = True
            raise failure
        return buffer

    def settle(self) -> None:
        """Wait for every device copy still queued on any buffer; the first failure is raised.

        The end of a transfer that went well: its last copies may still be
        running, and a copy that failed when it ran is reported only here.
        """
        with self._lock:
            buffers = list(self._all)
        failure: BaseException | None = None
        for buffer in buffers:
            try:
                self._settled(buffer)
            except Exception as exc:  # the others are still waited for: their buffers are unmapped next
                failure = failure or exc
        if failure is not None:
            raise failure
        self._settled_well = not self._copy_failed

    def close(self) -> None:
        """Unpin and unmap every buffer, once the device copies queued on them ran.

        A buffer the device still reads or writes must stay mapped (unmapping
        it would copy zeros into device memory or fault); a failure found
        while waiting is not raised here, as close runs on the way out of a
        transfer that already failed, or after settle reported it.
        """
        with contextlib.suppress(Exception):
            self.settle()
        kept = self._kept if self._settled_well else None  # after a failed copy, nothing is kept
        while True:  # none of them is handed out again (a late take waits, then finds the pipeline aborted)
            try:
                self._free.get_nowait()
            except queue.Empty:
                break
        for buffer in self._all:
            if kept is None or not kept.offer(buffer):
                buffer.close()
        self._all.clear()


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_POPULATE_STEP = 64 << 20
_libc: ctypes.CDLL | None = None


def _pages(view: memoryview) -> tuple[int, int]:
    """The addresses of the first and past the last whole page inside ``view``."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(view))
    start = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    return start, max(start, (address + len(view)) // mmap.PAGESIZE * mmap.PAGESIZE)


def _madvise(start: int, length: int, advice: int) -> bool:
    """madvise() a page-aligned range (ctypes drops the GIL meanwhile); False on failure."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return length == 0 or _libc.madvise(start, length, advice) == 0


def populate(view: memoryview, abort: threading.Event, *, huge: bool = False) -> None:
    """Fault in the (writable, host) memory behind ``view`` ahead of copying into it; best effort.

    A wake refills memory just reallocated; faulting it in with
    MADV_POPULATE_WRITE, a step ahead of the copies while the disk works,
    measured faster (0.93x vs 0.66x raw, paired) than taking the faults page
    by page in the copies, and than faulting everything in before the first
    read. Contents are not changed. Older kernels (EINVAL) take the faults later.
    ``huge`` first asks for transparent huge pages over the 2 MiB-aligned
    interior (see :mod:`hibernate.store.hugepages` for when that pays off).
    """
    if view.readonly or len(view) < mmap.PAGESIZE:
        return
    start, end = _pages(view)
    if huge:
        huge_start = -(-start // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        huge_end = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
        if huge_end > huge_start:
            _madvise(huge_start, huge_end - huge_start, mmap.MADV_HUGEPAGE)
    for step in range(start, end, _POPULATE_STEP):
        if abort.is_set() or not _madvise(step, min(_POPULATE_STEP, end - step), _MADV_POPULATE_WRITE):
            return


class PipelineAbortedError(Exception):
    """Internal: another pipeline thread failed; stop quietly."""


def take(items: queue.Queue[T], abort: threading.Event) -> T:
    """The next item of ``items``, or PipelineAbortedError once another thread of the transfer failed."""
    while True:
        try:
            return items.get(timeout=0.05)
        except queue.Empty:
            if abort.is_set():
                raise PipelineAbortedError() from None


class DirectIORefusedError(OSError):
    """``--io-mode direct`` was asked for on a filesystem that refuses O_DIRECT."""


def direct_io_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory``'s filesystem accepts an aligned O_DIRECT write (for ``doctor``).

    The store itself does not probe: it asks for O_DIRECT when it opens each
    data file and falls back when the kernel refuses.
    """
    name = os.path.join(os.fspath(directory), f".odirect-probe-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    try:
        probe = StagingBuffer(4096)
        try:
            os.pwrite(fd, probe.view, 0)
            return True
        except OSError:
            return False
        finally:
            probe.close()
    finally:
        os.close(fd)
        os.unlink(name)


@dataclass
class DataFile:
    """A data file being written or read, in direct or buffered mode (or CACHED: see follow_page_cache)."""

    fd: int
    mode: str
    _since_evict: int = 0
    opened_as: str = ""  # the mode it was opened in: what it goes back to when it leaves the page cache

    def __post_init__(self) -> None:
        self.opened_as = self.opened_as or self.mode

    def close(self) -> None:
        os.close(self.fd)


def _open(dir_fd: int, name: str, flags: int, io_mode: str) -> DataFile:
    """Open with O_DIRECT unless ``io_mode`` is buffered; EINVAL means the filesystem refuses it.

    ``auto`` then falls back to buffered I/O; ``direct`` raises DirectIORefusedError.
    """
    if io_mode != BUFFERED:
        try:
            return DataFile(os.open(name, flags | os.O_DIRECT, PRIVATE_FILE_MODE, dir_fd=dir_fd), DIRECT)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            if io_mode == DIRECT:
                raise DirectIORefusedError(
                    errno.EINVAL, "the filesystem refuses direct I/O (O_DIRECT)", name
                ) from exc
    return DataFile(os.open(name, flags, PRIVATE_FILE_MODE, dir_fd=dir_fd), BUFFERED)


def create_data_file(dir_fd: int, name: str, io_mode: str) -> DataFile:
    """A new private data file in ``dir_fd``; refuses to follow or reuse anything already there."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return _open(dir_fd, name, flags, io_mode)


def open_data_file(dir_fd: int, name: str, io_mode: str, *, page_cache: bool = True) -> DataFile:
    """An existing data file, never through a symlink, never blocking on a planted FIFO.

    With ``page_cache`` and an ``io_mode`` other than direct, a file mostly in
    memory already (pagecache.mostly_cached: on tmpfs, or read or written
    through the cache before) is read through the page cache (CACHED): direct
    I/O would read the disk again for bytes memory holds.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    file = _open(dir_fd, name, flags, io_mode)
    if not page_cache or io_mode == DIRECT:
        return file
    try:
        follow_page_cache(file)
    except BaseException:
        file.close()
        raise
    return file


def follow_page_cache(file: DataFile) -> None:
    """Read ``file`` through the page cache (CACHED) if it is mostly there now, else as it was opened.

    Asked when the file is opened and again just before it is read: in
    between, a wake maps its destination memory in, which on a host short of
    memory may evict the snapshot's pages, and a file read through the cache
    from the disk would stay there. The switch sets or clears O_DIRECT on
    the open file; where the kernel refuses it, the file stays as it is
    (either way reads the same bytes).
    """
    cached = stat.S_ISREG(os.fstat(file.fd).st_mode) and mostly_cached(file.fd)
    wanted = CACHED if cached else file.opened_as
    if wanted == file.mode:
        return
    try:
        flags = fcntl.fcntl(file.fd, fcntl.F_GETFL)
        fcntl.fcntl(file.fd, fcntl.F_SETFL, flags | os.O_DIRECT if wanted == DIRECT else flags & ~os.O_DIRECT)
    except OSError:
        return
    file.mode = wanted


def _advance(views: Sequence[memoryview], done: int) -> list[memoryview]:
    """The part of ``views`` after the first ``done`` bytes (after a short transfer)."""
    rest: list[memoryview] = []
    for view in views:
        if done >= len(view):
            done -= len(view)
            continue
        rest.append(view[done:])
        done = 0
    return rest


def write_views(file: DataFile, views: Sequence[memoryview], offset: int) -> None:
    """Write ``views`` back to back at ``offset``, as few requests as the kernel allows.

    Buffered files are synced and dropped from the page cache as they grow, so
    a spill to a filesystem without O_DIRECT does not fill host memory either.
    """
    total = sum(len(v) for v in views)
    pending = list(views)
    done = 0
    while pending:
        n = os.pwritev(file.fd, pending[:_MAX_IOVECS], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "the disk accepted no bytes")
        done += n
        pending = _advance(pending, n)
    if file.mode == BUFFERED:
        file._since_evict += total
        if file._since_evict >= _EVICT_EVERY_BYTES:
            os.fdatasync(file.fd)
            os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)
            file._since_evict = 0


def read_views(file: DataFile, views: Sequence[memoryview], offset: int) -> int:
    """Fill ``views`` back to back from ``offset``; returns the bytes read (short only at EOF)."""
    pending = list(views)
    done = 0
    while pending:
        n = os.preadv(file.fd, pending[:_MAX_IOVECS], offset + done)
        if n == 0:
            break
        done += n
        pending = _advance(pending, n)
    if file.mode == BUFFERED:
        os.posix_fadvise(file.fd, offset, done, os.POSIX_FADV_DONTNEED)
    return done


class _Pieces:
    """One request's pieces: claimed in file order by the threads that serve it, what each read, and the
    count of those not yet done."""

    def __init__(self, file: DataFile, view: memoryview, offset: int, step: int) -> None:
        self.file, self.view, self.offset, self.step = file, view, offset, step
        self.count = -(-len(view) // step)
        self.got: list[int | BaseException] = [0] * self.count
        self.claimed = 0  # pieces handed to a thread, under ``lock``
        self.left = self.count
        self.lock = threading.Lock()
        self.done = threading.Event()

    def claim(self) -> int | None:
        """The index of the next piece not yet taken, or None."""
        with self.lock:
            if self.claimed == self.count:
                return None
            self.claimed += 1
            return self.claimed - 1

    def finish(self, index: int, result: int | BaseException) -> None:
        self.got[index] = result
        with self.lock:
            self.left -= 1
            if self.left == 0:
                self.done.set()


class ParallelReads:
    """Read one request as pieces, ``threads`` of them in flight at once, on threads of its own.

    Where each request waits a round trip (a network or FUSE filesystem), the
    requests in flight, not their size, make the throughput; splitting each
    read keeps that many in flight with only a few staging buffers (a chunk
    is verified whole, so a buffer holds at least one). The pieces are
    ``piece_bytes`` each and the threads take them in file order, each the
    next one not yet taken, so those in flight at once lie side by side:
    with a share of 4 MiB for each of 8 threads, the 8 requests in flight lay
    4 MiB apart. On the latency-bound stand-in (tests/standins/latencyfs.py,
    requests of at most 1 MiB, a passthrough of a file on ext4) 1 MiB pieces
    taken in order made the restore of a 512 MiB wake through the CLI 20%
    faster (./scripts/bench-latency, two runs of each alternating: 950-1135
    MB/s against 779-882) and its server's CPU 0.71-0.73 s per GiB against
    0.86-0.94; with the destination already faulted and nothing copied, the
    read went from 882 MB/s (794-1111) to 1210 (1013-1304), the raw read's
    speed. A piece never outlives its read: :meth:`read` returns only
    once every piece it asked for has finished or been skipped (after
    ``abort``), so the buffer it reads into is never given back while the
    kernel still writes into it.
    """

    def __init__(self, threads: int, abort: threading.Event, piece_bytes: int = 1 << 20) -> None:
        self._abort = abort
        self._piece_bytes = piece_bytes
        self._jobs: queue.SimpleQueue[_Pieces | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._serve, name=f"hibernate-read-piece-{n}", daemon=True)
            for n in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def _serve(self) -> None:
        while (pieces := self._jobs.get()) is not None:
            while (index := pieces.claim()) is not None:
                start = index * pieces.step
                view = pieces.view[start : start + pieces.step]
                try:
                    at = pieces.offset + start
                    pieces.finish(index, 0 if self._abort.is_set() else read_views(pieces.file, [view], at))
                except BaseException as exc:  # handed to the reader that asked, which raises it
                    pieces.finish(index, exc)
                finally:
                    view.release()  # no slice of the staging outlives its read
            del pieces

    def read(self, file: DataFile, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset`` as read_views does; the bytes read (short only at EOF).

        Pieces are ``piece_bytes`` (whole pages, at least one); one job per thread
        that can have a piece is queued, each thread taking pieces until none is left."""
        step = max(ALIGNMENT, self._piece_bytes // ALIGNMENT * ALIGNMENT)
        pieces = _Pieces(file, view, offset, step)
        for _ in range(min(pieces.count, len(self._threads))):
            self._jobs.put(pieces)
        if pieces.count:
            pieces.done.wait()
        # A job a thread has not taken yet still holds ``pieces``: it finds none left to claim, and
        # holds no slice of the buffer meanwhile.
        pieces.view = memoryview(b"")
        got = 0
        for index, result in enumerate(pieces.got):
            if isinstance(result, BaseException):
                raise result
            got += result
            if result < min(step, len(view) - index * step):
                break  # the end of the file: nothing after it was read
        if self._abort.is_set():
            raise PipelineAbortedError()
        return got

    def close(self) -> None:
        """Stop the threads once the pieces asked for are done; they end on their own."""
        for _ in self._threads:
            self._jobs.put(None)


def finish_write(file: DataFile) -> None:
    """Make the file durable and leave none of it in the page cache."""
    os.fsync(file.fd)
    if file.mode == BUFFERED:
        os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)
