"""The CUDA stage: one for every target of an operation, whatever their kinds.

    sleep: survey and refuse (before anything changes), then lock ALL -> checkpoint ALL
    wake:  survey (from the real states) -> restore ALL -> unlock ALL

Every holder of every target is locked before any is checkpointed, so no
process is copied out while another of the same job still runs kernels. The
stage chooses the checkpointer once, lazily, and keeps what it found (holders,
processes set aside, why no checkpointer) as its own state. Processes that
checkpoint themselves (a vLLM worker with HIBERNATE_SELF_CHECKPOINT=1) are
waited for instead of driven.

With ``--checkpointer none`` the stage makes no checkpoint call at all: the
holders (found by their device files) keep their CUDA state on the GPU and are
listed as left there; a wake refuses a process an earlier sleep checkpointed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hibernate import procinfo
from hibernate.checkpoint import detect, nvml, records, room
from hibernate.checkpoint.base import Checkpointer, CheckpointStepError, CudaState, DetachedCall
from hibernate.checkpoint.group import GroupCheckpoint, check_sleepable, refuse_without_room, room_check
from hibernate.checkpoint.nccl import NCCL_FIX, VLLM_FIX, multi_process_traps
from hibernate.checkpoint.selection import NONE, choose
from hibernate.errors import (
    CudaCheckpointError,
    HibernateError,
    HibernateTimeoutError,
    NeedsRecoveryError,
    NoSuchProcessError,
    UnsupportedError,
    UsageError,
    describe_cause,
)
from hibernate.operation.options import Options
from hibernate.procinfo import ProcessIdentity

POLL_S = 0.05


def changed(report: dict[str, Any]) -> bool:
    """Whether a CUDA wake report says some process's state was changed."""
    return any(p.get("steps") for p in report.get("processes", []))


