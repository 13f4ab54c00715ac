"""The demo target's OpenAI-style HTTP API (``python -m hibernate.demo serve --http-port``).

What it answers is described in :mod:`hibernate.demo`'s docstring: ``GET
/v1/models``, ``POST /v1/completions`` and ``/v1/chat/completions`` (streamed
or not) over the demo's ``infer``, refused (503) while the process sleeps, and
the demo-only ``/demo/step`` and ``/demo/stats`` that tests drive. It lives
apart from the model so that the target (the model, its probes and graphs,
its control commands) reads on its own; it knows the model only through the
``infer`` callable it is given.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class HttpApi:
    """The demo's OpenAI-style HTTP API over ``infer`` (see the module's docstring)."""

    def __init__(self, infer: Callable[[], dict[str, Any]], model: str) -> None:
        self.infer = infer
        self.model = model
        self.steps = threading.Semaphore(0)  # POST /demo/step: one more token of the paced streams
        self.lock = threading.Lock()
        self.stats = {
            "completions": 0, "streams_started": 0, "streams_finished": 0, "cancelled": 0,
            "keep_alive_received": 0,  # requests whose body had a keep_alive field (a proxy takes it out)
        }  # fmt: skip

    def count(self, key: str) -> None:
        with self.lock:
            self.stats[key] += 1

    def completion(self) -> dict[str, Any]:
        """One inference, or why there is none: what a client gets, the same bytes every time."""
        import hibernate
        from hibernate.errors import HibernatingError

        try:
            with hibernate.guard(wait=False):
                result = self.infer()
        except HibernatingError as exc:
            return {
                "error": {"message": str(exc), "type": "ServiceUnavailableError", "param": None, "code": 503}
            }
        return {
            "id": "cmpl-demo",
            "object": "text_completion",
            "model": self.model,
            "choices": [
                {"index": 0, "text": " ".join(map(str, result["tokens"])), "finish_reason": "length"}
            ],
            "digest": result["digest"],
        }

    def chat(self, answer: dict[str, Any]) -> dict[str, Any]:
        """A completion as OpenAI's chat API answers it: the text as the assistant's message."""
        text = answer["choices"][0]["text"]
        return {
            "id": "chatcmpl-demo",
            "object": "chat.completion",
            "created": 0,
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 0, "completion_tokens": len(text.split(" ")), "total_tokens": 0},
            "digest": answer["digest"],
        }

    def chat_chunks(self, answer: dict[str, Any]) -> Iterator[bytes]:
        """A streamed chat completion: the role, one delta per token, then the finish reason with the digest.

        Every event is a chunk an OpenAI client can read (the digest rides in an extra field of the
        last one), then ``[DONE]``.
        """

        def chunk(delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"id": "chatcmpl-demo", "object": "chat.completion.chunk", "created": 0,
                    "model": self.model, "choices": [choice]}  # fmt: skip

        yield event(chunk({"role": "assistant", "content": ""}, None))
        for piece in pieces(answer["choices"][0]["text"]):
            yield event(chunk({"content": piece}, None))
        yield event({**chunk({}, answer["choices"][0]["finish_reason"]), "digest": answer["digest"]})
        yield b"data: [DONE]\n\n"

    def chunks(self, answer: dict[str, Any]) -> Iterator[bytes]:
        """A streamed completion: one chunk per token, then the finish reason with the digest, then [DONE].

        The last chunk's text is empty, as OpenAI's is: it carries the finish reason and, in an extra
        field a client ignores, the digest a test compares with an unstreamed answer's.
        """

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}
            return {"id": answer["id"], "object": "text_completion", "created": 0,
                    "model": self.model, "choices": [choice]}  # fmt: skip

        for piece in pieces(answer["choices"][0]["text"]):
            yield event(chunk(piece, None))
        yield event({**chunk("", answer["choices"][0]["finish_reason"]), "digest": answer["digest"]})
        yield b"data: [DONE]\n\n"


def pieces(text: str) -> list[str]:
    """The text cut into what a stream sends, one token each: joined again they are the text, exactly."""
    tokens = text.split(" ")
    return [token + " " for token in tokens[:-1]] + tokens[-1:]


def event(chunk: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return f"data: {json.dumps(chunk)}\n\n".encode()


def client_gone(conn: socket.socket) -> bool:
    """Whether the peer closed the connection (readable, and nothing to read)."""
    readable, _, _ = select.select([conn], [], [], 0)
    if not readable:
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def http_handler(api: HttpApi) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, document: Any) -> None:
            data = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/v1/models":
                model = {"id": api.model, "object": "model", "created": 0, "owned_by": "hibernate-demo"}
                self._send(200, {"object": "list", "data": [model]})
            elif self.path == "/health":
                self._send(200, {})
            elif self.path == "/demo/stats":
                with api.lock:
                    self._send(200, dict(api.stats))
            else:
                self._send(404, {"error": {"message": "Not Found", "type": "NotFoundError", "code": 404}})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path == "/demo/step":
                api.steps.release()
                self._send(200, {"stepped": True})
                return
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, {"error": {"message": "Not Found", "type": "NotFoundError", "code": 404}})
                return
            try:
                request = json.loads(body)
            except ValueError:
                self._send(400, {"error": {"message": "not JSON", "type": "BadRequestError", "code": 400}})
                return
            if request.get("model") != api.model:
                message = f"The model `{request.get('model')}` does not exist."
                self._send(404, {"error": {"message": message, "type": "NotFoundError", "code": 404}})
                return
            if isinstance(request, dict) and "keep_alive" in request:
                api.count("keep_alive_received")
            answer = api.completion()
            chat = self.path == "/v1/chat/completions"
            if "error" in answer:
                self._send(503, answer)
            elif request.get("stream"):
                chunks = api.chat_chunks(answer) if chat else api.chunks(answer)
                self._stream(chunks, bool(request.get("paced")))
            else:
                api.count("completions")
                self._send(200, api.chat(answer) if chat else answer)

        def _stream(self, chunks: Iterator[bytes], paced: bool) -> None:
            api.count("streams_started")
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for index, chunk in enumerate(chunks):
                if paced and index > 0 and not self._step():
                    api.count("cancelled")
                    self.close_connection = True
                    return
                try:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                except OSError:
                    api.count("cancelled")
                    self.close_connection = True
                    return
            # Counted before the last frame: a client that has the whole answer finds it counted.
            api.count("streams_finished")
            self.wfile.write(b"0\r\n\r\n")

        def _step(self) -> bool:
            """Wait for the next POST /demo/step; False when the client left first."""
            while not api.steps.acquire(timeout=0.05):
                if client_gone(self.connection):
                    return False
            return True

    return Handler


class DemoHttpServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the listen backlog: a proxy may open hundreds of connections at once


def serve_http(api: HttpApi, port: int, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    server = DemoHttpServer((host, port), http_handler(api))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
