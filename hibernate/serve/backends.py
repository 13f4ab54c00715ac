"""Each backend's state, and the one transition at a time that changes it.

    asleep --(a request)--> waking --> awake --(idle, or room for another)--> sleeping --> asleep
    stopped --(a request)--> starting --> awake      (a backend with a command, not running yet)

A request for a backend that is not awake starts its wake, or joins the one
under way: one wake per transition, however many requests wait. The state
kept here is what the proxy last saw, not the truth: a request is forwarded
only once it holds a lease on every agent of the backend (:mod:`leases`),
which the agents grant only while the process is awake and which keeps it awake
until given back. A refused lease says what the backend really is: asleep
(put to sleep by another proxy or by hand: woken now), or in the middle of
someone else's sleep or wake (waited for, then looked at again). A transition
runs the same engine as ``hibernate sleep``/``wake``, in a worker thread, so
the proxy keeps serving meanwhile. A failed transition leaves the backend in
the state the engine left it (a failed wake: asleep, recoverable), read back
from its agents, and the next request tries again.

The decisions (which backend is idle, which to put to sleep to make room) are
small pure functions over :class:`Candidate` readings, in :mod:`.decisions`;
this module acts on them. What starts a backend's command and waits for it to
be ready is :mod:`.starter`; what a request's keep-alive asks is read by
:mod:`.proxy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.errors import BusyError, HibernateError, NoSuchProcessError
from hibernate.serve import starter
from hibernate.serve.config import BackendSpec
from hibernate.serve.control import BackendControl, Inspection
from hibernate.serve.decisions import (
    Candidate,
    Room,
    State,
    idle_due,
    plan_room,
    plan_room_measured,
    plan_start,
)
from hibernate.serve.leases import BackendLeases, Verdict
from hibernate.serve.metrics import Recorder
from hibernate.serve.routing import ApiError

log = logging.getLogger("hibernate.serve")
# How often the proxy reads back the real state of backends at rest (changed by hand, e.g.).
REFRESH_SECONDS = 5.0
# How often a request retries its lease while someone else's sleep or wake runs.
RETRY_SECONDS = 0.05
# Retry-After of a 503 (seconds): the proxy is full; a transition is under way or failed.
RETRY_FULL_SECONDS = 1
RETRY_BUSY_SECONDS = 5
RETRY_FAILED_SECONDS = 10
EXIT_WAIT_SECONDS = 1.0  # for a started process whose agent vanished to finish exiting


def joined_reasons(first: str, then: str) -> str:
    """Why a transition failed, then why reading the backend back failed too: once if they say the same."""
    if then == first or then in first:
        return first
    if first in then:
        return then
    return f"{first}; then: {then}"


@dataclass
class TransitionOutcome:
    """How one transition of a backend (a start, wake or sleep) ended, as the requests waiting read it."""

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
    transition: asyncio.Task[TransitionOutcome] | None = None
    gpu: dict[str, int] = field(default_factory=dict)  # GPU UUID -> bytes, as last seen awake
    leases: BackendLeases | None = None  # links to its agents, opened by the first request
    linking: asyncio.Lock = field(default_factory=asyncio.Lock)  # one opening of the links at a time
    keep_alive: float | None = None  # the last request's keep-alive, in place of its idle limit
    process: subprocess.Popen[bytes] | None = None  # started by the proxy (its command)
    log: Path | None = None  # where that process writes

    @property
    def idle_limit(self) -> float | None:
        """How long it may go unused before it is put to sleep: the last request's keep-alive, else its
        own limit; None: the proxy's."""
        return self.keep_alive if self.keep_alive is not None else self.spec.idle_limit

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
            self.idle_limit,
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
        idle_limit: float | None,
        wake_timeout: float,
        budget: int | None,
        measure_gpu: bool = False,
    ) -> None:
        self.backends = {spec.name: Backend(spec) for spec in specs}
        self.control = control
        self.recorder = recorder
        self.idle_limit = idle_limit
        self.wake_timeout = wake_timeout
        self.budget = budget
        self.measure_gpu = measure_gpu
        self._room = asyncio.Lock()  # one budget decision (and the wake it makes room for) at a time
        self._released = asyncio.Condition()  # a request ended: a wake waiting for room looks again
        self._starting = asyncio.Lock()  # one start of a backend's command at a time
        self._log_dir: Path | None = None  # where started commands write (created by the first start)
        self.stopping = threading.Event()  # serve is stopping: no command is started, none waited for
        for backend in self.backends.values():
            recorder.register(backend.name, backend.state.value, backend.spec.model_names)

    # -- adoption ---------------------------------------------------------------

    async def adopt(self) -> None:
        """Find every backend's process and state; an interrupted sleep or wake is recovered first."""
        await asyncio.gather(*(self._adopt(b) for b in self.backends.values()))
        await self._fit_budget()

    async def _adopt(self, backend: Backend) -> None:
        started = time.monotonic()
        try:
            found = await asyncio.to_thread(self.control.adopt, backend.spec)
        except NoSuchProcessError as exc:
            if backend.spec.command:
                self._set(backend, State.STOPPED)
                log.info("%s: not running; its first request starts it", backend.name)
                return
            self._set(backend, State.FAILED, reason=exc.message)
            log.warning("%s: not adopted: %s", backend.name, exc.message)
            return
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
    async def use(self, name: str, keep_alive: float | None = None) -> AsyncIterator[Backend]:
        """Hold ``name`` awake for one request: leases taken on its agents (woken first if it sleeps);
        counted in flight until the block ends (a streamed answer: until its last byte).

        ``keep_alive`` (seconds; 0: sleep once this request ends; inf: no idle sleep) takes the place
        of the backend's idle limit until the next request, which sets its own (or none: the idle limit
        configured)."""
        backend = self.backends[name]
        backend.last_used = time.monotonic()  # no idle sleep of ours begins while it takes its leases
        leases = await self._hold(backend)
        backend.keep_alive = keep_alive  # only a request that is served changes it
        backend.in_flight += 1
        self.recorder.in_flight(name, backend.in_flight)
        try:
            yield backend
        finally:
            leases.give_back()
            backend.in_flight -= 1
            backend.last_used = time.monotonic()
            self.recorder.in_flight(name, backend.in_flight)
            if backend.keep_alive == 0 and backend.in_flight == 0:
                self.sleep_idle(backend.last_used)  # "sleep right after this one"
            async with self._released:
                self._released.notify_all()

    @contextlib.asynccontextmanager
    async def probe(self, name: str) -> AsyncIterator[Backend | None]:
        """A probe of ``name`` (health, metrics): the backend held awake for it if it is awake now, else
        None. It never wakes the backend, nor counts as use: its idle time runs on."""
        backend = self.backends[name]
        leases = None
        if backend.state is State.AWAKE:
            verdict, leases = await self._take(backend)
            if leases is None and verdict.reason == "asleep":
                await self._learn(backend, verdict)
            elif leases is None and verdict.reason == "gone":
                await self._found_gone(backend, verdict)  # its state said, not a 502: a probe answers it
        try:
            yield backend if leases is not None else None
        finally:
            if leases is not None:
                leases.give_back()

    async def wake_now(self, name: str) -> Backend:
        """Wake ``name`` (or start it) if it is not awake, within --wake-timeout; as a request would,
        without one to forward. Its idle time starts now."""
        backend = self.backends[name]
        deadline = asyncio.get_running_loop().time() + self.patience(backend)
        backend.keep_alive = None
        await self._wait_awake(backend, deadline)
        backend.last_used = time.monotonic()
        return backend

    async def sleep_now(self, name: str) -> TransitionOutcome:
        """Put ``name`` to sleep now, whatever its idle limit, once any transition under way has ended.
        Requests in flight through the proxy hold it awake: the sleep waits for them briefly, then gives
        up (busy). A backend not awake is left as it is."""
        backend = self.backends[name]
        while backend.transition is not None and not backend.transition.done():
            await asyncio.shield(backend.transition)
        if backend.state is not State.AWAKE:
            return TransitionOutcome(True)
        return await self._begin(backend, State.SLEEPING, self._sleep(backend, "asked"))

    def patience(self, backend: Backend) -> float:
        """How long a request waits for its backend to be awake: --wake-timeout, or its start_timeout if
        it has a command and that is longer (a start may have to come first)."""
        if backend.spec.command:
            return max(self.wake_timeout, backend.spec.start_timeout)
        return self.wake_timeout

    def _within(self, backend: Backend) -> str:
        """The limit :meth:`patience` took, as a 503 names it."""
        if backend.spec.command and self.patience(backend) > self.wake_timeout:
            return f"its start_timeout {self.patience(backend):g}s"
        return f"--wake-timeout {self.wake_timeout:g}s"

    def startable(self, backend: Backend) -> bool:
        """Whether the next request starts the backend's command: it has one, and no process of it is
        known (none ever found, or the one the proxy started has exited)."""
        if not backend.spec.command or backend.pid is not None:
            return False
        return backend.process is None or backend.process.poll() is not None

    def stop_starting(self) -> None:
        """On stop, first: a start under way gives up at once (its command stopped, its requests answered
        503) instead of holding the shutdown for its start_timeout; none begins."""
        self.stopping.set()

    async def stop_started(self, timeout: float) -> list[tuple[str, int]]:
        """Stop every process the proxy started (SIGTERM to its group, SIGKILL after ``timeout``); the
        backends whose process was still running, with its pid (what the last log line names)."""
        started = [(b.name, b.process) for b in self.backends.values() if b.process is not None]
        running = [(name, proc.pid) for name, proc in started if proc.poll() is None]
        await asyncio.gather(*(asyncio.to_thread(starter.stop, proc, timeout) for _, proc in started))
        return running

    async def _hold(self, backend: Backend) -> BackendLeases:
        """The backend's leases, taken: at once if it is awake, else after waking it or waiting for someone
        else's sleep or wake to end, within --wake-timeout (else a 503 that says why)."""
        if backend.state is State.AWAKE:
            verdict, leases = await self._take(backend)
            if leases is not None:
                return leases
            await self._learn(backend, verdict)  # what it is, if not awake; else the loop below waits
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.patience(backend)
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
                if not await self._learn(backend, verdict):
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

    async def _learn(self, backend: Backend, verdict: Verdict) -> bool:
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
            if not await self._found_gone(backend, verdict):
                return False  # the links broke, not the process: opened again on the next try
            if backend.state is State.STOPPED:
                return True  # its command is started again, for this very request
            raise ApiError(502, f"backend {backend.name} did not answer: {verdict.detail}", "BadGatewayError")
        if verdict.reason == "failed":
            raise ApiError(
                503,
                f"backend {backend.name}'s agent refused a lease: {verdict.detail}",
                "ServiceUnavailableError",
                retry_after=RETRY_FAILED_SECONDS,
            )
        return False

    async def _found_gone(self, backend: Backend, verdict: Verdict) -> bool:
        """Whether the backend's process is really gone (else only the links to its agents broke), taken
        into its state if no transition of ours runs: stopped if it has a command (the next request, or
        this one, starts it again), else failed (looked for again by the next request)."""
        if backend.pid is not None and _alive(backend.pid):
            return False
        await _exit_of(backend.process)  # one the proxy started: reaped, not left a zombie
        if backend.state is State.AWAKE:
            log.warning("%s: its process is gone: %s", backend.name, verdict.detail)
            self._lost(backend, verdict.detail)
        return True

    def _lost(self, backend: Backend, reason: str) -> None:
        """A backend whose process was found gone: stopped if the proxy can start it again, else failed."""
        backend.pid = None
        self._set(backend, State.STOPPED if self.startable(backend) else State.FAILED, reason=reason)

    async def _pause(self, backend: Backend, deadline: float, why: str) -> None:
        """A short wait before the next try; a 503 once the wait would pass ``deadline``."""
        loop = asyncio.get_running_loop()
        if loop.time() + RETRY_SECONDS > deadline:
            raise ApiError(
                503,
                f"backend {backend.name} stayed busy past {self._within(backend)} ({why}); retry later",
                "ServiceUnavailableError",
                retry_after=RETRY_BUSY_SECONDS,
            )
        await asyncio.sleep(RETRY_SECONDS)

    async def _wait_awake(self, backend: Backend, deadline: float) -> None:
        """Until the proxy's view of the backend is awake: its wake started, or the transition under way
        joined; a wake that found someone else's sleep or wake under way is tried again."""
        loop = asyncio.get_running_loop()
        while backend.state is not State.AWAKE:
            if backend.state in (State.STOPPED, State.FAILED) and self.startable(backend):
                self._begin(backend, State.STARTING, self._start(backend))
            elif backend.state in (State.ASLEEP, State.FAILED):
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
                    f"backend {backend.name} did not wake within {self._within(backend)} "
                    f"(it is {backend.state.value}); "
                    "retry later",
                    "ServiceUnavailableError",
                    retry_after=RETRY_BUSY_SECONDS,
                ) from None
            if kind in (State.WAKING, State.STARTING) and not outcome.ok:
                if outcome.busy:
                    await self._pause(backend, deadline, outcome.reason or "busy")
                    continue
                what = "woken" if kind is State.WAKING else "started"
                raise ApiError(
                    503,
                    f"backend {backend.name} could not be {what}: {outcome.reason}",
                    "ServiceUnavailableError",
                    retry_after=RETRY_FAILED_SECONDS,
                )

    # -- transitions --------------------------------------------------------------------

    def _set(self, backend: Backend, state: State, reason: str | None = None) -> None:
        backend.state = state
        backend.reason = reason
        self.recorder.state(backend.name, state.value)
        self.recorder.tracked(backend.name, backend.tracked_bytes)

    def _begin(self, backend: Backend, state: State, work: Any) -> asyncio.Task[TransitionOutcome]:
        self._set(backend, state, backend.reason)
        backend.transition = asyncio.ensure_future(self._ended(backend, state, work))
        return backend.transition

    async def _ended(self, backend: Backend, state: State, work: Any) -> TransitionOutcome:
        """``work``'s outcome, whatever becomes of it. Each transition settles its own failures; one
        that escapes it all the same (from reading the state back after a failure, say) still ends the
        transition as a failure: the backend is never left starting, waking or sleeping, where every
        request for it would wait on a transition that is over. Stopped if its command can be started
        again, else failed (looked for again by the next request)."""
        try:
            outcome: TransitionOutcome = await work
            return outcome
        except Exception as exc:
            reason = as_error(exc).message
            if backend.state is state:
                settled = State.STOPPED if self.startable(backend) else State.FAILED
                if settled is State.FAILED:
                    backend.pid = None
                self._set(backend, settled, reason=reason)
            log.warning("%s: %s failed: %s", backend.name, state.value, reason)
            return TransitionOutcome(False, reason)

    async def _settle(
        self, backend: Backend, error: HibernateError, op: str, started: float
    ) -> TransitionOutcome:
        """After a failed ``op``: the state the engine left, read from the backend's agents."""
        seconds = time.monotonic() - started
        if isinstance(error, BusyError) and op == "wake":
            # Someone else's sleep or wake (or a sleep waiting for their requests): nothing was done.
            # Left asleep in the proxy's view; the request tries again once that operation ends.
            self._set(
                backend, State.ASLEEP if backend.pid is not None else State.FAILED, reason=error.message
            )
            return TransitionOutcome(False, error.message, busy=True)
        self.recorder.failed(backend.name, op)
        try:
            found: Inspection = await asyncio.to_thread(self.control.adopt, backend.spec, backend.pid)
        except BusyError:
            # Another operation on it is under way: a sleep of ours that failed left it as it was.
            if op == "sleep":
                backend.last_used = time.monotonic()
            self._set(backend, State.AWAKE if op == "sleep" else State.ASLEEP, reason=error.message)
            log.warning("%s: %s failed after %.2f s: %s", backend.name, op, seconds, error.message)
            return TransitionOutcome(False, error.message, busy=True)
        except HibernateError as exc:
            backend.pid = None  # gone, or not ours any more: the next request looks for it again
            self._set(backend, State.FAILED, reason=joined_reasons(error.message, exc.message))
            log.warning("%s: %s failed after %.2f s: %s", backend.name, op, seconds, backend.reason)
            return TransitionOutcome(False, backend.reason)
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
        return TransitionOutcome(op == "wake" and found.awake, error.message)

    async def _wake(self, backend: Backend) -> TransitionOutcome:
        started = time.monotonic()
        try:
            async with self._room:
                if backend.pid is None:  # not found at adoption (or gone): look again
                    found = await asyncio.to_thread(self.control.adopt, backend.spec)
                    backend.pid, backend.tracked_bytes = found.pid, found.tracked_bytes
                    if found.awake:
                        self._set(backend, State.AWAKE)
                        return TransitionOutcome(True)
                await self._make_room(backend, started + self.wake_timeout)
                begun = time.monotonic()
                restored = await asyncio.to_thread(self.control.wake, backend.pid)
        except Exception as exc:  # any failure: the state is read back, never left waking
            return await self._settle(backend, as_error(exc), "wake", started)
        seconds = time.monotonic() - begun
        backend.last_used = time.monotonic()
        self._set(backend, State.AWAKE)
        await self._measure(backend)
        self.recorder.transition(backend.name, "wake", seconds, restored=restored)
        log.info("%s: asleep -> awake (wake %.2f s, %d bytes restored)", backend.name, seconds, restored)
        return TransitionOutcome(True)

    async def _start(self, backend: Backend) -> TransitionOutcome:
        """Run the backend's command and wait for it to be ready, one start at a time; under a GPU
        budget every other backend holding memory is put to sleep first. A server found listening on
        its address meanwhile (started by hand) is adopted instead."""
        spec, started = backend.spec, time.monotonic()
        budgeted = self.budget is not None or self.measure_gpu
        try:
            async with self._starting, self._room if budgeted else contextlib.nullcontext():
                try:
                    found = await asyncio.to_thread(self.control.adopt, spec)
                except NoSuchProcessError:
                    if budgeted:
                        await self._make_room(backend, started + spec.start_timeout, starting=True)
                    found = await self._run_command(backend)
        except Exception as exc:  # any failure ends the start stopped, never starting
            message = as_error(exc).message
            self.recorder.failed(backend.name, "start")
            tail = starter.tail(backend.log) if backend.log is not None else ""
            where = f" (log {backend.log})" if backend.log is not None else ""
            reason = f"{message}{where}" + (f"; its log ends:\n{tail}" if tail else "")
            self._set(backend, State.STOPPED, reason=reason)
            log.warning(
                "%s: start failed after %.2f s: %s%s",
                backend.name,
                time.monotonic() - started,
                message,
                where,
            )
            return TransitionOutcome(False, reason)
        seconds = time.monotonic() - started
        backend.pid, backend.tracked_bytes = found.pid, found.tracked_bytes
        backend.last_used = time.monotonic()
        self._set(backend, State.AWAKE if found.awake else State.ASLEEP)
        await self._measure(backend)
        self.recorder.transition(backend.name, "start", seconds)
        log.info(
            "%s: stopped -> %s (started pid %d in %.2f s, log %s)",
            backend.name, backend.state.value, found.pid, seconds, backend.log,
        )  # fmt: skip
        return TransitionOutcome(True)

    async def _run_command(self, backend: Backend) -> Inspection:
        spec = backend.spec
        if self._log_dir is None:
            self._log_dir = await asyncio.to_thread(starter.log_directory)
        backend.log = starter.log_path(self._log_dir, spec.name)
        log.info("%s: starting: %s (log %s)", spec.name, " ".join(spec.command), backend.log)
        if self.stopping.is_set():
            raise starter.StartError(f"backend {spec.name}: not started: serve is stopping")
        await asyncio.to_thread(_spawn, backend, backend.log)
        proc = backend.process
        assert proc is not None
        try:
            await asyncio.to_thread(starter.wait_ready, spec, proc, spec.start_timeout, self.stopping)
            return await asyncio.to_thread(self.control.adopt, spec)
        except BaseException:
            await asyncio.to_thread(starter.stop, proc, 10.0)
            raise

    async def _measure(self, backend: Backend) -> None:
        """With ``--gpu-budget auto``, what an awake backend holds on each GPU (what its wake will need)."""
        if self.measure_gpu and backend.state is State.AWAKE and backend.pid is not None:
            backend.gpu = await asyncio.to_thread(self.control.gpu_usage, backend.pid)

    async def _room_now(self, backend: Backend, starting: bool = False) -> Room:
        others = [b.candidate() for b in self.backends.values() if b is not backend]
        if starting:
            return plan_start(others)
        if self.measure_gpu:
            free = await asyncio.to_thread(self.control.gpu_free)
            need = await asyncio.to_thread(self.control.gpu_need, backend.pid) if backend.pid else {}
            return plan_room_measured(need or backend.gpu, free, others)
        assert self.budget is not None
        return plan_room(backend.tracked_bytes, self.budget, others)

    async def _make_room(self, backend: Backend, deadline: float, starting: bool = False) -> None:
        if self.budget is None and not self.measure_gpu:
            return
        while True:
            room = await self._room_now(backend, starting)
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
                within = f"--wake-timeout {self.wake_timeout:g}s"
                if starting:
                    within = f"its start_timeout {backend.spec.start_timeout:g}s"
                raise NoRoomError(f"the backends holding the budget stayed busy past {within}")
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

    async def _sleep(self, backend: Backend, why: str) -> TransitionOutcome:
        started = time.monotonic()
        try:
            if backend.pid is None:
                raise NoRoomError("its process is not known")
            written, reused = await asyncio.to_thread(self.control.sleep, backend.pid)
        except Exception as exc:  # any failure: the state is read back, never left sleeping
            return await self._settle(backend, as_error(exc), "sleep", started)
        seconds = time.monotonic() - started
        self._set(backend, State.ASLEEP)
        self.recorder.transition(backend.name, "sleep", seconds, written, reused)
        log.info(
            "%s: awake -> asleep (sleep, %s, %.2f s, %d bytes spilled: %d written, %d reused)",
            backend.name, why, seconds, written + reused, written, reused,
        )  # fmt: skip
        return TransitionOutcome(True)

    # -- idle -------------------------------------------------------------------------

    def sleep_idle(self, now: float) -> list[asyncio.Task[TransitionOutcome]]:
        """Start the sleep of every backend unused past its idle limit; the tasks started."""
        started = []
        for name in idle_due([b.candidate() for b in self.backends.values()], now, self.idle_limit):
            backend = self.backends[name]
            why = "keep-alive 0" if backend.keep_alive == 0 else "idle"  # the log says which asked for it
            started.append(self._begin(backend, State.SLEEPING, self._sleep(backend, why)))
        return started

    async def watch(self, refresh: float = REFRESH_SECONDS) -> None:
        """Forever: put idle backends to sleep (looking a few times per ``--idle`` period), and every
        ``refresh`` seconds read back the real state of those at rest (a ``hibernate sleep`` or
        ``wake`` run by hand behind the proxy's back)."""
        configured = (self.idle_limit, *(b.spec.idle_limit for b in self.backends.values()))
        limits = [t for t in configured if t is not None]
        tick = min(1.0, min(limits) / 4) if limits else 1.0  # a request's keep-alive can be short too
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
        one whose process cannot be read is marked failed, and looked for again by the next request (stopped
        if it has a command: the next request starts it again)."""
        for backend in self.backends.values():
            if backend.state not in (State.AWAKE, State.ASLEEP) or backend.in_flight or backend.waiting:
                continue
            before, transition = backend.state, backend.transition
            if backend.process is not None:
                backend.process.poll()  # one the proxy started and that exited: reaped, not a zombie
            try:
                found = await asyncio.to_thread(self.control.adopt, backend.spec, backend.pid)
            except BusyError:
                continue  # a `hibernate sleep` or `wake` of someone else is under way: read it next time
            except HibernateError as exc:
                await _exit_of(backend.process)
                if backend.state is before and backend.transition is transition:
                    # Gone: looked for (or started) again by the next request.
                    log.warning("%s: its state could not be read: %s", backend.name, exc.message)
                    self._lost(backend, exc.message)
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


def _spawn(backend: Backend, log: Path) -> None:
    """Run the backend's command, known to the fleet as soon as it exists: set from the worker thread, so
    that a request cancelled meanwhile cannot leave it running unknown (stop_started stops it)."""
    backend.process = starter.spawn(backend.spec, log)


async def _exit_of(process: subprocess.Popen[bytes] | None) -> None:
    """Reap a started process that is exiting, waiting for it briefly. A killed process loses its agent
    (its sockets closed) and shows as a zombie (its main thread gone) a moment before the last of its
    threads has ended and it can be reaped: seen in that moment it would not be startable again, and be
    marked failed instead of stopped."""
    if process is not None and process.poll() is None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            await asyncio.to_thread(process.wait, EXIT_WAIT_SECONDS)


def as_error(exc: Exception) -> HibernateError:
    """A failure as a transition reports one: ours as it is, any other (a bug, or an error no layer
    below knew to classify, such as a ValueError from the operating system) with its kind named."""
    if isinstance(exc, HibernateError):
        return exc
    return HibernateError(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _alive(pid: int) -> bool:
    identity = procinfo.identity(pid)
    return identity is not None and procinfo.is_alive(identity)


class NoRoomError(HibernateError):
    """A wake that cannot fit in --gpu-budget (or found no process to act on)."""
