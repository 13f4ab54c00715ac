"""The CUDA driver's checkpoint API, called through ctypes on ``libcuda.so.1``.

Preferred over the ``cuda-checkpoint`` binary for the exact CUresult of every
failure, and for lock, unlock and the queries, made in this process without
starting one. Checkpoint and restore are not (below): each starts a helper
process, 12-15 ms a call on a 2-core machine with the stand-in driver
(``scripts/bench-detached``), and the restore's helper calls ``cuInit(0)``
itself: one driver initialization per restore, not measured on a GPU node
(NVIDIA Dynamo measured restore+unlock at 8.57 s from the CLI, a process per
step, against 1.32 s from a persistent caller). The entry points
exist from CUDA 12.8 (driver 570); the GPU remapping on restore from 13.0
(driver 580). Calling them creates no CUDA context in this process, so it
takes no GPU memory; ``cuInit(0)`` (needed before a restore unless persistence
mode is on) does not either.

Checkpoint and restore are never called from this process: each runs in a
small program of its own session (:mod:`hibernate.checkpoint.driver_call`,
ctypes and libcuda only), so that neither a timeout, a Ctrl-C nor this
process's death cuts one half-way (:mod:`hibernate.checkpoint.detached`).
Lock is bounded by the driver itself (``timeoutMs``); unlock and the queries
run in a thread under a timeout, abandoned with the command if they never
answer: they move no memory, and a retry reads the state first.

``HIBERNATE_LIBCUDA`` names another library to load: the documented seam the
tests use to load a stand-in built from C.
"""

from __future__ import annotations

import ctypes
import os
import sys
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from hibernate.checkpoint import curesult, driver_call
from hibernate.checkpoint.base import (
    STATE_BY_NUMBER,
    CheckpointStepError,
    CudaState,
    DetachedCall,
    StepTimeouts,
    cuda_version_text,
)
from hibernate.checkpoint.curesult import CuError
from hibernate.checkpoint.detached import CALL_PROGRAM, Detached, Strays, helper_environment, still_running
from hibernate.checkpoint.driver_call import LockArgs, UnlockArgs
from hibernate.errors import UnsupportedError, UsageError
from hibernate.threads import Call, CallTimedOutError, call_with_timeout

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


def uuid_bytes(gpu_uuid: str) -> bytes:
    """``GPU-1a2b...`` (as NVML and nvidia-smi print it) -> the 16 bytes of a CUuuid."""
    text = gpu_uuid.strip()
    if text.upper().startswith(("GPU-", "MIG-")):
        text = text[4:]
    try:
        return uuid.UUID(text).bytes
    except ValueError:
        raise UsageError(f"not a GPU UUID: {gpu_uuid!r}", hint="use the form GPU-xxxxxxxx-xxxx-...") from None


