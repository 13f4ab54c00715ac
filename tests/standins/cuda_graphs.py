"""Stand-in for a captured CUDA graph, over host memory (tests only).

A captured CUDA graph is a list of kernels with their arguments frozen at
capture: RAW device addresses, sizes and strides. Replaying it does not look
at the Python tensors again, so if their memory moved since (freed and
reallocated elsewhere, even with the same values), the replay reads the old
address: whatever lies there now, or a fault if nothing is mapped there.
That is the hazard a sleep that does not keep addresses must not meet, and
what :class:`StandInGraph` keeps:

* ``capture(fn, *static_inputs)`` runs ``fn`` once under a dispatch mode that
  records every aten op with its arguments. A tensor the op reads that no
  earlier op of the capture made (a static input, a module parameter, any
  tensor ``fn`` closes over) is recorded by raw address, dtype, shape and
  strides (:class:`TensorRead`); a tensor the capture made is recorded as
  such. ``fn`` returns a tensor or a tuple/list of tensors it computed; they
  become the graph's static outputs, kept in the graph's private pool.
* ``replay()`` runs the recorded ops again on tensors rebuilt at those raw
  addresses, and copies the results into the static outputs (returned).
* The graph's private pool shows in the allocator's snapshot
  (:func:`graph_segments`, and ``StandInTms.memory_snapshot``): one segment
  per live graph that allocated anything, ``segment_pool_id`` ``(N, 0)`` as
  for every pool a graph makes for itself (``graph_pool_handle()``, or a
  capture without ``pool=``), or the id given as ``capture(..., pool=...)``
  (a user pool ``(0, N)``, or another graph's pool).

What a replay detects instead of faulting: a read in a stand-in
torch_memory_saver allocation that is paused (a GPU faults) or was freed, and
a read of ordinary host memory whose storage died or was reallocated
(``resize_``) since the capture (the memory may be unmapped: the stand-in
cannot read it safely). What it cannot detect: a read of a
``HostReservations`` range another stand-in unmapped (the process gets
SIGSEGV, as a GPU faults), memory reached other than through aten ops
(ctypes, a C++ extension outside the dispatcher), or tensors made from
Python data inside ``fn`` (``torch.tensor``: the capture reads a temporary).
Random ops draw anew on each replay (real graphs advance a Philox offset);
``fn`` should be deterministic.

:class:`CUDAGraph` and :class:`graph` are ``torch.cuda.CUDAGraph`` and
``torch.cuda.graph`` themselves, with torch's contract, for code that uses
them directly (``hibernate.cuda_graph`` does; :func:`patched_torch_cuda`
puts them in ``torch.cuda`` for a block):

* Between ``capture_begin`` and ``capture_end`` (the ``with graph(g):``
  block) the ops of the capturing thread are recorded, NOT run, as on a GPU:
  each op's results are worked out on the meta device (shape, strides,
  dtype; no data) and get fresh memory of the capture's pool holding garbage
  (the poison byte) until the first replay; an in-place op (``add_``,
  ``out=``) leaves its target as it was. Views run (they launch no kernel),
  and the ops that only allocate (``empty``) are recorded as nothing.
* The capture's pool: a new private pool ``(N, 0)`` without ``pool=``; the
  pool of ``graph_pool_handle()`` or of another graph's ``pool()``; or the
  live MemPool ``(0, N)`` named (a torch_memory_saver tag's, vLLM's
  ``cudagraph_pool()``), through torch's caching allocator
  (:mod:`tests.standins.mempool`). A private pool's segments show in
  :func:`graph_segments` while a graph uses it or a tensor holds a block.
  A tensor the capture made lives as long as the program holds it, as in
  torch: an intermediate the program drops during the capture gives its
  block back to the capture's pool at once (torch's allocator frees a block
  with no other stream's use straight to its pool's free list), where the
  capture's next allocations, and after the capture any allocation routed to
  that pool, may get it, while every replay still writes it.
* ``replay()`` runs every kernel on the raw addresses captured (arguments
  and results alike) and writes each result where the capture put it; it
  allocates nothing. Before running, each address is checked where a GPU
  would fault: memory of a pool asks the pool (a paused torch_memory_saver
  allocation, an asleep vLLM one, a freed one all fault); other memory must
  still be mapped and readable (:func:`readable`), and is read whatever it
  holds now: a tensor that moved leaves the graph reading garbage.
* Refused during a capture as on a GPU (RuntimeError "operation not
  permitted when stream is capturing"): a result read on the host
  (``.item()``, ``torch.equal``) and ops whose result shape depends on the
  data (``nonzero``); a second capture on the thread; an unknown
  ``capture_error_mode``. Not modelled: streams (one stands for all), the
  capture error modes' effect on other threads, ``enable_annotations``, a
  ``use_mem_pool`` entered inside a capture.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import TreeSpec, tree_flatten, tree_map, tree_unflatten

from tests.standins import tms
from tests.standins.mempool import CachingMemPool, PoolId, live_pools, pool_by_id, pool_holding
from tests.standins.vllm_memory import PAGE, POISON, HostReservations, StandInFault

_graph_pool_ids = itertools.count(1)  # torch counts the pools graphs make (N, 0) process-wide from 1
_live_graphs: weakref.WeakSet[StandInGraph] = weakref.WeakSet()


def graph_pool_handle() -> tuple[int, int]:
    """``torch.cuda.graph_pool_handle()``: a new graph-private pool id ``(N, 0)``."""
    return (next(_graph_pool_ids), 0)


@dataclass(frozen=True)
class TensorRead:
    """A tensor the graph reads, as a kernel argument has it: where, and how to look at it."""

    address: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes from ``address`` to the last element (what the strided view covers)."""
        if any(size == 0 for size in self.shape):
            return 0
        last = sum((size - 1) * step for size, step in zip(self.shape, self.stride, strict=True))
        return (last + 1) * self.dtype.itemsize


