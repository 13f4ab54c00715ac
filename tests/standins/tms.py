"""Stand-in for torch_memory_saver 0.0.10 in its ``torch`` hook mode, over host memory (tests only).

On a GPU machine ``import torch_memory_saver`` gives the real package: a Python
front (``TorchMemorySaver``, the ``torch_memory_saver`` singleton) over a C++
library that ``torch.cuda.MemPool``'s pluggable allocator calls. Here a test
puts this stand-in in ``sys.modules`` under that name (:func:`install`), with
the same public names and the private attributes hibernate reads
(``_impl``, ``_impl_ctor_kwargs``, ``_impl._hook_mode``, ``_impl._mem_pools``,
``_impl._binary_wrapper.cdll``). The CPU stands for the CUDA device: inside
``region(tag)``, on the thread that entered it, every torch op's output that
owns fresh memory is moved into memory of the region's pool.

It has the real layering, each layer keeping its real contract:

* :class:`SaverCore` is the C++ ``TorchMemorySaver`` (``csrc/core.cpp``): one
  allocation per ``malloc`` (tag, device, raw size, size rounded to the 2 MiB
  granularity, state ACTIVE or PAUSED), each a fixed address range of
  :class:`~tests.standins.vllm_memory.HostReservations`. ``malloc`` refuses
  with out-of-memory when ``memory_margin_bytes`` plus the size exceeds the
  device's free memory, or when ``cuMemCreate`` finds too little free memory.
  ``pause(tag)`` unmaps every allocation of the tag (every allocation for
  ``""``); one that is not ACTIVE ends the process (``exit(1)``), the ones
  before it in the loop already paused. ``resume(tag)`` maps each at the SAME
  address with fresh contents (a poison byte: device memory comes back as
  garbage, not zeros); one not PAUSED, or ``cuMemCreate`` out of memory, ends
  the process. ``free`` works on a paused allocation (it unmaps only an active one).
* :class:`StandInLibrary` is the loaded library (``csrc/entrypoint.cpp``),
  what ``_binary_wrapper.cdll`` exposes: thread-local region config (tag,
  "interesting region"), ``tms_pause``/``tms_resume``,
  ``set_memory_margin_bytes``, and the two pluggable-allocator hooks.
  ``tms_torch_malloc`` and ``tms_torch_free`` end the process outside an
  interesting region, and ``tms_torch_malloc`` ends it on out of memory too
  (``CUDA_ERROR_CHECK``): in this mode an out-of-memory inside a region is
  fatal, never a ``torch.OutOfMemoryError``.
* :class:`StandInMemPool` is ``torch.cuda.MemPool(allocator=tms)``, with
  torch's caching allocator in front of the library: requests rounded to 512
  bytes; up to 1 MiB from 2 MiB "small" segments, up to 10 MiB from 20 MiB
  "large" segments, above that a segment of the size rounded to 2 MiB; best
  fit, blocks split and merged as torch does. A tensor's death frees its
  block, not the segment: torch keeps a live pool's segments (tms never drops
  its pools), so a tms allocation lives until the process ends, is paused and
  resumed with whatever blocks it holds, and hands out its free blocks again
  (a block of a paused allocation included: writing it would fault on a GPU,
  which the stand-in raises as :class:`StandInFault`). ``.id`` is ``(0, N)``
  as for every user-created pool.

Fatal paths print the C++ message to stderr and ``os._exit(1)``, as the real
library does; ``install(fatal_raises=True)`` raises :class:`StandInExit`
instead, so an in-process test keeps its pytest worker. Only what hibernate
uses is modelled: CPU and disk backups, ``disable()``, the ``preload`` hook
mode (and so ``cuda_graph()`` and ``configure_subprocess()``), the
``TMS_INIT_*`` environment variables and XPU/ROCm are refused or absent.
What the stand-in cannot catch: reading a paused tensor touches a
``PROT_NONE`` range and kills the process with SIGSEGV (a GPU faults too);
storages of moved tensors cannot be resized (``torch.frombuffer``), where a
real CUDA storage can.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import sys
import threading
import types
import weakref
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum
from importlib.machinery import ModuleSpec
from typing import Any, NoReturn

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from tests.standins.vllm_memory import HostReservations, StandInFault

MODULE_NAME = "torch_memory_saver"
MIB = 1 << 20
GRANULARITY = 2 * MIB  # cuMemGetAllocationGranularity(MINIMUM) on current NVIDIA GPUs
CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation
CUDA_ERROR_INVALID_VALUE = 1  # what cudaFree answers for a pointer it never gave
_SOURCE = "[torch_memory_saver.cpp]"

# torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp)
MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 * MIB
SMALL_BUFFER = 2 * MIB
LARGE_BUFFER = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB

# Ops whose output aliases their input yet is a tensor the program just made (``torch.tensor(...)``).
_FRESH_ALIASES = (torch.ops.aten.lift_fresh.default,)

_user_pool_ids = itertools.count(1)  # torch counts user-created pools (0, N) process-wide from 1


class StandInExit(StandInFault):
    """The real library would have ended the process here (``exit(1)``); raised with ``fatal_raises``."""

    status = 1


class AllocationState(Enum):
    ACTIVE = "active"
    PAUSED = "paused"


@dataclass
class Allocation:
    """One ``AllocationMetadata`` of the C++ core."""

    address: int
    raw_size: int
    allocation_size: int
    device: int
    tag: str
    state: AllocationState


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def round_block_size(nbytes: int) -> int:
    """torch's ``round_size``: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK_SIZE, _round_up(nbytes, MIN_BLOCK_SIZE))


