"""torch_memory_saver as the provider of ``hibernate.pool()`` (the ``hibernate[pools]`` extra).

torch_memory_saver (0.0.10) in its ``torch`` hook mode gives each tag a
``torch.cuda.MemPool`` whose raw allocations come from its own pluggable
allocator: each is a reserved virtual range with physical memory mapped in.
``pause(tag)`` unmaps and releases the physical memory of every allocation
with that tag; ``resume(tag)`` creates and maps fresh memory at the same
addresses. Its CPU and disk backups stay off: the bytes go through
hibernate's store instead (spilled before the pause, written back and
verified after the resume).

Its C core ends the process (``exit(1)``) on three things this pool
therefore never lets happen: a pause of a tag that holds an allocation not
mapped (a second pause), a resume of one that holds an allocation mapped
(one made while the tag slept), and a resume the GPU has no memory for. A
pool keeps which tags it paused and what they held, refuses a resume whose
tag gained an allocation meanwhile, and checks the free memory of every GPU
before it maps anything back.

hibernate's tags live in a name space of their own in torch_memory_saver's
process-wide tags (``hibernate:<tag>``): a pause acts on every allocation with
its tag, whoever made it, and a library that uses torch_memory_saver itself
with a tag such as ``weights`` must not have its memory paused unspilled.

Each ``hibernate.cuda_graph`` capture gets a MemPool of its own, under a
torch_memory_saver tag of its own (``hibernate:<tag>/graph-<n>``; a hibernate
tag has no ``/``), hibernated with its tag. Blocks a capture frees return to
its pool's free list (torch's caching allocator reuses them within the
capture), and the graph writes them on every replay: a pool shared with
``hibernate.pool(tag)`` blocks would hand them to the program's next tensors.

Which memory a tag holds is read from torch's allocator: the segments of the
tag's MemPools (``torch.cuda.memory_snapshot(pool_id)``), each one raw
allocation of torch_memory_saver. torch_memory_saver names no public way to
reach those pools; they are read from its ``_impl._mem_pools``, keyed
``(tag, cpu backup, disk backup, backup kind, device)`` in 0.0.10, and a
version that keeps them elsewhere is refused with that said.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from hibernate import faults
from hibernate.errors import HibernateError, UnsupportedError, UsageError, WrongStateError
from hibernate.pools.base import Contents, SpillableRegion
from hibernate.pools.device import (
    CudaCopies,
    DeviceCopies,
    DeviceRegion,
    PinFn,
    free_device_bytes,
)
from hibernate.pools.graphs import PoolId
from hibernate.pools.provided import (
    TORCH_MEMORY_SAVER,
    Span,
    bytes_to_map,
    declare_once,
    no_room,
    resume_margin,
    shortfalls,
)

KNOWN_VERSION = "0.0.10"
HOOK_MODE = "torch"
TAG_PREFIX = "hibernate:"  # hibernate's tags among torch_memory_saver's (see the module docstring)
CAPTURE_SUFFIX = "/graph-"  # a capture's own tag: hibernate:<tag>/graph-<n>

Segments = Callable[[PoolId], Sequence[Mapping[str, Any]]]


def _cuda_segments(pool: PoolId) -> Sequence[Mapping[str, Any]]:
    import torch

    return list(torch.cuda.memory_snapshot(pool, include_traces=False))


def _cuda_device() -> int:
    import torch

    return int(torch.cuda.current_device())


def _import_saver() -> Any:
    try:
        import torch_memory_saver
    except ImportError as exc:
        raise UnsupportedError(
            f"torch_memory_saver cannot be imported ({exc})",
            hint="pip install 'hibernate[pools]'",
        ) from exc
    return torch_memory_saver


def spans_of(tag: str, segments: Sequence[Mapping[str, Any]]) -> list[Span]:
    """One span per segment (one raw allocation of the provider), in address order."""
    found = [
        Span(tag, int(s["device"]), int(s["address"]), int(s["total_size"]))
        for s in segments
        if int(s["total_size"]) > 0
    ]
    return sorted(found, key=lambda span: (span.device, span.address))


def unlisted(spans: Sequence[Span], listed: Sequence[Span]) -> list[Span]:
    """The allocations of ``spans`` that ``listed`` does not hold (made since it was taken)."""
    known = {(span.device, span.address) for span in listed}
    return [span for span in spans if (span.device, span.address) not in known]


def pools_of_tag(mem_pools: Mapping[Any, Any], tag: str) -> list[PoolId]:
    """The ids of torch_memory_saver's MemPools for ``tag`` (any device, any backup setting)."""
    ids = []
    for key, pool in list(mem_pools.items()):
        if isinstance(key, tuple) and key and key[0] == tag:
            first, second = pool.id
            ids.append((int(first), int(second)))
    return ids