@dataclass(frozen=True)
class _Made:
    """A tensor over a storage an earlier op of the capture made."""

    key: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Read:
    index: int


@dataclass(frozen=True)
class _Empty:
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class _Step:
    func: Any
    spec: TreeSpec
    leaves: list[Any]
    made: list[tuple[int, int]]  # (index among the op's flattened outputs, storage key)


class _StorageGuard:
    """Ordinary host memory read at capture: its storage must still be alive and in place."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._ref = StorageWeakRef(storage)
        self._pointer = storage.data_ptr()
        self._nbytes = storage.nbytes()

    def check(self, read: TensorRead) -> None:
        if self._ref.expired():
            raise StandInFault(
                f"replay reads {read.address:#x}, whose storage was freed since the capture"
                " (a GPU graph would read whatever reuses it, or fault)"
            )
        storage = torch.UntypedStorage._new_with_weak_ptr(self._ref.cdata)
        if storage.data_ptr() != self._pointer or storage.nbytes() < self._nbytes:
            raise StandInFault(
                f"replay reads {read.address:#x}, whose storage was reallocated since the capture"
                f" (now at {storage.data_ptr():#x}: the graph still reads the old address)"
            )


class _AllocationGuard:
    """Memory of a stand-in torch_memory_saver allocation: it must still be there, and mapped."""

    def __init__(self, world: tms.StandInTms, allocation: tms.Allocation) -> None:
        self._world = weakref.ref(world)
        self._allocation = allocation.address

    def check(self, read: TensorRead) -> None:
        world = self._world()
        found = world.core.find(read.address, read.nbytes) if world is not None else None
        if found is None or found.address != self._allocation:
            raise StandInFault(
                f"replay reads {read.address:#x}, in a torch_memory_saver allocation freed since the"
                " capture (a GPU faults)"
            )
        if found.state is not tms.AllocationState.ACTIVE:
            raise StandInFault(
                f"replay reads {read.address:#x}, in the paused torch_memory_saver allocation"
                f" {found.address:#x} (tag {found.tag!r}): a GPU faults"
            )


def _tensor_at(read: TensorRead) -> torch.Tensor:
    """A tensor over the raw address, not over any Python tensor's storage."""
    nbytes = read.nbytes
    if nbytes == 0:
        return torch.empty(read.shape, dtype=read.dtype)
    buffer = (ctypes.c_uint8 * nbytes).from_address(read.address)
    flat = torch.frombuffer(buffer, dtype=torch.uint8).view(read.dtype)
    return flat.as_strided(read.shape, read.stride)


