"""The agent's wire protocol: length-prefixed JSON over a Unix stream socket.

Frame: 4-byte big-endian length, then that many bytes of UTF-8 JSON (one
object). Frames above MAX_MESSAGE_BYTES are refused before being read, so a
peer cannot make the agent allocate. JSON only: nothing received is executed.

Request:  {"v": 1, "id": N, "op": "spill", "args": {...}}
Replies:  {"v": 1, "id": N, "type": "progress", "progress": {...}}   (zero or more)
          {"v": 1, "id": N, "type": "result", "result": {...}}
          {"v": 1, "id": N, "type": "error", "error": {"code", "message", "hint"}}

A peer speaking another major version ``v`` is answered with a "protocol"
error and the connection is closed.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from hibernate.errors import ProtocolError

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 1 << 20
_HEADER = struct.Struct("!I")
HEADER_BYTES = _HEADER.size
MAX_ID = 2**53


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_MESSAGE_BYTES} limit")
    return _HEADER.pack(len(body)) + body


def send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall(encode(message))


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 16))
        if not chunk:
            if got == 0:
                return None
            raise ProtocolError("connection closed in the middle of a message")
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def receive(sock: socket.socket) -> dict[str, Any] | None:
    """The next message, or None when the peer closed the connection cleanly."""
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    length = body_length(header)
    body = _recv_exact(sock, length)
    if body is None:
        raise ProtocolError("connection closed in the middle of a message")
    return decode(body)


def body_length(header: bytes) -> int:
    """The length a frame's header (HEADER_BYTES) announces; refused above the limit."""
    (length,) = _HEADER.unpack(header)
    if length > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {length} bytes exceeds the {MAX_MESSAGE_BYTES} limit")
    return int(length)


def decode(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(f"malformed message: {exc}") from exc
    if not isinstance(message, dict):
        raise ProtocolError("malformed message: not a JSON object")
    return message


def parse_request(message: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """Validate a request's envelope; raises ProtocolError with what is wrong."""
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version!r} is not supported (this agent speaks {PROTOCOL_VERSION})",
            hint="use the same hibernate version for the command and the target",
        )
    request_id = message.get("id")
    if not isinstance(request_id, int) or isinstance(request_id, bool) or not 0 <= request_id < MAX_ID:
        raise ProtocolError(f"request id {request_id!r} is not a non-negative integer")
    op = message.get("op")
    if not isinstance(op, str) or not op or len(op) > 64:
        raise ProtocolError(f"request op {op!r} is not a short string")
    args = message.get("args", {})
    if not isinstance(args, dict):
        raise ProtocolError("request args must be an object")
    return request_id, op, args


def request(request_id: int, op: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "id": request_id, "op": op, "args": args or {}}


def reply(request_id: int, kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    key = {"result": "result", "error": "error", "progress": "progress"}[kind]
    return {"v": PROTOCOL_VERSION, "id": request_id, "type": kind, key: payload}
