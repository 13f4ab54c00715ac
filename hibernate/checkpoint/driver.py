"""The CUDA driver's checkpoint API, called in-process through ctypes on ``libcuda.so.1``.

Preferred over the ``cuda-checkpoint`` binary: no process start-up per step
(NVIDIA Dynamo measured restore+unlock 8.57 s with the CLI, 1.32 s with a
persistent caller) and the exact CUresult of every failure. The entry points
exist from CUDA 12.8 (driver 570); the GPU remapping on restore from 13.0
(driver 580). Calling them creates no CUDA context in this process, so it
takes no GPU memory; ``cuInit(0)`` (needed before a restore unless persistence
mode is on) does not either.

``HIBERNATE_LIBCUDA`` names another library to load: the documented seam the
tests use to load a stand-in built from C.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from hibernate.checkpoint import curesult
from hibernate.checkpoint.base import (
    STATE_BY_NUMBER,
    CheckpointStepError,
    CudaState,
    StepTimeouts,
    cuda_version_text,
)
from hibernate.checkpoint.curesult import CuError
from hibernate.errors import UnsupportedError, UsageError
from hibernate.threads import Call, CallTimedOut, call_with_timeout

LIBCUDA_ENV = "HIBERNATE_LIBCUDA"
DEFAULT_LIBCUDA = "libcuda.so.1"
GPU_MAP_MIN_VERSION = 13000  # CUcheckpointRestoreArgs.gpuPairs from 13.0 (driver 580)
# step -> the entry point that does it, each called as f(pid, &argument).
SYMBOL_BY_STEP = {
    "lock": "cuCheckpointProcessLock",
    "checkpoint": "cuCheckpointProcessCheckpoint",
    "restore": "cuCheckpointProcessRestore",
    "unlock": "cuCheckpointProcessUnlock",
    "state": "cuCheckpointProcessGetState",
    "restore-tid": "cuCheckpointProcessGetRestoreThreadId",
}
REQUIRED_SYMBOLS = tuple(SYMBOL_BY_STEP.values())


# The argument structs: 64 bytes each, all zero means default behaviour in every version.
class LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),  # 0 = no timeout
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class RestoreArgs(ctypes.Structure):
    # 13.0+: gpuPairs/gpuPairsCount; 13.4 puts customStorageInfo_out at offset 16 (left NULL).
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("padding0", ctypes.c_uint),
        ("reserved", ctypes.c_uint64 * 6),
    ]


class UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


for _struct in (LockArgs, CheckpointArgs, RestoreArgs, UnlockArgs):
    assert ctypes.sizeof(_struct) == 64, _struct
assert ctypes.sizeof(GpuPair) == 32


def uuid_bytes(gpu_uuid: str) -> bytes:
    """``GPU-1a2b...`` (as NVML and nvidia-smi print it) -> the 16 bytes of a CUuuid."""
    text = gpu_uuid.strip()
    if text.upper().startswith(("GPU-", "MIG-")):
        text = text[4:]
    try:
        return uuid.UUID(text).bytes
    except ValueError:
        raise UsageError(f"not a GPU UUID: {gpu_uuid!r}", hint="use the form GPU-xxxxxxxx-xxxx-...") from None


def gpu_pairs(gpu_map: Mapping[str, str]) -> ctypes.Array[GpuPair]:
    """The CUcheckpointGpuPair array for a {old uuid: new uuid} map."""
    pairs = (GpuPair * len(gpu_map))()
    for index, (old, new) in enumerate(gpu_map.items()):
        ctypes.memmove(pairs[index].oldUuid, uuid_bytes(old), 16)
        ctypes.memmove(pairs[index].newUuid, uuid_bytes(new), 16)
    return pairs


def library_path() -> str:
    return os.environ.get(LIBCUDA_ENV) or DEFAULT_LIBCUDA


class DriverUnavailable(UnsupportedError):
    """libcuda cannot be loaded here, or it has no checkpoint API."""


class DriverCheckpointer:
    """cuCheckpointProcess* on one loaded libcuda."""

    name = "driver"

    def __init__(self, path: str | None = None, timeouts: StepTimeouts | None = None) -> None:
        self.path = path or library_path()
        self.timeouts = timeouts or StepTimeouts()
        try:
            self._lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise DriverUnavailable(
                f"cannot load {self.path}: {exc}",
                hint="install the NVIDIA driver (>= 570 for the checkpoint API)",
            ) from None
        self.version = self._driver_version()
        missing = [s for s in REQUIRED_SYMBOLS if not hasattr(self._lib, s)]
        if missing:
            raise DriverUnavailable(
                f"{self.path} (CUDA {cuda_version_text(self.version)}) has no {missing[0]}: "
                "the checkpoint driver API needs CUDA 12.8, driver 570 or newer",
                hint="upgrade the NVIDIA driver, or use --checkpointer binary with cuda-checkpoint",
            )
        for symbol in REQUIRED_SYMBOLS:
            function = getattr(self._lib, symbol)
            function.restype = ctypes.c_int
            function.argtypes = [ctypes.c_int, ctypes.c_void_p]
        for symbol in ("cuGetErrorName", "cuGetErrorString"):
            if hasattr(self._lib, symbol):
                function = getattr(self._lib, symbol)
                function.restype = ctypes.c_int
                function.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        self._init_lock = threading.Lock()
        self._initialized = False
        # Per pid, a call that timed out and may still be running in its thread: the next call for that
        # pid waits for it (bounded) instead of overlapping it; what was waited for is said in _waits.
        self._strays: dict[int, Call[int]] = {}
        self._strays_lock = threading.Lock()
        self._waits: list[str] = []

    def _driver_version(self) -> int:
        if not hasattr(self._lib, "cuDriverGetVersion"):
            raise DriverUnavailable(f"{self.path} has no cuDriverGetVersion: not a CUDA driver library")
        version = ctypes.c_int(0)
        result = self._lib.cuDriverGetVersion(ctypes.byref(version))
        if result != 0:
            raise DriverUnavailable(f"cuDriverGetVersion failed: {self._error(result)}")
        return version.value

    @property
    def supports_gpu_map(self) -> bool:
        return self.version >= GPU_MAP_MIN_VERSION

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "cuda_version": cuda_version_text(self.version),
            "gpu_map": self.supports_gpu_map,
        }

    # -- errors --------------------------------------------------------------

    def _error(self, result: int) -> CuError:
        """The driver's own name and string for ``result`` (the table's when it has none)."""
        name = self._error_text("cuGetErrorName", result)
        text = self._error_text("cuGetErrorString", result)
        return curesult.from_code(result, name, text)

    def _error_text(self, symbol: str, result: int) -> str | None:
        if not hasattr(self._lib, symbol):
            return None
        text = ctypes.c_char_p()
        if getattr(self._lib, symbol)(result, ctypes.byref(text)) != 0 or not text.value:
            return None
        return text.value.decode("utf-8", "replace")

    def _call_step(self, step: str, pid: int, argument: Any, timeout: float | None) -> None:
        """``SYMBOL_BY_STEP[step](pid, &argument)`` under ``timeout``."""
        name = SYMBOL_BY_STEP[step]
        function = getattr(self._lib, name)
        self._call(step, pid, name, lambda: int(function(pid, ctypes.byref(argument))), timeout)

    def waits(self) -> list[str]:
        """The calls that waited for an earlier, timed-out call for the same process, since last asked."""
        with self._strays_lock:
            waits, self._waits = self._waits, []
        return waits

    def _outcome_text(self, call: Call[int]) -> str:
        if call.outcome.error is not None:
            return f"it raised {type(call.outcome.error).__name__}"
        result = int(call.outcome.value or 0)
        return "CUDA_SUCCESS" if result == 0 else str(self._error(result).name)

    def _after_strays(self, step: str, pid: int, function_name: str) -> None:
        """Wait (at most the query timeout) for a timed-out call for ``pid`` still running: never overlap."""
        with self._strays_lock:
            stray = self._strays.get(pid)
        if stray is None:
            return
        started = time.perf_counter()
        if not stray.wait(self.timeouts.query):
            raise CheckpointStepError(
                pid,
                step,
                CuError(
                    None,
                    "not called",
                    f"{stray.name}, which had timed out, was still running {self.timeouts.query:g}s later; "
                    f"{function_name}({pid}) was not called over it",
                ),
                how=function_name,
                timed_out=True,
            )
        waited = time.perf_counter() - started
        with self._strays_lock:
            if self._strays.get(pid) is stray:
                del self._strays[pid]
            self._waits.append(
                f"{function_name}({pid}) waited {waited:.1f}s for {stray.name}, which had timed out, "
                f"to return ({self._outcome_text(stray)})"
            )

    def _call(
        self, step: str, pid: int, function_name: str, func: Callable[[], int], timeout: float | None
    ) -> None:
        self._after_strays(step, pid, function_name)
        try:
            result = call_with_timeout(func, timeout, f"{function_name}({pid})")
        except CallTimedOut as late:
            with self._strays_lock:
                self._strays[pid] = late.call
            raise CheckpointStepError(
                pid,
                step,
                CuError(None, "no answer", f"{function_name} did not return within {timeout:g}s"),
                how=function_name,
                timed_out=True,
            ) from None
        if result != 0:
            raise CheckpointStepError(pid, step, self._error(result), how=function_name)

    # -- the API -------------------------------------------------------------

    def state(self, pid: int) -> CudaState:
        value = ctypes.c_int(-1)
        self._call_step("state", pid, value, self.timeouts.query)
        state = STATE_BY_NUMBER.get(value.value)
        if state is None:
            raise CheckpointStepError(
                pid,
                "state",
                CuError(None, "unknown CUprocessState", f"the driver answered {value.value}"),
                how="cuCheckpointProcessGetState",
            )
        return state

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = LockArgs(timeoutMs=max(0, int(timeout_ms)))
        grace = timeout_ms / 1000 + self.timeouts.query if timeout_ms else None
        self._call_step("lock", pid, args, grace)

    def checkpoint(self, pid: int) -> None:
        self._call_step("checkpoint", pid, CheckpointArgs(), self.timeouts.checkpoint)

    def _ensure_init(self, pid: int) -> None:
        """cuInit(0) once: a restore needs it in the caller unless persistence mode is on."""
        with self._init_lock:
            if self._initialized:
                return
            self._call("init", pid, "cuInit", lambda: int(self._lib.cuInit(0)), self.timeouts.query)
            self._initialized = True

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        self._ensure_init(pid)
        args = RestoreArgs()
        pairs = None
        if gpu_map:
            if not self.supports_gpu_map:
                raise UnsupportedError(
                    f"restoring onto other GPUs needs CUDA 13.0 (driver 580); this driver is "
                    f"CUDA {cuda_version_text(self.version)}",
                    hint="restore onto the same GPUs, or upgrade the driver",
                )
            pairs = gpu_pairs(gpu_map)
            args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(GpuPair))
            args.gpuPairsCount = len(gpu_map)
        self._call_step("restore", pid, args, self.timeouts.restore)
        del pairs  # kept alive through the call

    def unlock(self, pid: int) -> None:
        self._call_step("unlock", pid, UnlockArgs(), self.timeouts.unlock)

    def restore_thread_id(self, pid: int) -> int:
        tid = ctypes.c_int(0)
        self._call_step("restore-tid", pid, tid, self.timeouts.query)
        return tid.value


def probe() -> dict[str, Any]:
    """What the driver library here offers, without raising (for ``hibernate doctor``)."""
    path = library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return {"path": path, "loaded": False, "error": str(exc)}
    version = ctypes.c_int(0)
    ok = hasattr(lib, "cuDriverGetVersion") and lib.cuDriverGetVersion(ctypes.byref(version)) == 0
    return {
        "path": path,
        "loaded": True,
        "cuda_version": cuda_version_text(version.value) if ok else None,
        "version": version.value if ok else None,
        "checkpoint_api": all(hasattr(lib, s) for s in REQUIRED_SYMBOLS),
        "gpu_map": ok and version.value >= GPU_MAP_MIN_VERSION,
    }
