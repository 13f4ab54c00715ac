"""``hibernate sleep/wake/recover`` on a vLLM server: its own endpoints move the workers' memory.

A vLLM worker's memory must not be released behind its scheduler's back, so
the CLI does not quiesce it; it asks the server, then does what the server
cannot: take the CUDA state off the GPU from another process.

    sleep: lock       the server's tree (any pid of it names it), its agents, CUDA holders, journal
           connect    every agent running and idle; GET /is_sleeping (vLLM with dev endpoints, awake)
           configure  tell each worker's agent the spill directory (--to)
           drain      POST /sleep?level=0&mode=wait|abort: scheduling stops, running requests finish
                      or are aborted; within --timeout, else undone (scheduling resumes)
           vllm-sleep POST /sleep?level=L&mode=wait: each worker spills and releases its pools; the
                      workers' agents are watched meanwhile (progress, server alive)
           cuda-lock, cuda   lock every CUDA holder, then checkpoint every one
    wake:  lock, connect, cuda-restore, cuda (restore all, unlock all), then
           vllm-wake  POST /wake_up (every tag): the workers read their pools back;
                      then GET /is_sleeping must say false

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
their sleep; the CUDA phase leaves them alone and waits for them instead.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLost
from hibernate.errors import (
    BusyError,
    CudaCheckpointError,
    HibernateError,
    HibernateTimeoutError,
    NeedsRecoveryError,
    NoSuchProcessError,
    ServerFailedError,
    UnsupportedError,
    UsageError,
    WrongStateError,
)
from hibernate.integrations.vllm_server import (
    DRAIN_MODES,
    START_HINT,
    InFlight,
    ServerAddress,
    ServerConnectionLost,
    VllmServer,
    address_from_argv,
    flag_values,
    parse_url,
    read_argv,
)
from hibernate.orchestrator import (
    Options,
    ProgressSink,
    _checkpointer,
    _cuda_changed,
    _cuda_sleep,
    _cuda_wake,
    _Operation,
    _require_checkpointer,
    _undo_cuda,
    exits,
    interrupted_operation,
    prepare_directory,
    sleep_entry,
    wake_entry,
)
from hibernate.procinfo import ProcessIdentity
from hibernate.targets import AgentRef, Target, find_agent, resolve

DRIVER = "vLLM"  # the sleep driver a vLLM process's agent names
POOL = "vllm-cumem"  # the pool of a worker's CuMemAllocator allocations
LEVELS = (1, 2)
POLL_S = 0.05
STATUS_TIMEOUT_S = 10.0


# -- small pure rules --------------------------------------------------------------------


def is_vllm(status: Mapping[str, Any]) -> bool:
    return status.get("sleep_driver") == DRIVER


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


def progress(statuses: Mapping[int, Mapping[str, Any] | None], phase: str, since: float) -> tuple[int, int]:
    """Bytes done and total of the workers' ``phase`` transfers that began after ``since`` (unix time)."""
    done = total = 0
    for status in statuses.values():
        transfer = (status or {}).get("transfer") or {}
        if transfer.get("phase") == phase and float(transfer.get("unix", 0.0)) >= since:
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

    @property
    def targets(self) -> list[Target]:
        return [self.target]

    def alive(self) -> bool:
        return procinfo.is_alive(self.identity)

    def operation(self, op: str) -> _Operation:
        """Locks and journal entries for the workers: the processes an operation changes.

        The API server's own process is never changed (only its endpoints are
        called), so it needs neither; every journal write is an fsync.
        """
        return _Operation(op, [Target(self.pid, list(self.target.processes), list(self.workers))])

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


def locate(targets: Sequence[Target], options: Options) -> Server:
    """The one vLLM server the requested pids belong to, with its whole tree (never several at once)."""
    others = sorted({a.pid for t in targets for a in t.agents if not is_vllm(a.status)})
    roots = sorted({server_root(a.pid) for t in targets for a in t.agents if is_vllm(a.status)})
    if others:
        raise UsageError(
            f"process(es) {', '.join(map(str, others))} are not part of a vLLM server, and a vLLM server "
            "is put to sleep by a command of its own; nothing was changed",
            hint="run one hibernate command for the vLLM server and another for the other targets",
        )
    if len(roots) != 1:
        raise UsageError(
            f"the pids belong to {len(roots)} vLLM servers (pids {', '.join(map(str, roots))}); "
            "put one to sleep per command; nothing was changed"
        )
    root = roots[0]
    (target,) = resolve([root])
    strays = sorted({a.pid for a in target.agents if not is_vllm(a.status)})
    if strays:
        raise UsageError(
            f"vLLM server {root} has processes with other hibernate agents ({', '.join(map(str, strays))}); "
            "nothing was changed"
        )
    identity = procinfo.identity(root)
    if identity is None:
        raise NoSuchProcessError(f"the vLLM server (pid {root}) exited")
    address = parse_url(options.vllm.url) if options.vllm.url else address_from_argv(read_argv(root), root)
    workers = [a for a in target.agents if holds_pools(a.status)]
    http = VllmServer(address, timeout=max(options.quiesce_timeout, 0.1))
    return Server(root, identity, target, address, http, workers)


