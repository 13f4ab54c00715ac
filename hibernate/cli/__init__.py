"""The ``hibernate`` command: parse, call the orchestrator, render. Nothing else lives here.

Importing this module must stay light (no torch): it runs on login nodes and
in scheduler hooks where torch may be missing or slow to import.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from hibernate.errors import ExitCode, HibernateError, UsageError
from hibernate.version import __version__

if TYPE_CHECKING:  # for annotations only: the commands import it when they run, --help never does
    from hibernate import orchestrator

app = typer.Typer(
    name="hibernate",
    help="Put a live GPU process to sleep (weights to files, GPU freed) and wake it in place.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress, only errors.")]
PidsArgument = Annotated[
    list[int], typer.Argument(help="Any process of each target's tree.", show_default=False)
]
BufferOption = Annotated[
    int,
    typer.Option(
        "--buffer-mb",
        help=(
            "Staging memory for the transfer, in MiB, shared by every process moving at once: "
            "16 to half of this machine's RAM."
        ),
    ),
]
IoModeOption = Annotated[
    str,
    typer.Option("--io-mode", help="auto (direct I/O where the filesystem allows), direct, or buffered."),
]
TimeoutOption = Annotated[
    float,
    typer.Option(
        "--timeout",
        help="Seconds to wait for the program to leave hibernate.guard() (a vLLM server: for its running "
        "requests to drain) and for its CUDA work to drain: 0 to 86400.",
    ),
]
CheckpointerOption = Annotated[
    str,
    typer.Option(
        "--checkpointer",
        help="How to drive cuda-checkpoint: auto (the driver API where libcuda has it, else the "
        "cuda-checkpoint binary), driver, binary, or none (free the pools only: every CUDA context "
        "stays on the GPU, no checkpoint call is made).",
    ),
]
CudaCheckpointOption = Annotated[
    Path | None,
    typer.Option(
        "--cuda-checkpoint",
        help="The cuda-checkpoint executable (default: $HIBERNATE_CUDA_CHECKPOINT, then PATH); "
        "implies the binary unless --checkpointer driver.",
        show_default=False,
    ),
]

ForceOption = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Go on where a safety check cannot tell: a wake whose free GPU memory NVML cannot read, a "
        "sleep of several CUDA processes without the NCCL settings a checkpoint needs.",
        show_default=False,
    ),
]
SkipReuseCheckOption = Annotated[
    bool,
    typer.Option(
        "--skip-reuse-check",
        help="Reuse the previous snapshot's unchanged chunks without reading them back first "
        "(a re-sleep then costs one hash of the memory, not a read of the disk beside it); "
        "a change on the disk since the last wake goes unnoticed until the next wake. "
        "Default: $HIBERNATE_SKIP_REUSE_CHECK.",
    ),
]
NoCudaOption = Annotated[
    bool,
    typer.Option("--no-cuda", help="Same as --checkpointer none.", show_default=False),
]

OptionalPidsArgument = Annotated[
    list[int] | None,
    typer.Argument(
        help="Any process of each target's tree (or select them with --all, --job, --cgroup).",
        show_default=False,
    ),
]
AllOption = Annotated[
    bool, typer.Option("--all", help="Every hibernate agent of yours on this node.", show_default=False)
]
JobOption = Annotated[
    str | None,
    typer.Option(
        "--job",
        metavar="ID",
        help="The processes of Slurm job ID on this node (found through its cgroup, else through "
        "SLURM_JOB_ID in their environment).",
        show_default=False,
    ),
]
CgroupOption = Annotated[
    str | None,
    typer.Option(
        "--cgroup",
        metavar="PATH",
        help="The processes of this cgroup and the cgroups below it (a directory, or the path "
        "/proc/PID/cgroup shows; root: $HIBERNATE_CGROUP_ROOT, default /sys/fs/cgroup).",
        show_default=False,
    ),
]
AllUsersOption = Annotated[
    bool,
    typer.Option(
        "--all-users",
        help="Root: act on the agents of every user the targets hold (without it, targets holding "
        "agents of several users are refused; --job and --cgroup imply it).",
        show_default=False,
    ),
]

VllmUrlOption = Annotated[
    str | None,
    typer.Option(
        "--vllm-url",
        help="vLLM server only: its address (http://HOST:PORT or unix:/PATH); default: read from the "
        "server's command line (--host/--port/--uds), else vLLM's default port 8000.",
        show_default=False,
    ),
]

F = TypeVar("F", bound=Callable[..., Any])


def _directory(value: str) -> Path:
    """A ``--to`` directory. An empty string is refused: ``Path("")`` quietly means the current
    directory, and an empty ``--to "$DIR"`` is a script whose variable was never set."""
    if isinstance(value, Path):  # a default, or a value already converted
        return value
    if value == "":
        raise typer.BadParameter("an empty string names no directory (for the current one, pass --to .)")
    return Path(value)


def _handles_errors(func: F) -> F:
    """Turn HibernateError into its exit code and message (JSON when --json).

    Every numeric option is range-checked here first (hibernate/limits.py, by
    parameter name), so each command refuses a bad number before it touches
    anything, with the same words and exit code, and no command can forget to.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from hibernate import limits
        from hibernate.cli import render

        try:
            limits.check(kwargs)
            return func(*args, **kwargs)
        except HibernateError as exc:
            raise typer.Exit(render.error(exc, bool(kwargs.get("as_json")))) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _cuda_options(
    kind: str, binary: Path | None, lock_timeout: float | None = None, no_cuda: bool = False
) -> dict[str, Any]:
    """Options fields for the CUDA stage, checked here so bad input fails before anything is touched."""
    from hibernate.checkpoint.base import StepTimeouts
    from hibernate.checkpoint.selection import KINDS, NONE

    if no_cuda:
        if kind not in ("auto", NONE):
            raise UsageError(
                f"--no-cuda means --checkpointer none; it cannot be used with --checkpointer {kind}"
            )
        kind = NONE
    if kind not in KINDS:
        raise UsageError(f"--checkpointer must be one of {', '.join(KINDS)}, not {kind!r}")
    if binary is not None and kind in ("driver", "none"):
        raise UsageError(f"--cuda-checkpoint names the binary; it cannot be used with --checkpointer {kind}")
    timeouts = StepTimeouts() if lock_timeout is None else StepTimeouts(lock=max(lock_timeout, 0.001))
    return {
        "checkpointer_kind": kind,
        "cuda_checkpoint": str(binary) if binary is not None else None,
        "cuda_timeouts": timeouts,
    }


