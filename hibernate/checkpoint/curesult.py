"""CUDA driver result codes: numbers, names and the driver's own words for them.

Both checkpointers must report the exact ``CUresult``: the driver API returns
it as an int, while the ``cuda-checkpoint`` binary prints the driver's
``cuGetErrorString`` text in quotes and exits with the code truncated to 8
bits (so 401, ``CUDA_ERROR_ILLEGAL_STATE``, exits 145, and 304 exits 48). The
exit status alone is ambiguous; the quoted text alone may be one the table
below does not know. :func:`identify` combines both.

Numbers and strings are those of ``cuda.h`` and ``cuGetErrorName`` /
``cuGetErrorString`` (CUDA 12.x/13.x); only the codes the checkpoint API and
its callers meet are listed, which is all this module needs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_OUT_OF_MEMORY = 2
CUDA_ERROR_NOT_INITIALIZED = 3
CUDA_ERROR_NO_DEVICE = 100
CUDA_ERROR_INVALID_CONTEXT = 201
CUDA_ERROR_OPERATING_SYSTEM = 304
CUDA_ERROR_ILLEGAL_STATE = 401
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_NOT_PERMITTED = 800
CUDA_ERROR_NOT_SUPPORTED = 801
CUDA_ERROR_TIMEOUT = 909
CUDA_ERROR_UNKNOWN = 999

# code -> (cuGetErrorName, cuGetErrorString)
KNOWN: dict[int, tuple[str, str]] = {
    0: ("CUDA_SUCCESS", "no error"),
    1: ("CUDA_ERROR_INVALID_VALUE", "invalid argument"),
    2: ("CUDA_ERROR_OUT_OF_MEMORY", "out of memory"),
    3: ("CUDA_ERROR_NOT_INITIALIZED", "initialization error"),
    4: ("CUDA_ERROR_DEINITIALIZED", "driver shutting down"),
    34: ("CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"),
    46: ("CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"),
    100: ("CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"),
    101: ("CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"),
    201: ("CUDA_ERROR_INVALID_CONTEXT", "invalid device context"),
    304: ("CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"),
    400: ("CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"),
    401: ("CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"),
    500: ("CUDA_ERROR_NOT_FOUND", "named symbol not found"),
    600: ("CUDA_ERROR_NOT_READY", "device not ready"),
    800: ("CUDA_ERROR_NOT_PERMITTED", "operation not permitted"),
    801: ("CUDA_ERROR_NOT_SUPPORTED", "operation not supported"),
    802: ("CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"),
    803: (
        "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        "system has unsupported display driver / cuda driver combination",
    ),
    909: ("CUDA_ERROR_TIMEOUT", "wait operation timed out"),
    999: ("CUDA_ERROR_UNKNOWN", "unknown error"),
}

_BY_NAME = {name: code for code, (name, _) in KNOWN.items()}
_BY_TEXT = {text: code for code, (_, text) in KNOWN.items()}
_QUOTED = re.compile(r'"([^"\n]*)"')


@dataclass(frozen=True)
class CuError:
    """One CUDA result as precisely as it could be known.

    ``code`` is None when only the 8-bit exit status and a text the table does
    not know were available; ``name`` then says so.
    """

    code: int | None
    name: str
    text: str

    def __str__(self) -> str:
        number = f" ({self.code})" if self.code is not None else ""
        return f"{self.name}{number}: {self.text}"


def from_code(code: int, name: str | None = None, text: str | None = None) -> CuError:
    """A CuError for a full result code; ``name``/``text`` from the driver win over the table."""
    known_name, known_text = KNOWN.get(code, (f"CUresult {code}", "unknown CUDA error"))
    return CuError(code, name or known_name, text or known_text)


def code_for_name(name: str) -> int | None:
    """``CUDA_ERROR_OUT_OF_MEMORY`` -> 2; also accepts a decimal number."""
    if name.isdigit():
        return int(name)
    return _BY_NAME.get(name)


def quoted_message(output: str) -> str | None:
    """The last double-quoted text in ``output`` (where cuda-checkpoint puts the driver's words)."""
    found = _QUOTED.findall(output)
    return found[-1] if found else None


def identify(exit_status: int, output: str) -> CuError:
    """The CUresult behind a failed ``cuda-checkpoint`` run.

    The quoted driver string decides when the table knows it and its code's low
    byte agrees with the exit status; failing that, the exit status decides
    when exactly one known code truncates to it. Otherwise the error is
    reported as unknown, with the driver's text kept verbatim.
    """
    text = quoted_message(output)
    if text is not None and text in _BY_TEXT:
        code = _BY_TEXT[text]
        if code & 0xFF == exit_status & 0xFF:
            return from_code(code)
    candidates = [code for code in KNOWN if code and code & 0xFF == exit_status & 0xFF]
    if len(candidates) == 1 and text is None:
        return from_code(candidates[0])
    if len(candidates) == 1 and text is not None and text == KNOWN[candidates[0]][1]:
        return from_code(candidates[0])
    detail = text if text is not None else (output.strip().splitlines() or ["no output"])[-1]
    return CuError(None, f"CUDA error (cuda-checkpoint exit status {exit_status})", detail)