class TmsRegion(DeviceRegion):
    """One raw allocation of torch_memory_saver: released and mapped back with its whole tag."""

    def __init__(self, pool: TmsPool, span: Span, keep: bool, listed: Sequence[Span]) -> None:
        key = f"{span.tag}/{span.address:#x}"
        super().__init__(key, span.tag, keep, span.nbytes, span.device, span.address)
        self._pool = pool
        self._listed = listed  # every allocation of its tag listed with it

    def _copies(self) -> DeviceCopies:
        return self._pool.copies()

    def release(self) -> None:
        """The whole tag is paused with its first region; the others find it paused."""
        self._pool.pause(self._tag, self._listed)

    def reallocate(self) -> None:
        self._pool.resume(self._tag)

    @property
    def released(self) -> bool:
        return self._pool.asleep(self._tag)

    def zero(self) -> None:
        self._pool.copies().zero(self._device, self._address, self._nbytes)


class TmsPool:
    """The allocations of the tags given to ``hibernate.pool()``, paused and resumed a tag at a time."""

    name = TORCH_MEMORY_SAVER

    def __init__(self, provider: TmsProvider) -> None:
        self._provider = provider
        self._lock = threading.Lock()
        self._keep: dict[str, bool] = {}
        self._paused: dict[str, list[Span]] = {}  # tag -> what it held when paused
        # tag -> its torch_memory_saver tags paused and not yet resumed (a capture's own among them)
        self._paused_saver_tags: dict[str, list[str]] = {}
        # The devices the newest regions() found: what synchronize and pinner act on, without asking
        # torch's allocator again (its snapshot is costly, and a sleep asks right after regions()).
        self._devices: frozenset[int] = frozenset()

    def declare(self, tag: str, keep: bool) -> None:
        with self._lock:
            declare_once(self._keep, tag, keep)

    def asleep(self, tag: str) -> bool:
        with self._lock:
            return tag in self._paused

    def copies(self) -> DeviceCopies:
        return self._provider.copies()

    def spans(self) -> list[Span]:
        with self._lock:
            tags = list(self._keep)
            paused = {tag: list(spans) for tag, spans in self._paused.items()}
        return [span for tag in tags for span in paused.get(tag) or self._provider.spans(tag)]

    # -- the Pool contract -----------------------------------------------------

    def contents(self) -> Contents:
        return Contents.of(self.name, self.regions())  # a few regions: nothing to spare

    def regions(self) -> Sequence[SpillableRegion]:
        with self._lock:
            keep = dict(self._keep)
        listed: dict[str, list[Span]] = {tag: [] for tag in keep}
        spans = self.spans()
        for span in spans:
            listed[span.tag].append(span)
        self._devices = frozenset(span.device for span in spans)
        return [
            TmsRegion(self, span, keep[tag], listed[tag]) for tag, spans in listed.items() for span in spans
        ]

    def after_release(self) -> None:
        """Nothing: a pause hands the physical memory back to the driver itself."""

    def pinner(self) -> PinFn | None:
        """The seam's page-locking, where the newest regions() found allocations."""
        return self.copies().pinner() if self._devices else None

    def synchronize(self) -> None:
        """Wait for every device the newest regions() found an allocation on (all its streams)."""
        for device in sorted(self._devices):
            self.copies().synchronize(device)

    def warnings(self) -> list[str]:
        return []

    def moves_refusal(self) -> str | None:
        """Nothing of this pool moves: that is what it is for."""
        return None

    # -- pause and resume, a tag at a time ---------------------------------------

    def pause(self, tag: str, listed: Sequence[Span]) -> None:
        """Release the tag's memory, if all of it is what the sleep spilled (``listed``: what the regions
        it wrote were), once the GPU is done with it.

        An allocation made after the spill enumerated the tag (a thread that
        allocated outside guard()) has no bytes in the snapshot: refused, and
        the sleep is undone, rather than paused and lost.
        """
        with self._lock:
            if tag in self._paused:
                return
        spans = self._provider.spans(tag)
        late = unlisted(spans, listed)
        if late:
            raise WrongStateError(
                f"memory was allocated in hibernate.pool({tag!r}) after its bytes were written "
                f"({len(late)} allocation(s), {sum(s.nbytes for s in late)} bytes): nothing was released",
                hint="allocate in a pool only inside hibernate.pool() blocks, which a sleep waits for",
            )
        for device in sorted({span.device for span in spans}):
            self.copies().synchronize(device)  # no kernel of an unguarded thread still uses the memory
        for saver_tag in self._provider.saver_tags(tag):
            faults.point("pool.pause")
            self._provider.pause(saver_tag)
            with self._lock:  # asleep from its first part on: a failure later resumes what went
                self._paused[tag] = spans
                self._paused_saver_tags.setdefault(tag, []).append(saver_tag)

    def resume(self, tag: str) -> None:
        """Map the tag back, unless that would end the process inside torch_memory_saver."""
        with self._lock:
            paused = self._paused.get(tag)
        if paused is None:
            return
        now = self._provider.spans(tag)
        added = unlisted(now, paused)
        if added:
            raise WrongStateError(
                f"memory was allocated in hibernate.pool({tag!r}) while it slept "
                f"({len(added)} allocation(s), {sum(s.nbytes for s in added)} bytes, at "
                f"{', '.join(hex(s.address) for s in added[:3])}): torch_memory_saver ends the process "
                "when it resumes a tag holding memory that is not paused, so the process stays asleep and "
                "cannot be woken; its snapshot is whole, for a process restarted from it",
                hint="allocate in a pool only inside hibernate.pool() blocks, which wait for the wake",
            )
        short = shortfalls(bytes_to_map(now), self._provider.free_bytes, resume_margin(len(now)))
        if short:
            raise no_room(short, f"hibernate.pool({tag!r})")
        with self._lock:
            saver_tags = list(self._paused_saver_tags.get(tag, ()))
        for saver_tag in saver_tags:
            faults.point("pool.resume")
            self._provider.resume(saver_tag)
            with self._lock:
                self._paused_saver_tags[tag].remove(saver_tag)
        with self._lock:
            self._paused.pop(tag, None)
            self._paused_saver_tags.pop(tag, None)


