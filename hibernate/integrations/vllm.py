"""hibernate as a vLLM sleep-mode backend: ``--sleep-mode-backend hibernate``.

vLLM 0.33 lets a plugin add a sleep-mode backend (RFC #34303). Its own
``cumem`` backend keeps a pinned host copy of the weights (level 1) or throws
them away (level 2). This one streams what must survive to a snapshot
directory through the store's bounded staging (never a whole host copy),
releases the physical memory with vLLM's own extension while the virtual
addresses stay reserved, and on wake maps it back at the same addresses and
reads it back verified. Nothing is torn down, so communicators, compiled
kernels and CUDA graphs stay valid.

How it is wired:

* :func:`register` is the ``vllm.general_plugins`` entry point. vLLM calls it in
  every process it starts (API server, engine core, workers), possibly more than
  once. It registers the backend with ``SleepModeBackendFactory`` and starts this
  process's hibernate agent (kind ``vllm``) so ``hibernate ls`` shows the server
  and its workers. Workers forked from a process that already loaded plugins do
  not run plugins again, so it also starts the agent again after a fork.
* vLLM creates :class:`HibernateBackend` in each worker, lazily, at the first
  sleep. The backend drives this process's :class:`~hibernate.agent.controller.Agent`
  (quiesce, spill, release; restore, resume) over a
  :class:`~hibernate.pools.vllm.CuMemPool`, rather than a state machine of its own.
* A hibernate client cannot start a sleep of a vLLM process itself: the worker's
  scheduler must stop first, which only the server's ``/sleep`` does. So
  ``hibernate sleep PID`` on a vLLM server sets where the spill goes (agent op
  ``configure``), asks the server's ``/sleep``, watches the workers' agents and
  then takes the CUDA state off the GPU from outside
  (:mod:`hibernate.flows.vllm`).
* With ``HIBERNATE_SELF_CHECKPOINT=1`` a worker does that last step itself,
  through a helper process of its own, so plain ``/sleep`` and ``/wake_up``
  give the full hibernation (:mod:`hibernate.integrations.self_checkpoint`).

With more than one GPU (a world of several workers), vLLM's all-reduce and
all-to-all workspaces live in memory shared across processes (CUDA IPC,
multicast), which no CUDA checkpoint can take. vLLM 0.33 tears FlashInfer's
down with ``checkpoint_prepare_distributed_state()`` and builds them again
with ``checkpoint_restore_distributed_state()``, both collectives: the backend
calls the first at the end of ``suspend`` and the second in ``resume`` right
after the CUDA state is back, where every worker is inside the same call
(with ``--enable-nccl-comm-suspend`` vLLM's own sleep and wake do it, and the
backend leaves it to them). The workers vote, with a bounded wait, wherever
one's failure must stop the others (the vote and the rules of that state are
:mod:`.vllm_distributed`; the backend's hooks that call them are here); while
the workspaces are down the agent refuses a client's restore, since only
vLLM's wake rebuilds them. A world wider than one engine (data
parallelism) is refused. An older vLLM has neither function: the sleep says
so in its warnings and goes on.

Where the spill goes: the directory a hibernate client configured on the
agent, else ``$HIBERNATE_DIR``, else ``$XDG_CACHE_HOME/hibernate`` (default
``~/.cache/hibernate``); under it, one directory per worker,
``vllm-rank<R>-pid<PID>``. The pid is part of the name because a snapshot is
only good for the process that wrote it, and two servers sharing a directory
must never retire each other's snapshots.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from vllm.device_allocator.sleep_mode_backend import SleepModeBackend, SleepModeState

from hibernate.agent.controller import Agent, AgentState, SleepDriver, write_options
from hibernate.agent.local import local_agent, unserved_reason
from hibernate.environ import KEEP_STAGING_ENV, SKIP_REUSE_CHECK_ENV, env_flag, env_mib
from hibernate.errors import (
    AbortedError,
    CudaCheckpointError,
    HibernateError,
    NeedsRecoveryError,
    UnsupportedError,
    UsageError,
)
from hibernate.integrations import VLLM_KIND
from hibernate.integrations.self_checkpoint import Helper, HelperProcess, SelfCheckpointer
from hibernate.integrations.vllm_distributed import (
    MISSING_DISTRIBUTED_CHECKPOINT,
    PREPARED_HINT,
    PREPARED_REFUSAL,
    RESTART_HINT,
    DistributedCheckpoint,
    comm_suspend_of,
    describe_failed,
    distributed_checkpoint,
    engine_size,
    failure_words,
    loaded_parallel_state,
    multi_engine_refusal,
    peer_timeout,
    world_size_of,
)
from hibernate.pools.device import DeviceMemory
from hibernate.pools.vllm import (
    CUMEM_MODULE,
    AllocatorLike,
    CuMemPool,
    check_level,
    default_device,
    live_allocator,
    require_allocator,
    wakes,
)

# vLLM's logging configuration covers the ``vllm`` logger tree; a child of it
# puts our lines in the server's log, formatted like vLLM's own.
log = logging.getLogger("vllm.hibernate")

BACKEND_NAME = "hibernate"
AGENT_RUNTIME = "vllm"  # what this agent says it runs on (the wire key `kind`; Agent.runtime in the agent)
DIR_ENV = "HIBERNATE_DIR"
SELF_CHECKPOINT_ENV = "HIBERNATE_SELF_CHECKPOINT"
BUFFER_ENV = "HIBERNATE_BUFFER_MB"
CHUNK_ENV = "HIBERNATE_CHUNK_MB"
VERIFY_ENV = "HIBERNATE_VERIFY"  # 1: read each snapshot back before its memory is released
QUIESCE_TIMEOUT_S = 30.0
DEFAULT_DEFERRABLE_TAGS = ("weights", "kv_cache")

_DRIVER_HINT = (
    "`hibernate sleep PID --to DIR` asks the vLLM server to sleep and then checkpoints its CUDA state; "
    "or POST /sleep?level=1 to the server yourself (served with VLLM_SERVER_DEV_MODE=1)"
)
VLLM_DRIVER = SleepDriver(name=VLLM_KIND, hint=_DRIVER_HINT)
VLLM_SELF_CHECKPOINT_DRIVER = SleepDriver(name=VLLM_KIND, hint=_DRIVER_HINT, checkpoints_itself=True)


# -- small pure rules --------------------------------------------------------------


def worker_name(rank: int | None, pid: int) -> str:
    """The agent's name, and its directory under the spill base (see the module docstring)."""
    return f"vllm-pid{pid}" if rank is None else f"vllm-rank{rank}-pid{pid}"


