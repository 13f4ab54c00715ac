"""Steps: what an operation does, declared as data, and the one runner that does it.

A step is a name, a ``run`` and an optional ``undo``, each a function of the
step's owner (a unit, or the operation itself). The runner shows each step,
journals it as passed (for its owner's processes) and fires its fault point
``<op>.after-<name>``; a step that reports progress also has
``<op>.during-<name>``. Fault points and journal marks are therefore derived
from the step lists (:func:`fault_points`), never written out by hand.

On a failure the runner lets the step's owner say where it happened, then
calls the undo of the failed step and of every completed step, in reverse.
An undo decides from the real state what to put back (a step that failed
half-way is undone as far as it got), so a flow
attaches one undo to the first step that changes anything. An error that
``keeps_journal`` (NeedsRecoveryError) is not undone: its state could not be
judged, and ``hibernate recover`` decides later from the journal.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hibernate.errors import HibernateError
from hibernate.operation.ledger import Ledger
from hibernate.operation.progress import ProgressSink
from hibernate.operation.targets import AgentRef


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Any], object]
    undo: Callable[[Any, BaseException], None] | None = None
    inner: tuple[str, ...] = ()  # marks the step passes (and journals) itself, before its own
    during: bool = False  # reports progress: a fault point inside it
    shown: bool = True  # announced to the progress sink by its label

    def marks(self) -> tuple[str, ...]:
        return (*self.inner, self.name)


def fault_points(op: str, steps: Sequence[Step]) -> list[str]:
    """Every fault point of ``steps``, in the order an operation passes them."""
    points: list[str] = []
    for step in steps:
        if step.during:
            points.append(f"{op}.during-{step.name}")
        points.extend(f"{op}.after-{mark}" for mark in step.marks())
    return points


class StepOwner(Protocol):
    """What runs a step: it says whose journal entries it marks, how it is shown, and where it failed."""

    @property
    def scope(self) -> Sequence[AgentRef] | None: ...

    def label(self, step: str) -> str: ...

    def annotate(self, step: str, error: HibernateError) -> None: ...


def run_steps(plan: Sequence[tuple[Step, StepOwner]], ledger: Ledger, sink: ProgressSink) -> None:
    """Run ``plan`` in order; on failure undo the failed step and every completed one, in reverse."""
    done: list[tuple[Step, StepOwner]] = []
    for step, owner in plan:
        try:
            if step.shown:
                sink.step(owner.label(step.name))
            step.run(owner)
            ledger.passed(step.name, owner.scope)
        except BaseException as exc:
            if isinstance(exc, HibernateError):
                owner.annotate(step.name, exc)  # before the undo changes what each process reached
            if not (isinstance(exc, HibernateError) and exc.keeps_journal):
                for undone, by in reversed([*done, (step, owner)]):
                    if undone.undo is not None:
                        undone.undo(by, exc)
            raise
        done.append((step, owner))