def segment_size_for(block_size: int) -> int:
    """torch's ``get_allocation_size``: the size of the segment a new block of ``block_size`` gets."""
    if block_size <= SMALL_SIZE:
        return SMALL_BUFFER
    if block_size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return _round_up(block_size, ROUND_LARGE)


# -- the C++ core and the loaded library ---------------------------------------------------


class SaverCore:
    """The C++ ``TorchMemorySaver`` singleton (see the module docstring)."""

    def __init__(self, world: StandInTms) -> None:
        self._world = world
        self._allocations: dict[int, Allocation] = {}  # insertion order stands for the map's order
        self.memory_margin_bytes = 0

    def malloc(self, device: int, raw_size: int, tag: str) -> int | None:
        """An address, or None for ``cudaErrorMemoryAllocation``."""
        world = self._world
        allocation_size = _round_up(raw_size, GRANULARITY)
        with world.lock:
            margin = self.memory_margin_bytes
            free = world.free_bytes(device)
            if margin > 0 and free is not None and margin + allocation_size > free:
                print(
                    f"{_SOURCE} TorchMemorySaver::malloc return OOM since memory_margin_bytes={margin}"
                    f" allocation_size={allocation_size} free_bytes={free}",
                    flush=True,
                )
                return None
            if not world.cu_mem_create(device, allocation_size):
                return None
            address = world.reservations.reserve(allocation_size)
            self._allocations[address] = Allocation(
                address, raw_size, allocation_size, device, tag, AllocationState.ACTIVE
            )
            return address

    def free(self, address: int) -> int:
        """0, or the error of the real ``cudaFree`` the core forwards an address it does not own to."""
        world = self._world
        with world.lock:
            allocation = self._allocations.pop(address, None)
            if allocation is None:
                return CUDA_ERROR_INVALID_VALUE
            if allocation.state is AllocationState.ACTIVE:
                world.cu_mem_release(allocation.device, allocation.allocation_size)
            world.reservations.free(address)
            return 0

    def _selected(self, tag: str) -> list[Allocation]:
        return [a for a in self._allocations.values() if not tag or a.tag == tag]

    def pause(self, tag: str) -> int:
        world = self._world
        with world.lock:
            for allocation in self._selected(tag):
                if allocation.state is not AllocationState.ACTIVE:
                    world.fatal(
                        f"{_SOURCE} Cannot pause allocation that is not active. tag={allocation.tag}"
                        f" ptr={allocation.address} file=csrc/core.cpp func=pause"
                    )
                world.reservations.unmap(allocation.address, allocation.allocation_size)
                world.cu_mem_release(allocation.device, allocation.allocation_size)
                allocation.state = AllocationState.PAUSED
        return 0

    def resume(self, tag: str) -> int:
        world = self._world
        with world.lock:
            for allocation in self._selected(tag):
                if allocation.state is not AllocationState.PAUSED:
                    world.fatal(
                        f"{_SOURCE} Cannot resume allocation that is not paused.  tag={allocation.tag}"
                        f" ptr={allocation.address} file=csrc/core.cpp func=resume"
                    )
                if not world.cu_mem_create(allocation.device, allocation.allocation_size):
                    world.fatal(
                        f"{_SOURCE} cudaError error: {CUDA_ERROR_MEMORY_ALLOCATION} (out of memory) "
                        " file=csrc/core.cpp func=resume"
                    )
                world.reservations.map(allocation.address, allocation.allocation_size)
                allocation.state = AllocationState.ACTIVE
        return 0

    def allocations(self) -> list[Allocation]:
        with self._world.lock:
            return [replace(a) for a in self._allocations.values()]

    def find(self, address: int, nbytes: int) -> Allocation | None:
        """The live allocation holding ``[address, address + nbytes)``, if any (a copy)."""
        with self._world.lock:
            for allocation in self._allocations.values():
                if (
                    allocation.address <= address
                    and address + nbytes <= allocation.address + allocation.allocation_size
                ):
                    return replace(allocation)
        return None


