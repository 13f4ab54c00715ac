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
"""

from __future__ import annotations

import ctypes
import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from tests.standins import tms
from tests.standins.vllm_memory import StandInFault

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
    """The private-pool segments of every live stand-in graph (captured, not reset, not collected)."""
    segments = [graph.segment() for graph in list(_live_graphs)]
    return [segment for segment in segments if segment is not None]