def _over(storage: torch.UntypedStorage, made: _Made) -> torch.Tensor:
    return torch.empty(0, dtype=made.dtype).set_(storage, made.offset, made.shape, made.stride)


class _Recorder(TorchDispatchMode):
    """Records each op of a capture, its reads by raw address, and the storages it makes."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[_Step] = []
        self.reads: list[TensorRead] = []
        self.guards: list[_StorageGuard | _AllocationGuard] = []
        self.made: dict[int, int] = {}  # storage address -> key
        self.made_sizes: list[int] = []
        self._read_index: dict[TensorRead, int] = {}
        self._alive: list[torch.Tensor] = []  # made storages stay alive, so no address is reused

    def ref(self, tensor: torch.Tensor) -> _Made | _Read | _Empty:
        shape, stride = tuple(tensor.shape), tuple(tensor.stride())
        if tensor.numel() == 0:
            return _Empty(shape, tensor.dtype)
        storage = tensor.untyped_storage()
        key = self.made.get(storage.data_ptr())
        if key is not None:
            return _Made(key, int(tensor.storage_offset()), shape, stride, tensor.dtype)
        read = TensorRead(tensor.data_ptr(), tensor.dtype, shape, stride)
        if read not in self._read_index:
            self._read_index[read] = len(self.reads)
            self.reads.append(read)
            found = tms.find_allocation(read.address, read.nbytes)
            self.guards.append(_AllocationGuard(*found) if found else _StorageGuard(storage))
        return _Read(self._read_index[read])

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        tensors = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        if any(t.layout != torch.strided or t.device.type != "cpu" for t in tensors):
            raise NotImplementedError(f"the stand-in graph records strided host tensors only ({func})")
        leaves = [self.ref(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in flat]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        out = func(*args, **kwargs)
        made = []
        for index, value in enumerate(tree_flatten(out)[0]):
            if not isinstance(value, torch.Tensor):
                continue
            storage = value.untyped_storage()
            pointer = storage.data_ptr()
            if storage.nbytes() == 0 or pointer in inputs or pointer in self.made:
                continue
            self.made[pointer] = len(self.made_sizes)
            self.made_sizes.append(storage.nbytes())
            self._alive.append(value)
            made.append((index, self.made[pointer]))
        self.steps.append(_Step(func, spec, leaves, made))
        return out


@dataclass
class _Captured:
    steps: list[_Step]
    reads: list[TensorRead]
    guards: list[_StorageGuard | _AllocationGuard]
    output_refs: list[_Made]
    output_spec: TreeSpec
    pool: tuple[int, int]
    static_outputs: list[torch.Tensor]
    segment_buffer: torch.Tensor  # the graph's private memory, where the static outputs live
    blocks: list[tuple[int, int, bool]]  # (size, requested size, allocated), in address order

    def outputs(self) -> Any:
        return tree_unflatten(list(self.static_outputs), self.output_spec)


def _private_pool_layout(
    outputs: list[torch.Tensor], output_keys: set[int], made_sizes: list[int]
) -> tuple[int, list[tuple[int, int, bool]]]:
    """The graph's segment: its live outputs, then the blocks it made and freed (cached), then the rest."""
    blocks = [(tms.round_block_size(out.nbytes), out.nbytes, True) for out in outputs]
    blocks += [
        (tms.round_block_size(size), 0, False)
        for key, size in enumerate(made_sizes)
        if key not in output_keys
    ]
    used = sum(size for size, _, _ in blocks)
    total = max(tms.SMALL_BUFFER, -(-used // tms.ROUND_LARGE) * tms.ROUND_LARGE)
    if total > used:
        blocks.append((total - used, 0, False))
    return total, blocks


class StandInGraph:
    """A captured CUDA graph over host memory (see the module docstring)."""

    def __init__(self) -> None:
        self._captured: _Captured | None = None

    def _require_captured(self) -> _Captured:
        if self._captured is None:
            raise RuntimeError("the graph is not captured")
        return self._captured

    @property
    def reads(self) -> list[TensorRead]:
        """The tensors the graph reads by raw address (what it would fault or misread on)."""
        return list(self._require_captured().reads)

    def pool(self) -> tuple[int, int]:
        """``CUDAGraph.pool()``: the id of the pool the graph's memory comes from."""
        return self._require_captured().pool

    def capture(
        self, fn: Callable[..., Any], *static_inputs: torch.Tensor, pool: tuple[int, int] | None = None
    ) -> Any:
        """Run ``fn(*static_inputs)`` once, recording it; returns the static outputs."""
        if self._captured is not None:
            raise RuntimeError("the graph is already captured: reset() it first")
        if pool is not None and (len(pool) != 2 or tuple(pool) == (0, 0) or 0 not in tuple(pool)):
            raise ValueError(f"pool must be a pool id (N, 0) or (0, N), not {pool!r}")
        recorder = _Recorder()
        with recorder:
            result = fn(*static_inputs)
        flat, spec = tree_flatten(result)
        refs = [recorder.ref(value) if isinstance(value, torch.Tensor) else value for value in flat]
        made_refs = [ref for ref in refs if isinstance(ref, _Made)]
        if not flat or len(made_refs) != len(refs):
            raise ValueError("fn must return a tensor, or a tuple or list of tensors, that it computed")
        total, blocks = _private_pool_layout(flat, {ref.key for ref in made_refs}, recorder.made_sizes)
        buffer = torch.empty(total, dtype=torch.uint8)
        static_outputs = []
        offset = 0
        for out in flat:
            static = buffer[offset : offset + out.nbytes].view(out.dtype).view(out.shape)
            static.copy_(out)
            static_outputs.append(static)
            offset += tms.round_block_size(out.nbytes)
        self._captured = _Captured(
            steps=recorder.steps,
            reads=recorder.reads,
            guards=recorder.guards,
            output_refs=made_refs,
            output_spec=spec,
            pool=(int(pool[0]), int(pool[1])) if pool is not None else graph_pool_handle(),
            static_outputs=static_outputs,
            segment_buffer=buffer,
            blocks=blocks,
        )
        _live_graphs.add(self)
        return self._captured.outputs()

    def replay(self) -> Any:
        """Run the recorded ops on the raw addresses; returns the static outputs, updated."""
        captured = self._require_captured()
        for read, guard in zip(captured.reads, captured.guards, strict=True):
            guard.check(read)
        storages: dict[int, torch.UntypedStorage] = {}

        def rebuild(leaf: Any) -> Any:
            if isinstance(leaf, _Read):
                return _tensor_at(captured.reads[leaf.index])
            if isinstance(leaf, _Made):
                return _over(storages[leaf.key], leaf)
            if isinstance(leaf, _Empty):
                return torch.empty(leaf.shape, dtype=leaf.dtype)
            return leaf

        with torch.no_grad():
            for step in captured.steps:
                args, kwargs = tree_unflatten([rebuild(leaf) for leaf in step.leaves], step.spec)
                flat_out = tree_flatten(step.func(*args, **kwargs))[0]
                for index, key in step.made:
                    storages[key] = flat_out[index].untyped_storage()
            for static, ref in zip(captured.static_outputs, captured.output_refs, strict=True):
                static.copy_(_over(storages[ref.key], ref))
        return captured.outputs()

    def reset(self) -> None:
        """``CUDAGraph.reset()``: the graph and its private memory are gone."""
        _live_graphs.discard(self)
        self._captured = None

    def segment(self) -> dict[str, Any] | None:
        """The graph's private-pool segment, as ``torch.cuda.memory_snapshot`` shows it."""
        if self._captured is None:
            return None
        captured = self._captured
        start = captured.segment_buffer.data_ptr()
        blocks = []
        address = start
        for size, requested, allocated in captured.blocks:
            state = "active_allocated" if allocated else "inactive"
            blocks.append(
                {"address": address, "size": size, "requested_size": requested, "state": state, "frames": []}
            )
            address += size
        allocated_size = sum(size for size, _, allocated in captured.blocks if allocated)
        total = captured.segment_buffer.numel()
        return {
            "device": 0,
            "address": start,
            "total_size": total,
            "allocated_size": allocated_size,
            "active_size": allocated_size,
            "requested_size": sum(requested for _, requested, _ in captured.blocks),
            "stream": 0,
            "segment_type": "small" if total == tms.SMALL_BUFFER else "large",
            "segment_pool_id": captured.pool,
            "is_expandable": False,
            "frames": [],
            "blocks": blocks,
        }


def graph_segments() -> list[dict[str, Any]]:
    """The private-pool segments of every live stand-in graph (captured, not reset, not collected),
    and of every graph pool (``(N, 0)``) of :class:`CUDAGraph` captures that still holds one."""
    segments = [graph.segment() for graph in list(_live_graphs)]
    private = [s for pool in live_pools() if isinstance(pool, GraphPool) for s in pool.snapshot()]
    return [segment for segment in segments if segment is not None] + private


# -- torch.cuda.CUDAGraph and torch.cuda.graph: a capture that records, not runs ----------------

CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")
_NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"

# Ops that only allocate: no kernel is captured for them.
_ALLOCATION_ONLY = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.empty_like.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
    }
)

