"""What the proxy logs of requests it could not serve: one line each, never a traceback, a few at most.

aiohttp reports a request it cannot parse, or whose client went away in the
middle of its body, through the logger it is given
(``RequestHandler.handle_error``), with the whole traceback: any local user
could fill the proxy's log with them. The proxy gives it :data:`HTTP_LOG`
instead, whose filter turns each record into one line (what happened, the
exception's name and words) and lets through at most :data:`LINES` of them per
:data:`WINDOW` seconds; the first line let through after some were held back
says how many.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

LINES = 5
WINDOW = 10.0
MAX_WORDS = 200  # characters of an exception's words kept in its line


@dataclass
class LineBudget:
    """At most ``lines`` admitted per window of ``window`` seconds (pure: the caller gives the time)."""

    lines: int
    window: float
    _start: float = -math.inf
    _used: int = 0
    _held_back: int = 0

    def admit(self, now: float) -> tuple[bool, int]:
        """Whether a line may go out at ``now``, and how many were held back before it (then reset)."""
        if now - self._start >= self.window:
            self._start, self._used = now, 0
        if self._used >= self.lines:
            self._held_back += 1
            return False, 0
        self._used += 1
        held_back, self._held_back = self._held_back, 0
        return True, held_back


def describe(exc: BaseException) -> str:
    """An exception in one line: its name and its words (aiohttp's span several lines), bounded."""
    words = getattr(exc, "message", None) or str(exc)
    flat = " ".join(str(words).split())
    if len(flat) > MAX_WORDS:
        flat = flat[: MAX_WORDS - 3] + "..."
    return f"{type(exc).__name__}: {flat}" if flat else type(exc).__name__


class OneLine(logging.Filter):
    """Every record as one line without its traceback, within a :class:`LineBudget`."""

    def __init__(self, budget: LineBudget, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.budget = budget
        self.clock = clock

    def filter(self, record: logging.LogRecord) -> bool:
        admitted, held_back = self.budget.admit(self.clock())
        if not admitted:
            return False
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text = f"{text}: {describe(record.exc_info[1])}"
        if held_back:
            text += f" ({held_back} more like it not logged)"
        record.msg, record.args = text, None
        record.exc_info = record.exc_text = record.stack_info = None
        return True


HTTP_LOG = logging.getLogger("hibernate.serve.http")
HTTP_LOG.addFilter(OneLine(LineBudget(LINES, WINDOW)))