def _status(ref: AgentRef, timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any] | None:
    """The agent's status now; None if its process is gone."""
    try:
        with AgentClient(ref.socket, timeout=timeout) as client:
            return client.call("status")
    except AgentConnectionLost:
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
            except AgentConnectionLost:
                if client is not None:
                    client.close()
                self._clients[ref.pid] = None
                out[ref.pid] = None
        return out

    def close(self) -> None:
        for client in self._clients.values():
            if client is not None:
                client.close()


def wake_directly(ref: AgentRef, options: Options) -> dict[str, Any]:
    """Bring a worker's pools back through its agent (vLLM will not: its executor thinks it awake).

    Only for undo and recovery: the agent allows a client's restore, which
    brings memory back and never releases it.
    """
    with ref.connect(options.agent_timeout) as client:
        client.call("begin")
        restore = client.call("restore", options.io.to_args(), idle_timeout=options.agent_timeout)
        resume = client.call("resume")
    return {"restore": restore, "resume": resume}


def _in_parallel(refs: Sequence[AgentRef], work: Callable[[AgentRef], Any]) -> dict[int, Any]:
    """``work`` on every ref at once; each result, or the exception it raised, by pid."""
    if not refs:
        return {}
    results: dict[int, Any] = {}
    with ThreadPoolExecutor(max_workers=len(refs)) as pool:
        futures = {ref.pid: pool.submit(work, ref) for ref in refs}
        for pid, future in futures.items():
            error = future.exception()
            results[pid] = error if error is not None else future.result()
    return results


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
    asleep = [pid for pid, s in found.items() if s and s.get("state") != "running"]
    if asleep:
        raise WrongStateError(
            f"vLLM server {server.pid} is not awake: worker(s) {', '.join(map(str, asleep))} are "
            f"{found[asleep[0]].get('state')}; nothing was changed",  # type: ignore[union-attr]
            hint=f"wake it first: hibernate wake {server.pid}",
        )


# -- watching a long request ------------------------------------------------------------------


class _Run:
    """State shared by the phases of one operation: the server, the journal, the options, the sink."""

    def __init__(self, server: Server, operation: _Operation, options: Options, sink: ProgressSink) -> None:
        self.server = server
        self.operation = operation
        self.options = options
        self.sink = sink
        self.last_statuses: dict[int, dict[str, Any] | None] = {}

    def answer(self, flight: InFlight) -> dict[str, Any]:
        """The server's checked answer; a dropped connection of a server that died says so."""
        try:
            return self.server.http.answer(flight)
        except ServerConnectionLost as exc:
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
        watch = SilenceWatch(self.options.agent_timeout, time.monotonic())
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
                    self.sink.transfer(transfer, done, total)
                if during is not None and (finished or current != first):
                    self.operation.during(during)
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


class _LeftInFlight(HibernateTimeoutError):
    """The server is still carrying a request out: nothing can be undone behind its back."""


# -- sleep ------------------------------------------------------------------------------------