def _kind_options(**given: Any) -> dict[str, Any]:
    """Options of one kind of target (a vLLM server's --level, --drain, --vllm-url), only those given."""
    return {name: value for name, value in given.items() if value is not None}


def _select(
    pids: list[int] | None, every: bool, job: str | None, cgroup: str | None, *, sleeping: bool = False
) -> Any:
    """The targets of a command: its pids and the processes its selectors find (sched.selectors.select)."""
    from hibernate.sched.selectors import select

    return select(pids, every=every, job=job, cgroup=cgroup, sleeping=sleeping)


def _by_selector(selection: Any) -> bool:
    """Whether a selector (--all, --job, --cgroup) chose targets, rather than pids alone."""
    return any(source["selector"] != "pids" for source in selection.sources)


def _all_users(all_users: bool, job: str | None, cgroup: str | None) -> bool:
    """Whether agents of several users may be acted on: asked for, or named exactly by a selector."""
    return all_users or job is not None or cgroup is not None


def _with_selection(document: dict[str, Any], selection: Any) -> dict[str, Any]:
    """Add how the targets were selected to a JSON document, when selectors were used."""
    if _by_selector(selection):
        document["selection"] = selection.to_wire()
    return document


def _skip_reuse_check_by_default() -> bool:
    """``$HIBERNATE_SKIP_REUSE_CHECK``: the default of ``--skip-reuse-check`` (a yes/no, else refused)."""
    import os

    from hibernate.environ import SKIP_REUSE_CHECK_ENV, env_flag

    return env_flag(os.environ, SKIP_REUSE_CHECK_ENV)


def _io_mode(value: str) -> str:
    if value not in ("auto", "direct", "buffered"):
        raise UsageError(f"--io-mode must be auto, direct or buffered, not {value!r}")
    return value


