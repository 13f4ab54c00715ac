"""Every flag the commands share, defined once: its name, placeholder, check and help.

A flag that two commands take is one alias here, so its name, help and
default cannot drift apart between commands; where commands word its help
for their own use, one factory declares it (``to_option``: each command's
``--to`` variant is named here beside it; ``quiet_option``). The checks of a flag's text (an
empty ``--to``, a pid) live beside it; the checks of the values an operation
is built from (``--io-mode``, ``--checkpointer``, ``--device-map``) live in the
one constructor of its Options, ``operation.options.options_from_flags``, so
every command refuses a bad value with the same words and exit code before
anything is touched. A flag only one command has stays with that command.

Light on purpose: typer and the standard library at import; what the checks
need (the selectors, the path limits) is imported when a command runs, never
for ``--help``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

import typer

from hibernate.errors import HibernateError, UsageError

if TYPE_CHECKING:  # for annotations only: the commands import it when they run, --help never does
    from hibernate.sched.selectors import Selection


def quiet_option(help: str) -> Any:  # typer's OptionInfo
    """``-q``/``--quiet`` as every command declares it: what it leaves out is the command's own help."""
    return typer.Option("--quiet", "-q", help=help)


JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout.")]
QuietOption = Annotated[bool, quiet_option("No progress, only errors.")]
BufferOption = Annotated[
    int,
    typer.Option(
        "--buffer-mb",
        metavar="MIB",
        help=(
            "Staging memory for the transfer, in MiB, shared by every process moving at once: "
            "16 to half of this machine's RAM."
        ),
    ),
]
IoDepthOption = Annotated[
    int | None,
    typer.Option(
        "--io-depth",
        metavar="N",
        envvar="HIBERNATE_IO_DEPTH",
        show_default=False,
        help="I/O requests each process keeps in flight, 1 to 64 (default: chosen from the snapshot's "
        "filesystem: 1 on a local disk, 8 on a network or FUSE filesystem, one per worker on tmpfs).",
    ),
]
IoWorkersOption = Annotated[
    int | None,
    typer.Option(
        "--io-workers",
        metavar="N",
        envvar="HIBERNATE_IO_WORKERS",
        show_default=False,
        help="Threads each process copies and checksums with, 1 to 64 (default: half the cores it may "
        "run on, 2 to 8).",
    ),
]
KeepStagingOption = Annotated[
    int | None,
    typer.Option(
        "--keep-staging-mb",
        metavar="MIB",
        show_default=False,
        help="Staging each target keeps for its next sleep or wake (page-locked on a GPU target), in MiB: "
        "0 gives back what it keeps; default: the target's HIBERNATE_KEEP_STAGING_MB, else 0.",
    ),
]
IoModeOption = Annotated[
    str,
    typer.Option(
        "--io-mode",
        metavar="[auto|direct|buffered]",
        help="auto (direct I/O where the filesystem allows), direct, or buffered.",
    ),
]
TimeoutOption = Annotated[
    float,
    typer.Option(
        "--timeout",
        metavar="SECONDS",
        help="Seconds to wait for the program to leave hibernate.guard() (a vLLM server: for its running "
        "requests to drain) and for its CUDA work to drain: 0 to 86400.",
    ),
]
CheckpointerOption = Annotated[
    str,
    typer.Option(
        "--checkpointer",
        metavar="[auto|driver|binary|none]",
        help="How to drive cuda-checkpoint: auto (the driver API where libcuda has it, else the "
        "cuda-checkpoint binary), driver, binary, or none (free the pools only: every CUDA context "
        "stays on the GPU, no checkpoint call is made).",
    ),
]
CudaCheckpointOption = Annotated[
    Path | None,
    typer.Option(
        "--cuda-checkpoint",
        metavar="PATH",
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
        "a change on the disk goes unnoticed until a wake reads the file from the disk. "
        "Default: $HIBERNATE_SKIP_REUSE_CHECK.",
    ),
]
AllowMovesOption = Annotated[
    bool,
    typer.Option(
        "--allow-moves",
        help="Sleep even where the process has captured CUDA graphs and tracked CUDA memory outside "
        "hibernate.pool(), which the wake brings back at new addresses: only for a program that "
        "captures its graphs again after each wake. Default: $HIBERNATE_ALLOW_MOVES.",
    ),
]
NoCudaOption = Annotated[
    bool,
    typer.Option("--no-cuda", help="Same as --checkpointer none.", show_default=False),
]


def parse_pid(value: str) -> int:
    """A process id, refused in words that name the bad value (click's own do not)."""
    if isinstance(value, int):  # a default, or a value already converted
        return value
    try:
        pid = int(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r} is not a process id (a positive integer)") from None
    if pid <= 0:
        raise typer.BadParameter(f"{value!r} is not a process id (a positive integer)")
    return pid


