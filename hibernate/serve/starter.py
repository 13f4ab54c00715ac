"""Backends started on demand: the ``command`` of a ``[[backend]]``, run by the first request for it.

The command runs in its own process group (stopping it stops its children), with
its output in a log file of a private (0700) directory, ``<runtime dir>/serve-<proxy
pid>/<backend>.log`` (the runtime directory of ``hibernate status``: ``$HIBERNATE_RUNTIME_DIR``,
else ``$XDG_RUNTIME_DIR/hibernate``, else ``/tmp/hibernate-<uid>``). It is ready once
a connection to its address reaches it and, if it has a ``health_path``, that path
answers 200. A start that fails says why with the end of that log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from hibernate.agent.paths import runtime_dir
from hibernate.errors import ExitCode, HibernateError, HibernateTimeoutError, UsageError
from hibernate.fsutil import ensure_private_dir
from hibernate.serve import discovery
from hibernate.serve.config import TOKEN_ENV, BackendSpec

TAIL_BYTES = 2000  # of a failed start's log, in its error
POLL_SECONDS = 0.2


class StartError(HibernateError):
    """A backend's command did not become ready: it exited, or could not be run (a start that timed
    out is a :class:`HibernateTimeoutError`). For ``-- COMMAND`` this ends serve with exit 3, as a
    target that exits during an operation ends ``hibernate sleep``: not 1, which says "a bug"."""

    exit_code = ExitCode.NO_SUCH_PROCESS
    wire_name = "no-such-process"


def choose_port(host: str) -> int:
    """A port free on ``host`` now, for a backend's ``${PORT}``: the one the kernel gives a socket bound
    to port 0 there, closed at once for the backend's server to take when it starts."""
    try:
        family, kind, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind) as probe:
            probe.bind(address)
            port: int = probe.getsockname()[1]
    except OSError as exc:
        raise UsageError(
            f"cannot choose a port for ${{PORT}} on {host}: {exc.strerror or exc}",
            hint="a backend's url names an address of this machine",
        ) from None
    return port


def log_directory() -> Path:
    """This proxy's private directory for the logs of what it starts (created 0700)."""
    directory = runtime_dir() / f"serve-{os.getpid()}"
    ensure_private_dir(directory)
    return directory


def log_path(directory: Path, name: str) -> Path:
    """A backend's log file; its name made a file name (``Org/Model`` -> ``Org_Model.log``)."""
    return directory / (name.replace("/", "_").replace(":", "_") + ".log")


def child_environment(
    extra: tuple[tuple[str, str], ...] = (), environ: dict[str, str] | None = None
) -> dict[str, str]:
    """What a started backend's process gets: serve's environment and ``extra``, but never the
    control endpoints' token (HIBERNATE_SERVE_TOKEN): a model server has no use for it."""
    env = {**(os.environ if environ is None else environ), **dict(extra)}
    env.pop(TOKEN_ENV, None)
    return env


def spawn(spec: BackendSpec, log: Path) -> subprocess.Popen[bytes]:
    """Run the backend's command, its output appended to ``log`` (0600)."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    try:
        return subprocess.Popen(
            list(spec.command),
            cwd=spec.cwd,
            env=child_environment(spec.env),
            stdin=subprocess.DEVNULL,
            stdout=fd,
            stderr=fd,
            start_new_session=True,
        )
    except OSError as exc:  # not found, not executable, no such cwd
        raise StartError(
            f"backend {spec.name}: cannot run {spec.command[0]}: {exc.strerror or exc}"
        ) from None
    finally:
        os.close(fd)


# The backend is on this machine's own address: a proxy named by http_proxy in the environment is not
# asked for it.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def healthy(url: str, timeout: float = 2.0) -> bool:
    try:
        with _DIRECT.open(url, timeout=timeout) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError, ValueError):
        return False


def wait_ready(
    spec: BackendSpec, proc: subprocess.Popen[bytes], timeout: float, stop: threading.Event | None = None
) -> None:
    """Until the started backend listens on its address (and answers its ``health_path``), or exits,
    or ``timeout`` passes, or ``stop`` is set (serve is stopping)."""
    host, port = spec.host_port
    deadline = time.monotonic() + timeout
    listening = False
    stop = stop or threading.Event()
    while True:
        if stop.is_set():
            raise StartError(f"backend {spec.name}: start given up: serve is stopping")
        if proc.poll() is not None:
            raise StartError(f"backend {spec.name}'s command exited with status {proc.returncode}")
        if not listening:
            try:
                listening = discovery.server_at(host, port) is not None
            except HibernateError:
                listening = False
        if listening and (spec.health_path is None or healthy(spec.url + spec.health_path)):
            return
        if time.monotonic() > deadline:
            what = f"answer 200 on {spec.health_path}" if listening else f"listen on port {port}"
            raise HibernateTimeoutError(f"backend {spec.name} did not {what} within {timeout:g}s")
        stop.wait(POLL_SECONDS)


def tail(log: Path, limit: int = TAIL_BYTES) -> str:
    """The end of a log, whole lines, for an error message."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(size - limit, 0))
            data = f.read()
    except OSError:
        return ""
    text = data.decode(errors="replace")
    if size > limit and "\n" in text:
        text = text.split("\n", 1)[1]
    return text.strip()


def stop(proc: subprocess.Popen[bytes] | None, timeout: float) -> None:
    """SIGTERM to the process group, SIGKILL after ``timeout``; reaped either way."""
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


def check_command(spec: BackendSpec) -> None:
    """At serve's start: a command that cannot be found, or a cwd that is no directory, is refused."""
    import shutil

    label = f"backend {spec.name}: command"
    if spec.cwd is not None and not spec.cwd.is_dir():
        raise UsageError(f"backend {spec.name}: cwd {spec.cwd} is not a directory")
    program = spec.command[0]
    if "/" in program and spec.cwd is not None and not os.path.isabs(program):
        program = str(spec.cwd / program)
    if shutil.which(program, path={**os.environ, **dict(spec.env)}.get("PATH")) is None:
        raise UsageError(f"{label} {spec.command[0]}: no such command (not found, or not executable)")
