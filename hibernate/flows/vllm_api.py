"""Talking to a running vLLM server: where it listens, and its sleep endpoints (CLI side, stdlib only).

vLLM 0.33 serves these only when started with ``VLLM_SERVER_DEV_MODE=1``
(``vllm/entrypoints/serve/dev/sleep/api_router.py``):

    POST /sleep?level=0..2&mode=abort|wait|keep  -> 200 {"status": "sleeping", "level": L}
    POST /wake_up[?tags=T&tags=U...]             -> 200 {"status": "awake"|"sleeping", "tags": [...]|null}
    GET  /is_sleeping                            -> 200 {"is_sleeping": bool}

and always ``GET /version`` -> ``{"version": "..."}``. A failure inside the
engine comes back as ``{"error": {"message", "type", "param", "code"}}`` with
that HTTP status (500 for a worker's exception, 400 for a bad query); a route
that is not served is a 404 in the same shape. Without dev mode the sleep
routes are simply not there: 404, while ``/version`` still answers. That is
how a server without them is told from something that is not vLLM at all.

Where the server listens is taken from ``--vllm-url`` or read from the server
process's own command line (``--host``, ``--port``, ``--uds``, TLS flags),
with vLLM's defaults (all interfaces, port 8000) where a flag is absent; the
caller is always told which, so a wrong guess is easy to correct.

Every request has a timeout. A request that may legitimately run long (the
sleep and the wake, which move the weights) is run with
:meth:`VllmServer.start`, which the caller watches and may abort.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hibernate.errors import (
    HibernateTimeoutError,
    ServerFailedError,
    UnsupportedError,
    UsageError,
)

DEFAULT_PORT = 8000  # vLLM's FrontendArgs.port
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
DRAIN_MODES = ("wait", "abort")  # vLLM's PauseMode values hibernate offers ("keep" is vLLM's third)
START_HINT = (
    "restart the server with the development endpoints and the hibernate backend: "
    f"{DEV_MODE_ENV}=1 vllm serve MODEL --enable-sleep-mode --sleep-mode-backend hibernate"
)
_FLAGS = ("--host", "--port", "--uds", "--ssl-certfile", "--ssl-keyfile", "--config", "--sleep-mode-backend")
_MAX_BODY = 1 << 20


class DevEndpointsMissingError(UnsupportedError):
    """The server is vLLM but serves no /sleep: it was started without VLLM_SERVER_DEV_MODE=1."""


class ServerUnreachableError(UsageError):
    """Nothing answers at the address (a wrong --vllm-url, or a wrong guess from the command line)."""


class ServerConnectionLostError(ServerFailedError):
    """The server closed the connection before answering (it may have died)."""


ServerConnectionLost = ServerConnectionLostError  # the former name, for code that catches it


# -- where the server listens ---------------------------------------------------------


@dataclass(frozen=True)
class ServerAddress:
    url: str  # http://host:port[/prefix], https://..., or unix:/path/to.sock
    found: str  # how it was found, in words, for messages and the report


def flag_values(argv: Sequence[str], names: Sequence[str] = _FLAGS) -> dict[str, str]:
    """The last value of each of ``names`` in ``argv`` (``--x v`` or ``--x=v``; ``_`` spelled as ``-``).

    vLLM parses its flags with argparse, where the last occurrence wins, and
    accepts ``--foo_bar`` for ``--foo-bar``; this reads them the same way.
    """
    wanted = set(names)
    found: dict[str, str] = {}
    items = list(argv)
    for index, item in enumerate(items):
        if not item.startswith("--"):
            continue
        name, sep, value = item.partition("=")
        name = "--" + name[2:].replace("_", "-")
        if name not in wanted:
            continue
        if sep:
            found[name] = value
        elif index + 1 < len(items) and not items[index + 1].startswith("--"):
            found[name] = items[index + 1]
    return found


def _connect_host(host: str | None) -> str:
    """The host to connect to for a server bound to ``host`` (vLLM binds all interfaces by default)."""
    if not host or host == "0.0.0.0":
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    if ":" in host and not host.startswith("["):
        return f"[{host}]"
    return host


def address_from_argv(argv: Sequence[str], pid: int) -> ServerAddress:
    """Where the vLLM server with command line ``argv`` listens, and how that was decided."""
    flags = flag_values(argv)
    if flags.get("--uds"):
        return ServerAddress(f"unix:{flags['--uds']}", f"--uds on the command line of pid {pid}")
    scheme = "https" if flags.get("--ssl-certfile") or flags.get("--ssl-keyfile") else "http"
    host = _connect_host(flags.get("--host"))
    raw_port = flags.get("--port")
    said: list[str] = []
    if raw_port is not None and raw_port.isdigit() and 0 < int(raw_port) < 65536:
        port = int(raw_port)
        said.append(f"--port {port}")
    else:
        port = DEFAULT_PORT
    if flags.get("--host"):
        said.append(f"--host {flags['--host']}")
    if said:
        found = f"{' '.join(said)} on the command line of pid {pid}"
        if "--port" not in flags:
            found += f", vLLM's default port {DEFAULT_PORT}"
    else:
        found = f"vLLM's default address (port {DEFAULT_PORT}): the command line of pid {pid} sets no --port"
    if flags.get("--config"):
        found += f"; it reads --config {flags['--config']}, which may set another port"
    return ServerAddress(f"{scheme}://{host}:{port}", found)


def parse_url(url: str) -> ServerAddress:
    """A ``--vllm-url`` checked: http(s)://host[:port][/prefix] or unix:/path; anything else is refused."""
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if not path.startswith("/"):
            raise UsageError(f"--vllm-url {url!r}: a unix socket must be given as unix:/absolute/path")
        return ServerAddress(url, "--vllm-url")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(
            f"--vllm-url {url!r} is not an http(s) URL",
            hint="for example --vllm-url http://127.0.0.1:8000 (or unix:/path/to.sock for --uds)",
        )
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError as exc:
        raise UsageError(f"--vllm-url {url!r}: {exc}") from None
    if parts.query or parts.fragment:
        raise UsageError(f"--vllm-url {url!r} must not have a query or fragment")
    return ServerAddress(url.rstrip("/"), "--vllm-url")


