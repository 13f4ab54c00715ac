"""Leases: requests in flight through a proxy (``hibernate serve``) that hold this process awake.

A proxy takes a lease before it forwards a request and gives it back once the
answer has gone out, over a connection to the agent that it keeps open. A
lease belongs to that connection: a proxy that dies or hangs up gives all of
its leases back, so none can outlive its holder.

A lease is granted only while the process runs and no sleep waits; otherwise
the refusal says why (asleep: wake it; an operation under way: wait for it).
A sleep, from anywhere, first *closes the gate*: new leases are refused from
then on, so a stream of requests cannot hold it off forever, and it waits for
those held to be given back, up to its timeout, after which the gate reopens
and the sleep fails as busy, naming the holders, with nothing changed. The gate
stays closed until whoever closed it resumes the process, fails, or goes away.

Every transition away from ``running`` begins by closing the gate (the
quiesce does, and the flows do before anything else), so a granted lease means
"running, and staying so until given back".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hibernate.errors import AbortedError, BusyError, UsageError

POLL_SECONDS = 0.1  # how often a waiting sleep looks whether its client went away


@dataclass
class _Holder:
    description: str
    count: int = 0


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


class Leases:
    """The leases of one process, by holder (a connection's session), and the gate a sleep closes."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held: dict[object, _Holder] = {}
        self._closers: dict[object, str] = {}  # who closed the gate, in words

    @property
    def held(self) -> int:
        with self._cond:
            return sum(h.count for h in self._held.values())

    def summary(self) -> dict[str, Any]:
        """For ``status``: how many are held, by whom, and who keeps new ones out."""
        with self._cond:
            return {
                "held": sum(h.count for h in self._held.values()),
                "holders": [{"by": h.description, "count": h.count} for h in self._held.values()],
                "closed_by": sorted(set(self._closers.values())),
            }

    def take(
        self, holder: object, description: str, refusal: Callable[[], dict[str, Any] | None]
    ) -> dict[str, Any]:
        """One more lease for ``holder``, unless the gate is closed or ``refusal`` (the process's state,
        read under the same lock) says no; the answer says which."""
        with self._cond:
            if self._closers:
                return {"granted": False, "reason": "closed", "by": sorted(set(self._closers.values()))}
            refused = refusal()
            if refused is not None:
                return {"granted": False, **refused}
            entry = self._held.setdefault(holder, _Holder(description))
            entry.description = description
            entry.count += 1
            return {"granted": True, "held": entry.count}

    def give_back(self, holder: object) -> int:
        """One lease of ``holder`` given back; how many it still holds."""
        with self._cond:
            entry = self._held.get(holder)
            if entry is None or entry.count == 0:
                raise UsageError("no lease is held on this connection")
            entry.count -= 1
            if entry.count == 0:
                del self._held[holder]
                self._cond.notify_all()
            return entry.count

    def close(
        self,
        closer: object,
        description: str,
        what: str,
        timeout: float,
        cancelled: Callable[[], bool] | None = None,
    ) -> float:
        """Close the gate for ``closer`` and wait until no lease is held; the seconds waited.

        On timeout (BusyError, naming the holders) or when ``cancelled`` says so
        (AbortedError) the gate is reopened if this call closed it.
        """
        started = time.monotonic()
        deadline = started + timeout
        with self._cond:
            added = closer not in self._closers
            self._closers[closer] = description
            try:
                while any(h.count for h in self._held.values()):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise BusyError(
                            f"{what} is held awake by {self._describe_holders()}; nothing was changed",
                            hint="retry once they have finished, or raise --timeout",
                        )
                    if cancelled is not None and cancelled():
                        raise AbortedError("the sleep was called off while waiting for requests in flight")
                    self._cond.wait(min(remaining, POLL_SECONDS))
            except BaseException:
                if added:
                    self._closers.pop(closer, None)
                raise
        return time.monotonic() - started

    def reopen(self, closer: object) -> None:
        with self._cond:
            self._closers.pop(closer, None)

    def drop(self, party: object) -> None:
        """A connection went away: its leases are given back and a gate it closed reopens."""
        with self._cond:
            self._closers.pop(party, None)
            if self._held.pop(party, None) is not None:
                self._cond.notify_all()

    def _describe_holders(self) -> str:
        return "; ".join(
            f"{plural(h.count, 'request')} in flight through {h.description}" for h in self._held.values()
        )
