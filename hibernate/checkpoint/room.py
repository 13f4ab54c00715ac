"""What a wake will ask of each GPU, from what the sleep measured: pure functions, tested on their own.

A restore that runs out of GPU memory wedges the process for good
(NVIDIA/cuda-checkpoint#44), so a wake must know, per GPU, what comes back
before anything is touched:

- the CUDA state: what the GPU's ``used`` memory dropped by between the lock
  and the checkpoint of a sleep (kept per process in its record, with the
  pids checkpointed together), and what NVML saw each process hold where it
  can see the pid at all (inside a container it often cannot); the larger;
- the bytes the pools map back, per CUDA device of the process, translated to
  a GPU UUID through the process's ``CUDA_VISIBLE_DEVICES``.

Whatever cannot be known (no reading, a drop of nothing, a device that cannot
be placed) is returned as unknown, never as zero: the caller refuses unless
told to go ahead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hibernate.errors import UsageError

Needs = dict[int, dict[str, int]]  # pid -> GPU UUID -> bytes


def device_drop(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int] | None:
    """Per GPU, how much ``used`` fell between two readings (UUID -> bytes used); None if nothing fell.

    A checkpoint of a CUDA process always frees its context (hundreds of MiB),
    so a drop of nothing anywhere means the readings saw nothing (a stale or
    blind NVML), not that the restore needs nothing.
    """
    drop = {uuid: used - after[uuid] for uuid, used in before.items() if uuid in after and used > after[uuid]}
    return drop or None


def cuda_needs(records: Mapping[int, Mapping[str, Any] | None]) -> tuple[Needs, list[int]]:
    """What restoring the processes of ``records`` (pid -> its sleep record) needs per GPU, and the unknown.

    A record holds ``gpus`` (what NVML saw the process hold, or None), ``drop``
    (the device drop of the processes checkpointed with it, or None) and
    ``cohort`` (those pids). Each GPU then needs the larger of the cohort's drop
    and the sum of what its processes were seen to hold; the drop is counted
    once per cohort, on its first process here.
    """
    needs: Needs = {}
    unknown: list[int] = []
    counted: set[tuple[int, ...]] = set()
    for pid, record in records.items():
        seen = (record or {}).get("gpus")
        drop = (record or {}).get("drop")
        mine = {str(k): int(v) for k, v in seen.items()} if isinstance(seen, dict) else {}
        cohort = tuple(sorted(int(p) for p in (record or {}).get("cohort") or (pid,)))
        if isinstance(drop, dict) and drop and cohort not in counted:
            counted.add(cohort)
            others: dict[str, int] = {}
            for other in cohort:
                other_seen = (records.get(other) or {}).get("gpus") if other != pid else None
                for uuid, nbytes in (other_seen or {}).items():
                    others[uuid] = others.get(uuid, 0) + int(nbytes)
            for uuid, nbytes in drop.items():
                mine[uuid] = max(mine.get(uuid, 0), int(nbytes) - others.get(uuid, 0))
        known = isinstance(seen, dict) or (isinstance(drop, dict) and bool(drop))
        if known:
            needs[pid] = mine
        else:
            unknown.append(pid)
    return needs, unknown


def device_uuid(device: str, environ: Mapping[str, str], uuids: Sequence[str]) -> str | None:
    """The UUID of the GPU that CUDA device ``device`` ("cuda:N") of a process is, or None if unknowable.

    ``environ`` is the process's environment, ``uuids`` the GPUs in NVML's
    (PCI) order. ``CUDA_VISIBLE_DEVICES`` may list indices or (prefixes of)
    UUIDs; without it device N is taken as NVML's GPU N, which holds where
    CUDA orders devices by PCI bus (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, or
    identical GPUs). MIG instances cannot be placed.
    """
    kind, _, number = device.partition(":")
    if kind != "cuda":
        return None
    ordinal = int(number) if number.isdigit() else 0
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return uuids[ordinal] if ordinal < len(uuids) else None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        return None
    entry = entries[ordinal]
    if entry.isdigit():
        index = int(entry)
        return uuids[index] if index < len(uuids) else None
    matches = [u for u in uuids if entry.startswith("GPU-") and u.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def pool_needs(
    device_bytes: Mapping[int, Mapping[str, int]],
    environs: Mapping[int, Mapping[str, str]],
    uuids: Sequence[str],
) -> tuple[Needs, list[int]]:
    """Per process, the pool bytes mapped back on each GPU (pid -> "cuda:N" -> bytes), and the unplaceable."""
    needs: Needs = {}
    unknown: list[int] = []
    for pid, devices in device_bytes.items():
        for device, nbytes in devices.items():
            uuid = device_uuid(device, environs.get(pid, {}), uuids)
            if uuid is None:
                unknown.append(pid)
                continue
            needs.setdefault(pid, {})[uuid] = needs.get(pid, {}).get(uuid, 0) + int(nbytes)
    return needs, list(dict.fromkeys(unknown))


def combine(*parts: Needs) -> Needs:
    """The sum of several needs, per process and GPU."""
    total: Needs = {}
    for part in parts:
        for pid, usage in part.items():
            mine = total.setdefault(pid, {})
            for uuid, nbytes in usage.items():
                mine[uuid] = mine.get(uuid, 0) + nbytes
    return total


def remap(needs: Needs, gpu_map: Mapping[str, str] | None) -> Needs:
    """The needs on the GPUs a ``--device-map`` (old UUID -> new UUID) restores onto."""
    if not gpu_map:
        return needs
    moved: Needs = {}
    for pid, usage in needs.items():
        mine = moved.setdefault(pid, {})
        for uuid, nbytes in usage.items():
            target = gpu_map.get(uuid, uuid)
            mine[target] = mine.get(target, 0) + nbytes
    return moved


def gpus_of(record: Mapping[str, Any] | None) -> list[str] | None:
    """The GPUs a checkpointed process's record says it was on (what NVML saw, what dropped); None: none."""
    if not record:
        return None
    found: dict[str, None] = {}
    for key in ("gpus", "drop"):
        value = record.get(key)
        if isinstance(value, dict):
            found.update(dict.fromkeys(str(uuid) for uuid in value))
    return list(found) or None