def rank_from(distributed_rank: int | None, environ: Mapping[str, str]) -> int | None:
    """This worker's rank: torch.distributed's when it is up, else ``$RANK``, else unknown."""
    if distributed_rank is not None:
        return distributed_rank
    raw = environ.get("RANK", "").strip()
    return int(raw) if raw.isdigit() else None


def spill_base(configured: Path | None, environ: Mapping[str, str]) -> Path:
    """Where this process's sleeps spill: configured, else ``$HIBERNATE_DIR``, else per-user cache."""
    if configured is not None:
        return configured
    if environ.get(DIR_ENV):
        return Path(environ[DIR_ENV]).expanduser().absolute()
    cache = environ.get("XDG_CACHE_HOME") or os.path.join(environ.get("HOME") or Path.home(), ".cache")
    return Path(cache).expanduser().absolute() / "hibernate"


def staging_args(environ: Mapping[str, str]) -> dict[str, Any]:
    """Staging budget, chunk size, --verify and --skip-reuse-check for spill and restore, from the
    environment, validated."""
    args: dict[str, Any] = {}
    for env, key in ((BUFFER_ENV, "buffer_mb"), (CHUNK_ENV, "chunk_mb")):
        raw = environ.get(env, "").strip()
        if not raw:
            continue
        if not raw.isdigit():
            raise UsageError(f"{env}={raw!r} is not a whole number of MiB")
        args[key] = int(raw)
    if environ.get(VERIFY_ENV, "").strip():
        args["verify"] = env_flag(environ, VERIFY_ENV)
    if environ.get(SKIP_REUSE_CHECK_ENV, "").strip():
        args["skip_reuse_check"] = env_flag(environ, SKIP_REUSE_CHECK_ENV)
    keep = env_mib(environ, KEEP_STAGING_ENV)  # refused here, in its own words, as the others are
    if keep is not None:
        args["keep_staging_mb"] = keep
    try:
        write_options(args)
    except UsageError as exc:
        raise UsageError(f"{BUFFER_ENV}/{CHUNK_ENV}: {exc.message}") from exc
    return args


