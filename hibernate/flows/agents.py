"""Plain agents: processes whose own agent moves their tagged pools (``hibernate.track``, ``run``).

    sleep: leases, quiesce (every member) -> spill (all at once) -> release (every member)
    wake:  restore (all at once) -> resume (every member)

All plain agents of an operation form one unit, so their spills and restores
run in parallel. Nothing is lost before ``release``, and after it the
published snapshot holds every kept byte, so the undo can always restore.

``leases`` closes every member's gate to new leases and waits for the requests
in flight through a proxy (``hibernate serve``) to end, before any member is
quiesced: a request may need every process of its server, so pausing one of
them while another still serves it would hold both until the timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from hibernate import procinfo
from hibernate.agent.wire import AgentState, AgentStatus, SpillArgs, WaitArgs, parse_state
from hibernate.errors import HibernateError, NeedsRecoveryError, WrongStateError, describe_cause
from hibernate.flows.members import (
    Member,
    connect_all,
    died_during_wake,
    hang_up,
    holds_leases,
)
from hibernate.operation.options import share_staging
from hibernate.operation.progress import ByteCounter, side_by_side
from hibernate.operation.reports import ProcessSleep, ProcessWake, UnitReport
from hibernate.operation.steps import Step
from hibernate.operation.targets import AgentRef, Target
from hibernate.operation.unit import Context, Unit, already_asleep, refuse_unsettled, skipped_entry
from hibernate.threads import raise_first_error, run_each


def describe_state(member: Member) -> str:
    status = member.begun
    if status.state is AgentState.ASLEEP:
        return already_asleep(member.pid, status.snapshot_path)
    not_asleep = "not asleep, it is " if status.state is AgentState.RUNNING else ""
    return f"process {member.pid} is {not_asleep}{status.state_word}"


# The state a member of a sleep is in once this command saw a request answered (else: running).
_STATE_AFTER = {
    "release": AgentState.ASLEEP,
    "quiesce": AgentState.QUIESCED,
    "spill": AgentState.SPILLED,
    "restore": AgentState.QUIESCED,
}


def undo_requests(state: str | None, reached: str) -> tuple[str, ...]:
    """The requests that bring a member of an undone sleep back to running.

    ``state`` is its agent's own (an AgentState; None where it could not be read), ``reached`` the
    last request this command saw answered: the agent's word wins, as a request may have ended unseen.
    """
    now = _STATE_AFTER.get(reached, AgentState.RUNNING) if state is None else parse_state(state)
    if now is AgentState.ASLEEP:
        return ("restore", "resume")
    if now in (AgentState.QUIESCED, AgentState.SPILLED):
        return ("resume",)
    return ()


def _state_now(member: Member) -> AgentState | None:
    """Its agent's state now, asked without counting as a step it reached; None if it cannot say."""
    try:
        return AgentStatus.from_wire(member.client.call("status")).state
    except HibernateError:
        return None


