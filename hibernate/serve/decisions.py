"""Which backend serve puts to sleep, and when: pure decisions over readings of the backends.

A backend's state (:class:`State`) is the one word the proxy keeps for it; a
:class:`Candidate` is what a decision reads of one backend at one instant. Two
decisions are made from them: which awake backends have gone unused past their
idle limit (:func:`idle_due`), and what a wake or a start needs done to fit the
GPU budget (:func:`plan_room`, :func:`plan_room_measured`, :func:`plan_start`).
They live apart from :mod:`.backends`, which acts on them, so that they are
tested on their own, without a proxy, an agent or an event loop.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum


class State(str, Enum):
    """Where a backend is, as the proxy last saw it: ``asleep --> waking --> awake --> sleeping``, and
    ``stopped --> starting --> awake`` for one the proxy starts (the diagram in :mod:`.backends`)."""

    AWAKE = "awake"
    ASLEEP = "asleep"
    WAKING = "waking"
    SLEEPING = "sleeping"
    FAILED = "failed"  # not found, or in a state the engine could not settle: retried on the next request
    STOPPED = "stopped"  # a backend with a command, not running: the next request starts it
    STARTING = "starting"


STATES = tuple(s.value for s in State)


@dataclass(frozen=True)
class Candidate:
    """What a decision needs to know of one backend, at one instant."""

    name: str
    state: State
    tracked_bytes: int
    last_used: float
    in_flight: int
    gpu: Mapping[str, int] = field(default_factory=dict)  # GPU UUID -> bytes, as last seen awake
    idle_limit: float | None = None  # its own idle limit, if it has one (a keep-alive's, or serve.toml's)


def idle_due(backends: Sequence[Candidate], now: float, idle_limit: float | None) -> list[str]:
    """Awake backends with nothing in flight and no request for their idle limit (their own, else
    ``idle_limit``, the proxy's; neither: never)."""
    due = []
    for b in backends:
        limit = b.idle_limit if b.idle_limit is not None else idle_limit
        if (
            limit is not None
            and limit != math.inf
            and b.state is State.AWAKE
            and b.in_flight == 0
            and now - b.last_used >= limit
        ):
            due.append(b.name)
    return due


@dataclass(frozen=True)
class Room:
    """What making room for a wake calls for next: ``action`` is fits, evict, wait (for a sleep under way
    or a request in flight to end) or never (the backend alone is over the budget)."""

    action: str
    victim: str | None = None


def plan_room(need: int, budget: int, others: Sequence[Candidate]) -> Room:
    """The next step to fit ``need`` bytes in ``budget``, the other backends as they are.

    Awake, waking and sleeping backends hold their memory; the least recently
    used awake one with nothing in flight is put to sleep first. One with
    requests in flight is never chosen: the wake waits for it instead.
    """
    if need > budget:
        return Room("never")
    held = [o for o in others if o.state in (State.AWAKE, State.WAKING, State.SLEEPING)]
    if sum(o.tracked_bytes for o in held) + need <= budget:
        return Room("fits")
    sleep_candidates = [o for o in held if o.state is State.AWAKE and o.in_flight == 0]
    if sleep_candidates:
        return Room("evict", min(sleep_candidates, key=lambda o: o.last_used).name)
    return Room("wait")


def plan_start(others: Sequence[Candidate]) -> Room:
    """Room for a server about to start, under a GPU budget: all of it. What it will take is not known
    before it runs (a server that starts takes what memory it finds), so every other backend holding
    memory is put to sleep first, the least recently used first; one with requests in flight is waited
    for. Another backend starting holds nothing yet: starts run one at a time, so any other is queued
    behind this one (it makes its own room when its turn comes)."""
    held = [o for o in others if o.state in (State.AWAKE, State.WAKING, State.SLEEPING)]
    if not held:
        return Room("fits")
    sleep_candidates = [o for o in held if o.state is State.AWAKE and o.in_flight == 0]
    if sleep_candidates:
        return Room("evict", min(sleep_candidates, key=lambda o: o.last_used).name)
    return Room("wait")


def plan_room_measured(need: Mapping[str, int], free: Mapping[str, int], others: Sequence[Candidate]) -> Room:
    """:func:`plan_room` for ``--gpu-budget auto``: the next step to free ``need`` bytes on each GPU.

    Only backends seen holding memory on a GPU that lacks room are candidates;
    with none, the memory is held by something else: it will never fit.
    """
    short = {uuid for uuid, nbytes in need.items() if free.get(uuid, 0) < nbytes}
    if not short:
        return Room("fits")
    held = [
        o
        for o in others
        if o.state in (State.AWAKE, State.WAKING, State.SLEEPING) and any(o.gpu.get(u, 0) for u in short)
    ]
    sleep_candidates = [o for o in held if o.state is State.AWAKE and o.in_flight == 0]
    if sleep_candidates:
        return Room("evict", min(sleep_candidates, key=lambda o: o.last_used).name)
    return Room("wait") if held else Room("never")