def options_from_flags(
    *,
    timeout: float | None = None,
    buffer_mb: int | None = None,
    io_mode: str = "auto",
    verify: bool = False,
    skip_reuse_check: bool = False,
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
) -> orchestrator.Options:
    """The orchestrator's Options from a command's flags; what a command has no flag for stays default.

    One constructor, so every command maps ``--timeout``, ``--buffer-mb``, ``--io-mode``, the CUDA
    and vLLM flags and the user scope the same way, and refuses a bad value with the same words, in
    the same order (``--io-mode`` before ``--checkpointer``), before anything is touched.

    ``timeout`` (``--timeout``) bounds the quiesce; an agent is allowed at least 5 s to answer even
    with ``--timeout 0``. None (a command without ``--timeout``) keeps the Options defaults, as does
    a None ``buffer_mb``. ``lock_timeout`` bounds cuda-checkpoint's lock (a sleep's), None for its
    default. ``job`` or ``cgroup`` imply ``all_users``, as their selection names the processes exactly.
    """
    from hibernate import orchestrator

    options = orchestrator.Options(
        io=orchestrator.IoOptions(
            io_mode=_io_mode(io_mode), verify=verify, skip_reuse_check=skip_reuse_check
        ),
        kind_options=_kind_options(level=level, drain=drain, vllm_url=vllm_url),
        all_users=_all_users(all_users, job, cgroup),
        **_cuda_options(checkpointer, cuda_checkpoint, lock_timeout=lock_timeout, no_cuda=no_cuda),
    )
    if timeout is not None:
        options.quiesce_timeout = timeout
        options.agent_timeout = max(timeout, 5.0)
    if buffer_mb is not None:
        options.io.buffer_mb = buffer_mb
    options.force = force
    if device_map is not None:
        if options.checkpointer_kind == "none":
            raise UsageError(
                "--device-map restores CUDA state onto other GPUs; --checkpointer none restores none"
            )
        options.device_map = parse_device_map(device_map)
    return options


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