def self_checkpoint_requested(environ: Mapping[str, str], *, strict: bool = True) -> bool:
    """``HIBERNATE_SELF_CHECKPOINT``: does this worker take its own CUDA state off the GPU after a sleep?

    ``strict=False`` reads an unclear value as no (where raising would stop
    vLLM from starting); the backend reads it strictly and says what is wrong.
    """
    try:
        return env_flag(environ, SELF_CHECKPOINT_ENV)
    except UsageError:
        if strict:
            raise
        return False


# -- this process ------------------------------------------------------------------


def _torch_rank() -> int | None:
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return None


def _adopt(agent: Agent, *, with_pool: bool = True) -> Agent:
    """Mark an agent as a vLLM process's and (by default) give it this process's CuMemAllocator pool."""
    agent.runtime = AGENT_RUNTIME
    agent.sleep_driver = (
        VLLM_SELF_CHECKPOINT_DRIVER if self_checkpoint_requested(os.environ, strict=False) else VLLM_DRIVER
    )
    if with_pool and agent.pool(CuMemPool.name) is None:
        agent.add_pool(CuMemPool())
    return agent


def _process_agent() -> Agent:
    """This process's agent, started (socket included) if it is not yet.

    Without its socket (agent.local.unserved_reason) the backend still works,
    driven by vLLM's own sleep and wake; only hibernate's commands are blind to it.
    """
    agent = local_agent(name=worker_name(None, os.getpid()), runtime=AGENT_RUNTIME)
    unserved = unserved_reason()
    if unserved is not None:
        log.warning(
            "hibernate: control socket not started (%s); `hibernate ls` will not show pid %d",
            unserved,
            os.getpid(),
        )
    return _adopt(agent)


def _vllm_deferrable_tags() -> tuple[str, ...]:
    """The tags vLLM lets a wake defer, from vLLM itself when it says."""
    try:
        from vllm.device_allocator import DEFERRABLE_TAGS
    except ImportError:
        return DEFAULT_DEFERRABLE_TAGS
    return tuple(DEFERRABLE_TAGS)


# -- the plugin --------------------------------------------------------------------

_fork_hook_installed = False


def register() -> None:
    """The ``vllm.general_plugins`` entry point: harmless to call any number of times.

    Never raises: a failure here would stop vLLM from starting at all, while
    without the agent only ``hibernate ls`` is blind (the backend starts the
    agent again when it is created, and reports a real error then).
    """
    global _fork_hook_installed
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    try:
        SleepModeBackendFactory.register_backend(BACKEND_NAME, __name__, HibernateBackend.__name__)
    except ValueError:  # registered before: by us (idempotent), or by someone else
        try:
            ours = SleepModeBackendFactory.get_backend_class(BACKEND_NAME) is HibernateBackend
        except Exception:  # the other registration does not even load
            ours = False
        if not ours:
            log.error("hibernate: another plugin registered a sleep-mode backend named %r", BACKEND_NAME)
            return
    _start_agent_quietly()
    if not _fork_hook_installed:
        # Registered after hibernate.agent's own reset hook, so it runs after it.
        os.register_at_fork(after_in_child=_start_agent_quietly)
        _fork_hook_installed = True


def _start_agent_quietly() -> None:
    try:
        _process_agent()
    except Exception as exc:  # see register(): never stop vLLM for the agent's sake
        log.warning("hibernate: agent not started in pid %d: %s", os.getpid(), exc)


