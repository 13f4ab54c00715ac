"""torch's side of a ``torch.cuda.MemPool`` over a pluggable allocator, on host memory (tests only).

On a GPU, ``torch.cuda.MemPool(allocator=...)`` puts torch's caching
allocator in front of a library's ``malloc``/``free``: the library hands out
segments, torch splits them into blocks, and ``torch.cuda.use_mem_pool(pool)``
makes the calling thread's new tensors come from that pool. Two stand-ins
need exactly that in front of their library: torch_memory_saver
(:mod:`tests.standins.tms`) and vLLM's ``CuMemAllocator``
(:mod:`tests.standins.vllm_memory`); and a CUDA graph's capture allocates in
a pool too (:mod:`tests.standins.cuda_graphs`). So it lives here once.

* :class:`CachingMemPool` is the caching allocator of one pool: requests
  rounded to 512 bytes; up to 1 MiB from 2 MiB "small" segments, up to
  10 MiB from 20 MiB "large" segments, above that a segment of the size
  rounded to 2 MiB; best fit, blocks split and merged as torch does. A
  tensor's death frees its block, not the segment. ``.id`` is ``(0, N)`` as
  for every user-created pool, counted process-wide, unless a graph's pool
  gives its own ``(N, 0)``. A subclass says where segments come from
  (:meth:`CachingMemPool.malloc_segment`), where they go
  (:meth:`CachingMemPool.free_segment`), and what a GPU would fault on
  (:meth:`CachingMemPool.require_usable`, :meth:`CachingMemPool.check_access`).
* :func:`use_mem_pool` is ``torch.cuda.use_mem_pool``: on the thread that
  entered it, every torch op's output that owns fresh memory is moved into a
  block of the pool (the CPU stands for the device, so the op runs and its
  result is copied in). Nested uses route to the innermost pool.
* :func:`pool_by_id` and :func:`pool_holding` find a live pool, as torch's
  allocator finds the pool a capture names.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

MIB = 1 << 20

# torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp)
MIN_BLOCK_SIZE = 512
SMALL_SIZE = 1 * MIB
SMALL_BUFFER = 2 * MIB
LARGE_BUFFER = 20 * MIB
MIN_LARGE_ALLOC = 10 * MIB
ROUND_LARGE = 2 * MIB

PoolId = tuple[int, int]

# Ops whose output aliases their input yet is a tensor the program just made (``torch.tensor(...)``).
_FRESH_ALIASES = (torch.ops.aten.lift_fresh.default,)

_user_pool_ids = itertools.count(1)  # torch counts user-created pools (0, N) process-wide from 1
_live_pools: weakref.WeakSet[CachingMemPool] = weakref.WeakSet()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def round_block_size(nbytes: int) -> int:
    """torch's ``round_size``: at least 512 bytes, a multiple of 512."""
    return max(MIN_BLOCK_SIZE, round_up(nbytes, MIN_BLOCK_SIZE))


def segment_size_for(block_size: int) -> int:
    """torch's ``get_allocation_size``: the size of the segment a new block of ``block_size`` gets."""
    if block_size <= SMALL_SIZE:
        return SMALL_BUFFER
    if block_size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return round_up(block_size, ROUND_LARGE)


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