class TmsProvider:
    """torch_memory_saver, in ``torch`` hook mode, behind hibernate's provider contract.

    ``saver`` is the ``torch_memory_saver`` module; ``segments`` lists a
    MemPool's segments (torch's allocator snapshot), ``copies`` moves bytes to
    and from the device, ``free_bytes`` reads a GPU's free memory and
    ``device`` the current device: the seams a test replaces.
    """

    name = TORCH_MEMORY_SAVER

    def __init__(
        self,
        saver: Any = None,
        segments: Segments = _cuda_segments,
        copies: Callable[[], DeviceCopies] = CudaCopies.from_process,
        free_bytes: Callable[[int], int | None] = free_device_bytes,
        device: Callable[[], int] = _cuda_device,
    ) -> None:
        module = saver if saver is not None else _import_saver()
        self._saver = module.torch_memory_saver
        self._segments = segments
        self._copies_source = copies
        self._copies: DeviceCopies | None = None
        self.free_bytes = free_bytes
        self._device = device
        self._lock = threading.Lock()
        self._pool = TmsPool(self)
        self._captures: dict[str, list[str]] = {}  # tag -> the torch_memory_saver tags of its captures
        self._capture_numbers = itertools.count(1)
        self._use_torch_hooks()

    def _use_torch_hooks(self) -> None:
        """torch hook mode, set before torch_memory_saver starts; refused if it started in another."""
        impl = getattr(self._saver, "_impl", None)
        if impl is None:
            self._saver.hook_mode = HOOK_MODE
            return
        mode = getattr(impl, "_hook_mode", None)
        if mode != HOOK_MODE:
            raise UsageError(
                f"torch_memory_saver was started in {mode!r} hook mode before hibernate.pool(); hibernate "
                f"uses its {HOOK_MODE!r} mode (no LD_PRELOAD)",
                hint="call hibernate.pool() before anything else starts torch_memory_saver; unset LD_PRELOAD",
            )

    def _mem_pools(self) -> Mapping[Any, Any]:
        impl = getattr(self._saver, "_impl", None)
        pools = getattr(impl, "_mem_pools", None)
        if impl is not None and not isinstance(pools, Mapping):
            raise UnsupportedError(
                "this torch_memory_saver keeps its memory pools where hibernate does not know to find them "
                f"(it knows {KNOWN_VERSION})",
                hint=f"pip install torch-memory-saver=={KNOWN_VERSION}",
            )
        return pools if isinstance(pools, Mapping) else {}

    def copies(self) -> DeviceCopies:
        with self._lock:
            if self._copies is None:
                self._copies = self._copies_source()
            return self._copies

    # -- the provider contract ---------------------------------------------------

    @contextmanager
    def region(self, tag: str) -> Iterator[None]:
        if self._pool.asleep(tag):
            raise WrongStateError(f"hibernate.pool({tag!r}) is asleep: nothing can be allocated in it now")
        with self._saver_region(TAG_PREFIX + tag):
            yield

    @contextmanager
    def _saver_region(self, saver_tag: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(self._saver.region(saver_tag))
            except RuntimeError as exc:  # its start-up checks (expandable_segments, the CUDA runtime)
                raise UnsupportedError(
                    f"torch_memory_saver could not open a region for {saver_tag.removeprefix(TAG_PREFIX)!r}: "
                    f"{exc}"
                ) from exc
            yield

    @contextmanager
    def graph_pool(self, tag: str) -> Iterator[PoolId]:
        """A MemPool of its own for one capture, hibernated with ``tag``, with torch_memory_saver's
        allocator set up on this thread.

        Its own pool: see the module docstring. Not entered as a region: that
        makes the thread allocate to the pool (``use_mem_pool``), and torch
        refuses a capture into a pool already being allocated to ("already
        recording to mempool_id"). The capture routes its own allocations to
        the pool; what torch_memory_saver's allocator needs besides is its
        thread-local tag and region flag, which it keeps per thread: the
        capture must allocate on this thread (a backward pass captured by
        make_graphed_callables allocates on autograd's threads, where the
        allocator ends the process).
        """
        if self._pool.asleep(tag):
            raise WrongStateError(f"hibernate.pool({tag!r}) is asleep: nothing can be allocated in it now")
        saver_tag = f"{TAG_PREFIX}{tag}{CAPTURE_SUFFIX}{next(self._capture_numbers)}"
        with self._saver_region(saver_tag):
            pass  # torch_memory_saver makes the tag's pool on this device on first use
        device = self._device()
        ids = [
            pool.id
            for key, pool in list(self._mem_pools().items())
            if isinstance(key, tuple) and key[0] == saver_tag and key[-1] == device
            and not any(key[1:3])  # neither of its own backups
        ]  # fmt: skip
        if not ids:
            raise HibernateError(f"torch_memory_saver made no memory pool for {tag!r} on cuda:{device}")
        pool_id = (int(ids[0][0]), int(ids[0][1]))
        configure = getattr(self._saver._impl, "_with_region_config", None)
        if configure is None:
            raise UnsupportedError(
                "this torch_memory_saver cannot set its allocator up for a graph capture the way hibernate "
                f"knows (it knows {KNOWN_VERSION})",
                hint=f"pip install torch-memory-saver=={KNOWN_VERSION}",
            )
        with self._lock:
            self._captures.setdefault(tag, []).append(saver_tag)
        with configure(tag=saver_tag, enable_cpu_backup=False, cpu_backup_backend=None):
            yield pool_id

    def saver_tags(self, tag: str) -> list[str]:
        """torch_memory_saver's tags that hold ``tag``'s memory: its own, then each capture's."""
        with self._lock:
            return [TAG_PREFIX + tag, *self._captures.get(tag, ())]

    def declare(self, tag: str, keep: bool) -> None:
        self._pool.declare(tag, keep)

    def pool(self) -> TmsPool:
        return self._pool

    def spans(self, tag: str | None = None) -> list[Span]:
        """The allocations of ``tag`` as torch's allocator lists them; every declared tag's without one."""
        if tag is None:
            return self._pool.spans()
        found: list[Span] = []
        for saver_tag in self.saver_tags(tag):
            for pool_id in pools_of_tag(self._mem_pools(), saver_tag):
                found.extend(spans_of(tag, self._segments(pool_id)))
        return sorted(found, key=lambda span: (span.device, span.address))

    def pause(self, saver_tag: str) -> None:
        """Unmap every allocation of torch_memory_saver's ``saver_tag`` (one of ``saver_tags``)."""
        self._saver.pause(saver_tag)

    def resume(self, saver_tag: str) -> None:
        self._saver.resume(saver_tag)
