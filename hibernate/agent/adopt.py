"""A new process takes up the snapshot of one that is gone: its tracked tensors filled, by name, from it.

A wake brings memory back into the process that wrote the snapshot. A job
that was killed, requeued or moved starts a new process instead, from the same
code: it builds its model and optimizer as before, tracks them, and adopts
the snapshot, which fills every tracked storage from the record of the same
name, each chunk verified as a wake verifies it. What cannot survive a process
is not attempted: the CUDA context, compiled kernels, graphs and
communicators are the new program's own.

The sequence runs on the agent's own terms: a session of its own (no sleep or
wake can start meanwhile), the guard closed (no holder touches the tensors
while they are written), and the snapshot root's shared lock held by the
reader (``gc`` cannot remove it meanwhile).

All or nothing: nothing of the program's is written until the whole snapshot
has been read and verified. The reader fills stand-ins for the program's
tensors (it reads straight into host memory and verifies after, so a flipped
byte would otherwise land before it is found): a twin on the device for a
device tensor, host memory for the others. Once every chunk has passed, each
stand-in is copied into its tensor. State an optimizer had not made yet is
new, held by nothing else, and filled in place; a refusal takes it back. The
price is memory for the adopted tensors the program already had (its
weights, not the optimizer state made here) for the length of the adoption,
on their device, and one more copy of them there.

A record taken on another device fills its storage here all the same (a
requeued job whose GPU has another index, a GPU job's state taken up on the
CPU): the stand-ins are made for the storage's device in this process, and
show the reader the record's description, since the bytes are the same.
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hibernate.agent.controller import Agent, Session, write_options
from hibernate.errors import SnapshotInvalidError, StorageError, UnsupportedError, WrongStateError
from hibernate.pools.base import Pool, RegionAttributes, SpillableRegion
from hibernate.pools.device import buffer_address
from hibernate.pools.optimizers import GivenState
from hibernate.pools.tensors import StorageRegion, TensorPool
from hibernate.procinfo import memory_headroom_bytes
from hibernate.store.adoption import GRADIENT_SUFFIX, NOTHING_THERE, AdoptionSource, locate, pair_by_name
from hibernate.store.directio import unmap_now
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import Columns, Record
from hibernate.store.pipeline import PinFn, deferral
from hibernate.store.reader import Discard, SnapshotReader, Unread
from hibernate.store.regions import Region
from hibernate.units import human_bytes


def adopt_here(
    agent: Agent,
    path: Path,
    *,
    select: Callable[[SpillableRegion], bool] | None = None,
    timeout: float = 30.0,
    args: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Fill this process's tracked regions (those ``select`` picks, default all) from the snapshot
    ``path`` names (see store.adoption.locate); the report says which snapshot and what was read.

    Adopting every region (``select`` None) also wants every record of the snapshot, all read and
    verified before any is written. A selection (one object just tracked, under HIBERNATE_ADOPT)
    reads only the records it names: the others are read, each verified whole, by the calls that
    track their objects; reading the whole snapshot at each call read a model's optimizer state
    once for the model and again for the optimizer.
    """
    started = time.perf_counter()
    session = Session(f"this process (pid {agent.identity.pid}) adopting {path}", in_process=True)
    agent.begin(session)
    try:
        if agent.state.value != "running":
            raise WrongStateError(
                f"the process is {agent.state.value}: a snapshot is adopted by a running process",
                hint="adopt right after tracking the model and optimizer, before the first sleep",
            )
        agent.quiesce(session, timeout)  # no guard() holder uses the tensors while they are filled
        try:
            report = _fill(agent.pools(), locate(path), select, args or {})
        finally:
            agent.resume(session)
    finally:
        agent.end(session)
    report["seconds"] = time.perf_counter() - started
    return report


ADOPT_ENV = "HIBERNATE_ADOPT"  # a path: each object tracked from then on is adopted from it