class CachingMemPool:
    """torch's caching allocator for one MemPool, over segments a subclass provides."""

    def __init__(self, device: int, lock: threading.RLock, pool_id: PoolId | None = None) -> None:
        self.id: PoolId = pool_id if pool_id is not None else (0, next(_user_pool_ids))
        self.device = device
        self._lock = lock
        self._segments: list[_Segment] = []
        _live_pools.add(self)

    # -- what a subclass says ----------------------------------------------------------

    def malloc_segment(self, size: int) -> int:
        """The pluggable allocator's malloc: the address of a new segment of ``size`` bytes."""
        raise NotImplementedError

    def free_segment(self, address: int) -> None:
        """The pluggable allocator's free: the segment at ``address`` goes back."""
        raise NotImplementedError

    def require_usable(self, segment_address: int) -> None:
        """Raise where writing a new block of this segment would fault on a GPU (it is not mapped)."""

    def releases_free_segments(self) -> bool:
        """Whether a segment goes back as soon as its last block is freed (a pool no longer used)."""
        return False

    def check_access(self, address: int, nbytes: int) -> None:
        """Raise where a kernel reading ``[address, address + nbytes)`` would fault on a GPU."""

    # -- torch's side ----------------------------------------------------------------

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
            address = self.malloc_segment(segment_size)
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

    def _take_block(self, nbytes: int) -> int:
        with self._lock:
            segment, block = self._allocate_block(nbytes)
            try:
                self.require_usable(segment.address)
            except BaseException:
                self._free_block(block.address)
                raise
        return block.address

    def _storage_at(self, address: int, nbytes: int) -> torch.UntypedStorage:
        """A storage over the block; its death frees the block (and keeps this pool alive until then)."""
        buffer = (ctypes.c_uint8 * nbytes).from_address(address)
        weakref.finalize(buffer, self._free_block, address).atexit = False
        return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()

    def adopt(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """A storage of this pool holding ``storage``'s bytes."""
        nbytes = storage.nbytes()
        address = self._take_block(nbytes)
        ctypes.memmove(address, storage.data_ptr(), nbytes)
        return self._storage_at(address, nbytes)

    def allocate(self, nbytes: int, fill: int) -> torch.UntypedStorage:
        """A storage of this pool, every byte ``fill`` (fresh device memory holds garbage)."""
        address = self._take_block(nbytes)
        ctypes.memset(address, fill, nbytes)
        return self._storage_at(address, nbytes)

    def _free_block(self, address: int) -> None:
        """torch's ``free_block``: the block is free for reuse, merged with free neighbours."""
        with self._lock:
            for segment in self._segments:
                for index, block in enumerate(segment.blocks):
                    if block.address == address:
                        self._merge_free(segment, index)
                        if self.releases_free_segments() and segment.fully_free():
                            self._segments.remove(segment)
                            self.free_segment(segment.address)
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
        """Give every segment with no live block back."""
        with self._lock:
            for segment in [s for s in self._segments if s.fully_free()]:
                self.release_segment(segment.address)

    def release_segment(self, address: int) -> bool:
        """Give the segment at ``address`` back if no block of it is live; whether it was."""
        with self._lock:
            for segment in self._segments:
                if segment.address == address and segment.fully_free():
                    self._segments.remove(segment)
                    self.free_segment(address)
                    return True
        return False

    def holds(self, address: int, nbytes: int) -> bool:
        with self._lock:
            return any(
                s.address <= address and address + nbytes <= s.address + s.size for s in self._segments
            )

    def snapshot(self) -> list[dict[str, Any]]:
        """This pool's segments as ``torch.cuda.memory_snapshot`` (and ``MemPool.snapshot``) gives them."""
        with self._lock:
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


def live_pools() -> list[CachingMemPool]:
    """Every pool alive, in no particular order."""
    return list(_live_pools)


def pool_by_id(pool_id: PoolId) -> CachingMemPool | None:
    """The live pool with id ``pool_id``, if any."""
    wanted = (int(pool_id[0]), int(pool_id[1]))
    return next((pool for pool in list(_live_pools) if pool.id == wanted), None)


def pool_holding(address: int, nbytes: int) -> CachingMemPool | None:
    """The live pool one of whose segments holds ``[address, address + nbytes)``, if any."""
    return next((pool for pool in list(_live_pools) if pool.holds(address, nbytes)), None)


# -- torch.cuda.use_mem_pool: the routing of a thread's new tensors ----------------------------


class _PoolRouting(TorchDispatchMode):
    """Moves a thread's fresh op outputs into the pool it routes to."""

    def __init__(self, stack: list[CachingMemPool]) -> None:
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
        self.stack: list[CachingMemPool] = []
        self.mode: _PoolRouting | None = None


_routing = _ThreadRouting()


@contextlib.contextmanager
def use_mem_pool(pool: CachingMemPool) -> Iterator[None]:
    """``torch.cuda.use_mem_pool(pool)``: this thread's new tensors come from ``pool``."""
    routing = _routing
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
