"""What a sleep, wake or recover reports: typed here, JSON through ``to_wire()`` (docs/json-schema)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hibernate.operation.progress import side_by_side, transfer_rate


def _tuning(answer: dict[str, Any]) -> dict[str, Any] | None:
    """A transfer's tuning as its agent reported it; None from an agent that does not say."""
    tuning = answer.get("tuning")
    return dict(tuning) if isinstance(tuning, dict) else None


def _io_seconds(answer: dict[str, Any]) -> float | None:
    """The store's own transfer time within a spill or restore; None where the agent did not say."""
    value = answer.get("io_seconds")
    return round(float(value), 6) if isinstance(value, (int, float)) else None


def _staging_bytes(answer: dict[str, Any]) -> int | None:
    """The staging memory a spill or restore allocated (its share of --buffer-mb, or less)."""
    value = answer.get("staging_bytes")
    return int(value) if isinstance(value, int) else None


def _kept_staging(answer: dict[str, Any]) -> dict[str, int] | None:
    """The staging a spill or restore reused from, and left kept for, the process's next
    transfers (store.directio.KeptStaging); None from an agent that does not say."""
    kept = answer.get("kept_staging")
    if not isinstance(kept, dict):
        return None
    return {str(k): int(v) for k, v in kept.items() if isinstance(v, int) and not isinstance(v, bool)}


def _step_seconds(answers: dict[str, Any]) -> dict[str, float]:
    return {k: round(float(v.get("seconds", 0.0)), 6) for k, v in answers.items() if isinstance(v, dict)}


@dataclass
class ProcessSleep:
    """One process of a sleep, from what its agent's quiesce, spill and release returned."""

    pid: int
    name: Any
    snapshot: Any
    total_bytes: int
    written_bytes: int
    reused_bytes: int
    dropped_bytes: int
    released_bytes: int
    io_mode: Any
    gb_per_s: float
    io_seconds: float | None
    staging_bytes: int | None
    verify_seconds: Any
    rss_before: Any
    rss_after: Any
    pools: list[Any]
    phases: dict[str, float]  # seconds of each step ("phases" in the JSON reports)
    # Defaulted: a node-step document written before these fields existed still reads back.
    resident_bytes: int = 0  # partial edge pages of host memory freed in place (hibernate.pools.hostpages)
    warnings: list[str] = field(default_factory=list)  # what the sleep left in memory, and why
    # The reuse check (see hibernate.store.reusecheck): bytes of the previous snapshot read back to
    # check what is reused, of those written again because the disk no longer held them, and bytes
    # reused without being read back (--skip-reuse-check).
    reuse_read_bytes: int = 0
    rewritten_bytes: int = 0
    reused_unread_bytes: int = 0
    # What the spill's writes ran with (store.tuning): requests in flight, threads, the filesystem.
    tuning: dict[str, Any] | None = None
    # Staging taken from what the process kept, kept for its next transfer, given back.
    kept_staging: dict[str, int] | None = None
    # The spilled regions' bytes on each CUDA device, as the spill counted them: what the command
    # accounts the GPUs' memory given back to (engine.sleep), where the hello that found the agent
    # left them uncounted. Not in the JSON report (to_wire), which shows the GPUs themselves.
    device_bytes: dict[str, int] = field(default_factory=dict)

    @classmethod
    def from_answers(cls, pid: int, name: Any, answers: dict[str, dict[str, Any]]) -> ProcessSleep:
        """GB/s is the snapshot's bytes (written and reused) over the whole spill step (``seconds``),
        not over the store's transfer alone (``io_seconds``): with many small tensors the work around
        the writes is most of the step, and a rate that left it out would promise what no sleep
        delivers. It is :func:`hibernate.operation.progress.transfer_rate`, the progress bar's rate.
        """
        spill = answers.get("spill", {})
        release = answers.get("release", {})
        written = int(spill.get("written_bytes", 0))
        spill_seconds = round(float(spill.get("seconds", 0.0)), 6)  # as phases holds it
        return cls(
            pid=pid,
            name=name,
            snapshot=spill.get("path"),
            total_bytes=spill.get("total_bytes", 0),
            written_bytes=written,
            reused_bytes=spill.get("reused_bytes", 0),
            dropped_bytes=spill.get("dropped_bytes", 0),
            released_bytes=release.get("released_bytes", 0),
            resident_bytes=release.get("resident_bytes", 0),
            warnings=list(spill.get("warnings", [])),
            reuse_read_bytes=spill.get("reuse_read_bytes", 0),
            rewritten_bytes=spill.get("rewritten_bytes", 0),
            reused_unread_bytes=spill.get("reused_unread_bytes", 0),
            io_mode=spill.get("io_mode"),
            gb_per_s=transfer_rate(written + int(spill.get("reused_bytes", 0)), spill_seconds),
            io_seconds=_io_seconds(spill),
            staging_bytes=_staging_bytes(spill),
            verify_seconds=spill.get("verify_seconds"),
            rss_before=release.get("rss_before"),
            rss_after=release.get("rss_after"),
            pools=spill.get("pools", []),
            phases=_step_seconds(answers),
            tuning=_tuning(spill),
            kept_staging=_kept_staging(spill),
            device_bytes=_device_bytes(spill),
        )

    def moved(self) -> tuple[int, float]:
        """The bytes and seconds its rate is over (``gb_per_s``)."""
        return self.written_bytes + self.reused_bytes, self.phases.get("spill", 0.0)

    def to_wire(self) -> dict[str, Any]:
        wire = asdict(self)
        del wire["device_bytes"]
        return wire


