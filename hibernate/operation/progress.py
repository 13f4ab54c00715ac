"""Where an operation tells its caller what it does: the label of each step, bytes moved, and notes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


def transfer_rate(nbytes: int, seconds: float) -> float:
    """The one rate of a spill or restore, in GB/s (10^9 bytes): the bytes the step got through
    over the seconds of the whole step so far.

    The progress bar and the report both show it, so they cannot disagree: a sleep's bytes are
    those its snapshot keeps, written and reused alike (the bar counts both as they pass), and
    the clock runs from the step's start, not from the first bytes moved (the staging, the
    planning and the last sync are part of what the user waits for).
    """
    return round(nbytes / max(seconds, 1e-9) / 1e9, 3)


def side_by_side(transfers: Sequence[tuple[int, float]]) -> tuple[int, float]:
    """Transfers of one step run at once (bytes, seconds each), as one: all their bytes over the
    longest one's seconds. The bar's last rate and a report's total line are both this; for one
    process it is that process's own bytes and seconds, so its report line says the same."""
    return sum(nbytes for nbytes, _ in transfers), max((seconds for _, seconds in transfers), default=0.0)


class ProgressSink:
    """Receives step labels, byte counts and notes; the CLI renders them, the default ignores them."""

    def step(self, label: str) -> None:
        """A step begins (``label`` is how it is shown: ``spill``, ``vllm-sleep 1234``)."""

    def transfer(self, label: str, done: int, total: int) -> None:
        """Bytes moved so far in a spill or restore, summed over every process."""

    def note(self, message: str) -> None:
        """Something the user should know that is not a step (a change of plan, a warning)."""

    def ended(self, label: str, nbytes: int, seconds: float) -> None:
        """A spill or restore ended: its bytes and seconds as the report counts them (side_by_side)."""


class ByteCounter:
    """Sums the progress of several agents transferring at once.

    ``on_first`` runs at the first report of bytes moved (or of a transfer with none to move), not
    at a report that the transfer is still being prepared: what follows it is inside the transfer.
    """

    def __init__(self, sink: ProgressSink, label: str, on_first: Callable[[], None] = lambda: None) -> None:
        self._sink = sink
        self._label = label
        self._on_first = on_first
        self._lock = threading.Lock()
        self._done: dict[int, int] = {}
        self._total: dict[int, int] = {}

    def for_member(self, pid: int) -> Callable[[dict[str, Any]], None]:
        def update(event: dict[str, Any]) -> None:
            with self._lock:
                self._done[pid] = int(event.get("done", 0))
                self._total[pid] = int(event.get("total", 0))
                done, total = sum(self._done.values()), sum(self._total.values())
            self._sink.transfer(self._label, done, total)
            if done or done >= total:
                self._on_first()

        return update