class _ThreadConfig(threading.local):
    """``ThreadLocalConfig`` of entrypoint.cpp (the ``TMS_INIT_*`` defaults are not modelled)."""

    def __init__(self) -> None:
        self.current_tag = "default"
        self.interesting_region = False


class StandInLibrary:
    """The loaded ``torch_memory_saver_hook_mode_torch`` library: what ``_binary_wrapper.cdll`` has."""

    def __init__(self, world: StandInTms) -> None:
        self._world = world
        self._config = _ThreadConfig()

    def tms_set_current_tag(self, tag: bytes) -> None:
        if tag is None:
            self._world.fatal(f"{_SOURCE} tag should not be null file=csrc/entrypoint.cpp")
        self._config.current_tag = tag.decode("utf-8")

    def tms_get_current_tag(self) -> bytes:
        return self._config.current_tag.encode("utf-8")

    def tms_set_interesting_region(self, value: bool) -> None:
        self._config.interesting_region = bool(value)

    def tms_get_interesting_region(self) -> bool:
        return self._config.interesting_region

    def set_memory_margin_bytes(self, value: int) -> None:
        self._world.core.memory_margin_bytes = int(value)

    def tms_pause(self, tag: bytes | None) -> int:
        self._world.pauses += 1
        return self._world.core.pause(tag.decode("utf-8") if tag is not None else "")

    def tms_resume(self, tag: bytes | None) -> int:
        self._world.resumes += 1
        return self._world.core.resume(tag.decode("utf-8") if tag is not None else "")

    def _require_region(self, func: str) -> None:
        if not self._config.interesting_region:
            self._world.fatal(
                f"{_SOURCE} only support interesting region file=csrc/entrypoint.cpp func={func}"
            )

    def tms_torch_malloc(self, size: int, device: int, stream: int = 0) -> int:
        """The pluggable allocator's malloc: a new segment for torch's caching allocator."""
        self._require_region("tms_torch_malloc")
        address = self._world.core.malloc(device, size, self._config.current_tag)
        if address is None:
            self._world.fatal(
                f"{_SOURCE} cudaError error: {CUDA_ERROR_MEMORY_ALLOCATION} (out of memory) "
                " file=csrc/entrypoint.cpp func=tms_torch_malloc"
            )
        return address

    def tms_torch_free(self, ptr: int, size: int, device: int, stream: int = 0) -> None:
        """The pluggable allocator's free: torch releasing a segment (``empty_cache`` of a dropped pool)."""
        self._require_region("tms_torch_free")
        result = self._world.core.free(ptr)
        if result != 0:
            self._world.fatal(
                f"{_SOURCE} cudaError error: {result} (invalid argument)  file=csrc/entrypoint.cpp"
                " func=tms_torch_free"
            )


# -- torch's side: MemPool with the caching allocator, and the routing of a thread's ops ------


@dataclass
class _Block:
    address: int
    size: int
    requested: int = 0
    allocated: bool = False


@dataclass
class _Segment:
    address: int
    size: int
    small: bool
    blocks: list[_Block]

    def fully_free(self) -> bool:
        return len(self.blocks) == 1 and not self.blocks[0].allocated


