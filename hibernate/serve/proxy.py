"""The HTTP side: an aiohttp server in front of the backends, an aiohttp client to them.

Requests and answers pass through unchanged (hop-by-hop headers aside), an
answer chunk by chunk as the backend writes it (server-sent events included).
A client that goes away cancels its handler (``handler_cancellation``), which
closes the upstream connection: the backend sees its client leave.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import re
import time
from typing import Any

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web

from hibernate.serve.backends import RETRY_BUSY_SECONDS, RETRY_FULL_SECONDS, Fleet
from hibernate.serve.bodies import CONTENT_ENCODING, codings, decode_body, with_model
from hibernate.serve.config import (
    MAX_SECONDS,
    PROBE_ANSWER,
    PROBE_FORWARD_OR_503,
    TOKEN_ENV,
    BackendSpec,
    ServeConfig,
    probe_path,
)
from hibernate.serve.control import BackendControl
from hibernate.serve.httplog import HTTP_LOG
from hibernate.serve.metrics import Recorder
from hibernate.serve.routing import MODELS_PATH, ApiError, models_list, route, without_keep_alive

# Headers about one connection, not the message (RFC 9110 section 7.6.1), and those aiohttp recomputes.
HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te",
     "trailer", "transfer-encoding", "upgrade", "host")
)  # fmt: skip
STATUS_PATH = "/hibernate/status"
METRICS_PATH = "/metrics"
HEALTH_PATHS = ("/health", "/healthz")
CONTROL_PATH = "/hibernate/models"  # GET: every backend; POST .../{name}/sleep, .../{name}/wake
KEEP_ALIVE_HEADER = "X-Hibernate-Keep-Alive"
# What the proxy itself reads from a request, never forwarded.
OWN_HEADERS = frozenset((KEEP_ALIVE_HEADER.lower(),))
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"

log = logging.getLogger("hibernate.serve")


def forwarded_headers(headers: Any, *, request: bool) -> list[tuple[str, str]]:
    """The end-to-end headers of a message; a request's Content-Length is set again from its body, and
    its Content-Encoding is left out where the proxy decoded the body (:mod:`bodies`)."""
    drop = HOP_BY_HOP | OWN_HEADERS | {"content-length"} if request else HOP_BY_HOP
    if request and codings(headers.get(CONTENT_ENCODING)):
        drop = drop | {CONTENT_ENCODING.lower()}
    return [(k, v) for k, v in headers.items() if k.lower() not in drop]


def error_response(error: ApiError, headers: dict[str, str] | None = None) -> web.Response:
    """An OpenAI-style error; every 503 says when to retry (Retry-After, seconds)."""
    extra = dict(headers or {})
    if error.status == 503:
        extra["Retry-After"] = str(error.retry_after or RETRY_FULL_SECONDS)
    return web.json_response(error.body(), status=error.status, headers=extra)


def authorize(config: ServeConfig, authorization: str | None) -> ApiError | None:
    """Whether a request to the control endpoints may go on: None if so, else the refusal.

    Off when the proxy listens beyond loopback with no token configured; with a token, a request
    must carry it (``Authorization: Bearer TOKEN``), compared in constant time."""
    if not config.control_enabled:
        return ApiError(
            403,
            f"the control endpoints are off: the proxy listens on {config.host} (not loopback) and no "
            f"token is configured; give --token-file FILE (or token_file in serve.toml, or {TOKEN_ENV})",
            "PermissionDeniedError",
        )
    if config.token is None:
        return None
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), config.token.encode()):
        return ApiError(
            401, "this endpoint needs the proxy's token: Authorization: Bearer TOKEN", "AuthenticationError"
        )
    return None


def backend_for(name: str, backends: tuple[BackendSpec, ...]) -> BackendSpec:
    """The backend a control request names: by its name, or by one of its models."""
    for spec in backends:
        if name == spec.name:
            return spec
    for spec in backends:
        if name in spec.model_names:
            return spec
    raise ApiError(404, f"no backend or model named {name!r}", "NotFoundError")


# A keep-alive given as text: seconds, or a duration with its unit (``-1``, ``30``, ``2.5``, ``5m``, ``1h``).
KEEP_ALIVE_TEXT = re.compile(r"(-?[0-9]+(?:\.[0-9]+)?)([smh]?)")
UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600}


def parse_keep_alive(value: object) -> float | None:
    """A request's keep-alive (Ollama's ``keep_alive``): how long its backend stays awake after it, in
    seconds; 0 puts it to sleep as soon as this request ends, a negative value keeps it awake (no idle
    sleep) until a request says otherwise. A finite number, or a string of digits with an optional unit
    (``30s``, ``5m``, ``1h``), at most a day (as every time in serve.toml). None when ``value`` is none
    of these."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond any float
            return None
    elif isinstance(value, str):
        match = KEEP_ALIVE_TEXT.fullmatch(value.strip().lower())
        if match is None:
            return None
        number = float(match[1]) * UNIT_SECONDS[match[2]]
    else:
        return None
    if not math.isfinite(number) or number > MAX_SECONDS:
        return None
    return math.inf if number < 0 else number + 0.0  # -0 is 0: sleep after this request