def adopt_on_track(agent: Agent, pool: TensorPool, obj: Any, path: str) -> dict[str, Any] | None:
    """What ``track`` does under HIBERNATE_ADOPT: the object just tracked adopted from ``path``.

    For job scripts, which cannot change the program: each ``track`` adopts what it tracks (a
    model, then its optimizer, whose state the snapshot gives it). Where ``path`` holds no
    complete snapshot yet (a job preempted before its first sleep ended), the program starts
    afresh, said in one line; any other refusal (a mismatch, a snapshot whose process still
    runs, a damaged one) raises, since starting afresh would throw the job's progress away.
    Returns the report, None where nothing was adopted.
    """
    holding: set[int] | None = None

    def tracked_here(region: SpillableRegion) -> bool:
        nonlocal holding
        if holding is None:  # asked after the optimizer's state was made (see _fill)
            holding = pool.tensors_of(obj)
        return isinstance(region, StorageRegion) and region.holds_any(holding)

    try:
        report = adopt_here(agent, Path(path), select=tracked_here)
    except SnapshotInvalidError as exc:
        if not exc.message.startswith(NOTHING_THERE):
            raise
        print(f"hibernate: {ADOPT_ENV}={path}: {exc.message}; starting afresh", file=sys.stderr, flush=True)
        return None
    _still_to_adopt.note(report["snapshot"], report["unclaimed"])
    moved = "".join(f", {count} moved {way}" for way, count in report["moved"].items())
    print(
        f"hibernate: adopted {report['adopted_regions']} tensor storage(s), {report['adopted_bytes']} bytes "
        f"({report['read_bytes']} read{moved}), from {report['snapshot']} ({report['picked']})",
        file=sys.stderr,
        flush=True,
    )
    return report


class _StillToAdopt:
    """What the snapshot HIBERNATE_ADOPT took holds that no ``track`` of this process has filled yet.

    Each ``track`` adopts what it tracks, so between two of them the process holds part of what
    it will adopt: a model, not yet its optimizer. A sleep then (SIGTERM on a requeued job) would
    publish a snapshot without the rest, newer than the complete one, and the next run would take
    it up and go on with a fresh optimizer, silently. So a sleep on a signal is refused while
    this is not empty (see signals.install), and the snapshot adopted from stays the newest.
    Gradients are not waited for: the next backward pass makes them. Process-wide, as the
    variable is.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snapshot = ""
        self._keys: set[str] | None = None

    def note(self, snapshot: str, unclaimed: Sequence[str]) -> None:
        """One ``track``'s adoption from ``snapshot``: of its records, ``unclaimed`` were not filled."""
        left = {key for key in unclaimed if not key.endswith(GRADIENT_SUFFIX)}
        with self._lock:
            if self._keys is None or snapshot != self._snapshot:
                self._snapshot, self._keys = snapshot, left
            else:
                self._keys &= left

    def refusal(self) -> str | None:
        """Why a sleep now would lose part of the adopted state; None when nothing is left to adopt."""
        with self._lock:
            if not self._keys:
                return None
            shown = sorted(self._keys)[:5]
            more = f" and {len(self._keys) - len(shown)} more" if len(self._keys) > len(shown) else ""
            return (
                f"this process has not yet tracked all it adopts from {self._snapshot} "
                f"({', '.join(shown)}{more}): a snapshot now would lack them, so none is written "
                "(the one adopted from stays the newest)"
            )


_still_to_adopt = _StillToAdopt()


def unfinished_adoption() -> str | None:
    """Why a sleep now would publish less than this process adopted (see _StillToAdopt); None if none."""
    return _still_to_adopt.refusal()


