"""PyTorch tensors named by the program with ``hibernate.track``.

The unit of hibernation is the *storage*, not the tensor: views, slices,
non-contiguous tensors and tied weights that share memory are spilled once and
all see their bytes again after the wake. A storage is released by resizing it
to zero bytes (the tensors keep their shape, dtype and identity, so every
reference the program holds stays valid) and reallocated by resizing it back.
On CPU the freed pages go back to the OS (``malloc_trim``); on CUDA the caching
allocator's cache is emptied. A CPU storage torch cannot resize (numpy-shared,
``frombuffer``, memory maps) is freed in place instead (FixedHostStorageRegion,
hibernate.pools.hostpages). CUDA storages are copied through the device seam
(hibernate.pools.device) on its own streams, after every device holding one was
synchronized (``synchronize``), so work the program left queued is in the snapshot.

A storage of zero bytes has a null data pointer, and torch's kernels do not
check it: ``t.sum()`` on a released tensor reads address 0 and the process dies
with SIGSEGV. So while its memory is away, every tracked tensor object is put
*to sleep* as well: its ``__class__`` is swapped for a subclass whose
``__torch_function__`` raises :class:`HibernatingError` (naming the tensor, the
operation and the thread) for anything but metadata (shape, dtype, device...).
``__torch_function__`` is looked up on the argument's type in every thread, so
no thread-local mode or global hook is involved, and the swap is undone when the
memory comes back: an awake tensor is its own class again, at no cost to any
operation. Where torch exposes it (CUDA builds), the storage itself is also made
to raise on data-pointer access, which turns an access through an untracked view
made before the sleep into a RuntimeError rather than a crash; a CUDA build
without it (torch 2.11) is named in every sleep's warnings.

Not used, and why: ``TorchFunctionMode``/``TorchDispatchMode`` are
thread-local (a mode entered in one thread does not see another thread's ops,
checked on torch 2.13); the storage flag above is bound only in CUDA builds
(``torch/csrc/cuda/Module.cpp``), and ``_set_throw_on_mutable_data_ptr`` cannot
be undone and misses reads.

Tracked objects are enumerated when a sleep starts, so a module whose
parameters were replaced since ``track`` is hibernated as it is now.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hibernate.errors import HibernatingError, UsageError
from hibernate.gcpause import gc_paused
from hibernate.pools import hostpages, optimizers
from hibernate.pools.base import Contents, PoolSummary, RegionAttributes, SpillableRegion
from hibernate.pools.capture import SeenGraph, live_graphs
from hibernate.pools.device import (
    POISON_STORAGE,
    UNPOISON_STORAGE,
    CudaCopies,
    DeviceCopies,
    torch_cuda_in_use,
    untracked_views_warning,
)
from hibernate.pools.graphs import graph_descriptions, graph_pools, moves_refusal
from hibernate.pools.provided import Span, covered_spans
from hibernate.store.manifest import PlainMeta
from hibernate.store.regions import memory_at

if TYPE_CHECKING:
    from hibernate.store.manifest import Columns


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# Every dtype's name, asked once per tensor of every enumeration: looked up, not formatted.
_DTYPE_NAMES = {dtype: _dtype_name(dtype) for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)}


# A device -> (its name as str() spells it, its type, its CUDA index or None), asked of every
# storage at every enumeration: ``device.type`` and ``str(device)`` build a new string at each call
# (0.3 us each here), a lookup by the device costs a tenth of that. Devices are few.
_DEVICE_FACTS: dict[torch.device, tuple[str, str, int | None]] = {}


def _device_facts(device: torch.device) -> tuple[str, str, int | None]:
    """What _DEVICE_FACTS holds of ``device``, learnt on first need (callers look there first)."""
    kind = device.type
    index = (0 if device.index is None else device.index) if kind == "cuda" else None
    facts = _DEVICE_FACTS[device] = (str(device), kind, index)
    return facts


def _address(view: memoryview) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


# -- tensors put to sleep ------------------------------------------------------

# Tensor attributes and methods that read only metadata, never the memory: allowed while asleep.
# ``untyped_storage`` hands out the zero-byte storage, whose own accessors are bounds-checked.
_METADATA_ATTRIBUTES = (
    "shape", "dtype", "device", "layout", "ndim", "requires_grad", "is_leaf", "grad", "grad_fn",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "nbytes", "itemsize",
)  # fmt: skip
_METADATA_METHODS = (
    "size", "dim", "numel", "nelement", "stride", "storage_offset", "element_size", "is_contiguous",
    "is_floating_point", "is_complex", "get_device", "__len__", "untyped_storage",
)  # fmt: skip
_metadata_funcs: set[Any] | None = None


def _metadata_only(func: Any) -> bool:
    global _metadata_funcs
    if _metadata_funcs is None:
        funcs: set[Any] = {getattr(torch.Tensor, name) for name in _METADATA_METHODS}
        descriptors = [vars(torch._C.TensorBase)[name] for name in _METADATA_ATTRIBUTES]
        funcs.update(d.__get__ for d in descriptors)
        funcs.add(vars(torch._C.TensorBase)["grad"].__set__)  # zero_grad(set_to_none=True) is harmless
        _metadata_funcs = funcs
    try:
        return func in _metadata_funcs
    except TypeError:  # an unhashable callable is no metadata accessor
        return False


# id(tensor) -> its name, for the tensors now asleep; the tensors themselves are held by their regions.
_asleep_names: dict[int, str] = {}
# A tensor class -> the class its tensors take while asleep: its asleep twin, or itself for a class
# already asleep. Looked up for every tensor a release puts to sleep: one dict lookup, where asking
# the class for ``_hibernate_awake_class`` walked its bases and raised inside getattr for an awake one.
_asleep_classes: dict[type, type] = {}
_asleep_lock = threading.Lock()


def _asleep_tensors(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor) and getattr(type(value), "_hibernate_awake_class", None):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _asleep_tensors(value)
        elif isinstance(value, Mapping):
            yield from _asleep_tensors(value.values())


def _refuse_while_asleep(
    cls: type, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
) -> Any:
    """``__torch_function__`` of a tensor put to sleep: a clear error instead of a null dereference."""
    kwargs = kwargs or {}
    if _metadata_only(func):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    tensor = next(_asleep_tensors((*args, *kwargs.values())), None)
    name = _asleep_names.get(id(tensor), "?") if tensor is not None else "?"
    try:
        op = torch.overrides.resolve_name(func) or repr(func)
    except Exception:  # resolve_name is best effort; the message must still be built
        op = repr(func)
    raise HibernatingError(
        f"tensor {name!r} is asleep (its memory is released): {op} was called on it by thread "
        f"{threading.current_thread().name!r} outside hibernate.guard()",
        hint="hold hibernate.guard() around code that touches tracked tensors; "
        "it waits for the wake instead of failing",
    )


def _asleep_class(awake: type) -> type:
    """The class a tensor of class ``awake`` takes asleep; ``awake`` itself if it is an asleep class."""
    cls = _asleep_classes.get(awake)  # made once per class: no lock taken for every tensor released
    if cls is not None:
        return cls
    with _asleep_lock:
        cls = _asleep_classes.get(awake)
        if cls is None and getattr(awake, "_hibernate_awake_class", None) is not None:
            cls = _asleep_classes[awake] = awake
        elif cls is None:
            cls = type(
                f"Asleep{awake.__name__}",
                (awake,),
                {
                    "__torch_function__": classmethod(_refuse_while_asleep),
                    "_hibernate_awake_class": awake,
                    "__module__": __name__,
                    "__doc__": f"A {awake.__name__} whose memory hibernate released (see {__name__}).",
                },
            )
            _asleep_classes[awake] = cls
        return cls


def _put_to_sleep(tensor: torch.Tensor, name: str) -> bool:
    """Swap the tensor's class for its asleep twin; False if this object's class cannot be swapped."""
    awake = type(tensor)
    asleep = _asleep_classes.get(awake) or _asleep_class(awake)
    if asleep is awake:
        return True  # asleep already
    try:
        _asleep_names[id(tensor)] = name
        tensor.__class__ = asleep
    except TypeError:  # a class whose layout differs from its subclass's; left as it is
        _asleep_names.pop(id(tensor), None)
        return False
    return True


# Present in CUDA builds of torch from 2.12, absent from CPU-only ones (see untracked_views_warning).
_poison_storage = getattr(torch._C, POISON_STORAGE, None)
_unpoison_storage = getattr(torch._C, UNPOISON_STORAGE, None)
if _poison_storage is None or _unpoison_storage is None:
    _poison_storage = _unpoison_storage = None  # one without the other could not be undone


@dataclass
class _Tracked:
    obj: Any
    tag: str
    keep: bool
    name: str


class StorageRegion(RegionAttributes):
    """One torch storage and every tracked view of it.

    A device storage (``on_device``: what gives the copy seam, and the device's index) is copied and
    zero-filled through that seam, on its own non-blocking streams, never by a ``copy_``
    on the program's current stream; a host storage by plain memcpy.
    """

    def __init__(
        self,
        key: str,
        tag: str,
        keep: bool,
        storage: torch.UntypedStorage,
        views: list[dict[str, Any]],
        tensors: Sequence[tuple[torch.Tensor, str]] = (),
        on_device: tuple[Callable[[], DeviceCopies], int] | None = None,
        optimizer: str | None = None,
    ) -> None:
        # Strings and ints only (see TensorPool._regions): plain by construction. A device storage is
        # named by the index its seam copies it on (the same as torch's "cuda:N" for a CUDA storage).
        # An optimizer's state says which kind of optimizer it is (see optimizers.give_state).
        where = storage.device  # a new object at each call: asked once
        name, kind, _ = _DEVICE_FACTS.get(where) or _device_facts(where)
        device = f"cuda:{on_device[1]}" if on_device is not None else name
        meta = PlainMeta(device=device, views=views)
        if optimizer is not None:
            meta["optimizer"] = optimizer
        super().__init__(key, tag, keep, storage.nbytes(), meta)
        self._storage = storage
        self._device = where
        self._on_device = on_device
        # Decided once: a sleep asks host_view once per chunk, and device.type alone cost 0.26 us.
        self._in_host_memory = on_device is None and kind == "cpu"
        # The tracked tensor objects on this storage, and their names. A list is kept as given (the
        # pool makes one per storage, for its region alone): a copy per region was 3% of a sleep's
        # regions() at 100,000 tensors.
        self._tensors = tensors if type(tensors) is list else list(tensors)
        self._storage_poisoned = False
        self.released = False
        self._view: memoryview | None = None  # see host_view
        self._view_address = 0

    def holds_any(self, tensor_ids: set[int]) -> bool:
        """Whether one of the tensors on this storage is among ``tensor_ids`` (TensorPool.tensors_of)."""
        return any(id(tensor) in tensor_ids for tensor, _ in self._tensors)

    def _bytes(self) -> torch.Tensor:
        flat = torch.empty(0, dtype=torch.uint8, device=self._device)
        return flat.set_(self._storage, 0, (self._nbytes,), (1,))

    def _check_range(self, offset: int, length: int) -> None:
        if offset < 0 or offset + length > self._nbytes:
            raise ValueError(f"{self._key}: bytes {offset}..{offset + length} outside its {self._nbytes}")

    def copy_out(self, offset: int, dst: memoryview) -> None:
        self._check_range(offset, len(dst))
        if self._on_device is not None:
            copies, index = self._on_device
            copies().copy_to_host(index, self._storage.data_ptr() + offset, dst)
            return
        if self._device.type == "cpu" and not dst.readonly and len(dst):
            # One plain memcpy that releases the GIL: torch's copy_ would fan out to its
            # intra-op threads and compete with the store's own workers for the cores.
            ctypes.memmove(_address(dst), self._storage.data_ptr() + offset, len(dst))
            return
        with torch.no_grad():
            torch.frombuffer(dst, dtype=torch.uint8).copy_(self._bytes()[offset : offset + len(dst)])

    def copy_in(self, offset: int, src: memoryview) -> None:
        self._check_range(offset, len(src))
        if self._on_device is not None:
            copies, index = self._on_device
            copies().copy_from_host(index, self._storage.data_ptr() + offset, src)
            return
        if self._device.type == "cpu" and not src.readonly and len(src):
            ctypes.memmove(self._storage.data_ptr() + offset, _address(src), len(src))
            return
        with torch.no_grad():
            self._bytes()[offset : offset + len(src)].copy_(torch.frombuffer(src, dtype=torch.uint8))

    def host_view(self, offset: int, length: int) -> memoryview | None:
        """A slice of one view of the whole storage, made once per allocation.

        Building a view per call cost more than hashing a small tensor; the
        view is dropped on release and rebuilt if the storage moved (torch may
        reallocate it at a new address). See memory_at for how it is built.
        """
        if not self._in_host_memory or self.released:
            return None
        address = self._storage.data_ptr()
        if self._view is None or self._view_address != address:
            self._view = memory_at(address, self._nbytes)
            self._view_address = address
        return self._view[offset : offset + length]

    def host_address(self) -> int | None:
        if not self._in_host_memory or self.released:
            return None
        return int(self._storage.data_ptr())

    def release(self) -> None:
        """Free the memory; first put its tensors to sleep, so that new uses raise, not crash."""
        if self.released:
            return
        for tensor, name in self._tensors:
            _put_to_sleep(tensor, name)
        self._view = None  # its memory is about to go
        try:
            if self._nbytes:
                self._free()
                if _poison_storage is not None:  # a call less per region where torch cannot poison
                    self._poison()
        except BaseException:
            self._wake_tensors()  # the memory is still there
            raise
        self.released = True

    def reallocate(self) -> None:
        """Memory back, and the tensors usable again (refilled before guard() reopens)."""
        if not self.released:
            return
        if self._nbytes:
            if self._storage_poisoned:  # a call less per region where torch cannot poison
                self._unpoison()
            try:
                self._take()
            except BaseException:
                self._poison()  # still released: keep views raising
                raise
        self._wake_tensors()
        self.released = False

    def _free(self) -> None:
        self._storage.resize_(0)

    def _take(self) -> None:
        self._storage.resize_(self._nbytes)

    def _poison(self) -> None:
        if _poison_storage is not None and not self._storage_poisoned:
            _poison_storage(
                self._storage._cdata,
                f"the memory of {self._key!r} is released while the process hibernates; "
                "a view of it was used outside hibernate.guard()",
            )
            self._storage_poisoned = True

    def _unpoison(self) -> None:
        if _unpoison_storage is not None and self._storage_poisoned:
            _unpoison_storage(self._storage._cdata)
            self._storage_poisoned = False

    def _wake_tensors(self) -> None:
        """Each tensor its own class again (the undoing of _put_to_sleep), in one loop: called for
        every region a wake brings back, a call per tensor was a tenth of its cost in Python."""
        names = _asleep_names
        for tensor, _ in self._tensors:
            awake = getattr(type(tensor), "_hibernate_awake_class", None)
            if awake is not None:
                tensor.__class__ = awake
            names.pop(id(tensor), None)

    def zero(self) -> None:
        if self._on_device is not None:
            copies, index = self._on_device
            copies().zero(index, self._storage.data_ptr(), self._nbytes)
            return
        with torch.no_grad():
            self._bytes().zero_()

    def device_twin(self) -> StorageRegion | None:
        """New memory on this region's device, of its size and description, holding no tensor; None
        for host memory.

        What an adoption fills in place of a device storage until the whole snapshot is verified
        (agent.adopt): filling host memory instead would fault in fresh host pages at a few GB/s
        a core, where the device copies run at tens; the twin costs device memory for the length
        of the adoption and one copy within the device.
        """
        if self._on_device is None and self._device.type == "cpu":
            return None
        storage = torch.empty(self._nbytes, dtype=torch.uint8, device=self._device).untyped_storage()
        twin = StorageRegion(self._key, self._tag, self._keep, storage, [], (), self._on_device)
        twin._meta = self._meta  # the same description, compared whole by the reader
        return twin

    def take_bytes_of(self, twin: StorageRegion) -> None:
        """Copy the twin's bytes (see device_twin) into this storage, done when it returns: a copy on
        the device, on torch's current stream, which the program waits on anyway."""
        with torch.no_grad():
            self._bytes().copy_(twin._bytes())
        if self._device.type == "cuda":
            torch.cuda.current_stream(self._device).synchronize()


class FixedHostStorageRegion(StorageRegion):
    """A CPU storage torch cannot resize, hibernated at its own address (see hibernate.pools.hostpages).

    Its pages are handed back with MADV_DONTNEED and its bytes written back in
    place: the address that numpy, a blob's owner or a memory map holds stays
    valid. Reads of it while asleep (through numpy, say, which no guard sees)
    find zeros, or the file's bytes for a private file mapping, never a fault.
    """

    def __init__(
        self,
        key: str,
        tag: str,
        keep: bool,
        storage: torch.UntypedStorage,
        views: list[dict[str, Any]],
        tensors: Sequence[tuple[torch.Tensor, str]] = (),
        optimizer: str | None = None,
    ) -> None:
        super().__init__(key, tag, keep, storage, views, tensors, optimizer=optimizer)
        self._address = storage.data_ptr()
        self._pages = hostpages.interior(self._address, self._nbytes)

    @property
    def resident_after_release(self) -> int:
        return self._nbytes - self._pages[1]

    def _free(self) -> None:
        hostpages.discard_pages(*self._pages)

    def _take(self) -> None:
        """Nothing to allocate: the range stayed mapped, its pages come back as they are touched."""

    def zero(self) -> None:
        # MADV_DONTNEED left zeros only in anonymous pages: a private file mapping reads the file again.
        ctypes.memset(self._address, 0, self._nbytes)


def _named_tensors(
    tracked: _Tracked, names: Mapping[int, str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a tracked object with its name; an optimizer's state goes by the names
    ``names`` gives its parameters (optimizers.parameter_names of the tracked modules)."""
    obj, prefix = tracked.obj, tracked.name
    if isinstance(obj, torch.nn.Module):
        for name, param in obj.named_parameters(remove_duplicate=False):
            yield f"{prefix}{name}", param
            if param.grad is not None:
                yield f"{prefix}{name}.grad", param.grad
        for name, buf in obj.named_buffers(remove_duplicate=False):
            yield f"{prefix}{name}", buf
    elif isinstance(obj, torch.optim.Optimizer):
        yield from optimizers.named_state(obj, prefix, names or {})
    elif isinstance(obj, torch.Tensor):
        yield prefix.rstrip("."), obj
    elif isinstance(obj, (Mapping, list, tuple)):
        # A tensor in it is named here, not in a call of its own: a model of many small tensors
        # (a dict of experts' weights) paid a generator and an entry per tensor, at every enumeration.
        items = obj.items() if isinstance(obj, Mapping) else enumerate(obj)
        for key, value in items:
            if isinstance(value, torch.Tensor):
                yield f"{prefix}{key}".rstrip("."), value
            else:
                yield from _named_tensors(
                    _Tracked(value, tracked.tag, tracked.keep, f"{prefix}{key}."), names
                )
    else:
        raise UsageError(
            f"cannot track {type(obj).__name__} at {prefix.rstrip('.') or 'top level'}: expected an "
            "nn.Module, optimizer, tensor, or a dict/list of them"
        )


def _parameter_names(tracked: Sequence[_Tracked]) -> Mapping[int, str]:
    """The names an optimizer's state goes by: its parameters' in the tracked modules; none is
    looked for where nothing tracked can hold an optimizer (modules and tensors only)."""
    if all(isinstance(entry.obj, (torch.nn.Module, torch.Tensor)) for entry in tracked):
        return {}
    modules = [(entry.name, entry.obj) for entry in tracked if isinstance(entry.obj, torch.nn.Module)]
    return optimizers.parameter_names(modules)


def _view(name: str, tensor: torch.Tensor, sizes: dict[tuple[int, ...], list[int]]) -> dict[str, Any]:
    """How ``tensor`` lies in its storage, as the snapshot's meta records it: plain strings and ints.

    Its shape and strides are lists taken from ``sizes`` (made there on first need), shared by every
    view of one walk that has the same: a model's tensors have few distinct shapes, and two lists
    per tensor were a tenth of the regions' memory, held from a sleep to its wake, and of the
    walk's time. Shared is safe as a region's meta is read-only (RegionAttributes).
    """
    dtype = tensor.dtype
    shape = tensor.shape
    strides = tensor.stride()
    return {
        "name": name,
        "dtype": _DTYPE_NAMES.get(dtype) or _dtype_name(dtype),
        "shape": sizes.get(shape) or sizes.setdefault(shape, list(shape)),
        "strides": sizes.get(strides) or sizes.setdefault(strides, list(strides)),
        "storage_offset": tensor.storage_offset(),
    }


def _view_identity(view: Mapping[str, Any]) -> tuple[Any, ...]:
    """A view dict as a hashable value: two views are the same view exactly when these are equal."""
    return (view["name"], view["dtype"], tuple(view["shape"]), tuple(view["strides"]), view["storage_offset"])


def _add_view(slot: list[Any], view: dict[str, Any], tensor: torch.Tensor, name: str) -> None:
    """A further view and tensor met on a storage (see TensorPool._storages), each added once.

    The same tensor is met twice under one name when it is tracked twice, under two when a module
    ties it; its views then differ by name. A storage's first view is added without a look, and
    from its second on they are looked up in sets made then: comparing each new view with every
    earlier one was quadratic in the views of one storage (a flat buffer of many parameters).
    """
    views, tensors, seen = slot[3], slot[4], slot[5]
    if seen is None:
        seen = slot[5] = ({_view_identity(v) for v in views}, {id(t) for t, _ in tensors})
    seen_views, seen_tensors = seen
    identity = _view_identity(view)
    if identity not in seen_views:
        seen_views.add(identity)
        views.append(view)
    if id(tensor) not in seen_tensors:
        seen_tensors.add(id(tensor))
        tensors.append((tensor, name))


def _unused_key(tag: str, name: str, keys: set[str]) -> str:
    """A key for a storage whose first name another storage's key took already: ``tag/name#2``,
    ``#3``..., the first not in ``keys``."""
    suffix = 2
    while f"{tag}/{name}#{suffix}" in keys:
        suffix += 1
    return f"{tag}/{name}#{suffix}"


def _check_trackable(name: str, tensor: torch.Tensor) -> None:
    # A tensor asleep (tracked again while the process sleeps) answers these metadata questions.
    with torch._C.DisableTorchFunctionSubclass():
        _check_layout(name, tensor)


def _check_layout(name: str, tensor: torch.Tensor) -> None:
    # Asked of every tracked tensor at every enumeration: each attribute read once (a sparse
    # tensor's layout is not strided either).
    if tensor.layout != torch.strided:
        raise UsageError(
            f"tensor {name!r} has layout {tensor.layout}; only strided tensors can be hibernated"
        )
    kind = tensor.device.type
    if kind == "cpu":
        return
    if kind != "cuda":
        raise UsageError(f"tensor {name!r} is on {tensor.device}; hibernate handles cpu and cuda tensors")
    if not tensor.untyped_storage().resizable():
        raise UsageError(
            f"tensor {name!r} uses CUDA memory torch did not allocate (from_blob, DLPack), "
            "which hibernate cannot free",
            hint="copy it into a torch-allocated tensor before tracking it",
        )


def _fixed_host(storage: torch.UntypedStorage) -> bool:
    """A CPU storage torch cannot resize (numpy-shared, ``frombuffer``, a memory map)."""
    return not storage.resizable() and storage.device.type == "cpu"


DEFAULT_POOL = (0, 0)  # the caching allocator's own pool, the one empty_cache() empties


class UnknownSegmentsError(Exception):
    """The CUDA allocator cannot list its segments: which pool holds a storage is unknown."""


def allocator_segments() -> list[dict[str, Any]]:
    """Every segment of torch's CUDA caching allocator, all pools (``segment_pool_id`` says which).

    Raises UnknownSegmentsError where the process replaced the caching allocator
    (``torch.cuda.memory.change_current_allocator``: RMM, a pluggable allocator),
    whose snapshot raises RuntimeError ("CUDAPluggableAllocator does not yet
    support snapshot").
    """
    if not torch_cuda_in_use():
        return []
    try:
        try:
            return list(torch.cuda.memory_snapshot(include_traces=False))
        except TypeError:  # a torch older than include_traces: the same segments, traces and all
            return list(torch.cuda.memory_snapshot())
    except RuntimeError as exc:
        raise UnknownSegmentsError(str(exc).strip()) from exc


def pool_of(device: int, address: int, segments: Sequence[Mapping[str, Any]]) -> tuple[int, int] | None:
    """The id of the memory pool whose segment holds ``address`` on ``device``; None if unknown.

    A torch that does not name each segment's pool (``segment_pool_id``) leaves it unknown.
    """
    for segment in segments:
        start = int(segment["address"])
        if int(segment["device"]) == device and start <= address < start + int(segment["total_size"]):
            if "segment_pool_id" not in segment:
                return None
            first, second = segment["segment_pool_id"]
            return int(first), int(second)
    return None


def private_pool_warnings(
    storages: Iterable[tuple[str, int, int, int]], segments: Sequence[Mapping[str, Any]]
) -> list[str]:
    """One warning per device storage (key, device, address, bytes) that lives in a non-default pool.

    ``torch.cuda.empty_cache()`` returns only the default pool's free blocks: a
    storage in a live ``torch.cuda.MemPool`` or a CUDA graph's private pool,
    resized to zero, stays reserved by that pool, so releasing it frees nothing
    on the GPU. It is still spilled and restored; the report says so.
    """
    warnings = []
    for key, device, address, nbytes in storages:
        pool = pool_of(device, address, segments)
        if pool is not None and pool != DEFAULT_POOL:
            warnings.append(
                f"{key} ({nbytes} bytes on cuda:{device}) lives in the private memory pool {pool} "
                "(a torch.cuda.MemPool or a CUDA graph's pool): releasing it frees nothing on the GPU, "
                "since empty_cache() does not return a live pool's blocks"
            )
    return warnings


def cuda_index(storage: torch.UntypedStorage) -> int | None:
    """The CUDA device a storage lives on; None for host memory."""
    where = storage.device
    return (_DEVICE_FACTS.get(where) or _device_facts(where))[2]


class PooledAddresses:
    """The allocations of ``hibernate.pool()``, to tell whether a storage lies in one (by its address)."""

    def __init__(self, spans: Sequence[Span]) -> None:
        self._spans = sorted(spans, key=lambda span: span.address)
        self._starts = [span.address for span in self._spans]

    def holds(self, storage: torch.UntypedStorage) -> bool:
        if not self._spans or not storage.nbytes():
            return False
        address = storage.data_ptr()
        index = bisect.bisect_right(self._starts, address) - 1
        return index >= 0 and self._spans[index].holds(address)


class TensorPool:
    """The tensors this process asked to hibernate.

    ``copies`` makes the device copy seam on first need (a CPU-only program never
    loads one); ``device_of`` says which storages are device memory, and where;
    ``segments`` lists the device allocator's segments and the pool of each;
    ``covered`` the allocations of ``hibernate.pool()``, whose storages their
    own pool hibernates at their addresses (tracking them too changes nothing);
    ``graphs`` the CUDA graphs alive that the process captured since its
    first track or pool (hibernate.pools.capture).
    """

    name = "torch"

    def __init__(
        self,
        copies: Callable[[], DeviceCopies] = CudaCopies.from_process,
        device_of: Callable[[torch.UntypedStorage], int | None] = cuda_index,
        segments: Callable[[], Sequence[Mapping[str, Any]]] = allocator_segments,
        covered: Callable[[], Sequence[Span]] = covered_spans,
        graphs: Callable[[], Sequence[SeenGraph]] = live_graphs,
    ) -> None:
        self._tracked: dict[int, _Tracked] = {}
        self._lock = threading.Lock()
        self._counter = itertools.count()
        # What the newest regions() found, for warnings(): host storages left in place (in words),
        # the device storages (key, device, address, bytes) whose pools warnings() looks up, and
        # whether any storage is released by resizing it (what untracked_views_warning is about).
        self._left_in_place: list[str] = []
        self._device_storages: list[tuple[str, int, int, int]] = []
        self._resized_any = False
        self._copies_source = copies
        self._copies: DeviceCopies | None = None
        self._device_of = device_of
        self._segments = segments
        self._covered = covered
        self._graphs = graphs
        self._devices: frozenset[int] = frozenset()  # those holding a storage at the newest regions()

    def copies(self) -> DeviceCopies:
        """The device copy seam, made on first use (a status call never makes it)."""
        with self._lock:
            if self._copies is None:
                self._copies = self._copies_source()
            return self._copies

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

    def prepare_adoption(self, columns: Columns) -> optimizers.GivenState:
        """Give each tracked optimizer that has not stepped the state a snapshot holds for it, before
        an adoption fills it (optimizers.give_state); what was made, to be taken back on a refusal."""
        with self._lock:
            tracked = list(self._tracked.values())
        names = _parameter_names(tracked)
        given = optimizers.GivenState()
        try:
            for entry in tracked:
                if not isinstance(entry.obj, torch.optim.Optimizer):
                    continue
                start = f"{entry.tag}/"
                records = [
                    (key[len(start) :], meta)
                    for key, tag, meta in zip(columns.keys, columns.tags, columns.metas, strict=True)
                    if tag == entry.tag and key.startswith(start)
                ]
                optimizers.give_state(entry.obj, entry.name, names, records, given)
        except BaseException:
            given.take_back()  # a second optimizer refused: the first one's state goes again
            raise
        return given

    def tensors_of(self, obj: Any) -> set[int]:
        """The ids of the tensors ``obj`` holds as it is tracked (see StorageRegion.holds_any)."""
        with self._lock:
            tracked = list(self._tracked.values())
            entry = self._tracked.get(id(obj))
        if entry is None:
            return set()
        return {id(tensor) for _, tensor in _named_tensors(entry, _parameter_names(tracked))}

    def regions(self) -> Sequence[SpillableRegion]:
        """Every tracked storage as a region; the collector is held off meanwhile (see gc_paused)."""
        with gc_paused():
            return self._regions()

    def contents(self) -> Contents:
        """What ``Contents.of(self.regions())`` says, without building the regions: one walk of the
        tracked tensors, by storage (what ``status`` asks of a running process, each command twice).

        Host storages torch cannot resize are placed by their mappings as regions() places them:
        where any is tracked, the regions are built after all.
        """
        with gc_paused():
            by_storage = self._storages(describe=False)
            groups: dict[tuple[str, bool], list[int]] = {}
            on_devices: dict[str, int] = {}
            for owner, _, storage, _, _, _ in by_storage.values():
                index = self._device_of(storage)
                if index is None and _fixed_host(storage):
                    return Contents.of(self.name, self._regions())
                nbytes = storage.nbytes()
                group = groups.setdefault((owner.tag, owner.keep), [0, 0])
                group[0] += 1
                group[1] += nbytes
                if index is not None:
                    device = f"cuda:{index}"
                    on_devices[device] = on_devices.get(device, 0) + nbytes
        summaries = [PoolSummary(self.name, tag, keep, n, size) for (tag, keep), (n, size) in groups.items()]
        return Contents(summaries, on_devices)

    def _storages(self, describe: bool) -> dict[int, list[Any]]:
        """The tracked tensors by storage: storage identity -> [owning entry, first name, storage,
        views, tensors, seen], in the order first met; a storage shared with a kept tensor is kept,
        under that tensor's tag. Storages of ``hibernate.pool()`` are left to their pool.

        Only where ``describe``: views (each distinct view dict once, see _view) and tensors (each
        tensor object once, with its first name: ``[(tensor, name)]``); ``seen`` is what finds the
        ones met already once a storage has several (see _add_view), None until then.
        """
        with self._lock:
            tracked = list(self._tracked.values())
        names = _parameter_names(tracked)
        by_storage: dict[int, list[Any]] = {}
        spans = self._covered()
        in_pool = PooledAddresses(spans).holds if spans else None
        strided = torch.strided
        sizes: dict[tuple[int, ...], list[int]] = {}  # the shapes and strides of the walk's views (see _view)
        # Once for the whole walk, not per tensor: a tensor asleep (tracked again while the process
        # sleeps) answers the metadata questions below as an awake one does.
        with torch._C.DisableTorchFunctionSubclass():
            for entry in tracked:
                for name, tensor in _named_tensors(entry, names):
                    # A strided CPU tensor passes _check_layout: two cheap reads instead of a call
                    # and ``device.type`` (0.3 us) for each tensor of a plain CPU model.
                    if tensor.layout is not strided or not tensor.is_cpu:
                        _check_layout(name, tensor)
                    storage = tensor.untyped_storage()
                    if in_pool is not None and in_pool(storage):
                        continue  # hibernated at its own address by its pool (hibernate.pool)
                    identity = storage._cdata
                    slot = by_storage.get(identity)
                    if slot is None:
                        # Most storages are met once: their lists are made here, in one go.
                        views = [_view(name, tensor, sizes)] if describe else ()
                        tensors = [(tensor, name)] if describe else ()
                        by_storage[identity] = [entry, name, storage, views, tensors, None]
                        continue
                    if entry.keep and not slot[0].keep:
                        slot[0], slot[1] = entry, name
                    if describe:
                        _add_view(slot, _view(name, tensor, sizes), tensor, name)
        return by_storage

    def _regions(self) -> Sequence[SpillableRegion]:
        by_storage = self._storages(describe=True)
        # resizable() first: the one question most storages need, without a call of _fixed_host each.
        fixed = [slot for slot in by_storage.values() if not slot[2].resizable() and _fixed_host(slot[2])]
        ranges = [(s[2].data_ptr(), s[2].data_ptr() + s[2].nbytes(), s[0].keep) for s in fixed]
        kept_by_overlap = {
            id(slot): keep for slot, keep in zip(fixed, hostpages.kept_with_overlaps(ranges), strict=True)
        }
        regions: list[SpillableRegion] = []
        warnings: list[str] = []
        keys: set[str] = set()
        mappings: list[hostpages.HostMapping] | None = None
        devices: set[int] = set()
        device_storages: list[tuple[str, int, int, int]] = []
        device_of = self._device_of
        for slot in by_storage.values():
            owner, first_name, storage, views, tensors, _ = slot
            key = f"{owner.tag}/{first_name}"
            if key in keys:
                key = _unused_key(owner.tag, first_name, keys)
            keys.add(key)
            optimizer = optimizers.kind(owner.obj) if isinstance(owner.obj, torch.optim.Optimizer) else None
            index = device_of(storage)
            if index is not None:
                devices.add(index)
                region = StorageRegion(
                    key, owner.tag, owner.keep, storage, views, tensors, (self.copies, index), optimizer
                )
                regions.append(region)
                if region.nbytes:
                    device_storages.append((key, index, storage.data_ptr(), region.nbytes))
            elif fixed and _fixed_host(storage):
                mappings = hostpages.own_mappings() if mappings is None else mappings
                start = storage.data_ptr()
                where = hostpages.placement(start, start + storage.nbytes(), mappings)
                if where.hibernate:
                    keep = kept_by_overlap[id(slot)]  # kept if it shares bytes with a kept storage
                    regions.append(
                        FixedHostStorageRegion(key, owner.tag, keep, storage, views, tensors, optimizer)
                    )
                else:
                    warnings.append(f"{key} ({storage.nbytes()} bytes) is left in memory: {where.reason}")
            else:
                regions.append(
                    StorageRegion(key, owner.tag, owner.keep, storage, views, tensors, optimizer=optimizer)
                )
        self._left_in_place = warnings
        self._device_storages = device_storages
        self._resized_any = any(type(r) is StorageRegion and r.nbytes for r in regions)
        self._devices = frozenset(devices)
        return regions

    def synchronize(self) -> None:
        """Wait for every device that holds a tracked storage, all its streams (before reads, after fills)."""
        for device in sorted(self._devices):
            self.copies().synchronize(device)

    def warnings(self) -> list[str]:
        """Host storages left in place, views that cannot raise, then device storages in a private pool.

        The pools are looked up here, not in regions(): the allocator's snapshot
        is costly, and ``status`` enumerates regions without needing it. Asked
        after every byte was written, so a snapshot that cannot be taken is a
        warning, never the sleep's failure.
        """
        found = list(self._left_in_place)
        untracked_views = untracked_views_warning(
            str(torch.__version__), torch.version.cuda, _poison_storage is not None
        )
        if untracked_views is not None and self._resized_any:
            found.append(untracked_views)
        if self._device_storages:
            try:
                found.extend(private_pool_warnings(self._device_storages, self._segments()))
            except UnknownSegmentsError as exc:
                nbytes = sum(size for _, _, _, size in self._device_storages)
                found.append(
                    f"torch's CUDA allocator cannot list its memory pools ({exc}): the process uses "
                    "another allocator (RMM, torch.cuda.memory.change_current_allocator), so whether "
                    f"releasing the {len(self._device_storages)} tracked CUDA storages ({nbytes} bytes) "
                    "frees memory on the GPU, or leaves it with that allocator, is unknown"
                )
        return found

    def moves_refusal(self) -> str | None:
        """Device storages the newest regions() resizes, while CUDA graphs live (hibernate.pools.graphs).

        Every tracked device storage moves (a pool's are not tracked here: see
        ``covered``); host storages are not counted, as a graph reads device
        memory. Asked only where something moves: the allocator's snapshot is
        costly. Every graph seen at its capture counts, one captured by
        ``hibernate.cuda_graph`` too (its own memory stays in place, not what it
        reads); so does a graph pool holding memory that none of them owns. An
        allocator that cannot list its segments shows no such pool (its warning
        says so), but the graphs seen at their capture still count.
        """
        moving = [(key, nbytes) for key, _, _, nbytes in self._device_storages]
        if not moving:
            return None
        try:
            pools = graph_pools(self._segments())
        except UnknownSegmentsError:
            pools = []
        live = [(graph.describe(), graph.pool) for graph in self._graphs()]
        return moves_refusal(moving, graph_descriptions(live, pools))

    def after_release(self) -> None:
        _trim_host_heap()
        if torch_cuda_in_use():
            torch.cuda.empty_cache()

    def pinner(self) -> Callable[[memoryview], Callable[[], None] | None] | None:
        """The seam's page-locking, where the newest regions() found device storages."""
        return self.copies().pinner() if self._devices else None


_libc: ctypes.CDLL | None = None


def _trim_host_heap() -> None:
    """Hand freed heap pages back to the OS; glibc otherwise keeps small frees around."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    trim = getattr(_libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