_graph_memory = HostReservations()  # where graphs' private pools take their segments
_capturing = threading.local()  # .graph: the CUDAGraph capturing on this thread, if any

_libc = ctypes.CDLL(None, use_errno=True)
_libc.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_libc.write.restype = ctypes.c_ssize_t


def readable(address: int, nbytes: int) -> bool:
    """Whether every page of ``[address, address + nbytes)`` can be read, asked without reading it:
    the kernel copies a byte of each page into a pipe and answers EFAULT where it cannot."""
    reader, writer = os.pipe()
    try:
        pages = range(address - address % PAGE, address + max(nbytes, 1), PAGE)
        for index, page in enumerate(pages):
            if _libc.write(writer, max(page, address), 1) != 1:
                return False
            if index % 4096 == 4095:
                os.read(reader, 4096)  # the pipe holds 64 KiB
        return True
    finally:
        os.close(reader)
        os.close(writer)


class GraphPool(CachingMemPool):
    """A pool a graph makes for itself, ``(N, 0)``: torch's caching allocator over host segments.

    Its segments go back once no graph uses it and their last block is freed
    (``torch.cuda.empty_cache`` would give them back then, too).
    """

    def __init__(self, pool_id: PoolId) -> None:
        super().__init__(0, threading.RLock(), pool_id)
        self.users = 0

    def malloc_segment(self, size: int) -> int:
        return _graph_memory.reserve(size)

    def free_segment(self, address: int) -> None:
        _graph_memory.free(address)

    def releases_free_segments(self) -> bool:
        return self.users == 0


