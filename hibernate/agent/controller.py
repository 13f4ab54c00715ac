"""The agent's state machine: what this process's memory is doing, and who may change it.

    running --quiesce--> quiesced --spill--> spilled --release--> asleep
       ^                    |                   |                   |
       +------resume--------+-------resume------+                restore
       |                                                            |
       +----------------------- resume <----- quiesced <------------+

``quiesce`` closes the guard; ``spill`` publishes a snapshot while the memory
is still in place; ``release`` frees it. Until ``release`` nothing is lost,
so a failure or a vanished client rolls back to ``running``. ``asleep`` is the
one state that outlives its client: it holds a verified snapshot and only a
``restore`` (from any later client) leaves it.

A restore may bring back only some regions (vLLM's deferred wake: weights now,
KV cache later). That is ``restore_part``: the process stays ``asleep``, with
fewer regions pending, until a restore that leaves nothing pending moves it to
``quiesced``. :func:`plan_restore` is that rule.

Some processes are put to sleep by a program inside them rather than by a
hibernate client: a vLLM worker sleeps when its server's ``/sleep`` asks it to,
so that its scheduler has stopped first. Such a process names a *sleep driver*;
a client's ``quiesce`` is then refused (a restore, which only brings memory
back, is still allowed, for recovery). A client that drives such a process
from outside (``hibernate sleep`` on a vLLM server) therefore watches it
instead: ``status`` shows the bytes moved by a transfer in progress
(``transfer``) and what the last sleep or wake the process ran itself did
(``last_operation``).

Requests in flight through a proxy hold the process awake with *leases*
(:mod:`hibernate.agent.leases`): a quiesce first closes their gate and waits
for them, and a lease is granted only while the process runs.

One client at a time owns the agent (a *session*); another gets a BusyError
naming the owner. Operations run on the owner's thread; the client's liveness
is polled through ``Session.cancelled`` so a killed client aborts a spill.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hibernate import faults, procinfo
from hibernate.agent.crash import recording_crashes
from hibernate.agent.guard import Guard
from hibernate.agent.leases import Leases
from hibernate.agent.wire import AgentState, AgentStatus, TransferArgs
from hibernate.environ import KEEP_STAGING_ENV, env_mib
from hibernate.errors import (
    AddressesWouldMoveError,
    BusyError,
    HibernateError,
    UnsupportedError,
    UsageError,
    WrongStateError,
)
from hibernate.pools.base import Contents, Pool, SpillableRegion, device_bytes
from hibernate.pools.capture import live_graphs
from hibernate.pools.device import free_device_bytes, torch_in_process
from hibernate.pools.graphs import MOVES_HINT
from hibernate.pools.provided import no_room, shortfalls
from hibernate.procinfo import ProcessIdentity
from hibernate.store.directio import KeptStaging
from hibernate.store.layout import SpillRoot, open_spill_root_in
from hibernate.store.manifest import RememberedManifest, WrittenRecords
from hibernate.store.options import WriteOptions
from hibernate.store.owner import Owner
from hibernate.store.reader import Discard, SnapshotReader, verify_snapshot
from hibernate.store.reuse import ReuseSource
from hibernate.store.writer import write_snapshot
from hibernate.version import __version__

_TRANSITIONS: dict[str, tuple[frozenset[AgentState], AgentState]] = {
    "quiesce": (frozenset({AgentState.RUNNING}), AgentState.QUIESCED),
    "spill": (frozenset({AgentState.QUIESCED}), AgentState.SPILLED),
    "release": (frozenset({AgentState.SPILLED}), AgentState.ASLEEP),
    "restore": (frozenset({AgentState.ASLEEP}), AgentState.QUIESCED),
    "restore_part": (frozenset({AgentState.ASLEEP}), AgentState.ASLEEP),
    "resume": (
        frozenset({AgentState.QUIESCED, AgentState.SPILLED, AgentState.RUNNING}),
        AgentState.RUNNING,
    ),
}

# How long a new session waits for one whose client has gone to be wound up (see Agent.begin).
GONE_OWNER_WAIT_S = 10.0

# A fault point at the start of each transition (a partial restore is a restore).
AGENT_POINTS = tuple(dict.fromkeys(f"agent.{op.removesuffix('_part')}" for op in _TRANSITIONS))

# States a vanished client leaves behind are rolled back to running; asleep stays.
ROLLED_BACK_ON_DISCONNECT = frozenset({AgentState.QUIESCED, AgentState.SPILLED})


def next_state(op: str, state: AgentState) -> AgentState:
    """The state after ``op`` from ``state``; WrongStateError if ``op`` is not allowed there."""
    allowed, target = _TRANSITIONS[op]
    if state not in allowed:
        if state is AgentState.ASLEEP:
            raise WrongStateError("the process is already asleep", hint="wake it first")
        if op in ("restore", "restore_part"):
            raise WrongStateError(f"the process is not asleep (it is {state.value})")
        raise WrongStateError(f"cannot {op} while the process is {state.value}")
    return target


def plan_restore(pending: Sequence[bool], wanted: Sequence[bool]) -> tuple[list[int], str]:
    """Which regions a restore brings back now, and the transition it makes.

    ``pending[i]``: region i is still released; ``wanted[i]``: the caller asks
    for it. The regions both pending and wanted come back; the op is
    ``restore`` (asleep -> quiesced) when no pending region is left behind,
    else ``restore_part`` (the process stays asleep).
    """
    if len(pending) != len(wanted):
        raise ValueError("pending and wanted must describe the same regions")
    now = [i for i, (p, w) in enumerate(zip(pending, wanted, strict=True)) if p and w]
    left_behind = any(p and not w for p, w in zip(pending, wanted, strict=True))
    return now, "restore_part" if left_behind else "restore"


@dataclass(frozen=True)
class SleepDriver:
    """A program inside the process that puts its memory to sleep (see the module docstring)."""

    name: str  # the kind of target its process is (hibernate.operation.registry.kind_of)
    hint: str  # how to put this process to sleep instead
    checkpoints_itself: bool = False  # its CUDA state is checkpointed by a helper of its own


def refuse_client_sleep(driver: SleepDriver | None, in_process: bool, pid: int) -> None:
    """A client may start a sleep unless the process has a driver and the caller is not it."""
    if driver is not None and not in_process:
        raise UnsupportedError(
            f"process {pid} is put to sleep by {driver.name} from inside, not by a hibernate client; "
            "nothing was changed",
            hint=driver.hint,
        )


@dataclass(eq=False)  # a session is itself: hashed and compared by identity
class Session:
    """Whoever drives the agent now: a socket client or the process itself (``in_process``)."""

    description: str
    cancelled: Callable[[], bool] = field(default=lambda: False)
    peer: str = ""  # "pid P, uid U" of a socket client: how its leases are named
    progress: Callable[[dict[str, Any]], None] | None = None
    in_process: bool = False


@dataclass
class _Sleep:
    """What a sleep left behind for the wake: the regions and where their bytes are."""

    regions: list[tuple[Pool, list[SpillableRegion]]]
    root: Path
    snapshot: str
    # What the sleep wrote of the kept regions: the wake compares the snapshot with it (check_matches).
    written: WrittenRecords | None = None
    remembered: RememberedManifest | None = None  # the manifest it published, known again unparsed
    restored: set[int] = field(default_factory=set)  # indices into all_regions a partial restore brought back
    _contents: list[Contents] | None = field(default=None, init=False, repr=False)

    @property
    def all_regions(self) -> list[SpillableRegion]:
        return [r for _, regions in self.regions for r in regions]

    def contents(self) -> list[Contents]:
        """What a status shows of the regions asleep, counted once: they do not change until the wake,
        and each command asks ``status`` twice (a second of a million tensors each time)."""
        if self._contents is None:
            self._contents = [Contents.of(pool.name, regions) for pool, regions in self.regions]
        return self._contents

    @property
    def kept(self) -> list[SpillableRegion]:
        return [r for r in self.all_regions if r.keep]

    def pending(self) -> list[bool]:
        return [i not in self.restored for i in range(len(self.all_regions))]


def _device_totals(counted: Sequence[Contents]) -> dict[str, int]:
    """The bytes of every pool counted on each CUDA device, all pools together."""
    totals: dict[str, int] = {}
    for content in counted:
        for device, nbytes in content.device_bytes.items():
            totals[device] = totals.get(device, 0) + nbytes
    return totals


def refuse_moves(pools: Sequence[Pool], allowed: bool) -> list[str]:
    """Refuse a sleep that would move memory captured CUDA graphs may read (hibernate.pools.graphs).

    Asked of the regions just enumerated, before a byte is written. With
    ``allowed`` (the program captures its graphs again after each wake) the
    reasons become the sleep's warnings instead.
    """
    reasons = [reason for pool in pools if (reason := pool.moves_refusal()) is not None]
    if reasons and not allowed:
        raise AddressesWouldMoveError("; ".join(reasons), hint=MOVES_HINT)
    return [f"{reason.removesuffix('. Nothing was changed')} (allowed: --allow-moves)" for reason in reasons]


def write_options(args: dict[str, Any]) -> WriteOptions:
    """The store's options of a spill or restore, from its arguments (``reuse``: in-process callers
    only, no client sends it)."""
    mib = 1 << 20
    transfer = TransferArgs.from_wire(args)
    keep_mb = transfer.keep_staging_mb
    if keep_mb is None:  # the process's own setting, then nothing kept
        keep_mb = env_mib(os.environ, KEEP_STAGING_ENV) or 0
    try:
        return WriteOptions(
            buffer_bytes=transfer.buffer_mb * mib,
            chunk_bytes=transfer.chunk_mb * mib,
            io_mode=transfer.io_mode,
            reuse=bool(args.get("reuse", True)),
            check_reuse=not transfer.skip_reuse_check,
            verify=transfer.verify,
            stage_threads=transfer.io_workers,
            io_threads=transfer.io_depth,
            keep_staging_bytes=keep_mb * mib,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


PREPARING_PULSE_S = 0.5  # see Agent._preparing


def _draw_token() -> str:
    """The random part of a spill root's name (store.owner.spill_root_name)."""
    return secrets.token_hex(6)