class _Sleep(_Run):
    def __init__(
        self,
        server: Server,
        operation: _Operation,
        options: Options,
        sink: ProgressSink,
        directory: Path,
        level: int,
        drain: str,
    ) -> None:
        super().__init__(server, operation, options, sink)
        self.directory = directory
        self.level = level
        self.drain = drain
        self.configured: dict[int, str | None] = {}  # worker pid -> the directory it had before
        self.paused = False  # a /sleep was sent: scheduling may be paused
        self.flight: InFlight | None = None
        self.slept = False  # the server answered the sleep: vLLM's executor knows its workers sleep
        self.cuda_done = False
        self.seconds: dict[str, float] = {}
        self.response: dict[str, Any] = {}

    def run(self, found: Mapping[int, dict[str, Any] | None]) -> dict[str, Any]:
        phase = "configure"
        try:
            self.sink.phase("configure")
            for ref in self.server.workers:
                with ref.connect(self.options.agent_timeout) as client:
                    client.call("configure", {"dir": str(self.directory)})
                self.configured[ref.pid] = (found.get(ref.pid) or {}).get("default_dir")
            self.operation.passed("configure")

            phase = "drain"
            self.sink.phase(f"drain ({self.drain})")
            started = time.perf_counter()
            self.paused = True
            self.server.http.sleep(0, self.drain)
            self.seconds["drain"] = round(time.perf_counter() - started, 6)
            self.operation.passed("drain")

            phase = "vllm-sleep"
            self.sink.phase(f"sleep (level {self.level})")
            started = time.perf_counter()
            self.flight = self.server.http.start_sleep(self.level, "wait")
            self.watch(self.flight, "vllm-sleep", "spill")
            self.response = self.answer(self.flight)
            self.slept = True
            self.seconds["sleep"] = round(time.perf_counter() - started, 6)
            after = statuses(self.server.workers)
            self.last_statuses = after
            awake = [pid for pid, s in after.items() if (s or {}).get("state") != "asleep"]
            if awake:
                raise UnsupportedError(
                    f"vLLM server {self.server.pid} reports sleeping, but worker(s) "
                    f"{', '.join(map(str, awake))} did not go to sleep through hibernate: the server uses "
                    "another sleep-mode backend",
                    hint=START_HINT,
                )
            self.operation.passed("vllm-sleep")

            phase = "cuda"
            self.sink.phase("cuda")
            started = time.perf_counter()
            cuda = _cuda_phase(self.server, self.options, self.operation, after)
            self.cuda_done = True
            self.seconds["cuda"] = round(time.perf_counter() - started, 6)
            self.operation.passed("cuda")
            return cuda
        except BaseException as exc:
            if phase == "cuda" and isinstance(exc, NeedsRecoveryError):
                raise  # CUDA could not be brought back: the workers stay asleep; `hibernate wake` finishes
            if self.cuda_done:
                _undo_cuda(self.server.targets, self.options, self.operation, exc)
            self.undo(exc)
            if isinstance(exc, HibernateError):
                exc.add_context(
                    f"vLLM server {self.server.pid} ({phase})", unless=f"vLLM server {self.server.pid}"
                )
            raise

    def undo(self, error: BaseException) -> None:
        """Back to awake and serving, from what was reached; NeedsRecoveryError if that fails too."""
        failures: list[str] = []
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
            and self.server.alive()
            and any((s or {}).get("busy") for s in statuses(self.server.workers).values())
        ):
            raise _LeftInFlight(
                f"{error.message}; the server is still carrying out the sleep, so nothing was undone",
                hint=f"once it finishes, `hibernate recover {self.server.pid}` brings the server back "
                f"(or `hibernate wake {self.server.pid}`)",
            ) from error
        alive = self.server.alive()
        if alive and self.slept:
            failures += self._wake_up()
        failures += _wake_leftovers(self.server, self.options)
        if alive and self.paused and not self.slept:
            failures += self._wake_up()  # resumes scheduling (vLLM's executor was not asleep)
        if alive and not failures:
            with contextlib.suppress(HibernateError):
                if self.server.http.is_sleeping():
                    failures.append(
                        f"the server at {self.server.address.url} still reports is_sleeping: true"
                    )
        for ref in self.server.workers:
            if ref.pid in self.configured:
                with contextlib.suppress(HibernateError), ref.connect(STATUS_TIMEOUT_S) as client:
                    client.call("configure", {"dir": self.configured[ref.pid]})
        if failures:
            raise NeedsRecoveryError(
                f"{error}; undoing it failed too: {'; '.join(failures)}",
                hint=f"run `hibernate recover {self.server.pid}` once the cause is fixed",
            ) from error

    def _wake_up(self) -> list[str]:
        try:
            flight = self.server.http.start_wake_up()
            self.watch(flight, None, "restore")
            self.answer(flight)
        except HibernateError as exc:
            return [f"POST /wake_up: {exc.message}"]
        return []

    def report(self, cuda: dict[str, Any], seconds: float) -> dict[str, Any]:
        processes = []
        for ref in self.server.workers:
            status = self.last_statuses.get(ref.pid) or {}
            operation = status.get("last_operation") or {}
            phases = {k: v for k, v in operation.items() if isinstance(v, dict)}
            processes.append(sleep_entry(ref.pid, status.get("name"), phases))
        return {
            "operation": "sleep",
            "directory": str(self.directory),
            "seconds": round(seconds, 6),
            "processes": processes,
            "cuda": cuda,
            "vllm": {
                **self.server.describe(),
                "level": self.level,
                "mode": self.drain,
                "seconds": self.seconds,
                "response": self.response,
            },
        }


