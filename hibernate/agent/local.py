"""This process's one agent: created on first use, its control socket opened with it.

A forked child starts with none: it is a different process and must not answer
for its parent.
"""

from __future__ import annotations

import atexit
import os
import threading

from hibernate import procinfo
from hibernate.agent import server as agent_server
from hibernate.agent.controller import Agent
from hibernate.agent.paths import runtime_dir
from hibernate.errors import HibernateError

_lock = threading.Lock()
_agent: Agent | None = None
_server: agent_server.AgentServer | None = None


def _reset_after_fork() -> None:
    global _agent, _server, _lock
    _agent = None
    _server = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def local_agent(*, name: str | None = None, kind: str = "torch", serve: bool | None = None) -> Agent:
    """This process's agent, created (and its socket opened, unless ``HIBERNATE_AGENT=0``) on first call."""
    global _agent, _server
    with _lock:
        if _agent is None:
            ident = procinfo.identity(os.getpid())
            if ident is None:
                raise HibernateError("cannot read this process's identity from /proc")
            _agent = Agent(ident, name=name, kind=kind)
        if serve is None:
            serve = os.environ.get("HIBERNATE_AGENT", "1") != "0"
        if serve and _server is None:
            server = agent_server.AgentServer(_agent, runtime_dir())
            _server = server
            atexit.register(server.stop)
        return _agent


def server_path() -> str | None:
    """The socket this process's agent listens on, if it was started."""
    return str(_server.path) if _server is not None else None
