"""vLLM's CuMemAllocator allocations as a hibernate pool.

vLLM allocates its weights, KV cache and scratch through ``CuMemAllocator``
pools; every allocation is an ``AllocationData(handle, tag, cpu_backup_tensor,
is_asleep)`` in ``allocator.pointer_to_data``, keyed by its device address.
This pool offers each *mapped* allocation to the agent as one region, whose
``keep`` follows the sleep level, and releases and maps it back with vLLM's own
extension so its virtual address never changes.

The pool keeps vLLM's bookkeeping exactly as vLLM's own sleep would leave it
(``is_asleep`` set on release and cleared on map, no ``cpu_backup_tensor``,
since the contents are on disk instead), so vLLM's discard, wake and free paths
stay valid. Allocations that are already asleep when a sleep starts (discarded
by vLLM, say) are not part of that sleep: nothing of them is left to spill, and
:meth:`CuMemPool.wake_loose` maps them back under the same tag rules.

vLLM may free an allocation while it is asleep. vLLM 0.33's free callback
then hands the asleep allocation's handle to its C extension, whose unmap
fails and leaves the extension's module-global error code set: the next
``create_and_map`` creates physical memory, returns before mapping it (that
memory is leaked) and raises the stale, unrelated error, which clears it.
The pool notices such vanished records when one of its maps or unmaps fails,
and then meets that failure as the stale error: a map is retried once; an
unmap (which the extension did before it raised) is taken as done. Both are
said in the warnings of the sleep or wake that met them. A record found
vanished at the end of a call is only reported: its error may be met by
vLLM's own next call, and a genuine failure must not be retried.

Nothing here imports vLLM or torch: the records are read through their fields,
and the rules are small pure functions the integration feeds vLLM's own
constants into.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from hibernate.errors import UnsupportedError, UsageError, WrongStateError
from hibernate.pools.base import Contents, SpillableRegion
from hibernate.pools.device import DeviceCopies, DeviceMemory, DeviceRegion, Handle, PinFn
from hibernate.pools.provided import VLLM_CUMEM, Span, declare_once
from hibernate.store.regions import memory_at

log = logging.getLogger(__name__)

CUMEM_MODULE = "vllm.device_allocator.cumem"

# vLLM's tags. Only these are dropped; see keeps().
DROPPED_AT_LEVEL: Mapping[int, frozenset[str]] = {
    1: frozenset({"kv_cache", "workspace"}),
    2: frozenset({"kv_cache", "workspace", "weights"}),
}
SLEEP_LEVELS = tuple(sorted(DROPPED_AT_LEVEL))


# -- the tag rules -----------------------------------------------------------------


def check_level(level: int) -> int:
    if isinstance(level, bool) or level not in DROPPED_AT_LEVEL:
        raise UsageError(f"sleep level must be one of {', '.join(map(str, SLEEP_LEVELS))}, not {level!r}")
    return level


def keeps(tag: str, level: int) -> bool:
    """Whether an allocation with ``tag`` survives a sleep at ``level`` (written to disk).

    Level 1 drops what vLLM rebuilds or never reads back (``kv_cache``,
    ``workspace``); level 2 also drops ``weights``, which vLLM reloads itself.
    Every other tag is kept, including tags a later vLLM may add: dropping
    contents that mattered would be silent corruption, keeping them only costs
    disk.
    """
    return tag not in DROPPED_AT_LEVEL[check_level(level)]


def wakes(tag: str, requested: Collection[str] | None, deferrable: Collection[str]) -> bool:
    """Whether a wake asked for ``requested`` tags (None: all) maps an allocation with ``tag``.

    vLLM's rule: only ``deferrable`` tags (weights, kv_cache) may wait for a
    later wake; every other tag comes back with the first one, whatever was asked.
    """
    return requested is None or tag in requested or tag not in deferrable


# -- what the pool reads: vLLM's records, by their fields --------------------------


class AllocationLike(Protocol):
    """The fields of ``vllm.device_allocator.AllocationData`` the pool reads and keeps coherent."""

    handle: Handle
    tag: str
    cpu_backup_tensor: Any
    is_asleep: bool


class AllocatorLike(Protocol):
    """What the pool needs of ``CuMemAllocator``: its records, keyed by device address."""

    @property
    def pointer_to_data(self) -> Mapping[int, Any]: ...


def live_allocator() -> AllocatorLike | None:
    """This process's CuMemAllocator if vLLM created it; never imports vLLM.

    In a vLLM worker with sleep mode the module is loaded and the singleton
    made before the model loads; in the API server or engine core it is not,
    and the pool there is simply empty.
    """
    module = sys.modules.get(CUMEM_MODULE)
    allocator_class = getattr(module, "CuMemAllocator", None)
    instance: AllocatorLike | None = getattr(allocator_class, "instance", None)
    return instance


def default_device() -> DeviceMemory:
    from hibernate.pools.device import CudaDeviceMemory

    return CudaDeviceMemory.from_vllm()


def _records(allocator: AllocatorLike | None) -> list[tuple[int, AllocationLike]]:
    """A snapshot of the allocator's records (copying a dict is atomic under the GIL)."""
    if allocator is None:
        return []
    return list(dict(allocator.pointer_to_data).items())


