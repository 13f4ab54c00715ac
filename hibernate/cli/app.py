"""The one typer app: every command registered under its name, in the order ``--help`` lists them.

The commands live in modules by family (operations, sched, serve, doctor) and
their shared flags in hibernate.cli.options; this module only names them.
Names are given here, not taken from the functions, so a command keeps its
name whatever its function is called (``ls`` is ``list_agents``, ``serve``
is ``run_proxy``, ``doctor`` is ``examine``: a function named like a module
of this package would shadow that module).
"""

from __future__ import annotations

from typing import Annotated

import typer

from hibernate.cli import doctor, operations, sched, serve
from hibernate.version import __version__

# `run` and `serve` pass what follows `--` to a program: their own options must come before it.
PASS_THROUGH = {"allow_interspersed_args": False}

app = typer.Typer(
    name="hibernate",
    help="Put a live GPU process to sleep (weights to files, GPU freed) and wake it in place.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)
app.command("sleep")(operations.sleep)
app.command("wake")(operations.wake)
app.command("recover")(operations.recover)
app.command("status")(operations.status)
app.command("ls")(operations.list_agents)
app.command("gc")(operations.gc)
app.command("run", context_settings=PASS_THROUGH)(sched.run)
app.command("serve", context_settings=PASS_THROUGH)(serve.run_proxy)
app.command("node-step", hidden=True)(sched.node_step)
app.command("doctor")(doctor.examine)


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
    """The ``hibernate`` console script and ``python -m hibernate``."""
    app()
