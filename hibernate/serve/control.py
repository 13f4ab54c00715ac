"""The proxy's hands: the same engine as ``hibernate sleep/wake/recover/status``, one backend at a time.

Every call blocks (it is the engine); the proxy runs them in worker threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hibernate import orchestrator, procinfo
from hibernate.agent.wire import AgentState, state_of
from hibernate.checkpoint import nvml, records
from hibernate.checkpoint.group import HEADROOM_BYTES
from hibernate.errors import HibernateError, NoSuchProcessError, PermissionDeniedError, UsageError
from hibernate.flows.members import holds_leases
from hibernate.operation import targets
from hibernate.serve import discovery
from hibernate.serve.config import BackendSpec

# How long the proxy's own sleep waits for requests in flight through others (their leases).
LEASE_WAIT_SECONDS = 2.0


@dataclass(frozen=True)
class Inspection:
    pid: int
    awake: bool
    tracked_bytes: int
    recovered: str | None = None  # what a recovery did first, if one was needed


def gpu_usage(reading: nvml.DeviceReading, pids: set[int]) -> dict[str, int]:
    """GPU UUID -> bytes the processes ``pids`` hold there, from one NVML reading."""
    usage: dict[str, int] = {}
    for pid in pids:
        for uuid, nbytes in reading.usage_of(pid).items():
            usage[uuid] = usage.get(uuid, 0) + nbytes
    return usage


def tracked_bytes(entries: list[dict[str, Any]]) -> int:
    """The memory a backend's agents track (awake, it is on the GPU; asleep, in the snapshot)."""
    return sum(int(pool.get("bytes", 0)) for entry in entries for pool in entry.get("pools", []))


def is_awake(entries: list[dict[str, Any]]) -> bool:
    return bool(entries) and all(state_of(entry) is AgentState.RUNNING for entry in entries)


def refuse_tree_holding_proxy(name: str, pid: int, proxy: int | None = None) -> None:
    """A backend's pid whose process tree holds the proxy itself is a mistake, refused.

    A sleep acts on every agent of a pid's tree: ``pid = 1``, or the shell that
    started both the proxy and the backends, would put every hibernate target of
    the user to sleep, and the proxy's own process with them.
    """
    proxy = os.getpid() if proxy is None else proxy
    if targets.tree_holds(pid, proxy):
        raise UsageError(
            f"backend {name}: pid {pid} is this proxy (pid {proxy}) or one of its ancestors; a sleep "
            "would act on every process under it",
            hint="give the backend's own server process (or leave pid out: it is found from the port)",
        )


def refuse_other_user(name: str, server: discovery.Server, euid: int | None = None) -> None:
    """As root, a backend found from its address must be root's own process: a process of another
    user is adopted (and put to sleep) only when serve.toml names its pid."""
    euid = os.geteuid() if euid is None else euid
    if euid == 0 and server.uid != 0:
        raise PermissionDeniedError(
            f"backend {name}: {server.describe()} belongs to {procinfo.describe_user(server.uid)}; as root, "
            "hibernate serve adopts another user's process only when serve.toml names its pid",
            hint=f"add pid = {server.pid} to the backend's [[backend]] table in serve.toml, or run "
            "hibernate serve as that user",
        )