@app.command()
@_handles_errors
def sleep(
    to: Annotated[
        Path,
        typer.Option(
            "--to", parser=_directory, help="Directory for the snapshots (created 0700 if missing)."
        ),
    ],
    pids: OptionalPidsArgument = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    all_users: AllUsersOption = False,
    timeout: TimeoutOption = 30.0,
    buffer_mb: BufferOption = 256,
    io_mode: IoModeOption = "auto",
    verify: Annotated[
        bool,
        typer.Option(
            "--verify",
            help="Read each snapshot back whole (checksums) before any memory is released: "
            "proof over speed, it costs one read of the snapshot.",
        ),
    ] = False,
    skip_reuse_check: SkipReuseCheckOption = False,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    no_cuda: NoCudaOption = False,
    force: ForceOption = False,
    level: Annotated[
        int | None,
        typer.Option(
            "--level",
            help="vLLM server only: 1 keeps the weights (written to DIR), 2 drops them. [default: 1]",
        ),
    ] = None,
    drain: Annotated[
        str | None,
        typer.Option(
            "--drain",
            help="vLLM server only: wait (running requests finish first, within --timeout) or abort "
            "them. [default: wait]",
        ),
    ] = None,
    vllm_url: VllmUrlOption = None,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Spill each target's tracked memory to DIR, release it, and take CUDA state off the GPU.

    For a vLLM server (any pid of it) the server's own /sleep stops its scheduler and spills the workers.
    """
    from hibernate import orchestrator
    from hibernate.cli import render

    options = options_from_flags(
        timeout=timeout,
        buffer_mb=buffer_mb,
        io_mode=io_mode,
        verify=verify,
        skip_reuse_check=skip_reuse_check or _skip_reuse_check_by_default(),
        checkpointer=checkpointer,
        cuda_checkpoint=cuda_checkpoint,
        no_cuda=no_cuda,
        force=force,
        lock_timeout=timeout,
        level=level,
        drain=drain,
        vllm_url=vllm_url,
        all_users=all_users,
        job=job,
        cgroup=cgroup,
    )
    selection = _select(pids, every, job, cgroup, sleeping=True)
    options.skip_asleep = _by_selector(selection)  # as a wake skips those awake
    with render.TerminalProgress(enabled=not (as_json or quiet)) as progress:
        report = orchestrator.sleep(selection.pids, to, options, progress)
    if as_json:
        render.print_json(_with_selection({"ok": True, **report.to_wire()}, selection))
    elif not quiet:
        render.sleep_report(report)


@app.command()
@_handles_errors
def wake(
    pids: OptionalPidsArgument = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    all_users: AllUsersOption = False,
    timeout: TimeoutOption = 30.0,
    buffer_mb: BufferOption = 256,
    io_mode: IoModeOption = "auto",
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    no_cuda: NoCudaOption = False,
    force: ForceOption = False,
    device_map: Annotated[
        str | None,
        typer.Option(
            "--device-map",
            metavar="OLD=NEW[,...]",
            help="Restore the CUDA state onto other GPUs of the same type (driver 580+): GPU UUIDs or "
            "indices, every GPU that was checkpointed named.",
            show_default=False,
        ),
    ] = None,
    vllm_url: VllmUrlOption = None,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Bring each target back where it was put to sleep, verified byte for byte."""
    from hibernate import orchestrator
    from hibernate.cli import render

    options = options_from_flags(
        timeout=timeout,
        buffer_mb=buffer_mb,
        io_mode=io_mode,
        checkpointer=checkpointer,
        cuda_checkpoint=cuda_checkpoint,
        no_cuda=no_cuda,
        force=force,
        device_map=device_map,
        vllm_url=vllm_url,
        all_users=all_users,
        job=job,
        cgroup=cgroup,
    )
    selection = _select(pids, every, job, cgroup)
    with render.TerminalProgress(enabled=not (as_json or quiet)) as progress:
        report = orchestrator.wake(selection.pids, options, progress)
    if as_json:
        render.print_json(_with_selection({"ok": True, **report.to_wire()}, selection))
    elif not quiet:
        render.wake_report(report)


@app.command()
@_handles_errors
def recover(
    pids: OptionalPidsArgument = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    all_users: AllUsersOption = False,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    force: ForceOption = False,
    vllm_url: VllmUrlOption = None,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """Finish or undo a sleep or wake whose hibernate command was killed half-way.

    A batch script that lost its `hibernate sleep --job ID` recovers the same set with
    `hibernate recover --job ID`.
    """
    from hibernate import orchestrator
    from hibernate.cli import render

    options = options_from_flags(
        checkpointer=checkpointer,
        cuda_checkpoint=cuda_checkpoint,
        force=force,
        vllm_url=vllm_url,
        all_users=all_users,
        job=job,
        cgroup=cgroup,
    )
    selection = _select(pids, every, job, cgroup)
    with render.TerminalProgress(enabled=not (as_json or quiet)) as progress:
        report = orchestrator.recover(selection.pids, options, progress)
    if as_json:
        render.print_json(_with_selection({"ok": True, **report.to_wire()}, selection))
    elif not quiet:
        render.recover_report(report)


@app.command()
@_handles_errors
def status(
    pids: Annotated[list[int] | None, typer.Argument(help="Targets to show (default: all of yours).")] = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    all_users: AllUsersOption = False,
    as_json: JsonOption = False,
) -> None:
    """State, pools and snapshot of each agent of the given targets (or all of yours)."""
    from hibernate import orchestrator
    from hibernate.cli import render

    selection = _select(pids, every, job, cgroup) if (pids or every or job or cgroup) else None
    entries = orchestrator.status(
        selection.pids if selection else None, all_users=_all_users(all_users, job, cgroup)
    )
    if as_json:
        document = {"ok": True, "agents": entries}
        render.print_json(_with_selection(document, selection) if selection else document)
    else:
        render.agents_table(entries)


@app.command("ls")
@_handles_errors
def list_agents(as_json: JsonOption = False) -> None:
    """Every hibernate agent of yours on this machine."""
    from hibernate import orchestrator
    from hibernate.cli import render

    entries = orchestrator.status(None)
    if as_json:
        render.print_json({"ok": True, "agents": entries})
    else:
        render.agents_table(entries)


@app.command()
@_handles_errors
def gc(
    directory: Annotated[Path, typer.Argument(help="A --to directory (or one process's directory in it).")],
    awake: Annotated[
        bool, typer.Option("--awake", help="Also delete the snapshot kept by processes that are awake.")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="List what would be deleted, and why.")] = False,
    as_json: JsonOption = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No output unless something fails.")] = False,
) -> None:
    """Delete unfinished snapshots and those of processes that are gone; never a sleeping one's."""
    from hibernate.cli import render
    from hibernate.operation import targets
    from hibernate.store.maintenance import collect_garbage

    report = collect_garbage(
        directory,
        awake=awake,
        dry_run=dry_run,
        agent_state=lambda owner: targets.agent_state(owner.pid, owner.start_time, owner.pid_namespace),
    )
    if as_json:
        render.print_json({"ok": True, **report})
    elif not quiet:
        render.gc_report(report)
    for warning in report["warnings"]:  # a warning is worth a log line even with --quiet
        render.err.print(f"hibernate gc: warning: {warning}", markup=False)


@app.command(context_settings={"allow_interspersed_args": False})
@_handles_errors
def run(
    command: Annotated[list[str], typer.Argument(help="The job to run, after --.", show_default=False)],
    to: Annotated[Path, typer.Option("--to", parser=_directory, help="Directory for the snapshots.")],
    on_signal: Annotated[
        str, typer.Option("--on-signal", help="Signal that puts the job to sleep.")
    ] = "USR1",
    wake_signal: Annotated[
        str, typer.Option("--wake-signal", help="Signal that wakes it ('' for none: use hibernate wake).")
    ] = "USR2",
    timeout: TimeoutOption = 30.0,
    buffer_mb: BufferOption = 256,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    no_cuda: NoCudaOption = False,
) -> None:
    """Run a job and hibernate it on a scheduler's warning signal (Slurm --signal=B:USR1@120)."""
    from hibernate.sched import runner

    options = options_from_flags(
        timeout=timeout,
        buffer_mb=buffer_mb,
        checkpointer=checkpointer,
        cuda_checkpoint=cuda_checkpoint,
        no_cuda=no_cuda,
        lock_timeout=timeout,
    )
    raise typer.Exit(runner.run(command, to, on_signal, wake_signal or None, options))


SERVE_EXTRA_HINT = "pip install 'hibernate[serve]' (aiohttp and prometheus-client)"


@app.command(context_settings={"allow_interspersed_args": False})
@_handles_errors
def serve(
    command: Annotated[
        list[str] | None,
        typer.Argument(
            help="After --: a backend to start and stop with the proxy (see --start).", show_default=False
        ),
    ] = None,
    to: Annotated[
        str | None,
        typer.Option(
            "--to", help="Directory for the snapshots of sleeping backends (created 0700 if missing)."
        ),
    ] = None,
    backend: Annotated[
        list[str] | None,
        typer.Option(
            "--backend",
            metavar="NAME=URL",
            help="A backend, http://HOST:PORT; requests whose model is NAME go to it (repeat for several).",
            show_default=False,
        ),
    ] = None,
    listen: Annotated[
        str | None, typer.Option("--listen", help="HOST:PORT to serve on. [default: 127.0.0.1:8000]")
    ] = None,
    idle: Annotated[
        float | None,
        typer.Option(
            "--idle",
            help="Put a backend to sleep after this many seconds without a request.",
            show_default=False,
        ),
    ] = None,
    wake_timeout: Annotated[
        float | None,
        typer.Option(
            "--wake-timeout", help="Longest a request waits for its backend to wake. [default: 300]"
        ),
    ] = None,
    gpu_budget: Annotated[
        str | None,
        typer.Option(
            "--gpu-budget",
            help="Tracked memory that may be awake at once (e.g. 70GiB), or auto (the GPUs' free memory, "
            "NVML): a wake that does not fit first puts the least recently used idle backends to sleep.",
            show_default=False,
        ),
    ] = None,
    start: Annotated[
        str | None,
        typer.Option(
            "--start",
            metavar="NAME",
            help="The backend `-- COMMAND` starts (default: the only one).",
            show_default=False,
        ),
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config", help="serve.toml: the same settings, plus per-backend ones.", show_default=False
        ),
    ] = None,
) -> None:
    """Serve HTTP in front of model servers: sleep them when idle, wake them on the first request."""
    from hibernate.errors import UnsupportedError
    from hibernate.serve import config as serve_config

    document = serve_config.load_toml(config) if config is not None else None
    settings = serve_config.build_config(
        listen=listen,
        to=_directory(to) if to is not None else None,
        backend_flags=backend or [],
        idle=idle,
        wake_timeout=wake_timeout,
        gpu_budget=gpu_budget,
        command=command or [],
        start=start,
        document=document,
        source=str(config) if config is not None else "serve.toml",
    )
    try:
        from hibernate.serve import server
    except ModuleNotFoundError as exc:
        if exc.name not in ("aiohttp", "prometheus_client"):
            raise
        raise UnsupportedError(
            f"hibernate serve needs {exc.name}, which is not installed", hint=SERVE_EXTRA_HINT
        ) from None
    raise typer.Exit(server.run(settings))