def _capture_pool(pool: PoolId | None) -> CachingMemPool:
    """The pool a capture allocates in: a new private one, another graph's, or a MemPool's (``pool=``)."""
    if pool is None:
        return GraphPool(graph_pool_handle())
    if len(pool) != 2 or tuple(pool) == (0, 0) or 0 not in tuple(pool):
        raise RuntimeError(f"pool must be a pool id (N, 0) or (0, N), not {pool!r}")
    found = pool_by_id(pool)
    if found is not None:
        return found
    if pool[1] == 0:  # a graph_pool_handle() no capture used yet
        return GraphPool((int(pool[0]), 0))
    raise RuntimeError(f"no memory pool with id {tuple(pool)} is alive")


def _returns_tensors(schema: Any) -> bool:
    """Whether every return of an op is a tensor, a list of tensors or an optional tensor."""

    def is_tensor_type(kind: Any) -> bool:
        if isinstance(kind, torch.TensorType):
            return True
        if isinstance(kind, (torch.ListType, torch.OptionalType)):
            return isinstance(kind.getElementType(), torch.TensorType)
        return False

    return all(is_tensor_type(r.type) for r in schema.returns)


class _HostGuard:
    """Memory outside every pool: garbage to read once its tensor moved, a fault once it is not readable."""

    def check(self, address: int, nbytes: int) -> None:
        if not readable(address, nbytes):
            raise StandInFault(
                f"replay reads {address:#x}, which is not mapped (or not readable) any more: a GPU faults"
            )


