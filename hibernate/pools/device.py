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
  own, one per staging thread at a time, so they neither wait for nor hold up
  the legacy default stream, and several chunks are in flight at once.

Nothing here imports torch or vLLM at module level: the CLI imports pools, and
``vllm.device_allocator.cumem`` raises ImportError on a machine without a driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from hibernate.errors import HibernateError, UnsupportedError
from hibernate.pools.hostpages import HostMapping, own_mappings
from hibernate.store.pipeline import PinFn

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


class DeviceMemoryError(HibernateError):
    """A device call failed (the CUDA runtime's own words are in the message)."""


class DeviceCopies(Protocol):
    """Copies between device memory and the host, on streams of the seam's own; all a torch storage needs."""

    def copy_to_host(self, device: int, address: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes at device ``address`` into ``dst``; done when it returns."""
        ...

    def copy_from_host(self, device: int, address: int, src: memoryview) -> None:
        """Copy ``src`` to device ``address``; done when it returns."""
        ...

    def zero(self, device: int, address: int, nbytes: int) -> None: ...

    def synchronize(self, device: int) -> None:
        """Wait for all work queued on ``device``, on every stream (before its memory is read or unmapped)."""
        ...

    def pinner(self) -> PinFn | None:
        """Page-locks staging buffers so device copies into them run at full speed."""
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


def buffer_address(view: memoryview) -> int:
    """The address of a writable buffer's first byte."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


_CUDA_MEMCPY_DEFAULT = 4  # direction inferred from the pointers (unified addressing)
_CUDA_STREAM_NON_BLOCKING = 1


class CudaRuntime:
    """The handful of CUDA runtime calls the pool needs, bound with ctypes.

    Bound to the ``libcudart`` that vLLM already loaded in this process, through
    a handle of our own so that vLLM's function prototypes are never touched.
    ctypes releases the GIL during each call, so staging threads overlap.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
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
        self._host_register = self._bind(lib, "cudaHostRegister", c_int, [c_void_p, c_size_t, c_uint])
        self._host_unregister = self._bind(lib, "cudaHostUnregister", c_int, [c_void_p])

    @staticmethod
    def _bind(lib: ctypes.CDLL, name: str, restype: Any, argtypes: list[Any]) -> Any:
        function = getattr(lib, name)
        function.restype = restype
        function.argtypes = argtypes
        return function

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raw = self._error_string(code)
            words = raw.decode("utf-8", "replace") if raw else "unknown error"
            raise DeviceMemoryError(f"{what} failed with CUDA error {code}: {words}")

    def set_device(self, device: int) -> None:
        self.check(self._set_device(device), f"cudaSetDevice({device})")

    def get_device(self) -> int:
        device = ctypes.c_int()
        self.check(self._get_device(ctypes.byref(device)), "cudaGetDevice")
        return device.value

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

    def host_register(self, address: int, nbytes: int) -> bool:
        """Page-lock host memory; False (error cleared) where the system refuses."""
        if self._host_register(address, nbytes, 0) != 0:
            self._get_last_error()
            return False
        return True

    def host_unregister(self, address: int) -> None:
        if self._host_unregister(address) != 0:
            self._get_last_error()


def loaded_cudart(mappings: Sequence[HostMapping]) -> str | None:
    """The path of the CUDA runtime library mapped into a process (torch's, in a CUDA build)."""
    return next((m.path for m in mappings if os.path.basename(m.path).startswith("libcudart.so")), None)


class CudaCopies:
    """Device copies through the CUDA runtime, on non-blocking streams of our own (see DeviceCopies)."""

    def __init__(self, runtime: CudaRuntime) -> None:
        self._rt = runtime
        self._lock = threading.Lock()
        self._idle_streams: dict[int, list[int]] = {}

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
        return cls(CudaRuntime(ctypes.CDLL(path)))

    # -- streams ---------------------------------------------------------------

    @contextlib.contextmanager
    def _stream(self, device: int) -> Iterator[int]:
        """A stream of ``device`` for this thread's next operation, current device set.

        Streams are reused across operations and spills (a fresh pipeline starts
        fresh threads each time, so per-thread streams would leak).
        """
        self._rt.set_device(device)
        with self._lock:
            idle = self._idle_streams.setdefault(device, [])
            stream = idle.pop() if idle else None
        if stream is None:
            stream = self._rt.stream_create()
        try:
            yield stream
        finally:
            with self._lock:
                self._idle_streams[device].append(stream)

    # -- data ------------------------------------------------------------------

    def copy_to_host(self, device: int, address: int, dst: memoryview) -> None:
        if not len(dst):
            return
        with self._stream(device) as stream:
            self._rt.memcpy_async(buffer_address(dst), address, len(dst), stream)
            self._rt.stream_synchronize(stream)

    def copy_from_host(self, device: int, address: int, src: memoryview) -> None:
        if not len(src):
            return
        if src.readonly:
            src = memoryview(bytearray(src))  # bounded by one chunk; the store passes writable views
        with self._stream(device) as stream:
            self._rt.memcpy_async(address, buffer_address(src), len(src), stream)
            self._rt.stream_synchronize(stream)

    def zero(self, device: int, address: int, nbytes: int) -> None:
        if not nbytes:
            return
        with self._stream(device) as stream:
            self._rt.memset_async(address, 0, nbytes, stream)
            self._rt.stream_synchronize(stream)

    def synchronize(self, device: int) -> None:
        """cudaDeviceSynchronize on ``device``: every stream of it, the program's side streams too.

        Runs on the caller's thread (the program's own, for an in-process sleep), so
        that thread's current device is put back: torch reads it as its current device.
        """
        current = self._rt.get_device()
        self._rt.set_device(device)
        try:
            self._rt.device_synchronize()
        finally:
            self._rt.set_device(current)

    def pinner(self) -> PinFn | None:
        runtime = self._rt

        def pin(view: memoryview) -> Callable[[], None]:
            address = buffer_address(view)
            if not runtime.host_register(address, len(view)):
                return lambda: None  # pageable staging still works, only slower
            return lambda: runtime.host_unregister(address)

        return pin


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
        return cls(CudaRuntime(ctypes.CDLL(lib._name)), cumem.create_and_map, cumem.unmap_and_release)

    def map(self, handle: Handle) -> None:
        self._create_and_map(handle)

    def unmap(self, handle: Handle) -> None:
        self._unmap_and_release(handle)

    def empty_cache(self) -> None:
        """What vLLM's own sleep does after releasing: collect, then empty torch's cache."""
        gc.collect()
        if torch_cuda_in_use():
            sys.modules["torch"].cuda.empty_cache()