@app.command("node-step", hidden=True)
@_handles_errors
def node_step(
    operation: Annotated[str, typer.Argument(help="sleep or wake.", show_default=False)],
    barrier: Annotated[
        Path,
        typer.Option("--barrier", help="A fresh directory every node shares, the same for all of them."),
    ],
    pids: OptionalPidsArgument = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    to: Annotated[
        Path | None,
        typer.Option(
            "--to",
            parser=_directory,
            help="Snapshot directory (sleep); this node's go to DIR/<node name>.",
            show_default=False,
        ),
    ] = None,
    nodes: Annotated[
        int | None,
        typer.Option(
            "--nodes",
            help="Nodes taking part (default: $SLURM_STEP_NUM_NODES, $SLURM_NNODES).",
            show_default=False,
        ),
    ] = None,
    node_index: Annotated[
        int | None,
        typer.Option("--node-index", help="This node's index (default: $SLURM_NODEID).", show_default=False),
    ] = None,
    node: Annotated[
        str | None,
        typer.Option(
            "--node-name",
            help="This node's name (default: $SLURMD_NODENAME, the host name).",
            show_default=False,
        ),
    ] = None,
    barrier_timeout: Annotated[
        float,
        typer.Option(
            "--barrier-timeout", help="Seconds from the start until silent nodes count as failed (to 86400)."
        ),
    ] = 600.0,
    allow_empty: Annotated[
        bool,
        typer.Option("--allow-empty", help="A node where nothing is selected agrees instead of failing."),
    ] = False,
    timeout: TimeoutOption = 30.0,
    buffer_mb: BufferOption = 256,
    io_mode: IoModeOption = "auto",
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    no_cuda: NoCudaOption = False,
    force: ForceOption = False,
    skip_reuse_check: SkipReuseCheckOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """One node's part of a job-wide sleep or wake (run by scripts/slurm/hibernate-job under srun)."""
    from hibernate.cli import render
    from hibernate.sched import nodestep

    document, error = nodestep.node_step(
        operation,
        barrier,
        pids=pids,
        every=every,
        job=job,
        cgroup=cgroup,
        to=to,
        nodes=nodes,
        node_index=node_index,
        node=node,
        barrier_timeout=barrier_timeout,
        allow_empty=allow_empty,
        options=lambda: options_from_flags(
            timeout=timeout,
            buffer_mb=buffer_mb,
            io_mode=io_mode,
            checkpointer=checkpointer,
            cuda_checkpoint=cuda_checkpoint,
            no_cuda=no_cuda,
            force=force,
            lock_timeout=timeout if operation == "sleep" else None,
            skip_reuse_check=operation == "sleep" and (skip_reuse_check or _skip_reuse_check_by_default()),
            job=job,
            cgroup=cgroup,
        ),
        progress=lambda: render.TerminalProgress(enabled=not (as_json or quiet)),
    )
    if error is not None:  # the nodes agreed to abort: the whole picture, then the verdict's exit code
        code = int(error.exit_code)
        if as_json:
            document["error"] = {**error.to_wire(), "exit_code": code, "exit_name": error.exit_code.name}
            render.print_json(document)
        else:
            if not quiet:
                render.node_step_report(document)
            render.error(error, False)
        raise typer.Exit(code)
    if as_json:
        render.print_json(document)
    elif not quiet:
        render.node_step_report(document)


@app.command()
@_handles_errors
def doctor(
    pid: Annotated[
        int | None,
        typer.Argument(help="A target to examine too (any process of its tree).", show_default=False),
    ] = None,
    to: Annotated[
        Path | None,
        typer.Option(
            "--to",
            parser=_directory,
            help="Where snapshots would go (default: the agent's default directory, if any).",
        ),
    ] = None,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    as_json: JsonOption = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="Only the checks that are not ok (nothing when all are).")
    ] = False,
) -> None:
    """What this machine (and target) can and cannot do, each with a fix. Exit 12 if any check fails."""
    from hibernate.cli import diagnosis, render

    cuda = _cuda_options(checkpointer, cuda_checkpoint)
    report = diagnosis.run(pid, to, cuda["checkpointer_kind"], cuda["cuda_checkpoint"])
    if as_json:
        render.print_json(report)
    else:
        render.doctor_report(report, only_problems=quiet)
    if not report["ok"]:
        raise typer.Exit(int(ExitCode.UNSUPPORTED))


def _version_callback(value: bool) -> None:
    if value:
        typer.echo(f"hibernate {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Put a live GPU process to sleep (weights to files, GPU freed) and wake it in place."""


def main() -> None:
    app()


if __name__ == "__main__":
    main()
