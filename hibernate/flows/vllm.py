"""The flow of a vLLM server: its own endpoints move the workers' memory (one unit per server).

A vLLM worker's memory must not be released behind its scheduler's back, so
the CLI does not quiesce it; it asks the server, then does what the server
cannot: take the CUDA state off the GPU from another process.

    sleep: lock       the server's tree (any pid of it names it), its agents, CUDA holders, journal
           connect    every agent running and idle; GET /is_sleeping (vLLM with dev endpoints, awake)
           leases     every agent of the tree refuses new leases and the requests in flight through
                      a proxy (hibernate serve) end, within --timeout, else busy: nothing changed
           configure  tell each worker's agent the spill directory (--to)
           drain      POST /sleep?level=0&mode=wait|abort: scheduling stops, running requests finish
                      or are aborted; within --timeout, else undone (scheduling resumes)
           vllm-sleep POST /sleep?level=L&mode=wait: each worker spills and releases its pools; the
                      workers' agents are watched meanwhile (progress, server alive)
           then the engine's CUDA stage: lock every CUDA holder, then checkpoint every one
    wake:  lock, connect, the CUDA stage (restore all, unlock all), then
           vllm-wake  POST /wake_up (every tag): the workers read their pools back;
                      then GET /is_sleeping must say false

The leases come before the drain: a proxy's request forwarded to a paused
server would wait there holding its lease, and the sleep would wait for the
lease. The agents' gates stay closed until the command hangs up.

The drain is its own step (level 0 only pauses scheduling) because vLLM
cannot call off a sleep that waits for requests: a later ``/wake_up`` would
resume scheduling while the sleep still runs as soon as the engine idles.
A level-0 pause can be called off. The sleep proper then has nothing to wait
for (``mode=wait`` with nothing running; requests that arrived are kept
queued for after the wake).

A failure is undone in reverse: the CUDA state is restored first, then the
workers are woken, then scheduling resumes, and the error says where it
failed. A worker that a failed ``/sleep`` left asleep is woken through its
agent *before* scheduling resumes: vLLM does not wake it (its executor never
recorded the sleep). When the server itself goes, its workers are woken
through their agents if they outlive it. When the server cannot be waited
for (it stops showing progress), nothing is undone behind its back: the
journal stays, and ``hibernate recover`` (or ``wake``) finishes the job.

Workers with ``HIBERNATE_SELF_CHECKPOINT=1`` checkpoint themselves after
their sleep; the CUDA stage leaves them alone and waits for them instead.

This module holds the unit: its steps, their order and their undo. What they
do to the server's processes through their agents (find them, poll them, wake
a worker directly) is :mod:`.vllm_processes`; the pure rules they apply
(--level, --drain, what counts as progress) are :mod:`.vllm_rules`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any

from hibernate.agent.client import AgentClient
from hibernate.agent.wire import AgentState, ConfigureArgs, WaitArgs, state_of
from hibernate.errors import (
    HibernateError,
    HibernateTimeoutError,
    NeedsRecoveryError,
    NoSuchProcessError,
    ServerFailedError,
    UnsupportedError,
    UsageError,
    WrongStateError,
    describe_cause,
)
from hibernate.flows.members import holds_leases
from hibernate.flows.vllm_api import (
    START_HINT,
    InFlight,
    ServerConnectionLostError,
)
from hibernate.flows.vllm_processes import (
    POLL_S,
    STATUS_TIMEOUT_S,
    Server,
    WorkerMonitor,
    check_ready,
    interrupted_sleep,
    locate,
    refuse_other_backend,
    refused_restore,
    settle,
    statuses,
    wake_leftovers,
    woken_directly,
)
from hibernate.flows.vllm_rules import SilenceWatch, check_drain, check_level, progress, signature
from hibernate.operation.reports import ProcessSleep, ProcessWake, UnitReport
from hibernate.operation.steps import Step
from hibernate.operation.targets import AgentRef, Target
from hibernate.operation.unit import Context, Unit


class _LeftInFlightError(HibernateTimeoutError):
    """The server is still carrying a request out: nothing can be undone behind its back."""

    keeps_journal = True  # `hibernate recover` reads the journal once the server is done


class VllmServerUnit(Unit):
    """One vLLM server. Its workers are the processes it changes (locked, journaled); the API
    server's own process is never changed, only its endpoints are called."""

    def __init__(self, ctx: Context, server: Server) -> None:
        super().__init__(ctx, server.workers, server.target.processes)
        self.server = server
        self.level = 1
        self.drain = "wait"
        self.last_statuses: dict[int, dict[str, Any] | None] = {}
        self.seconds: dict[str, float] = {}
        self.response: dict[str, Any] = {}
        # sleep: what has been done, for the undo
        self.configured: dict[int, str | None] = {}  # worker pid -> the directory it had before
        self.gates: list[AgentClient] = []  # connections whose agents refuse new leases until closed
        self.paused = False  # a /sleep was sent: scheduling may be paused
        self.flight: InFlight | None = None
        self.slept = False  # the server answered the sleep: vLLM's executor knows its workers sleep
        # wake: what connect found
        self.agent_first = False
        self.alive = True
        self.sleeping: bool | None = None
        self.asleep_workers: list[AgentRef] = []
        self.woken: dict[int, dict[str, Any]] = {}
        self.began = 0.0

    @classmethod
    def plan(cls, ctx: Context, agents: Sequence[AgentRef], targets: Sequence[Target]) -> list[Unit]:
        return [cls(ctx, server) for server in locate(ctx, agents)]

    # -- before anything changes --------------------------------------------------------

    def check(self) -> None:
        if self.ctx.op == "wake":
            self.agent_first = self.ctx.recovering or interrupted_sleep(self.server)
            return
        options = self.ctx.options
        self.level = check_level(options.kind_options.get("level"))
        self.drain = check_drain(options.kind_options.get("drain"))
        if options.io.verify:
            raise UsageError(
                "--verify does not reach a vLLM server's workers: they sleep through the server's own "
                "/sleep, with the settings of their environment; nothing was changed",
                hint="start the server with HIBERNATE_VERIFY=1 in its environment",
            )
        if options.io.skip_reuse_check:
            raise UsageError(
                "--skip-reuse-check (or HIBERNATE_SKIP_REUSE_CHECK) does not reach a vLLM server's workers: "
                "they sleep through the server's own /sleep, with the settings of their environment; "
                "nothing was changed",
                hint="start the server with HIBERNATE_SKIP_REUSE_CHECK=1 in its environment",
            )
        refuse_other_backend(self.server)

    def connect(self) -> None:
        server = self.server
        if self.ctx.op == "wake":
            self.last_statuses = settle(server, self.ctx.options)
            self.alive = server.alive()
            self.sleeping = server.http.probe() if self.alive else None
            self.asleep_workers = [
                ref
                for ref in server.workers
                if state_of(self.last_statuses.get(ref.pid)) is AgentState.ASLEEP
            ]
            return
        found = statuses(server.target.agents)
        self.last_statuses = found
        check_ready(server, found)
        if server.http.probe():
            raise WrongStateError(
                f"the vLLM server at {server.address.url} (pid {server.pid}) reports is_sleeping: true "
                "(asleep, or its scheduling paused); nothing was changed",
                hint=f"wake it first: hibernate wake {server.pid}",
            )

    def label(self, step: str) -> str:
        return {"drain": f"drain ({self.drain})", "vllm-sleep": f"sleep (level {self.level})"}.get(
            step, "wake_up" if step == "vllm-wake" else step
        )

    def annotate(self, step: str, error: HibernateError) -> None:
        if isinstance(error, NeedsRecoveryError) and self.ctx.op == "wake":
            return  # its message is the recovery's, worded whole
        if self.ctx.op == "sleep":
            error.add_context(
                f"vLLM server {self.server.pid} ({step})", unless=f"vLLM server {self.server.pid}"
            )
        else:
            error.add_context(
                f"vLLM server {self.server.pid} (wake)", unless=("nothing to wake", "vLLM server")
            )

    # -- watching a long request ----------------------------------------------------------

    def answer(self, flight: InFlight) -> dict[str, Any]:
        """The server's checked answer; a dropped connection of a server that died says so."""
        try:
            return self.server.http.answer(flight)
        except ServerConnectionLostError as exc:
            if not self.server.alive():
                raise NoSuchProcessError(
                    f"the vLLM server (pid {self.server.pid}) exited during {flight.description}"
                ) from exc
            raise

    def watch(self, flight: InFlight, during: str | None, transfer: str) -> None:
        """Wait for ``flight`` while the workers visibly move; give up on silence or on the server's death.

        Silence is judged from the workers' agents (state, owner, bytes moved),
        so a sleep of 100 GB takes as long as it takes while a hung one is
        given up after ``agent_timeout`` seconds without change.
        """
        monitor = WorkerMonitor(self.server.workers)
        began = time.time()
        first = None
        watch = SilenceWatch(self.ctx.options.agent_timeout, time.monotonic())
        try:
            while True:
                finished = flight.wait(POLL_S)
                found = monitor.poll()
                self.last_statuses = found
                now = time.monotonic()
                current = signature(found)
                watch.observe(current, now)
                first = current if first is None else first
                done, total = progress(found, transfer, began)
                if total:
                    self.ctx.sink.transfer(transfer, done, total)
                if during is not None and (finished or current != first):
                    self.ctx.journal.during(during)
                    during = None
                if finished:
                    return
                if not self.server.alive():
                    flight.abort()
                    raise NoSuchProcessError(
                        f"the vLLM server (pid {self.server.pid}) exited during {flight.description}"
                    )
                if watch.expired(now):
                    flight.abort()
                    states = ", ".join(
                        f"{pid} {(s or {}).get('state', 'gone')}" for pid, s in sorted(found.items())
                    )
                    raise HibernateTimeoutError(
                        f"the vLLM server (pid {self.server.pid}) showed no progress on {flight.description} "
                        f"for {watch.silent_for(now):.0f}s (workers: {states})",
                        hint="raise --timeout if the disk is slow; `hibernate status PID` shows the workers",
                    )
        finally:
            monitor.close()

    # -- sleep ------------------------------------------------------------------------------

    def close_leases(self) -> None:
        """Every agent of the server refuses new leases, then those held are waited for (BusyError)."""
        options = self.ctx.options
        timeout = options.lease_wait
        for ref in self.server.target.agents:
            if not holds_leases(ref.status):
                continue
            client = ref.connect(options.agent_timeout)
            self.gates.append(client)
            client.call(
                "close_leases", WaitArgs(timeout).to_wire(), silence_timeout=timeout + options.agent_timeout
            )

    def close(self) -> None:
        for client in self.gates:
            client.close()  # their agents take leases again
        self.gates.clear()

    def configure(self) -> None:
        """Tell each worker's agent the spill directory (--to)."""
        for ref in self.server.workers:
            with ref.connect(self.ctx.options.agent_timeout) as client:
                client.call("configure", ConfigureArgs(str(self.ctx.spill_dir)).to_wire())
            self.configured[ref.pid] = (self.last_statuses.get(ref.pid) or {}).get("default_dir")

    def drain_requests(self) -> None:
        """POST /sleep?level=0: scheduling stops; running requests finish or are aborted."""
        started = time.perf_counter()
        self.paused = True
        self.server.http.sleep(0, self.drain)
        self.seconds["drain"] = round(time.perf_counter() - started, 6)

    def vllm_sleep(self) -> None:
        """POST /sleep?level=L: each worker spills and releases its pools, watched meanwhile."""
        started = time.perf_counter()
        self.flight = self.server.http.start_sleep(self.level, "wait")
        self.watch(self.flight, "vllm-sleep", "spill")
        self.response = self.answer(self.flight)
        self.slept = True
        self.seconds["sleep"] = round(time.perf_counter() - started, 6)
        after = statuses(self.server.workers)
        self.last_statuses = after
        awake = [pid for pid, s in after.items() if state_of(s) is not AgentState.ASLEEP]
        if awake:
            raise UnsupportedError(
                f"vLLM server {self.server.pid} reports sleeping, but worker(s) "
                f"{', '.join(map(str, awake))} did not go to sleep through hibernate: the server uses "
                "another sleep-mode backend",
                hint=START_HINT,
            )

    def checkpoints_itself(self) -> list[int]:
        found = self.last_statuses or statuses(self.server.workers)
        return [ref.pid for ref in self.server.workers if (found.get(ref.pid) or {}).get("self_checkpoint")]

    def undo_sleep(self, error: BaseException) -> None:
        """Back to awake and serving, from what was reached; NeedsRecoveryError if that fails too."""
        failures: list[str] = []
        server = self.server
        if self.flight is not None and not self.flight.done:
            # Stopped while the server works on the sleep (an interrupt): let it finish first.
            try:
                self.watch(self.flight, None, "spill")
                self.response = self.answer(self.flight)
                self.slept = True
            except HibernateError:
                pass  # it failed, its server died or went silent: decided below from the real states
        if (
            isinstance(error, HibernateTimeoutError)
            and self.flight is not None
            and not self.slept
            and server.alive()
            and any((s or {}).get("busy") for s in statuses(server.workers).values())
        ):
            raise _LeftInFlightError(
                f"{error.message}; the server is still carrying out the sleep, so nothing was undone",
                hint=f"once it finishes, `hibernate recover {server.pid}` brings the server back "
                f"(or `hibernate wake {server.pid}`)",
            ) from error
        alive = server.alive()
        if alive and self.slept:
            failures += self._wake_up()
        failures += wake_leftovers(server, self.ctx.options)
        if alive and not failures:  # awake, but with communicators that cannot be trusted
            failures += [
                f"process {pid}: {refused}"
                for pid, status in statuses(server.workers).items()
                if (refused := refused_restore(status))
            ]
        if alive and self.paused and not self.slept and not failures:
            # Resumes scheduling (vLLM's executor was not asleep); never over a worker that cannot serve.
            failures += self._wake_up()
        if alive and not failures:
            with contextlib.suppress(HibernateError):
                if server.http.is_sleeping():
                    failures.append(f"the server at {server.address.url} still reports is_sleeping: true")
        for ref in server.workers:
            if ref.pid in self.configured:
                with contextlib.suppress(HibernateError), ref.connect(STATUS_TIMEOUT_S) as client:
                    client.call("configure", ConfigureArgs(self.configured[ref.pid]).to_wire())
        if failures:
            any_refused = any(refused_restore(s) for s in statuses(server.workers).values())
            raise NeedsRecoveryError(
                f"{describe_cause(error)}; undoing it failed too: {'; '.join(failures)}"
                + (
                    "; the server's scheduling stays paused"
                    if alive and self.paused and not self.slept
                    else ""
                ),
                hint="restart the vLLM server"
                if any_refused
                else f"run `hibernate recover {server.pid}` once the cause is fixed",
            ) from error

    def _wake_up(self) -> list[str]:
        try:
            flight = self.server.http.start_wake_up()
            self.watch(flight, None, "restore")
            self.answer(flight)
        except HibernateError as exc:
            return [f"POST /wake_up: {exc.message}"]
        return []

    # -- wake ---------------------------------------------------------------------------------

    def has_sleeping(self) -> bool:
        return bool(self.asleep_workers or self.sleeping)

    def describe_state(self) -> str:
        return f"vLLM server {self.server.pid} is awake (is_sleeping: false, every worker running)"

    def vllm_wake(self) -> None:
        """POST /wake_up (every tag): the workers read their pools back; then is_sleeping must say false."""
        server = self.server
        self.began = time.time()
        if not self.has_sleeping():
            return  # awake already, while other targets of the command slept
        options = self.ctx.options
        direct = self.asleep_workers
        if self.sleeping:
            # A worker whose communicators across GPUs are torn down is left to vLLM's own wake,
            # which rebuilds them first; its agent would refuse.
            direct = [r for r in direct if not refused_restore(self.last_statuses.get(r.pid))]
        if direct and (self.agent_first or not self.sleeping):
            # vLLM may not know these sleep (an interrupted or failed /sleep): woken through their
            # agents before scheduling resumes; vLLM's own wake_up then finds them awake.
            failures = woken_directly(direct, options, self.woken)
            if failures:
                raise failures[0]
        if self.sleeping:
            clock = time.perf_counter()
            flight = server.http.start_wake_up()
            self.watch(flight, "vllm-wake", "restore")
            self.response = self.answer(flight)
            self.seconds["wake_up"] = round(time.perf_counter() - clock, 6)
        # A worker vLLM did not wake (its executor never recorded that sleep): only after a failed
        # sleep whose journal is gone; scheduling has resumed, so wake it at once.
        after = statuses(server.workers)
        leftovers = [ref for ref in server.workers if state_of(after.get(ref.pid)) is AgentState.ASLEEP]
        if leftovers:
            failures = woken_directly(leftovers, options, self.woken)
            if failures:
                raise failures[0]
            after = statuses(server.workers)
        self.last_statuses = after
        if self.alive and server.http.is_sleeping():
            raise ServerFailedError(
                f"the vLLM server at {server.address.url} still reports is_sleeping: true "
                "after POST /wake_up",
                hint=f"see the server's log; then run `hibernate wake {server.pid}` again",
            )

    # -- recovery -------------------------------------------------------------------------------

    def asleep_now(self) -> bool:
        now = settle(self.server, self.ctx.options)
        return all(state_of(now.get(w.pid)) is AgentState.ASLEEP for w in self.server.workers)

    # -- report ---------------------------------------------------------------------------------

    def report(self) -> UnitReport:
        if self.ctx.op == "sleep":
            return UnitReport(
                sleeps=[self._sleep_entry(ref) for ref in self.server.workers],
                extra_key="vllm",
                extra={
                    **self.server.describe(),
                    "level": self.level,
                    "mode": self.drain,
                    "seconds": self.seconds,
                    "response": self.response,
                },
            )
        return UnitReport(
            wakes=[self._wake_entry(ref) for ref in self.asleep_workers],
            extra_key="vllm",
            extra={
                **self.server.describe(),
                "seconds": self.seconds,
                "response": self.response,
                "woken_directly": sorted(self.woken),
                "server_alive": self.alive,
            },
        )

    def _sleep_entry(self, ref: AgentRef) -> ProcessSleep:
        status = self.last_statuses.get(ref.pid) or {}
        operation = status.get("last_operation") or {}
        answers = {k: v for k, v in operation.items() if isinstance(v, dict)}
        return ProcessSleep.from_answers(ref.pid, status.get("name"), answers)

    def _wake_entry(self, ref: AgentRef) -> ProcessWake:
        status = self.last_statuses.get(ref.pid) or {}
        if ref.pid in self.woken:
            answers = self.woken[ref.pid]
        else:
            last = status.get("last_operation") or {}
            answers = (
                {k: v for k, v in last.items() if isinstance(v, dict)} if last.get("op") == "wake" else {}
            )
            if float(last.get("finished_unix", 0.0)) < self.began:
                answers = {}
        snapshot = (status.get("snapshot") or {}).get("path")
        return ProcessWake.from_answers(ref.pid, status.get("name"), snapshot, answers)


VllmServerUnit.sleep_steps = (
    Step("leases", VllmServerUnit.close_leases),  # reopened when the command hangs up (close)
    Step("configure", VllmServerUnit.configure, undo=VllmServerUnit.undo_sleep),
    Step("drain", VllmServerUnit.drain_requests),
    Step("vllm-sleep", VllmServerUnit.vllm_sleep, during=True),
)
VllmServerUnit.wake_steps = (Step("vllm-wake", VllmServerUnit.vllm_wake, during=True),)
