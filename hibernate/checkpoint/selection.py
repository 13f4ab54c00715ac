"""Which checkpointer drives cuda-checkpoint: ``--checkpointer auto|driver|binary|none``.

``auto`` takes the driver API where libcuda has it (no process per step, exact
error codes), else the ``cuda-checkpoint`` binary, else none. Below driver API
13.0 (drivers 570 and 575) the binary comes first where it is found: CRIU's
CUDA plugin refuses its own driver-API backend there too, and hibernate's
driver path has been validated on 13.0 (driver 580) only. Having none is
not an error by itself: a target without CUDA holders needs no checkpointer,
and the orchestrator says "neither is there" only when one does.

``none`` (``--no-cuda``) is asked for: the pools are freed and every CUDA
context stays on the GPU, with no checkpoint call at all (a faster wake for
users who only need the weights' memory back).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from hibernate.checkpoint.base import Checkpointer, StepTimeouts, cuda_version_text
from hibernate.errors import UnsupportedError, UsageError

if TYPE_CHECKING:
    from hibernate.checkpoint.driver import DriverCheckpointer

NONE = "none"
KINDS = ("auto", "driver", "binary", NONE)
VALIDATED_DRIVER_API = 13000  # cuDriverGetVersion of driver 580; below it ``auto`` prefers the binary


def check_choice(kind: str, binary_path: object = None) -> None:
    """Refuse (UsageError) a ``--checkpointer`` that is none of KINDS, or a ``--cuda-checkpoint``
    binary with a kind that uses none; every command checks its flags here before anything is
    touched."""
    if kind not in KINDS:
        raise UsageError(f"--checkpointer must be one of {', '.join(KINDS)}, not {kind!r}")
    if binary_path and kind in ("driver", NONE):
        raise UsageError(f"--cuda-checkpoint names the binary; it cannot be used with --checkpointer {kind}")


def choose(
    kind: str = "auto",
    binary_path: str | os.PathLike[str] | None = None,
    timeouts: StepTimeouts | None = None,
) -> tuple[Checkpointer | None, list[str]]:
    """The checkpointer for ``kind``, and why the others were passed over.

    An explicit ``driver`` or ``binary`` that is not usable raises
    UnsupportedError at once (nothing has been touched yet); ``auto`` returns
    None with the reasons instead.
    """
    from hibernate.checkpoint.binary import BinaryCheckpointer
    from hibernate.checkpoint.driver import DriverCheckpointer

    check_choice(kind, binary_path)
    if kind == NONE:
        return None, ["--checkpointer none: CUDA state is left on the GPU"]
    reasons: list[str] = []
    if kind in ("auto", "driver") and not (kind == "auto" and binary_path):
        try:
            driver = DriverCheckpointer(timeouts=timeouts)
        except UnsupportedError as exc:
            if kind == "driver":
                raise
            reasons.append(f"driver API: {exc.message}")
        else:
            if kind == "driver" or driver.version >= VALIDATED_DRIVER_API:
                return driver, reasons
            return _below_validated(driver, timeouts)
    try:
        return BinaryCheckpointer(binary_path, timeouts=timeouts), reasons
    except UnsupportedError as exc:
        if kind == "binary":
            raise
        reasons.append(f"cuda-checkpoint binary: {exc.message}")
    return None, reasons


def _below_validated(
    driver: DriverCheckpointer, timeouts: StepTimeouts | None
) -> tuple[Checkpointer, list[str]]:
    """``auto`` on a driver API older than 13.0: the binary where it is found, else the driver API."""
    from hibernate.checkpoint.binary import BinaryCheckpointer

    older = f"CUDA {cuda_version_text(driver.version)} is below 13.0 (driver 580)"
    try:
        binary = BinaryCheckpointer(None, timeouts=timeouts)
    except UnsupportedError as exc:
        return driver, [f"cuda-checkpoint binary, preferred where {older}: {exc.message}"]
    return binary, [f"driver API: {older}, where it is not validated; the binary is preferred there"]


def describe(checkpointer: Checkpointer | None) -> dict[str, Any] | None:
    return None if checkpointer is None else checkpointer.describe()
