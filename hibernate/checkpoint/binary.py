"""The ``cuda-checkpoint`` executable, run once per step.

The binary is a ~6 KB stub: its help text, its states and its flags all come
from the installed driver, so capabilities are probed from ``--help`` rather
than assumed from a version. Its contract, as observed on drivers 550-580:

- ``--get-state --pid P`` prints one word (``running``, ``locked``,
  ``checkpointed``, ``failed``); ``--get-restore-tid --pid P`` prints a number.
- ``--action lock|checkpoint|restore|unlock --pid P`` (R555+), lock taking
  ``--timeout MS``; R580 adds ``--device-map OLD=NEW,...`` for restore. R550
  only has ``--toggle``, which cannot lock every process before
  checkpointing any, so hibernate refuses it.
- On failure it prints the driver's words in quotes, e.g.
  ``Could not checkpoint on process ID 42: "out of memory"``, and exits with
  the CUDA error code truncated to 8 bits; with a driver older than 550 it
  prints ``Insufficient driver`` and exits 255.

Each run is started in a session of its own and is never killed
(:mod:`hibernate.checkpoint.detached`): past its timeout hibernate stops
waiting for it. A checkpoint or restore cut half-way can leave the process in
the driver's failed state; those two are told to ``on_detach`` (the journal)
before they are waited for, and start only then: they are started through
the gate of :mod:`hibernate.checkpoint.driver_call` (``--exec``), which
becomes ``cuda-checkpoint`` once told to go.

Found as ``--cuda-checkpoint PATH``, else ``$HIBERNATE_CUDA_CHECKPOINT``, else
on ``PATH``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate.checkpoint import curesult
from hibernate.checkpoint.base import CheckpointStepError, CudaState, DetachedCall, StepTimeouts
from hibernate.checkpoint.curesult import CuError
from hibernate.checkpoint.detached import (
    CALL_PROGRAM,
    CannotStartError,
    Detached,
    Strays,
    helper_environment,
    still_running,
)
from hibernate.errors import UnsupportedError

BINARY_ENV = "HIBERNATE_CUDA_CHECKPOINT"
BINARY_NAME = "cuda-checkpoint"
INSUFFICIENT_DRIVER = "Insufficient driver"
# The steps a cut could leave in the driver's failed state: journaled, and never given up on silently.
UNCUT_STEPS = ("checkpoint", "restore")
_VERSION = re.compile(r"Version\s+(\d+(?:\.\d+)+)")


class BinaryUnavailableError(UnsupportedError):
    """No usable cuda-checkpoint executable."""


BinaryUnavailable = BinaryUnavailableError  # the former name, for code that catches it


@dataclass(frozen=True)
class Capabilities:
    """What ``cuda-checkpoint --help`` says this driver's binary can do."""

    version: str | None
    actions: bool  # --action lock|checkpoint|restore|unlock (R555+)
    lock_timeout: bool  # --timeout for lock
    get_state: bool
    restore_tid: bool
    device_map: bool  # --device-map on restore (R580+)
    toggle: bool
    flags: list[str] = field(default_factory=list)


def parse_help(text: str) -> Capabilities:
    """Capabilities from the help text (flags are looked for by name, wording may change)."""
    flags = sorted(set(re.findall(r"--[a-z][a-z-]+", text)))
    match = _VERSION.search(text)
    return Capabilities(
        version=match.group(1) if match else None,
        actions="--action" in flags,
        lock_timeout="--timeout" in flags,
        get_state="--get-state" in flags,
        restore_tid="--get-restore-tid" in flags,
        device_map="--device-map" in flags,
        toggle="--toggle" in flags,
        flags=flags,
    )