def _backup_view(tensor: Any, nbytes: int) -> memoryview:
    """The bytes of a host tensor vLLM's own sleep left as a backup."""
    return memory_at(tensor.data_ptr(), nbytes)


# -- regions -----------------------------------------------------------------------


class CuMemRegion(DeviceRegion):
    """One CuMemAllocator allocation: its whole aligned size, at its fixed address."""

    def __init__(self, pool: CuMemPool, allocator: AllocatorLike, data: AllocationLike, keep: bool) -> None:
        device, nbytes, address, _ = data.handle
        key = f"{data.tag}/{int(address):#x}"
        super().__init__(key, data.tag, keep, int(nbytes), int(device), int(address))
        self._pool = pool
        self._allocator = allocator
        self._data = data

    def live(self) -> bool:
        """Still the allocator's record for this address (vLLM may free it while asleep)."""
        return self._allocator.pointer_to_data.get(self._address) is self._data

    def _copies(self) -> DeviceCopies:
        return self._pool.device

    def _writable(self) -> bool:
        return self.live()

    def release(self) -> None:
        """vLLM's ``unmap_and_release``; bookkeeping as vLLM's own sleep leaves it."""
        if self.live() and not self._data.is_asleep:
            self._pool.unmap_out(self._address, self._data)
        self._data.cpu_backup_tensor = None

    @property
    def released(self) -> bool:
        return self.live() and self._data.is_asleep

    def reallocate(self) -> None:
        """vLLM's ``create_and_map`` at the same address (contents undefined until filled)."""
        if self.live() and self._data.is_asleep:
            self._pool.map_back(self._address, self._data)

    def zero(self) -> None:
        if self.live():
            self._pool.device.zero(self._device, self._address, self._nbytes)


# -- the pool ----------------------------------------------------------------------


