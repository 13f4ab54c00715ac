"""What the GPUs hold and can hold: NVML through ctypes, optional.

hibernate asks NVML (the library behind nvidia-smi, part of every driver) for
each GPU's UUID, free memory, persistence and MIG mode, and for how much each
process holds. It matters most before a restore: a restore that runs out of
GPU memory leaves the process checkpointed and the driver refuses every later
restore of it (NVIDIA/cuda-checkpoint#44), so free memory is checked first.

No Python binding is needed (nvidia-ml-py may be absent); the library is
loaded only when asked, and its absence is an answer (``None``), not an error.
``HIBERNATE_LIBNVML`` names another library to load (the tests' stand-in).
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass, field
from typing import Any

LIBNVML_ENV = "HIBERNATE_LIBNVML"
DEFAULT_LIBNVML = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_INSUFFICIENT_SIZE = 7
NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE for usedGpuMemory


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_t as filled by nvmlDeviceGetComputeRunningProcesses_v2/_v3.
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


@dataclass
class Gpu:
    index: int
    uuid: str
    name: str
    total: int
    free: int
    used: int
    persistence: bool | None
    mig: bool | None
    minor: int | None
    processes: dict[int, int] = field(default_factory=dict)  # pid -> bytes (None-able values dropped)

    def to_wire(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "total_bytes": self.total,
            "free_bytes": self.free,
            "used_bytes": self.used,
            "persistence_mode": self.persistence,
            "mig_mode": self.mig,
            "minor": self.minor,
            "processes": {str(pid): n for pid, n in self.processes.items()},
        }


@dataclass
class DeviceReading:
    """One reading of every GPU."""

    driver_version: str | None
    gpus: list[Gpu]

    def usage_of(self, pid: int) -> dict[str, int]:
        """GPU UUID -> bytes ``pid`` holds there (GPUs where it holds nothing are left out)."""
        return {gpu.uuid: gpu.processes[pid] for gpu in self.gpus if pid in gpu.processes}


_lock = threading.Lock()


def library_path() -> str:
    return os.environ.get(LIBNVML_ENV) or DEFAULT_LIBNVML


def _load() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(library_path())
    except OSError:
        return None


def _text(lib: ctypes.CDLL, symbol: str, *args: Any, size: int = 96) -> str | None:
    if not hasattr(lib, symbol):
        return None
    buffer = ctypes.create_string_buffer(size)
    if getattr(lib, symbol)(*args, buffer, ctypes.c_uint(size)) != NVML_SUCCESS:
        return None
    return buffer.value.decode("utf-8", "replace")


def _uint(lib: ctypes.CDLL, symbol: str, handle: ctypes.c_void_p) -> int | None:
    if not hasattr(lib, symbol):
        return None
    value = ctypes.c_uint(0)
    if getattr(lib, symbol)(handle, ctypes.byref(value)) != NVML_SUCCESS:
        return None
    return value.value


def _mig(lib: ctypes.CDLL, handle: ctypes.c_void_p) -> bool | None:
    if not hasattr(lib, "nvmlDeviceGetMigMode"):
        return None
    current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
    result = lib.nvmlDeviceGetMigMode(handle, ctypes.byref(current), ctypes.byref(pending))
    if result == NVML_ERROR_NOT_SUPPORTED:
        return False  # a GPU without MIG
    return bool(current.value) if result == NVML_SUCCESS else None


def _processes(lib: ctypes.CDLL, handle: ctypes.c_void_p) -> dict[int, int]:
    symbol = next(
        (
            s
            for s in ("nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetComputeRunningProcesses_v2")
            if hasattr(lib, s)
        ),
        None,
    )
    if symbol is None:
        return {}
    function = getattr(lib, symbol)
    count = ctypes.c_uint(0)
    infos = (_ProcessInfo * 1)()
    result = function(handle, ctypes.byref(count), infos)
    for _ in range(3):  # the list may grow between the two calls
        if result != NVML_ERROR_INSUFFICIENT_SIZE:
            break
        count = ctypes.c_uint(count.value + 8)
        infos = (_ProcessInfo * count.value)()
        result = function(handle, ctypes.byref(count), infos)
    if result != NVML_SUCCESS:
        return {}
    return {
        int(infos[i].pid): int(infos[i].usedGpuMemory)
        for i in range(count.value)
        if infos[i].usedGpuMemory != NOT_AVAILABLE
    }


def read_gpus() -> DeviceReading | None:
    """Every GPU's state now, or None when NVML is not there or does not start."""
    with _lock:
        lib = _load()
        if lib is None:
            return None
        init = getattr(lib, "nvmlInit_v2", None) or getattr(lib, "nvmlInit", None)
        if init is None or init() != NVML_SUCCESS:
            return None
        try:
            driver = _text(lib, "nvmlSystemGetDriverVersion", size=80)
            count = ctypes.c_uint(0)
            get_count = getattr(lib, "nvmlDeviceGetCount_v2", None) or lib.nvmlDeviceGetCount
            if get_count(ctypes.byref(count)) != NVML_SUCCESS:
                return DeviceReading(driver, [])
            get_handle = getattr(lib, "nvmlDeviceGetHandleByIndex_v2", None) or lib.nvmlDeviceGetHandleByIndex
            gpus = []
            for index in range(count.value):
                handle = ctypes.c_void_p()
                if get_handle(ctypes.c_uint(index), ctypes.byref(handle)) != NVML_SUCCESS:
                    continue
                memory = _Memory()
                if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != NVML_SUCCESS:
                    continue
                persistence = _uint(lib, "nvmlDeviceGetPersistenceMode", handle)
                gpus.append(
                    Gpu(
                        index=index,
                        uuid=_text(lib, "nvmlDeviceGetUUID", handle) or f"GPU-index-{index}",
                        name=_text(lib, "nvmlDeviceGetName", handle) or "unknown",
                        total=int(memory.total),
                        free=int(memory.free),
                        used=int(memory.used),
                        persistence=None if persistence is None else bool(persistence),
                        mig=_mig(lib, handle),
                        minor=_uint(lib, "nvmlDeviceGetMinorNumber", handle),
                        processes=_processes(lib, handle),
                    )
                )
            return DeviceReading(driver, gpus)
        finally:
            if hasattr(lib, "nvmlShutdown"):
                lib.nvmlShutdown()


