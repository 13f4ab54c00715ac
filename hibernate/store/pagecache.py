"""How much of a file is in memory already: a wake from the page cache need not touch the disk.

Direct I/O (``O_DIRECT``) bypasses the page cache: it is what keeps a sleep
and a wake from filling host memory with a snapshot's pages, but for a
snapshot whose pages are there already (read once by an operator warming it,
written with ``--io-mode buffered``, copied, or on a network filesystem's
client cache) it reads the disk again at the disk's speed, where reading
through the cache is a copy from memory. A snapshot on tmpfs is memory too.

The share is asked of the kernel with ``mincore(2)`` over a read-only
mapping of the file, which maps nothing in and reads no data, for a sample
of the file's pages (see resident_share).
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Any

# A file whose pages are at least this share in memory is read through the page cache: what
# is missing (at most a tenth) is read into the cache and left there, like the rest.
CACHED_SHARE = 0.9

_PROT_READ, _MAP_SHARED = 0x1, 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
_WINDOW = 64 << 10  # bytes asked about in one call
_SAMPLES = 64  # windows asked about per file, at most
_PAGE = os.sysconf("SC_PAGE_SIZE")
# mincore's vector: bit 0 of each byte is the page's residency, the others are reserved.
_RESIDENT_BIT = bytes(value & 1 for value in range(256))

_libc: Any = None


def _functions() -> Any:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter already loaded
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.mmap.restype = ctypes.c_void_p
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.munmap.restype = ctypes.c_int
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.mincore.restype = ctypes.c_int
        _libc = libc
    return _libc


def resident_share(fd: int, size: int) -> float:
    """The share of regular file ``fd``'s first ``size`` bytes that is in memory now, from a sample.

    A whole file's pages took mincore 30 ms per GiB (tmpfs, 2-core machine):
    as long as a wake of a GiB from memory takes on a GPU node. So up to
    _SAMPLES windows of _WINDOW bytes, evenly spread, are asked about (a file
    of no more than that is asked about whole), through one mapping of the
    file that only takes address space; windows in a hole are left out (0.0
    where all are). Raises OSError where the file cannot be mapped (a
    filesystem without mmap).
    """
    libc = _functions()
    pages = -(-size // _PAGE)
    step = max(_WINDOW, -(-pages // _SAMPLES) * _PAGE)
    asked = resident = 0
    vector = ctypes.create_string_buffer(_WINDOW // _PAGE)
    address = libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)  # address space only: nothing is read
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    try:
        for at in range(0, size, step):
            window = min(_WINDOW, size - at)
            if _in_a_hole(fd, at, window):
                continue
            if libc.mincore(address + at, window, vector) != 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code))
            count = -(-window // _PAGE)
            asked += count
            resident += vector.raw[:count].translate(_RESIDENT_BIT).count(1)
    finally:
        libc.munmap(address, size)
    return resident / asked if asked else 0.0


def _in_a_hole(fd: int, at: int, window: int) -> bool:
    """Whether the window holds no data (a hole, which has no pages to cache).

    A re-sleep punches holes where a file it shares with the last snapshot
    holds chunks no longer used; warming what is used leaves them uncached,
    and they must not count against it. A filesystem that cannot tell holes
    says all of it is data (lseek(2)).
    """
    try:
        return os.lseek(fd, at, os.SEEK_DATA) >= at + window
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # no data at or after ``at``
            return True
        raise


def mostly_cached(fd: int) -> bool:
    """Whether at least CACHED_SHARE of regular file ``fd`` is in memory; False where that cannot be
    told (an empty file, one that cannot be mapped), which keeps the caller's way of reading it."""
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return False
        return resident_share(fd, size) >= CACHED_SHARE
    except OSError:
        return False