def _wake_leftovers(server: Server, options: Options) -> list[str]:
    """Workers still asleep (that vLLM will not wake) woken through their agents; failures in words.

    A worker that exits meanwhile (its server died, and vLLM's workers end with
    it) is no failure: nothing of it is left to bring back.
    """
    alive = [ref for ref in server.workers if procinfo.is_alive(ref.identity)]
    asleep = [ref for ref in alive if (_status(ref) or {}).get("state") == "asleep"]
    failures = []
    for pid, outcome in _in_parallel(asleep, lambda ref: wake_directly(ref, options)).items():
        if isinstance(outcome, BaseException):
            ref = next(r for r in asleep if r.pid == pid)
            if isinstance(outcome, (AgentConnectionLost, NoSuchProcessError)) and exits(ref.identity):
                continue
            words = outcome.message if isinstance(outcome, HibernateError) else repr(outcome)
            failures.append(f"process {pid}: {words}")
    return failures


def _cuda_phase(
    server: Server, options: Options, operation: _Operation, found: Mapping[int, dict[str, Any] | None]
) -> dict[str, Any]:
    """Lock all, then checkpoint all CUDA holders; workers that checkpoint themselves are waited for."""
    own = {ref.pid for ref in server.workers if (found.get(ref.pid) or {}).get("self_checkpoint")}
    everyone = server.target.cuda_holders
    themselves = [h for h in everyone if h.pid in own]
    others = replace(server.target, cuda_holders=[h for h in everyone if h.pid not in own])
    report = _cuda_sleep([others], options, operation)
    if themselves:
        report = _await_self_checkpoint(themselves, options, report)
    return report


def _await_self_checkpoint(
    holders: Sequence[ProcessIdentity], options: Options, report: dict[str, Any]
) -> dict[str, Any]:
    """Wait for workers that checkpoint themselves (HIBERNATE_SELF_CHECKPOINT=1) to be checkpointed."""
    from hibernate.checkpoint.base import CheckpointStepError, CudaState

    checkpointer = _checkpointer(options)
    if checkpointer is None:  # guarded by _require_checkpointer
        raise UnsupportedError("the CUDA phase needs a checkpointer")
    started = time.monotonic()
    running_limit = options.agent_timeout + options.cuda_timeouts.lock
    overall_limit = running_limit + options.cuda_timeouts.checkpoint
    pending = {h.pid for h in holders}
    states: dict[int, str] = {}
    while pending:
        for pid in sorted(pending):
            try:
                state = checkpointer.state(pid)
            except CheckpointStepError as exc:
                raise CudaCheckpointError(f"process {pid}: {exc.message}") from exc
            states[pid] = state.value
            if state is CudaState.CHECKPOINTED:
                pending.discard(pid)
            elif state is CudaState.FAILED:
                raise CudaCheckpointError(
                    f"process {pid} is in the driver's failed state after checkpointing itself"
                )
        waited = time.monotonic() - started
        stuck = [p for p in pending if states.get(p) == "running" and waited > running_limit]
        if stuck or (pending and waited > overall_limit):
            late = stuck or sorted(pending)
            raise HibernateTimeoutError(
                f"worker(s) {', '.join(map(str, late))} did not checkpoint themselves within {waited:.0f}s "
                f"(HIBERNATE_SELF_CHECKPOINT=1; state {', '.join(states[p] for p in late)})",
                hint="their vLLM log says why (lines with 'hibernate:')",
            )
        if pending:
            time.sleep(POLL_S)
    seconds = round(time.monotonic() - started, 6)
    merged = dict(report)
    merged["processes"] = [
        *report.get("processes", []),
        *(
            {"pid": h.pid, "state": "checkpointed", "by": "itself", "seconds": seconds, "steps": {}}
            for h in holders
        ),
    ]
    # "checkpointed" alone means hibernate locked and checkpointed every holder itself.
    merged["status"] = (
        "checkpointed (by the workers themselves)"
        if not report.get("processes")
        else f"checkpointed ({len(holders)} by the workers themselves)"
    )
    return merged