def _device_bytes(spill: dict[str, Any]) -> dict[str, int]:
    """A spill answer's bytes per CUDA device; none where an older agent did not count them."""
    counted = spill.get("device_bytes")
    if not isinstance(counted, dict):
        return {}
    return {
        str(device): nbytes
        for device, nbytes in counted.items()
        if isinstance(nbytes, int) and not isinstance(nbytes, bool)
    }


@dataclass
class ProcessWake:
    """One process of a wake, from what its agent's restore and resume returned."""

    pid: int
    name: Any
    snapshot: Any
    restored_bytes: int
    zeroed_bytes: int
    io_mode: Any
    gb_per_s: float
    io_seconds: float | None
    staging_bytes: int | None
    rss_before: Any
    rss_after: Any
    phases: dict[str, float]  # seconds of each step ("phases" in the JSON reports)
    warnings: list[str] = field(default_factory=list)  # what the wake met and went past, and why
    tuning: dict[str, Any] | None = None  # what the restore's reads ran with (see ProcessSleep)
    kept_staging: dict[str, int] | None = None  # see ProcessSleep

    @classmethod
    def from_answers(
        cls, pid: int, name: Any, snapshot: Any, answers: dict[str, dict[str, Any]]
    ) -> ProcessWake:
        """GB/s is over the whole restore step, as in :meth:`ProcessSleep.from_answers`."""
        restore = answers.get("restore", {})
        total = int(restore.get("total_bytes", 0))
        restore_seconds = round(float(restore.get("seconds", 0.0)), 6)  # as phases holds it
        return cls(
            pid=pid,
            name=name,
            snapshot=snapshot,
            restored_bytes=total,
            zeroed_bytes=restore.get("zeroed_bytes", 0),
            io_mode=restore.get("io_mode"),
            gb_per_s=transfer_rate(total, restore_seconds),
            io_seconds=_io_seconds(restore),
            staging_bytes=_staging_bytes(restore),
            rss_before=restore.get("rss_before"),
            rss_after=restore.get("rss_after"),
            phases=_step_seconds(answers),
            warnings=list(restore.get("warnings", [])),
            tuning=_tuning(restore),
            kept_staging=_kept_staging(restore),
        )

    def moved(self) -> tuple[int, float]:
        """The bytes and seconds its rate is over (``gb_per_s``)."""
        return self.restored_bytes, self.phases.get("restore", 0.0)

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)


def total_rate(processes: Sequence[ProcessSleep] | Sequence[ProcessWake]) -> tuple[int, float] | None:
    """Bytes and GB/s of the processes' transfers as one (side_by_side): the progress bar's last
    rate; None for fewer than two processes, whose own lines say it."""
    if len(processes) < 2:
        return None
    nbytes, seconds = side_by_side([p.moved() for p in processes])
    return nbytes, transfer_rate(nbytes, seconds)