def read_argv(pid: int) -> list[str]:
    """The command line of ``pid`` as its arguments (empty if it cannot be read)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


# -- the requests ---------------------------------------------------------------------


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over vLLM's ``--uds`` socket."""

    def __init__(self, path: str, timeout: float | None) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


@dataclass
class Response:
    status: int
    body: Any  # parsed JSON, or None
    text: str


def error_message(response: Response) -> str:
    """The words of a vLLM error answer (``{"error": {"message": ...}}``), else the raw text."""
    body = response.body
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    return response.text.strip()[:500] or "(no body)"


def query_string(params: Mapping[str, Any]) -> str:
    """``level=1&mode=wait``; a list becomes repeated keys (``tags=a&tags=b``, as vLLM reads them)."""
    pairs: list[tuple[str, str]] = []
    for key, value in params.items():
        if value is None:
            continue
        values = value if isinstance(value, (list, tuple)) else [value]
        pairs.extend((key, str(v)) for v in values)
    return urllib.parse.urlencode(pairs)


class InFlight:
    """A request running on its own thread, so the caller can watch the workers meanwhile and give up."""

    def __init__(self, server: VllmServer, method: str, path: str, params: Mapping[str, Any]) -> None:
        self._server = server
        self.description = f"{method} {path}" + (f"?{query_string(params)}" if params else "")
        self._connection: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self._aborted = False
        self.response: Response | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(method, path, params), name="hibernate-vllm-request", daemon=True
        )
        self._thread.start()

    def _run(self, method: str, path: str, params: Mapping[str, Any]) -> None:
        try:
            self.response = self._server.request(method, path, params, timeout=None, keep=self._keep)
        except BaseException as exc:
            self.error = exc

    def _keep(self, connection: http.client.HTTPConnection) -> bool:
        with self._lock:
            self._connection = connection
            return not self._aborted

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds``; True once the request has finished (answered or failed)."""
        self._thread.join(seconds)
        return not self._thread.is_alive()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def abort(self) -> None:
        """Give up: close our end (the server may still carry the request out)."""
        with self._lock:
            self._aborted = True
            connection = self._connection
        if connection is not None and connection.sock is not None:
            with contextlib.suppress(OSError):
                connection.sock.shutdown(socket.SHUT_RDWR)

    def result(self) -> Response:
        """The answer; the request's own failure is raised."""
        if self.error is not None:
            raise self.error
        assert self.response is not None
        return self.response


