"""Each backend's state, and the one transition at a time that changes it.

    asleep --(a request)--> waking --> awake --(idle, or room for another)--> sleeping --> asleep

A request for a backend that is not awake starts its wake, or joins the one
under way: one wake per transition, however many requests wait. The state
kept here is what the proxy last saw, not the truth: a request is forwarded
only once it holds a lease on every agent of the backend (:mod:`leases`),
which the agents grant only while the process runs and which keeps it running
until given back. A refused lease says what the backend really is: asleep
(put to sleep by another proxy or by hand: woken now), or in the middle of
someone else's sleep or wake (waited for, then looked at again). A transition
runs the same engine as ``hibernate sleep``/``wake``, in a worker thread, so
the proxy keeps serving meanwhile. A failed transition leaves the backend in
the state the engine left it (a failed wake: asleep, recoverable), read back
from its agents, and the next request tries again.

The decisions (which backend is idle, which to put to sleep to make room) are
small pure functions over :class:`Candidate` snapshots, tested on their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hibernate import procinfo
from hibernate.errors import BusyError, HibernateError
from hibernate.serve.config import BackendSpec
from hibernate.serve.control import BackendControl, Inspection
from hibernate.serve.leases import BackendLeases, Verdict
from hibernate.serve.metrics import Recorder
from hibernate.serve.routing import ApiError

log = logging.getLogger("hibernate.serve")
# How often the proxy reads back the real state of backends at rest (changed by hand, e.g.).
REFRESH_SECONDS = 5.0
# How often a request retries its lease while someone else's sleep or wake runs.
RETRY_SECONDS = 0.05


class State(str, Enum):
    AWAKE = "awake"
    ASLEEP = "asleep"
    WAKING = "waking"
    SLEEPING = "sleeping"
    FAILED = "failed"  # not found, or in a state the engine could not settle: retried on the next request


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
    idle: float | None = None  # its own idle time, if it has one


def idle_due(backends: Sequence[Candidate], now: float, idle: float | None) -> list[str]:
    """Awake backends with nothing in flight and no request for their idle time (their own, else
    ``idle``; neither: never)."""
    due = []
    for b in backends:
        limit = b.idle if b.idle is not None else idle
        if limit is not None and b.state is State.AWAKE and b.in_flight == 0 and now - b.last_used >= limit:
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
    idle = [o for o in held if o.state is State.AWAKE and o.in_flight == 0]
    if idle:
        return Room("evict", min(idle, key=lambda o: o.last_used).name)
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
    idle = [o for o in held if o.state is State.AWAKE and o.in_flight == 0]
    if idle:
        return Room("evict", min(idle, key=lambda o: o.last_used).name)
    return Room("wait") if held else Room("never")


@dataclass
class Outcome:
    ok: bool
    reason: str | None = None
    busy: bool = False  # another sleep or wake was under way: nothing was done, try again once it ends


@dataclass
class Backend:
    spec: BackendSpec
    state: State = State.FAILED
    pid: int | None = None
    in_flight: int = 0
    waiting: int = 0
    last_used: float = 0.0
    tracked_bytes: int = 0
    reason: str | None = None  # why the last transition failed, if it did
    transition: asyncio.Task[Outcome] | None = None
    gpu: dict[str, int] = field(default_factory=dict)  # GPU UUID -> bytes, as last seen awake
    leases: BackendLeases | None = None  # links to its agents, opened by the first request
    linking: asyncio.Lock = field(default_factory=asyncio.Lock)  # one opening of the links at a time

    @property
    def name(self) -> str:
        return self.spec.name

    def candidate(self) -> Candidate:
        return Candidate(
            self.name,
            self.state,
            self.tracked_bytes,
            self.last_used,
            self.in_flight,
            self.gpu,
            self.spec.idle,
        )

    def view(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.spec.url,
            "models": list(self.spec.model_names),
            "prefix": self.spec.prefix,
            "state": self.state.value,
            "pid": self.pid,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "tracked_bytes": self.tracked_bytes,
            "idle_seconds": round(max(now - self.last_used, 0.0), 3) if self.last_used else None,
            "reason": self.reason,
        }


class Fleet:
    """Every backend of the proxy, and the transitions between their states."""

    def __init__(
        self,
        specs: Sequence[BackendSpec],
        control: BackendControl,
        recorder: Recorder,
        *,
        idle: float | None,
        wake_timeout: float,
        budget: int | None,
        measure_gpu: bool = False,
    ) -> None:
        self.backends = {spec.name: Backend(spec) for spec in specs}
        self.control = control
        self.recorder = recorder
        self.idle = idle
        self.wake_timeout = wake_timeout
        self.budget = budget
        self.measure_gpu = measure_gpu
        self._room = asyncio.Lock()  # one budget decision (and the wake it makes room for) at a time
        self._released = asyncio.Condition()  # a request ended: a wake waiting for room looks again

    # -- adoption ---------------------------------------------------------------

    async def adopt(self) -> None:
        """Find every backend's process and state; an interrupted sleep or wake is recovered first."""
        await asyncio.gather(*(self._adopt(b) for b in self.backends.values()))
        await self._fit_budget()

    async def _adopt(self, backend: Backend) -> None:
        started = time.monotonic()
        try:
            found = await asyncio.to_thread(self.control.adopt, backend.spec)
        except HibernateError as exc:
            self._set(backend, State.FAILED, reason=exc.message)
            log.warning("%s: not adopted: %s", backend.name, exc.message)
            return
        backend.pid = found.pid
        backend.tracked_bytes = found.tracked_bytes
        backend.last_used = time.monotonic()
        self._set(backend, State.AWAKE if found.awake else State.ASLEEP)
        await self._measure(backend)
        what = f", {found.recovered}" if found.recovered else ""
        log.info(
            "%s: adopted pid %s, %s%s (%.2f s)",
            backend.name, found.pid, backend.state.value, what, time.monotonic() - started,
        )  # fmt: skip

    # -- requests -----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def use(self, name: str) -> AsyncIterator[Backend]:
        """Hold ``name`` awake for one request: leases taken on its agents (woken first if it sleeps);
        counted in flight until the block ends (a streamed answer: until its last byte)."""
        backend = self.backends[name]
        backend.last_used = time.monotonic()  # no idle sleep of ours begins while it takes its leases
        leases = await self._hold(backend)
        backend.in_flight += 1
        self.recorder.in_flight(name, backend.in_flight)
        try:
            yield backend
        finally:
            leases.give_back()
            backend.in_flight -= 1
            backend.last_used = time.monotonic()
            self.recorder.in_flight(name, backend.in_flight)
            async with self._released:
                self._released.notify_all()

    async def _hold(self, backend: Backend) -> BackendLeases:
        """The backend's leases, taken: at once if it runs, else after waking it or waiting for someone
        else's sleep or wake to end, within --wake-timeout (else a 503 that says why)."""
        if backend.state is State.AWAKE:
            verdict, leases = await self._take(backend)
            if leases is not None:
                return leases
            self._learn(backend, verdict)  # what it is, if not awake; else the loop below waits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wake_timeout
        started = time.monotonic()
        backend.waiting += 1
        self.recorder.waiting(backend.name, backend.waiting)
        try:
            while True:
                if backend.state is not State.AWAKE:
                    await self._wait_awake(backend, deadline)
                verdict, leases = await self._take(backend)
                if leases is not None:
                    return leases
                if not self._learn(backend, verdict):
                    await self._pause(backend, deadline, verdict.detail)
        finally:
            backend.waiting -= 1
            self.recorder.waiting(backend.name, backend.waiting)
            self.recorder.waited(backend.name, time.monotonic() - started)

    async def _take(self, backend: Backend) -> tuple[Verdict, BackendLeases | None]:
        """A lease on every agent of the backend (the links to them opened first if need be)."""
        async with backend.linking:
            leases, pid = backend.leases, backend.pid
            if leases is None or leases.pid != pid or not leases.usable:
                if leases is not None:
                    leases.close()
                backend.leases = None
                if pid is None:
                    return Verdict(False, "gone", "its process is not known"), None
                try:
                    sockets = await asyncio.to_thread(self.control.agent_sockets, pid)
                    leases = await BackendLeases.open(pid, sockets)
                except HibernateError as exc:
                    return Verdict(False, "gone", exc.message), None
                backend.leases = leases
        verdict = await leases.take()
        return verdict, leases if verdict.granted else None

    def _learn(self, backend: Backend, verdict: Verdict) -> bool:
        """What a refused lease says of the backend, taken into its state; False when the request can
        only wait (someone else's sleep or wake is under way). A backend whose agents are gone is
        answered 502 at once, and looked for again by the next request."""
        settled = backend.state is State.AWAKE  # no transition of ours: its outcome would be the truth
        if verdict.reason == "asleep":
            if settled:
                log.info("%s: found asleep (changed outside the proxy)", backend.name)
                self._set(backend, State.ASLEEP)
            return True
        if verdict.reason == "gone":
            if backend.pid is not None and _alive(backend.pid):
                return False  # the links broke, not the process: opened again on the next try
            if settled:
                log.warning("%s: its process is gone: %s", backend.name, verdict.detail)
                backend.pid = None
                self._set(backend, State.FAILED, reason=verdict.detail)
            raise ApiError(502, f"backend {backend.name} did not answer: {verdict.detail}", "BadGatewayError")
        if verdict.reason == "failed":
            raise ApiError(
                503,
                f"backend {backend.name}'s agent refused a lease: {verdict.detail}",
                "ServiceUnavailableError",
            )
        return False

    async def _pause(self, backend: Backend, deadline: float, why: str) -> None:
        """A short wait before the next try; a 503 once the wait would pass ``deadline``."""
        loop = asyncio.get_running_loop()
        if loop.time() + RETRY_SECONDS > deadline:
            raise ApiError(
                503,
                f"backend {backend.name} stayed busy past --wake-timeout {self.wake_timeout:g}s ({why}); "
                "retry later",
                "ServiceUnavailableError",
            )
        await asyncio.sleep(RETRY_SECONDS)

    async def _wait_awake(self, backend: Backend, deadline: float) -> None:
        """Until the proxy's view of the backend is awake: its wake started, or the transition under way
        joined; a wake that found someone else's sleep or wake under way is tried again."""
        loop = asyncio.get_running_loop()
        while backend.state is not State.AWAKE:
            if backend.state in (State.ASLEEP, State.FAILED):
                self._begin(backend, State.WAKING, self._wake(backend))
            kind, task = backend.state, backend.transition
            assert task is not None
            remaining = deadline - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                outcome = await asyncio.wait_for(asyncio.shield(task), remaining)
            except TimeoutError:
                raise ApiError(
                    503,
                    f"backend {backend.name} did not wake within --wake-timeout {self.wake_timeout:g}s "
                    f"(it is {backend.state.value}); retry later",
                    "ServiceUnavailableError",
                ) from None
            if kind is State.WAKING and not outcome.ok:
                if outcome.busy:
                    await self._pause(backend, deadline, outcome.reason or "busy")
                    continue
                raise ApiError(
                    503,
                    f"backend {backend.name} could not be woken: {outcome.reason}",
                    "ServiceUnavailableError",
                )

    # -- transitions --------------------------------------------------------------------

    def _set(self, backend: Backend, state: State, reason: str | None = None) -> None:
        backend.state = state
        backend.reason = reason
        self.recorder.state(backend.name, state.value)

    def _begin(self, backend: Backend, state: State, work: Any) -> asyncio.Task[Outcome]:
        self._set(backend, state, backend.reason)
        backend.transition = asyncio.ensure_future(work)
        return backend.transition

    async def _settle(self, backend: Backend, error: HibernateError, op: str, started: float) -> Outcome:
        """After a failed ``op``: the state the engine left, read from the backend's agents."""
        seconds = time.monotonic() - started
        if isinstance(error, BusyError) and op == "wake":
            # Someone else's sleep or wake (or a sleep waiting for their requests): nothing was done.
            # Left asleep in the proxy's view; the request tries again once that operation ends.
            self._set(
                backend, State.ASLEEP if backend.pid is not None else State.FAILED, reason=error.message
            )
            return Outcome(False, error.message, busy=True)
        self.recorder.failed(backend.name, op)
        try:
            found: Inspection = await asyncio.to_thread(self.control.adopt, backend.spec, backend.pid)
        except BusyError:
            # Another operation on it is under way: a sleep of ours that failed left it as it was.
            if op == "sleep":
                backend.last_used = time.monotonic()
            self._set(backend, State.AWAKE if op == "sleep" else State.ASLEEP, reason=error.message)
            log.warning("%s: %s failed after %.2f s: %s", backend.name, op, seconds, error.message)
            return Outcome(False, error.message, busy=True)
        except HibernateError as exc:
            backend.pid = None  # gone, or not ours any more: the next request looks for it again
            self._set(backend, State.FAILED, reason=f"{error.message}; then: {exc.message}")
            log.warning("%s: %s failed after %.2f s: %s", backend.name, op, seconds, backend.reason)
            return Outcome(False, backend.reason)
        backend.pid = found.pid
        if op == "sleep":
            backend.last_used = time.monotonic()  # an idle sleep that failed is tried again an --idle later
        self._set(backend, State.AWAKE if found.awake else State.ASLEEP, reason=error.message)
        log.warning(
            "%s: %s failed after %.2f s, left %s: %s",
            backend.name,
            op,
            seconds,
            backend.state.value,
            error.message,
        )
        # A wake that failed because the backend was already awake (woken from outside) is no failure.
        return Outcome(op == "wake" and found.awake, error.message)

    async def _wake(self, backend: Backend) -> Outcome:
        started = time.monotonic()
        try:
            async with self._room:
                if backend.pid is None:  # not found at adoption (or gone): look again
                    found = await asyncio.to_thread(self.control.adopt, backend.spec)
                    backend.pid, backend.tracked_bytes = found.pid, found.tracked_bytes
                    if found.awake:
                        self._set(backend, State.AWAKE)
                        return Outcome(True)
                await self._make_room(backend, started + self.wake_timeout)
                begun = time.monotonic()
                restored = await asyncio.to_thread(self.control.wake, backend.pid)
        except HibernateError as exc:
            return await self._settle(backend, exc, "wake", started)
        seconds = time.monotonic() - begun
        backend.last_used = time.monotonic()
        self._set(backend, State.AWAKE)
        await self._measure(backend)
        self.recorder.transition(backend.name, "wake", seconds, restored)
        log.info("%s: asleep -> awake (wake %.2f s, %d bytes restored)", backend.name, seconds, restored)
        return Outcome(True)

    async def _measure(self, backend: Backend) -> None:
        """With ``--gpu-budget auto``, what an awake backend holds on each GPU (what its wake will need)."""
        if self.measure_gpu and backend.state is State.AWAKE and backend.pid is not None:
            backend.gpu = await asyncio.to_thread(self.control.gpu_usage, backend.pid)

    async def _room_now(self, backend: Backend) -> Room:
        others = [b.candidate() for b in self.backends.values() if b is not backend]
        if self.measure_gpu:
            free = await asyncio.to_thread(self.control.gpu_free)
            need = await asyncio.to_thread(self.control.gpu_need, backend.pid) if backend.pid else {}
            return plan_room_measured(need or backend.gpu, free, others)
        assert self.budget is not None
        return plan_room(backend.tracked_bytes, self.budget, others)

    async def _make_room(self, backend: Backend, deadline: float) -> None:
        if self.budget is None and not self.measure_gpu:
            return
        while True:
            room = await self._room_now(backend)
            if room.action == "fits":
                return
            if room.action == "never":
                if self.measure_gpu:
                    raise NoRoomError("the GPU memory it needs is held by something other than the backends")
                raise NoRoomError(
                    f"it tracks {backend.tracked_bytes} bytes, more than --gpu-budget {self.budget}"
                )
            if room.action == "evict":
                assert room.victim is not None
                victim = self.backends[room.victim]
                log.info(
                    "%s: put to sleep to make room for %s (least recently used)", victim.name, backend.name
                )
                outcome = await self._begin(victim, State.SLEEPING, self._sleep(victim, "room"))
                if not outcome.ok:  # it is still awake: choosing it again would loop
                    raise NoRoomError(f"putting {victim.name} to sleep to make room failed: {outcome.reason}")
                continue
            sleeping = [
                b.transition for b in self.backends.values() if b.state is State.SLEEPING and b.transition
            ]
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise NoRoomError("the backends holding the budget stayed busy past --wake-timeout")
            if sleeping:
                await asyncio.wait(sleeping, timeout=remaining)
                continue
            async with self._released:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._released.wait(), remaining)

    async def _fit_budget(self) -> None:
        """Backends adopted awake beyond ``--gpu-budget``: the least recently used are put to sleep."""
        if self.budget is None:
            return
        while True:
            room = plan_room(0, self.budget, [b.candidate() for b in self.backends.values()])
            if room.action != "evict" or room.victim is None:
                return
            victim = self.backends[room.victim]
            log.info("%s: put to sleep to fit --gpu-budget (adopted awake)", victim.name)
            outcome = await self._begin(victim, State.SLEEPING, self._sleep(victim, "budget"))
            if not outcome.ok:
                return

    async def _sleep(self, backend: Backend, why: str) -> Outcome:
        started = time.monotonic()
        try:
            if backend.pid is None:
                raise NoRoomError("its process is not known")
            spilled = await asyncio.to_thread(self.control.sleep, backend.pid)
        except HibernateError as exc:
            return await self._settle(backend, exc, "sleep", started)
        seconds = time.monotonic() - started
        self._set(backend, State.ASLEEP)
        self.recorder.transition(backend.name, "sleep", seconds, spilled)
        log.info(
            "%s: awake -> asleep (sleep, %s, %.2f s, %d bytes spilled)", backend.name, why, seconds, spilled
        )
        return Outcome(True)

    # -- idle -------------------------------------------------------------------------

    def sleep_idle(self, now: float) -> list[asyncio.Task[Outcome]]:
        """Start the sleep of every backend idle past its idle time; the tasks started."""
        started = []
        for name in idle_due([b.candidate() for b in self.backends.values()], now, self.idle):
            backend = self.backends[name]
            started.append(self._begin(backend, State.SLEEPING, self._sleep(backend, "idle")))
        return started

    async def watch(self, refresh: float = REFRESH_SECONDS) -> None:
        """Forever: put idle backends to sleep (looking a few times per ``--idle`` period), and every
        ``refresh`` seconds read back the real state of those at rest (a ``hibernate sleep`` or
        ``wake`` run by hand behind the proxy's back)."""
        idles = [t for t in (self.idle, *(b.spec.idle for b in self.backends.values())) if t is not None]
        tick = min(1.0, min(idles) / 4) if idles else refresh
        last_refresh = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last_refresh >= refresh:
                last_refresh = now
                await self.refresh_states()
            self.sleep_idle(time.monotonic())

    async def refresh_states(self) -> None:
        """Read back the state of every backend at rest (no transition, nothing in flight or waiting);
        one whose process cannot be read is marked failed, and looked for again by the next request."""
        for backend in self.backends.values():
            if backend.state not in (State.AWAKE, State.ASLEEP) or backend.in_flight or backend.waiting:
                continue
            before, transition = backend.state, backend.transition
            try:
                found = await asyncio.to_thread(self.control.adopt, backend.spec, backend.pid)
            except BusyError:
                continue  # a `hibernate sleep` or `wake` of someone else is under way: read it next time
            except HibernateError as exc:
                if backend.state is before and backend.transition is transition:
                    # Gone: looked for again by the next request.
                    log.warning("%s: its state could not be read: %s", backend.name, exc.message)
                    backend.pid = None
                    self._set(backend, State.FAILED, reason=exc.message)
                continue
            if backend.state is not before or backend.transition is not transition:
                continue  # something started meanwhile: its own outcome is the truth
            state = State.AWAKE if found.awake else State.ASLEEP
            if state is not before:
                log.info("%s: found %s (changed outside the proxy)", backend.name, state.value)
                backend.last_used = time.monotonic()
                self._set(backend, state)
            await self._measure(backend)

    def close(self) -> None:
        """Let go of the links to the agents (their leases end with them)."""
        for backend in self.backends.values():
            if backend.leases is not None:
                backend.leases.close()
                backend.leases = None

    async def drain(self, timeout: float) -> None:
        """Wait (bounded) for every transition under way to end: a sleep is not left half-done on stop."""
        pending = [b.transition for b in self.backends.values() if b.transition and not b.transition.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)


def _alive(pid: int) -> bool:
    identity = procinfo.identity(pid)
    return identity is not None and procinfo.is_alive(identity)


class NoRoomError(HibernateError):
    """A wake that cannot fit in --gpu-budget (or found no process to act on)."""
