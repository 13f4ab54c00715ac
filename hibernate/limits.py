"""The allowed range of every numeric option of the CLI, checked before anything is touched.

A number outside a sane range used to travel on into socket timeouts, the
driver's 32-bit lock timeout (milliseconds) or a staging allocation in the
target, and end there in a traceback (exit 1) half-way through an operation.
Each option is refused here instead, at once, with exit 2 (USAGE) and a
message that says the range, so a scheduler's script learns what it got
wrong before any process is touched.

Standard library only: the CLI imports this before it knows which command runs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from hibernate.errors import UsageError

MIB = 1 << 20
# One day. A wait longer than that is a hang, not a wait; and every timeout must fit the driver's
# cuCheckpointProcessLock timeoutMs (a 32-bit count of milliseconds: at most ~49.7 days).
MAX_SECONDS = 86400.0
# The CLI's floor for staging: room for two arenas of a few chunks, far above the store's own
# floor (hibernate.store.options.MIN_BUFFER_BYTES, 32 KiB; a test keeps it so). Not imported
# from the store: the CLI stays light.
MIN_BUFFER_MB = 16
# More nodes than one job spans on any cluster we know of; a bound that keeps a typo from
# sizing the barrier's bookkeeping.
MAX_NODES = 65536
# I/O requests in flight and copy/hash threads of one process's transfer (--io-depth, --io-workers):
# far above what pays on any machine we know of (store.tuning chooses 1 to 8 of each).
MAX_IO_DEPTH = 64
MAX_IO_WORKERS = 64


def physical_memory_bytes() -> int:
    """This machine's RAM: the staging of a sleep or wake lives in the target, on this machine."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def max_buffer_mb() -> int:
    """The largest --buffer-mb: half of this machine's RAM, so that staging alone cannot exhaust it."""
    return physical_memory_bytes() // 2 // MIB


@dataclass(frozen=True)
class Bound:
    """The range of one option: ``low <= value <= high``, the bounds computed when checked."""

    option: str
    low: Callable[[], float]
    high: Callable[[], float]
    unit: str = ""
    why: Callable[[], str] = lambda: ""  # what the upper bound is, in words (said in the message)

    def check(self, value: object) -> None:
        low, high = self.low(), self.high()
        # NaN compares false with everything, so "not inside" (rather than "below or above") catches it.
        if isinstance(value, (int, float)) and not math.isnan(value) and low <= value <= high:
            return
        unit = f" {self.unit}" if self.unit else ""
        words = self.why()
        why = f" ({words})" if words else ""
        raise UsageError(
            f"{self.option} must be between {_number(low)} and {_number(high)}{unit}{why}, "
            f"not {_number(value) if isinstance(value, (int, float)) else repr(value)}; nothing was changed",
        )


def _number(value: float) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _const(value: float) -> Callable[[], float]:
    return lambda: value


def _words(text: str) -> Callable[[], str]:
    return lambda: text


def _half_ram_words() -> str:
    return f"half of this machine's {physical_memory_bytes() / (1 << 30):.1f} GiB of memory"


# By the name of the command function's parameter: every command with such a parameter is checked.
# (--level is checked by the vLLM flow, hibernate/flows/vllm.py:check_level, whose message
# says what each level does; for any other target it is refused as a vLLM-only option.)
BOUNDS: dict[str, Bound] = {
    "timeout": Bound("--timeout", _const(0.0), _const(MAX_SECONDS), "seconds", _words("one day")),
    "barrier_timeout": Bound(
        "--barrier-timeout", _const(0.0), _const(MAX_SECONDS), "seconds", _words("one day")
    ),
    "buffer_mb": Bound("--buffer-mb", _const(MIN_BUFFER_MB), max_buffer_mb, "MiB", _half_ram_words),
    "keep_staging_mb": Bound("--keep-staging-mb", _const(0), max_buffer_mb, "MiB", _half_ram_words),
    "io_depth": Bound("--io-depth", _const(1), _const(MAX_IO_DEPTH)),
    "io_workers": Bound("--io-workers", _const(1), _const(MAX_IO_WORKERS)),
    "nodes": Bound("--nodes", _const(1), _const(MAX_NODES)),
    "node_index": Bound("--node-index", _const(0), _const(MAX_NODES - 1)),
}


def check(values: Mapping[str, object]) -> None:
    """Refuse (UsageError, exit 2) the first value of ``values`` outside its option's range.

    ``values`` are a command's keyword arguments; names without a bound, and
    options not given (None), are left alone.
    """
    for name, bound in BOUNDS.items():
        value = values.get(name)
        if value is None or isinstance(value, bool):
            continue
        bound.check(value)
