"""The commands batch schedulers use: run (hibernate a job on its warning signal) and node-step.

The command-line face of hibernate.sched: each parses its flags
(hibernate.cli.options) and calls into hibernate.sched, imported when the
command runs so that ``--help`` loads none of it. ``node-step`` is hidden: it
is one node's part of a job-wide operation, run by scripts/slurm/hibernate-job.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from hibernate.cli.options import (
    AllOption,
    AllowMovesOption,
    BufferOption,
    CgroupOption,
    CheckpointerOption,
    CudaCheckpointOption,
    ForceOption,
    IoModeOption,
    JobOption,
    JsonOption,
    NoCudaOption,
    NodeSnapshotDirOption,
    OptionalPidsArgument,
    QuietOption,
    RunSnapshotDirOption,
    SkipReuseCheckOption,
    TimeoutOption,
    handles_errors,
    or_env,
)
from hibernate.errors import UsageError


@handles_errors
def run(
    command: Annotated[
        list[str], typer.Argument(metavar="COMMAND", help="The job to run, after --.", show_default=False)
    ],
    to: RunSnapshotDirOption,
    on_signal: Annotated[
        str, typer.Option("--on-signal", metavar="SIGNAL", help="Signal that puts the job to sleep.")
    ] = "USR1",
    wake_signal: Annotated[
        str,
        typer.Option(
            "--wake-signal", metavar="SIGNAL", help="Signal that wakes it ('' for none: use hibernate wake)."
        ),
    ] = "USR2",
    timeout: TimeoutOption = 30.0,
    buffer_mb: BufferOption = 256,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    no_cuda: NoCudaOption = False,
    as_json: Annotated[bool, typer.Option("--json", hidden=True)] = False,
) -> None:
    """Run a job and hibernate it on a scheduler's warning signal (Slurm --signal=B:USR1@120)."""
    from hibernate import orchestrator
    from hibernate.sched import runner

    if as_json:  # refused in words (and as the error document a script asking for JSON can read)
        raise UsageError(
            "hibernate run has no --json: the job owns stdout, and run exits with the job's own status",
            hint="for the state of the job's processes, `hibernate status --json` (from another shell)",
        )

    options = orchestrator.options_from_flags(
        timeout=timeout,
        buffer_mb=buffer_mb,
        checkpointer=checkpointer,
        cuda_checkpoint=cuda_checkpoint,
        no_cuda=no_cuda,
        lock_timeout=timeout,
    )
    raise typer.Exit(runner.run(command, to, on_signal, wake_signal or None, options))


@handles_errors
def node_step(
    operation: Annotated[
        str, typer.Argument(metavar="sleep|wake", help="sleep or wake.", show_default=False)
    ],
    barrier: Annotated[
        Path,
        typer.Option(
            "--barrier", metavar="DIR", help="A fresh directory every node shares, the same for all of them."
        ),
    ],
    pids: OptionalPidsArgument = None,
    every: AllOption = False,
    job: JobOption = None,
    cgroup: CgroupOption = None,
    to: NodeSnapshotDirOption = None,
    nodes: Annotated[
        int | None,
        typer.Option(
            "--nodes",
            metavar="N",
            help="Nodes taking part (default: $SLURM_STEP_NUM_NODES, $SLURM_NNODES).",
            show_default=False,
        ),
    ] = None,
    node_index: Annotated[
        int | None,
        typer.Option(
            "--node-index",
            metavar="N",
            help="This node's index (default: $SLURM_NODEID).",
            show_default=False,
        ),
    ] = None,
    node: Annotated[
        str | None,
        typer.Option(
            "--node-name",
            metavar="NAME",
            help="This node's name (default: $SLURMD_NODENAME, the host name).",
            show_default=False,
        ),
    ] = None,
    barrier_timeout: Annotated[
        float,
        typer.Option(
            "--barrier-timeout",
            metavar="SECONDS",
            help="Seconds from the start until silent nodes count as failed (to 86400).",
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
    allow_moves: AllowMovesOption = False,
    as_json: JsonOption = False,
    quiet: QuietOption = False,
) -> None:
    """One node's part of a job-wide sleep or wake: run once on every node (hibernate-job does, under srun).

    The nodes agree through the barrier directory: every node ends asleep, or every node ends awake.
    """
    from hibernate import orchestrator
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
        options=lambda: orchestrator.options_from_flags(
            timeout=timeout,
            buffer_mb=buffer_mb,
            io_mode=io_mode,
            checkpointer=checkpointer,
            cuda_checkpoint=cuda_checkpoint,
            no_cuda=no_cuda,
            force=force,
            lock_timeout=timeout if operation == "sleep" else None,
            skip_reuse_check=or_env(skip_reuse_check) if operation == "sleep" else False,
            allow_moves=or_env(allow_moves),
            job=job,
            cgroup=cgroup,
        ),
        progress=lambda: render.TerminalProgress(enabled=not (as_json or quiet)),
    )
    if error is not None:  # the nodes agreed to abort: the whole picture, then the verdict's exit code
        document["error"] = render.error_wire(error)
    if as_json:
        # On one line: srun passes its tasks' output on line by line, the nodes' lines interleaved,
        # so each node's document must be one line to be read apart from the others.
        sys.stdout.write(json.dumps(document, sort_keys=True) + "\n")
        sys.stdout.flush()
    else:
        render.result(document, lambda: render.node_step_report(document), as_json=False, quiet=quiet)
    if error is not None:
        if not as_json:
            render.error(error, False)
        raise typer.Exit(int(error.exit_code))


@handles_errors
def slurm_scripts() -> None:
    """Print the directory of the Slurm scripts installed with hibernate.

    hibernate-job, hibernate-suspend and hibernate-resume (also on PATH) and the example batch
    scripts (*.sbatch), e.g. `cp "$(hibernate slurm-scripts)"/train-phases.sbatch .`
    """
    from hibernate.errors import UnsupportedError
    from hibernate.sched import slurm

    directory = slurm.scripts_directory()
    if directory is None:
        raise UnsupportedError(
            "the Slurm scripts were not installed with this hibernate",
            hint="install hibernate with pip (they come with the package), or take them from scripts/slurm/ "
            "of its source",
        )
    typer.echo(str(directory))
