"""What ``hibernate recover`` does about an interrupted operation: one table for every kind of target.

Decided from the journal (which steps each unit had passed) and the real
states (is every unit asleep now). Until a unit's last memory step nothing of
it was lost, and after it the snapshot holds every byte, so waking is always
possible; finishing is chosen only where nothing but the CUDA stage was left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Action(Enum):
    NOTHING = "nothing to recover"
    CLEAR = "the interrupted sleep had completed"  # only the journal was left
    FINISH_SLEEP = "finish the sleep"  # every memory step done, the CUDA stage left
    WAKE = "wake"  # undo an interrupted sleep, or finish an interrupted wake


@dataclass(frozen=True)
class UnitRecord:
    """One unit as recovery sees it."""

    op: str | None  # the interrupted operation its journal names; None: no entry
    marks: tuple[str, ...]  # the steps its journal marked done, in order
    last_memory_step: str  # the name of its flow's last sleep step before the CUDA stage
    asleep: bool  # every process of it that holds memory is asleep now


def decide(units: Sequence[UnitRecord]) -> tuple[Action, str | None]:
    """The action, and the operation that was interrupted (None when nothing was)."""
    pending = [u for u in units if u.op is not None]
    if not pending:
        return Action.NOTHING, None
    op = pending[0].op
    every_asleep = all(u.asleep for u in units)
    if op == "sleep" and every_asleep:
        if all(u.marks and u.marks[-1] == "cuda" for u in pending):
            return Action.CLEAR, op
        if all(u.op == "sleep" and u.last_memory_step in u.marks for u in units):
            return Action.FINISH_SLEEP, op
    return Action.WAKE, op
