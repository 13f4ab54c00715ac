"""The contract between the agent and whatever memory it hibernates.

A pool enumerates its regions when a sleep starts; the agent keeps that list
until the wake, so the snapshot and the memory it came from are matched one to
one. Regions with ``keep`` are written to the snapshot; the others are only
released and come back zero-filled.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
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

    @property
    def released(self) -> bool:
        """Whether its memory is away now (released, not yet reallocated)."""
        ...

    @property
    def resident_after_release(self) -> int:
        """Bytes a release leaves in memory (the partial edge pages of host memory freed in place)."""
        ...


class RegionAttributes:
    """The five read-only attributes of a pool's region (SpillableRegion): key, tag, keep, nbytes, meta.

    Each pool's region class held the same five as private fields behind the same five properties;
    they live here once. Read-only, because the agent keeps the regions from a sleep to its wake and
    matches the snapshot to them by these values: they are fixed when the pool enumerates a region.
    A subclass adds the copies and the release; it may read ``self._key`` and the others directly.
    """

    def __init__(self, key: str, tag: str, keep: bool, nbytes: int, meta: Mapping[str, Any]) -> None:
        self._key = key
        self._tag = tag
        self._keep = keep
        self._nbytes = nbytes
        self._meta = meta

    @property
    def key(self) -> str:
        return self._key

    @property
    def tag(self) -> str:
        return self._tag

    @property
    def keep(self) -> bool:
        return self._keep

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def meta(self) -> Mapping[str, Any]:
        return self._meta

    @property
    def resident_after_release(self) -> int:
        """Nothing, unless a region frees its memory only in part (see SpillableRegion)."""
        return 0


class Pool(Protocol):
    name: str

    def regions(self) -> Sequence[SpillableRegion]:
        """Every region of the pool, in a stable order, as of now."""
        ...

    def after_release(self) -> None:
        """Return freed memory to the system (malloc_trim, empty_cache...)."""
        ...

    def pinner(self) -> Callable[[memoryview], Callable[[], None] | None] | None:
        """A way to page-lock staging buffers for fast device copies, if this pool needs one.

        A pool whose device copies run on streams returns a
        pipeline.DeviceStaging: the store then queues a staging chunk's copies
        and waits once for all of them, not for each.
        """
        ...

    def synchronize(self) -> None:
        """Wait for all work queued on every device holding a region, on any stream.

        Called before a spill reads a region and after a wake refilled and zeroed them:
        the program's side streams are not ordered with the pool's own copies.
        """
        ...

    def contents(self) -> Contents:
        """What ``Contents.of(name, regions())`` says now: what ``status`` shows of a running process."""
        ...

    def warnings(self) -> list[str]:
        """What the newest ``regions()`` found that a sleep will not free, in words for its report."""
        ...

    def moves_refusal(self) -> str | None:
        """Why the newest ``regions()`` may not sleep: memory a captured CUDA graph may read would come
        back at new addresses (hibernate.pools.graphs); None where nothing of the pool moves."""
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


def device_bytes(regions: Sequence[SpillableRegion]) -> dict[str, int]:
    """Bytes per CUDA device ("cuda:N") of ``regions``: what a wake maps back on each GPU.

    A region names its device in ``meta["device"]``: a torch device string
    ("cuda:0", "cpu") or a vLLM pool's device index. CPU regions are left out.
    """
    total: dict[str, int] = {}
    for region in regions:
        device = region.meta.get("device")
        name = f"cuda:{device}" if isinstance(device, int) else str(device or "")
        if name == "cuda":
            name = "cuda:0"
        if name.startswith("cuda:"):
            total[name] = total.get(name, 0) + region.nbytes
    return total


@dataclass(frozen=True)
class Contents:
    """What a status shows of a pool: its regions by tag (``summarize``) and its bytes on each CUDA
    device (``device_bytes``)."""

    summaries: list[PoolSummary]
    device_bytes: dict[str, int]

    @classmethod
    def of(cls, pool_name: str, regions: Sequence[SpillableRegion]) -> Contents:
        return cls(summarize(pool_name, regions), device_bytes(regions))