class StandInMemPool:
    """``torch.cuda.MemPool(allocator=...)`` of the tms library (see the module docstring)."""

    def __init__(self, world: StandInTms, library: StandInLibrary, device: int) -> None:
        self.id: tuple[int, int] = (0, next(_user_pool_ids))
        self.device = device
        self._world = world
        self._library = library
        self._segments: list[_Segment] = []
        world.register_pool(self)

    def _allocate_block(self, nbytes: int) -> tuple[_Segment, _Block]:
        size = round_block_size(nbytes)
        small = size <= SMALL_SIZE
        best: tuple[_Segment, _Block] | None = None
        for segment in self._segments:
            if segment.small != small:
                continue
            for block in segment.blocks:
                if block.allocated or block.size < size:
                    continue
                if best is None or (block.size, block.address) < (best[1].size, best[1].address):
                    best = (segment, block)
        if best is None:
            segment_size = segment_size_for(size)
            address = self._library.tms_torch_malloc(segment_size, self.device)
            segment = _Segment(address, segment_size, small, [_Block(address, segment_size)])
            self._segments.append(segment)
            best = (segment, segment.blocks[0])
        segment, block = best
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK_SIZE) or (not small and remaining > SMALL_SIZE):
            index = segment.blocks.index(block)
            segment.blocks.insert(index + 1, _Block(block.address + size, remaining))
            block.size = size
        block.allocated = True
        block.requested = nbytes
        return segment, block

    def adopt(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """A storage of this pool holding ``storage``'s bytes; its death frees the block."""
        nbytes = storage.nbytes()
        with self._world.lock:
            segment, block = self._allocate_block(nbytes)
            if not self._world.reservations.is_mapped(segment.address):
                self._free_block(block.address)
                raise StandInFault(
                    f"a new tensor got a block of the paused allocation {segment.address:#x}"
                    " (writing it faults on a GPU: allocate in a region only while its tag is resumed)"
                )
        ctypes.memmove(block.address, storage.data_ptr(), nbytes)
        buffer = (ctypes.c_uint8 * nbytes).from_address(block.address)
        weakref.finalize(buffer, self._free_block, block.address).atexit = False
        return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()

    def _free_block(self, address: int) -> None:
        """torch's ``free_block``: the block is free for reuse, merged with free neighbours."""
        with self._world.lock:
            for segment in self._segments:
                for index, block in enumerate(segment.blocks):
                    if block.address == address:
                        self._merge_free(segment, index)
                        if self._world.closed and segment.fully_free():
                            self._segments.remove(segment)
                            self._world.core.free(segment.address)
                        return

    @staticmethod
    def _merge_free(segment: _Segment, index: int) -> None:
        block = segment.blocks[index]
        block.allocated, block.requested = False, 0
        after = index + 1
        if after < len(segment.blocks) and not segment.blocks[after].allocated:
            block.size += segment.blocks.pop(after).size
        if index > 0 and not segment.blocks[index - 1].allocated:
            segment.blocks[index - 1].size += segment.blocks.pop(index).size

    def release_free_segments(self) -> None:
        """Give every segment with no live block back (cleanup when the stand-in is uninstalled)."""
        with self._world.lock:
            for segment in [s for s in self._segments if s.fully_free()]:
                self._segments.remove(segment)
                self._world.core.free(segment.address)

    def snapshot(self) -> list[dict[str, Any]]:
        """This pool's segments as ``torch.cuda.memory_snapshot`` gives them."""
        with self._world.lock:
            return [self._segment_dict(s) for s in self._segments]

    def _segment_dict(self, segment: _Segment) -> dict[str, Any]:
        allocated = [b for b in segment.blocks if b.allocated]
        return {
            "device": self.device,
            "address": segment.address,
            "total_size": segment.size,
            "allocated_size": sum(b.size for b in allocated),
            "active_size": sum(b.size for b in allocated),
            "requested_size": sum(b.requested for b in allocated),
            "stream": 0,
            "segment_type": "small" if segment.small else "large",
            "segment_pool_id": self.id,
            "is_expandable": False,
            "frames": [],
            "blocks": [
                {
                    "address": b.address,
                    "size": b.size,
                    "requested_size": b.requested,
                    "state": "active_allocated" if b.allocated else "inactive",
                    "frames": [],
                }
                for b in segment.blocks
            ],
        }


class _PoolRouting(TorchDispatchMode):
    """Moves a thread's fresh op outputs into the pool it routes to (``torch.cuda.use_mem_pool``)."""

    def __init__(self, stack: list[StandInMemPool]) -> None:
        super().__init__()
        self._stack = stack

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        out = func(*args, **(kwargs or {}))
        pool = self._stack[-1]
        inputs = {
            leaf.untyped_storage().data_ptr()
            for leaf in tree_flatten((args, kwargs))[0]
            if isinstance(leaf, torch.Tensor) and leaf.layout == torch.strided
        }
        moved: dict[int, torch.UntypedStorage] = {}

        def move(value: Any) -> Any:
            if not isinstance(value, torch.Tensor) or value.layout != torch.strided or value.is_meta:
                return value
            storage = value.untyped_storage()
            pointer = storage.data_ptr()
            if storage.nbytes() == 0 or (pointer in inputs and func not in _FRESH_ALIASES):
                return value
            if pointer not in moved:
                moved[pointer] = pool.adopt(storage)
            return torch.empty(0, dtype=value.dtype).set_(
                moved[pointer], value.storage_offset(), value.size(), value.stride()
            )

        return tree_map(move, out)


class _ThreadRouting(threading.local):
    def __init__(self) -> None:
        self.stack: list[StandInMemPool] = []
        self.mode: _PoolRouting | None = None


# -- the world a test controls --------------------------------------------------------------


class StandInTms:
    """The state of one installed stand-in: the core, the library, the pools, and the test's controls."""

    def __init__(self, fatal_raises: bool = False) -> None:
        self.fatal_raises = fatal_raises
        self.current_device = 0  # stands for torch.cuda.current_device() (one for all threads here)
        self.lock = threading.RLock()
        self.reservations = HostReservations()
        self.core = SaverCore(self)
        self.library = StandInLibrary(self)
        self.pauses = 0  # tms_pause calls
        self.resumes = 0  # tms_resume calls
        self.closed = False
        self._free: dict[int, int] = {}  # free device memory, for devices the test gave a budget
        self._used: defaultdict[int, int] = defaultdict(int)
        self._pools: list[StandInMemPool] = []
        self._routing = _ThreadRouting()
        _worlds.add(self)

    # controls and readings
    def set_free_bytes(self, device: int, free: int | None) -> None:
        """The free memory ``cudaMemGetInfo`` reports on ``device`` now (None: unlimited)."""
        with self.lock:
            if free is None:
                self._free.pop(device, None)
            else:
                self._free[device] = free

    def free_bytes(self, device: int) -> int | None:
        with self.lock:
            return self._free.get(device)

    def used_bytes(self, device: int) -> int:
        """Device memory the allocations hold now (paused ones hold none)."""
        with self.lock:
            return self._used[device]

    def allocations(self) -> list[Allocation]:
        return self.core.allocations()

    def is_mapped(self, address: int) -> bool:
        return self.reservations.is_mapped(address)

    def pools(self) -> list[StandInMemPool]:
        with self.lock:
            return list(self._pools)

    def memory_snapshot(self, pool_id: tuple[int, int] | None = None) -> list[dict[str, Any]]:
        """``torch.cuda.memory_snapshot(mempool_id)``: every segment, or those of one pool.

        The segments of live stand-in CUDA graphs (:mod:`tests.standins.cuda_graphs`) are part of it.
        """
        from tests.standins.cuda_graphs import graph_segments

        segments = [s for pool in self.pools() for s in pool.snapshot()] + graph_segments()
        if pool_id is None or tuple(pool_id) == (0, 0):
            return segments
        return [s for s in segments if s["segment_pool_id"] == tuple(pool_id)]

    # what the layers share
    def fatal(self, message: str) -> NoReturn:
        """What ``SIMPLE_CHECK`` / ``CUDA_ERROR_CHECK`` do: the message on stderr, then ``exit(1)``."""
        print(message, file=sys.stderr, flush=True)
        if self.fatal_raises:
            raise StandInExit(message)
        sys.stdout.flush()
        os._exit(1)

    def cu_mem_create(self, device: int, size: int) -> bool:
        """Physical memory for an allocation; False (and the C++ message) when the device has too little."""
        with self.lock:
            free = self._free.get(device)
            if free is not None and size > free:
                print(
                    f"{_SOURCE} cuMemCreate CUDA_ERROR_OUT_OF_MEMORY (may not be an issue e.g. torch"
                    " allocator will free cache and retry)",
                    file=sys.stderr,
                    flush=True,
                )
                return False
            if free is not None:
                self._free[device] = free - size
            self._used[device] += size
            return True

    def cu_mem_release(self, device: int, size: int) -> None:
        with self.lock:
            self._used[device] -= size
            if device in self._free:
                self._free[device] += size

    def register_pool(self, pool: StandInMemPool) -> None:
        with self.lock:
            self._pools.append(pool)

    @contextlib.contextmanager
    def use_mem_pool(self, pool: StandInMemPool) -> Iterator[None]:
        """``torch.cuda.use_mem_pool(pool)``: this thread's new tensors come from ``pool``."""
        routing = self._routing
        routing.stack.append(pool)
        entered = routing.mode is None
        if entered:
            routing.mode = _PoolRouting(routing.stack)
            routing.mode.__enter__()
        try:
            yield
        finally:
            routing.stack.pop()
            if entered:
                assert routing.mode is not None
                routing.mode.__exit__(None, None, None)
                routing.mode = None

    def close(self) -> None:
        """Give back every segment no tensor uses; the others go when their last tensor dies."""
        with self.lock:
            self.closed = True
            for pool in self._pools:
                pool.release_free_segments()


_worlds: weakref.WeakSet[StandInTms] = weakref.WeakSet()


def find_allocation(address: int, nbytes: int) -> tuple[StandInTms, Allocation] | None:
    """The stand-in allocation (of any stand-in still alive) holding ``[address, address + nbytes)``."""
    for world in list(_worlds):
        found = world.core.find(address, nbytes)
        if found is not None:
            return world, found
    return None


# -- the Python package: torch_memory_saver/entrypoint.py's shape ----------------------------

_installed: StandInTms | None = None
_previous_module: types.ModuleType | None = None

_NOT_MODELLED = (
    "the torch_memory_saver stand-in models only what hibernate uses: hook_mode='torch',"
    " region(tag) without CPU or disk backup, pause(tag), resume(tag), memory_margin_bytes"
)


def _require_installed() -> StandInTms:
    if _installed is None:
        raise RuntimeError("the torch_memory_saver stand-in is not installed (tests.standins.tms.install)")
    return _installed


class _BinaryWrapper:
    def __init__(self, library: StandInLibrary) -> None:
        self.cdll = library


class _TorchMemorySaverImpl:
    def __init__(self, hook_mode: str = "preload") -> None:
        world = _require_installed()
        if hook_mode == "preload":
            preload = os.environ.get("LD_PRELOAD", "")
            preloaded = [p for p in preload.split(":") if "torch_memory_saver" in p]
            assert len(preloaded) == 1, (
                f'TorchMemorySaver observes invalid LD_PRELOAD. (LD_PRELOAD="{preload}")'
            )

            raise NotImplementedError(_NOT_MODELLED)
        if hook_mode != "torch":
            raise KeyError(hook_mode)
        self._hook_mode = hook_mode
        self._world = world
        self._binary_wrapper = _BinaryWrapper(world.library)
        self._mem_pools: defaultdict[tuple[Any, ...], StandInMemPool] = defaultdict(
            lambda: StandInMemPool(world, world.library, world.current_device)
        )
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise RuntimeError(
                "TorchMemorySaver is disabled for the current process because expandable_segments is not"
                " supported yet."
            )

    @contextlib.contextmanager
    def region(self, tag: str) -> Iterator[None]:
        world = self._world
        key = (tag, False, False, "", world.current_device)
        with world.use_mem_pool(self._mem_pools[key]), self._with_region_config(tag):
            yield

    @contextlib.contextmanager
    def _with_region_config(self, tag: str) -> Iterator[None]:
        cdll = self._binary_wrapper.cdll
        previous_tag = cdll.tms_get_current_tag().decode("utf-8")
        previous_region = cdll.tms_get_interesting_region()
        cdll.tms_set_current_tag(tag.encode("utf-8"))
        cdll.tms_set_interesting_region(True)
        try:
            yield
        finally:
            assert cdll.tms_get_interesting_region()
            assert cdll.tms_get_current_tag().decode("utf-8") == tag
            cdll.tms_set_current_tag(previous_tag.encode("utf-8"))
            cdll.tms_set_interesting_region(previous_region)

    def pause(self, tag: str | None) -> None:
        self._binary_wrapper.cdll.tms_pause(tag.encode("utf-8") if tag else None)

    def resume(self, tag: str | None) -> None:
        self._binary_wrapper.cdll.tms_resume(tag.encode("utf-8") if tag else None)


class TorchMemorySaver:
    """``torch_memory_saver.TorchMemorySaver`` of 0.0.10, over the installed stand-in."""

    def __init__(self) -> None:
        self._impl_ctor_kwargs: dict[str, Any] = {}
        self._impl: _TorchMemorySaverImpl | None = None

    @contextlib.contextmanager
    def region(
        self,
        tag: str = "default",
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: str | None = None,
    ) -> Iterator[None]:
        if enable_cpu_backup or enable_disk_backup or cpu_backup_backend is not None:
            raise NotImplementedError(_NOT_MODELLED)
        impl = self._ensure_initialized()
        with impl.region(tag):
            yield

    def cuda_graph(
        self, cuda_graph: Any, *args: Any, **kwargs: Any
    ) -> contextlib.AbstractContextManager[None]:
        """Refused in the torch hook mode, as the real one asserts (the preload mode is not modelled)."""
        impl = self._ensure_initialized()
        assert impl._hook_mode == "preload", "Only hook_mode=preload supports pauseable CUDA Graph currently"
        raise NotImplementedError(_NOT_MODELLED)

    def disable(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError(_NOT_MODELLED)

    def pause(self, tag: str | None = None) -> None:
        """Pause memory of ``tag``, or all memory if ``tag`` is None."""
        self._ensure_initialized().pause(tag)

    def resume(self, tag: str | None = None) -> None:
        """Resume memory of ``tag``, or all memory if ``tag`` is None."""
        self._ensure_initialized().resume(tag)

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        raise AttributeError

    @hook_mode.setter
    def hook_mode(self, hook_mode: str) -> None:
        assert self._impl_ctor_kwargs is not None, "Cannot configure after initialization"
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self) -> int:
        raise NotImplementedError("Only setter is supported")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self._ensure_initialized()._binary_wrapper.cdll.set_memory_margin_bytes(value)

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> torch.Tensor | None:
        raise NotImplementedError(_NOT_MODELLED)

    def set_disk_backup_dir(self, path: str) -> None:
        raise NotImplementedError(_NOT_MODELLED)

    def _ensure_initialized(self) -> _TorchMemorySaverImpl:
        if self._impl is None:
            self._impl = _TorchMemorySaverImpl(**self._impl_ctor_kwargs)
            del self._impl_ctor_kwargs
        return self._impl


def configure_subprocess() -> contextlib.AbstractContextManager[None]:
    """The real one sets ``LD_PRELOAD`` for the ``preload`` hook mode, which is not modelled."""
    raise NotImplementedError(_NOT_MODELLED)


# -- installing ------------------------------------------------------------------------------


def install(fatal_raises: bool = False) -> types.ModuleType:
    """Put a fresh stand-in in ``sys.modules["torch_memory_saver"]``; returns that module.

    The module's ``standin`` attribute is the :class:`StandInTms` the test controls.
    """
    global _installed, _previous_module
    if _installed is not None:
        raise RuntimeError("the torch_memory_saver stand-in is already installed")
    world = StandInTms(fatal_raises=fatal_raises)
    module = types.ModuleType(MODULE_NAME, "stand-in for torch_memory_saver 0.0.10 (tests only)")
    module.__spec__ = ModuleSpec(MODULE_NAME, None)
    module.TorchMemorySaver = TorchMemorySaver  # type: ignore[attr-defined]
    module.configure_subprocess = configure_subprocess  # type: ignore[attr-defined]
    module.standin = world  # type: ignore[attr-defined]
    _previous_module = sys.modules.get(MODULE_NAME)
    _installed = world
    module.torch_memory_saver = TorchMemorySaver()  # type: ignore[attr-defined]
    sys.modules[MODULE_NAME] = module
    return module


def uninstall() -> None:
    """Restore ``sys.modules`` as it was, and give back the memory no tensor uses any more."""
    global _installed, _previous_module
    world = _require_installed()
    if _previous_module is None:
        sys.modules.pop(MODULE_NAME, None)
    else:
        sys.modules[MODULE_NAME] = _previous_module
    _installed, _previous_module = None, None
    world.close()


@contextlib.contextmanager
def installed(fatal_raises: bool = True) -> Iterator[types.ModuleType]:
    """The stand-in installed for the block (fatal paths raise by default: in-process tests)."""
    module = install(fatal_raises=fatal_raises)
    try:
        yield module
    finally:
        uninstall()


def current() -> StandInTms:
    """The installed stand-in's controls."""
    return _require_installed()