def gpu_pairs(gpu_map: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The (old, new) CUuuid pairs of a {old uuid: new uuid} map."""
    return [(uuid_bytes(old), uuid_bytes(new)) for old, new in gpu_map.items()]


def library_path() -> str:
    return os.environ.get(LIBCUDA_ENV) or DEFAULT_LIBCUDA


class DriverUnavailableError(UnsupportedError):
    """libcuda cannot be loaded here, or it has no checkpoint API."""


DriverUnavailable = DriverUnavailableError  # the former name, for code that catches it


class DriverCheckpointer:
    """cuCheckpointProcess* on one loaded libcuda."""

    name = "driver"

    def __init__(self, path: str | None = None, timeouts: StepTimeouts | None = None) -> None:
        self.path = path or library_path()
        self.timeouts = timeouts or StepTimeouts()
        try:
            self._lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise DriverUnavailableError(
                f"cannot load {self.path}: {exc}",
                hint="install the NVIDIA driver (>= 570 for the checkpoint API)",
            ) from None
        self.version = self._driver_version()
        missing = [s for s in REQUIRED_SYMBOLS if not hasattr(self._lib, s)]
        if missing:
            raise DriverUnavailableError(
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
        self.on_detach: Callable[[DetachedCall], None] | None = None
        # Per pid, a call whose wait gave up (a timeout, or an interrupt) and may still be running (a
        # thread here, or a detached process): the next call for that pid waits for it (bounded).
        self._strays = Strays()

    def _driver_version(self) -> int:
        if not hasattr(self._lib, "cuDriverGetVersion"):
            raise DriverUnavailableError(f"{self.path} has no cuDriverGetVersion: not a CUDA driver library")
        version = ctypes.c_int(0)
        result = self._lib.cuDriverGetVersion(ctypes.byref(version))
        if result != 0:
            raise DriverUnavailableError(f"cuDriverGetVersion failed: {self._error(result)}")
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
        return self._strays.waits()

    def _result_text(self, result: int) -> str:
        return "CUDA_SUCCESS" if result == 0 else str(self._error(result).name)

    def _call(
        self, step: str, pid: int, function_name: str, func: Callable[[], int], timeout: float | None
    ) -> None:
        """``func()`` in a thread of this process, abandoned after ``timeout`` (lock, unlock, queries)."""
        self._strays.settle(pid, step, function_name, self.timeouts.query)
        try:
            result = call_with_timeout(func, timeout, f"{function_name}({pid})")
        except CallTimedOutError as late:
            call: Call[int] = late.call

            def outcome() -> str:
                if call.outcome.error is not None:
                    return f"it raised {type(call.outcome.error).__name__}"
                return self._result_text(int(call.outcome.value or 0))

            self._strays.add(pid, call.name, call.wait, outcome)
            raise CheckpointStepError(
                pid,
                step,
                CuError(None, "no answer", f"{function_name} did not return within {timeout:g}s"),
                how=function_name,
                timed_out=True,
            ) from None
        if result != 0:
            raise CheckpointStepError(pid, step, self._error(result), how=function_name)

    def _call_detached(self, step: str, pid: int, extra: list[str], timeout: float) -> None:
        """Checkpoint or restore ``pid`` from a program of its own session: waited for, never cut."""
        function_name = SYMBOL_BY_STEP[step]
        self._strays.settle(pid, step, function_name, self.timeouts.query)
        argv = [sys.executable, "-I", "-S", str(CALL_PROGRAM), self.path, step, str(pid), *extra]
        helper = Detached(
            argv,
            pid=pid,
            step=step,
            what=function_name,
            gated=True,
            env=helper_environment(pid),
            on_start=self.on_detach,
        )

        def outcome() -> str:
            _, error = self._answer(helper, function_name)
            return "CUDA_SUCCESS" if error is None else str(error.name)

        self._strays.add(pid, helper.name, helper.wait, outcome)
        if not helper.wait(timeout):
            raise still_running(helper.call, timeout, function_name)
        self._strays.discard(pid, helper.name)
        how, error = self._answer(helper, function_name)
        if error is not None:
            raise CheckpointStepError(pid, step, error, how=how)

    def _answer(self, helper: Detached, function_name: str) -> tuple[str, CuError | None]:
        """What the exited helper called last and its error (None: CUDA_SUCCESS)."""
        stdout, stderr = helper.output()
        words = stdout.split()
        if len(words) == 2 and words[1].lstrip("-").isdigit():
            how = "cuInit" if words[0] == "init" else function_name
            result = int(words[1])
            return how, None if result == 0 else self._error(result)
        said = stderr.strip().splitlines()[-1:] or ["nothing"]
        return function_name, CuError(
            None, "no answer", f"its helper exited with status {helper.returncode} ({said[0]})"
        )

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
        self._call_detached("checkpoint", pid, [], self.timeouts.checkpoint)

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        extra: list[str] = []
        if gpu_map:
            if not self.supports_gpu_map:
                raise UnsupportedError(
                    f"restoring onto other GPUs needs CUDA 13.0 (driver 580); this driver is "
                    f"CUDA {cuda_version_text(self.version)}",
                    hint="restore onto the same GPUs, or upgrade the driver",
                )
            extra = driver_call.pair_arguments(gpu_pairs(gpu_map))
        self._call_detached("restore", pid, extra, self.timeouts.restore)

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
