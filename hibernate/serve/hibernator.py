"""The proxy's hands: the same engine as ``hibernate sleep/wake/recover/status``, one backend at a time.

Every call blocks (it is the engine); the proxy runs them in worker threads.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hibernate import orchestrator
from hibernate.errors import HibernateError, NoSuchProcessError
from hibernate.serve import discovery
from hibernate.serve.config import BackendSpec


@dataclass(frozen=True)
class Inspection:
    pid: int
    awake: bool
    tracked_bytes: int
    recovered: str | None = None  # what a recovery did first, if one was needed


def tracked_bytes(entries: list[dict[str, Any]]) -> int:
    """The memory a backend's agents track (awake, it is on the GPU; asleep, in the snapshot)."""
    return sum(int(pool.get("bytes", 0)) for entry in entries for pool in entry.get("pools", []))


def is_awake(entries: list[dict[str, Any]]) -> bool:
    return bool(entries) and all(entry.get("state") == "running" for entry in entries)


class Hibernator:
    def __init__(self, directory: Path, sleep_timeout: float) -> None:
        self.directory = directory
        self.sleep_timeout = sleep_timeout

    def options(self) -> orchestrator.Options:
        options = orchestrator.Options(quiesce_timeout=self.sleep_timeout)
        options.agent_timeout = max(self.sleep_timeout, 5.0)
        return options

    def find(self, spec: BackendSpec) -> int:
        if spec.pid is not None:
            return spec.pid
        _, port = spec.host_port
        pid = discovery.listener_pid(port)
        if pid is None:
            raise NoSuchProcessError(
                f"backend {spec.name}: no process of yours listens on port {port} ({spec.url})",
                hint="start the backend first, or give its pid in serve.toml",
            )
        return pid

    def adopt(self, spec: BackendSpec, pid: int | None = None) -> Inspection:
        """The backend's process and state; an interrupted sleep or wake is finished or undone first."""
        pid = pid if pid is not None else self.find(spec)
        entries = orchestrator.status([pid])
        recovered = None
        if any(entry.get("interrupted") for entry in entries):
            recovered = orchestrator.recover([pid], self.options()).action
            entries = orchestrator.status([pid])
        return Inspection(pid, is_awake(entries), tracked_bytes(entries), recovered)

    def sleep(self, pid: int) -> int:
        """Put the backend to sleep; the bytes spilled."""
        report = orchestrator.sleep([pid], self.directory, self.options())
        return sum(int(p.total_bytes) for p in report.processes)

    def wake(self, pid: int) -> int:
        """Wake the backend; the bytes restored."""
        report = orchestrator.wake([pid], self.options())
        return sum(int(p.restored_bytes) for p in report.processes)

    def status(self, pid: int | None) -> list[dict[str, Any]]:
        """What ``hibernate status PID --json`` lists as ``agents``."""
        if pid is None:
            return []
        try:
            return orchestrator.status([pid])
        except HibernateError:
            return []
