"""Connections to the agents taking part in an operation, and what each one reached."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLostError
from hibernate.agent.paths import crash_record_path
from hibernate.agent.wire import AgentState, AgentStatus
from hibernate.errors import HibernateTimeoutError, NoSuchProcessError
from hibernate.operation.targets import AgentRef
from hibernate.procinfo import ProcessIdentity

# Operations after which an agent whose client hangs up goes back to running by itself.
ROLLS_BACK_BY_ITSELF = ("begin", "close_leases", "quiesce", "spill")


def exits(identity: ProcessIdentity, within: float = 2.0) -> bool:
    """Whether a process whose agent just hung up is gone, or goes within ``within`` seconds.

    A dying process's sockets close before /proc shows it gone (the kernel
    closes its files first), so "connection lost" is judged only once the
    process had a moment to finish exiting.
    """
    deadline = time.monotonic() + within
    while procinfo.is_alive(identity):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# The first line the interpreter's fault handler writes for each fatal signal (agent/crash.py).
_FATAL_ERRORS = {
    "Segmentation fault": signal.SIGSEGV,
    "Bus error": signal.SIGBUS,
    "Floating-point exception": signal.SIGFPE,
    "Floating point exception": signal.SIGFPE,
    "Illegal instruction": signal.SIGILL,
    "Aborted": signal.SIGABRT,
}
_CRASH_RECORD_LIMIT = 64 << 10
# What a signal means when it ends a process while its memory is written back.
_LIKELY_CAUSE = {
    signal.SIGBUS: "memory it had mapped could not be backed: a file it mapped was truncated or "
    "removed while it slept, or its huge pages or shared memory ran out",
    signal.SIGKILL: "the kernel's out-of-memory killer, or someone, killed it",
}


def describe_end(wait_status: int | None, crash_record: str) -> str | None:
    """How a process ended, from its wait status (if a zombie's could be read) or its crash record.

    None when neither says: its parent reaped it, and no fault handler wrote anything.
    """
    for line in crash_record.splitlines():
        if line.startswith("Fatal Python error: "):
            fatal = _FATAL_ERRORS.get(line.removeprefix("Fatal Python error: ").strip())
            if fatal is not None:
                return _with_cause(f"killed by {fatal.name}", fatal)
    if wait_status is not None and os.WIFSIGNALED(wait_status):
        number = os.WTERMSIG(wait_status)
        try:
            sig = signal.Signals(number)
        except ValueError:
            return f"killed by signal {number}"
        return _with_cause(f"killed by {sig.name}", sig)
    if wait_status is not None and os.WIFEXITED(wait_status):
        return f"exited with status {os.WEXITSTATUS(wait_status)}"
    return None


def _with_cause(what: str, sig: signal.Signals) -> str:
    cause = _LIKELY_CAUSE.get(sig)
    return f"{what}: {cause}" if cause else what


def how_it_ended(ref: AgentRef) -> str | None:
    """How the process of ``ref`` ended, as far as anyone but its parent can tell (see describe_end)."""
    record = crash_record_path(ref.socket)
    text = ""
    try:
        with open(record, "rb") as f:
            text = f.read(_CRASH_RECORD_LIMIT).decode("utf-8", "replace")
        os.unlink(record)
    except OSError:
        pass
    return describe_end(procinfo.zombie_wait_status(ref.identity), text)


def died_during_wake(ref: AgentRef) -> NoSuchProcessError:
    """The error for a process that died while its memory came back: final, nothing to retry.

    Its snapshot stays (gc deletes it once it sees the process gone), and the
    message says where, for a user who wants to look at what it held.
    """
    how = how_it_ended(ref) or "how it ended is known only to its parent, which has reaped it"
    snapshot = ref.status.snapshot_path
    where = ""
    if snapshot:
        base = Path(snapshot).parent.parent
        where = f"; its snapshot stays in {snapshot} (`hibernate gc {base}` deletes it)"
    return NoSuchProcessError(
        f"process {ref.pid} died during its wake ({how}); the memory it held is lost{where}",
        hint="start the program again: a process that died cannot be woken",
    )


def holds_leases(status: AgentStatus) -> bool:
    """Whether an agent knows leases, from its status: one of a hibernate before them has no
    ``leases`` and no operation to close them, and no proxy can hold a lease there to wait for.

    A target is a long-running process: it may still run the hibernate it was started with
    after the command's was upgraded.
    """
    return status.leases is not None


@dataclass
class Member:
    """One agent taking part in an operation, and what happened to it."""

    ref: AgentRef
    client: AgentClient
    answers: dict[str, dict[str, Any]] = field(default_factory=dict)  # per request, the agent's answer
    reached: str = "connected"
    unresponsive: bool = False  # stopped answering: it is left to roll back by itself

    @property
    def pid(self) -> int:
        return self.ref.pid

    @cached_property
    def begun(self) -> AgentStatus:
        """Its agent's status when the operation began (its answer to ``begin``, asked once)."""
        return AgentStatus.from_wire(self.answers["begin"])

    @property
    def state(self) -> AgentState | None:
        """The state its agent reported when the operation began."""
        return self.begun.state

    def call(self, op: str, args: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            result = self.client.call(op, args, **kwargs)
        except AgentConnectionLostError as exc:
            if exits(self.ref.identity):
                raise NoSuchProcessError(f"process {self.pid} exited during {op}") from exc
            raise
        except HibernateTimeoutError as exc:
            # Hang up: an agent whose client is gone rolls a half-done sleep back to running
            # by itself as soon as it runs again; waiting on it for an undo would hang too.
            self.unresponsive = True
            self.client.close()
            if self.reached in ROLLS_BACK_BY_ITSELF:
                exc.add_consequence(
                    "the connection was closed, so the process goes back to running by itself "
                    "as soon as it answers again"
                )
            raise
        # The step as this command saw it, from request to answer: everything the agent did for it
        # (not only the store's transfer, which it reports as io_seconds) and the round trip.
        result["seconds"] = time.perf_counter() - started
        self.answers[op] = result
        self.reached = op
        return result


def connect_all(refs: Sequence[AgentRef], timeout: float) -> list[Member]:
    """A member for every ref, each told that an operation begins (which also reports its state)."""
    members: list[Member] = []
    try:
        for ref in refs:
            member = Member(ref, ref.connect(timeout))
            members.append(member)
            member.call("begin")
    except BaseException:
        hang_up(members)
        raise
    return members


def hang_up(members: Sequence[Member]) -> None:
    for member in members:
        member.client.close()
