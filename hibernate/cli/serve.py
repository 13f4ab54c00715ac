"""``hibernate serve``: the HTTP proxy that puts idle model servers to sleep and wakes them on demand.

The command-line face of hibernate.serve, which lives in an extra (aiohttp,
prometheus-client): its settings are checked first (hibernate.serve.config,
standard library only), and the server itself is imported last, so ``--help``
and a refused setting work without the extra, and a missing one says what to
install. The command function is ``run_proxy`` because a function named
``serve`` would shadow this module as an attribute of the package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hibernate.cli.options import ServeSnapshotDirOption, handles_errors, quiet_option

SERVE_EXTRA_HINT = "pip install 'hibernate[serve]' (aiohttp and prometheus-client)"


@handles_errors
def run_proxy(
    command: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="COMMAND",
            help="After --: a backend to start and stop with the proxy (see --start).",
            show_default=False,
        ),
    ] = None,
    to: ServeSnapshotDirOption = None,
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
        str | None,
        typer.Option(
            "--listen", metavar="HOST:PORT", help="HOST:PORT to serve on. [default: 127.0.0.1:8000]"
        ),
    ] = None,
    idle: Annotated[
        float | None,
        typer.Option(
            "--idle",
            metavar="SECONDS",
            help="Put a backend to sleep after this many seconds without a request. [default: never]",
            show_default=False,
        ),
    ] = None,
    wake_timeout: Annotated[
        float | None,
        typer.Option(
            "--wake-timeout",
            metavar="SECONDS",
            help="Longest a request waits for its backend to wake. [default: 300]",
        ),
    ] = None,
    gpu_budget: Annotated[
        str | None,
        typer.Option(
            "--gpu-budget",
            metavar="SIZE|auto",
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
            "--config",
            metavar="FILE",
            help="serve.toml: the same settings, plus per-backend ones.",
            show_default=False,
        ),
    ] = None,
    token_file: Annotated[
        Path | None,
        typer.Option(
            "--token-file",
            metavar="FILE",
            help="A file of yours (or root's), mode 600, holding the bearer token of /hibernate/models "
            "(sleep, wake); else HIBERNATE_SERVE_TOKEN. Without one they are on only when listening on "
            "loopback.",
            show_default=False,
        ),
    ] = None,
    log_format: Annotated[
        str, typer.Option("--log-format", metavar="[text|json]", help="How log lines are written.")
    ] = "text",
    quiet: Annotated[bool, quiet_option("Log warnings and errors only.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also log every request (debug).")] = False,
) -> None:
    """Serve HTTP in front of model servers: sleep them when idle, wake them on the first request."""
    import logging
    import os

    from hibernate.errors import UnsupportedError, UsageError
    from hibernate.serve import config as serve_config

    if log_format not in ("text", "json"):
        raise UsageError(f"--log-format must be text or json, not {log_format!r}")
    if quiet and verbose:
        raise UsageError("--quiet and --verbose: choose one")
    level = logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO

    document = serve_config.load_toml(config) if config is not None else None
    settings = serve_config.build_config(
        listen=listen,
        to=to,
        backend_flags=backend or [],
        idle=idle,
        wake_timeout=wake_timeout,
        gpu_budget=gpu_budget,
        command=command or [],
        start=start,
        document=document,
        source=str(config) if config is not None else "serve.toml",
        token_file=token_file,
        environ=os.environ,
    )
    try:
        from hibernate.serve import server
    except ModuleNotFoundError as exc:
        if exc.name not in ("aiohttp", "prometheus_client"):
            raise
        raise UnsupportedError(
            f"hibernate serve needs {exc.name}, which is not installed", hint=SERVE_EXTRA_HINT
        ) from None
    raise typer.Exit(server.run(settings, log_format, level))