class AgentsUnit(Unit):
    def __init__(self, ctx: Context, groups: Sequence[list[AgentRef]], processes: Sequence[int]) -> None:
        super().__init__(ctx, [ref for group in groups for ref in group], processes)
        self.groups = [list(group) for group in groups]  # by requested target: skipped as a whole
        self.members: list[Member] = []

    @classmethod
    def plan(cls, ctx: Context, agents: Sequence[AgentRef], targets: Sequence[Target]) -> list[Unit]:
        mine = {ref.identity for ref in agents}
        groups: list[list[AgentRef]] = []
        processes: list[int] = []
        for target in targets:
            group = [ref for ref in target.agents if ref.identity in mine]
            if group:
                groups.append(group)
                processes.extend(target.processes)
        return [cls(ctx, groups, processes)]

    def skip_asleep(self) -> list[dict[str, object]]:
        """Targets asleep as a whole are left out; a target half asleep stays (and connect refuses it),
        and one whose last operation has not ended is refused (``unsettled``)."""
        skipped: list[dict[str, object]] = []
        kept: list[list[AgentRef]] = []
        for group in self.groups:
            if all(ref.status.state is AgentState.ASLEEP for ref in group):
                refuse_unsettled(group)
                skipped.extend(skipped_entry(ref.pid, ref.status) for ref in group)
            else:
                kept.append(group)
        self.groups = kept
        self.refs = [ref for group in kept for ref in group]
        return skipped

    # -- connect ------------------------------------------------------------------------

    def connect(self) -> None:
        self.members.extend(connect_all(self.refs, self.ctx.options.agent_timeout))
        if self.ctx.op != "sleep":
            return
        not_running = [m for m in self.members if m.state is not AgentState.RUNNING]
        if not_running:
            raise WrongStateError(
                "; ".join(describe_state(m) for m in not_running) + "; nothing was changed",
                hint=f"wake it first: hibernate wake {' '.join(str(m.pid) for m in not_running)}",
            )

    def close(self) -> None:
        hang_up(self.members)

    # -- sleep ----------------------------------------------------------------------------

    def close_leases(self) -> None:
        """New leases refused on every member, then those held waited for (BusyError naming them)."""
        options = self.ctx.options
        timeout = options.lease_wait
        for member in self.members:
            if holds_leases(member.begun):
                member.call(
                    "close_leases",
                    WaitArgs(timeout).to_wire(),
                    silence_timeout=timeout + options.agent_timeout,
                )

    def quiesce(self) -> None:
        timeout = self.ctx.options.quiesce_timeout
        for member in self.members:
            member.call(
                "quiesce",
                WaitArgs(timeout).to_wire(),
                silence_timeout=timeout + self.ctx.options.agent_timeout,
            )

    def spill(self) -> None:
        ledger = self.ctx.journal
        counter = ByteCounter(self.ctx.sink, "spill", lambda: ledger.during("spill"))
        share = share_staging(self.ctx.options.io.buffer_mb, len(self.members))
        args = SpillArgs(str(self.ctx.spill_dir), self.ctx.options.io.transfer(share.buffer_mb)).to_wire()
        timeout = self.ctx.options.agent_timeout
        spill = run_each(
            self.members,
            lambda m: m.call("spill", args, progress=counter.for_member(m.pid), silence_timeout=timeout),
            at_once=share.at_once,
        )
        raise_first_error(spill)
        moved = [ProcessSleep.from_answers(m.pid, None, m.answers).moved() for m in self.members]
        self.ctx.sink.ended("spill", *side_by_side(moved))

    def release(self) -> None:
        raise_first_error(run_each(self.members, lambda m: m.call("release")))

    def undo_sleep(self, error: BaseException) -> None:
        """Put every member back to running; NeedsRecoveryError if that fails too.

        What to undo is read from each agent's own state where it answers: a request cut in flight
        (a second Ctrl-C) may have ended in the agent after this command stopped waiting for it.
        """
        failures = []
        for member in reversed(self.members):
            if member.unresponsive or not procinfo.is_alive(member.ref.identity):
                continue  # left to roll back by itself, or gone: nothing of it to put back
            try:
                for op in undo_requests(_state_now(member), member.reached):
                    member.call(op)
            except HibernateError as undo_error:
                failures.append(f"process {member.pid}: {undo_error.message}")
        if failures:
            pids = " ".join(str(m.pid) for m in self.members)
            raise NeedsRecoveryError(
                f"{describe_cause(error)}; undoing it failed too: {'; '.join(failures)}",
                hint=f"run `hibernate recover {pids}` once the cause is fixed (`hibernate status {pids}` "
                "shows where each was left)",
            ) from error

    def annotate(self, step: str, error: HibernateError) -> None:
        if self.ctx.op != "sleep" or not self.members:
            return
        op = "close_leases" if step == "leases" else step  # the agent's name for the step
        failed = next((m for m in self.members if m.reached != op), self.members[0])
        error.add_context(f"process {failed.pid} ({step})", unless=f"process {failed.pid}")

    # -- wake -----------------------------------------------------------------------------

    @property
    def sleeping(self) -> list[Member]:
        return [m for m in self.members if m.state is AgentState.ASLEEP]

    def has_sleeping(self) -> bool:
        return bool(self.sleeping)

    def describe_state(self) -> str:
        return "; ".join(describe_state(m) for m in self.members)

    def restore(self) -> None:
        """Every sleeping member reads its snapshot back; one that fails stays asleep, the rest resume."""
        sleeping = self.sleeping
        ledger = self.ctx.journal
        counter = ByteCounter(self.ctx.sink, "restore", lambda: ledger.during("restore"))
        failures: list[tuple[Member, HibernateError]] = []
        lock = threading.Lock()
        share = share_staging(self.ctx.options.io.buffer_mb, len(sleeping))
        args = self.ctx.options.io.transfer(share.buffer_mb).to_wire()

        def restore(member: Member) -> None:
            try:
                member.call(
                    "restore",
                    args,
                    progress=counter.for_member(member.pid),
                    silence_timeout=self.ctx.options.agent_timeout,
                )
            except HibernateError as exc:
                with lock:
                    failures.append((member, exc))

        if sleeping:
            raise_first_error(run_each(sleeping, restore, at_once=share.at_once))
        if sleeping and not failures:
            moved = [_wake_entry(m).moved() for m in sleeping]
            self.ctx.sink.ended("restore", *side_by_side(moved))
        if failures:
            self.resume()
            # A process that died is no longer asleep: its memory is gone, and no retry brings it back.
            dead = [member for member, _ in failures if not procinfo.is_alive(member.ref.identity)]
            if dead:
                raise died_during_wake(dead[0].ref)
            member, exc = failures[0]
            raise exc.add_context(
                f"process {member.pid} stays asleep",
                hint=f"fix the cause, then run `hibernate wake {member.pid}` again",
            )

    def resume(self) -> None:
        for member in self.sleeping:
            if member.reached == "restore":
                member.call("resume")

    # -- report ---------------------------------------------------------------------------

    def report(self) -> UnitReport:
        if self.ctx.op == "sleep":
            return UnitReport(
                sleeps=[ProcessSleep.from_answers(m.pid, m.ref.status.name, m.answers) for m in self.members]
            )
        return UnitReport(wakes=[_wake_entry(m) for m in self.sleeping])


def _wake_entry(member: Member) -> ProcessWake:
    status = member.ref.status
    return ProcessWake.from_answers(member.pid, status.name, status.snapshot_path, member.answers)


AgentsUnit.sleep_steps = (
    Step("leases", AgentsUnit.close_leases),  # its gates reopen when the members hang up or resume
    Step("quiesce", AgentsUnit.quiesce, undo=AgentsUnit.undo_sleep),
    Step("spill", AgentsUnit.spill, during=True),
    Step("release", AgentsUnit.release),
)
AgentsUnit.wake_steps = (
    Step("restore", AgentsUnit.restore, during=True),
    Step("resume", AgentsUnit.resume),
)
