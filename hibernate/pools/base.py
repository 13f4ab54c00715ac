"""The contract between the agent and whatever memory it hibernates.

A pool enumerates its regions when a sleep starts; the agent keeps that list
until the wake, so the snapshot and the memory it came from are matched one to
one. Regions with ``keep`` are written to the snapshot; the others are only
released and come back zero-filled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hibernate.store.regions import Region


class SpillableRegion(Region, Protocol):
    @property
    def keep(self) -> bool:
        """Whether the contents survive a sleep (weights) or are dropped (KV cache)."""
        ...

    def release(self) -> None:
        """Give the memory back; the contents are lost."""
        ...

    def reallocate(self) -> None:
        """Take memory again (contents undefined until filled or zeroed)."""
        ...

    def zero(self) -> None: ...


class Pool(Protocol):
    name: str

    def regions(self) -> Sequence[SpillableRegion]:
        """Every region of the pool, in a stable order, as of now."""
        ...

    def after_release(self) -> None:
        """Return freed memory to the system (malloc_trim, empty_cache...)."""
        ...

    def pinner(self) -> Callable[[memoryview], Callable[[], None]] | None:
        """A way to page-lock staging buffers for fast device copies, if this pool needs one."""
        ...


@dataclass(frozen=True)
class PoolSummary:
    pool: str
    tag: str
    keep: bool
    count: int
    bytes: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "tag": self.tag,
            "keep": self.keep,
            "count": self.count,
            "bytes": self.bytes,
        }


def summarize(pool_name: str, regions: Sequence[SpillableRegion]) -> list[PoolSummary]:
    """Regions grouped by (tag, keep), in order of first appearance."""
    groups: dict[tuple[str, bool], list[int]] = {}
    for region in regions:
        entry = groups.setdefault((region.tag, region.keep), [0, 0])
        entry[0] += 1
        entry[1] += region.nbytes
    return [PoolSummary(pool_name, tag, keep, n, size) for (tag, keep), (n, size) in groups.items()]