OptionalPidsArgument = Annotated[
    list[int] | None,
    typer.Argument(
        parser=parse_pid,
        metavar="PID",
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

IfNeededOption = Annotated[
    bool,
    typer.Option(
        "--if-needed",
        help="Succeed (exit 0) where a target already is in the state asked for: it is left as it is and "
        "listed as skipped, and only the others are acted on (without it: exit 6, wrong state). One that "
        "another command is still at work on is exit 7, one a command left half-way exit 13.",
        show_default=False,
    ),
]

VllmUrlOption = Annotated[
    str | None,
    typer.Option(
        "--vllm-url",
        metavar="URL",
        help="vLLM server only: its address (http://HOST:PORT or unix:/PATH); default: read from the "
        "server's command line (--host/--port/--uds), else vLLM's default port 8000.",
        show_default=False,
    ),
]

F = TypeVar("F", bound=Callable[..., Any])


def parse_directory(value: str) -> Path:
    """A ``--to`` directory. An empty string is refused: ``Path("")`` quietly means the current
    directory, and an empty ``--to "$DIR"`` is a script whose variable was never set."""
    if isinstance(value, Path):  # a default, or a value already converted
        return value
    if value == "":
        raise typer.BadParameter("an empty string names no directory (for the current one, pass --to .)")
    return Path(value)


def to_option(help: str) -> Any:  # typer's OptionInfo
    """``--to DIR`` as every command that takes one declares it: one name, placeholder and check
    (``parse_directory``; ``check_paths`` then refuses a path no directory could have). Only the
    help line is the command's; required where its variant's type has no None (and the command
    gives it no default)."""
    return typer.Option("--to", parser=parse_directory, metavar="DIR", help=help, show_default=False)


# The variants, one per command (the same flag, each command's help line).
SnapshotDirOption = Annotated[Path, to_option("Directory for the snapshots (created 0700 if missing).")]
RunSnapshotDirOption = Annotated[Path, to_option("Directory for the snapshots.")]
NodeSnapshotDirOption = Annotated[
    Path | None, to_option("Snapshot directory (sleep); this node's go to DIR/<node name>.")
]
DoctorSnapshotDirOption = Annotated[
    Path | None, to_option("Where snapshots would go (default: the agent's default directory, if any).")
]
ServeSnapshotDirOption = Annotated[
    Path | None, to_option("Directory for the snapshots of sleeping backends (created 0700 if missing).")
]

# How an error names a command's path parameter, where that is not ``--`` and its name.
PATH_LABELS = {"directory": "DIR"}


def check_paths(values: dict[str, Any]) -> None:
    """Refuse (UsageError, exit 2) a path given to a command that no file or directory could have: a
    name in it longer than its filesystem allows (255 bytes on most), or a path beyond ``PATH_MAX``.
    Checked for every path parameter of every command, and for the runtime directory the environment
    names, before anything is touched, as numbers are."""
    import os

    from hibernate.agent.paths import runtime_dir
    from hibernate.fsutil import path_length_problem

    for name, value in values.items():
        if isinstance(value, Path):
            problem = path_length_problem(value)
            if problem is not None:
                label = PATH_LABELS.get(name, "--" + name.replace("_", "-"))
                raise UsageError(f"{label} {problem}; nothing was changed")
    problem = path_length_problem(runtime_dir())
    if problem is not None:
        named = [v for v in ("HIBERNATE_RUNTIME_DIR", "XDG_RUNTIME_DIR", "TMPDIR") if os.environ.get(v)]
        label = f"the runtime directory ({named[0]})" if named else "the runtime directory"
        raise UsageError(
            f"{label} {problem}; nothing was changed", hint="set HIBERNATE_RUNTIME_DIR to a shorter directory"
        )


def handles_errors(func: F) -> F:
    """Turn HibernateError into its exit code and message (JSON when --json), and a Ctrl-C into
    exit 130 with its line or document, so a script reading stdout gets one whatever happened.

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
            check_paths(kwargs)
            return func(*args, **kwargs)
        except HibernateError as exc:
            raise typer.Exit(render.error(exc, bool(kwargs.get("as_json")))) from None
        except KeyboardInterrupt:  # outside an operation (one reports its targets' states itself)
            from hibernate.errors import InterruptedByUserError

            interrupted = InterruptedByUserError("interrupted (Ctrl-C)")
            raise typer.Exit(render.error(interrupted, bool(kwargs.get("as_json")))) from None

    return wrapper  # type: ignore[return-value]


def select_targets(
    pids: list[int] | None, every: bool, job: str | None, cgroup: str | None, *, sleeping: bool = False
) -> Selection:
    """The targets of a command: its pids and the processes its selectors find (sched.selectors.select)."""
    from hibernate.sched.selectors import select

    return select(pids, every=every, job=job, cgroup=cgroup, sleeping=sleeping)


def by_selector(selection: Selection) -> bool:
    """Whether a selector (--all, --job, --cgroup) chose targets, rather than pids alone."""
    return any(source["selector"] != "pids" for source in selection.sources)


def with_selection(document: dict[str, Any], selection: Selection) -> dict[str, Any]:
    """Add how the targets were selected to a JSON document, when selectors were used."""
    if by_selector(selection):
        document["selection"] = selection.to_wire()
    return document


def or_env(flag: bool) -> bool | None:
    """A yes/no flag whose default is an environment variable's (``--skip-reuse-check``,
    ``--allow-moves``), as ``options_from_flags`` takes it: True where given, else None (the
    variable decides: ``environ.flag_or_env``)."""
    return True if flag else None