def resolve_device_map(given: Mapping[str, str], uuids: Sequence[str] | None) -> dict[str, str]:
    """``--device-map`` (each side a GPU UUID or an NVML index) as old UUID -> new UUID.

    ``uuids``: this machine's GPUs in NVML order (None without NVML: only UUIDs
    can be given then). A new GPU must be on this machine where that can be
    read; no two old GPUs may go to the same new one.
    """

    def uuid_of(side: str) -> str:
        text = side.strip()
        if text.isdigit():
            if uuids is None:
                raise UsageError(
                    f"--device-map: GPU index {text} needs NVML to be named; give GPU UUIDs instead",
                    hint="nvidia-smi -L lists them",
                )
            if int(text) >= len(uuids):
                raise UsageError(f"--device-map: there is no GPU {text} on this machine ({len(uuids)} GPUs)")
            return uuids[int(text)]
        if not text.upper().startswith("GPU-"):
            raise UsageError(f"--device-map: {side!r} is neither a GPU UUID (GPU-...) nor an index")
        return text

    resolved = {uuid_of(old): uuid_of(new) for old, new in given.items()}
    if uuids is not None:
        absent = [new for new in resolved.values() if new not in uuids]
        if absent:
            raise UsageError(f"--device-map: {', '.join(absent)} is not a GPU of this machine")
    if len(set(resolved.values())) != len(resolved):
        raise UsageError("--device-map: two GPUs are mapped onto the same one")
    return resolved


def uncovered(gpu_map: Mapping[str, str], on: Mapping[int, Sequence[str]]) -> dict[int, list[str]]:
    """Per process, the GPUs it was checkpointed on that ``gpu_map`` does not name (the driver needs all)."""
    missing = {pid: [uuid for uuid in gpus if uuid not in gpu_map] for pid, gpus in on.items()}
    return {pid: gpus for pid, gpus in missing.items() if gpus}
