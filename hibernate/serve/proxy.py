"""The HTTP side: an aiohttp server in front of the backends, an aiohttp client to them.

Requests and answers pass through unchanged (hop-by-hop headers aside), an
answer chunk by chunk as the backend writes it (server-sent events included).
A client that goes away cancels its handler (``handler_cancellation``), which
closes the upstream connection: the backend sees its client leave.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from hibernate.serve.backends import Fleet
from hibernate.serve.config import ServeConfig
from hibernate.serve.control import BackendControl
from hibernate.serve.metrics import Recorder
from hibernate.serve.routing import MODELS_PATH, ApiError, models_list, route

# Headers about one connection, not the message (RFC 9110 section 7.6.1), and those aiohttp recomputes.
HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
     "trailer", "transfer-encoding", "upgrade", "host")
)  # fmt: skip
STATUS_PATH = "/hibernate/status"
METRICS_PATH = "/metrics"


def forwarded_headers(headers: Any, *, request: bool) -> list[tuple[str, str]]:
    """The end-to-end headers of a message; a request's Content-Length is set again from its body."""
    drop = HOP_BY_HOP | {"content-length"} if request else HOP_BY_HOP
    return [(k, v) for k, v in headers.items() if k.lower() not in drop]


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


class Proxy:
    def __init__(
        self, config: ServeConfig, fleet: Fleet, recorder: Recorder, control: BackendControl
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.recorder = recorder
        self.control = control
        self.session: ClientSession | None = None
        self.active = 0  # requests being handled now
        self.ready = asyncio.Event()  # set once every backend was adopted: requests wait for it

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        app.on_startup.append(self._open_session)
        app.on_cleanup.append(self._close_session)
        return app

    async def _open_session(self, app: web.Application) -> None:
        limits = self.config.limits
        self.session = ClientSession(
            connector=TCPConnector(limit=limits.max_connections),
            timeout=ClientTimeout(total=None, sock_connect=10, sock_read=limits.upstream_timeout),
            auto_decompress=False,  # the bytes the backend sent, compressed or not
        )

    async def _close_session(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """Every request: the proxy's own answers, else routed, woken for and forwarded; bounded in number."""
        limit = self.config.limits.max_requests
        if self.active >= limit:
            error = ApiError(
                503,
                f"the proxy is handling {limit} requests already (max_requests); retry later",
                "ServiceUnavailableError",
            )
            self.recorder.request("", error.status)
            return error_response(error)
        self.active += 1
        try:
            await self.ready.wait()
            return await self._handle(request)
        finally:
            self.active -= 1

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        backend = ""
        try:
            own = await self._own(request)
            if own is not None:
                return own
            body = await self._body(request)
            target = route(request.method, request.path_qs, body, self.config.backends)
            backend = target.backend
            return await self._forward(request, backend, target.path, body, started)
        except ApiError as error:
            self.recorder.request(backend, error.status)
            return error_response(error)

    async def _own(self, request: web.Request) -> web.StreamResponse | None:
        """The proxy's own answers: /metrics, /hibernate/status, /v1/models (none of them wakes anyone)."""
        if request.method != "GET":
            return None
        if request.path == METRICS_PATH:
            data, content_type = self.recorder.exposition()
            return web.Response(body=data, headers={"Content-Type": content_type})
        if request.path == STATUS_PATH:
            return web.json_response(await self.status())
        if request.path == MODELS_PATH:
            states = {name: b.state.value for name, b in self.fleet.backends.items()}
            return web.json_response(models_list(self.config.backends, states))
        return None

    async def status(self) -> dict[str, Any]:
        """Every backend as the proxy sees it, with what ``hibernate status PID --json`` lists for it."""
        entries = []
        for backend in self.fleet.backends.values():
            agents = await asyncio.to_thread(self.control.status, backend.pid)
            entries.append({**backend.view(time.monotonic()), "agents": agents})  # now: after the await
        return {"ok": True, "backends": entries}

    async def _body(self, request: web.Request) -> bytes:
        """The whole request body, bounded in size and in time (a slow client is answered 408)."""
        limits = self.config.limits
        declared = request.content_length
        if declared is not None and declared > limits.max_body_bytes:
            raise self._too_large(declared)
        try:
            return await asyncio.wait_for(request.read(), limits.body_timeout)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {limits.body_timeout:g}s",
                "invalid_request_error",
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large(None) from None

    def _too_large(self, size: int | None) -> ApiError:
        limit = self.config.limits.max_body_bytes
        what = f"{size} bytes" if size is not None else "more"
        return ApiError(
            413, f"the request body is {what}; the limit is {limit} bytes", "invalid_request_error"
        )

    async def _forward(
        self, request: web.Request, name: str, path: str, body: bytes, started: float
    ) -> web.StreamResponse:
        assert self.session is not None
        before = time.monotonic()
        response: web.StreamResponse | None = None
        async with self.fleet.use(name) as backend:
            asked = time.monotonic()
            waited = asked - before
            try:
                upstream_cm = self.session.request(
                    request.method,
                    backend.spec.url + path,
                    headers=forwarded_headers(request.headers, request=True),
                    data=body,
                    allow_redirects=False,
                )
                async with upstream_cm as upstream:
                    answered = time.monotonic()
                    response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
                    for key, value in forwarded_headers(upstream.headers, request=False):
                        response.headers.add(key, value)
                    await response.prepare(request)
                    self.recorder.latency(name, (time.monotonic() - started - waited) - (answered - asked))
                    async for chunk in upstream.content.iter_any():
                        await response.write(chunk)
                    # Counted before the end goes out: a client holding the whole answer finds it counted.
                    self.recorder.request(name, response.status)
                    await response.write_eof()
            except (ClientError, TimeoutError) as exc:
                if response is not None and response.prepared:
                    raise  # mid-answer: the client sees the connection end, as it would from the backend
                error = ApiError(
                    502, f"backend {name} did not answer: {exc or type(exc).__name__}", "BadGatewayError"
                )
                self.recorder.request(name, error.status)
                return error_response(error)
        return response
