"""A snapshot taken up by a new process: which one a path names, whether it may be taken, and how its
records pair with the new process's regions.

A snapshot outlives its process: a job killed, requeued or moved to another
node starts again from the same code and wants its tensors back. The process
that wrote the snapshot is gone, so nothing of it can be asked: what the new
process has is the path it is given and the names it tracks. This module
answers the store's part: ``locate`` finds the snapshot a path means and
judges its owner; ``pair_by_name`` matches records to regions by key (a
process built by the same code may have created its tensors in another
order) and lists every difference at once, so a refusal says all that is
wrong before a byte is written.

The device a storage was on is no difference: its bytes are the same on any
device for the same dtypes, shapes and strides, as ``load_state_dict`` copies
across devices. A requeued job often lands on a node where its GPU has another
index, and a GPU job's state may be taken up on the CPU: each such record is
noted (``Pairing.moved``), for the report to say so.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hibernate.errors import BusyError, PermissionDeniedError, SnapshotInvalidError, StorageError
from hibernate.store.layout import SpillRoot, is_spill_root, read_marker
from hibernate.store.manifest import MANIFEST_NAME, Columns, snapshot_sequence
from hibernate.store.owner import Liveness, Owner, liveness
from hibernate.store.regions import Region

NOTHING_THERE = "no complete snapshot"  # how every refusal for want of a snapshot begins
DEVICE = "device"  # the meta's field that names the device a storage is on (pools.base)


@dataclass(frozen=True)
class AdoptionSource:
    """The snapshot a path names, whose it was, and why this one."""

    root: Path  # the spill root that holds it
    snapshot: str  # its name, snap-NNNNNN
    owner: Owner  # the process that wrote it
    liveness: Liveness  # "dead" or "unknown": an owner "alive" is refused
    why: str  # what liveness rests on ("it has exited", "it ran on another machine (...)")
    picked: str  # how the path led to it, for the report


def locate(path: Path) -> AdoptionSource:
    """The snapshot ``path`` names: a snapshot directory, a process's spill root (its newest
    published snapshot), or a directory of spill roots (the newest published snapshot of any).

    Refused: nothing hibernate wrote there, another user's root (never read), and a snapshot
    whose owner still runs (it is woken, not adopted). An owner this machine cannot see (another
    host, a pid namespace out of sight) is accepted: the caller named the path.
    """
    path = Path(path).expanduser().absolute()
    if snapshot_sequence(path.name) is not None and _is_root(path.parent):
        root, snapshot, picked = path.parent, path.name, "the snapshot named"
    elif _is_root(path):
        root, snapshot = path, _newest_in(path)
        picked = "the newest snapshot of the process directory named"
    else:
        # A process directory whose sleep was cut short (killed before it published) holds no
        # complete snapshot: it is passed over, and an older complete one elsewhere is taken.
        complete = [(root, name) for root in _roots_in(path) if (name := _newest_or_none(root))]
        if not complete:
            raise SnapshotInvalidError(
                f"{NOTHING_THERE} in {path}",
                hint="name a snapshot (…/snap-NNNNNN), a process's directory in --to, or the --to directory",
            )
        root, snapshot = max(complete, key=lambda found: (_published_at(*found), str(found[0])))
        where = "the one process directory" if len(complete) == 1 else f"{len(complete)} process directories"
        picked = f"the newest complete snapshot of {where} in the directory named"
    _refuse_foreign(root)
    with SpillRoot(root, inspect=True) as opened:
        owner = opened.owner
    state, why = liveness(owner)
    if state == "alive":
        raise BusyError(
            f"{root / snapshot} belongs to {owner.describe()}, which still runs: {why}; nothing was adopted",
            hint=f"wake that process instead (hibernate wake {owner.pid}), or end it first",
        )
    return AdoptionSource(root, snapshot, owner, state, why, picked)


def _is_root(path: Path) -> bool:
    try:
        return is_spill_root(path)
    except PermissionError:
        return False


def _roots_in(path: Path) -> list[Path]:
    """The spill roots directly in ``path`` that belong to this user (another user's are not looked into)."""
    try:
        names = sorted(os.listdir(path))
    except FileNotFoundError as exc:
        raise SnapshotInvalidError(f"{NOTHING_THERE} in {path}: it does not exist") from exc
    except NotADirectoryError as exc:
        raise SnapshotInvalidError(f"{path} is not a directory") from exc
    except PermissionError as exc:
        raise PermissionDeniedError(f"cannot list {path}: permission denied") from exc
    roots = []
    for name in names:
        candidate = path / name
        try:
            info = os.lstat(candidate)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and _is_root(candidate):
            roots.append(candidate)
    return roots


def _newest_or_none(root: Path) -> str | None:
    """The newest published snapshot of ``root``; None where it has none, or cannot be opened."""
    try:
        with SpillRoot(root, inspect=True) as opened:
            published = opened.published()
    except (SnapshotInvalidError, StorageError):
        return None
    return published[-1] if published else None


def _newest_in(root: Path) -> str:
    with SpillRoot(root, inspect=True) as opened:
        published = opened.published()
    if not published:
        raise SnapshotInvalidError(
            f"{NOTHING_THERE} in {root} (a sleep cut short publishes none)",
            hint="a snapshot is complete once its manifest.json is in place",
        )
    return published[-1]


def _published_at(root: Path, snapshot: str) -> int:
    """When a snapshot was published: its manifest is written once, then the directory renamed."""
    return os.stat(root / snapshot / MANIFEST_NAME, follow_symlinks=False).st_mtime_ns


def _refuse_foreign(root: Path) -> None:
    """Another user's snapshot is never read: its marker's owner and the directory must be ours."""
    try:
        info = os.lstat(root)
    except OSError as exc:
        raise SnapshotInvalidError(f"cannot open {root}: {exc.strerror or exc}") from exc
    uid = os.geteuid()
    if info.st_uid != uid:
        raise PermissionDeniedError(
            f"{root} belongs to uid {info.st_uid}, not to you (uid {uid}); nothing was adopted",
            hint="adopt only your own snapshots",
        )
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        owner = read_marker(fd)
    finally:
        os.close(fd)
    if owner is not None and owner.uid not in (-1, uid):
        raise PermissionDeniedError(
            f"{root} was written by uid {owner.uid}, not by you (uid {uid}); nothing was adopted"
        )


@dataclass(frozen=True)
class Pairing:
    """Records paired with regions by key: ``regions[order[i]]`` is record ``i``'s region."""

    order: list[int]
    unclaimed: list[str]  # keys of records no region asked for (left unread: a partial adoption)
    # Record index -> "<its device> -> <its region's device>", for each record whose region is on
    # another device: its bytes are the same, only what the reader compares must be the record's.
    moved: dict[int, str] = dataclasses.field(default_factory=dict)

    def moves(self) -> dict[str, int]:
        """How many storages changed device, by way (``{"cuda:1 -> cuda:0": 12}``); empty if none did."""
        return dict(sorted(Counter(self.moved.values()).items()))


def pair_by_name(columns: Columns, regions: Sequence[Region], *, every_record: bool) -> Pairing:
    """Each region's record, by key; refused with every difference listed where any differs.

    A difference is a region the snapshot lacks, or one whose tag, size or meta (dtype, shape,
    strides of each view) is not the record's; its device is none (see the module), and each
    record whose region is on another device is noted in ``moved``. With ``every_record``, a
    record no region claims is one too (the whole process is adopted), but for a gradient of a
    parameter that is adopted; otherwise it is left unread and reported.
    """
    index = {key: i for i, key in enumerate(columns.keys)}
    differences: list[str] = []
    order = [-1] * len(columns.keys)
    moved: dict[int, str] = {}
    for position, region in enumerate(regions):
        record = index.get(region.key)
        if record is None:
            differences.append(f"{region.key}: in this process, not in the snapshot")
            continue
        order[record] = position
        problem = _difference(columns, record, region)
        if problem is not None:
            differences.append(f"{region.key}: {problem}")
            continue
        saved_device, live_device = columns.metas[record].get(DEVICE), region.meta.get(DEVICE)
        if saved_device != live_device:
            moved[record] = f"{saved_device} -> {live_device}"
    unclaimed = [key for key, position in zip(columns.keys, order, strict=True) if position < 0]
    if every_record:
        claimed = {region.key for region in regions}
        differences.extend(
            f"{key}: in the snapshot, not in this process"
            for key in unclaimed
            if not _gradient_of(key, claimed)
        )
    if differences:
        shown = differences[:20]
        more = f"; and {len(differences) - len(shown)} more" if len(differences) > len(shown) else ""
        counted = f"{len(differences)} difference{'s' if len(differences) != 1 else ''}"
        raise SnapshotInvalidError(
            f"the snapshot does not match this process ({counted}): {'; '.join(shown)}{more}; "
            "nothing was adopted",
            hint="adopt a snapshot of a process built by the same code (same model, dtypes and shapes)",
        )
    return Pairing(order, unclaimed, moved)


GRADIENT_SUFFIX = ".grad"  # how the tensor pool names a parameter's gradient


def _gradient_of(key: str, claimed: set[str]) -> bool:
    """Whether a record is the gradient of a parameter adopted (``<its key>.grad``): the program
    has none before its first backward pass, which makes it anew, so it is not wanted."""
    return key.endswith(GRADIENT_SUFFIX) and key[: -len(GRADIENT_SUFFIX)] in claimed


def _difference(columns: Columns, record: int, region: Region) -> str | None:
    """What differs between a record and the region of the same key; None if nothing does."""
    tag, size = columns.tags[record], columns.sizes[record]
    if tag != region.tag:
        return f"tag {tag!r} in the snapshot, {region.tag!r} here"
    saved_views = list(columns.metas[record].get("views") or [])
    live_views = list(region.meta.get("views") or [])
    if saved_views != live_views:
        return _views_difference(saved_views, live_views) or "its tensors differ"
    if size != region.nbytes:
        return f"{size} bytes in the snapshot, {region.nbytes} here"
    saved, live = columns.metas[record], region.meta
    if saved != live and _but_device(saved) != _but_device(live):
        return "its description differs"
    return None


def _but_device(meta: Mapping[str, Any]) -> dict[str, Any]:
    """A region's meta without its device, which an adoption does not compare (see the module)."""
    return {name: value for name, value in meta.items() if name != DEVICE}


def _views_difference(saved: list[dict[str, object]], live: list[dict[str, object]]) -> str | None:
    """The first view that differs, said as a person would: its dtype, its shape, or its layout."""
    by_name = {str(v.get("name")): v for v in saved}
    for view in live:
        name = str(view.get("name"))
        old = by_name.get(name)
        if old is None:
            return f"tensor {name} is not in the snapshot's record"
        for field, words in (("dtype", "dtype"), ("shape", "shape"), ("strides", "strides")):
            if old.get(field) != view.get(field):
                return f"{words} {old.get(field)} in the snapshot, {view.get(field)} here (tensor {name})"
        if old.get("storage_offset") != view.get("storage_offset"):
            return f"offset {old.get('storage_offset')} in the snapshot, {view.get('storage_offset')} here"
    return None
