"""Talking to an agent from outside its process (the CLI, the orchestrator, tests)."""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hibernate.agent import protocol
from hibernate.errors import (
    HibernateError,
    HibernateTimeoutError,
    PermissionDeniedError,
    error_from_wire,
)

ProgressFn = Callable[[dict[str, Any]], None]


class AgentConnectionLostError(HibernateError):
    """The agent's end closed: its process exited or was killed."""

    wire_name = "connection-lost"


AgentConnectionLost = AgentConnectionLostError  # the former name, for code that catches it


class AgentClient:
    def __init__(self, path: Path, *, timeout: float = 30.0) -> None:
        self.path = path
        self.timeout = timeout
        self._ids = itertools.count(1)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(str(path))
        except PermissionError as exc:
            self._sock.close()
            raise PermissionDeniedError(f"not allowed to connect to the agent at {path}") from exc
        except (ConnectionRefusedError, FileNotFoundError) as exc:
            self._sock.close()
            raise AgentConnectionLostError(f"no agent is listening at {path}") from exc
        except TimeoutError as exc:
            self._sock.close()
            raise HibernateTimeoutError(f"the agent at {path} did not accept within {timeout:g}s") from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _refusal(self) -> HibernateError | None:
        """An error frame the agent sent before closing, if one is waiting."""
        try:
            self._sock.settimeout(1.0)
            message = protocol.receive(self._sock)
        except (OSError, HibernateError):
            return None
        if message is not None and message.get("type") == "error":
            return error_from_wire(message.get("error"))
        return None

    def call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        progress: ProgressFn | None = None,
        silence_timeout: float | None = None,
    ) -> dict[str, Any]:
        """Send one request and wait for its result; ``silence_timeout`` bounds silence, not length."""
        request_id = next(self._ids)
        self._sock.settimeout(silence_timeout if silence_timeout is not None else self.timeout)
        try:
            try:
                protocol.send(self._sock, protocol.request(request_id, op, args))
            except (BrokenPipeError, ConnectionResetError) as exc:
                # The agent may have refused us (wrong user) and hung up before our request
                # arrived: its reason is then already waiting to be read.
                raise self._refusal() or AgentConnectionLostError(
                    f"the agent at {self.path} went away during {op!r}"
                ) from exc
            while True:
                message = protocol.receive(self._sock)
                if message is None:
                    raise AgentConnectionLostError(
                        f"the agent at {self.path} closed the connection during {op!r}"
                    )
                if message.get("id") not in (request_id, 0):
                    continue  # a late reply to a request this client gave up on
                kind = message.get("type")
                if kind == "progress":
                    if progress is not None and isinstance(message.get("progress"), dict):
                        progress(message["progress"])
                    continue
                if kind == "error":
                    raise error_from_wire(message.get("error"))
                if kind == "result":
                    result = message.get("result")
                    return result if isinstance(result, dict) else {}
                raise AgentConnectionLostError(f"unexpected reply from the agent at {self.path}: {message!r}")
        except TimeoutError as exc:
            waited = silence_timeout if silence_timeout is not None else self.timeout
            raise HibernateTimeoutError(
                f"the agent at {self.path} did not answer {op!r} within {waited:g}s"
            ) from exc
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise AgentConnectionLostError(f"the agent at {self.path} went away during {op!r}") from exc
