"""``hibernate doctor [PID]``: the command; its checks are :mod:`hibernate.doctor`.

The checks are a package of their own, imported when the command runs, so
that ``--help`` does not load them. The command function is ``examine``: a
function named ``doctor`` would shadow this module as an attribute of the package.
"""

from __future__ import annotations

from typing import Annotated

import typer

from hibernate.cli.options import (
    CheckpointerOption,
    CudaCheckpointOption,
    DoctorSnapshotDirOption,
    JsonOption,
    handles_errors,
    parse_pid,
    quiet_option,
)
from hibernate.errors import ExitCode


@handles_errors
def examine(
    pid: Annotated[
        int | None,
        typer.Argument(
            parser=parse_pid,
            metavar="PID",
            help="A target to examine too (any process of its tree).",
            show_default=False,
        ),
    ] = None,
    to: DoctorSnapshotDirOption = None,
    checkpointer: CheckpointerOption = "auto",
    cuda_checkpoint: CudaCheckpointOption = None,
    as_json: JsonOption = False,
    quiet: Annotated[bool, quiet_option("Only the checks that are not ok (nothing when all are).")] = False,
) -> None:
    """What this machine (and target) can and cannot do, each with a fix. Exit 12 if any check fails."""
    from hibernate import doctor
    from hibernate.cli import render
    from hibernate.operation.options import cuda_options

    cuda = cuda_options(checkpointer, cuda_checkpoint)
    report = doctor.run(pid, to, cuda.checkpointer_kind, cuda.cuda_checkpoint)
    if as_json:
        render.print_json(report)
    else:
        render.doctor_report(report, only_problems=quiet)
    if not report["ok"]:
        raise typer.Exit(int(ExitCode.UNSUPPORTED))