def _fill(
    pools: Sequence[Pool],
    source: AdoptionSource,
    select: Callable[[SpillableRegion], bool] | None,
    args: dict[str, Any],
) -> dict[str, Any]:
    options = write_options(args)
    with (
        SpillRoot(source.root, owner=source.owner) as root,
        SnapshotReader(root, source.snapshot, io_mode=options.io_mode) as reader,
    ):
        columns = reader.manifest.columns
        given: list[GivenState] = []
        try:
            for pool in pools:
                if isinstance(pool, TensorPool):  # state an optimizer has not made yet, as the snapshot holds
                    given.append(pool.prepare_adoption(columns))
            regions = [r for pool in pools for r in pool.regions() if select is None or select(r)]
            kept = [r for r in regions if r.keep]
            pairing = pair_by_name(columns, kept, every_record=select is None)
            pin = next((p for p in (pool.pinner() for pool in pools) if p is not None), None)
            made = {id(tensor) for state in given for tensor in state.tensors}
            unasked = Discard if select is None else Unread
            with Shadows([r for r in kept if not _made_here(r, made)]) as shadows:
                targets = [
                    shadows.standing_for(kept[i]) if i >= 0 else unasked(_record(columns, n))
                    for n, i in enumerate(pairing.order)
                ]
                for n in pairing.moved:  # on another device here: the reader compares the record's
                    targets[n] = _AsRecorded(targets[n], columns.metas[n])
                try:
                    result = reader.read_into(
                        targets,
                        buffer_bytes=options.buffer_bytes,
                        threads=options.stage_threads,
                        io_depth=options.io_threads,
                        pin=pin,
                    ).to_wire()
                except (SnapshotInvalidError, StorageError) as exc:  # a damaged or unreadable chunk
                    raise type(exc)(
                        f"{exc.message}; nothing was adopted (the tracked tensors are as they were)",
                        hint=exc.hint,
                    ) from exc
                shadows.commit(pools, pin)  # every chunk verified: now the program's own tensors
        except BaseException:
            for state in given:
                state.take_back()
            raise
        zeroed = [r for r in regions if not r.keep]
        for region in zeroed:
            region.zero()  # as after a wake: a tag not kept comes back zero-filled
        for pool in pools:
            pool.synchronize()  # the copies are on the device before the program runs again
    warnings = []
    if source.liveness == "unknown":
        warnings.append(
            f"its owner, {source.owner.describe()}, cannot be seen from here ({source.why}): adopted "
            "because this path was named; make sure that process has ended"
        )
    if pairing.unclaimed and select is None:
        warnings.append(
            f"{len(pairing.unclaimed)} record(s) of the snapshot were read and verified but not adopted "
            "(gradients, which the next backward pass makes)"
        )
    return {
        "snapshot": str(source.root / source.snapshot),
        "picked": source.picked,
        "owner": source.owner.describe(),
        "owner_state": f"{source.liveness}: {source.why}",
        "adopted_regions": len(kept),
        "adopted_bytes": sum(r.nbytes for r in kept),
        "zeroed_bytes": sum(r.nbytes for r in zeroed),
        "read_bytes": result["total_bytes"],
        "io_seconds": result["seconds"],
        "io_mode": result["io_mode"],
        "tuning": result["tuning"],
        "unclaimed": pairing.unclaimed,
        "moved": pairing.moves(),
        "warnings": warnings,
    }


def _record(columns: Columns, index: int) -> Record:
    """Record ``index`` as a Discard or Unread needs it (no chunks: the reader walks them itself)."""
    return Record(columns.keys[index], columns.tags[index], columns.sizes[index], columns.metas[index], ())


def _made_here(region: SpillableRegion, made: set[int]) -> bool:
    """Whether the region is state this adoption made (nothing else holds it: filled in place)."""
    return isinstance(region, StorageRegion) and region.holds_any(made)


_CHECK_ROOM_FROM_BYTES = 64 << 20  # below this, the adoption fits wherever the program did
_SMALL_ALIGNMENT = 64  # a small shadow's start: a cache line, so that 100,000 small tensors share pages
_PAGE = mmap.PAGESIZE


