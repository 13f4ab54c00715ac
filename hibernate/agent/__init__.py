"""The in-process agent: the state machine of this process's memory and its control socket.

``hibernator()`` returns this process's single Hibernator, starting its
control server on first use (unless ``HIBERNATE_AGENT=0``). A forked child
starts with none: it is a different process and must not answer for its parent.

The CLI imports this package too, for the client side (``paths``, ``protocol``,
``client``): the in-process side (the controller, and through it the pools and
the store) is therefore loaded only when it is first asked for, so that a
command on a login node or in a scheduler hook stays light.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING, Any

from hibernate import procinfo
from hibernate.agent.paths import runtime_dir
from hibernate.errors import HibernateError

if TYPE_CHECKING:
    from hibernate.agent.controller import AgentState, Hibernator, Session

__all__ = ["AgentState", "Hibernator", "Session", "hibernator", "server_path"]

_lock = threading.Lock()
_hibernator: Hibernator | None = None
_server: object | None = None
_IN_PROCESS = ("AgentState", "Hibernator", "Session")


def __getattr__(name: str) -> Any:
    """The controller's classes, imported on first use (see the module docstring)."""
    if name in _IN_PROCESS:
        from hibernate.agent import controller

        return getattr(controller, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _reset_after_fork() -> None:
    global _hibernator, _server, _lock
    _hibernator = None
    _server = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def hibernator(*, name: str | None = None, kind: str = "torch", serve: bool | None = None) -> Hibernator:
    """This process's Hibernator, created (and its socket opened) on first call."""
    global _hibernator, _server
    from hibernate.agent.controller import Hibernator

    with _lock:
        if _hibernator is None:
            ident = procinfo.identity(os.getpid())
            if ident is None:
                raise HibernateError("cannot read this process's identity from /proc")
            _hibernator = Hibernator(ident, name=name, kind=kind)
        if serve is None:
            serve = os.environ.get("HIBERNATE_AGENT", "1") != "0"
        if serve and _server is None:
            from hibernate.agent.server import AgentServer

            server = AgentServer(_hibernator, runtime_dir())
            _server = server
            atexit.register(server.stop)
        return _hibernator


def server_path() -> str | None:
    """The socket this process's agent listens on, if it was started."""
    server = _server
    return str(getattr(server, "path", "")) or None