@dataclass
class UnitReport:
    """What one unit adds to a report: its processes, and anything of its kind (a vLLM server's URL)."""

    sleeps: list[ProcessSleep] = field(default_factory=list)
    wakes: list[ProcessWake] = field(default_factory=list)
    extra_key: str | None = None  # the report's key for ``extra`` (one per kind: "vllm")
    extra: dict[str, Any] | None = None


def _units_from_wire(wire: dict[str, Any]) -> list[UnitReport]:
    """The kinds' extras of a report read back (the processes are the report's own)."""
    return [
        UnitReport(extra_key=key.removesuffix("_all"), extra=extra)
        for key, values in wire.items()
        if key.endswith("_all") and isinstance(values, list)
        for extra in values
    ]


def _extras(units: list[UnitReport]) -> dict[str, Any]:
    """Each kind's extras: under its key when one unit of it (as ever), and as a list under ``<key>_all``."""
    grouped: dict[str, list[dict[str, Any]]] = {}
    for unit in units:
        if unit.extra_key is not None and unit.extra is not None:
            grouped.setdefault(unit.extra_key, []).append(unit.extra)
    wire: dict[str, Any] = {}
    for key, values in grouped.items():
        if len(values) == 1:
            wire[key] = values[0]
        wire[f"{key}_all"] = values
    return wire


@dataclass
class SleepReport:
    directory: str | None
    seconds: float
    processes: list[ProcessSleep]
    cuda: dict[str, Any]
    units: list[UnitReport] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    # Per GPU, what the sleep really gave back (NVML's used before and after) beside the tracked bytes;
    # None where NVML could not be read (or the sleep did not read it: a recovery's CUDA stage alone).
    gpus: list[dict[str, Any]] | None = None

    @property
    def extras(self) -> dict[str, Any]:
        return _extras(self.units)

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> SleepReport:
        """A report read back from its JSON (a node-step's document)."""
        return cls(
            directory=wire.get("directory"),
            seconds=float(wire.get("seconds", 0.0)),
            processes=[ProcessSleep(**p) for p in wire.get("processes", [])],
            cuda=wire.get("cuda", {}),
            units=_units_from_wire(wire),
            skipped=wire.get("skipped", []),
            gpus=wire.get("gpus"),
        )

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "operation": "sleep",
            "directory": self.directory,
            "seconds": round(self.seconds, 6),
            "processes": [p.to_wire() for p in self.processes],
            "cuda": self.cuda,
            "gpus": self.gpus,
        }
        wire.update(self.extras)
        if self.skipped:
            wire["skipped"] = self.skipped
        return wire


@dataclass
class WakeReport:
    seconds: float
    processes: list[ProcessWake]
    cuda: dict[str, Any]
    units: list[UnitReport] = field(default_factory=list)
    # Processes found awake and left as they were (`hibernate wake --if-needed`), as a sleep's.
    skipped: list[dict[str, Any]] = field(default_factory=list)

    @property
    def extras(self) -> dict[str, Any]:
        return _extras(self.units)

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> WakeReport:
        return cls(
            seconds=float(wire.get("seconds", 0.0)),
            processes=[ProcessWake(**p) for p in wire.get("processes", [])],
            cuda=wire.get("cuda", {}),
            units=_units_from_wire(wire),
            skipped=wire.get("skipped", []),
        )

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "operation": "wake",
            "seconds": round(self.seconds, 6),
            "processes": [p.to_wire() for p in self.processes],
            "cuda": self.cuda,
        }
        wire.update(self.extras)
        if self.skipped:
            wire["skipped"] = self.skipped
        return wire


@dataclass
class RecoverReport:
    action: str
    report: SleepReport | WakeReport | None = None
    message: str | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"operation": "recover", "action": self.action}
        if self.message is not None:
            wire["message"] = self.message
        else:
            wire["report"] = self.report.to_wire() if self.report is not None else None
        return wire
