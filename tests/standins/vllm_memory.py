"""Stand-ins for a vLLM worker's device memory, on a machine without a GPU.

Each stands for one real thing and keeps its contract; none is used outside tests.

* :class:`HostReservations` stands for the virtual-address reservations vLLM's
  cumem extension makes. Every allocation is one anonymous mmap kept reserved
  for its whole life, so an address never changes (the property under test,
  since on CPU one cannot choose where memory is mapped). ``unmap`` gives the
  pages back to the OS (MADV_DONTNEED) and makes the range inaccessible
  (PROT_NONE), as ``unmap_and_release`` leaves a reserved range with no
  physical memory; ``map`` makes it accessible again at the same address and
  fills it with a poison byte, because fresh device memory holds garbage, not
  zeros. Mapping a mapped range or unmapping an unmapped one fails, as
  ``cuMemMap`` / ``cuMemUnmap`` would.
* :class:`StandInCuMemAllocator` stands for ``CuMemAllocator``: its records are
  REAL ``vllm.device_allocator.AllocationData`` objects in ``pointer_to_data``,
  keyed by address, with vLLM's handle layout (device, aligned size, pointer,
  pointer to the generic allocation handle). The granularity is the page size
  (CUDA's is usually 2 MiB) so that sizes are not multiples of the chunk size.
  Like vLLM 0.33's, ``use_memory_pool(tag)`` routes the block's new tensors
  (the calling thread's) through a new MemPool of the allocator
  (:class:`StandInCuMemPool`: torch's caching allocator in front, each
  segment one allocation recorded under the allocator's ``current_tag``),
  and releases its free segments on the way out (vLLM's ``_trim``);
  ``cudagraph_pool()`` yields the id of the allocator's one graph MemPool with
  ``current_tag`` ``cudagraph`` inside, for a capture's ``pool=``
  (:mod:`tests.standins.cuda_graphs`). ``allocate`` makes one allocation
  directly, as the tests of the pool's own rules do.
* :func:`create_and_map` / :func:`unmap_and_release` have the signatures of
  vLLM's ``vllm.device_allocator.cumem`` functions, over the reservations.
  They keep the one flaw of vLLM 0.33's C extension that a sleep can meet: a
  module-global error code (:attr:`HostReservations.stale_error`). A failing
  driver call sets it; only a failing ``create_and_map`` or
  ``unmap_and_release`` clears it, by raising it. ``my_free`` (the end of
  :meth:`StandInCuMemAllocator.free`) is given the handle of an allocation
  that is asleep too, fails to unmap it and leaves the code set; so the next
  ``create_and_map`` creates physical memory, returns before mapping it
  (the memory is leaked) and raises the stale, unrelated message; a call after
  that works again. The next ``unmap_and_release`` likewise unmaps, leaks the
  physical memory and raises; ``my_malloc`` returns NULL and leaves the code set.
* :class:`HostDeviceMemory` is hibernate's device-memory seam over host memory.
  Any access to an unmapped range raises :class:`StandInFault` (a GPU would fault).
* :func:`reference_sleep` / :func:`reference_wake_up` behave as vLLM's own
  ``CuMemAllocator.sleep`` / ``wake_up`` (host backups of offloaded tags): the
  oracle for "behaves as vLLM's".
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from vllm.device_allocator import DEFERRABLE_TAGS, AllocationData

from hibernate.pools.device import buffer_address
from tests.standins.mempool import CachingMemPool, PoolId, use_mem_pool

POISON = 0xA5
PROT_NONE = 0
PAGE = mmap.PAGESIZE
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class StandInFault(AssertionError):
    """Memory was used in a way the real device (or driver) would refuse or fault on."""


def _check(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what} failed")


@dataclass
class _Reservation:
    address: int
    size: int
    mapped: bool


class HostReservations:
    """Fixed address ranges standing for reserved device virtual memory (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_address: dict[int, _Reservation] = {}
        self.maps = 0
        self.unmaps = 0
        # vLLM's cumem extension's module-global error code and message (see the module docstring).
        self.stale_error: str | None = None
        self.leaked_bytes = 0  # physical memory the extension created or kept and lost track of

    def raise_stale(self) -> None:
        """As ``python_create_and_map`` / ``python_unmap_and_release`` end: a set code is raised, cleared."""
        message, self.stale_error = self.stale_error, None
        if message is not None:
            raise RuntimeError(message)

    def release_freed(self, address: int) -> None:
        """``my_free`` on the handle the free callback handed back: unmap and release, then free the address.

        An allocation that is asleep is not mapped: ``cuMemUnmap`` fails, and
        the error code stays set, since nothing raises it from here.
        """
        with self._lock:
            reservation = self._by_address.pop(address)
            if not reservation.mapped:
                self.stale_error = f"CUDA Error: invalid argument at cumem_allocator.cpp ({address:#x})"
            elif self.stale_error is not None:  # unmapped, then it returns before cuMemRelease
                self.leaked_bytes += reservation.size
        _check(libc.munmap(address, reservation.size), "munmap")

    def reserve(self, size: int) -> int:
        """Reserve and map ``size`` bytes (a page multiple); contents are poison."""
        if size <= 0 or size % PAGE:
            raise StandInFault(f"reservation of {size} bytes is not a positive multiple of the page size")
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        address = libc.mmap(None, size, prot, flags, -1, 0)
        if address in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), "mmap failed")
        ctypes.memset(address, POISON, size)
        with self._lock:
            self._by_address[address] = _Reservation(address, size, True)
        return int(address)

    def free(self, address: int) -> None:
        with self._lock:
            reservation = self._by_address.pop(address)
        _check(libc.munmap(address, reservation.size), "munmap")

    def _get(self, address: int) -> _Reservation:
        reservation = self._by_address.get(address)
        if reservation is None:
            raise StandInFault(f"{address:#x} is not the start of a reservation")
        return reservation

    def map(self, address: int, size: int) -> None:
        with self._lock:
            reservation = self._get(address)
            if size != reservation.size:
                raise StandInFault(f"map of {size} bytes at {address:#x}, reserved {reservation.size}")
            if reservation.mapped:
                raise StandInFault(f"create_and_map of {address:#x}, which is already mapped")
            _check(libc.mprotect(address, size, mmap.PROT_READ | mmap.PROT_WRITE), "mprotect")
            ctypes.memset(address, POISON, size)
            reservation.mapped = True
            self.maps += 1

    def unmap(self, address: int, size: int) -> None:
        with self._lock:
            reservation = self._get(address)
            if size != reservation.size:
                raise StandInFault(f"unmap of {size} bytes at {address:#x}, reserved {reservation.size}")
            if not reservation.mapped:
                raise StandInFault(f"unmap_and_release of {address:#x}, which is not mapped")
            _check(libc.madvise(address, size, mmap.MADV_DONTNEED), "madvise")
            _check(libc.mprotect(address, size, PROT_NONE), "mprotect")
            reservation.mapped = False
            self.unmaps += 1

    def is_mapped(self, address: int) -> bool:
        with self._lock:
            return self._get(address).mapped

    def check_access(self, address: int, nbytes: int) -> None:
        """Raise unless ``[address, address + nbytes)`` lies in one mapped reservation."""
        with self._lock:
            for reservation in self._by_address.values():
                if (
                    reservation.address <= address
                    and address + nbytes <= reservation.address + reservation.size
                ):
                    if not reservation.mapped:
                        raise StandInFault(f"access to {address:#x}, which is not mapped (a GPU would fault)")
                    return
        raise StandInFault(f"access to {address:#x}+{nbytes} outside every reservation")

    def read(self, address: int, nbytes: int) -> bytes:
        self.check_access(address, nbytes)
        return ctypes.string_at(address, nbytes)

    def write(self, address: int, data: bytes) -> None:
        self.check_access(address, len(data))
        ctypes.memmove(address, data, len(data))


