"""What callers use: sleep, wake, recover and status, with every kind of target registered.

The engine (:mod:`hibernate.operation`) knows no kind of target by name;
importing :mod:`hibernate.flows` registers the kinds this hibernate ships
(plain agents, vLLM servers), each loaded only when a target of its kind is met.
"""

from __future__ import annotations

import hibernate.flows  # noqa: F401  (registers the built-in kinds of target)
from hibernate.operation.engine import prepare_directory, recover, sleep, status, wake
from hibernate.operation.options import IoOptions, Options, options_from_flags
from hibernate.operation.progress import ProgressSink
from hibernate.operation.reports import RecoverReport, SleepReport, WakeReport

__all__ = [
    "IoOptions",
    "Options",
    "ProgressSink",
    "RecoverReport",
    "SleepReport",
    "WakeReport",
    "options_from_flags",
    "prepare_directory",
    "recover",
    "sleep",
    "status",
    "wake",
]
