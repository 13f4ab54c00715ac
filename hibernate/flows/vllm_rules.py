"""The vLLM flow's pure rules: which agents are a vLLM server's workers, what --level and --drain
accept, and what counts as progress while the server works.

They read agents' statuses and the caller's options and touch no process, so
that :mod:`hibernate.flows.vllm` (the steps) and :mod:`.vllm_processes` (the
server's processes) share them, and tests check them alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hibernate.agent.wire import AgentStatus
from hibernate.errors import UsageError
from hibernate.flows.vllm_api import DRAIN_MODES
from hibernate.integrations import VLLM_KIND

POOL = "vllm-cumem"  # the pool of a worker's CuMemAllocator allocations
# The CLI's copy of hibernate.pools.vllm.SLEEP_LEVELS, which loads the store; a test pins them.
LEVELS = (1, 2)


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
