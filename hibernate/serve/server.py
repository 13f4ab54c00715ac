"""``hibernate serve`` from start to stop: check what it was given, open its port, start the backend it
was given, adopt every backend, serve, and on SIGTERM stop accepting, let the requests in flight finish
(bounded) and stop what it started.

Everything that can be checked before a backend is touched is (``--to``, the
port to listen on, the pids serve.toml names): a bad value ends the command at
once with one line and its exit code, as the same value given to ``hibernate
sleep`` would, rather than at the first idle sleep.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

from aiohttp import web

from hibernate.errors import HibernateError, UsageError
from hibernate.operation import targets
from hibernate.serve import starter
from hibernate.serve.backends import Fleet
from hibernate.serve.config import ServeConfig, with_ports
from hibernate.serve.control import BackendControl, refuse_tree_holding_proxy
from hibernate.serve.decisions import STATES
from hibernate.serve.httplog import HTTP_LOG
from hibernate.serve.metrics import Recorder
from hibernate.serve.proxy import Proxy

log = logging.getLogger("hibernate.serve")


def start_command(config: ServeConfig) -> subprocess.Popen[bytes] | None:
    """``-- COMMAND``: started in its own process group, so that stopping it stops its children too."""
    if not config.command:
        return None
    log.info("starting backend %s: %s", config.start, " ".join(config.command))
    try:
        return subprocess.Popen(list(config.command), start_new_session=True, env=starter.child_environment())
    except OSError as exc:  # not found, not executable: the command given is wrong
        raise UsageError(f"-- {config.command[0]}: {exc.strerror or exc}") from None


def check_snapshot_dir(directory: Path) -> None:
    """``--to``: a directory we can write in, or one we can create (``hibernate sleep`` creates it)."""
    directory = directory.expanduser().absolute()
    existing = directory
    try:
        while not existing.exists():
            existing = existing.parent
        is_dir = existing.is_dir()
    except OSError as exc:
        raise UsageError(f"--to {directory}: {exc.strerror or exc}") from None
    if not is_dir:
        what = "is a file" if existing == directory else f"cannot be created: {existing} is a file"
        raise UsageError(f"--to {directory} {what}, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "is not writable by you" if existing == directory else f"cannot be created in {existing}"
        raise UsageError(f"--to {directory} {what}", hint="choose a directory you can write to")


def check_at_start(config: ServeConfig) -> None:
    """What can be refused before anything starts: ``--to``, ``-- COMMAND``, the pids serve.toml names."""
    check_snapshot_dir(config.to)
    if config.command and shutil.which(config.command[0]) is None:
        raise UsageError(f"-- {config.command[0]}: no such command (not found, or not executable)")
    for spec in config.backends:
        if spec.command:
            starter.check_command(spec)
        if spec.pid is not None:
            try:
                targets.check_access(spec.pid)
            except HibernateError as exc:
                raise exc.add_context(f"backend {spec.name}") from None
            refuse_tree_holding_proxy(spec.name, spec.pid)


def control_scope(config: ServeConfig) -> str:
    """What the startup log says of /hibernate/models: who may sleep and wake the backends over HTTP."""
    if config.token is not None:
        return f"on, with the token of {config.token_source}"
    if config.is_local:
        return "on (loopback: anyone on this machine)"
    return (
        "OFF: listening beyond loopback without a token (give --token-file, token_file in serve.toml, "
        "or HIBERNATE_SERVE_TOKEN)"
    )


async def listen(runner: web.AppRunner, config: ServeConfig) -> None:
    """Open the port, or end the command with one line (exit 2) before any backend is touched."""
    try:
        await web.TCPSite(runner, config.host, config.port).start()  # requests wait for adoption
    except OSError as exc:
        in_use = exc.errno == errno.EADDRINUSE
        raise UsageError(
            f"--listen {config.host}:{config.port}: {exc.strerror or exc}",
            hint="another server listens there: stop it or choose another port" if in_use else None,
        ) from None


def choose_ports(config: ServeConfig) -> ServeConfig:
    """Each backend's ``${PORT}``, chosen free now, and said in the log (its url, command and env)."""
    chosen = with_ports(config, starter.choose_port)
    for before, after in zip(config.backends, chosen.backends, strict=True):
        if before.port_chosen_by_serve:
            log.info("%s: ${PORT} is %d (%s)", after.name, after.host_port[1], after.url)
    return chosen