class BackendControl:
    """What serve does to a backend's processes: find and adopt them, sleep, wake, measure."""

    def __init__(self, directory: Path, sleep_timeout: float) -> None:
        self.directory = directory
        self.sleep_timeout = sleep_timeout

    def options(self, lease_timeout: float | None = None) -> orchestrator.Options:
        """A sleep's or wake's options: serve's sleep timeout as ``--timeout``, and
        ``HIBERNATE_ALLOW_MOVES`` in serve's environment as ``--allow-moves`` (for backends that
        capture their CUDA graphs again after each wake)."""
        return orchestrator.options_from_flags(
            timeout=self.sleep_timeout, lease_timeout=lease_timeout, allow_moves=None
        )

    def find(self, spec: BackendSpec) -> int:
        if spec.pid is not None:
            return spec.pid  # refused at start if its tree holds the proxy (server.serve)
        host, port = spec.host_port
        try:
            server = discovery.server_at(host, port)
        except HibernateError as exc:
            raise exc.add_context(f"backend {spec.name}") from None
        if server is None:
            raise NoSuchProcessError(
                f"backend {spec.name}: no process of yours listens on port {port} ({spec.url})",
                hint="start the backend first, or give its pid in serve.toml",
            )
        refuse_other_user(spec.name, server)
        return server.pid

    def agent_sockets(self, pid: int) -> list[Path]:
        """The sockets of every agent of the backend's process tree that knows leases (what its leases
        are taken on). A backend still running a hibernate from before leases has none to take:
        its requests are forwarded as before, on the state the proxy last saw."""
        refs = [ref for target in targets.resolve([pid]) for ref in target.agents]
        return [ref.socket for ref in refs if holds_leases(ref.status)]

    def adopt(self, spec: BackendSpec, pid: int | None = None) -> Inspection:
        """The backend's process and state; an interrupted sleep or wake is finished or undone first."""
        pid = pid if pid is not None else self.find(spec)
        entries = orchestrator.status([pid])
        recovered = None
        if any(entry.get("interrupted") for entry in entries):
            recovered = orchestrator.recover([pid], self.options()).action
            entries = orchestrator.status([pid])
        return Inspection(pid, is_awake(entries), tracked_bytes(entries), recovered)

    def sleep(self, pid: int) -> tuple[int, int]:
        """Put the backend to sleep; the bytes spilled: written, and reused from its previous snapshot
        (unchanged since, linked rather than written again).

        The proxy's sleeps (idle, or making room) are its own choice: requests in flight through
        another proxy mean the backend is in use, so they are waited for briefly, not --timeout.
        """
        options = self.options(lease_timeout=min(self.sleep_timeout, LEASE_WAIT_SECONDS))
        report = orchestrator.sleep([pid], self.directory, options)
        written = sum(int(p.written_bytes) for p in report.processes)
        reused = sum(int(p.reused_bytes) for p in report.processes)
        return written, reused

    def wake(self, pid: int) -> int:
        """Wake the backend; the bytes restored."""
        report = orchestrator.wake([pid], self.options())
        return sum(int(p.restored_bytes) for p in report.processes)

    def gpu_usage(self, pid: int) -> dict[str, int]:
        """What the backend's process tree holds on each GPU now (NVML; empty without it)."""
        reading = nvml.read_gpus()
        if reading is None:
            return {}
        return gpu_usage(reading, {pid, *procinfo.descendants(pid)})

    def gpu_need(self, pid: int) -> dict[str, int]:
        """What waking the backend will take on each GPU: what its checkpointed processes held there when
        put to sleep (the records `hibernate wake` checks too), each with the restore's headroom."""
        need: dict[str, int] = {}
        for member in {pid, *procinfo.descendants(pid)}:
            ident = procinfo.identity(member)
            record = records.load(ident) if ident is not None else None
            usage = record.get("gpus") if record else None
            if isinstance(usage, dict):
                for uuid, nbytes in usage.items():
                    need[str(uuid)] = need.get(str(uuid), 0) + int(nbytes) + HEADROOM_BYTES
        return need

    def gpu_free(self) -> dict[str, int]:
        """Free bytes of each GPU now (NVML; empty without it)."""
        reading = nvml.read_gpus()
        return {gpu.uuid: gpu.free for gpu in reading.gpus} if reading is not None else {}

    def status(self, pid: int | None) -> list[dict[str, Any]]:
        """What ``hibernate status PID --json`` lists as ``agents``."""
        if pid is None:
            return []
        try:
            return orchestrator.status([pid])
        except HibernateError:
            return []