class CuMemPool:
    """Every allocation of this process's CuMemAllocator; ``level`` decides what is kept.

    ``keep`` replaces the level's rule where the tags are a program's own (its
    ``hibernate.pool(tag, keep)``), not vLLM's.
    """

    name = "vllm-cumem"

    def __init__(
        self,
        allocator: Callable[[], AllocatorLike | None] = live_allocator,
        device: Callable[[], DeviceMemory] = default_device,
        keep: Callable[[str], bool] | None = None,
    ) -> None:
        self._allocator_source = allocator
        self._device_source = device
        self._keep = keep
        self._device: DeviceMemory | None = None
        self._lock = threading.Lock()
        self.level = 1
        # Every record seen asleep, by address, until it is mapped again: one that is gone from the
        # allocator by then was freed while asleep (see the module docstring).
        self._asleep: dict[int, AllocationLike] = {}
        self._met: list[str] = []  # what the pool's own maps and unmaps met, for the next report
        # Said in the report of the sleep about to run, by whoever knows more than the records
        # (the backend, of communicators this worker shares with others).
        self.sleep_notes: list[str] = []

    @property
    def allocator(self) -> AllocatorLike | None:
        return self._allocator_source()

    @property
    def device(self) -> DeviceMemory:
        """Created on first use: the API server's pool (always empty) never needs one."""
        with self._lock:
            if self._device is None:
                self._device = self._device_source()
            return self._device

    def set_level(self, level: int) -> None:
        self.level = check_level(level)

    def keeps(self, tag: str) -> bool:
        return self._keep(tag) if self._keep is not None else keeps(tag, self.level)

    # -- the Pool contract -----------------------------------------------------

    def contents(self) -> Contents:
        return Contents.of(self.name, self.regions())  # a few regions: nothing to spare

    def regions(self) -> Sequence[SpillableRegion]:
        allocator = self.allocator
        if allocator is None:
            return []
        records = _records(allocator)
        for address, data in records:
            if data.is_asleep:
                self.note_asleep(address, data)
        return [
            CuMemRegion(self, allocator, data, self.keeps(data.tag))
            for _, data in records
            if not data.is_asleep
        ]

    def after_release(self) -> None:
        if _records(self.allocator):
            self.device.empty_cache()

    def pinner(self) -> PinFn | None:
        if not _records(self.allocator):
            return None
        return self.device.pinner()

    def warnings(self) -> list[str]:
        """Only the sleep's notes: every mapped allocation a sleep takes is unmapped, its memory freed."""
        return list(self.sleep_notes)

    def moves_refusal(self) -> str | None:
        """Nothing: every allocation is mapped back at its own address."""
        return None

    # -- records freed while asleep ------------------------------------------------

    def note_asleep(self, address: int, data: AllocationLike) -> None:
        with self._lock:
            self._asleep[address] = data

    def _notice_vanished(self) -> bool:
        """Records seen asleep that the allocator no longer holds (each one's free left an error
        behind), said in the next warnings; whether there were any not noticed before."""
        allocator = self.allocator
        current = dict(allocator.pointer_to_data) if allocator is not None else {}
        with self._lock:
            gone = [(a, d) for a, d in self._asleep.items() if current.get(a) is not d]
            for address, data in gone:
                del self._asleep[address]
                self._met.append(
                    f"vLLM freed its {data.tag} allocation at {address:#x} ({int(data.handle[1])} bytes) "
                    "while it was asleep: vLLM's cumem extension fails to unmap such an allocation and "
                    "keeps that failure for its next call"
                )
        return bool(gone)

    def map_back(self, address: int, data: AllocationLike) -> None:
        """vLLM's ``create_and_map`` for an asleep record, once more if it failed with a free's error.

        After a record vanished while asleep, the extension's first call fails with
        that free's error whatever it is asked (and clears it): a map that fails
        when a vanished record is found is retried once. Vanished records are
        looked for when a call fails, not before every map: a wake maps every
        record, and the lookup walks them all.
        """
        try:
            self.device.map(data.handle)
        except Exception as exc:
            if not self._notice_vanished():
                raise
            self.device.map(data.handle)
            self._met.append(
                f"mapping {data.tag} at {address:#x} failed with the error left by that free ({exc}); "
                f"mapped on a second try, and the {int(data.handle[1])} bytes vLLM's extension created "
                "on the first try stay allocated until the process ends"
            )
        data.is_asleep = False
        with self._lock:
            self._asleep.pop(address, None)

    def unmap_out(self, address: int, data: AllocationLike) -> None:
        """vLLM's ``unmap_and_release`` for a mapped record, meeting a stale error as done.

        With that error set, the extension unmaps the range, then returns before
        releasing its physical memory and raises the stale error: the record is
        asleep as far as the GPU goes, so it is marked so (a retry would fail on
        the unmapped range and leave a new error behind).
        """
        try:
            self.device.unmap(data.handle)
        except Exception as exc:
            if not self._notice_vanished():
                raise
            self._met.append(
                f"releasing {data.tag} at {address:#x} met the error left by that free ({exc}): vLLM's "
                f"extension unmapped it and keeps its {int(data.handle[1])} bytes allocated until the "
                "process ends"
            )
        data.is_asleep = True
        self.note_asleep(address, data)

    def take_warnings(self) -> list[str]:
        """What the pool's maps and unmaps met since the last call, in words for a report; cleared.

        Records vanished since are said too, but no failure of a later call is
        retried for them (see the module docstring).
        """
        self._notice_vanished()
        with self._lock:
            warnings, self._met = self._met, []
        return warnings

    # -- what vLLM's backend calls besides a sleep -------------------------------

    def synchronize(self) -> None:
        """Wait for every device that holds an allocation (before reading or unmapping it)."""
        for device in sorted({int(data.handle[0]) for _, data in _records(self.allocator)}):
            self.device.synchronize(device)

    def asleep_tags(self) -> set[str]:
        return {data.tag for _, data in _records(self.allocator) if data.is_asleep}

    def discard(self, tags: Iterable[str]) -> dict[str, Any]:
        """Release the mapped allocations with ``tags``, contents lost (vLLM's ``discard``).

        Allocations already asleep keep what their sleep decided (as in vLLM):
        one whose contents wait on disk or in a backup is not made to lose them.
        """
        wanted = set(tags)
        records = [(ptr, data) for ptr, data in _records(self.allocator) if data.tag in wanted]
        for device in sorted({int(data.handle[0]) for _, data in records if not data.is_asleep}):
            self.device.synchronize(device)
        discarded = skipped = 0
        for address, data in records:
            if data.is_asleep:
                skipped += 1
                continue
            self.unmap_out(address, data)
            data.cpu_backup_tensor = None
            discarded += int(data.handle[1])
        if skipped:
            log.info(
                "hibernate: %d allocation(s) with tags %s were already asleep; left as they are",
                skipped,
                sorted(wanted),
            )
        if discarded:
            self.device.empty_cache()
        return {"discarded_bytes": discarded, "already_asleep": skipped}

    def wake_loose(self, wanted: Callable[[str], bool]) -> dict[str, Any]:
        """Map back asleep allocations that no hibernate sleep holds, if ``wanted`` by tag.

        They were discarded (or put to sleep by vLLM's own allocator): their
        contents come from a backup vLLM left, if any, else they are zero-filled.
        Fills are only queued (DeviceCopies.zero): the devices are synchronized
        before vLLM runs again, a failure's way out included.
        """
        mapped = from_backup = 0
        filled: set[int] = set()
        try:
            for _, data in _records(self.allocator):
                if not data.is_asleep or not wanted(data.tag):
                    continue
                device, nbytes, address, _ = data.handle
                self.map_back(int(address), data)
                backup = data.cpu_backup_tensor
                if backup is not None:
                    size = min(int(nbytes), int(backup.numel() * backup.element_size()))
                    self.device.copy_from_host(int(device), int(address), _backup_view(backup, size))
                    data.cpu_backup_tensor = None
                    from_backup += size
                else:
                    filled.add(int(device))
                    self.device.zero(int(device), int(address), int(nbytes))
                mapped += int(nbytes)
        except BaseException:
            for device in sorted(filled):
                with contextlib.suppress(Exception):  # the failure that stopped the wake is the one to say
                    self.device.synchronize(device)
            raise
        for device in sorted(filled):
            self.device.synchronize(device)
        return {"mapped_bytes": mapped, "from_backup_bytes": from_backup}


