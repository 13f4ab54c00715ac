"""Host memory torch cannot resize: where it lives, and how its pages go back to the OS.

A CPU storage is not resizable when torch does not own its memory: a tensor
whose ``.numpy()`` was taken, ``torch.from_numpy``, ``torch.from_blob``, a
memory map. Its address must not change (numpy, or whoever made the blob,
still points at it), so it cannot be freed the usual way (resize to zero).
Instead its pages are handed back with ``madvise(MADV_DONTNEED)`` while the
address range stays mapped, and its bytes are written back in place on wake.

What ``MADV_DONTNEED`` does depends on the mapping (madvise(2); each case is
pinned by a test in tests/test_pools_fixed_storages.py, run on Linux 6.18):

* private anonymous memory (malloc, numpy's own buffers): the pages are freed;
  the next touch maps fresh zero pages;
* private file mapping: the pages are dropped, and the next touch reads the
  file again (modified copy-on-write pages are lost, so they are spilled);
* shared mapping: the process's RSS drops, but the pages stay in the page
  cache or in shared memory with their data, so nothing is freed. For a file
  the data lives in the file, so it is left as it is; for shared memory
  (``/dev/shm``, memfd, anonymous ``MAP_SHARED``) ``MADV_REMOVE`` would free
  it, but also erase it under every other process that maps it, so it is left
  in place as well and reported.

A read-only mapping cannot be written back, and MADV_DONTNEED refuses locked
(``mlock``), hugetlbfs and device pages: those are left in place too.

Only whole pages can be handed back: the partial pages at both ends of a
range stay resident (they may hold other objects) and are counted.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from hibernate.errors import UnsupportedError

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
MADV_DONTNEED = 4  # <bits/mman-linux.h>, the same value on every Linux architecture


# VmFlags (proc(5)) of pages MADV_DONTNEED refuses with EINVAL: locked (mlock, mlockall),
# hugetlbfs, and PFN maps (device memory); each with the words a report gives.
UNFREEABLE_FLAGS = {"lo": "locked in memory (mlock)", "ht": "hugetlbfs pages", "pf": "a device (PFN) mapping"}


@dataclass(frozen=True)
class HostMapping:
    """One mapping of /proc/self/smaps (or maps, which has no VmFlags)."""

    start: int
    end: int
    writable: bool
    shared: bool
    path: str  # empty for anonymous memory; "[heap]" and the like for special regions
    flags: frozenset[str] = frozenset()  # VmFlags: "lo" locked, "ht" hugetlbfs...


def _header(line: str) -> HostMapping | None:
    """A mapping's first line (``start-end perms offset dev inode [path]``); None for a field line."""
    fields = line.split(maxsplit=5)
    if len(fields) < 5:
        return None
    start, dash, end = fields[0].partition("-")
    try:
        low, high = int(start, 16), int(end, 16)
    except ValueError:
        return None
    if not dash:
        return None
    perms = fields[1]
    path = fields[5].strip() if len(fields) == 6 else ""
    return HostMapping(low, high, perms[1] == "w", perms[3] == "s", path)


def parse_maps(text: str) -> list[HostMapping]:
    """The mappings of a /proc/PID/smaps or maps text, with their VmFlags where smaps gives them."""
    mappings: list[HostMapping] = []
    for line in text.splitlines():
        if line.startswith("VmFlags:") and mappings:
            flags = frozenset(line.removeprefix("VmFlags:").split())
            mappings[-1] = replace(mappings[-1], flags=flags)
            continue
        mapping = _header(line)
        if mapping is not None:
            mappings.append(mapping)
    return mappings


def _is_shared_memory(path: str) -> bool:
    """A shared mapping of memory rather than of a file on disk (anonymous, memfd, SysV, /dev/shm)."""
    return (
        path == ""
        or path.startswith(("/dev/zero", "/memfd:", "/SYSV", "/dev/shm/", "[anon_shmem"))
        or path.endswith("(deleted)")
    )


@dataclass(frozen=True)
class Placement:
    """Whether a host range can be hibernated in place, and if not, why (for the report)."""

    hibernate: bool
    reason: str  # empty when it can be hibernated


def placement(start: int, end: int, mappings: Sequence[HostMapping]) -> Placement:
    """How the bytes ``[start, end)`` can be hibernated, from the mappings that cover them."""
    covering = [m for m in mappings if m.start < end and m.end > start]
    covered = start
    for mapping in sorted(covering, key=lambda m: m.start):
        if mapping.start > covered:
            break
        covered = max(covered, mapping.end)
    if end > start and covered < end:
        return Placement(False, "its memory is not (wholly) mapped in this process")
    if any(m.shared for m in covering):
        if all(not _is_shared_memory(m.path) for m in covering if m.shared):
            names = sorted({m.path for m in covering if m.shared})
            return Placement(False, f"a shared mapping of {', '.join(names)}: its data lives in the file")
        return Placement(
            False,
            "shared memory that other processes may map: releasing it would free nothing "
            "(MADV_DONTNEED) or erase it for them too (MADV_REMOVE)",
        )
    if not all(m.writable for m in covering):
        return Placement(False, "a read-only mapping: its bytes could not be written back")
    unfreeable = sorted({UNFREEABLE_FLAGS[f] for m in covering for f in m.flags if f in UNFREEABLE_FLAGS})
    if unfreeable:
        return Placement(False, f"{' and '.join(unfreeable)}: MADV_DONTNEED cannot free it")
    return Placement(True, "")


def kept_with_overlaps(ranges: Sequence[tuple[int, int, bool]]) -> list[bool]:
    """Which of the ranges ``(start, end, keep)`` must be kept: any that shares bytes with a kept one.

    Two storages torch did not allocate may share memory (``from_numpy`` twice on one
    array). A wake fills the kept regions, then zero-fills the dropped ones, so a
    dropped range overlapping a kept one, directly or through others, would wipe
    kept bytes: every range of an overlapping group is kept if one of them is.
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    kept = [keep for _, _, keep in ranges]
    group: list[int] = []
    group_end = -1
    for index in [*order, None]:
        if index is None or ranges[index][0] >= group_end:
            if any(kept[i] for i in group):
                for i in group:
                    kept[i] = True
            group, group_end = [], -1
        if index is not None:
            group.append(index)
            group_end = max(group_end, ranges[index][1])
    return kept


def own_mappings() -> list[HostMapping]:
    """This process's mappings, from smaps for their VmFlags (read only when such storages exist)."""
    return parse_maps(Path("/proc/self/smaps").read_text())


def interior(start: int, nbytes: int, page: int = PAGE_SIZE) -> tuple[int, int]:
    """The whole pages inside ``[start, start + nbytes)``: (first page's address, length)."""
    first = -(-start // page) * page
    last = (start + nbytes) // page * page
    return first, max(0, last - first)


_libc: ctypes.CDLL | None = None


def discard_pages(address: int, length: int) -> None:
    """``madvise(MADV_DONTNEED)`` over whole pages: memory back to the OS, the address kept."""
    global _libc
    if not length:
        return
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _libc.madvise.restype = ctypes.c_int
    if _libc.madvise(address, length, MADV_DONTNEED) != 0:
        errno = ctypes.get_errno()
        raise UnsupportedError(
            f"madvise(MADV_DONTNEED) of {length} bytes at {address:#x} failed: {os.strerror(errno)}; "
            "these pages were not released",
            hint="the pages were locked (mlock) or remapped after the sleep began; untrack the tensor "
            "or copy it into torch-allocated memory",
        )