class Agent:
    def __init__(self, identity: ProcessIdentity, name: str | None = None, runtime: str = "torch") -> None:
        self.identity = identity
        self.name = name or f"proc-{identity.pid}"
        self.owner = Owner.current()
        self.runtime = runtime  # what the program runs on ("torch", "vllm"): the status's "kind"
        self.guard = Guard()
        self.leases = Leases()
        self.token = secrets.token_hex(8)
        # Staging kept from one sleep or wake to the next (page-locked where there is device memory),
        # within each one's bound (0 unless asked: --keep-staging-mb, HIBERNATE_KEEP_STAGING_MB).
        self.kept_staging = KeptStaging()
        # The random part of this process's spill root names (see store.owner.spill_root_name):
        # drawn once, so every sleep of the process finds its previous snapshot again; a --to where
        # that name was taken by someone else gets a name of its own, remembered here.
        self.root_token = _draw_token()
        self._root_tokens: dict[Path, str] = {}
        self._pools: list[Pool] = []
        self._mutex = threading.Lock()
        self._owner: Session | None = None
        self._owner_changed = threading.Condition(self._mutex)
        self.gone_owner_wait_s = GONE_OWNER_WAIT_S
        self._state = AgentState.RUNNING
        self._sleep: _Sleep | None = None
        self._last_snapshot: dict[str, Any] | None = None
        # What the next sleep's reuse needs of the snapshot the last wake read (not its keys or
        # meta), and its root: that sleep need not parse the manifest again. Held while awake
        # only: a sleep drops it.
        self._known: tuple[Path, ReuseSource] | None = None
        self.default_dir: Path | None = None
        self.sleep_driver: SleepDriver | None = None
        self._transfer: dict[str, Any] | None = None  # the newest progress of a spill or restore
        self._last_operation: dict[str, Any] | None = None  # the report of the newest sleep_here/wake_here
        self.signals_configured = False  # hibernate-on-signal handlers, once per process
        self.crash_record: Path | None = None  # where a restore's fatal signal is named (agent/crash.py)
        # Why a client may not bring this process's memory back now (None: it may), asked by each
        # client restore and shown in status: a sleep driver whose own wake must rebuild state
        # first (vLLM's communicators across GPUs) says so here.
        self.restore_refusal: Callable[[], HibernateError | None] | None = None
        # A CUDA device's free memory now (None: unknown), read before a restore maps anything back.
        self.free_device_memory: Callable[[int], int | None] = free_device_bytes

    # -- pools ---------------------------------------------------------------

    def add_pool(self, pool: Pool) -> None:
        with self._mutex:
            if pool not in self._pools:
                self._pools.append(pool)

    def pool(self, name: str) -> Pool | None:
        with self._mutex:
            return next((p for p in self._pools if p.name == name), None)

    def pools(self) -> list[Pool]:
        with self._mutex:
            return list(self._pools)

    # -- state ---------------------------------------------------------------

    @property
    def state(self) -> AgentState:
        with self._mutex:
            return self._state

    def status(self, contents: bool = True) -> dict[str, Any]:
        """The agent's status; without ``contents``, its pools and their bytes on each device are left
        out (absent keys, as an older agent's: every reader takes them as unknown), which spares a
        walk of every tracked tensor where the asker does not read them."""
        with self._mutex:
            pools = list(self._pools)
            sleeping = self._sleep
            state = self._state
            owner = self._owner.description if self._owner else None
            snapshot = dict(self._last_snapshot) if self._last_snapshot else None
            transfer = dict(self._transfer) if self._transfer else None
            last_operation = self._last_operation
        leases = self.leases.summary()
        summaries: list[dict[str, Any]] = []
        # Asleep: the regions the sleep enumerated; running: each pool as it is now, counted
        # without building its regions (a sleep builds them once, when it starts).
        counted: list[Contents] = []
        if contents and sleeping:
            counted = sleeping.contents()
        elif contents:
            counted = [pool.contents() for pool in pools]
        for content in counted:
            summaries.extend(s.to_wire() for s in content.summaries)
        on_devices = _device_totals(counted)
        refusal = self._restore_refused()
        return AgentStatus(
            version=__version__,
            pid=self.identity.pid,
            start_time=self.identity.start_time,
            pid_namespace=procinfo.pid_namespace(),
            uid=os.getuid(),
            name=self.name,
            runtime=self.runtime,
            state=state,
            busy=owner,
            guard_holders=self.guard.holders,
            leases=leases,
            pools=tuple(summaries),
            device_bytes=on_devices,
            snapshot=snapshot,
            default_dir=str(self.default_dir) if self.default_dir else None,
            sleep_driver=self.sleep_driver.name if self.sleep_driver else None,
            self_checkpoint=bool(self.sleep_driver and self.sleep_driver.checkpoints_itself),
            transfer=transfer,
            last_operation=last_operation,
            restore_refusal=refusal.message if refusal else None,
            torch=torch_in_process(),  # version, CUDA, and what its build costs (doctor's "torch" check)
            graphs=tuple(graph.to_wire() for graph in live_graphs()),  # seen since the first track/pool
            absent=frozenset() if contents else frozenset({"pools", "device_bytes"}),
        ).to_wire()

    def configure(self, directory: Path | None) -> dict[str, Any]:
        """Where later sleeps spill when they are not told (a driven process's own sleeps)."""
        self.default_dir = directory
        return self.status()

    # -- sessions ------------------------------------------------------------

    def begin(self, session: Session) -> None:
        """Own the agent, or BusyError naming its owner.

        An owner whose client is gone (its socket closed: the command exited) is waited for, up to
        ``gone_owner_wait_s``: its connection thread is winding its session up (rolling back what was
        half done) and the next command, run right after, must not be told the agent is busy.
        """
        with self._owner_changed:
            owner = self._owner
            if owner is not None and owner is not session and owner.cancelled():
                self._owner_changed.wait_for(lambda: self._owner is not owner, self.gone_owner_wait_s)
            if self._owner is not None and self._owner is not session:
                raise BusyError(
                    f"process {self.identity.pid} is busy: {self._owner.description} is operating on it",
                    hint="wait for it to finish, then retry",
                )
            self._owner = session

    def end(self, session: Session) -> None:
        """Give up ownership; a half-done sleep or wake is rolled back to running."""
        with self._mutex:
            owned, state = self._owner is session, self._state
        if not owned:
            self.leases.reopen(session)  # (not under the mutex: leases take it after their own lock)
            return
        try:
            if state in ROLLED_BACK_ON_DISCONNECT:
                self._transition(session, "resume", self._do_resume)
        finally:
            self.leases.reopen(session)
            with self._owner_changed:
                self._owner = None
                self._owner_changed.notify_all()

    def disconnect(self, session: Session) -> None:
        """A client's connection ended: its leases are given back, then its session ends."""
        self.leases.drop(session)
        self.end(session)

    # -- leases --------------------------------------------------------------

    def lease(self, session: Session, by: str | None = None) -> dict[str, Any]:
        """One more request of ``session``'s client holds the process awake, if it runs and no sleep
        waits; else the answer says why (``reason``: asleep, busy or closed)."""

        def refusal() -> dict[str, Any] | None:
            with self._mutex:
                state, owner = self._state, self._owner
            if state is AgentState.RUNNING:
                return None
            if state is AgentState.ASLEEP and owner is None:
                return {"reason": "asleep", "state": state.value}
            return {"reason": "busy", "state": state.value, "by": [owner.description] if owner else []}

        description = f"{by} ({session.peer})" if by and session.peer else session.description
        return self.leases.take(session, description, refusal)

    def unlease(self, session: Session) -> dict[str, Any]:
        return {"held": self.leases.give_back(session)}

    def close_leases(self, session: Session, timeout: float) -> dict[str, Any]:
        """Refuse new leases until ``session`` resumes the process or ends, and wait (up to ``timeout``)
        for those held to be given back; BusyError naming their holders if they are not."""
        what = f"process {self.identity.pid}"
        seconds = self.leases.close(session, session.description, what, timeout, session.cancelled)
        return {"seconds": seconds}

    def _transition(self, session: Session, op: str, action: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        with self._mutex:
            if self._owner is not session:
                raise BusyError(f"operation {op!r} requires owning the agent; begin a session first")
            target = next_state(op, self._state)
        faults.point(f"agent.{op.removesuffix('_part')}")
        started = time.perf_counter()
        result = action()
        # The whole step in this process (a restore's matching, re-allocation and zero-filling
        # around the store's reads, a spill's enumeration around its writes): what a report's
        # times and GB/s are computed from. The store's own transfer time is "io_seconds".
        result["seconds"] = time.perf_counter() - started
        with self._mutex:
            self._state = target
        return result

    # -- operations ----------------------------------------------------------

    def quiesce(self, session: Session, timeout: float) -> dict[str, Any]:
        refuse_client_sleep(self.sleep_driver, session.in_process, self.identity.pid)

        def action() -> dict[str, Any]:
            started = time.perf_counter()
            try:
                self.close_leases(session, timeout)  # at once after a flow's own leases step
                self.guard.close(timeout, session.cancelled)
            except BaseException:
                self.leases.reopen(session)
                raise
            return {"seconds": time.perf_counter() - started}

        return self._transition(session, "quiesce", action)

    def spill(self, session: Session, directory: Path | None, args: dict[str, Any]) -> dict[str, Any]:
        options = write_options(args)

        def action() -> dict[str, Any]:
            base = directory or self.default_dir
            if base is None:
                raise UsageError("no snapshot directory given", hint="pass --to DIR")
            with self._mutex:
                pools = list(self._pools)
            regions = [(pool, list(pool.regions())) for pool in pools]
            moves = refuse_moves(pools, bool(args.get("allow_moves", False)))
            for pool in pools:
                pool.synchronize()  # work the program queued on any stream lands before a byte is read
            base = Path(os.path.abspath(base))
            opened, token = open_spill_root_in(
                base, self.name, self._root_tokens.get(base, self.root_token), self.owner, _draw_token
            )
            self._root_tokens[base] = token
            sleeping = _Sleep(regions, opened.path, "")
            pin = next((p for p in (pool.pinner() for pool in pools) if p is not None), None)
            with self._mutex:
                known, self._known = self._known, None
            with opened as root:
                with self.kept_staging.bracket(options.keep_staging_bytes) as kept_staging:
                    result = write_snapshot(
                        root,
                        sleeping.kept,
                        producer={
                            "pid": self.identity.pid,
                            "start_time": self.identity.start_time,
                            "agent_token": self.token,
                            "agent": self.name,
                            "hibernate": __version__,
                        },
                        options=options,
                        progress=self._reporter(session, "spill"),
                        cancelled=session.cancelled,
                        pin=pin,
                        known=known[1] if known is not None and known[0] == sleeping.root else None,
                        kept=self.kept_staging,
                    )
                del known
                verified = (
                    verify_snapshot(
                        root, result.snapshot, io_mode=options.io_mode, buffer_bytes=options.buffer_bytes
                    )
                    if options.verify
                    else None
                )
            sleeping.snapshot = result.snapshot
            sleeping.written = WrittenRecords.of(result.manifest.columns)
            sleeping.remembered = RememberedManifest(result.manifest_digest, result.manifest)
            with self._mutex:
                self._sleep = sleeping
                self._last_snapshot = {
                    "dir": str(sleeping.root),
                    "snapshot": result.snapshot,
                    "path": str(result.path),
                }
            report = result.to_wire()
            report["io_seconds"] = report.pop("seconds")
            report["kept_staging"] = kept_staging
            if verified is not None:
                report["verify_seconds"] = round(verified.seconds, 6)
            # Counted once, for the report and for every status until the wake (see _Sleep.contents).
            counted = sleeping.contents()
            report["pools"] = [s.to_wire() for content in counted for s in content.summaries]
            # What the regions hold on each CUDA device: the command's account of the memory given
            # back, which a hello that left the pools out (a sleep's) did not say.
            report["device_bytes"] = _device_totals(counted)
            report["dropped_bytes"] = sum(r.nbytes for r in sleeping.all_regions if not r.keep)
            # The store's (reused chunks rewritten or left unread, files not linked), then the pools'.
            report["warnings"] = [
                *result.warnings,
                *(warning for pool in pools for warning in pool.warnings()),
                *moves,
            ]
            return report

        return self._transition(session, "spill", action)

    def release(self, session: Session) -> dict[str, Any]:
        def action() -> dict[str, Any]:
            sleeping = self._require_sleep()
            rss_before = procinfo.resident_bytes(os.getpid())
            started = time.perf_counter()
            try:
                for region in sleeping.all_regions:
                    region.release()
                for pool, _ in sleeping.regions:
                    pool.after_release()
            except BaseException:
                # Memory the release just gave back: no room check of the agent's (a pool's own, which
                # keeps its provider from ending the process, still runs). A dropped region is
                # zero-filled only where its memory went: one the failure came before keeps its bytes.
                regions = sleeping.all_regions
                lost = {i for i, region in enumerate(regions) if not region.keep and region.released}
                self._refill(sleeping, session, {}, range(len(regions)), check_room=False, zero=lost)
                raise
            resident = sum(r.resident_after_release for r in sleeping.all_regions)
            return {
                "released_bytes": sum(r.nbytes for r in sleeping.all_regions) - resident,
                "resident_bytes": resident,
                "rss_before": rss_before,
                "rss_after": procinfo.resident_bytes(os.getpid()),
                "seconds": time.perf_counter() - started,
            }

        return self._transition(session, "release", action)

    def restore(
        self,
        session: Session,
        args: dict[str, Any],
        wanted: Callable[[SpillableRegion], bool] | None = None,
    ) -> dict[str, Any]:
        """Bring back the pending regions ``wanted`` selects (all by default); see plan_restore.

        A client's restore is refused while the sleep driver says its own wake
        must come first (``restore_refusal``); the process's own wake is not.
        """
        refusal = None if session.in_process else self._restore_refused()
        if refusal is not None:
            raise refusal
        with self._mutex:
            sleeping = self._sleep
        indices: list[int] = []
        op = "restore"
        if sleeping is not None:
            regions = sleeping.all_regions
            indices, op = plan_restore(sleeping.pending(), [wanted is None or wanted(r) for r in regions])

        def action() -> dict[str, Any]:
            sleeping = self._require_sleep()
            rss_before = procinfo.resident_bytes(os.getpid())
            report = self._refill(sleeping, session, args, indices)
            sleeping.restored.update(indices)
            report["rss_before"] = rss_before
            report["rss_after"] = procinfo.resident_bytes(os.getpid())
            report["complete"] = op == "restore"
            return report

        with recording_crashes(self.crash_record):
            return self._transition(session, op, action)

    def _refill(
        self,
        sleeping: _Sleep,
        session: Session,
        args: dict[str, Any],
        indices: Sequence[int],
        check_room: bool = True,
        zero: Collection[int] | None = None,
    ) -> dict[str, Any]:
        """Memory and bytes back for the regions at ``indices``, verified.

        On any failure those regions are released again (the process stays
        asleep); regions an earlier partial restore brought back are left alone,
        since the program may have changed them since.
        """
        options = write_options(args)
        regions = sleeping.all_regions
        chosen = [regions[i] for i in indices]
        if check_room:
            self._refuse_without_room(chosen)
        fill = {i for i in indices if regions[i].keep}
        # The reader walks every record; those not chosen now are read, verified and skipped.
        targets: list[Any] = [r if i in fill else Discard(r) for i, r in enumerate(regions) if r.keep]
        preparing = self._preparing(session, "restore", sum(r.nbytes for r in targets))
        with contextlib.ExitStack() as stack:
            reader: SnapshotReader | None = None
            if fill:  # refuse what can be found wrong before any memory is touched
                root = stack.enter_context(
                    SpillRoot(sleeping.root, owner=self.owner, remembered=sleeping.remembered)
                )
                reader = stack.enter_context(SnapshotReader(root, sleeping.snapshot, io_mode=options.io_mode))
                preparing()
                reader.check_matches(targets, written=sleeping.written)
            try:
                for region in chosen:
                    region.reallocate()
                    preparing()
                if reader is not None:
                    pin = next(
                        (p for p in (pool.pinner() for pool, _ in sleeping.regions) if p is not None),
                        None,
                    )
                    with self.kept_staging.bracket(options.keep_staging_bytes) as kept_staging:
                        report = reader.read_into(
                            targets,
                            buffer_bytes=options.buffer_bytes,
                            threads=options.stage_threads,
                            io_depth=options.io_threads,
                            progress=self._reporter(session, "restore"),
                            cancelled=session.cancelled,
                            pin=pin,
                            kept=self.kept_staging,
                        ).to_wire()
                    report["io_seconds"] = report.pop("seconds")
                    report["kept_staging"] = kept_staging
                else:
                    with self.kept_staging.bracket(options.keep_staging_bytes) as kept_staging:
                        pass  # nothing to read: the bound applies all the same (0 gives it back)
                    report = {
                        "snapshot": sleeping.snapshot,
                        "total_bytes": 0,
                        "io_seconds": 0.0,
                        "io_mode": None,
                        "staging_bytes": 0,
                        "kept_staging": kept_staging,
                    }
                for index in indices:
                    if not regions[index].keep and (zero is None or index in zero):
                        regions[index].zero()
                for pool, _ in sleeping.regions:
                    pool.synchronize()  # the fills are on the device before the program runs again
            except BaseException:
                for region in chosen:
                    region.release()
                for pool, _ in sleeping.regions:
                    pool.after_release()
                raise
            if reader is not None:
                with self._mutex:
                    self._known = (sleeping.root, ReuseSource.of(reader.manifest))
        report["zeroed_bytes"] = sum(r.nbytes for r in chosen if not r.keep)
        report["restored_regions"] = len(chosen)
        return report

    def _refuse_without_room(self, regions: Sequence[SpillableRegion]) -> None:
        """Refuse a restore, before anything is mapped, that the GPUs' free memory cannot take.

        Every pool's device bytes count (tracked storages, hibernate.pool's
        allocations, vLLM's), per device, with the headroom a program needs to
        run its first kernels: a provider that runs out half-way may end the
        process (torch_memory_saver does), and a half-restored process is
        worse than one still asleep.
        """
        need: dict[int, int] = {}
        for device, nbytes in device_bytes(regions).items():
            index = int(device.partition(":")[2] or 0)
            need[index] = need.get(index, 0) + nbytes
        short = shortfalls(need, self.free_device_memory)
        if short:
            raise no_room(short, "this process's memory")

    def resume(self, session: Session) -> dict[str, Any]:
        result = self._transition(session, "resume", self._do_resume)
        self.leases.reopen(session)
        return result

    def _do_resume(self) -> dict[str, Any]:
        with self._mutex:
            if self._state is AgentState.ASLEEP:
                raise WrongStateError("the process is asleep; restore before resuming")
            self._sleep = None
        self.guard.open()
        return {}

    def _restore_refused(self) -> HibernateError | None:
        return self.restore_refusal() if self.restore_refusal is not None else None

    def _require_sleep(self) -> _Sleep:
        with self._mutex:
            if self._sleep is None:
                raise WrongStateError("no snapshot was taken in this sleep")
            return self._sleep

    # -- the in-process API (hibernate.sleep / hibernate.wake) -----------------

    def sleep_here(self, directory: Path | None, timeout: float, args: dict[str, Any]) -> dict[str, Any]:
        session = Session(f"this process (pid {self.identity.pid})", in_process=True)
        self.begin(session)
        try:
            report = {"quiesce": self.quiesce(session, timeout)}
            report["spill"] = self.spill(session, directory, args)
            report["release"] = self.release(session)
            self._remember("sleep", report)
            return report
        finally:
            self.end(session)

    def wake_here(
        self, args: dict[str, Any], wanted: Callable[[SpillableRegion], bool] | None = None
    ) -> dict[str, Any]:
        """Restore (the ``wanted`` regions, default all) and resume once nothing is pending."""
        session = Session(f"this process (pid {self.identity.pid})", in_process=True)
        self.begin(session)
        try:
            report = {"restore": self.restore(session, args, wanted)}
            if self.state is AgentState.QUIESCED:
                report["resume"] = self.resume(session)
            self._remember("wake", report)
            return report
        finally:
            self.end(session)

    def add_warnings(self, step: str, warnings: list[str]) -> None:
        """Add what the caller of sleep_here/wake_here met around it to that operation's ``step`` answer.

        The vLLM backend's own pool meets some things (an allocation vLLM freed
        while it slept) outside the agent's steps; a client watching from
        outside reads the last operation, so they are kept there too.
        """
        if not warnings:
            return
        with self._mutex:
            if self._last_operation is not None:
                answer = dict(self._last_operation.get(step) or {})  # the caller's report stays its own
                answer["warnings"] = [*answer.get("warnings", []), *warnings]
                self._last_operation[step] = answer

    def _remember(self, op: str, report: dict[str, Any]) -> None:
        """Keep what an in-process sleep or wake did, for a client watching from outside."""
        with self._mutex:
            self._last_operation = {"op": op, "finished_unix": time.time(), **report}

    # -- progress ------------------------------------------------------------

    def _preparing(self, session: Session, step: str, total: int) -> Callable[[], None]:
        """A pulse for the work before a transfer's first byte: called as that work advances, it
        reports no bytes moved yet, at most every half second.

        A wake of a million tensors parses its manifest and maps a million storages back before it
        reads: seconds in which a client, which bounds the agent's silence, would hear nothing. The
        pulse comes from the work itself, so an agent stuck in it still falls silent.
        """
        report = self._reporter(session, step)
        last = [time.monotonic()]

        def pulse() -> None:
            now = time.monotonic()
            if now - last[0] >= PREPARING_PULSE_S:
                last[0] = now
                report(0, total)

        return pulse

    def _reporter(self, session: Session, step: str) -> Callable[[int, int], None]:
        """Progress of a transfer: kept for ``status`` (whoever drives it), sent to the session's client.

        A client that did not start the transfer (one watching a vLLM worker
        sleep through its server) judges whether it still moves by ``status``.
        """
        forward = _progress_reporter(session, step)

        def report(done: int, total: int) -> None:
            with self._mutex:
                self._transfer = {"phase": step, "done": done, "total": total, "unix": time.time()}
            if forward is not None:
                forward(done, total)

        return report


def _progress_reporter(session: Session, step: str) -> Callable[[int, int], None] | None:
    if session.progress is None:
        return None
    emit = session.progress
    last = [0.0]

    def report(done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total or now - last[0] >= 0.1:
            last[0] = now
            emit({"phase": step, "done": done, "total": total})  # "phase": the wire's word for the step

    return report


def describe_error(exc: BaseException) -> HibernateError:
    """Any exception as a HibernateError, for the wire."""
    if isinstance(exc, HibernateError):
        return exc
    return HibernateError(f"{type(exc).__name__}: {exc}")
