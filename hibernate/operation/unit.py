"""A unit: agents of one kind that move as one, and what every kind must say about itself.

A flow (one kind of target) is a Unit subclass, registered by kind. Its
``plan`` groups the agents of its kind into units (all plain agents are one
unit; each vLLM server is one), and each unit declares its own memory steps.
The engine runs, for a sleep, ``lock`` and ``connect`` over everyone, then every
unit's ``sleep_steps`` in turn, then one CUDA stage; for a wake, ``lock``,
``connect``, the CUDA stage, then every unit's ``wake_steps``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hibernate.agent.wire import AgentState, AgentStatus
from hibernate.errors import BusyError, HibernateError, NeedsRecoveryError
from hibernate.operation.ledger import Ledger, interrupted_operation
from hibernate.operation.options import Options
from hibernate.operation.progress import ProgressSink
from hibernate.operation.reports import UnitReport
from hibernate.operation.steps import Step
from hibernate.operation.targets import AgentRef, Target


@dataclass
class Context:
    """One operation as its units see it; ``ledger`` and ``directory`` are set once the locks are held."""

    op: str
    options: Options
    sink: ProgressSink
    ledger: Ledger | None = None
    directory: Path | None = None
    recovering: bool = False  # a wake that recover runs: anything asleep may be unknown to its server

    @property
    def journal(self) -> Ledger:
        if self.ledger is None:
            raise RuntimeError("the operation's ledger is set before any step runs")
        return self.ledger

    @property
    def spill_dir(self) -> Path:
        if self.directory is None:
            raise RuntimeError("a sleep's directory is set before any step runs")
        return self.directory


class Unit(ABC):
    """Agents of one kind that move as one through the steps their class declares."""

    sleep_steps: ClassVar[tuple[Step, ...]] = ()
    wake_steps: ClassVar[tuple[Step, ...]] = ()

    def __init__(self, ctx: Context, refs: Sequence[AgentRef], processes: Sequence[int]) -> None:
        self.ctx = ctx
        self.refs = list(refs)  # the processes it changes: locked and journaled
        self.processes = list(dict.fromkeys(processes))  # where its CUDA holders are looked for

    @classmethod
    @abstractmethod
    def plan(cls, ctx: Context, agents: Sequence[AgentRef], targets: Sequence[Target]) -> list[Unit]:
        """The units the agents of this kind form (``targets``: every resolved target, for their trees)."""

    # -- before anything changes ------------------------------------------------------

    def asleep(self) -> bool:
        """Asleep as a whole, as its agents answered when resolved (a selector's sleep skips it)."""
        holders = self.memory_holders()
        return bool(holders) and all(a.status.state is AgentState.ASLEEP for a in holders)

    def memory_holders(self) -> list[AgentRef]:
        """The agents whose state says whether the unit sleeps."""
        return self.refs

    def check(self) -> None:  # noqa: B027  (a hook: most kinds need nothing)
        """Refuse what this unit cannot do in ``ctx.op``, before any lock; nothing is changed."""

    @abstractmethod
    def connect(self) -> None:
        """Reach every agent and check each is in the state ``ctx.op`` needs (after the locks)."""

    def close(self) -> None:  # noqa: B027  (a hook: most kinds need nothing)
        """Let go of connections when the operation ends, whatever happened."""

    # -- during the operation ---------------------------------------------------------

    @property
    def scope(self) -> Sequence[AgentRef] | None:
        return self.refs

    def label(self, step: str) -> str:
        return step

    def annotate(self, step: str, error: HibernateError) -> None:  # noqa: B027  (a hook: most kinds need nothing)
        """Say where ``error`` happened (which process or server, which step)."""

    def checkpoints_itself(self) -> list[int]:
        """Pids of CUDA holders that checkpoint themselves after the unit's sleep (waited for, not driven)."""
        return []

    @abstractmethod
    def has_sleeping(self) -> bool:
        """A wake: whether anything of the unit is asleep (known after connect)."""

    @abstractmethod
    def describe_state(self) -> str:
        """Why there is nothing to wake in this unit, in words."""

    @abstractmethod
    def report(self) -> UnitReport:
        """Its part of the report of the operation that just ended."""

    # -- recovery -------------------------------------------------------------------

    def asleep_now(self) -> bool:
        """Whether the unit sleeps as a whole now, once nothing of it moves by itself (recover)."""
        return self.asleep()

    def skip_asleep(self) -> list[dict[str, object]]:
        """Leave out what already sleeps (a selector's sleep); what was left out, one entry per process.

        A unit asleep as a whole is left out entirely (its ``refs`` emptied);
        one half asleep is kept, and its connect refuses it. One whose last operation has not
        ended is refused (see ``unsettled``): it is not asleep whole, nor to be left alone silently.
        """
        if not self.asleep():
            return []
        refuse_unsettled(self.memory_holders())
        skipped = [skipped_entry(ref.pid, ref.status) for ref in self.memory_holders()]
        self.refs = []
        return skipped


def already_asleep(pid: object, snapshot: object = None) -> str:
    """How a process found asleep is named, in a refusal or beside a sleep that skipped it."""
    return f"process {pid} is already asleep" + (f" (snapshot {snapshot})" if snapshot else "")


def skipped_entry(pid: object, status: AgentStatus) -> dict[str, object]:
    """A process a sleep or wake left as it was, as its report lists it (from its agent's status)."""
    return {"pid": pid, "name": status.name, "state": status.state_word, "snapshot": status.snapshot_path}


def unsettled(
    pid: object, status: AgentStatus, interrupted: Mapping[str, Any] | None
) -> HibernateError | None:
    """Why a target found in the state asked for is not "already there" (None where it is).

    Its state says where its agent is, not that an operation got it there whole: a command still
    at work on it (busy) may yet undo it, and one that died half-way left the rest undone (after
    a sleep's release, its CUDA state may still be on the GPU). ``interrupted`` is its journal's
    word (``ledger.interrupted_operation``).
    """
    if interrupted and "resolve" in interrupted:
        return NeedsRecoveryError(
            f"process {pid} was left half-way by an interrupted `hibernate {interrupted.get('op')}` "
            f"(it is {status.state_word}); nothing was changed",
            hint=f"run `{interrupted['resolve']}` to finish or undo it",
        )
    holder = status.busy or (interrupted or {}).get("in_progress")
    if holder:
        return BusyError(
            f"process {pid} is {status.state_word}, but {holder} is still at work on it; nothing was changed",
            hint=f"wait for it to end (`hibernate status {pid}` shows it), then run this again",
        )
    return None


def refuse_unsettled(refs: Sequence[AgentRef]) -> None:
    """Raise ``unsettled``'s error for the first of ``refs`` that has one."""
    for ref in refs:
        error = unsettled(ref.pid, ref.status, interrupted_operation(ref))
        if error is not None:
            raise error
