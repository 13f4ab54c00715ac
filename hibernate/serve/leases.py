"""The proxy's side of leases (:mod:`hibernate.agent.leases`): a forwarded request holds its backend awake.

For each backend the proxy keeps a connection open to every agent of its
process tree. Before it forwards a request it takes a lease on each of them
(one round trip, to all agents at once); once the answer has gone out it gives
them back without waiting for the reply. A granted lease is the backend's real
state, read at that instant: awake, and kept so until given back, whoever
else wants it asleep (another proxy, ``hibernate sleep`` by hand). A refusal
says why: asleep (wake it), or an operation under way (wait for its end).

A lease per request, rather than one held while any request is in flight: the
agent then knows how many requests hold it (``hibernate status``, and the
error of a sleep that waited for them names them), the proxy needs no state
that could disagree with the agent's, and the cost is one round trip on a Unix
socket already open (scripts/bench-serve measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hibernate.agent import protocol
from hibernate.agent.client import AgentConnectionLostError
from hibernate.agent.wire import LeaseArgs
from hibernate.errors import HibernateError, error_from_wire

HOLDER = "hibernate serve"  # what the agent calls the holder of these leases
ANSWER_SECONDS = 10.0  # an agent that does not answer a lease within this is treated as gone


class AgentLink:
    """One open connection to one agent; requests are pipelined, replies matched to them by id."""

    def __init__(self, path: Path, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.path = path
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._lost: HibernateError | None = None
        self._replies = asyncio.ensure_future(self._read_replies())

    @classmethod
    async def open(cls, path: Path) -> AgentLink:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), ANSWER_SECONDS)
        except (OSError, TimeoutError) as exc:
            raise AgentConnectionLostError(f"no agent answers at {path}: {exc}") from None
        return cls(path, reader, writer)

    @property
    def alive(self) -> bool:
        return self._lost is None

    def _send(self, op: str, args: dict[str, Any] | None) -> int:
        if self._lost is not None:
            raise self._lost
        request_id = next(self._ids)
        self._writer.write(protocol.encode(protocol.request(request_id, op, args)))
        return request_id

    async def call(self, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send ``op`` and wait for its result (an agent's error is raised as it was sent)."""
        request_id = self._send(op, args)
        answer = self._waiting[request_id] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(answer, ANSWER_SECONDS)
        except TimeoutError:
            self._fail(AgentConnectionLostError(f"the agent at {self.path} did not answer {op!r} in time"))
            raise self._lost or AgentConnectionLostError(str(self.path)) from None
        finally:
            self._waiting.pop(request_id, None)

    def cast(self, op: str, args: dict[str, Any] | None = None) -> None:
        """Send ``op`` without waiting for its reply (read and dropped when it comes)."""
        with contextlib.suppress(HibernateError):
            self._send(op, args)

    async def _read_replies(self) -> None:
        try:
            while True:
                length = protocol.body_length(await self._reader.readexactly(protocol.HEADER_BYTES))
                message = protocol.decode(await self._reader.readexactly(length))
                self._deliver(message)
        except (OSError, asyncio.IncompleteReadError) as exc:
            self._fail(AgentConnectionLostError(f"the agent at {self.path} went away ({exc})"))
        except HibernateError as exc:
            self._fail(exc)

    def _deliver(self, message: dict[str, Any]) -> None:
        request_id, kind = message.get("id"), message.get("type")
        if request_id == 0 and kind == "error":  # about the connection itself: it ends
            raise error_from_wire(message.get("error"))
        answer = self._waiting.get(request_id) if isinstance(request_id, int) else None
        if answer is None or answer.done():
            return  # the reply to a cast, or to a call given up on
        if kind == "result":
            result = message.get("result")
            answer.set_result(result if isinstance(result, dict) else {})
        elif kind == "error":
            answer.set_exception(error_from_wire(message.get("error")))

    def _fail(self, error: HibernateError) -> None:
        if self._lost is None:
            self._lost = error
        for answer in self._waiting.values():
            if not answer.done():
                answer.set_exception(self._lost)
        self._writer.close()

    def close(self) -> None:
        self._fail(AgentConnectionLostError(f"closed by the proxy ({self.path})"))
        self._replies.cancel()


@dataclass(frozen=True)
class Verdict:
    """What taking the leases of a backend found: ``granted``, else why not.

    ``reason``: asleep (nobody is waking it), busy (a sleep or wake is under way,
    or a sleep waits for requests in flight), gone (an agent's connection was
    lost: its process exited, or it did not answer), failed (an agent answered
    with an error: one of another hibernate version, say).
    """

    granted: bool
    reason: str = ""
    detail: str = ""


class BackendLeases:
    """Links to every agent of one backend's process (``pid``), and the leases taken over them."""

    def __init__(self, pid: int, links: Sequence[AgentLink]) -> None:
        self.pid = pid
        self.links = list(links)

    @classmethod
    async def open(cls, pid: int, sockets: Sequence[Path]) -> BackendLeases:
        links: list[AgentLink] = []
        try:
            for path in sockets:
                links.append(await AgentLink.open(path))
        except BaseException:
            for link in links:
                link.close()
            raise
        return cls(pid, links)

    @property
    def usable(self) -> bool:
        """Every link still open (none at all: a backend whose agents predate leases, nothing to take)."""
        return all(link.alive for link in self.links)

    async def take(self) -> Verdict:
        """A lease on every agent, or none: those granted are given back when another is refused."""
        asked = asyncio.gather(
            *(link.call("lease", LeaseArgs(HOLDER).to_wire()) for link in self.links), return_exceptions=True
        )
        try:
            answers = await asyncio.shield(asked)
        except asyncio.CancelledError:  # the client left: what is granted meanwhile goes back at once
            asked.add_done_callback(self._give_back_when_answered)
            raise
        if all(_granted(a) for a in answers):
            return Verdict(True)
        self._give_back_granted(answers)
        return refusal(answers)

    def _give_back_when_answered(self, asked: asyncio.Future[list[dict[str, Any] | BaseException]]) -> None:
        if not asked.cancelled():
            self._give_back_granted(asked.result())

    def _give_back_granted(self, answers: Sequence[object]) -> None:
        for link, answer in zip(self.links, answers, strict=True):
            if _granted(answer):
                link.cast("unlease")

    def give_back(self) -> None:
        for link in self.links:
            link.cast("unlease")

    def close(self) -> None:
        for link in self.links:
            link.close()


def _granted(answer: object) -> bool:
    return isinstance(answer, dict) and answer.get("granted") is True


def refusal(answers: Sequence[object]) -> Verdict:
    """The verdict of a set of agents' answers when not all granted: gone first (an error), then
    busy (an operation under way somewhere), then asleep."""
    for answer in answers:
        if isinstance(answer, (AgentConnectionLostError, OSError)):
            return Verdict(False, "gone", str(answer))
        if isinstance(answer, BaseException):
            words = answer.message if isinstance(answer, HibernateError) else repr(answer)
            return Verdict(False, "failed", words)
    refused = [a for a in answers if isinstance(a, dict) and not _granted(a)]
    busy = [a for a in refused if a.get("reason") != "asleep"]
    if busy:
        by = ", ".join(str(b) for a in busy for b in a.get("by") or [])
        state = busy[0].get("state")
        words = f"a sleep or wake is under way{f' ({by})' if by else ''}" + (
            f", it is {state}" if state else ""
        )
        return Verdict(False, "busy", words)
    return Verdict(False, "asleep", "asleep")
