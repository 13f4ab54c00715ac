"""The one typer app: every command registered under its name, in the order ``--help`` lists them.

The commands live in modules by family (operations, sched, serve, doctor) and
their shared flags in hibernate.cli.options; this module only names them.
Names are given here, not taken from the functions, so a command keeps its
name whatever its function is called (``ls`` is ``list_agents``, ``serve``
is ``run_proxy``, ``doctor`` is ``examine``: a function named like a module
of this package would shadow that module).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Annotated, Any

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
    rich_markup_mode=None,  # plain help and errors: they read the same piped, in a log, on a terminal
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)
app.command("sleep")(operations.sleep)
app.command("wake")(operations.wake)
app.command("recover")(operations.recover)
app.command("status")(operations.status)
app.command("ls")(operations.list_agents)
app.command("gc")(operations.gc)
app.command("export")(operations.export)
app.command("run", context_settings=PASS_THROUGH)(sched.run)
app.command("node-step")(sched.node_step)
app.command("serve", context_settings=PASS_THROUGH)(serve.run_proxy)
app.command("doctor")(doctor.examine)
app.command("slurm-scripts")(sched.slurm_scripts)


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


# What click raises for a bad command line (a missing option, an unknown one, a value of the wrong
# type): found by name, as typer vendors click in some versions and depends on it in others.
_ClickException: type[Exception] = next(
    cls for cls in typer.BadParameter.__mro__ if cls.__name__ == "ClickException"
)


def wants_json(args: Sequence[str], group: Any = None) -> bool:
    """Whether a command line asks for ``--json``: among the command's own arguments, not a job's
    (``hibernate run -- job --json``, or ``hibernate run job --json``: for ``run`` and ``serve``,
    whatever follows the first argument that is not an option belongs to the program).

    ``group``: the app's click group where the caller built it already (building it again took
    0.08 s of every command's start)."""
    own = list(args[: args.index("--")] if "--" in args else args)
    if group is None:
        group = typer.main.get_command(app)
    command = group.commands.get(own[0]) if own else None
    if command is not None and command.context_settings == PASS_THROUGH:  # run, serve
        own = own[: 1 + _first_program_word(own[1:], command)]
    return "--json" in own


def _first_program_word(args: Sequence[str], command: Any) -> int:
    """The index of the first word of ``args`` that is neither an option of ``command`` nor the
    value of one (len(args) if none): where the program's own command line starts."""
    takes_value = {
        name
        for param in command.params
        if param.param_type_name == "option" and not param.is_flag and not getattr(param, "count", False)
        for name in param.opts
    }
    index = 0
    while index < len(args):
        word = args[index]
        if not word.startswith("-") or word == "-":
            return index
        index += 2 if word in takes_value else 1  # --opt=value is one word
    return index


def readable_help(command: Any) -> None:  # click's Command: vendored by typer in some versions
    """Show an argument by its placeholder alone (``PID``), not followed by its Python type, and a
    required one in the usage line as ``DIR`` (optional ones are ``[PID]...``), not ``{DIR}``.

    Every parameter declares its placeholder (``metavar``: PID, DIR, SECONDS, a choice as
    ``[auto|direct|buffered]``); typer 0.2x prints an argument's type after it all the same
    (``PID <list[int]>``), which tells a user nothing the placeholder does not. Versions without
    that method show the placeholder alone already. The usage line is made by ``_usage_display_name``
    in typer 0.29 and by ``make_metavar`` before it: both are given the plain placeholder.
    """
    for sub in getattr(command, "commands", {}).values():
        readable_help(sub)
    for param in command.params:
        if param.param_type_name != "argument" or not param.metavar:
            continue
        if hasattr(param, "display_type_rich"):
            param.display_type_rich = lambda ctx: None
        dots = "..." if param.nargs != 1 else ""
        if hasattr(param, "_usage_display_name"):  # typer 0.29: the usage line's own name
            if param.required:  # `{DIR}`: as the usual `DIR`
                param._usage_display_name = lambda usage=param.metavar + dots: usage
        elif hasattr(param, "make_metavar"):  # before: one placeholder for the usage line and the help
            metavar = param.metavar
            usage = metavar + dots if param.required else f"[{metavar}]{dots}"
            param.make_metavar = lambda ctx, *, usage=False, shown=usage, metavar=metavar: (
                shown if usage else metavar
            )


def main() -> None:
    """The ``hibernate`` console script and ``python -m hibernate``.

    With ``--json`` a bad command line is reported as the one JSON document every failure is (exit
    code 2, ``usage``), not as click's box on stderr: a script that parses stdout must get a
    document whatever went wrong, and the first thing to go wrong is often a flag.
    """
    args = sys.argv[1:]
    command = typer.main.get_command(app)
    readable_help(command)
    if not wants_json(args, command):
        command.main(args)
        return
    try:
        code = command.main(args, standalone_mode=False)
    except _ClickException as exc:
        from hibernate.cli import render
        from hibernate.errors import UsageError

        context = getattr(exc, "ctx", None)
        where = context.command_path if context is not None else "hibernate"
        message = exc.format_message()  # type: ignore[attr-defined]
        error = UsageError(message, hint=f"see `{where} --help`")
        sys.exit(render.error(error, as_json=True))
    except typer.Abort:
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)
