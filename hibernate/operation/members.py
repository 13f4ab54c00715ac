"""Connections to the agents taking part in an operation, and what each one reached."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hibernate import procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLost
from hibernate.errors import HibernateTimeoutError, NoSuchProcessError
from hibernate.procinfo import ProcessIdentity
from hibernate.targets import AgentRef

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


@dataclass
class Member:
    """One agent taking part in an operation, and what happened to it."""

    ref: AgentRef
    client: AgentClient
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    reached: str = "connected"
    unresponsive: bool = False  # stopped answering: it is left to roll back by itself

    @property
    def pid(self) -> int:
        return self.ref.pid

    @property
    def state(self) -> Any:
        """The state its agent reported when the operation began."""
        return self.phases["begin"].get("state")

    def call(self, op: str, args: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            result = self.client.call(op, args, **kwargs)
        except AgentConnectionLost as exc:
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
        # The phase as this command saw it, from request to answer: everything the agent did for it
        # (not only the store's transfer, which it reports as io_seconds) and the round trip.
        result["seconds"] = time.perf_counter() - started
        self.phases[op] = result
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


def parallel(members: Sequence[Member], work: Callable[[Member], object], at_once: int | None = None) -> None:
    """Run ``work`` on every member, ``at_once`` at a time (default: all); re-raise the first failure
    after all finish."""
    if len(members) == 1:
        work(members[0])
        return
    errors: list[BaseException] = []
    with ThreadPoolExecutor(max_workers=max(1, min(len(members), at_once or len(members)))) as pool:
        for future in [pool.submit(work, m) for m in members]:
            exc = future.exception()
            if exc is not None:
                errors.append(exc)
    if errors:
        raise errors[0]
