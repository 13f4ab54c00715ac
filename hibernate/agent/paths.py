"""Where agents listen: one socket per process in a private runtime directory.

    $HIBERNATE_RUNTIME_DIR, else $XDG_RUNTIME_DIR/hibernate, else <tmp>/hibernate-<uid>
      agent-<pid>-<start_time>.sock

The socket's name carries the process identity, so a socket left by a dead
process (or by an earlier process with the same pid) is recognised as stale
without connecting to it, and removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

from hibernate import procinfo
from hibernate.errors import UsageError
from hibernate.procinfo import ProcessIdentity

_SOCKET_RE = re.compile(r"^agent-(\d+)-(\d+)\.sock$")
_CRASH_RE = re.compile(r"^agent-(\d+)-(\d+)\.crash$")
_MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL


def runtime_dir(uid: int | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The runtime directory for ``uid`` given its environment (default: ours)."""
    env = os.environ if environ is None else environ
    uid = os.getuid() if uid is None else uid
    if env.get("HIBERNATE_RUNTIME_DIR"):
        return Path(env["HIBERNATE_RUNTIME_DIR"])
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "hibernate"
    return Path(tempfile.gettempdir()) / f"hibernate-{uid}"


def socket_name(ident: ProcessIdentity) -> str:
    return f"agent-{ident.pid}-{ident.start_time}.sock"


def socket_path(directory: Path, ident: ProcessIdentity) -> Path:
    path = directory / socket_name(ident)
    if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
        raise UsageError(
            f"socket path {path} is longer than {_MAX_SOCKET_PATH} bytes",
            hint="set HIBERNATE_RUNTIME_DIR to a shorter directory",
        )
    return path


def crash_record_path(socket: Path) -> Path:
    """Where the agent listening at ``socket`` writes how it died during a restore (agent/crash.py)."""
    return socket.with_suffix(".crash")


def parse_socket_name(name: str) -> ProcessIdentity | None:
    match = _SOCKET_RE.match(name)
    return ProcessIdentity(int(match.group(1)), int(match.group(2))) if match else None


def _named(directory: Path, pattern: re.Pattern[str]) -> list[tuple[ProcessIdentity, Path]]:
    """Every file in ``directory`` named as ``pattern`` names an agent's, with the process its name claims."""
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    found = []
    for name in names:
        match = pattern.match(name)
        if match:
            found.append((ProcessIdentity(int(match.group(1)), int(match.group(2))), directory / name))
    return found


def _sockets(directory: Path) -> list[tuple[ProcessIdentity, Path]]:
    """Every agent socket in ``directory``, live or stale, with the process its name claims."""
    return _named(directory, _SOCKET_RE)


def live_sockets(directory: Path) -> list[tuple[ProcessIdentity, Path]]:
    """Sockets in ``directory`` whose process (pid and start time) still lives."""
    return [(ident, path) for ident, path in _sockets(directory) if procinfo.is_alive(ident)]


def sweep_stale_sockets(directory: Path) -> None:
    """Delete the sockets (and crash records) of processes that are gone: nobody will ever answer there."""
    for ident, path in [*_sockets(directory), *_named(directory, _CRASH_RE)]:
        if not procinfo.is_alive(ident):
            with contextlib.suppress(OSError):
                os.unlink(path)
