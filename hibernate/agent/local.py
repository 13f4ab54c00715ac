"""This process's one agent: created on first use, its control socket opened with it.

A forked child starts with none: it is a different process and must not answer
for its parent.

A socket that cannot be opened (the runtime directory belongs to another user,
its path is too long) never ends the program hibernate was imported into: the
agent runs unserved and the reason is kept (``unserved_reason``), for the
public API to decide what that means (hibernate.__init__: off) and to say once.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

from hibernate import procinfo
from hibernate.agent import server as agent_server
from hibernate.agent.controller import Agent
from hibernate.agent.paths import runtime_dir
from hibernate.errors import HibernateError

_lock = threading.Lock()
_agent: Agent | None = None
_server: agent_server.AgentServer | None = None
_unserved: str | None = None  # why the socket could not be opened, once that was tried and failed
_said_unserved = False


def _reset_after_fork() -> None:
    global _agent, _server, _lock, _unserved, _said_unserved
    _agent = None
    _server = None
    _unserved = None
    _said_unserved = False
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def local_agent(*, name: str | None = None, runtime: str = "torch", serve: bool | None = None) -> Agent:
    """This process's agent, created (and its socket opened, unless ``HIBERNATE_AGENT=0``) on first call.

    Opening the socket is tried once: where it fails, the agent stays unserved
    for the life of the process and ``unserved_reason`` says why.
    """
    global _agent, _server, _unserved
    with _lock:
        if _agent is None:
            ident = procinfo.identity(os.getpid())
            if ident is None:
                raise HibernateError("cannot read this process's identity from /proc")
            _agent = Agent(ident, name=name, runtime=runtime)
        if serve is None:
            serve = os.environ.get("HIBERNATE_AGENT", "1") != "0"
        if serve and _server is None and _unserved is None:
            directory = runtime_dir()
            try:
                server = agent_server.AgentServer(_agent, directory)
            except (HibernateError, OSError) as exc:
                _unserved = _why_unserved(exc, directory)
            else:
                _server = server
                atexit.register(server.stop)
        return _agent


def _why_unserved(exc: BaseException, directory: object) -> str:
    if isinstance(exc, HibernateError):
        return exc.message
    return f"cannot listen in {directory}: {getattr(exc, 'strerror', None) or exc}"


def unserved_reason() -> str | None:
    """Why this process's agent has no socket although one was asked for (None: it has, or none was)."""
    with _lock:
        return _unserved


def say_unserved_once(consequence: str) -> None:
    """One line on stderr, the first time only: why the socket is missing, ``consequence``, what to set.

    Not ``warnings.warn``: a program run with ``-W error`` would end on it.
    """
    global _said_unserved
    with _lock:
        if _unserved is None or _said_unserved:
            return
        _said_unserved = True
        reason = _unserved
    line = (
        f"hibernate: this process's agent did not start ({reason}); {consequence}. Set HIBERNATE_RUNTIME_DIR "
        "(or XDG_RUNTIME_DIR) to a directory only your user can write, then restart the program"
    )
    with contextlib.suppress(OSError, ValueError):  # no usable stderr: the program goes on regardless
        print(line, file=sys.stderr, flush=True)


def server_path() -> str | None:
    """The socket this process's agent listens on, if it was started."""
    return str(_server.path) if _server is not None else None
