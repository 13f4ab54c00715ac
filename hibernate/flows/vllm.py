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
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hibernate import procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLostError
from hibernate.agent.wire import AgentState, AgentStatus, ConfigureArgs, WaitArgs, state_of
from hibernate.errors import (
    BusyError,
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
from hibernate.flows.members import died_during_wake, exits, holds_leases
from hibernate.flows.vllm_api import (
    DRAIN_MODES,
    START_HINT,
    InFlight,
    ServerAddress,
    ServerConnectionLostError,
    VllmServer,
    address_from_argv,
    flag_values,
    parse_url,
    read_argv,
)
from hibernate.integrations import VLLM_KIND
from hibernate.operation.ledger import interrupted_operation
from hibernate.operation.options import Options
from hibernate.operation.reports import ProcessSleep, ProcessWake, UnitReport
from hibernate.operation.steps import Step
from hibernate.operation.targets import AgentRef, Target, find_agent, resolve
from hibernate.operation.unit import Context, Unit
from hibernate.procinfo import ProcessIdentity
from hibernate.threads import run_each

POOL = "vllm-cumem"  # the pool of a worker's CuMemAllocator allocations
LEVELS = (
    1,
    2,
)  # the CLI's copy of hibernate.pools.vllm.SLEEP_LEVELS, which loads the store; a test pins them
POLL_S = 0.05
STATUS_TIMEOUT_S = 10.0


# -- small pure rules --------------------------------------------------------------------


def is_vllm(status: AgentStatus) -> bool:
    return status.sleep_driver == VLLM_KIND


def holds_pools(status: Mapping[str, Any]) -> bool:
    """A worker: its agent lists CuMemAllocator allocations (the API server's pool is empty)."""
    return any(p.get("pool") == POOL and int(p.get("bytes", 0)) > 0 for p in status.get("pools") or [])


def check_level(level: int | None) -> int:
    if level is None:
        return 1
    if level not in LEVELS:
        raise UsageError(
            f"--level must be 1 or 2, not {level}",
            hint="level 1 keeps the weights (on disk), level 2 drops them (vLLM reloads them); "
            "vLLM's level 0 only pauses scheduling",
        )
    return level


def check_drain(drain: str | None) -> str:
    if drain is None:
        return "wait"
    if drain not in DRAIN_MODES:
        raise UsageError(
            f"--drain must be {' or '.join(DRAIN_MODES)}, not {drain!r}",
            hint="wait lets running requests finish first; abort aborts them",
        )
    return drain


def signature(statuses: Mapping[int, Mapping[str, Any] | None]) -> tuple[Any, ...]:
    """What changes while workers make progress: state, owner, bytes moved (None: gone)."""
    out: list[tuple[Any, ...]] = []
    for pid in sorted(statuses):
        status = statuses[pid]
        if status is None:
            out.append((pid, None))
            continue
        transfer = status.get("transfer") or {}
        out.append(
            (pid, status.get("state"), status.get("busy"), transfer.get("phase"), transfer.get("done"))
        )
    return tuple(out)


def progress(statuses: Mapping[int, Mapping[str, Any] | None], step: str, since: float) -> tuple[int, int]:
    """Bytes done and total of the workers' ``step`` transfers (spill, restore) begun after ``since``."""
    done = total = 0
    for status in statuses.values():
        transfer = (status or {}).get("transfer") or {}
        if transfer.get("phase") == step and float(transfer.get("unix", 0.0)) >= since:
            done += int(transfer.get("done", 0))
            total += int(transfer.get("total", 0))
    return done, total


@dataclass
class SilenceWatch:
    """Gives up on a long request only when nothing visible has changed for ``limit`` seconds."""

    limit: float
    since: float  # monotonic time of the last change
    last: Any = None

    def observe(self, value: Any, now: float) -> None:
        if value != self.last:
            self.last = value
            self.since = now

    def silent_for(self, now: float) -> float:
        return now - self.since

    def expired(self, now: float) -> bool:
        return self.silent_for(now) > self.limit


# -- the server and its processes ----------------------------------------------------------


@dataclass
class Server:
    """A vLLM server: its topmost process, its tree's agents, its workers and its address."""

    pid: int
    identity: ProcessIdentity
    target: Target
    address: ServerAddress
    http: VllmServer
    workers: list[AgentRef] = field(default_factory=list)

    def alive(self) -> bool:
        return procinfo.is_alive(self.identity)

    def describe(self) -> dict[str, Any]:
        return {
            "server_pid": self.pid,
            "url": self.address.url,
            "url_from": self.address.found,
            "workers": [w.pid for w in self.workers],
        }


def server_root(pid: int, timeout: float = 5.0) -> int:
    """The topmost process at or above ``pid`` whose agent is a vLLM one: the API server.

    A user may name any process of the server (a worker, the engine core);
    vLLM starts them all as descendants of the API server, and each loads
    hibernate's plugin, so the chain of vLLM agents upwards ends there.
    """
    root, seen = pid, {pid}
    current = procinfo.parent_pid(pid)
    while current is not None and current > 1 and current not in seen:
        seen.add(current)
        try:
            ref = find_agent(current, timeout)
        except HibernateError:
            break
        if ref is None or not is_vllm(ref.status):
            break
        root = current
        current = procinfo.parent_pid(current)
    return root


def locate(ctx: Context, agents: Sequence[AgentRef]) -> list[Server]:
    """The vLLM servers ``agents`` belong to (any pid of a server names it), each with its whole tree."""
    roots = sorted({server_root(a.pid) for a in agents})
    url = ctx.options.kind_options.get("vllm_url")
    if url and len(roots) > 1:
        raise UsageError(
            f"--vllm-url names one server, and the selection holds {len(roots)} vLLM servers "
            f"(pids {', '.join(map(str, roots))}); nothing was changed",
            hint="leave --vllm-url out (each server's URL is read from its command line), "
            "or select one server",
        )
    servers = []
    for root in roots:
        (target,) = resolve([root], all_users=ctx.options.all_users)
        strays = sorted({a.pid for a in target.agents if not is_vllm(a.status)})
        if strays:
            raise UsageError(
                f"vLLM server {root} has processes with other hibernate agents "
                f"({', '.join(map(str, strays))}); nothing was changed"
            )
        identity = procinfo.identity(root)
        if identity is None:
            raise NoSuchProcessError(f"the vLLM server (pid {root}) exited")
        address = parse_url(url) if url else address_from_argv(read_argv(root), root)
        workers = [a for a in target.agents if holds_pools(a.answer)]
        http = VllmServer(address, timeout=max(ctx.options.quiesce_timeout, 0.1))
        servers.append(Server(root, identity, target, address, http, workers))
    return servers


def _status(ref: AgentRef, timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any] | None:
    """The agent's status now; None if its process is gone."""
    try:
        with AgentClient(ref.socket, timeout=timeout) as client:
            return client.call("status")
    except AgentConnectionLostError:
        return None


def statuses(refs: Sequence[AgentRef]) -> dict[int, dict[str, Any] | None]:
    return {ref.pid: _status(ref) for ref in refs}


class _Monitor:
    """Persistent connections to the workers' agents, polled for status while the server works."""

    def __init__(self, refs: Sequence[AgentRef]) -> None:
        self._refs = list(refs)
        self._clients: dict[int, AgentClient | None] = {}

    def poll(self) -> dict[int, dict[str, Any] | None]:
        out: dict[int, dict[str, Any] | None] = {}
        for ref in self._refs:
            client = self._clients.get(ref.pid)
            if ref.pid in self._clients and client is None:
                out[ref.pid] = None  # gone earlier
                continue
            try:
                if client is None:
                    client = AgentClient(ref.socket, timeout=STATUS_TIMEOUT_S)
                    self._clients[ref.pid] = client
                out[ref.pid] = client.call("status")
            except AgentConnectionLostError:
                if client is not None:
                    client.close()
                self._clients[ref.pid] = None
                out[ref.pid] = None
        return out

    def close(self) -> None:
        for client in self._clients.values():
            if client is not None:
                client.close()


def refused_restore(status: Mapping[str, Any] | None) -> str | None:
    """Why a worker's agent will not let a client bring its memory back (its communicators across
    GPUs are torn down, or cannot be trusted); None if it will."""
    return (status or {}).get("restore_refusal")


def wake_directly(ref: AgentRef, options: Options) -> dict[str, Any]:
    """Bring a worker's pools back through its agent (vLLM will not: its executor thinks it awake).

    Only for undo and recovery: the agent allows a client's restore, which
    brings memory back and never releases it. A worker whose communicators
    across GPUs are torn down refuses it (NeedsRecoveryError): only vLLM's own
    wake rebuilds them.
    """
    with ref.connect(options.agent_timeout) as client:
        client.call("begin")
        restore = client.call("restore", options.io.to_args(), idle_timeout=options.agent_timeout)
        resume = client.call("resume")
    return {"restore": restore, "resume": resume}


def _refuse_other_backend(server: Server) -> None:
    """A server started with another sleep-mode backend is refused before anything changes."""
    backend = flag_values(read_argv(server.pid)).get("--sleep-mode-backend")
    if backend is not None and backend != "hibernate":
        raise UnsupportedError(
            f"vLLM server {server.pid} was started with --sleep-mode-backend {backend}: its workers would "
            "keep their memory in host RAM instead of writing it to --to, and hibernate cannot take their "
            "CUDA state off the GPU then; nothing was changed",
            hint=START_HINT,
        )


def _check_ready(server: Server, found: Mapping[int, dict[str, Any] | None]) -> None:
    """Every agent present, running and idle, and at least one worker; else refused, nothing changed."""
    gone = [pid for pid, status in found.items() if status is None]
    if gone:
        raise NoSuchProcessError(
            f"process(es) {', '.join(map(str, gone))} of vLLM server {server.pid} exited"
        )
    if not server.workers:
        raise UnsupportedError(
            f"no process of vLLM server {server.pid} holds CuMemAllocator pools, so there is nothing to put "
            "to sleep (was it started without --enable-sleep-mode?); nothing was changed",
            hint=START_HINT,
        )
    busy = [(pid, s["busy"]) for pid, s in found.items() if s and s.get("busy")]
    if busy:
        pid, owner = busy[0]
        raise BusyError(f"process {pid} of vLLM server {server.pid} is busy: {owner} is operating on it")
    asleep = [pid for pid, s in found.items() if s and state_of(s) is not AgentState.RUNNING]
    if asleep:
        raise WrongStateError(
            f"vLLM server {server.pid} is not awake: worker(s) {', '.join(map(str, asleep))} are "
            f"{found[asleep[0]].get('state')}; nothing was changed",  # type: ignore[union-attr]
            hint=f"wake it first: hibernate wake {server.pid}",
        )


class _LeftInFlightError(HibernateTimeoutError):
    """The server is still carrying a request out: nothing can be undone behind its back."""

    keeps_journal = True  # `hibernate recover` reads the journal once the server is done


def _interrupted_sleep(server: Server) -> bool:
    """An earlier sleep stopped before the server had answered it: vLLM may not know its workers sleep."""
    for ref in server.target.agents:
        info = interrupted_operation(ref)
        if info and info.get("op") == "sleep" and "vllm-sleep" not in info.get("phases", []):
            return True
    return False


def _settle(server: Server, options: Options) -> dict[int, dict[str, Any] | None]:
    """Statuses once no worker runs a sleep or wake of its own (one the server is still carrying out)."""
    watch = SilenceWatch(options.agent_timeout, time.monotonic())
    while True:
        found = statuses(server.target.agents)
        owners = [s.get("busy") for s in found.values() if s and s.get("busy")]
        if not owners:
            return found
        foreign = [o for o in owners if not str(o).startswith("this process")]
        if foreign:
            raise BusyError(f"a process of vLLM server {server.pid} is busy: {foreign[0]} is operating on it")
        now = time.monotonic()
        watch.observe(signature(found), now)
        if watch.expired(now):
            raise HibernateTimeoutError(
                f"vLLM server {server.pid}'s workers are still busy with a sleep or wake of their own and "
                f"show no progress for {watch.silent_for(now):.0f}s"
            )
        time.sleep(POLL_S)


def _wake_leftovers(server: Server, options: Options) -> list[str]:
    """Workers still asleep (that vLLM will not wake) woken through their agents; failures in words.

    A worker that exits meanwhile (its server died, and vLLM's workers end with
    it) is no failure: nothing of it is left to bring back. On a loaded machine
    its exit can take seconds after its agent stopped answering.
    """
    alive = [ref for ref in server.workers if procinfo.is_alive(ref.identity)]
    asleep = [ref for ref in alive if state_of(_status(ref)) is AgentState.ASLEEP]
    failures = []
    for ref, outcome in zip(asleep, run_each(asleep, lambda ref: wake_directly(ref, options)), strict=True):
        error = outcome.error
        if error is not None:
            # A worker whose server died is on its way out (its agent goes first, or it refuses a
            # restore only its server's wake could make): give it as long as a status call gets
            # before calling what it answered a failure.
            gone = isinstance(error, (AgentConnectionLostError, NoSuchProcessError)) or not server.alive()
            if gone and exits(ref.identity, within=STATUS_TIMEOUT_S):
                continue
            words = error.message if isinstance(error, HibernateError) else repr(error)
            failures.append(f"process {ref.pid}: {words}")
    return failures


def _woken_directly(
    refs: Sequence[AgentRef], options: Options, woken: dict[int, dict[str, Any]]
) -> list[HibernateError]:
    failures: list[HibernateError] = []
    for ref, outcome in zip(refs, run_each(refs, lambda ref: wake_directly(ref, options)), strict=True):
        error = outcome.error
        if isinstance(error, HibernateError) and not procinfo.is_alive(ref.identity):
            failures.append(died_during_wake(ref))  # not asleep: gone, and its memory with it
        elif isinstance(error, HibernateError):
            failures.append(error.add_context(f"process {ref.pid} stays asleep"))
        elif error is not None:
            raise error
        else:
            woken[ref.pid] = outcome.value  # type: ignore[assignment]
    return failures


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
            self.agent_first = self.ctx.recovering or _interrupted_sleep(self.server)
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
        _refuse_other_backend(self.server)

    def connect(self) -> None:
        server = self.server
        if self.ctx.op == "wake":
            self.last_statuses = _settle(server, self.ctx.options)
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
        _check_ready(server, found)
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
        monitor = _Monitor(self.server.workers)
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
                "close_leases", WaitArgs(timeout).to_wire(), idle_timeout=timeout + options.agent_timeout
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
        failures += _wake_leftovers(server, self.ctx.options)
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
            failures = _woken_directly(direct, options, self.woken)
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
            failures = _woken_directly(leftovers, options, self.woken)
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
        now = _settle(self.server, self.ctx.options)
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