async def serve(config: ServeConfig) -> None:
    config = choose_ports(config)
    check_at_start(config)
    recorder = Recorder(STATES)
    control = BackendControl(config.to, config.sleep_timeout)
    fleet = Fleet(
        config.backends,
        control,
        recorder,
        idle_limit=config.idle_limit,
        wake_timeout=config.wake_timeout,
        budget=config.gpu_budget,
        measure_gpu=config.measure_gpu,
    )
    proxy = Proxy(config, fleet, recorder, control)
    limits = config.limits
    runner = web.AppRunner(
        proxy.app(),
        handler_cancellation=True,  # a client that leaves cancels its request, upstream too
        auto_decompress=False,  # the proxy decodes a compressed body itself (hibernate.serve.bodies)
        max_line_size=limits.max_header_bytes,
        max_field_size=limits.max_header_bytes,
        shutdown_timeout=limits.shutdown_timeout,
        keepalive_timeout=limits.idle_timeout,  # also bounds a client that sends its headers slowly
        access_log=None,
        logger=HTTP_LOG,  # a request it cannot serve: one line, never a traceback (httplog)
    )
    await runner.setup()
    watching: asyncio.Future[None] | None = None  # the idle sleeps and the reading back of states
    started: subprocess.Popen[bytes] | None = None
    try:
        await listen(runner, config)
        started = start_command(config)
        if started is not None:
            spec = next(s for s in config.backends if s.name == config.start)
            await asyncio.to_thread(starter.wait_ready, spec, started, config.wake_timeout)
        await fleet.adopt()
        proxy.ready.set()
        where = ", ".join(f"http://{h}:{p}" for h, p, *_ in runner.addresses)
        scope = (
            "this machine only"
            if config.is_local
            else "ANY machine that can reach it: its OpenAI paths have no authentication"
        )
        log.info("listening on %s (%s); control endpoints %s", where, scope, control_scope(config))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        watching = asyncio.ensure_future(fleet.watch())
        await stop.wait()
        log.info("stopping: no new requests; those in flight have %gs to finish", limits.shutdown_timeout)
    finally:
        if watching is not None:
            watching.cancel()
        fleet.stop_starting()  # before the requests in flight are waited for: some wait for a start
        await runner.cleanup()
        await fleet.drain(limits.shutdown_timeout)
        fleet.close()
        stopped = (
            [(config.start or "", started.pid)] if started is not None and started.poll() is None else []
        )
        await asyncio.to_thread(starter.stop, started, limits.shutdown_timeout)
        stopped += await fleet.stop_started(limits.shutdown_timeout)
        if watching is not None:
            names = {name for name, _ in stopped}
            left = [(b.name, b.state.value) for b in fleet.backends.values() if b.name not in names]
            log.info("%s", shutdown_words(stopped, left))


def shutdown_words(stopped: list[tuple[str, int]], left: list[tuple[str, str]]) -> str:
    """serve's last line: the backends it stopped (those it started, with their pids) and those it left
    as they are (with their states), so that an operator knows what is still running."""
    words = ["stopped"]
    if stopped:
        words.append("stopped what it started: " + ", ".join(f"{name} (pid {pid})" for name, pid in stopped))
    if left:
        words.append("left as they are: " + ", ".join(f"{name} ({state})" for name, state in left))
    return "; ".join(words)


class TextFormat(logging.Formatter):
    """``2026-01-31T12:00:00.123Z INFO hibernate serve: message``: UTC, to the millisecond."""

    def format(self, record: logging.LogRecord) -> str:
        return f"{timestamp(record)} {record.levelname} hibernate serve: {record.getMessage()}"


class JsonFormat(logging.Formatter):
    """One JSON object a line: time, level, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        return json.dumps(entry)


def timestamp(record: logging.LogRecord) -> str:
    moment = datetime.fromtimestamp(record.created, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


def setup_logging(log_format: str, level: int) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormat() if log_format == "json" else TextFormat())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)  # other libraries' chatter stays out
    logging.getLogger("hibernate").setLevel(level)


def run(config: ServeConfig, log_format: str = "text", level: int = logging.INFO) -> int:
    setup_logging(log_format, level)
    asyncio.run(serve(config))
    return 0
