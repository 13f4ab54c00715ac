"""A vLLM server's processes, read and acted on through their agents, for the flow's steps.

Here: finding the server from any pid of it (:func:`locate`), polling its
workers' agents while it works (:func:`statuses`, :class:`WorkerMonitor`,
:func:`settle`), what is checked before a sleep changes anything
(:func:`refuse_other_backend`, :func:`check_ready`), and the undo that vLLM
cannot do: a worker woken through its agent (:func:`wake_directly`,
:func:`wake_leftovers`, :func:`woken_directly`). The steps that use them, and
the order they run in, are :mod:`hibernate.flows.vllm`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hibernate import procinfo
from hibernate.agent.client import AgentClient, AgentConnectionLostError
from hibernate.agent.wire import AgentState, state_of
from hibernate.errors import (
    BusyError,
    HibernateError,
    HibernateTimeoutError,
    NoSuchProcessError,
    UnsupportedError,
    UsageError,
    WrongStateError,
)
from hibernate.flows.members import died_during_wake, exits
from hibernate.flows.vllm_api import (
    START_HINT,
    ServerAddress,
    VllmServer,
    address_from_argv,
    flag_values,
    parse_url,
    read_argv,
)
from hibernate.flows.vllm_rules import SilenceWatch, holds_pools, is_vllm, signature
from hibernate.operation.ledger import interrupted_operation
from hibernate.operation.options import Options
from hibernate.operation.targets import AgentRef, Target, find_agent, resolve
from hibernate.operation.unit import Context
from hibernate.procinfo import ProcessIdentity
from hibernate.threads import run_each

POLL_S = 0.05
STATUS_TIMEOUT_S = 10.0


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


def status_of(ref: AgentRef, timeout: float = STATUS_TIMEOUT_S) -> dict[str, Any] | None:
    """The agent's status now; None if its process is gone."""
    try:
        with AgentClient(ref.socket, timeout=timeout) as client:
            return client.call("status")
    except AgentConnectionLostError:
        return None


def statuses(refs: Sequence[AgentRef]) -> dict[int, dict[str, Any] | None]:
    return {ref.pid: status_of(ref) for ref in refs}


class WorkerMonitor:
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
        restore = client.call("restore", options.io.to_args(), silence_timeout=options.agent_timeout)
        resume = client.call("resume")
    return {"restore": restore, "resume": resume}


def refuse_other_backend(server: Server) -> None:
    """A server started with another sleep-mode backend is refused before anything changes."""
    backend = flag_values(read_argv(server.pid)).get("--sleep-mode-backend")
    if backend is not None and backend != "hibernate":
        raise UnsupportedError(
            f"vLLM server {server.pid} was started with --sleep-mode-backend {backend}: its workers would "
            "keep their memory in host RAM instead of writing it to --to, and hibernate cannot take their "
            "CUDA state off the GPU then; nothing was changed",
            hint=START_HINT,
        )


def check_ready(server: Server, found: Mapping[int, dict[str, Any] | None]) -> None:
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


def interrupted_sleep(server: Server) -> bool:
    """An earlier sleep stopped before the server had answered it: vLLM may not know its workers sleep."""
    for ref in server.target.agents:
        info = interrupted_operation(ref)
        if info and info.get("op") == "sleep" and "vllm-sleep" not in info.get("phases", []):
            return True
    return False


def settle(server: Server, options: Options) -> dict[int, dict[str, Any] | None]:
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


def wake_leftovers(server: Server, options: Options) -> list[str]:
    """Workers still asleep (that vLLM will not wake) woken through their agents; failures in words.

    A worker that exits meanwhile (its server died, and vLLM's workers end with
    it) is no failure: nothing of it is left to bring back. On a loaded machine
    its exit can take seconds after its agent stopped answering.
    """
    alive = [ref for ref in server.workers if procinfo.is_alive(ref.identity)]
    asleep = [ref for ref in alive if state_of(status_of(ref)) is AgentState.ASLEEP]
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


def woken_directly(
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