class CuMemProvider:
    """vLLM's CuMemAllocator as the provider of ``hibernate.pool()`` in a program that is not vLLM.

    ``use_memory_pool(tag)`` routes the allocations of its block to a MemPool
    of vLLM's pluggable allocator, recorded under ``tag``; ``cudagraph_pool()``
    gives a pool of it to capture a graph into. The allocator is vLLM's
    singleton: in a vLLM worker it is vLLM's own, and vLLM's sleep mode
    (hibernate's backend there) hibernates it instead.
    """

    name = VLLM_CUMEM

    def __init__(
        self,
        allocator: Callable[[], Any] | None = None,
        device: Callable[[], DeviceMemory] = default_device,
    ) -> None:
        self._instance = allocator or _allocator_instance
        self._declared: dict[str, bool] = {}
        self._pool = CuMemPool(allocator=self._instance, device=device, keep=self._keeps)

    def _keeps(self, tag: str) -> bool:
        return self._declared.get(tag, True)  # a tag nobody declared is kept: dropping it could lose data

    def region(self, tag: str) -> AbstractContextManager[None]:
        if tag in self._pool.asleep_tags():
            raise WrongStateError(f"hibernate.pool({tag!r}) is asleep: nothing can be allocated in it now")
        context: AbstractContextManager[None] = self._instance().use_memory_pool(tag)
        return context

    @contextmanager
    def graph_pool(self, tag: str) -> Iterator[tuple[int, int]]:
        """vLLM's graph pool, its allocations recorded under ``tag`` (vLLM itself uses "cudagraph").

        vLLM's allocator keeps its current tag for the whole process: pools of
        two tags opened on two threads at once would mix their allocations.
        """
        if tag in self._pool.asleep_tags():
            raise WrongStateError(f"hibernate.pool({tag!r}) is asleep: nothing can be allocated in it now")
        allocator = self._instance()
        with allocator.cudagraph_pool() as pool_id:
            allocator.current_tag = tag
            yield int(pool_id[0]), int(pool_id[1])

    def declare(self, tag: str, keep: bool) -> None:
        declare_once(self._declared, tag, keep)

    def pool(self) -> CuMemPool:
        return self._pool

    def spans(self) -> list[Span]:
        return [
            Span(data.tag, int(data.handle[0]), int(data.handle[2]), int(data.handle[1]))
            for _, data in _records(self._pool.allocator)
            if data.tag in self._declared
        ]


def _allocator_instance() -> Any:
    """vLLM's CuMemAllocator singleton, made on first use (imports vLLM's cumem module)."""
    try:
        cumem = importlib.import_module(CUMEM_MODULE)
    except ImportError as exc:
        raise UnsupportedError(
            f"vLLM's cumem allocator cannot be loaded here ({exc})",
            hint="it needs a CUDA build of vLLM and a GPU driver",
        ) from exc
    if not getattr(cumem, "cumem_available", False):  # get_instance() would only assert it
        raise UnsupportedError(
            "vLLM's cumem allocator extension is not available in this vLLM build",
            hint="it needs a CUDA build of vLLM and a GPU driver",
        )
    return cumem.CuMemAllocator.get_instance()


def require_allocator(pool: CuMemPool) -> AllocatorLike:
    """The allocator a suspend acts on, or a clear error saying how to get one.

    A sleep with no allocator would "succeed" and free nothing: vLLM allocates
    through CuMemAllocator only when sleep mode is on.
    """
    allocator = pool.allocator
    if allocator is None:
        raise UnsupportedError(
            "vLLM's CuMemAllocator is not in use in this process, so there is nothing to put to sleep",
            hint="start vLLM with --enable-sleep-mode --sleep-mode-backend hibernate",
        )
    return allocator