def find(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The executable to use: explicit path, then $HIBERNATE_CUDA_CHECKPOINT, then PATH."""
    if explicit:
        return Path(explicit)
    if os.environ.get(BINARY_ENV):
        return Path(os.environ[BINARY_ENV])
    found = shutil.which(BINARY_NAME)
    return Path(found) if found else None


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return f"{self.stdout}\n{self.stderr}"


def _failure_in_output(run: Run) -> bool:
    """A success exit with the driver's error words printed is still a failure."""
    lowered = run.output.lower()
    return run.returncode == 0 and (
        "could not" in lowered or "error " in lowered or INSUFFICIENT_DRIVER.lower() in lowered
    )


class BinaryCheckpointer:
    """cuda-checkpoint as a subprocess per step, its output parsed, each step under a timeout."""

    name = "binary"

    def __init__(self, path: str | os.PathLike[str] | None = None, timeouts: StepTimeouts | None = None):
        found = find(path)
        if found is None:
            raise BinaryUnavailableError(
                "no cuda-checkpoint executable: not on PATH and neither --cuda-checkpoint nor "
                f"${BINARY_ENV} is set",
                hint="install it from https://github.com/NVIDIA/cuda-checkpoint (driver >= 555) "
                "or pass --cuda-checkpoint PATH",
            )
        if not found.is_file() or not os.access(found, os.X_OK):
            raise BinaryUnavailableError(
                f"cuda-checkpoint at {found} is not an executable file",
                hint="pass --cuda-checkpoint with the path of the executable",
            )
        self.path = found
        self.timeouts = timeouts or StepTimeouts()
        self.on_detach: Callable[[DetachedCall], None] | None = None
        self._strays = Strays()
        self.capabilities = self._probe()

    def _probe(self) -> Capabilities:
        run = self._run(["--help"], step="help", pid=0)
        if INSUFFICIENT_DRIVER in run.output or run.returncode == 255:
            raise BinaryUnavailableError(
                f"{self.path} says {INSUFFICIENT_DRIVER!r}: the NVIDIA driver is older than 550",
                hint="upgrade the NVIDIA driver to 570 or newer",
            )
        capabilities = parse_help(run.output)
        if not capabilities.actions or not capabilities.get_state:
            raise BinaryUnavailableError(
                f"{self.path} (driver {capabilities.version or 'unknown'}) has no --action/--get-state "
                "(only --toggle): hibernate must lock every process before checkpointing any",
                hint="upgrade the NVIDIA driver to 555 or newer (570+ recommended)",
            )
        return capabilities

    def describe(self) -> dict[str, Any]:
        caps = self.capabilities
        return {
            "name": self.name,
            "path": str(self.path),
            "driver_version": caps.version,
            "lock_timeout": caps.lock_timeout,
            "gpu_map": caps.device_map,
            "restore_tid": caps.restore_tid,
        }

    def _run(self, args: list[str], *, step: str, pid: int, timeout: float | None = None) -> Run:
        limit = self.timeouts.for_step(step) if timeout is None else timeout
        what = "cuda-checkpoint " + " ".join(args[:2] if args[0] == "--action" else args[:1])
        self._strays.settle(pid, step, what, self.timeouts.query)
        uncut = step in UNCUT_STEPS
        argv = [str(self.path), *args]
        if uncut:  # gated: it acts only once it is journaled (the same pid, become cuda-checkpoint)
            argv = [sys.executable, "-I", "-S", str(CALL_PROGRAM), "--exec", *argv]
        try:
            run = Detached(
                argv,
                pid=pid,
                step=step,
                what=what,
                gated=uncut,
                env=helper_environment(pid),
                on_start=self.on_detach if uncut else None,
            )
        except CannotStartError as exc:
            raise BinaryUnavailableError(f"cannot run {self.path}: {exc.strerror}") from None
        # A stray before the wait, as a Ctrl-C inside it leaves the run going: the undo's calls wait for it.
        self._strays.add(pid, run.name, run.wait, lambda: f"exit status {run.returncode}")
        if not run.wait(limit):
            if step in UNCUT_STEPS:
                raise still_running(run.call, limit, "cuda-checkpoint")
            raise CheckpointStepError(
                pid,
                step,
                CuError(
                    None,
                    "no answer",
                    f"cuda-checkpoint {' '.join(args)} did not exit within {limit:g}s "
                    "(it was left to end by itself)",
                ),
                how="cuda-checkpoint",
                timed_out=True,
            )
        self._strays.discard(pid, run.name)
        stdout, stderr = run.output()
        assert run.returncode is not None
        return Run(run.returncode, stdout, stderr)

    def _step(self, step: str, pid: int, args: list[str], timeout: float | None = None) -> Run:
        run = self._run([*args, "--pid", str(pid)], step=step, pid=pid, timeout=timeout)
        if run.returncode < 0:
            raise CheckpointStepError(
                pid,
                step,
                CuError(
                    None, "killed", f"cuda-checkpoint was killed by {signal.Signals(-run.returncode).name}"
                ),
                how="cuda-checkpoint",
            )
        if run.returncode == 255 and INSUFFICIENT_DRIVER in run.output:
            raise BinaryUnavailableError(
                f"{self.path} says {INSUFFICIENT_DRIVER!r}: the driver is older than 550"
            )
        if run.returncode != 0 or _failure_in_output(run):
            raise CheckpointStepError(
                pid,
                step,
                curesult.identify(run.returncode, run.output),
                how="cuda-checkpoint " + " ".join(args[:2] if args[0] == "--action" else args[:1]),
            )
        return run

    def state(self, pid: int) -> CudaState:
        run = self._step("state", pid, ["--get-state"])
        word = run.stdout.strip().split()[-1].lower() if run.stdout.strip() else ""
        try:
            return CudaState(word)
        except ValueError:
            raise CheckpointStepError(
                pid,
                "state",
                CuError(None, "unexpected output", f"--get-state printed {run.stdout.strip()!r}"),
                how="cuda-checkpoint --get-state",
            ) from None

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = ["--action", "lock"]
        if timeout_ms and self.capabilities.lock_timeout:
            args += ["--timeout", str(int(timeout_ms))]
        # The driver gives up after timeout_ms (leaving the process running); allow it time to say so.
        limit = (timeout_ms / 1000 if timeout_ms else self.timeouts.lock) + self.timeouts.query
        self._step("lock", pid, args, timeout=limit)

    def checkpoint(self, pid: int) -> None:
        self._step("checkpoint", pid, ["--action", "checkpoint"])

    def restore(self, pid: int, gpu_map: Mapping[str, str] | None = None) -> None:
        args = ["--action", "restore"]
        if gpu_map:
            if not self.capabilities.device_map:
                raise UnsupportedError(
                    f"{self.path} (driver {self.capabilities.version or 'unknown'}) has no --device-map: "
                    "restoring onto other GPUs needs driver 580",
                    hint="restore onto the same GPUs, or upgrade the driver",
                )
            args += ["--device-map", ",".join(f"{old}={new}" for old, new in gpu_map.items())]
        self._step("restore", pid, args)

    def unlock(self, pid: int) -> None:
        self._step("unlock", pid, ["--action", "unlock"])

    def waits(self) -> list[str]:
        """The calls that waited for an earlier, timed-out run for the same process, since last asked."""
        return self._strays.waits()

    def restore_thread_id(self, pid: int) -> int:
        run = self._step("restore-tid", pid, ["--get-restore-tid"])
        try:
            return int(run.stdout.strip().split()[-1])
        except (ValueError, IndexError):
            raise CheckpointStepError(
                pid,
                "restore-tid",
                CuError(None, "unexpected output", f"--get-restore-tid printed {run.stdout.strip()!r}"),
                how="cuda-checkpoint --get-restore-tid",
            ) from None


def probe(explicit: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """What the binary here offers, without raising (for ``hibernate doctor``)."""
    found = find(explicit)
    if found is None:
        return {"path": None, "usable": False, "error": "not found"}
    try:
        checkpointer = BinaryCheckpointer(found)
    except UnsupportedError as exc:
        return {"path": str(found), "usable": False, "error": exc.message, "hint": exc.hint}
    caps = checkpointer.capabilities
    return {
        "path": str(found),
        "usable": True,
        "driver_version": caps.version,
        "actions": caps.actions,
        "lock_timeout": caps.lock_timeout,
        "device_map": caps.device_map,
        "restore_tid": caps.restore_tid,
        "flags": caps.flags,
    }