def sleep(targets: Sequence[Target], directory: Path, options: Options, sink: ProgressSink) -> dict[str, Any]:
    """Put a vLLM server to sleep through its endpoints, then take its CUDA state off the GPU."""
    started = time.perf_counter()
    level = check_level(options.vllm.level)
    drain = check_drain(options.vllm.drain)
    if options.io.verify:
        raise UsageError(
            "--verify does not reach a vLLM server's workers: they sleep through the server's own /sleep, "
            "with the settings of their environment; nothing was changed",
            hint="start the server with HIBERNATE_VERIFY=1 in its environment",
        )
    server = locate(targets, options)
    _refuse_other_backend(server)
    operation = server.operation("sleep")
    operation.lock()
    with operation.concluding(_LeftInFlight):  # a sleep left in flight: `hibernate recover` reads the journal
        _require_checkpointer(server.targets, options)
        directory = prepare_directory(directory, server.targets)
        checkpointer = options.checkpointer
        operation.record(
            directory,
            list(server.target.cuda_holders),
            checkpointer.name if checkpointer is not None else None,
        )
        operation.passed("lock")
        found = statuses(server.target.agents)
        _check_ready(server, found)
        if server.http.probe():
            raise WrongStateError(
                f"the vLLM server at {server.address.url} (pid {server.pid}) reports is_sleeping: true "
                "(asleep, or its scheduling paused); nothing was changed",
                hint=f"wake it first: hibernate wake {server.pid}",
            )
        operation.passed("connect")
        run = _Sleep(server, operation, options, sink, directory, level, drain)
        cuda = run.run(found)
    return run.report(cuda, time.perf_counter() - started)


# -- wake -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _naming(server: Server, op: str) -> Iterator[None]:
    """An error of ``op`` says which server and which operation, unless it already names the server."""
    try:
        yield
    except NeedsRecoveryError:
        raise  # its message is the recovery's, worded whole
    except HibernateError as exc:
        exc.add_context(f"vLLM server {server.pid} ({op})", unless=("nothing to wake", "vLLM server"))
        raise


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


def wake(
    targets: Sequence[Target], options: Options, sink: ProgressSink, *, recovering: bool = False
) -> dict[str, Any]:
    """Restore and unlock the CUDA state, then POST /wake_up; the server must then say it is awake."""
    started = time.perf_counter()
    server = locate(targets, options)
    agent_first = recovering or _interrupted_sleep(server)
    operation = server.operation("wake")
    operation.lock()
    run = _Run(server, operation, options, sink)
    with operation.concluding(), _naming(server, "wake"):
        operation.record(None, list(server.target.cuda_holders), None)
        operation.passed("lock")
        found = _settle(server, options)
        alive = server.alive()
        sleeping = server.http.probe() if alive else None
        operation.passed("connect")
        sink.phase("cuda")
        cuda = _cuda_wake(server.targets, options, operation)
        operation.passed("cuda")
        asleep = [ref for ref in server.workers if (found.get(ref.pid) or {}).get("state") == "asleep"]
        if not asleep and not sleeping and not _cuda_changed(cuda):
            raise WrongStateError(
                f"nothing to wake: vLLM server {server.pid} is awake "
                "(is_sleeping: false, every worker running)"
            )
        sink.phase("wake_up")
        seconds: dict[str, float] = {}
        response: dict[str, Any] = {}
        woken: dict[int, dict[str, Any]] = {}
        began = time.time()
        if asleep and (agent_first or not sleeping):
            # vLLM may not know these sleep (an interrupted or failed /sleep): woken through their
            # agents before scheduling resumes; vLLM's own wake_up then finds them awake.
            failures = _woken_directly(asleep, options, woken)
            if failures:
                raise failures[0]
        if sleeping:
            clock = time.perf_counter()
            flight = server.http.start_wake_up()
            run.watch(flight, "vllm-wake", "restore")
            response = run.answer(flight)
            seconds["wake_up"] = round(time.perf_counter() - clock, 6)
        # A worker vLLM did not wake (its executor never recorded that sleep): only after a failed
        # sleep whose journal is gone; scheduling has resumed, so wake it at once.
        after = statuses(server.workers)
        leftovers = [ref for ref in server.workers if (after.get(ref.pid) or {}).get("state") == "asleep"]
        if leftovers:
            failures = _woken_directly(leftovers, options, woken)
            if failures:
                raise failures[0]
            after = statuses(server.workers)
        if alive and server.http.is_sleeping():
            raise ServerFailedError(
                f"the vLLM server at {server.address.url} still reports is_sleeping: true "
                "after POST /wake_up",
                hint=f"see the server's log; then run `hibernate wake {server.pid}` again",
            )
        operation.passed("vllm-wake")
    processes = []
    for ref in asleep:
        status = after.get(ref.pid) or {}
        if ref.pid in woken:
            phases = woken[ref.pid]
        else:
            last = status.get("last_operation") or {}
            phases = (
                {k: v for k, v in last.items() if isinstance(v, dict)} if last.get("op") == "wake" else {}
            )
            if float(last.get("finished_unix", 0.0)) < began:
                phases = {}
        snapshot = (status.get("snapshot") or {}).get("path")
        processes.append(wake_entry(ref.pid, status.get("name"), snapshot, phases))
    return {
        "operation": "wake",
        "seconds": round(time.perf_counter() - started, 6),
        "processes": processes,
        "cuda": cuda,
        "vllm": {
            **server.describe(),
            "seconds": seconds,
            "response": response,
            "woken_directly": sorted(woken),
            "server_alive": alive,
        },
    }


