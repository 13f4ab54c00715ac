"""What a caller may choose about one operation, and the one constructor of it from a caller's flags.

Run state lives elsewhere (the CUDA stage, the units): an Options is built
once, by :func:`options_from_flags` (the CLI's commands, serve), and never
changed after (``dataclasses.replace`` makes a variant), so what an operation
was asked for is what it was built with. The checks a flag's value gets
(``--io-mode``, ``--checkpointer``, ``--device-map``) live in that constructor,
so every caller refuses a bad value with the same words, in the same order,
before anything is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hibernate.agent.wire import TransferArgs
from hibernate.checkpoint.base import Checkpointer, StepTimeouts
from hibernate.checkpoint.selection import NONE, check_choice
from hibernate.environ import ALLOW_MOVES_ENV, SKIP_REUSE_CHECK_ENV, flag_or_env
from hibernate.errors import UsageError
from hibernate.limits import MIN_BUFFER_MB

# The least an agent is given to answer, whatever the --timeout: a quiesce may be asked to wait
# for nothing (--timeout 0), but an agent busy reading its socket still needs a moment to reply.
MIN_AGENT_TIMEOUT = 5.0
IO_MODES = ("auto", "direct", "buffered")


@dataclass(frozen=True)
class IoOptions(TransferArgs):
    """How the bytes of a sleep or wake move (``--buffer-mb``, ``--io-mode``, ``--verify``, ...):
    the transfer arguments every agent is sent, with ``buffer_mb`` the whole command's staging
    budget until :meth:`transfer` gives each process its share."""

    def transfer(self, buffer_mb: int | None = None) -> TransferArgs:
        """These options as a spill's or restore's arguments (``buffer_mb``: one process's share)."""
        return self if buffer_mb is None else replace(self, buffer_mb=buffer_mb)

    def to_args(self) -> dict[str, Any]:
        return self.to_wire()


@dataclass(frozen=True)
class StagingShare:
    """How one staging budget (``--buffer-mb``) is shared by the processes of one transfer."""

    buffer_mb: int  # each process's staging
    at_once: int  # processes transferring at the same time


def share_staging(budget_mb: int, processes: int, floor_mb: int = MIN_BUFFER_MB) -> StagingShare:
    """Divide a node-wide staging budget among ``processes`` moving at once.

    ``--buffer-mb`` is what the whole operation may stage, not each process:
    eight workers of one node sleeping together with 256 MiB each held 2 GiB
    of staging where one budget was asked for. Each process gets an equal
    share; where shares would fall below ``floor_mb`` (staging that small makes
    chunks so small the disk slows), fewer processes move at once, each with
    ``floor_mb`` or more, so the total never passes the budget.
    """
    processes = max(1, processes)
    at_once = max(1, min(processes, budget_mb // floor_mb))
    return StagingShare(buffer_mb=budget_mb // at_once, at_once=at_once)


@dataclass(frozen=True)
class Options:
    quiesce_timeout: float = 30.0
    # How long a sleep waits for requests in flight through a proxy to end (leases); None: the
    # quiesce_timeout. A proxy's own idle sleep gives up sooner: another proxy's requests mean the
    # backend is not idle.
    lease_timeout: float | None = None
    agent_timeout: float = 60.0  # longest silence from an agent before giving up
    io: IoOptions = field(default_factory=IoOptions)
    # The CUDA stage: an explicit checkpointer, else one chosen (once, lazily) by kind:
    # "auto" (driver API, else the cuda-checkpoint binary, else none), "driver" or "binary".
    checkpointer: Checkpointer | None = None
    checkpointer_kind: str = "auto"
    cuda_checkpoint: str | None = None  # path of the cuda-checkpoint binary (--cuda-checkpoint)
    cuda_timeouts: StepTimeouts = field(default_factory=StepTimeouts)
    # --force: go on where a safety check cannot tell (a wake's free GPU memory that NVML cannot
    # read; a multi-process CUDA sleep without the NCCL settings a checkpoint needs).
    force: bool = False
    # --device-map: restore onto other GPUs, as given (GPU UUIDs or NVML indices, old -> new).
    device_map: dict[str, str] = field(default_factory=dict)
    # Options of one kind of target, by the name its registration declares (a vLLM server's
    # "level", "drain", "vllm_url"); only those the user gave, so that the engine can refuse
    # them for a selection with no target of that kind.
    kind_options: dict[str, Any] = field(default_factory=dict)
    # A sleep of targets chosen by a selector (--all, --job, --cgroup) skips those already asleep and
    # lists them, as a wake skips those awake: "everything of mine" should end asleep, not fail because
    # part of it already is. Pids named one by one are refused instead (the user meant those).
    skip_asleep: bool = False
    # --if-needed: a target already in the state asked for is left as it is and listed as skipped;
    # a sleep or wake that finds every target there ends with that report instead of refusing
    # (exit 6). One that a command is still at work on, or left half-way, is refused all the same.
    if_needed: bool = False
    # Agents of several users in one command (root only): --all-users, or a --job/--cgroup selection.
    all_users: bool = False

    @property
    def lease_wait(self) -> float:
        """How long a sleep waits for the leases held on its targets: ``lease_timeout``, else the
        quiesce's."""
        return self.quiesce_timeout if self.lease_timeout is None else self.lease_timeout


def options_from_flags(
    *,
    timeout: float | None = None,
    lease_timeout: float | None = None,
    buffer_mb: int | None = None,
    io_mode: str = "auto",
    verify: bool = False,
    skip_reuse_check: bool | None = False,
    allow_moves: bool | None = False,
    checkpointer: str = "auto",
    cuda_checkpoint: Path | None = None,
    no_cuda: bool = False,
    force: bool = False,
    device_map: str | None = None,
    lock_timeout: float | None = None,
    level: int | None = None,
    drain: str | None = None,
    vllm_url: str | None = None,
    all_users: bool = False,
    job: str | None = None,
    cgroup: str | None = None,
    skip_asleep: bool = False,
    if_needed: bool = False,
    io_depth: int | None = None,
    io_workers: int | None = None,
    keep_staging_mb: int | None = None,
) -> Options:
    """The Options of one operation from its caller's flags; what a caller has no flag for stays default.

    The one constructor (every command of the CLI, serve's backends), so each maps ``--timeout``,
    ``--buffer-mb``, ``--io-mode``, the CUDA and vLLM flags and the user scope the same way, and
    refuses a bad value with the same words, in the same order (``--io-mode`` before
    ``--checkpointer``), before anything is touched.

    ``timeout`` (``--timeout``) bounds the quiesce; an agent is allowed at least
    ``MIN_AGENT_TIMEOUT`` to answer even with ``--timeout 0``. None (a caller without ``--timeout``)
    keeps the Options defaults, as does a None ``buffer_mb``. ``lock_timeout`` bounds
    cuda-checkpoint's lock (a sleep's), None for its default. ``skip_reuse_check`` and
    ``allow_moves`` None mean "not given": their environment variable's value (``flag_or_env``).
    ``job`` or ``cgroup`` imply ``all_users``, as their selection names the processes exactly.
    """
    reuse_unchecked = flag_or_env(skip_reuse_check, SKIP_REUSE_CHECK_ENV)  # a bad variable first, as
    moves = flag_or_env(allow_moves, ALLOW_MOVES_ENV)  # when the commands read them themselves
    io = IoOptions(
        io_mode=_io_mode(io_mode),
        verify=verify,
        skip_reuse_check=reuse_unchecked,
        allow_moves=moves,
        io_depth=io_depth,
        io_workers=io_workers,
        keep_staging_mb=keep_staging_mb,
    )
    kind_options = _kind_options(level=level, drain=drain, vllm_url=vllm_url)
    scope = spans_users(all_users, job, cgroup)
    cuda = cuda_options(checkpointer, cuda_checkpoint, lock_timeout=lock_timeout, no_cuda=no_cuda)
    options = Options(
        io=io if buffer_mb is None else replace(io, buffer_mb=buffer_mb),
        lease_timeout=lease_timeout,
        kind_options=kind_options,
        all_users=scope,
        checkpointer_kind=cuda.checkpointer_kind,
        cuda_checkpoint=cuda.cuda_checkpoint,
        cuda_timeouts=cuda.cuda_timeouts,
        force=force,
        device_map=_device_map(device_map, cuda.checkpointer_kind),
        skip_asleep=skip_asleep,
        if_needed=if_needed,
    )
    if timeout is None:
        return options
    return replace(options, quiesce_timeout=timeout, agent_timeout=max(timeout, MIN_AGENT_TIMEOUT))


def spans_users(all_users: bool, job: str | None, cgroup: str | None) -> bool:
    """Whether agents of several users may be acted on: asked for, or named exactly by a selector."""
    return all_users or job is not None or cgroup is not None


@dataclass(frozen=True)
class CudaFlags:
    """The CUDA stage's fields of an Options, as ``--checkpointer``, ``--cuda-checkpoint`` and
    ``--no-cuda`` (and a sleep's ``--timeout``, for the lock) chose them."""

    checkpointer_kind: str
    cuda_checkpoint: str | None
    cuda_timeouts: StepTimeouts


def cuda_options(
    kind: str, binary: Path | None, lock_timeout: float | None = None, no_cuda: bool = False
) -> CudaFlags:
    """The CUDA stage's options, checked here so bad input fails before anything is touched
    (``hibernate doctor`` checks its --checkpointer and --cuda-checkpoint through it too)."""
    if no_cuda:
        if kind not in ("auto", NONE):
            raise UsageError(
                f"--no-cuda means --checkpointer none; it cannot be used with --checkpointer {kind}"
            )
        kind = NONE
    check_choice(kind, binary)
    timeouts = StepTimeouts() if lock_timeout is None else StepTimeouts(lock=max(lock_timeout, 0.001))
    return CudaFlags(kind, str(binary) if binary is not None else None, timeouts)


def _kind_options(**given: Any) -> dict[str, Any]:
    """Options of one kind of target (a vLLM server's --level, --drain, --vllm-url), only those given."""
    return {name: value for name, value in given.items() if value is not None}


def _io_mode(value: str) -> str:
    """``--io-mode``, checked here: the store takes any value but direct or buffered for auto, silently."""
    if value not in IO_MODES:
        raise UsageError(f"--io-mode must be auto, direct or buffered, not {value!r}")
    return value


def _device_map(text: str | None, checkpointer_kind: str) -> dict[str, str]:
    """``--device-map`` (none: empty), refused where no CUDA state is restored at all."""
    if text is None:
        return {}
    if checkpointer_kind == NONE:
        raise UsageError(
            "--device-map restores CUDA state onto other GPUs; --checkpointer none restores none"
        )
    return parse_device_map(text)


def parse_device_map(text: str) -> dict[str, str]:
    """``OLD=NEW[,OLD=NEW...]`` (GPU UUIDs or indices) -> {old: new}; a malformed map is refused."""
    pairs: dict[str, str] = {}
    for item in text.split(","):
        old, sep, new = (part.strip() for part in item.partition("="))
        if not sep or not old or not new:
            raise UsageError(
                f"--device-map: {item.strip()!r} is not OLD=NEW",
                hint="e.g. --device-map 0=1, or GPU-aaaa...=GPU-bbbb... (several: comma-separated)",
            )
        if old in pairs:
            raise UsageError(f"--device-map: GPU {old} is mapped twice")
        pairs[old] = new
    return pairs