class _PoolGuard:
    """Memory of a pool: the pool says whether a kernel may touch it (a paused allocation faults)."""

    def __init__(self, pool: CachingMemPool) -> None:
        self._pool = pool

    def check(self, address: int, nbytes: int) -> None:
        self._pool.check_access(address, nbytes)


@dataclass
class _Kernel:
    """One captured kernel: the op, its arguments with tensors as raw addresses, where its results go."""

    func: Any
    spec: TreeSpec
    leaves: list[Any]
    outputs: list[tuple[int, TensorRead]]  # (index among the op's flattened results, where it lives)


class _Recording:
    """What a capture recorded, and the memory it holds while the graph lives."""

    def __init__(self, pool: CachingMemPool) -> None:
        self.pool = pool
        self.kernels: list[_Kernel] = []
        self.guards: dict[tuple[int, int], _HostGuard | _PoolGuard] = {}
        if isinstance(pool, GraphPool):
            pool.users += 1

    def read(self, tensor: torch.Tensor) -> TensorRead:
        read = TensorRead(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        key = (read.address, read.nbytes)
        if read.nbytes and key not in self.guards:
            pool = pool_holding(read.address, read.nbytes)
            self.guards[key] = _PoolGuard(pool) if pool is not None else _HostGuard()
        return read

    def close(self) -> None:
        """The graph is gone: its memory goes back to its pool (a private pool's segments with it)."""
        pool = self.pool
        if isinstance(pool, GraphPool):
            pool.users -= 1
        self.kernels, self.guards = [], {}
        if isinstance(pool, GraphPool) and pool.users == 0:
            pool.release_free_segments()


class _CaptureMode(TorchDispatchMode):
    """Records each op instead of running it; new tensors come from the capture's pool, holding garbage."""

    def __init__(self, recording: _Recording) -> None:
        super().__init__()
        self._recording = recording

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        with _disable_current_modes():  # what the capture itself does is not captured, nor routed
            return self._capture(func, args, kwargs or {})

    def _capture(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        tensors = [leaf for leaf in flat if isinstance(leaf, torch.Tensor)]
        if any(t.layout != torch.strided or t.device.type != "cpu" for t in tensors):
            raise NotImplementedError(f"the stand-in graph captures strided host tensors only ({func})")
        schema = func._schema
        if not _returns_tensors(schema):  # .item(), torch.equal: a result read back on the host
            raise RuntimeError(f"{_NOT_PERMITTED} ({func} reads its result back on the host)")
        aliases = [r.alias_info for r in schema.returns]
        if schema.returns and all(a is not None and not a.is_write for a in aliases):
            return func(*args, **kwargs)  # a view: no kernel, the same memory
        if any(a is not None and not a.is_write for a in aliases):
            raise NotImplementedError(f"the stand-in graph cannot capture {func}: it returns a view and more")
        shapes = self._shapes(func, args, kwargs)
        written = _written_arguments(schema, args, kwargs)
        fresh: set[int] = set()

        def allocate(meta: Any) -> Any:
            if not isinstance(meta, torch.Tensor):
                return meta
            out = self._allocate(meta)
            fresh.add(id(out))
            return out

        per_return = list(shapes) if len(schema.returns) > 1 else [shapes]
        results = [
            written[index] if index in written else tree_map(allocate, meta)
            for index, meta in enumerate(per_return)
        ]
        result: Any = tuple(results) if len(schema.returns) > 1 else results[0] if results else None
        if func not in _ALLOCATION_ONLY:
            recording = self._recording
            leaves = [recording.read(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in flat]
            outputs = [
                (index, recording.read(value))
                for index, value in enumerate(tree_flatten(result)[0])
                if isinstance(value, torch.Tensor) and id(value) in fresh
            ]
            recording.kernels.append(_Kernel(func, spec, leaves, outputs))
        return result

    @staticmethod
    def _shapes(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The op's results on the meta device: shapes, strides and dtypes, no data, nothing run."""

        def to_meta(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            if isinstance(value, torch.device):
                return torch.device("meta")
            return value

        meta_args, meta_kwargs = tree_map(to_meta, (args, kwargs))
        names = [argument.name for argument in func._schema.arguments]
        if "device" in names and names.index("device") >= len(meta_args):
            meta_kwargs["device"] = torch.device("meta")  # a factory: made on the meta device too
        if meta_kwargs.get("pin_memory"):
            meta_kwargs["pin_memory"] = False
        try:
            return func(*meta_args, **meta_kwargs)
        except Exception as exc:  # data-dependent shapes (nonzero, unique) need the data: a sync
            raise RuntimeError(f"{_NOT_PERMITTED} ({func} cannot be captured: {exc})") from exc

    def _allocate(self, meta: torch.Tensor) -> torch.Tensor:
        nbytes = meta.untyped_storage().nbytes()
        if nbytes == 0:
            return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype)
        storage = self._recording.pool.allocate(nbytes, POISON)
        out = torch.empty(0, dtype=meta.dtype)
        return out.set_(storage, meta.storage_offset(), meta.shape, meta.stride())


def _written_arguments(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, Any]:
    """The returns that are arguments the op writes (``add_``, ``out=``), by return index: those arguments."""
    values = {argument.name: value for argument, value in zip(schema.arguments, args, strict=False)}
    values.update(kwargs)
    written = {}
    for index, ret in enumerate(schema.returns):
        alias = ret.alias_info
        if alias is None or not alias.is_write:
            continue
        for argument in schema.arguments:
            if argument.alias_info is not None and argument.alias_info.before_set == alias.before_set:
                written[index] = values[argument.name]
                break
    return written


class CUDAGraph:
    """``torch.cuda.CUDAGraph`` over host memory (see the module docstring)."""

    def __init__(self, keep_graph: bool = False) -> None:
        self._keep_graph = keep_graph
        self._recording: _Recording | None = None
        self._mode: _CaptureMode | None = None
        self._captured = False
        self._release: weakref.finalize | None = None

    def capture_begin(
        self,
        pool: PoolId | None = None,
        capture_error_mode: str = "global",
        check_input_liveness: bool = False,
    ) -> None:
        """Begin capturing this thread's ops; new tensors come from ``pool`` (a private pool without)."""
        if self._recording is not None:
            raise RuntimeError(
                "This CUDAGraph instance already owns a captured graph. To capture a new graph, create a"
                " new instance."
            )
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise RuntimeError(
                "Unknown capture error mode. Expected `global`, `thread_local`, or `relaxed`, got "
                f"{capture_error_mode}"
            )
        if getattr(_capturing, "graph", None) is not None:
            raise RuntimeError(f"{_NOT_PERMITTED} (a capture is already underway on this thread)")
        recording = _Recording(_capture_pool(pool))
        self._recording = recording
        self._release = weakref.finalize(self, recording.close)
        self._mode = _CaptureMode(recording)
        self._mode.__enter__()
        _capturing.graph = self

    def capture_end(self) -> None:
        if self._mode is None:
            raise RuntimeError("Called CUDAGraph::capture_end without a preceding capture_begin")
        mode, self._mode = self._mode, None
        _capturing.graph = None
        mode.__exit__(None, None, None)
        self._captured = True

    def instantiate(self) -> None:
        self._require_captured()

    def _require_captured(self) -> _Recording:
        if not self._captured or self._recording is None:
            raise RuntimeError("Called CUDAGraph::replay without a preceding successful capture.")
        return self._recording

    def replay(self) -> None:
        """Run the captured kernels on the addresses they were captured with; nothing is allocated."""
        recording = self._require_captured()
        for (address, nbytes), guard in recording.guards.items():
            guard.check(address, nbytes)
        with _disable_current_modes(), torch.no_grad():
            for kernel in recording.kernels:
                leaves = [
                    _tensor_at(leaf) if isinstance(leaf, TensorRead) else leaf for leaf in kernel.leaves
                ]
                args, kwargs = tree_unflatten(leaves, kernel.spec)
                result = kernel.func(*args, **kwargs)
                if kernel.outputs:
                    flat = tree_flatten(result)[0]
                    for index, target in kernel.outputs:
                        _tensor_at(target).copy_(flat[index])

    def reset(self) -> None:
        """The graph is gone; its memory goes back to its pool."""
        if self._mode is not None:
            self.capture_end()
        if self._release is not None:
            self._release()
        self._recording, self._release, self._captured = None, None, False

    def pool(self) -> PoolId:
        """The id of the pool the graph's memory comes from (to share it with another capture)."""
        if self._recording is None:
            raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
        return self._recording.pool.id

    @property
    def kernels(self) -> int:
        """How many kernels the capture recorded (a stand-in reading, not torch's)."""
        return len(self._recording.kernels) if self._recording is not None else 0

    @property
    def writes(self) -> list[TensorRead]:
        """Where every replay writes: each kernel's results (a stand-in reading, not torch's)."""
        if self._recording is None:
            return []
        return [target for kernel in self._recording.kernels for _, target in kernel.outputs]

    def enable_debug_mode(self) -> None:
        raise NotImplementedError("the stand-in CUDAGraph has no debug dump")

    def debug_dump(self, debug_path: str) -> None:
        raise NotImplementedError("the stand-in CUDAGraph has no debug dump")


class graph:
    """``torch.cuda.graph``: capture the block into ``cuda_graph`` (see the module docstring)."""

    def __init__(
        self,
        cuda_graph: CUDAGraph,
        pool: PoolId | None = None,
        stream: Any = None,
        capture_error_mode: str = "global",
        enable_annotations: bool = False,
        check_input_liveness: bool = False,
    ) -> None:
        if enable_annotations:
            raise NotImplementedError(
                "the stand-in graph has no kernel annotations (they need cuda.bindings)"
            )
        self.pool: tuple[()] | tuple[PoolId] = () if pool is None else (pool,)
        self.capture_stream = stream  # one stream stands for all here
        self.cuda_graph = cuda_graph
        self.capture_error_mode = capture_error_mode
        self.check_input_liveness = check_input_liveness

    def __enter__(self) -> None:
        # torch synchronizes, collects if torch.compiler.config.force_cudagraph_gc, and empties the
        # caches: nothing to wait for here, and a private pool no graph uses gives its segments back
        # as its last block goes.
        if torch.compiler.config.force_cudagraph_gc:
            gc.collect()
        self.cuda_graph.capture_begin(
            self.pool[0] if self.pool else None,
            capture_error_mode=self.capture_error_mode,
            check_input_liveness=self.check_input_liveness,
        )

    def __exit__(self, *args: object) -> None:
        self.cuda_graph.capture_end()


def is_current_stream_capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing``: whether this thread is capturing."""
    return getattr(_capturing, "graph", None) is not None


_PATCHED = {
    "CUDAGraph": CUDAGraph,
    "graph": graph,
    "graph_pool_handle": graph_pool_handle,
    "is_current_stream_capturing": is_current_stream_capturing,
}


@contextlib.contextmanager
def patched_torch_cuda() -> Iterator[None]:
    """``torch.cuda.CUDAGraph``, ``graph``, ``graph_pool_handle`` and ``is_current_stream_capturing``
    are the stand-ins for the block (in-process tests); what was there before comes back after."""
    missing = object()
    before = {name: getattr(torch.cuda, name, missing) for name in _PATCHED}
    for name, value in _PATCHED.items():
        setattr(torch.cuda, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is missing:
                delattr(torch.cuda, name)
            else:
                setattr(torch.cuda, name, value)


def memory_snapshot(pool_id: PoolId | None = None) -> list[dict[str, Any]]:
    """``torch.cuda.memory_snapshot()`` over every stand-in pool alive (and every stand-in graph's)."""
    segments = [segment for pool in live_pools() for segment in pool.snapshot()]
    segments += [s for s in (g.segment() for g in list(_live_graphs)) if s is not None]
    if pool_id is None or tuple(pool_id) == (0, 0):
        return segments
    return [s for s in segments if s["segment_pool_id"] == tuple(pool_id)]
