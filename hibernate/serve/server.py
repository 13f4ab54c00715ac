"""``hibernate serve`` from start to stop: start the backend it was given, adopt every backend, serve,
and on SIGTERM stop accepting, let the requests in flight finish (bounded) and stop what it started."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time

from aiohttp import web

from hibernate.errors import HibernateTimeoutError
from hibernate.serve import discovery
from hibernate.serve.backends import STATES, Fleet
from hibernate.serve.config import BackendSpec, ServeConfig
from hibernate.serve.hibernator import Hibernator, refuse_tree_holding_proxy
from hibernate.serve.metrics import Recorder
from hibernate.serve.proxy import Proxy

log = logging.getLogger("hibernate.serve")


def start_command(config: ServeConfig) -> subprocess.Popen[bytes] | None:
    """``-- COMMAND``: started in its own process group, so that stopping it stops its children too."""
    if not config.command:
        return None
    log.info("starting backend %s: %s", config.start, " ".join(config.command))
    return subprocess.Popen(list(config.command), start_new_session=True)


def wait_listening(spec: BackendSpec, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the started backend listens on its port (its model loaded), or fails, or ``timeout``."""
    _, port = spec.host_port
    deadline = time.monotonic() + timeout
    while discovery.listener_pid(port) is None:
        if proc.poll() is not None:
            raise HibernateTimeoutError(f"backend {spec.name}'s command exited with status {proc.returncode}")
        if time.monotonic() > deadline:
            raise HibernateTimeoutError(
                f"backend {spec.name} did not listen on port {port} within {timeout:g}s"
            )
        time.sleep(0.2)


def stop_command(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def serve(config: ServeConfig) -> None:
    for spec in config.backends:  # before anything starts: a wrong pid is bad input
        if spec.pid is not None:
            refuse_tree_holding_proxy(spec.name, spec.pid)
    started = start_command(config)
    try:
        if started is not None:
            spec = next(s for s in config.backends if s.name == config.start)
            await asyncio.to_thread(wait_listening, spec, started, config.wake_timeout)
        await _serve(config)
    finally:
        await asyncio.to_thread(stop_command, started, config.limits.shutdown_timeout)


async def _serve(config: ServeConfig) -> None:
    recorder = Recorder(STATES)
    hibernator = Hibernator(config.to, config.sleep_timeout)
    fleet = Fleet(
        config.backends,
        hibernator,
        recorder,
        idle=config.idle,
        wake_timeout=config.wake_timeout,
        budget=config.gpu_budget,
        measure_gpu=config.measure_gpu,
    )
    await fleet.adopt()
    limits = config.limits
    runner = web.AppRunner(
        Proxy(config, fleet, recorder, hibernator).app(),
        handler_cancellation=True,  # a client that leaves cancels its request, upstream too
        max_line_size=limits.max_header_bytes,
        max_field_size=limits.max_header_bytes,
        shutdown_timeout=limits.shutdown_timeout,
        keepalive_timeout=limits.idle_timeout,  # also bounds a client that sends its headers slowly
        access_log=None,
    )
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    where = ", ".join(f"http://{h}:{p}" for h, p, *_ in runner.addresses)
    scope = "this machine only" if config.is_local else "ANY machine that can reach it (no authentication)"
    log.info("listening on %s (%s)", where, scope)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    idle = asyncio.ensure_future(fleet.watch())
    try:
        await stop.wait()
        log.info("stopping: no new requests; those in flight have %gs to finish", limits.shutdown_timeout)
    finally:
        idle.cancel()
        await runner.cleanup()
        await fleet.drain(limits.shutdown_timeout)
        log.info("stopped")


def run(config: ServeConfig) -> int:
    logging.basicConfig(level=logging.INFO, format="hibernate serve: %(message)s")
    asyncio.run(serve(config))
    return 0
