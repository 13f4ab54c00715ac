"""Device memory as the vLLM pool sees it: map, unmap, copy to and from the host, zero.

The copies alone (:class:`DeviceCopies`) are also how tracked PyTorch CUDA
storages are spilled and restored (hibernate.pools.tensors).

This seam is what lets the pool's logic (which allocations to spill, release,
map back, fill or zero) run unchanged over GPU memory and, in tests, over host
memory. On a GPU:

* mapping is vLLM's own C extension (``create_and_map`` / ``unmap_and_release``
  from ``vllm.device_allocator.cumem``): physical memory goes and comes back
  while the virtual address stays reserved, so every pointer vLLM holds (and
  every captured CUDA graph) stays valid;
* copies and fills go through the CUDA runtime on non-blocking streams of our
  own, so they neither wait for nor hold up the legacy default stream. The
  store's copies of one staging chunk are only queued, on a stream the
  staging thread holds for that chunk (one per thread and device, pooled, so
  the workers' chunks are in flight on as many streams), and one event
  recorded after them says when the staging may be reused
  (:func:`deferred_copies`, the store's side in pipeline.DeviceStaging).
  Waiting for each copy instead cost a synchronization per region (100,000
  for as many small tensors) and left the device idle while the next chunk
  was verified. Fills are only queued: every wake ends with a device
  synchronization before the program runs again.

Nothing here imports torch or vLLM at module level: the CLI imports pools, and
``vllm.device_allocator.cumem`` raises ImportError on a machine without a driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from hibernate.errors import HibernateError, UnsupportedError
from hibernate.pools.base import RegionAttributes
from hibernate.pools.hostpages import HostMapping, own_mappings
from hibernate.store.pipeline import DeviceStaging, PinFn, Queued

# vLLM's allocation handle: (device, aligned size, device pointer, generic allocation handle).
Handle = tuple[int, int, int, Any]


def torch_cuda_in_use() -> bool:
    """Whether torch in this process has started CUDA: only then is there a cache to empty or list.

    Never torch.cuda.is_available(): asking it initializes the CUDA driver (its
    cuInit opens the NVIDIA device files), after which a CPU-only process looks
    like a CUDA process to the next sleep on a GPU machine; four such processes
    were refused there as CUDA processes checkpointed together.
    """
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def free_device_bytes(device: int) -> int | None:
    """The free memory of CUDA device ``device`` now, as the driver counts it; None where unknown.

    Asked only where torch already started CUDA (see torch_cuda_in_use): a
    process without it has no device memory to bring back.
    """
    if not torch_cuda_in_use():
        return None
    torch = sys.modules["torch"]
    try:
        free, _ = torch.cuda.mem_get_info(device)
    except RuntimeError:
        return None
    return int(free)


# torch._C's pair that makes a storage raise on data-pointer access, and undoes it. Bound in CUDA
# builds only (torch/csrc/cuda/Module.cpp); the second from STORAGE_POISONING_SINCE (2.11 has the first).
POISON_STORAGE = "_set_storage_data_ptr_access_error_msg"
UNPOISON_STORAGE = "_clear_storage_data_ptr_access_error_msg"
STORAGE_POISONING_SINCE = "2.12"


def untracked_views_warning(version: str, cuda: str | None, poisons_storages: bool) -> str | None:
    """What a CUDA build of torch that cannot make a released storage raise costs; None where it can.

    Tracked tensor objects raise HibernatingError while asleep on any torch; a
    view made of one before the sleep and not tracked itself raises only through
    its poisoned storage. A CPU-only build never could (the README says so); a
    CUDA build older than the floor launches the view's kernel on freed memory.
    """
    if cuda is None or poisons_storages:
        return None
    return (
        f"torch {version} (CUDA {cuda}) cannot make released memory raise: a view of a tracked tensor "
        "that was not tracked itself, used outside hibernate.guard() while the process sleeps, reaches "
        f"freed memory (a crash or an illegal address) instead of raising a RuntimeError as torch "
        f"{STORAGE_POISONING_SINCE} and newer do"
    )


def torch_in_process() -> dict[str, Any] | None:
    """The torch this process loaded, for the agent's status (doctor reads it); None where none is.

    Read from ``sys.modules``: the agent never imports torch for a status call.
    """
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None)
    if version is None:
        return None
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    poisons = all(hasattr(getattr(torch, "_C", None), name) for name in (POISON_STORAGE, UNPOISON_STORAGE))
    return {
        "version": str(version),
        "cuda": cuda,
        "warning": untracked_views_warning(str(version), cuda, poisons),
    }


class DeviceMemoryError(HibernateError):
    """A device call failed (the CUDA runtime's own words are in the message)."""


class DeviceCopies(Protocol):
    """Copies between device memory and the host, on streams of the seam's own; all a torch storage needs.

    A copy is done when it returns, except inside a deferral block of the
    seam's pinner (pipeline.DeviceStaging), where it is only queued until the
    block's fence completed. A seam whose copies are always done on return
    (host memory) offers a plain pin, and the store then waits for nothing.
    """

    def copy_to_host(self, device: int, address: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes at device ``address`` into ``dst`` (in a deferral block: once its fence
        completed)."""
        ...

    def copy_from_host(self, device: int, address: int, src: memoryview) -> None:
        """Copy ``src`` to device ``address``.

        In a deferral block ``src`` is read when the copy runs, so it stays
        unchanged and mapped until the block's fence completed; a read-only
        ``src`` is copied first, and the fence keeps that copy.
        """
        ...

    def zero(self, device: int, address: int, nbytes: int) -> None:
        """Fill device memory with zeros; only queued, as no host memory waits on it.

        The memory reads as zeros to what runs after ``synchronize(device)``
        returned, as every wake ends with, or after the fence of the deferral
        block it was queued in.
        """
        ...

    def synchronize(self, device: int) -> None:
        """Wait for all work queued on ``device``, on every stream (before its memory is read or unmapped)."""
        ...

    def pinner(self) -> PinFn | None:
        """Page-locks staging buffers so device copies into them run at full speed; a
        pipeline.DeviceStaging where the seam's copies can be deferred."""
        ...


class DeviceMemory(DeviceCopies, Protocol):
    """Copies, and mapping physical memory in and out of reserved ranges (vLLM's allocations)."""

    def map(self, handle: Handle) -> None:
        """Back the reserved range of ``handle`` with fresh physical memory (contents undefined)."""
        ...

    def unmap(self, handle: Handle) -> None:
        """Give the physical memory of ``handle`` back; its virtual range stays reserved."""
        ...

    def empty_cache(self) -> None:
        """Return memory cached by other allocators of the process (after a release)."""
        ...


def attempt_copy(
    copy: Callable[[int, int, memoryview], None], device: int, address: int, view: memoryview
) -> str | None:
    """Run a device copy; a failure comes back as words, not as an exception.

    A raised exception's traceback would keep ``view`` (a slice of a store
    staging buffer) alive, and the store could then not unmap that buffer: its
    BufferError would hide the real failure. So the caller raises afresh, once
    it has dropped its own reference to the view.
    """
    try:
        copy(device, address, view)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        del view
    return None


class DeviceRegion(RegionAttributes):
    """A region of device memory at a fixed address (``meta``'s device and address), copied through a
    seam: what a pool that maps memory back at the same addresses (vLLM's, a provider's) offers."""

    def __init__(self, key: str, tag: str, keep: bool, nbytes: int, device: int, address: int) -> None:
        super().__init__(key, tag, keep, nbytes, {"device": device, "address": address})
        self._device = device
        self._address = address

    @property
    def address(self) -> int:
        return self._address

    def _copies(self) -> DeviceCopies:
        """The seam its bytes move through."""
        raise NotImplementedError

    def _writable(self) -> bool:
        """Whether copy_in may write it now (vLLM's allocator may free a region while it sleeps)."""
        return True

    def copy_out(self, offset: int, dst: memoryview) -> None:
        failure = attempt_copy(self._copies().copy_to_host, self._device, self._address + offset, dst)
        if failure is not None:
            del dst
            raise DeviceMemoryError(f"copying {self._key} (+{offset}) to the host failed: {failure}")

    def copy_in(self, offset: int, src: memoryview) -> None:
        if not self._writable():
            return
        failure = attempt_copy(self._copies().copy_from_host, self._device, self._address + offset, src)
        if failure is not None:
            del src
            raise DeviceMemoryError(f"copying {self._key} (+{offset}) to the device failed: {failure}")

    def host_view(self, offset: int, length: int) -> memoryview | None:
        return None  # device memory: the store stages it

    def host_address(self) -> int | None:
        return None


def buffer_address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


_CUDA_MEMCPY_DEFAULT = 4  # direction inferred from the pointers (unified addressing)
_CUDA_STREAM_NON_BLOCKING = 1
_CUDA_EVENT_DISABLE_TIMING = 2  # a fence needs no timestamp, and an event without one records faster
_CUDA_ERROR_NOT_READY = 600  # cudaEventQuery: the work before the record is still running


class CudaRuntime:
    """The handful of CUDA runtime calls the pool needs, bound with ctypes.

    Bound to the ``libcudart`` that vLLM already loaded in this process, through
    a handle of our own so that vLLM's function prototypes are never touched.
    ctypes releases the GIL during each call, so staging threads overlap.
    ``driver``, the ``libcuda`` the process loaded, answers has_primary_context.
    """

    def __init__(self, lib: ctypes.CDLL, driver: ctypes.CDLL | None = None) -> None:
        c_void_p, c_size_t, c_int, c_uint = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_uint
        self._error_string = self._bind(lib, "cudaGetErrorString", ctypes.c_char_p, [c_int])
        self._get_last_error = self._bind(lib, "cudaGetLastError", c_int, [])
        self._set_device = self._bind(lib, "cudaSetDevice", c_int, [c_int])
        self._get_device = self._bind(lib, "cudaGetDevice", c_int, [ctypes.POINTER(c_int)])
        self._device_synchronize = self._bind(lib, "cudaDeviceSynchronize", c_int, [])
        self._stream_create = self._bind(
            lib, "cudaStreamCreateWithFlags", c_int, [ctypes.POINTER(c_void_p), c_uint]
        )
        self._stream_synchronize = self._bind(lib, "cudaStreamSynchronize", c_int, [c_void_p])
        self._memcpy_async = self._bind(
            lib, "cudaMemcpyAsync", c_int, [c_void_p, c_void_p, c_size_t, c_int, c_void_p]
        )
        self._memset_async = self._bind(lib, "cudaMemsetAsync", c_int, [c_void_p, c_int, c_size_t, c_void_p])
        self._event_create = self._bind(
            lib, "cudaEventCreateWithFlags", c_int, [ctypes.POINTER(c_void_p), c_uint]
        )
        self._event_record = self._bind(lib, "cudaEventRecord", c_int, [c_void_p, c_void_p])
        self._event_synchronize = self._bind(lib, "cudaEventSynchronize", c_int, [c_void_p])
        self._event_query = self._bind(lib, "cudaEventQuery", c_int, [c_void_p])
        self._event_destroy = self._bind(lib, "cudaEventDestroy", c_int, [c_void_p])
        self._host_register = self._bind(lib, "cudaHostRegister", c_int, [c_void_p, c_size_t, c_uint])
        self._host_unregister = self._bind(lib, "cudaHostUnregister", c_int, [c_void_p])
        self._device_get = self._primary_context_state = None
        if driver is not None and hasattr(driver, "cuDevicePrimaryCtxGetState"):
            self._device_get = self._bind(driver, "cuDeviceGet", c_int, [ctypes.POINTER(c_int), c_int])
            self._primary_context_state = self._bind(
                driver,
                "cuDevicePrimaryCtxGetState",
                c_int,
                [c_int, ctypes.POINTER(c_uint), ctypes.POINTER(c_int)],
            )

    @staticmethod
    def _bind(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
        return function

    def check(self, code: int, what: str) -> None:
        """Raise for a failed call, after taking its error off the thread's last-error slot.

        The runtime keeps a failed call's error per thread until cudaGetLastError
        reads it, and torch reads that slot after each kernel launch: left there, a
        copy that failed here would surface later as an unrelated launch's error.
        """
        if code != 0:
            self._get_last_error()
            raw = self._error_string(code)
            words = raw.decode("utf-8", "replace") if raw else "unknown error"
            raise DeviceMemoryError(f"{what} failed with CUDA error {code}: {words}")

    def set_device(self, device: int) -> None:
        self.check(self._set_device(device), f"cudaSetDevice({device})")

    def get_device(self) -> int:
        device = ctypes.c_int()
        self.check(self._get_device(ctypes.byref(device)), "cudaGetDevice")
        return device.value

    def has_primary_context(self, device: int) -> bool:
        """Whether ``device``'s primary context is active; True where the driver cannot be asked.

        Asked of the driver, which answers without creating one (cudaSetDevice would).
        """
        if self._device_get is None or self._primary_context_state is None:
            return True
        handle, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        if self._device_get(ctypes.byref(handle), device) != 0:
            return True
        if self._primary_context_state(handle, ctypes.byref(flags), ctypes.byref(active)) != 0:
            return True
        return bool(active.value)

    def device_synchronize(self) -> None:
        self.check(self._device_synchronize(), "cudaDeviceSynchronize")

    def stream_create(self) -> int:
        stream = ctypes.c_void_p()
        self.check(self._stream_create(ctypes.byref(stream), _CUDA_STREAM_NON_BLOCKING), "cudaStreamCreate")
        return int(stream.value or 0)

    def stream_synchronize(self, stream: int) -> None:
        self.check(self._stream_synchronize(stream), "cudaStreamSynchronize")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        code = self._memcpy_async(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream)
        self.check(code, f"cudaMemcpyAsync of {nbytes} bytes {src:#x} -> {dst:#x}")

    def memset_async(self, address: int, value: int, nbytes: int, stream: int) -> None:
        self.check(self._memset_async(address, value, nbytes, stream), f"cudaMemsetAsync at {address:#x}")

    def event_create(self) -> int:
        """An event of the current device, without timing."""
        event = ctypes.c_void_p()
        code = self._event_create(ctypes.byref(event), _CUDA_EVENT_DISABLE_TIMING)
        self.check(code, "cudaEventCreateWithFlags")
        return int(event.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        """Mark ``stream``: the event completes once everything queued on it before now ran."""
        self.check(self._event_record(event, stream), "cudaEventRecord")

    def event_synchronize(self, event: int) -> None:
        self.check(self._event_synchronize(event), "cudaEventSynchronize")

    def event_query(self, event: int) -> bool:
        """Whether the event completed, without waiting; a failure of the work before it raises."""
        code = self._event_query(event)
        if code == _CUDA_ERROR_NOT_READY:
            self._get_last_error()  # an answer, not an error; cleared all the same, as torch does
            return False
        self.check(code, "cudaEventQuery")
        return True

    def event_destroy(self, event: int) -> None:
        """Free the event (at once, or once its pending record ran); a failure is only cleared."""
        if self._event_destroy(event) != 0:
            self._get_last_error()

    def host_register(self, address: int, nbytes: int) -> bool:
        """Page-lock host memory; False (error cleared) where the system refuses."""
        if self._host_register(address, nbytes, 0) != 0:
            self._get_last_error()
            return False
        return True

    def host_unregister(self, address: int) -> None:
        if self._host_unregister(address) != 0:
            self._get_last_error()


# libcudart.so, libcudart.so.12, libcudart.so.12.4.127, and the names auditwheel gives the copies
# it vendors into a wheel, a hash before the suffix: libcudart-9335f6a2.so.12.
_CUDART_NAME = re.compile(r"libcudart(?:-[0-9a-f]+)?\.so(?:\.(?P<major>\d+)(?:\.\d+)*)?")


def choose_cudart(paths: Sequence[str], cuda_version: str | None, torch_dirs: Sequence[str]) -> str | None:
    """Which of the libraries mapped at ``paths`` is the CUDA runtime torch uses; None if none is one.

    A process may hold two: an extension can load its own beside torch's (another
    major version, or the system's copy of the same one), and a copy bound to the
    wrong one works on that runtime's state, not torch's. So the choice prefers a
    runtime of the major version torch was built for (``cuda_version``, from
    ``torch.version.cuda``), then one under torch's own directories or the NVIDIA
    wheels beside it (``torch_dirs``: where libtorch_cuda's RPATH points), then the
    first mapped.
    """
    found: list[tuple[str, str | None]] = []
    for path in paths:
        name = _CUDART_NAME.fullmatch(os.path.basename(path))
        if name is not None:
            found.append((path, name.group("major")))
    if not found:
        return None
    wanted_major = cuda_version.split(".")[0] if cuda_version else None
    roots = [os.path.join(d, "") for d in torch_dirs]

    def rank(entry: tuple[str, str | None]) -> tuple[bool, bool]:
        path, major = entry
        return (wanted_major is not None and major == wanted_major, path.startswith(tuple(roots)))

    return max(found, key=rank)[0]  # max keeps the first of equals: mapping order breaks ties


def loaded_cudart(mappings: Sequence[HostMapping]) -> str | None:
    """The CUDA runtime library mapped into this process that its torch uses (see choose_cudart)."""
    torch = sys.modules.get("torch")
    cuda_version = getattr(getattr(torch, "version", None), "cuda", None)
    torch_file = getattr(torch, "__file__", None)
    torch_dirs = []
    if torch_file:
        package = os.path.dirname(os.path.realpath(torch_file))
        torch_dirs = [package, os.path.join(os.path.dirname(package), "nvidia")]
    return choose_cudart([m.path for m in mappings], cuda_version, torch_dirs)


def loaded_driver() -> ctypes.CDLL | None:
    """The CUDA driver library (``libcuda.so.1``) the runtime already loaded here; None if it did not.

    RTLD_NOLOAD: a handle to the loaded one, never a load of its own.
    """
    try:
        return ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


class _Batch:
    """What one thread queued inside a :func:`deferred_copies` block, through any seam."""

    __slots__ = ("keep", "streams")

    def __init__(self) -> None:
        # The stream the thread holds for the block, per seam and device: held, not given back after
        # each copy, so the event recorded at the end follows this block's copies and nothing another
        # thread queued after them.
        self.streams: dict[tuple[CudaCopies, int], int] = {}
        self.keep: list[bytearray] = []  # copies of read-only sources, read when the copies run


_deferring = threading.local()  # .batch: the thread's open block, if any


def _open_batch() -> _Batch | None:
    batch: _Batch | None = getattr(_deferring, "batch", None)
    return batch


class CudaFence:
    """The copies and fills of one deferred block: an event recorded after them on each stream it held."""

    def __init__(self, marks: list[tuple[CudaCopies, int, int]], keep: list[bytearray]) -> None:
        self._marks = marks  # (seam, device, event)
        self._keep = keep
        self._lock = threading.Lock()

    def done(self) -> bool:
        """Whether all of it ran, without waiting."""
        with self._lock:
            return all(copies._rt.event_query(event) for copies, _, event in self._marks)

    def wait(self) -> None:
        """Block until all of it ran; a copy that failed when it ran raises DeviceMemoryError, once.

        The device reports a copy that faults when it runs at the next wait,
        without saying which copy: the error names the device and what was
        queued there.
        """
        failure: tuple[int, DeviceMemoryError] | None = None
        with self._lock:
            marks, self._marks = self._marks, []
            for copies, device, event in marks:
                try:
                    copies._rt.event_synchronize(event)
                except DeviceMemoryError as exc:
                    failure = failure or (device, exc)
                    copies._rt.event_destroy(event)  # after a fault its state is the context's guess
                else:
                    copies._give_event(device, event)
            self._keep.clear()
        if failure is not None:
            raise DeviceMemoryError(
                f"a copy or fill queued on device {failure[0]} failed when it ran (the device says so at "
                f"the next wait, not which one): {failure[1].message}"
            )


def _fence_of(batch: _Batch) -> CudaFence | None:
    """An event recorded on each stream ``batch`` held, the streams given back; None if it held none.

    A stream whose event cannot be recorded is waited for instead, so that
    nothing it queued is left running when the error goes up.
    """
    if not batch.streams:
        return None
    marks: list[tuple[CudaCopies, int, int]] = []
    failure: DeviceMemoryError | None = None
    for (copies, device), stream in batch.streams.items():
        try:
            marks.append((copies, device, copies._mark(device, stream)))
        except DeviceMemoryError as exc:
            failure = failure or exc
            with contextlib.suppress(DeviceMemoryError):
                copies._rt.stream_synchronize(stream)
        finally:
            copies._give_stream(device, stream)
    fence = CudaFence(marks, batch.keep)
    if failure is not None:
        with contextlib.suppress(DeviceMemoryError):
            fence.wait()
        raise failure
    return fence


@contextlib.contextmanager
def deferred_copies() -> Iterator[Queued]:
    """This thread's device copies and fills in the block, through any seam, only queued; when it ends,
    ``queued.fence`` covers them (the contract: pipeline.DeviceStaging).

    The thread's stream stays its own for the block, so its copies run in
    the order they were queued: a copy to the host after a copy to the device
    of the same bytes reads what that one wrote. Left by an exception, the
    block waits for what it queued first (a staging buffer is unmapped on the
    way out). Blocks do not nest: an inner block's fence would cover copies
    the outer's caller thinks are its own.
    """
    if _open_batch() is not None:
        raise RuntimeError("deferred device copies do not nest")
    batch = _Batch()
    _deferring.batch = batch
    queued = Queued()
    try:
        yield queued
    except BaseException:
        _deferring.batch = None
        with contextlib.suppress(DeviceMemoryError):
            fence = _fence_of(batch)
            if fence is not None:
                fence.wait()
        raise
    _deferring.batch = None
    queued.fence = _fence_of(batch)


class CudaCopies:
    """Device copies through the CUDA runtime, on non-blocking streams of our own (see DeviceCopies)."""

    def __init__(self, runtime: CudaRuntime) -> None:
        self._rt = runtime
        self._lock = threading.Lock()
        self._idle_streams: dict[int, list[int]] = {}
        self._idle_events: dict[int, list[int]] = {}

    @classmethod
    def from_process(cls) -> CudaCopies:
        """Over the CUDA runtime this process already loaded (torch's), through a handle of our own."""
        path = loaded_cudart(own_mappings())
        if path is None:
            raise UnsupportedError(
                "no CUDA runtime library (libcudart.so) is loaded in this process, so hibernate cannot copy "
                "its CUDA tensors; nothing was changed",
                hint="use a torch build that loads libcudart dynamically (the PyPI and conda builds do)",
            )
        return cls(CudaRuntime(ctypes.CDLL(path), loaded_driver()))

    # -- streams ---------------------------------------------------------------

    @contextlib.contextmanager
    def _on_device(self, device: int) -> Iterator[None]:
        """``device`` current on this thread for the block; the thread's own current device after it.

        Some calls run on the program's own thread (an in-process sleep or wake):
        torch takes that thread's current device as the one ``device='cuda'``
        means, so it is put back on every path, a failed call's included.
        Except onto a device without a primary context: cudaSetDevice would
        create one, hundreds of MiB on a GPU the process never used (a staging
        thread starts on device 0, in a vLLM worker of rank 1 too). torch's own
        device guard leaves such a device unset as well (c10::cuda::MaybeSetDevice).
        """
        previous = self._rt.get_device()
        if previous == device:
            yield
            return
        self._rt.set_device(device)
        try:
            yield
        finally:
            if self._rt.has_primary_context(previous):
                self._rt.set_device(previous)

    @contextlib.contextmanager
    def _stream(self, device: int) -> Iterator[tuple[int, _Batch | None]]:
        """A stream of ``device`` for this thread's next operation, ``device`` current meanwhile (see
        _on_device), and the thread's open deferral block if any (which then holds the stream).

        Streams are reused across operations and spills (a fresh pipeline starts
        fresh threads each time, so per-thread streams would leak): taken from
        the idle ones, given back after the operation or its block.
        """
        with self._on_device(device):
            batch = _open_batch()
            if batch is not None:
                stream = batch.streams.get((self, device))
                if stream is None:
                    stream = batch.streams[(self, device)] = self._take_stream(device)
                yield stream, batch
                return
            stream = self._take_stream(device)
            try:
                yield stream, None
            finally:
                self._give_stream(device, stream)

    def _take_stream(self, device: int) -> int:
        """An idle stream of ``device`` (the current device), or a new one."""
        with self._lock:
            idle = self._idle_streams.setdefault(device, [])
            stream = idle.pop() if idle else None
        return stream if stream is not None else self._rt.stream_create()

    def _give_stream(self, device: int, stream: int) -> None:
        with self._lock:
            self._idle_streams.setdefault(device, []).append(stream)

    def _mark(self, device: int, stream: int) -> int:
        """An event recorded on ``stream`` of ``device`` now (an idle one reused, else a new one)."""
        with self._on_device(device):
            with self._lock:
                idle = self._idle_events.setdefault(device, [])
                event = idle.pop() if idle else None
            if event is None:
                event = self._rt.event_create()
            try:
                self._rt.event_record(event, stream)
            except DeviceMemoryError:
                self._rt.event_destroy(event)
                raise
            return event

    def _give_event(self, device: int, event: int) -> None:
        """An event whose wait returned, for the next fence (events cost a driver call to make)."""
        with self._lock:
            self._idle_events.setdefault(device, []).append(event)

    # -- data ------------------------------------------------------------------

    def copy_to_host(self, device: int, address: int, dst: memoryview) -> None:
        if not len(dst):
            return
        with self._stream(device) as (stream, batch):
            self._rt.memcpy_async(buffer_address(dst), address, len(dst), stream)
            if batch is None:
                self._rt.stream_synchronize(stream)

    def copy_from_host(self, device: int, address: int, src: memoryview) -> None:
        if not len(src):
            return
        # A read-only view (a mapping) cannot give ctypes an address: copied, bounded by one chunk
        # (the store passes writable views), and kept until the copy ran.
        owned = bytearray(src) if src.readonly else None
        if owned is not None:
            src = memoryview(owned)
        with self._stream(device) as (stream, batch):
            self._rt.memcpy_async(address, buffer_address(src), len(src), stream)
            if batch is None:
                self._rt.stream_synchronize(stream)
            elif owned is not None:
                batch.keep.append(owned)

    def zero(self, device: int, address: int, nbytes: int) -> None:
        if not nbytes:
            return
        try:
            with self._stream(device) as (stream, _):
                self._rt.memset_async(address, 0, nbytes, stream)
        except DeviceMemoryError:
            # The caller releases the memory of a wake that failed: fills it queued before this one
            # must not run on memory handed to someone else.
            with contextlib.suppress(DeviceMemoryError):
                self.synchronize(device)
            raise

    def synchronize(self, device: int) -> None:
        """cudaDeviceSynchronize on ``device``: every stream of it, the program's side streams too.

        Runs on the caller's thread (the program's own, for an in-process sleep).
        """
        with self._on_device(device):
            self._rt.device_synchronize()

    def pinner(self) -> PinFn | None:
        """Page-locking for the staging buffers, with the store's copies deferred (pipeline.DeviceStaging)."""
        runtime = self._rt

        def pin(view: memoryview) -> Callable[[], None] | None:
            address = buffer_address(view)
            if not runtime.host_register(address, len(view)):
                return None  # pageable staging still works, only slower
            return lambda: runtime.host_unregister(address)

        return DeviceStaging(pin, deferred_copies)


class CudaDeviceMemory(CudaCopies):
    """GPU memory: vLLM's map/unmap, the CUDA runtime for copies on streams of our own."""

    def __init__(
        self,
        runtime: CudaRuntime,
        create_and_map: Callable[[Handle], None],
        unmap_and_release: Callable[[Handle], None],
    ) -> None:
        super().__init__(runtime)
        self._create_and_map = create_and_map
        self._unmap_and_release = unmap_and_release

    @classmethod
    def from_vllm(cls) -> CudaDeviceMemory:
        """The seam of a vLLM worker, over vLLM's cumem extension and its libcudart."""
        try:
            cumem = importlib.import_module("vllm.device_allocator.cumem")
        except ImportError as exc:
            raise UnsupportedError(f"vLLM's cumem allocator cannot be imported here: {exc}") from exc
        if not getattr(cumem, "cumem_available", False):
            raise UnsupportedError("vLLM's cumem allocator is not available on this platform")
        lib = cumem.libcudart.lib
        runtime = CudaRuntime(ctypes.CDLL(lib._name), loaded_driver())
        return cls(runtime, cumem.create_and_map, cumem.unmap_and_release)

    def map(self, handle: Handle) -> None:
        self._create_and_map(handle)

    def unmap(self, handle: Handle) -> None:
        self._unmap_and_release(handle)

    def empty_cache(self) -> None:
        """What vLLM's own sleep does after releasing: collect, then empty torch's cache."""
        gc.collect()
        if torch_cuda_in_use():
            sys.modules["torch"].cuda.empty_cache()