class Shadows:
    """Memory standing in for regions while an adoption reads and verifies the snapshot.

    A tensor's storage on a device gets a twin on that device (StorageRegion.device_twin): the
    reader's device copies land there as they would in the storage. Every other region gets host
    memory: one anonymous mapping for all of them (a mapping each would cost a system call per
    tensor), freed on leaving the block whatever happened. A host shadow of a page or more
    starts at the same offset within its page as its region's host memory, so the reader treats
    it as it would the region: its direct reads land where they would have landed.
    """

    def __init__(
        self, regions: Sequence[SpillableRegion], headroom: Callable[[], int | None] = memory_headroom_bytes
    ) -> None:
        self._twins: dict[int, tuple[StorageRegion, StorageRegion]] = {}
        self._hosted: list[SpillableRegion] = []
        for region in regions:
            twin = _twin(region)
            if twin is not None and isinstance(region, StorageRegion):
                self._twins[id(region)] = (region, twin)
            else:
                self._hosted.append(region)
        offsets: list[int] = []
        end = 0
        for region in self._hosted:
            end = _placed(end, region)
            offsets.append(end)
            end += region.nbytes
        room = headroom() if end >= _CHECK_ROOM_FROM_BYTES else None
        if room is not None and end > room:
            self._twins.clear()
            raise UnsupportedError(
                f"adopting needs {human_bytes(end)} of host memory beside the tensors this process already "
                f"has, to verify the whole snapshot before any of it is written, and this process may take "
                f"{human_bytes(room)} more (the machine's available memory, or its cgroup's limit); "
                "nothing was adopted",
                hint="adopt before building what else takes memory, or run with more memory (a job's --mem)",
            )
        self._map = mmap.mmap(-1, max(end, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self._view = memoryview(self._map)
        self._base = buffer_address(self._view)
        self._shadows = {
            id(region): _Shadow(region, self._view[offset : offset + region.nbytes], self._base + offset)
            for region, offset in zip(self._hosted, offsets, strict=True)
        }

    def __enter__(self) -> Shadows:
        return self

    def __exit__(self, *exc: object) -> None:
        self._twins.clear()  # the device memory goes back to torch's allocator
        self._shadows.clear()
        unmap_now(self._map, self._view)  # even where a failure's traceback still holds a slice

    def standing_for(self, region: SpillableRegion) -> Region:
        """What the reader fills for ``region``: its twin or shadow, or the region itself if it has none."""
        twin = self._twins.get(id(region))
        if twin is not None:
            return twin[1]
        shadow = self._shadows.get(id(region))
        return region if shadow is None else shadow

    def commit(self, pools: Sequence[Pool], pin: PinFn | None) -> None:
        """Every chunk verified: each stand-in's bytes into its region. The twins' copies are waited
        for first (they ran on the pools' streams); the host shadows' device copies are queued
        together and waited for once."""
        if self._twins:
            for pool in pools:
                pool.synchronize()
            for twinned, twin in self._twins.values():
                twinned.take_bytes_of(twin)
        with deferral(pin)() as queued:
            for hosted in self._hosted:
                hosted.copy_in(0, self._shadows[id(hosted)].view)
        if queued.fence is not None:
            queued.fence.wait()


def _twin(region: SpillableRegion) -> StorageRegion | None:
    """The region's twin on its device (StorageRegion.device_twin); refused where the device lacks room."""
    if not isinstance(region, StorageRegion):
        return None
    try:
        return region.device_twin()
    except torch.OutOfMemoryError as exc:
        raise UnsupportedError(
            f"adopting needs {human_bytes(region.nbytes)} more on {region.meta.get('device')} for "
            f"{region.key!r}, to verify the whole snapshot before any of it is written, and the device "
            "has no room for them now; nothing was adopted",
            hint="adopt right after building the model, before anything else takes device memory",
        ) from exc


def _placed(end: int, region: SpillableRegion) -> int:
    """Where a shadow starts at or after ``end``: congruent to its region's address modulo the page
    for a region of a page or more, else the next cache line."""
    if region.nbytes < _PAGE:
        return -(-end // _SMALL_ALIGNMENT) * _SMALL_ALIGNMENT
    address = region.host_address()
    within = (address or 0) % _PAGE
    start = end - end % _PAGE + within
    return start if start >= end else start + _PAGE


class _Shadow(RegionAttributes):
    """One region's stand-in: its name, tag, size and meta (what the reader checks), host memory."""

    def __init__(self, region: SpillableRegion, view: memoryview, address: int) -> None:
        super().__init__(region.key, region.tag, region.keep, region.nbytes, region.meta)
        self.view = view
        self._address = address

    def copy_out(self, offset: int, dst: memoryview) -> None:
        raise AssertionError("an adoption only reads the snapshot")

    def copy_in(self, offset: int, src: memoryview) -> None:
        self.view[offset : offset + len(src)] = src

    def host_view(self, offset: int, length: int) -> memoryview | None:
        return self.view[offset : offset + length]

    def host_address(self) -> int | None:
        return self._address if self._nbytes else None


class _AsRecorded:
    """A stand-in (or a region filled in place) shown to the reader with its record's description.

    The reader compares each region's meta with its record's, whole; a storage on another device
    here than in the snapshot differs only by its device (store.adoption.pair_by_name has judged
    the rest), and its bytes are the same, so the reader is shown the record's meta and fills the
    memory the stand-in has, on this process's device.
    """

    def __init__(self, region: Region, meta: Mapping[str, Any]) -> None:
        self._region = region
        self.meta = meta

    @property
    def key(self) -> str:
        return self._region.key

    @property
    def tag(self) -> str:
        return self._region.tag

    @property
    def nbytes(self) -> int:
        return self._region.nbytes

    def copy_out(self, offset: int, dst: memoryview) -> None:
        raise AssertionError("an adoption only reads the snapshot")

    def copy_in(self, offset: int, src: memoryview) -> None:
        self._region.copy_in(offset, src)

    def host_view(self, offset: int, length: int) -> memoryview | None:
        return self._region.host_view(offset, length)

    def host_address(self) -> int | None:
        return self._region.host_address()
