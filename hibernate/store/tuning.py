"""How many requests a transfer keeps in flight and how many threads copy and hash: chosen from the machine.

A transfer is bounded by whichever of three resources it leaves idle: the
storage (requests in flight), the cores (copies and checksums) and the
staging memory. What keeps each busy depends on where the snapshot lies:

* a local block device (ext4, xfs, btrfs on NVMe or SSD): the block layer
  splits one large direct request into many in flight already, so one of
  ours at a time keeps it busy;
* a network or FUSE filesystem (NFS, Lustre, GPFS, CephFS, SMB, ...): each
  request waits a round trip however fast the servers are, so one at a time
  reads at request size / latency; eight in flight reach what the link gives;
* memory (tmpfs, or a snapshot whose files are in the page cache: see
  pagecache.py): a read is a memcpy, bounded by the cores, so as many
  requests as there are copying threads.

The copying and hashing threads follow the cores the process may run on
(its affinity, which a batch scheduler's cgroup sets), half of them, at
least two and at most eight: the rest are the program's and the reader's.
Either can be set instead (``--io-depth``, ``--io-workers``), and every
report names what was used.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import asdict, dataclass
from typing import Any

from hibernate.limits import MAX_IO_DEPTH, MAX_IO_WORKERS

LOCAL, NETWORK, MEMORY = "local", "network", "memory"

# statfs(2) f_type magic numbers (linux/magic.h and the filesystems' own headers).
_MEMORY_MAGIC = {0x01021994: "tmpfs", 0x858458F6: "ramfs", 0x958458F6: "hugetlbfs"}
_NETWORK_MAGIC = {
    0x6969: "nfs",
    0x65735546: "fuse",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb2",
    0x00C36400: "ceph",
    0x01021997: "9p",
    0x19830326: "beegfs",
    0x73757245: "coda",
    0x564C: "ncp",
    0x6B414653: "afs",
    0x5346414F: "afs",
}
_LOCAL_MAGIC = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x2FC12FC1: "zfs", 0xF2F52010: "f2fs"}


@dataclass(frozen=True)
class Tuning:
    """What one transfer runs with, and the filesystem it was chosen for."""

    io_depth: int  # requests in flight at once
    workers: int  # threads that copy and checksum (verify and copy, at a wake)
    filesystem: str  # its name as the kernel gives it ("ext4", "fuse", ...), or "unknown"
    kind: str  # LOCAL, NETWORK or MEMORY (also files in the page cache): what the depth was chosen for

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


def filesystem_of(fd: int) -> tuple[str, str]:
    """(name, kind) of the filesystem holding the open file or directory ``fd``; unknown is local."""
    magic = _statfs_magic(fd)
    if magic is None:
        return "unknown", LOCAL
    if magic in _MEMORY_MAGIC:
        return _MEMORY_MAGIC[magic], MEMORY
    if magic in _NETWORK_MAGIC:
        return _NETWORK_MAGIC[magic], NETWORK
    return _LOCAL_MAGIC.get(magic, f"0x{magic:x}"), LOCAL


class _StatFs(ctypes.Structure):
    # struct statfs on 64-bit Linux: f_type first, the rest unread (sized generously).
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 256)]


_fstatfs: Any = None


def _statfs_magic(fd: int) -> int | None:
    global _fstatfs
    if _fstatfs is None:
        libc = ctypes.CDLL(None, use_errno=True)  # the C library the interpreter already loaded
        _fstatfs = libc.fstatfs
        _fstatfs.argtypes = [ctypes.c_int, ctypes.POINTER(_StatFs)]
        _fstatfs.restype = ctypes.c_int
    result = _StatFs()
    if _fstatfs(fd, ctypes.byref(result)) != 0:
        return None
    return int(result.f_type) & 0xFFFFFFFF


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which cgroups and taskset set)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except OSError:
        return max(1, os.cpu_count() or 1)


def default_workers(cores: int) -> int:
    """Copy-and-hash threads for ``cores`` cores: half of them, within 2 and 8."""
    return min(8, max(2, cores // 2))


def default_io_depth(kind: str, workers: int) -> int:
    """Requests in flight for a filesystem of ``kind`` (see the module's docstring).

    On a local disk one is enough: a sleep writes one 128 MiB arena while the
    stagers fill the other, a wake reads 32 MiB requests that the block layer
    splits into a full queue. A second reader measured no faster there (a cold
    wake of 2 GiB: 1.33 GB/s with two, 1.54 with one, in two runs minutes
    apart), and ext4 serialises direct writes that extend a file.
    """
    if kind == NETWORK:
        return 8
    if kind == MEMORY:
        return workers
    return 1


def choose(
    fd: int,
    *,
    io_depth: int | None = None,
    workers: int | None = None,
    cores: int | None = None,
    in_memory: bool = False,
) -> Tuning:
    """The tuning of a transfer to or from the filesystem of ``fd``: what is given, else the default.

    ``in_memory``: every file is read from the page cache, whatever the filesystem.
    """
    name, kind = filesystem_of(fd)
    if in_memory:
        kind = MEMORY
    if workers is None:
        workers = default_workers(usable_cores() if cores is None else cores)
    if io_depth is None:
        io_depth = default_io_depth(kind, workers)
    return Tuning(
        io_depth=min(io_depth, MAX_IO_DEPTH), workers=min(workers, MAX_IO_WORKERS), filesystem=name, kind=kind
    )