def create_and_map(reservations: HostReservations, handle: tuple[int, int, int, Any]) -> None:
    """vLLM's ``create_and_map(handle)``: fresh physical memory at the reserved address.

    With a stale error code set, the memory is created but never mapped (leaked) and the stale
    message is raised, which clears it.
    """
    _, size, address, _ = handle
    if reservations.stale_error is not None:
        reservations.leaked_bytes += size
        reservations.raise_stale()
    reservations.map(address, size)


def unmap_and_release(reservations: HostReservations, handle: tuple[int, int, int, Any]) -> None:
    """vLLM's ``unmap_and_release(handle)``: physical memory gone, the address stays reserved.

    With a stale error code set, the range is unmapped but its physical memory is not released
    (leaked), and the stale message is raised, which clears it.
    """
    _, size, address, _ = handle
    reservations.unmap(address, size)
    if reservations.stale_error is not None:
        reservations.leaked_bytes += size
        reservations.raise_stale()


class StandInCuMemAllocator:
    """CuMemAllocator's records over host reservations (see the module docstring)."""

    instance: ClassVar[StandInCuMemAllocator | None] = None
    default_tag = "default"

    def __init__(self, reservations: HostReservations, device: int = 0, granularity: int = PAGE) -> None:
        self.reservations = reservations
        self.device = device
        self.granularity = granularity
        self.pointer_to_data: dict[int, AllocationData] = {}
        self._handle_boxes: dict[int, ctypes.c_uint64] = {}
        # What use_memory_pool and cudagraph_pool keep, as vLLM's CuMemAllocator does.
        self.current_tag = self.default_tag
        self.allocator_and_pools: dict[str, list[StandInCuMemPool]] = {}
        self.lock = threading.RLock()

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """vLLM's ``use_memory_pool(tag)``: the block's new tensors come from a new MemPool of the
        allocator, each of its segments one allocation recorded under the current tag; on the way out
        the segments no tensor uses any more are released (vLLM's ``_trim``)."""
        if tag is None:
            tag = self.default_tag
        assert isinstance(tag, str)
        old_tag = self.current_tag
        self.current_tag = tag
        try:
            if tag != old_tag:  # older pools of this tag are never reused, so trim them
                for older in self.allocator_and_pools.get(tag, []):
                    self._trim(older)
            pool = StandInCuMemPool(self)
            self.allocator_and_pools.setdefault(tag, []).append(pool)
            with use_mem_pool(pool):
                yield
                self._trim(pool)
        finally:
            self.current_tag = old_tag

    def _trim(self, pool: StandInCuMemPool) -> None:
        for segment in pool.snapshot():
            data = self.pointer_to_data.get(segment["address"])
            if segment["allocated_size"] == 0 and data is not None and not data.is_asleep:
                pool.release_segment(segment["address"])

    @contextlib.contextmanager
    def cudagraph_pool(self) -> Iterator[PoolId]:
        """vLLM's ``cudagraph_pool()``: the id of the allocator's graph MemPool (one, made on first use),
        with the current tag ``cudagraph`` while inside; a capture given ``pool=`` that id allocates there."""
        if "cudagraph" not in self.allocator_and_pools:
            self.allocator_and_pools["cudagraph"] = [StandInCuMemPool(self)]
        old_tag = self.current_tag
        self.current_tag = "cudagraph"
        try:
            yield self.allocator_and_pools["cudagraph"][0].id
        finally:
            self.current_tag = old_tag

    @classmethod
    def get_instance(cls) -> StandInCuMemAllocator:
        if cls.instance is None:
            raise StandInFault("the stand-in allocator has no instance; the test must create one")
        return cls.instance

    def allocate(self, nbytes: int, tag: str) -> int:
        if self.reservations.stale_error is not None:  # my_malloc returns NULL, the code stays set
            raise RuntimeError("CUDA out of memory (the cumem allocator returned NULL)")
        aligned = -(-nbytes // self.granularity) * self.granularity
        address = self.reservations.reserve(aligned)
        box = ctypes.c_uint64(address)  # stands for the CUmemGenericAllocationHandle vLLM points at
        self._handle_boxes[address] = box
        handle = (self.device, aligned, address, ctypes.addressof(box))
        self.pointer_to_data[address] = AllocationData(handle, tag)
        return address

    def free(self, address: int) -> None:
        """What the free callback and the C extension do when a tensor's memory is freed.

        As in vLLM 0.33 on CUDA, the callback hands back the handle of an allocation that is asleep
        too, and ``my_free`` then fails to unmap it (see :meth:`HostReservations.release_freed`).
        """
        data = self.pointer_to_data.pop(address)
        data.cpu_backup_tensor = None
        self.reservations.release_freed(address)
        del self._handle_boxes[address]

    def size_of(self, address: int) -> int:
        return int(self.pointer_to_data[address].handle[1])

    def by_tag(self, tag: str) -> list[int]:
        return [a for a, d in self.pointer_to_data.items() if d.tag == tag]


class StandInCuMemPool(CachingMemPool):
    """``torch.cuda.MemPool`` over vLLM's pluggable allocator: each segment is one allocation of
    :class:`StandInCuMemAllocator`, recorded under the allocator's current tag when it is made.

    vLLM's ``_trim`` releases a free segment behind torch's back (torch still lists it); here the
    segment also leaves the pool's list, which only the snapshot after a trim shows.
    """

    def __init__(self, allocator: StandInCuMemAllocator) -> None:
        super().__init__(allocator.device, allocator.lock)
        self._allocator = allocator

    def malloc_segment(self, size: int) -> int:
        return self._allocator.allocate(size, self._allocator.current_tag)

    def free_segment(self, address: int) -> None:
        self._allocator.free(address)

    def require_usable(self, segment_address: int) -> None:
        if not self._allocator.reservations.is_mapped(segment_address):
            raise StandInFault(
                f"a new tensor got a block of the allocation {segment_address:#x}, which is asleep"
                " (writing it faults on a GPU)"
            )

    def check_access(self, address: int, nbytes: int) -> None:
        self._allocator.reservations.check_access(address, nbytes)


class HostDeviceMemory:
    """hibernate's DeviceMemory seam over host reservations, with counters the tests read."""

    def __init__(self, reservations: HostReservations) -> None:
        self.reservations = reservations
        self._lock = threading.Lock()
        self.synchronized: list[int] = []
        self.pinned_now = 0
        self.pinned_peak = 0
        self.copied_to_host = 0
        self.fail_copy_after: int | None = None  # raise on the copy after this many bytes

    def map(self, handle: tuple[int, int, int, Any]) -> None:
        create_and_map(self.reservations, handle)

    def unmap(self, handle: tuple[int, int, int, Any]) -> None:
        unmap_and_release(self.reservations, handle)

    def copy_to_host(self, device: int, address: int, dst: memoryview) -> None:
        self.reservations.check_access(address, len(dst))
        with self._lock:
            if self.fail_copy_after is not None and self.copied_to_host >= self.fail_copy_after:
                raise RuntimeError("stand-in device copy failed (injected)")
            self.copied_to_host += len(dst)
        ctypes.memmove(buffer_address(dst), address, len(dst))

    def copy_from_host(self, device: int, address: int, src: memoryview) -> None:
        self.reservations.check_access(address, len(src))
        ctypes.memmove(address, bytes(src) if src.readonly else buffer_address(src), len(src))

    def zero(self, device: int, address: int, nbytes: int) -> None:
        self.reservations.check_access(address, nbytes)
        ctypes.memset(address, 0, nbytes)

    def synchronize(self, device: int) -> None:
        self.synchronized.append(device)

    def empty_cache(self) -> None:
        pass

    def pinner(self) -> Callable[[memoryview], Callable[[], None]]:
        def pin(view: memoryview) -> Callable[[], None]:
            size = len(view)
            with self._lock:
                self.pinned_now += size
                self.pinned_peak = max(self.pinned_peak, self.pinned_now)

            def unpin() -> None:
                with self._lock:
                    self.pinned_now -= size

            return unpin

        return pin


# -- vLLM's own behaviour, the oracle ---------------------------------------------


def reference_sleep(
    allocator: StandInCuMemAllocator, memory: HostDeviceMemory, offload_tags: Iterable[str]
) -> None:
    """As ``CuMemAllocator.sleep(offload_tags)``: a host copy of each offloaded allocation, all unmapped.

    Allocations already asleep keep the policy they were put to sleep with.
    """
    offload = tuple(offload_tags)
    for address, data in allocator.pointer_to_data.items():
        if data.is_asleep:
            continue
        size = int(data.handle[1])
        if data.tag in offload:
            backup = torch.empty(size, dtype=torch.uint8)
            ctypes.memmove(backup.data_ptr(), address, size)
            data.cpu_backup_tensor = backup
        memory.unmap(data.handle)
        data.is_asleep = True


def reference_wake_up(
    allocator: StandInCuMemAllocator, memory: HostDeviceMemory, tags: list[str] | None
) -> None:
    """As ``CuMemAllocator.wake_up(tags)``: only deferrable tags may stay asleep."""
    for address, data in allocator.pointer_to_data.items():
        if not data.is_asleep:
            continue
        if tags is None or data.tag in tags or data.tag not in DEFERRABLE_TAGS:
            memory.map(data.handle)
            data.is_asleep = False
            if data.cpu_backup_tensor is not None:
                backup = data.cpu_backup_tensor
                ctypes.memmove(address, backup.data_ptr(), backup.numel())
                data.cpu_backup_tensor = None


def reference_discard(
    allocator: StandInCuMemAllocator, memory: HostDeviceMemory, tags: Iterable[str]
) -> None:
    """As ``CuMemAllocator.discard(tags)``: mapped allocations with ``tags`` unmapped, no backup."""
    wanted = tuple(tags)
    for data in allocator.pointer_to_data.values():
        if data.tag in wanted and not data.is_asleep:
            memory.unmap(data.handle)
            data.is_asleep = True


# -- test data ---------------------------------------------------------------------

MIB = 1 << 20

# Every tag vLLM uses, many sizes: pages, odd page counts, and sizes that are not
# multiples of the 1 MiB chunks the tests spill with (nor of each other).
LAYOUT: list[tuple[str, int]] = [
    ("weights", 3 * MIB + 5 * PAGE),
    ("weights", 1 * MIB),
    ("weights", 7 * PAGE),
    ("weights", 2 * MIB - PAGE),
    ("kv_cache", 2 * MIB + 3 * PAGE),
    ("kv_cache", PAGE),
    ("runtime", 5 * PAGE),
    ("runtime", MIB + PAGE),
    ("workspace", MIB + 11 * PAGE),
    ("cudagraph", 9 * PAGE),
    ("default", 3 * PAGE),
    ("default", 1 * MIB + 1),  # rounded up to the granularity by the allocator
]


def fill(reservations: HostReservations, address: int, size: int, seed: int) -> None:
    """Deterministic bytes, written a MiB at a time (no whole-size temporary)."""
    import random

    rng = random.Random(seed)
    for offset in range(0, size, MIB):
        reservations.write(address + offset, rng.randbytes(min(MIB, size - offset)))


def populate(
    allocator: StandInCuMemAllocator, layout: list[tuple[str, int]], seed: int = 0
) -> dict[int, bytes]:
    """Allocate ``layout`` and fill it; returns each allocation's bytes by address."""
    contents = {}
    for index, (tag, size) in enumerate(layout):
        address = allocator.allocate(size, tag)
        aligned = allocator.size_of(address)
        fill(allocator.reservations, address, aligned, seed * 1000 + index)
        contents[address] = allocator.reservations.read(address, aligned)
    return contents