# -- the backend -------------------------------------------------------------------


def _fixed(value: Any) -> Callable[[], Any]:
    return lambda: value


class HibernateBackend(SleepModeBackend):
    """Sleep to disk: level 1 keeps weights and runtime state, level 2 only runtime state.

    vLLM creates it with no arguments; the keyword arguments are for embedding
    and tests (an allocator and device memory of one's own, an agent not the
    process's, a self-checkpoint helper of one's own, vLLM's ``parallel_state``
    module or a stand-in for it).

    With ``HIBERNATE_SELF_CHECKPOINT=1`` the backend starts its helper here
    (vLLM creates the backend at the first sleep, so that sleep fails cleanly,
    before anything is touched, if no checkpointer is available).
    """

    def __init__(
        self,
        *,
        allocator: AllocatorLike | None = None,
        device: DeviceMemory | None = None,
        agent: Agent | None = None,
        environ: Mapping[str, str] | None = None,
        helper: Callable[[], Helper] | None = None,
        parallel_state: Callable[[], Any] = loaded_parallel_state,
    ) -> None:
        super().__init__()
        self._environ: Mapping[str, str] = os.environ if environ is None else environ
        self._args = staging_args(self._environ)
        wants_self_checkpoint = self_checkpoint_requested(self._environ)
        self._deferrable: Collection[str] = _vllm_deferrable_tags()
        self._agent = _adopt(agent, with_pool=False) if agent is not None else _process_agent()
        self._pool = self._attach_pool(allocator, device)
        rank = rank_from(_torch_rank(), self._environ)
        if rank is not None:
            self._agent.name = worker_name(rank, self._agent.identity.pid)
        self._self_checkpoint: SelfCheckpointer | None = None
        if wants_self_checkpoint:
            self._self_checkpoint = SelfCheckpointer((helper or (lambda: HelperProcess(self._environ)))())
            self._agent.sleep_driver = VLLM_SELF_CHECKPOINT_DRIVER
        else:
            self._agent.sleep_driver = VLLM_DRIVER
        self._parallel_state = parallel_state
        self._rank = rank
        self._peer_timeout = peer_timeout(self._environ)
        # Asleep with its peers since the last suspend, their communicators not yet rebuilt.
        self._prepared: DistributedCheckpoint | None = None
        self._distributed_lost: str | None = None  # why the communicators cannot be trusted any more
        self._agent.restore_refusal = self._restore_refusal
        self.last_report: dict[str, Any] = {}

    def _attach_pool(self, allocator: AllocatorLike | None, device: DeviceMemory | None) -> CuMemPool:
        existing = self._agent.pool(CuMemPool.name)
        if allocator is None and device is None and isinstance(existing, CuMemPool):
            return existing
        if existing is not None and (allocator is not None or device is not None):
            raise UsageError("this agent already has a vLLM pool; give the backend an agent of its own")
        pool = CuMemPool(
            allocator=_fixed(allocator) if allocator is not None else live_allocator,
            device=_fixed(device) if device is not None else default_device,
        )
        self._agent.add_pool(pool)
        return pool

    @property
    def agent(self) -> Agent:
        return self._agent

    @property
    def pool(self) -> CuMemPool:
        return self._pool

    def _settled_state(self) -> SleepModeState:
        """SUSPENDED while anything is released (sleeping, partly woken or discarded)."""
        if self._agent.state is AgentState.ASLEEP or self._pool.asleep_tags():
            return "SUSPENDED"
        return "RUNNING"

    # -- SleepModeBackend ------------------------------------------------------

    def _cuda_running(self) -> None:
        """With self-checkpoint: this process's CUDA state restored and unlocked (else nothing to do)."""
        if self._self_checkpoint is not None:
            self._self_checkpoint.wake()

    def suspend(self, level: int = 1) -> None:
        caller = sys._getframe(1)  # vLLM's Worker.sleep: the self-checkpoint waits for it to return
        report: dict[str, Any] = {}
        slept = False
        try:
            distributed = self._distributed_to_prepare(comm_suspend_of(caller.f_locals.get("self")))
            self._ready(distributed, level)
            try:
                self._cuda_running()
                if self._agent.state is AgentState.ASLEEP:
                    # Partly woken (deferred wake) and asked to sleep again, as vLLM allows:
                    # bring the rest back first so the new snapshot holds everything.
                    report["finish_wake"] = self._agent.wake_here(self._args)
                self._pool.set_level(level)
                base = spill_base(self._agent.default_dir, self._environ)
                self._pool.synchronize()
                report.update(self._agent.sleep_here(base, QUIESCE_TIMEOUT_S, self._args))
                slept = True
            except BaseException as exc:
                if distributed is not None:  # the others must not wait for this worker, and learn why
                    self._vote(distributed, failure_words(exc), "whether every sleep succeeded")
                raise
            if distributed is not None:
                self._prepare_distributed(distributed)
        finally:
            self._pool.sleep_notes = []
            report["warnings"] = self._pool_warnings()
            if slept:  # a client reading this sleep from outside (hibernate sleep) sees them too
                self._agent.add_warnings("spill", report["warnings"])
            self._state = self._settled_state()
        self.last_report = report
        if self._self_checkpoint is not None:
            self._self_checkpoint.after_return(caller, threading.get_ident())
        del caller
        spill, release = report["spill"], report["release"]
        for warning in spill.get("warnings", []):
            log.warning("hibernate: %s", warning)
        log.info(
            "hibernate: level %d sleep kept %.2f GiB in %s (%.2f GiB written), dropped %.2f GiB, "
            "released %.2f GiB in %.2f s",
            level,
            spill["total_bytes"] / 2**30,
            spill["path"],
            spill["written_bytes"] / 2**30,
            spill["dropped_bytes"] / 2**30,
            release["released_bytes"] / 2**30,
            spill["seconds"] + release["seconds"],
        )

    def resume(self, tags: list[str] | None = None) -> None:
        requested = None if tags is None else tuple(tags)

        def wanted(tag: str) -> bool:
            return wakes(tag, requested, self._deferrable)

        self._state = "RESUMING"
        report: dict[str, Any] = {}
        woke = False
        try:
            self._cuda_running_with_peers()  # before any device call of this wake
            self._restore_distributed()
            if self._agent.state is AgentState.ASLEEP:
                report.update(self._agent.wake_here(self._args, lambda region: wanted(region.tag)))
                woke = True
            report["loose"] = self._pool.wake_loose(wanted)
        finally:
            report["warnings"] = self._pool_warnings()
            if woke:  # a client reading this wake from outside (hibernate wake) sees them too
                self._agent.add_warnings("restore", report["warnings"])
            self._state = self._settled_state()
        self.last_report = report
        restore = report.get("restore", {})
        log.info(
            "hibernate: woke %s: %.2f GiB read back and verified, %.2f GiB zero-filled%s",
            "everything" if requested is None else f"tags {list(requested)}",
            restore.get("total_bytes", 0) / 2**30,
            (restore.get("zeroed_bytes", 0) + report["loose"]["mapped_bytes"]) / 2**30,
            "" if self._state == "RUNNING" else "; the rest stays asleep",
        )

    # -- communicators across GPUs ------------------------------------------------

    def _distributed_to_prepare(self, comm_suspend: bool) -> DistributedCheckpoint | None:
        """vLLM's hooks a suspend of this worker must call, if it has peers; a warning if it has none.

        Refused before anything is touched where the communicators are known
        lost, or where the world spans more than one engine (every worker of
        every engine computes the same, so no peer is left waiting).
        """
        if self._distributed_lost is not None:
            raise NeedsRecoveryError(self._distributed_lost, hint=RESTART_HINT)
        if self._prepared is not None:  # prepared at an earlier suspend and not restored since
            return None
        module = self._parallel_state()
        world = world_size_of(module, self._environ)
        if world < 2:
            return None
        one_engine = engine_size(module)
        refusal = None if one_engine is None else multi_engine_refusal(world, one_engine)
        if refusal is not None:
            raise UnsupportedError(
                refusal,
                hint="serve with one engine (no --data-parallel-size) to put it to sleep with hibernate",
            )
        distributed = distributed_checkpoint(module, self._peer_timeout, comm_suspend=comm_suspend)
        if distributed is None:
            self._pool.sleep_notes = [MISSING_DISTRIBUTED_CHECKPOINT]
        return distributed

    def _ready(self, distributed: DistributedCheckpoint | None, level: int) -> None:
        """The checks that can refuse a sleep, then, with peers, a vote before any releases anything."""
        refused: BaseException | None = None
        try:
            check_level(level)
            require_allocator(self._pool)
        except Exception as exc:
            refused = exc
        if distributed is not None:
            failed = self._vote(distributed, failure_words(refused), "whether every worker can sleep")
            if refused is None and failed:
                raise AbortedError(
                    f"{describe_failed(failed, 'cannot sleep')}; so no worker slept: nothing was released"
                )
        if refused is not None:
            raise refused

    def _vote(
        self, distributed: DistributedCheckpoint, failure: str | None, about: str, *, undo: bool = False
    ) -> dict[int, str]:
        """Every worker's failure by rank (see ``DistributedCheckpoint.vote``), this one giving its own.

        A vote that cannot be held (a peer that never comes within the peer
        timeout, or gone) leaves the world's collectives out of step: the
        communicators are called lost, and with ``undo`` this worker's memory
        comes back first. Without ``vote`` each worker only knows itself.
        """
        if distributed.vote is None:
            return {} if failure is None else {self._rank or 0: failure}
        try:
            return distributed.vote(failure)
        except Exception as exc:
            self._distributed_lost = (
                f"the workers could not vote {about}: {type(exc).__name__}: {exc}"
                + (f" (this worker's own: {failure})" if failure is not None else "")
                + "; a peer may be hung or gone, and the workers' collectives may be out of step"
            )
            log.error("hibernate: %s", self._distributed_lost)
            if undo:
                self._undo_sleep(self._distributed_lost, exc)
            raise NeedsRecoveryError(
                self._distributed_lost + ("; this worker's memory is back" if undo else ""), hint=RESTART_HINT
            ) from exc

    def _undo_sleep(self, cause: str, exc: BaseException) -> None:
        """Bring this worker's memory back after a sleep it cannot keep; NeedsRecoveryError if that fails."""
        log.error("hibernate: %s; bringing the memory back", cause)
        try:
            self._agent.wake_here(self._args)
        except Exception as undo:
            raise NeedsRecoveryError(
                f"{cause}; bringing the memory back failed too: {undo}",
                hint="`hibernate recover PID` or restart the vLLM server",
            ) from exc

    def _prepare_distributed(self, distributed: DistributedCheckpoint) -> None:
        """Tear down the workspaces shared across GPUs, once every worker slept; undo all if any cannot.

        Every worker of the world is inside ``suspend`` at this point (vLLM
        calls it on all of them together), so the collectives meet their peers:
        first all agree that every sleep succeeded (else each undoes its own and
        nothing is torn down), then the prepare, then a vote on the prepare. A
        prepare that failed anywhere may have torn down some workspaces and not
        others, and their rebuilding is a collective not every worker can
        enter: the memory comes back, and the server must be restarted.
        """
        failed = self._vote(distributed, None, "whether every sleep succeeded", undo=True)
        if failed:
            cause = describe_failed(failed, "could not sleep")
            self._undo_sleep(cause, AbortedError(cause))
            raise AbortedError(
                f"{cause}; so this worker's sleep was undone too, its communicators across GPUs left as "
                "they are: its memory is back and it keeps serving"
            )
        if distributed.tear_down:
            error: Exception | None = None
            try:
                distributed.prepare()
            except Exception as exc:
                error = exc
            failed = self._vote(
                distributed, failure_words(error), "whether every prepare succeeded", undo=True
            )
            if failed:
                self._distributed_lost = (
                    f"vLLM's checkpoint_prepare_distributed_state failed on {describe_failed(failed)}: the "
                    "communicators across GPUs may be torn down on some workers and not on others, and "
                    "rebuilding them is a collective they cannot all enter"
                )
                origin = error or AbortedError(self._distributed_lost)
                self._undo_sleep(self._distributed_lost, origin)
                raise NeedsRecoveryError(
                    f"{self._distributed_lost}; this worker's memory is back, but the server must not serve",
                    hint=RESTART_HINT,
                ) from origin
        self._prepared = distributed

    def _cuda_running_with_peers(self) -> None:
        """``_cuda_running``, and with peers a vote on it: the rebuild after it is a collective."""
        if self._distributed_lost is not None:
            raise NeedsRecoveryError(self._distributed_lost, hint=RESTART_HINT)
        distributed = self._prepared
        if distributed is None:
            self._cuda_running()
            return
        error: Exception | None = None
        try:
            self._cuda_running()
        except Exception as exc:
            error = exc
        failed = self._vote(distributed, failure_words(error), "whether every CUDA state is back")
        if error is not None:
            raise error
        if failed:
            raise CudaCheckpointError(
                f"{describe_failed(failed, 'could not get its CUDA state back')}; so no worker rebuilt its "
                "communicators or brought its memory back: the server stays asleep",
                hint="see the server's log; wake it again once the cause is fixed",
            )

    def _restore_distributed(self) -> None:
        """Rebuild what ``_prepare_distributed`` tore down, once, before any memory comes back.

        A failure is not retried by a later wake (the peers are past the
        collective, which would hang): every later wake says it again.
        """
        distributed, self._prepared = self._prepared, None
        if distributed is None or not distributed.tear_down:
            return
        try:
            distributed.restore()
        except Exception as exc:
            self._distributed_lost = (
                f"vLLM's checkpoint_restore_distributed_state failed: {type(exc).__name__}: {exc}; this "
                "worker's communicators across GPUs are not rebuilt, so its memory stays asleep"
            )
            log.error("hibernate: %s", self._distributed_lost)
            raise NeedsRecoveryError(self._distributed_lost, hint=RESTART_HINT) from exc

    def _restore_refusal(self) -> HibernateError | None:
        """Why a hibernate client may not bring this worker's memory back (the agent asks)."""
        if self._distributed_lost is not None:
            return NeedsRecoveryError(self._distributed_lost, hint=RESTART_HINT)
        if self._prepared is not None:
            return NeedsRecoveryError(PREPARED_REFUSAL, hint=PREPARED_HINT)
        return None

    def discard(self, tags: tuple[str, ...]) -> None:
        try:
            self._cuda_running()
            self.last_report = self._pool.discard(tags)
        finally:
            warnings = self._pool_warnings()
            self._state = self._settled_state()
        self.last_report["warnings"] = warnings

    def _pool_warnings(self) -> list[str]:
        """What the pool's own maps and unmaps met in this call, logged (failed or not) and returned."""
        warnings = self._pool.take_warnings()
        for warning in warnings:
            log.warning("hibernate: %s", warning)
        return warnings

    def state(self) -> SleepModeState:
        """Read from the memory itself, so a wake done from outside (``hibernate recover``) shows."""
        return self._state if self._state == "RESUMING" else self._settled_state()

    @property
    def self_checkpoint(self) -> SelfCheckpointer | None:
        return self._self_checkpoint

    # -- capabilities ----------------------------------------------------------

    @classmethod
    def is_supported(cls) -> bool:
        """Where vLLM's cumem allocator works (its import fails without a driver)."""
        try:
            module = importlib.import_module(CUMEM_MODULE)
        except Exception:  # ImportError without libcuda; anything else means unusable too
            return False
        return bool(getattr(module, "cumem_available", False))

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # the CUDA context and its communicators are never torn down

    @classmethod
    def preserves_compiled_artifacts(cls) -> bool:
        return True

    @classmethod
    def preserves_graphs_with_communicators(cls) -> bool:
        return True  # pools come back at the same virtual addresses

    @classmethod
    def supports_durable_storage(cls) -> bool:
        return False  # the snapshot only holds the pools; the rest of the process is in memory