class CudaStage:
    def __init__(self, options: Options, on_detach: Callable[[DetachedCall], None] | None = None) -> None:
        """``on_detach`` is told of each checkpoint or restore started in a process of its own, before
        it is waited for (the operation's journal)."""
        self.options = options
        self.on_detach = on_detach
        self._checkpointer = options.checkpointer
        self._chosen = options.checkpointer is not None
        if self._checkpointer is not None:
            self._checkpointer.on_detach = on_detach
        self.passed_over: list[str] = []  # why each checkpointer kind could not be used
        self.skipped: list[dict[str, Any]] = []  # processes with device files but no CUDA state
        self.holders: list[ProcessIdentity] = []
        self.left: list[int] = []  # --checkpointer none: holders whose CUDA state stays on the GPU
        self._gpus_before: Any = None  # every GPU before the sleep changed anything (None: not read)
        self.slept = False  # every holder locked and checkpointed by this stage

    @property
    def pools_only(self) -> bool:
        """``--checkpointer none``: free the pools, leave every CUDA context where it is."""
        return self.options.checkpointer_kind == NONE and self.options.checkpointer is None

    # -- what there is ------------------------------------------------------------

    @property
    def checkpointer(self) -> Checkpointer | None:
        """Chosen on first use (an explicit kind that is missing raises UnsupportedError)."""
        if not self._chosen:
            options = self.options
            self._checkpointer, self.passed_over = choose(
                options.checkpointer_kind, options.cuda_checkpoint, options.cuda_timeouts
            )
            self._chosen = True
            if self._checkpointer is not None:
                self._checkpointer.on_detach = self.on_detach
        return self._checkpointer

    @property
    def checkpointer_name(self) -> str | None:
        return self._checkpointer.name if self._checkpointer is not None else None

    def survey(self, processes: Sequence[int]) -> Any:
        """Find every CUDA holder among ``processes`` (device files, or the driver answering for the pid)."""
        found = detect.survey(list(dict.fromkeys(processes)), self.checkpointer)
        self.skipped = found.skipped
        self.holders = list(dict.fromkeys(h.identity for h in found.holders))
        return found

    def require(self, processes: Sequence[int], themselves: Sequence[int] = ()) -> None:
        """Before anything changes: find the holders; refuse unless every one can be checkpointed.

        ``themselves``: holders that checkpoint themselves after the memory steps (vLLM workers with
        HIBERNATE_SELF_CHECKPOINT=1); ``--checkpointer none`` cannot keep them from it, so it refuses.
        """
        if self.pools_only:
            if themselves:
                raise UsageError(
                    f"process(es) {', '.join(map(str, themselves))} checkpoint their own CUDA state after a "
                    "sleep (HIBERNATE_SELF_CHECKPOINT=1): --checkpointer none cannot leave it on the GPU; "
                    "nothing was changed",
                    hint="sleep without --checkpointer none, or start the workers without "
                    "HIBERNATE_SELF_CHECKPOINT",
                )
            found = self.survey(processes)  # by device files only: no checkpointer is asked
            self.left = [h.pid for h in found.holders]
            self.holders = []
            return
        found = self.survey(processes)
        if found.holders and self.checkpointer is None:
            raise UnsupportedError(
                f"process(es) {', '.join(str(h.pid) for h in found.holders)} hold a CUDA context and "
                "neither the driver's checkpoint API nor the cuda-checkpoint binary is available to take "
                "it off the GPU" + self._why_none() + "; nothing was changed",
                hint="install an NVIDIA driver >= 570, or cuda-checkpoint (see `hibernate doctor`)",
            )
        check_sleepable(found.holders)
        self._require_nccl_settings([h.pid for h in found.holders])

    def checkpointed_already(self, processes: Sequence[int]) -> dict[str, Any] | None:
        """The report of a CUDA stage already done: every holder found CUDA-checkpointed; else None.

        What a sleep leaves when its checkpoint outlived its timeout (never cut) and then
        completed: finishing that sleep has nothing left to call.
        """
        checkpointer = None if self.pools_only else self.checkpointer
        if checkpointer is None:
            return None
        found = self.survey(processes)
        if not found.holders or any(h.state is not CudaState.CHECKPOINTED for h in found.holders):
            return None
        self.slept = True
        return self._with_skipped(
            {
                "status": "checkpointed (already, by the interrupted sleep)",
                "checkpointer": checkpointer.describe(),
                "processes": [{"pid": h.pid, "state": "checkpointed", "steps": {}} for h in found.holders],
            }
        )

    def _require_nccl_settings(self, pids: Sequence[int]) -> None:
        """Refuse a sleep of several CUDA processes that may share CUDA IPC memory (unless --force)."""
        if self.options.force:
            return
        traps = multi_process_traps(pids, procinfo.environment, procinfo.command_line)
        if traps:
            detail = "; ".join(f"process {pid}: {', '.join(found)}" for pid, found in traps.items())
            raise UnsupportedError(
                f"{len(pids)} CUDA processes would be checkpointed together, and NCCL's CUDA IPC transports "
                f"may be on ({detail}): cuda-checkpoint cannot checkpoint CUDA IPC memory, so such a job "
                "fails or hangs; nothing was changed",
                hint=f"{NCCL_FIX} ({VLLM_FIX}); or pass --force if these processes share no CUDA memory",
            )

    def _why_none(self) -> str:
        return f" ({'; '.join(self.passed_over)})" if self.passed_over else ""

    def _skipped_report(self) -> dict[str, Any]:
        return self._with_skipped({"status": "none (skipped)", "processes": []})

    def _left_report(self) -> dict[str, Any]:
        """--checkpointer none: what stayed on the GPU, said so, with no call made."""
        return self._with_skipped(
            {"status": "left on the GPU (--checkpointer none)", "processes": [], "left": self.left}
        )

    def _with_skipped(self, report: dict[str, Any]) -> dict[str, Any]:
        if self.skipped:
            report["skipped"] = self.skipped
        return report

    # -- what a sleep gave back -------------------------------------------------------

    def read_gpus_before(self) -> None:
        """Read every GPU before the sleep changes anything (NVML; nothing where it cannot be read)."""
        self._gpus_before = nvml.read_gpus()

    def given_back(
        self, processes: Sequence[int], pool_bytes: Mapping[int, Mapping[str, int]]
    ) -> list[dict[str, Any]] | None:
        """Per GPU, ``used`` before and after the sleep beside the pools' bytes there; None without NVML."""
        before = self._gpus_before
        after = nvml.read_gpus() if before is not None else None
        if before is None or after is None:
            return None
        needs, unplaced = self._placed(pool_bytes, after)
        tracked: dict[str, int] | None = None
        if not unplaced:
            tracked = {}
            for usage in needs.values():
                for uuid, nbytes in usage.items():
                    tracked[uuid] = tracked.get(uuid, 0) + nbytes
        return nvml.given_back(before, after, list(processes), tracked)

    # -- sleep ----------------------------------------------------------------------

    def sleep(self, themselves: Sequence[int], after_lock: Callable[[], None]) -> dict[str, Any]:
        """Lock, then checkpoint, every holder found by :meth:`require`; wait for those in ``themselves``.

        ``after_lock`` runs once every driven holder is locked (the journal's
        ``cuda-lock``; not reached when no holder is driven); if it raises, the
        stage is undone like any failure.
        """
        if self.pools_only:
            self.slept = True
            return self._left_report()
        if not self.holders:
            self.slept = True
            return self._skipped_report()
        checkpointer = self.checkpointer
        if checkpointer is None:  # refused by require()
            raise UnsupportedError("the CUDA stage needs a checkpointer")
        gone = [ident.pid for ident in self.holders if not procinfo.is_alive(ident)]
        if gone:
            raise NoSuchProcessError(f"process(es) {', '.join(map(str, gone))} exited during the sleep")
        driven = [ident for ident in self.holders if ident.pid not in themselves]
        waited = [ident for ident in self.holders if ident.pid in themselves]
        report: dict[str, Any] = {"status": "none (skipped)", "processes": []}
        if driven:
            holders = [detect.Holder(ident, detect.nvidia_device_files(ident.pid), None) for ident in driven]

            def after_step(step: str) -> None:
                if step == "lock":
                    after_lock()

            report = GroupCheckpoint(checkpointer, self.options.cuda_timeouts, after_step=after_step).sleep(
                holders
            )
        if waited:
            report = self._await_themselves(checkpointer, waited, report)
        self.slept = True
        return self._with_skipped(report)

    def _await_themselves(
        self, checkpointer: Checkpointer, holders: Sequence[ProcessIdentity], report: dict[str, Any]
    ) -> dict[str, Any]:
        """Wait for the processes that checkpoint themselves to be checkpointed."""
        started = time.monotonic()
        options = self.options
        running_limit = options.agent_timeout + options.cuda_timeouts.lock
        overall_limit = running_limit + options.cuda_timeouts.checkpoint
        pending = {h.pid for h in holders}
        states: dict[int, str] = {}
        while pending:
            for pid in sorted(pending):
                try:
                    state = checkpointer.state(pid)
                except CheckpointStepError as exc:
                    raise CudaCheckpointError(f"process {pid}: {exc.message}") from exc
                states[pid] = state.value
                if state is CudaState.CHECKPOINTED:
                    pending.discard(pid)
                elif state is CudaState.FAILED:
                    raise CudaCheckpointError(
                        f"process {pid} is in the driver's failed state after checkpointing itself"
                    )
            waited = time.monotonic() - started
            stuck = [p for p in pending if states.get(p) == "running" and waited > running_limit]
            if stuck or (pending and waited > overall_limit):
                late = stuck or sorted(pending)
                raise HibernateTimeoutError(
                    f"worker(s) {', '.join(map(str, late))} did not checkpoint themselves within "
                    f"{waited:.0f}s (HIBERNATE_SELF_CHECKPOINT=1; "
                    f"state {', '.join(states[p] for p in late)})",
                    hint="their vLLM log says why (lines with 'hibernate:')",
                )
            if pending:
                time.sleep(POLL_S)
        seconds = round(time.monotonic() - started, 6)
        merged = dict(report)
        merged["processes"] = [
            *report.get("processes", []),
            *(
                {"pid": h.pid, "state": "checkpointed", "by": "itself", "seconds": seconds, "steps": {}}
                for h in holders
            ),
        ]
        # "checkpointed" alone means hibernate locked and checkpointed every holder itself.
        merged["status"] = (
            "checkpointed (by the workers themselves)"
            if not report.get("processes")
            else f"checkpointed ({len(holders)} by the workers themselves)"
        )
        return merged

    def undo_sleep(self, processes: Sequence[int], error: BaseException) -> None:
        """Bring a completed stage back (restore, unlock) before any agent touches memory again."""
        if not self.slept or self.pools_only:
            return  # a failure inside the stage was undone by the stage itself; none changes nothing
        try:
            self.wake(processes, after_restore=lambda: None)
        except HibernateError as undo_error:
            raise NeedsRecoveryError(
                f"{describe_cause(error)}; bringing the CUDA state back failed too: {undo_error.message}",
                hint=f"run `hibernate recover {' '.join(map(str, processes))}` once the cause is fixed",
            ) from error
        self.slept = False

    # -- wake -----------------------------------------------------------------------

    def gpu_map(self, holders: Sequence[Any]) -> dict[str, str] | None:
        """``--device-map`` as GPU UUIDs, refused unless it covers every GPU a checkpointed holder was on."""
        if not self.options.device_map:
            return None
        reading = nvml.read_gpus()
        uuids = [gpu.uuid for gpu in sorted(reading.gpus, key=lambda gpu: gpu.index)] if reading else None
        gpu_map = room.resolve_device_map(self.options.device_map, uuids)
        on = {
            h.pid: room.gpus_of(records.load(h.identity))
            for h in holders
            if h.state is CudaState.CHECKPOINTED
        }
        unknown = [pid for pid, gpus in on.items() if gpus is None]
        if unknown:
            raise UsageError(
                f"--device-map: nothing recorded which GPUs process(es) {', '.join(map(str, unknown))} were "
                "checkpointed on, so the map cannot be checked to cover them; nothing was changed",
                hint="wake without --device-map, on the GPUs the sleep left",
            )
        missing = room.uncovered(gpu_map, {pid: gpus for pid, gpus in on.items() if gpus is not None})
        if missing:
            described = "; ".join(f"process {pid} was on {', '.join(gpus)}" for pid, gpus in missing.items())
            raise UsageError(
                f"--device-map does not name every GPU that was checkpointed ({described}); "
                "nothing was changed",
                hint="map each of those GPUs: --device-map OLD=NEW,... (UUIDs or indices)",
            )
        return gpu_map

    def _pool_needs(self, pool_bytes: Mapping[int, Mapping[str, int]]) -> tuple[Any, list[int]]:
        """What each process's pools will map back per GPU UUID, and the processes that cannot be placed."""
        if not any(pool_bytes.values()):
            return {}, []
        return self._placed(pool_bytes, nvml.read_gpus())

    @staticmethod
    def _placed(pool_bytes: Mapping[int, Mapping[str, int]], reading: Any) -> tuple[Any, list[int]]:
        """Pool bytes per process and GPU UUID (placed through CUDA_VISIBLE_DEVICES), and the unplaced."""
        wanted = {pid: dict(devices) for pid, devices in pool_bytes.items() if devices}
        if not wanted:
            return {}, []
        if reading is None:
            return {}, list(wanted)
        uuids = [gpu.uuid for gpu in sorted(reading.gpus, key=lambda gpu: gpu.index)]
        return room.pool_needs(wanted, {pid: procinfo.environment(pid) for pid in wanted}, uuids)

    def _check_pools(self, pools: tuple[Any, list[int]], report: dict[str, Any]) -> dict[str, Any]:
        """Without a CUDA restore, the pools' own remap is checked the same way (free memory per GPU)."""
        needs, unknown = pools
        if not needs and not unknown:
            return report
        memory = room_check(needs, unknown, nvml.read_gpus())
        refuse_without_room(memory, self.options.force)
        report["memory"] = memory
        return report

    def wake(
        self,
        processes: Sequence[int],
        after_restore: Callable[[], None],
        pool_bytes: Mapping[int, Mapping[str, int]] | None = None,
    ) -> dict[str, Any]:
        """Restore every checkpointed holder, then unlock every locked one, deciding from their real states.

        A checkpointed process has closed its device files, so it is found by
        asking the driver; without a checkpointer nothing can be asked, and a
        process that an earlier sleep checkpointed (its record says so) is
        refused rather than left blocked in its first CUDA call.

        ``pool_bytes`` (pid -> "cuda:N" -> bytes) is what the units' wake will
        map back afterwards: the free-memory check counts it on each GPU, with
        the CUDA state or, where nothing is restored, alone.
        """
        pools = self._pool_needs(pool_bytes or {})

        checkpointer = self.checkpointer
        if checkpointer is None:
            pending = [
                ident.pid
                for ident in (procinfo.identity(p) for p in dict.fromkeys(processes))
                if ident is not None and records.load(ident) is not None
            ]
            if pending:
                if self.pools_only:
                    raise UsageError(
                        f"process(es) {', '.join(map(str, pending))} had their CUDA state checkpointed by "
                        "`hibernate sleep`: --checkpointer none cannot restore it; nothing was changed",
                        hint="wake without --checkpointer none (or --no-cuda)",
                    )
                raise UnsupportedError(
                    f"process(es) {', '.join(map(str, pending))} had their CUDA state checkpointed by "
                    "`hibernate sleep`, and neither the driver's checkpoint API nor the cuda-checkpoint "
                    "binary is available to restore it" + self._why_none() + "; nothing was changed",
                    hint="run the wake where the sleep ran (same driver), or pass --cuda-checkpoint PATH",
                )
        found = self.survey(processes)
        if self.pools_only:
            self.left = [h.pid for h in found.holders]
            return self._check_pools(pools, self._left_report())
        restoring = checkpointer is not None and any(h.state is CudaState.CHECKPOINTED for h in found.holders)
        if self.options.device_map and not restoring:
            raise UsageError(
                "--device-map: no process of the targets is CUDA-checkpointed; nothing was changed"
            )
        alone = {} if restoring else self._check_pools(pools, {})  # nothing restored: the pools alone
        if not found.holders or checkpointer is None:
            return {**self._skipped_report(), **alone}

        def after_step(step: str) -> None:
            if step == "restore":
                after_restore()

        group = GroupCheckpoint(
            checkpointer,
            self.options.cuda_timeouts,
            after_step=after_step,
            force=self.options.force,
            gpu_map=self.gpu_map(found.holders) if restoring else None,
            pools=pools if restoring else ({}, []),
        )
        report = {**group.wake(found.holders), **alone}
        return self._with_skipped(report)
