"""The agent's control server: a Unix socket served from daemon threads inside the target.

Only the same user (or root) may talk to it: the runtime directory is 0700 and
every connection's peer credentials (SO_PEERCRED) are checked before a byte of
it is read. Each connection is one session; a long operation runs on the
connection's thread and polls the socket so that a client that disappears
(killed, timed out) aborts it instead of leaving the process half asleep.
The leases a connection holds (a proxy's requests in flight) end with it too.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
from pathlib import Path
from typing import Any

from hibernate.agent import protocol
from hibernate.agent.controller import Agent, Session, describe_error
from hibernate.agent.paths import crash_record_path, socket_path
from hibernate.agent.wire import ConfigureArgs, HelloArgs, LeaseArgs, SpillArgs, WaitArgs
from hibernate.errors import PermissionDeniedError, ProtocolError, UsageError
from hibernate.fsutil import ensure_private_dir

_UCRED = struct.Struct("3i")


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel saw it connect."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return pid, uid, gid


def peer_allowed(peer_uid: int, own_uid: int) -> bool:
    return peer_uid == own_uid or peer_uid == 0


class _Connection:
    def __init__(self, conn: socket.socket, agent: Agent, peer_pid: int, peer_uid: int) -> None:
        self.conn = conn
        self.agent = agent
        self._send_lock = threading.Lock()
        self.session = Session(
            description=f"hibernate (pid {peer_pid}, uid {peer_uid})",
            cancelled=self._peer_gone,
            peer=f"pid {peer_pid}, uid {peer_uid}",
        )
        self._current_id = 0
        self.session.progress = self._send_progress

    def _peer_gone(self) -> bool:
        """True when the client closed its end (EOF is readable without blocking)."""
        try:
            readable, _, _ = select.select([self.conn], [], [], 0)
            if not readable:
                return False
            return self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    def _send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            protocol.send(self.conn, message)

    def _send_progress(self, progress: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            self._send(protocol.reply(self._current_id, "progress", progress))

    def serve(self) -> None:
        try:
            while True:
                try:
                    message = protocol.receive(self.conn)
                except ProtocolError as exc:
                    with contextlib.suppress(OSError):
                        self._send(protocol.reply(0, "error", exc.to_wire()))
                    return
                if message is None:
                    return
                try:
                    request_id, op, args = protocol.parse_request(message)
                except ProtocolError as exc:
                    self._send(protocol.reply(0, "error", exc.to_wire()))
                    return
                self._current_id = request_id
                try:
                    result = self._dispatch(op, args)
                except BaseException as exc:  # every failure goes back to the client
                    self._send(protocol.reply(request_id, "error", describe_error(exc).to_wire()))
                else:
                    self._send(protocol.reply(request_id, "result", result))
        except OSError:
            return
        finally:
            self.agent.disconnect(self.session)
            with contextlib.suppress(OSError):
                self.conn.close()

    def _dispatch(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        h, s = self.agent, self.session
        if op == "hello":
            return h.status(contents=HelloArgs.from_wire(args).contents)
        if op == "status":
            return h.status()
        if op == "begin":
            h.begin(s)
            # Its asker reads the state, leases and snapshot of the process it now owns; the pools
            # it was told of by the hello that found the agent.
            return h.status(contents=False)
        if op == "end":
            h.end(s)
            return h.status()
        if op == "configure":
            directory = ConfigureArgs.from_wire(args).directory
            return h.configure(Path(directory) if directory else None)
        if op == "lease":
            return h.lease(s, LeaseArgs.from_wire(args).by)
        if op == "unlease":
            return h.unlease(s)
        if op == "close_leases":
            return h.close_leases(s, WaitArgs.from_wire(args).timeout)
        if op == "quiesce":
            return h.quiesce(s, WaitArgs.from_wire(args).timeout)
        if op == "spill":
            directory = SpillArgs.from_wire(args).directory
            return h.spill(s, Path(directory) if directory else None, args)
        if op == "release":
            return h.release(s)
        if op == "restore":
            return h.restore(s, args)
        if op == "resume":
            return h.resume(s)
        raise ProtocolError(f"unknown operation {op!r}")


def _answers(path: Path) -> bool:
    """Whether a process listens on the socket at ``path`` (a leftover refuses the connection)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        probe.connect(os.fspath(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class AgentServer:
    """Listens on the process's socket until :meth:`stop` or process exit."""

    def __init__(self, agent: Agent, directory: Path) -> None:
        self.agent = agent
        self.directory = directory
        ensure_private_dir(directory)
        self.path = socket_path(directory, agent.identity)
        if _answers(self.path):
            # Same pid and start tick, yet alive: a process of another pid namespace (a container
            # sharing this directory). Taking its socket over would hand its commands to us.
            raise UsageError(
                f"{self.path} is the live socket of another process with this pid and start time "
                "(a process of another container sharing this runtime directory)",
                hint="give each container its own runtime directory (HIBERNATE_RUNTIME_DIR)",
            )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # nobody answers there: a leftover of this very process
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)
        try:
            self._sock.bind(os.fspath(self.path))
            self._sock.listen(16)
        except BaseException:
            self._sock.close()
            raise
        finally:
            os.umask(old_umask)
        agent.crash_record = crash_record_path(self.path)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="hibernate-agent", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        own_uid = os.getuid()
        while not self._stopped.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                continue
            try:
                peer_pid, peer_uid, _ = peer_credentials(conn)
            except OSError:
                conn.close()
                continue
            if not peer_allowed(peer_uid, own_uid):
                with contextlib.suppress(OSError):
                    error = PermissionDeniedError(
                        f"uid {peer_uid} may not control process {self.agent.identity.pid} "
                        f"(owned by uid {own_uid})"
                    )
                    protocol.send(conn, protocol.reply(0, "error", error.to_wire()))
                conn.close()
                continue
            handler = _Connection(conn, self.agent, peer_pid, peer_uid)
            threading.Thread(target=handler.serve, name="hibernate-agent-conn", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)