def _woken_directly(
    refs: Sequence[AgentRef], options: Options, woken: dict[int, dict[str, Any]]
) -> list[HibernateError]:
    failures: list[HibernateError] = []
    for pid, outcome in _in_parallel(refs, lambda ref: wake_directly(ref, options)).items():
        if isinstance(outcome, HibernateError):
            failures.append(outcome.add_context(f"process {pid} stays asleep"))
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            woken[pid] = outcome
    return failures


# -- recover ----------------------------------------------------------------------------------


def _finish_sleep(server: Server, options: Options, sink: ProgressSink) -> dict[str, Any]:
    """The CUDA phase of a sleep whose workers are all asleep already."""
    operation = server.operation("sleep")
    operation.lock()
    with operation.concluding():
        _require_checkpointer(server.targets, options)  # refuses holders that are not all running
        sink.phase("cuda")
        cuda = _cuda_phase(server, options, operation, statuses(server.workers))
    return {"operation": "sleep", "cuda": cuda}


def recover(targets: Sequence[Target], options: Options, sink: ProgressSink) -> dict[str, Any]:
    """Finish or undo what an interrupted sleep or wake of a vLLM server left, from the journal and states.

    A sleep the server had carried out, with every CUDA holder still running,
    is finished (only the CUDA phase was left). Anything else is brought back
    to awake: CUDA restored, sleeping workers woken (through their agents
    first: vLLM may not know they sleep), scheduling resumed.
    """
    server = locate(targets, options)
    found = [(ref, interrupted_operation(ref)) for ref in server.target.agents]
    busy = [(ref, i) for ref, i in found if i and "in_progress" in i]
    if busy:
        ref, info = busy[0]
        raise BusyError(f"process {ref.pid} is busy: {info['in_progress']} is operating on it")
    pending = [i for _, i in found if i]
    if not pending:
        states = ", ".join(f"{r.pid}: {r.status.get('state')}" for r in server.target.agents)
        return {"operation": "recover", "action": "none", "message": f"nothing to recover ({states})"}
    op, phases = pending[0]["op"], pending[0]["phases"]
    now = _settle(server, options)
    all_asleep = all((now.get(w.pid) or {}).get("state") == "asleep" for w in server.workers)
    if op == "sleep" and phases and phases[-1] == "cuda" and all_asleep:
        operation = server.operation("sleep")
        operation.lock()
        operation.finish()
        return {"operation": "recover", "action": "the interrupted sleep had completed", "report": None}
    if op == "sleep" and "vllm-sleep" in phases and all_asleep:
        try:
            report = _finish_sleep(server, options, sink)
            return {"operation": "recover", "action": "finished the interrupted sleep", "report": report}
        except HibernateError as exc:
            sink.phase(f"cannot finish the sleep ({exc.message}); waking instead")
    try:
        report = wake(targets, options, sink, recovering=True)
    except WrongStateError:
        return {"operation": "recover", "action": f"the interrupted {op} had changed nothing", "report": None}
    action = "finished the interrupted wake" if op == "wake" else "undid the interrupted sleep"
    return {"operation": "recover", "action": action, "report": report}