def keep_alive_of(header: str | None, field: object) -> float | None:
    """A request's keep-alive, from its header or else its body's ``keep_alive`` field; a value that
    is neither a number of seconds nor a duration (30s, 5m, 1h) is a 400."""
    for value, where in ((header, KEEP_ALIVE_HEADER), (field, "keep_alive")):
        if value is None:
            continue
        seconds = parse_keep_alive(value)
        if seconds is None:
            raise ApiError(
                400,
                f"{where} must be a number of seconds (0: sleep after this request; negative: stay "
                f"awake) or a duration such as 5m, at most {MAX_SECONDS:g} seconds, not {value!r}",
                "invalid_request_error",
                "keep_alive",
            )
        return seconds
    return None


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
        if request.path in HEALTH_PATHS:  # answered even at max_requests: busy is not unhealthy
            return self.health()
        limit = self.config.limits.max_requests
        if self.active >= limit:
            error = ApiError(
                503,
                f"the proxy is handling {limit} requests already (max_requests); retry later",
                "ServiceUnavailableError",
                retry_after=RETRY_FULL_SECONDS,
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
        response = await self._answer(request, started)
        if log.isEnabledFor(logging.DEBUG):  # --verbose: every request, once it is answered
            log.debug(
                "%s %s -> %d (%.3f s)",
                request.method,
                request.path,
                response.status,
                time.monotonic() - started,
            )
        return response

    async def _answer(self, request: web.Request, started: float) -> web.StreamResponse:
        backend = ""
        try:
            own = await self._own(request)
            if own is not None:
                return own
            body = await self._body(request)
            target = route(request.method, request.path_qs, body, self.config.backends)
            backend = target.backend
            spec = next(s for s in self.config.backends if s.name == backend)
            probe = spec.probe_action(request.method, target.path) if target.prefixed else None
            if probe is not None:
                return await self._probe(request, spec, target.path, probe, started)
            body, field = without_keep_alive(body) if request.method == "POST" else (body, None)
            if spec.served_model is not None and not target.prefixed:  # an alias: the backend's own name
                body = with_model(body, spec.served_model)
            keep_alive = keep_alive_of(request.headers.get(KEEP_ALIVE_HEADER), field)
            return await self._forward(request, backend, target.path, body, started, keep_alive)
        except ApiError as error:
            self.recorder.request(backend, error.status)
            return error_response(error)

    def health(self) -> web.Response:
        """``/health``, ``/healthz``: the proxy's own, never forwarded, waking nothing. 200 once it serves
        (every backend adopted, whatever its state: asleep is healthy), 503 while it starts."""
        if not self.ready.is_set():
            error = ApiError(503, "starting: adopting the backends", "ServiceUnavailableError")
            return error_response(error)
        states = {name: b.state.value for name, b in self.fleet.backends.items()}
        return web.json_response({"status": "ok", "backends": states})

    async def _probe(
        self, request: web.Request, spec: BackendSpec, path: str, action: str, started: float
    ) -> web.StreamResponse:
        """A probe of a backend (health, metrics, models): forwarded only while it is awake, never
        waking it, never counted as use; otherwise answered as its action says."""
        if action != PROBE_ANSWER:
            async with self.fleet.probe(spec.name) as awake:
                if awake is not None:
                    return await self._send(request, spec.name, awake.spec.url + path, b"", started, 0.0)
        state = self.fleet.backends[spec.name].state.value
        if action == PROBE_FORWARD_OR_503:
            raise ApiError(
                503,
                f"backend {spec.name} is {state}; a request to it (not a probe) wakes it",
                "ServiceUnavailableError",
                retry_after=RETRY_BUSY_SECONDS,
            )
        self.recorder.request(spec.name, 200, "probe_answered")
        bare = probe_path(path)
        if bare == MODELS_PATH:
            return web.json_response(models_list([spec], {spec.name: state}))
        if bare.rsplit("/", 1)[-1] == "metrics":  # an exposition with nothing in it: nothing to scrape
            return web.Response(body=b"", headers={"Content-Type": PROMETHEUS_TEXT})
        return web.json_response({"status": "ok", "backend": spec.name, "state": state})

    async def _own(self, request: web.Request) -> web.StreamResponse | None:
        """The proxy's own answers: /metrics, /hibernate/status, /v1/models, /hibernate/models (none of
        them wakes anyone but a POST .../wake; /hibernate/status and /hibernate/models only for those
        :func:`authorize` lets in)."""
        if request.path == CONTROL_PATH or request.path.startswith(CONTROL_PATH + "/"):
            return await self._control(request)
        if request.method != "GET":
            return None
        if request.path == METRICS_PATH:
            data, content_type = self.recorder.exposition()
            return web.Response(body=data, headers={"Content-Type": content_type})
        if request.path == STATUS_PATH:  # pids and command lines: for whoever may use the control endpoints
            refused = self._authorize(request)
            if refused is not None:
                return refused
            return web.json_response(await self.status())
        if request.path == MODELS_PATH:
            states = {name: b.state.value for name, b in self.fleet.backends.items()}
            return web.json_response(models_list(self.config.backends, states))
        return None

    def _authorize(self, request: web.Request) -> web.Response | None:
        """None if :func:`authorize` lets the request in, else its 401 or 403 (counted, backend "")."""
        refused = authorize(self.config, request.headers.get("Authorization"))
        if refused is None:
            return None
        self.recorder.request("", refused.status)
        return error_response(refused, {"WWW-Authenticate": "Bearer"} if refused.status == 401 else None)

    async def _control(self, request: web.Request) -> web.StreamResponse:
        """``GET /hibernate/models``; ``POST /hibernate/models/{name}/sleep`` and ``.../wake``."""
        refused = self._authorize(request)
        if refused is not None:
            return refused
        rest = request.path[len(CONTROL_PATH) :]
        if rest in ("", "/") and request.method == "GET":
            now = time.monotonic()
            return web.json_response(
                {
                    "object": "list",
                    "data": [self._model_view(b.spec.name, now) for b in self.fleet.backends.values()],
                }
            )
        name, _, action = rest.lstrip("/").rpartition("/")
        if request.method != "POST" or action not in ("sleep", "wake") or not name:
            raise ApiError(
                404,
                f"{request.method} {request.path}: the control endpoints are GET {CONTROL_PATH}, "
                f"POST {CONTROL_PATH}/NAME/sleep and POST {CONTROL_PATH}/NAME/wake",
                "NotFoundError",
            )
        spec = backend_for(name, self.config.backends)
        if action == "wake":
            await self.fleet.wake_now(spec.name)
        else:
            outcome = await self.fleet.sleep_now(spec.name)
            if not outcome.ok:
                status, kind = (409, "ConflictError") if outcome.busy else (500, "InternalServerError")
                raise ApiError(status, f"backend {spec.name} was not put to sleep: {outcome.reason}", kind)
        return web.json_response(self._model_view(spec.name, time.monotonic()))

    def _model_view(self, name: str, now: float) -> dict[str, Any]:
        backend = self.fleet.backends[name]
        view = backend.view(now)
        keep = backend.keep_alive
        view["keep_alive"] = None if keep is None else -1 if keep == float("inf") else keep
        return view

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
            body = await asyncio.wait_for(request.read(), limits.body_timeout)
        except TimeoutError:
            raise ApiError(
                408,
                f"the request body did not arrive within {limits.body_timeout:g}s",
                "invalid_request_error",
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large(None) from None
        try:
            return decode_body(body, request.headers.get(CONTENT_ENCODING), limits.max_body_bytes)
        except ApiError as error:  # a client's mistake, but one worth a line: its body is not what it says
            where = f"{request.method} {request.path}"
            HTTP_LOG.warning("bad request body from %s: %s: %s", request.remote, where, error.message)
            raise

    def _too_large(self, size: int | None) -> ApiError:
        limit = self.config.limits.max_body_bytes
        what = f"{size} bytes" if size is not None else "more"
        return ApiError(
            413, f"the request body is {what}; the limit is {limit} bytes", "invalid_request_error"
        )

    async def _forward(
        self,
        request: web.Request,
        name: str,
        path: str,
        body: bytes,
        started: float,
        keep_alive: float | None = None,
    ) -> web.StreamResponse:
        before = time.monotonic()
        async with self.fleet.use(name, keep_alive) as backend:
            return await self._send(
                request, name, backend.spec.url + path, body, started, time.monotonic() - before
            )

    async def _send(
        self, request: web.Request, name: str, url: str, body: bytes, started: float, waited: float
    ) -> web.StreamResponse:
        """Forward the request to ``url`` and its answer back, chunk by chunk; counted by how it ended."""
        assert self.session is not None
        asked = time.monotonic()
        response: web.StreamResponse | None = None
        counted = False
        try:
            upstream_cm = self.session.request(
                request.method,
                url,
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
                counted = True
                await response.write_eof()
        except asyncio.CancelledError:  # the client left (handler_cancellation): upstream closed too
            if not counted:
                code = response.status if response is not None else 499  # 499: nginx's "client closed"
                self.recorder.request(name, code, "client_cancelled")
            raise
        except (ClientError, TimeoutError, ConnectionResetError) as exc:
            if response is not None and response.prepared:
                if not counted:
                    # writing to a client that left, or reading from a backend that failed
                    cancelled = isinstance(exc, ConnectionResetError)
                    self.recorder.request(
                        name, response.status, "client_cancelled" if cancelled else "backend_failed"
                    )
                raise  # mid-answer: the client sees the connection end, as it would from the backend
            error = ApiError(
                502, f"backend {name} did not answer: {exc or type(exc).__name__}", "BadGatewayError"
            )
            self.recorder.request(name, error.status)
            return error_response(error)
        return response