class VllmServer:
    """A vLLM server's HTTP endpoints; every request bounded by ``timeout`` unless said otherwise."""

    def __init__(self, address: ServerAddress, timeout: float) -> None:
        self.address = address
        self.timeout = timeout
        if address.url.startswith("unix:"):
            self._unix: str | None = address.url[len("unix:") :]
            self._parts = None
        else:
            self._unix = None
            self._parts = urllib.parse.urlsplit(address.url)

    @property
    def url(self) -> str:
        return self.address.url

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        if self._unix is not None:
            return _UnixConnection(self._unix, timeout)
        assert self._parts is not None and self._parts.hostname is not None
        host = self._parts.hostname
        if self._parts.scheme == "https":
            return http.client.HTTPSConnection(host, self._parts.port or 443, timeout=timeout)
        return http.client.HTTPConnection(host, self._parts.port or 80, timeout=timeout)

    def _path(self, path: str, params: Mapping[str, Any]) -> str:
        prefix = self._parts.path.rstrip("/") if self._parts is not None else ""
        query = query_string(params)
        return f"{prefix}{path}" + (f"?{query}" if query else "")

    def request(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | None = None,
        *,
        timeout: float | bool | None = True,
        keep: Any = None,
    ) -> Response:
        """One request; ``timeout=True`` means this server's timeout, None none (see InFlight).

        Raises ServerUnreachableError when nothing accepts the connection,
        HibernateTimeoutError when the answer does not come in time and
        ServerConnectionLostError when the connection drops before the answer.
        """
        seconds = self.timeout if timeout is True else (None if timeout is None else float(timeout))
        target = self._path(path, params or {})
        what = f"{method} {target}"
        connection = self._connection(seconds)
        if keep is not None and not keep(connection):
            raise ServerConnectionLostError(f"{what} was abandoned")
        try:
            try:
                connection.connect()
            except TimeoutError as exc:
                raise HibernateTimeoutError(
                    f"the vLLM server at {self.url} did not accept a connection within {seconds:g}s"
                ) from exc
            except ssl.SSLError as exc:
                raise ServerUnreachableError(
                    f"TLS with the server at {self.url} ({self.address.found}) failed: {exc}",
                    hint="pass an address this machine can verify with --vllm-url URL",
                ) from None
            except OSError as exc:
                raise ServerUnreachableError(
                    f"no server answers at {self.url} ({self.address.found}): {exc.strerror or exc}",
                    hint="pass the server's address with --vllm-url URL",
                ) from None
            if keep is not None and not keep(connection):
                raise ServerConnectionLostError(f"{what} was abandoned")
            try:
                connection.request(
                    method, target, headers={"Accept": "application/json", "Content-Length": "0"}
                )
                answer = connection.getresponse()
                raw = answer.read(_MAX_BODY)
            except TimeoutError as exc:
                raise HibernateTimeoutError(
                    f"the vLLM server at {self.url} did not answer {what} within {seconds:g}s"
                ) from exc
            except (http.client.HTTPException, OSError) as exc:
                raise ServerConnectionLostError(
                    f"the vLLM server at {self.url} closed the connection during {what} "
                    f"({type(exc).__name__}: {exc})"
                ) from None
        finally:
            connection.close()
        text = raw.decode("utf-8", "replace")
        try:
            body = json.loads(text) if text.strip() else None
        except json.JSONDecodeError:
            body = None
        return Response(answer.status, body, text)

    # -- the endpoints ----------------------------------------------------------------

    def _checked(self, response: Response, what: str, dev: bool = True) -> dict[str, Any]:
        """A 2xx JSON object, or the error it means (404 on a dev route: the endpoints are missing)."""
        if response.status == 404 and dev:
            raise DevEndpointsMissingError(
                f"the vLLM server at {self.url} does not serve {what} (404): it was started without "
                f"{DEV_MODE_ENV}=1; nothing was changed",
                hint=START_HINT,
            )
        if not 200 <= response.status < 300:
            raise ServerFailedError(
                f"the vLLM server at {self.url} answered {what} with HTTP {response.status}: "
                f"{error_message(response)}"
            )
        if not isinstance(response.body, dict):
            raise ServerFailedError(
                f"the vLLM server at {self.url} answered {what} with something that is not a JSON object: "
                f"{response.text.strip()[:200]!r}"
            )
        return response.body

    def probe(self) -> bool:
        """Whether the server is sleeping, checking first that it is vLLM and serves the sleep routes.

        A 404 on ``/is_sleeping`` is told apart with ``/version``: vLLM
        without dev mode answers it (DevEndpointsMissingError, with how to
        start it), anything else does not (ServerUnreachableError: a wrong
        address).
        """
        response = self.request("GET", "/is_sleeping")
        if response.status == 404:
            version = self.request("GET", "/version")
            if version.status != 200 or not isinstance(version.body, dict) or "version" not in version.body:
                raise ServerUnreachableError(
                    f"the server at {self.url} ({self.address.found}) is not a vLLM server: "
                    "it serves neither /is_sleeping nor /version; nothing was changed",
                    hint="pass the vLLM server's address with --vllm-url URL",
                )
            self._checked(response, "GET /is_sleeping")
        return self.sleeping_from(self._checked(response, "GET /is_sleeping"))

    def is_sleeping(self) -> bool:
        return self.sleeping_from(self._checked(self.request("GET", "/is_sleeping"), "GET /is_sleeping"))

    @staticmethod
    def sleeping_from(body: dict[str, Any]) -> bool:
        value = body.get("is_sleeping")
        if not isinstance(value, bool):
            raise ServerFailedError(f"GET /is_sleeping answered {body!r}, not {{'is_sleeping': bool}}")
        return value

    def sleep(self, level: int, mode: str) -> dict[str, Any]:
        """``POST /sleep`` within this server's timeout (the drain: level 0 only pauses scheduling)."""
        return self._checked(
            self.request("POST", "/sleep", {"level": level, "mode": mode}), f"POST /sleep?level={level}"
        )

    def start_sleep(self, level: int, mode: str) -> InFlight:
        return InFlight(self, "POST", "/sleep", {"level": level, "mode": mode})

    def wake_up(self, tags: Sequence[str] | None = None) -> dict[str, Any]:
        return self._checked(
            self.request("POST", "/wake_up", {"tags": list(tags) if tags else None}), "POST /wake_up"
        )

    def start_wake_up(self, tags: Sequence[str] | None = None) -> InFlight:
        return InFlight(self, "POST", "/wake_up", {"tags": list(tags) if tags else None})

    def answer(self, flight: InFlight) -> dict[str, Any]:
        """The checked answer of a request started with ``start_*``."""
        return self._checked(flight.result(), flight.description.split("?")[0])
