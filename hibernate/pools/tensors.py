"""PyTorch tensors named by the program with ``hibernate.track``.

The unit of hibernation is the *storage*, not the tensor: views, slices,
non-contiguous tensors and tied weights that share memory are spilled once and
all see their bytes again after the wake. A storage is released by resizing it
to zero bytes (the tensors keep their shape, dtype and identity, so every
reference the program holds stays valid) and reallocated by resizing it back.
On CPU the freed pages go back to the OS (``malloc_trim``); on CUDA the caching
allocator's cache is emptied.

Tracked objects are enumerated when a sleep starts, so a module whose
parameters were replaced since ``track`` is hibernated as it is now.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hibernate.errors import UsageError
from hibernate.pools.base import SpillableRegion


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


@dataclass
class _Tracked:
    obj: Any
    tag: str
    keep: bool
    name: str


class StorageRegion:
    """One torch storage and every tracked view of it."""

    def __init__(
        self,
        key: str,
        tag: str,
        keep: bool,
        storage: torch.UntypedStorage,
        views: list[dict[str, Any]],
    ) -> None:
        self._key = key
        self._tag = tag
        self._keep = keep
        self._storage = storage
        self._nbytes = storage.nbytes()
        self._device = storage.device
        self._meta = {"device": str(self._device), "views": views}
        self.released = False

    @property
    def key(self) -> str:
        return self._key

    @property
    def tag(self) -> str:
        return self._tag

    @property
    def keep(self) -> bool:
        return self._keep

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def meta(self) -> Mapping[str, Any]:
        return self._meta

    def _bytes(self) -> torch.Tensor:
        flat = torch.empty(0, dtype=torch.uint8, device=self._device)
        return flat.set_(self._storage, 0, (self._nbytes,), (1,))

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self._nbytes:
            raise ValueError(f"{self._key}: bytes {offset}..{offset + length} outside its {self._nbytes}")

    def copy_out(self, offset: int, dst: memoryview) -> None:
        self._check_range(offset, len(dst))
        if self._device.type == "cpu" and not dst.readonly and len(dst):
            # One plain memcpy that releases the GIL: torch's copy_ would fan out to its
            # intra-op threads and compete with the store's own workers for the cores.
            ctypes.memmove(_address(dst), self._storage.data_ptr() + offset, len(dst))
            return
        with torch.no_grad():
            torch.frombuffer(dst, dtype=torch.uint8).copy_(self._bytes()[offset : offset + len(dst)])

    def copy_in(self, offset: int, src: memoryview) -> None:
        self._check_range(offset, len(src))
        if self._device.type == "cpu" and not src.readonly and len(src):
            ctypes.memmove(self._storage.data_ptr() + offset, _address(src), len(src))
            return
        with torch.no_grad():
            self._bytes()[offset : offset + len(src)].copy_(torch.frombuffer(src, dtype=torch.uint8))

    def host_view(self, offset: int, length: int) -> memoryview | None:
        if self._device.type != "cpu" or self.released:
            return None
        return memoryview((ctypes.c_char * length).from_address(self._storage.data_ptr() + offset)).cast("B")

    def release(self) -> None:
        if self._nbytes and not self.released:
            self._storage.resize_(0)
        self.released = True

    def reallocate(self) -> None:
        if self.released and self._nbytes:
            self._storage.resize_(self._nbytes)
        self.released = False

    def zero(self) -> None:
        with torch.no_grad():
            self._bytes().zero_()


def _named_tensors(tracked: _Tracked) -> Iterator[tuple[str, torch.Tensor]]:
    obj, prefix = tracked.obj, tracked.name
    if isinstance(obj, torch.nn.Module):
        for name, param in obj.named_parameters(remove_duplicate=False):
            yield f"{prefix}{name}", param
            if param.grad is not None:
                yield f"{prefix}{name}.grad", param.grad
        for name, buf in obj.named_buffers(remove_duplicate=False):
            yield f"{prefix}{name}", buf
    elif isinstance(obj, torch.optim.Optimizer):
        for index, state in enumerate(obj.state.values()):
            for name, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield f"{prefix}state.{index}.{name}", value
    elif isinstance(obj, torch.Tensor):
        yield prefix.rstrip("."), obj
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            yield from _named_tensors(_Tracked(value, tracked.tag, tracked.keep, f"{prefix}{key}."))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _named_tensors(_Tracked(value, tracked.tag, tracked.keep, f"{prefix}{index}."))
    else:
        raise UsageError(
            f"cannot track {type(obj).__name__} at {prefix.rstrip('.') or 'top level'}: expected an "
            "nn.Module, optimizer, tensor, or a dict/list of them"
        )


def _check_trackable(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_sparse or tensor.layout != torch.strided:
        raise UsageError(
            f"tensor {name!r} has layout {tensor.layout}; only strided tensors can be hibernated"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise UsageError(f"tensor {name!r} is on {tensor.device}; hibernate handles cpu and cuda tensors")
    if not tensor.untyped_storage().resizable():
        raise UsageError(
            f"tensor {name!r} uses memory torch cannot free (from numpy, from_blob or a memory map)",
            hint="copy it into a torch-allocated tensor before tracking it",
        )


class TensorPool:
    """The tensors this process asked to hibernate."""

    name = "torch"

    def __init__(self) -> None:
        self._tracked: dict[int, _Tracked] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count()

    def track(self, obj: Any, tag: str, keep: bool, name: str | None) -> None:
        if not tag or any(ch in tag for ch in "/\n\0"):
            raise UsageError(f"tag {tag!r} must be a non-empty name without '/'")
        if name is None:
            name = (
                ""
                if isinstance(obj, torch.nn.Module)
                else f"{type(obj).__name__.lower()}{next(self._counter)}"
            )
        prefix = f"{name}." if name else ""
        entry = _Tracked(obj, tag, keep, prefix)
        for tensor_name, tensor in _named_tensors(entry):
            _check_trackable(tensor_name, tensor)
        with self._lock:
            self._tracked[id(obj)] = entry

    def untrack(self, obj: Any) -> bool:
        with self._lock:
            return self._tracked.pop(id(obj), None) is not None

    def regions(self) -> Sequence[SpillableRegion]:
        with self._lock:
            tracked = list(self._tracked.values())
        # storage identity -> [owning entry, first name, storage, views]; a storage shared
        # with a kept tensor is kept, under that tensor's tag.
        by_storage: dict[int, list[Any]] = {}
        for entry in tracked:
            for name, tensor in _named_tensors(entry):
                _check_trackable(name, tensor)
                storage = tensor.untyped_storage()
                view = {
                    "name": name,
                    "dtype": _dtype_name(tensor.dtype),
                    "shape": list(tensor.shape),
                    "strides": list(tensor.stride()),
                    "storage_offset": tensor.storage_offset(),
                }
                slot = by_storage.setdefault(storage._cdata, [entry, name, storage, []])
                if view not in slot[3]:
                    slot[3].append(view)
                if entry.keep and not slot[0].keep:
                    slot[0], slot[1] = entry, name
        regions: list[SpillableRegion] = []
        keys: set[str] = set()
        for owner, first_name, storage, views in by_storage.values():
            key = f"{owner.tag}/{first_name}"
            suffix = 2
            while key in keys:
                key = f"{owner.tag}/{first_name}#{suffix}"
                suffix += 1
            keys.add(key)
            regions.append(StorageRegion(key, owner.tag, owner.keep, storage, views))
        return regions

    def after_release(self) -> None:
        _trim_host_heap()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    def pinner(self) -> Callable[[memoryview], Callable[[], None]] | None:
        if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
            return None
        cudart = torch.cuda.cudart()

        def pin(view: memoryview) -> Callable[[], None]:
            address = _address(view)
            if cudart.cudaHostRegister(address, len(view), 0) != 0:
                return lambda: None  # pageable staging still works, only slower
            return lambda: cudart.cudaHostUnregister(address)

        return pin


_libc: ctypes.CDLL | None = None


def _trim_host_heap() -> None:
    """Hand freed heap pages back to the OS; glibc otherwise keeps small frees around."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