def given_back(
    before: DeviceReading, after: DeviceReading, pids: list[int], tracked: dict[str, int] | None
) -> list[dict[str, Any]]:
    """Per GPU, what a sleep really gave back: ``used`` before and after, beside the bytes it tracked.

    ``pids`` are the target's processes: each one NVML lists on a GPU (before or
    after) is shown with its own bytes; inside a container NVML often lists
    none, and the GPU's ``used`` is then the only witness. ``tracked``: GPU
    UUID -> bytes of the pools released there (None where they could not be
    placed on a GPU).
    """
    later = {gpu.uuid: gpu for gpu in after.gpus}
    out = []
    for gpu in before.gpus:
        now = later.get(gpu.uuid)
        if now is None:
            continue
        shown = [pid for pid in pids if pid in gpu.processes or pid in now.processes]
        out.append(
            {
                "index": gpu.index,
                "uuid": gpu.uuid,
                "name": gpu.name,
                "used_before_bytes": gpu.used,
                "used_after_bytes": now.used,
                "given_back_bytes": gpu.used - now.used,
                "tracked_bytes": None if tracked is None else tracked.get(gpu.uuid, 0),
                "processes": [
                    {
                        "pid": pid,
                        "before_bytes": gpu.processes.get(pid),
                        "after_bytes": now.processes.get(pid),
                    }
                    for pid in shown
                ],
            }
        )
    return out
