"""What ``hibernate serve`` is told: flags and ``serve.toml``, parsed and checked as pure functions.

Every bad value is refused here, before a port is opened or a backend touched,
with a :class:`~hibernate.errors.UsageError` that names the flag, or the file,
table and key (``serve.toml: [limits] max_body_bytes: must be ...``), and what
would be accepted.
"""

from __future__ import annotations

import errno
import ipaddress
import math
import os
import pwd
import re
import shlex
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from hibernate.errors import UsageError
from hibernate.procinfo import describe_user

DEFAULT_LISTEN = "127.0.0.1:8000"
AUTO = "auto"  # --gpu-budget auto: measured free memory rather than a size
MAX_SECONDS = 86400.0
# A name is a label in metrics and logs, and by default the model name routed to the backend: what
# model names are made of (vLLM serves "Org/Model-7B" by default), nothing that needs quoting.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")
SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
# The proxy's own paths: no backend prefix may take them.
OWN_PATHS = ("/v1", "/metrics", "/hibernate", "/health", "/healthz")
TOKEN_ENV = "HIBERNATE_SERVE_TOKEN"
# In a backend's url, command and env: the port serve chooses for it, free when serve starts, so that
# the port is written once (as llama-swap's ${PORT}).
PORT_MACRO = "${PORT}"
# Linux's PID_MAX_LIMIT: no process id reaches it, whatever /proc/sys/kernel/pid_max says. A pid beyond
# it is a typo, refused as one (exit 2), not looked for as a process that is gone (exit 3).
PID_LIMIT = 1 << 22
DEFAULT_START_TIMEOUT = 600.0

# What a probe (a GET or HEAD of one of a backend's probe paths, under its prefix) gets. None of them
# wakes the backend or counts as use (its idle time runs on).
PROBE_ANSWER = "answer"  # the proxy answers from what it knows, never forwarded
PROBE_FORWARD_OR_ANSWER = "forward_or_answer"  # forwarded while awake, else the proxy answers
PROBE_FORWARD_OR_503 = "forward_or_503"  # forwarded while awake, else 503 with Retry-After
PROBE_WAKE = "wake"  # not a probe: an ordinary request (wakes the backend, counts as use)
PROBE_ACTIONS = (PROBE_ANSWER, PROBE_FORWARD_OR_ANSWER, PROBE_FORWARD_OR_503, PROBE_WAKE)
DEFAULT_PROBES: tuple[tuple[str, str], ...] = (
    ("/health", PROBE_FORWARD_OR_ANSWER),
    ("/healthz", PROBE_FORWARD_OR_ANSWER),
    ("/ping", PROBE_FORWARD_OR_ANSWER),
    ("/metrics", PROBE_FORWARD_OR_ANSWER),
    ("/v1/models", PROBE_FORWARD_OR_ANSWER),
)


def probe_path(path: str) -> str:
    """A request's path as a probe path is matched: its query left out, percent-escapes decoded and a
    trailing slash stripped, so that ``/%68ealth`` and ``/health/`` are the probe ``/health`` (as the
    backend may well read them) rather than requests that wake it."""
    return unquote(path.split("?", 1)[0]).rstrip("/") or "/"


@dataclass(frozen=True)
class BackendSpec:
    """One backend: where it listens, and what routes to it.

    ``models`` are the values of a request's ``model`` field that go to it (its
    name by default: start vLLM with ``--served-model-name NAME``, or list the
    served names in ``serve.toml``). ``prefix`` also routes every path under it,
    stripped of the prefix. ``pid`` names its process where it cannot be found
    from the port it listens on.
    """

    name: str
    url: str
    models: tuple[str, ...] = ()
    prefix: str | None = None
    pid: int | None = None
    idle_limit: float | None = None  # its own idle limit (``idle`` in serve.toml), else the proxy's
    probes: tuple[tuple[str, str], ...] = DEFAULT_PROBES  # path (under its prefix) -> PROBE_* action
    # Started on demand: by the first request for it when nothing listens on its address.
    command: tuple[str, ...] = ()
    cwd: Path | None = None
    env: tuple[tuple[str, str], ...] = ()  # added to serve's own environment
    start_timeout: float = DEFAULT_START_TIMEOUT  # to listen (and answer health_path) once started
    health_path: str | None = None  # answers 200 once it is ready (after it listens)
    # The model name the backend itself serves: a request routed to it by one of its models is
    # forwarded with its ``model`` field set to this (None: forwarded as it came).
    served_model: str | None = None

    def probe_action(self, method: str, path: str) -> str | None:
        """What a request for ``path`` (the backend's own path, prefix stripped) is, if a probe: the
        action for it; None for an ordinary request. Only GET and HEAD are probes."""
        if method not in ("GET", "HEAD"):
            return None
        action = dict(self.probes).get(probe_path(path))
        return None if action in (None, PROBE_WAKE) else action

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.models or (self.name,)

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80

    @property
    def port_chosen_by_serve(self) -> bool:
        """Whether its url names its port as ``${PORT}``: one serve chooses (:func:`with_ports`)."""
        return PORT_MACRO in self.url


@dataclass(frozen=True)
class Limits:
    """Bounds on what one client may cost the proxy: every one of them finite."""

    max_body_bytes: int = 16 << 20
    max_header_bytes: int = 16 << 10  # one header line (aiohttp's max_field_size and max_line_size)
    body_timeout: float = 30.0  # the whole request body must arrive within this
    idle_timeout: float = 30.0  # a connection with no whole request (headers) for this long is closed
    upstream_timeout: float = 600.0  # a backend must answer (headers) within this once awake
    max_connections: int = 256  # to all backends together
    max_requests: int = 4096  # handled at once, held for a wake included; more are answered 503 at once
    shutdown_timeout: float = 30.0  # SIGTERM: how long requests in flight may take to finish


@dataclass(frozen=True)
class ServeConfig:
    host: str
    port: int
    to: Path
    backends: tuple[BackendSpec, ...]
    idle_limit: float | None = None  # --idle: unused this long, a backend is put to sleep (None: never)
    wake_timeout: float = 300.0
    sleep_timeout: float = 120.0  # the --timeout of each sleep (drain and quiesce)
    gpu_budget: int | None = None  # bytes of tracked memory that may be awake at once
    measure_gpu: bool = False  # --gpu-budget auto: the GPUs' free memory (NVML) decides instead
    command: tuple[str, ...] = ()  # `-- cmd...`: started by the proxy as backend `start`
    start: str | None = None
    limits: Limits = field(default_factory=Limits)
    token: str | None = None  # the bearer token of /hibernate/models (None: none configured)
    token_source: str | None = None  # where it came from (--token-file PATH, or the variable)

    @property
    def is_local(self) -> bool:
        return is_loopback(self.host)

    @property
    def control_enabled(self) -> bool:
        """/hibernate/models (sleep, wake, state): on when a token is configured (then required), else
        only while listening on loopback; off otherwise."""
        return self.token is not None or self.is_local


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_listen(value: Any, label: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); port 0 takes a free one."""
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"{label} must be HOST:PORT (e.g. {DEFAULT_LISTEN}), not {value!r}")
    return host, int(port)


def toml_key(source: str, table: str | None, key: str) -> str:
    """How an error names a key of serve.toml: ``serve.toml: [limits] max_body_bytes:`` (``table`` None:
    a top-level key), so that ``{label} must be ...`` reads as one sentence, as ``--idle must be ...``
    does for a flag."""
    return f"{source}: {table} {key}:" if table else f"{source}: {key}:"


def parse_size(value: str | int, option: str) -> int:
    """Bytes from ``40GiB``, ``40G``, ``512MiB`` or a plain number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = SIZE_PATTERN.match(str(value))
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"{option} must be a size such as 40GiB, 512MiB or a number of bytes, not {value!r}")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def check_seconds(value: Any, option: str, *, allow_zero: bool = False) -> float:
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if not number or not ((value >= 0) if allow_zero else (value > 0)):
        raise UsageError(f"{option} must be a number of seconds above 0 and at most one day, not {value!r}")
    if value > MAX_SECONDS:
        raise UsageError(f"{option} must be at most {MAX_SECONDS:g} seconds (one day), not {value!r}")
    return float(value)


def check_url(value: str, label: str) -> str:
    """A backend's address: ``http://HOST:PORT``, where a server can listen and the proxy connect.

    No path or query (the proxy adds the request's), no user or password (the proxy would send them
    with no request; a backend is on this machine, behind the proxy's own checks) and no port 0 (a
    server told port 0 takes any free port: none is ever reached at port 0)."""
    if PORT_MACRO in value:
        host, _, macro = urlsplit(value).netloc.rpartition(":")
        if macro != PORT_MACRO or PORT_MACRO in host:
            raise UsageError(
                f"{label} {PORT_MACRO} stands for the port alone: http://HOST:{PORT_MACRO}, not {value!r}"
            )
    parts = urlsplit(value.replace(PORT_MACRO, "1"))  # the rest checked as for the port serve chooses
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise UsageError(
            f"{label} a backend's address must be http://HOST:PORT (no path, no query), not {value!r}"
        )
    if parts.username is not None or parts.password is not None:
        raise UsageError(
            f"{label} a backend's address holds no user or password: http://HOST:PORT, not {value!r}"
        )
    try:
        port = parts.port
    except ValueError:
        raise UsageError(f"{label} bad port in {value!r}") from None
    if port == 0:
        raise UsageError(
            f"{label} port 0 names no server (it asks for any free port): give the port it listens on"
        )
    return value.rstrip("/")


def check_name(name: str, label: str) -> str:
    if not NAME_PATTERN.match(name):
        raise UsageError(
            f"{label} a backend name is 1 to 128 letters, digits, '.', '_', '-', '/' or ':' "
            f"(starting with a letter or digit), not {name!r}"
        )
    return name


def check_prefix(prefix: str, label: str) -> str:
    if not prefix.startswith("/") or prefix == "/" or "//" in prefix or "?" in prefix:
        raise UsageError(
            f"{label} a path prefix starts with / and names a path, such as /qwen, not {prefix!r}"
        )
    if prefix.rstrip("/") in OWN_PATHS or prefix.startswith("/hibernate/"):
        raise UsageError(f"{label} the prefix {prefix!r} is the proxy's own; choose another")
    return prefix.rstrip("/")


def parse_backend_flag(value: str) -> BackendSpec:
    """``--backend NAME=http://HOST:PORT``."""
    name, sep, url = value.partition("=")
    if not sep:
        raise UsageError(f"--backend must be NAME=http://HOST:PORT, not {value!r}")
    label = f"--backend {value}:"
    if PORT_MACRO in url:
        raise UsageError(
            f"{label} {PORT_MACRO} is a port serve chooses for a backend it starts: give it in serve.toml, "
            "with the backend's command"
        )
    return BackendSpec(check_name(name, label), check_url(url, label))


TOP_KEYS = {
    "listen", "to", "idle", "wake_timeout", "sleep_timeout", "gpu_budget", "backend", "limits", "probes",
    "token_file",
}  # fmt: skip
BACKEND_KEYS = {
    "name", "url", "models", "prefix", "pid", "idle", "probes", "command", "cwd", "env", "start_timeout",
    "health_path", "served_model",
}  # fmt: skip
LIMIT_KEYS = {f.name for f in fields(Limits)}


def _unknown(keys: Sequence[str], allowed: set[str], where: str) -> None:
    extra = sorted(set(keys) - allowed)
    if extra:
        raise UsageError(f"{where}: unknown key(s) {', '.join(extra)}; known: {', '.join(sorted(allowed))}")


def probes_from_table(
    table: Any, label: str, base: tuple[tuple[str, str], ...] = DEFAULT_PROBES
) -> tuple[tuple[str, str], ...]:
    """A ``probes`` table (path = action) laid over ``base``: a path given ``"wake"`` is no probe."""
    if not isinstance(table, Mapping):
        raise UsageError(f'{label} must be a table of path = action, such as {{ "/metrics" = "answer" }}')
    merged = dict(base)
    for path, action in table.items():
        if not isinstance(path, str) or not path.startswith("/") or "?" in path:
            raise UsageError(f"{label} a probe path starts with / (no query), not {path!r}")
        if action not in PROBE_ACTIONS:
            raise UsageError(
                f"{label} {path}: the action is one of {', '.join(PROBE_ACTIONS)}, not {action!r}"
            )
        merged[path] = action
    return tuple(merged.items())


def command_from_value(value: Any, label: str) -> tuple[str, ...]:
    """``command``: a list of strings (run as given), or one string split as a POSIX shell would
    (shlex; no shell runs it: no pipes, no variables)."""
    if isinstance(value, str):
        try:
            words = shlex.split(value)
        except ValueError as exc:
            raise UsageError(f"{label} cannot be split into words: {exc}") from None
    elif isinstance(value, list) and all(isinstance(w, str) for w in value):
        words = list(value)
    else:
        raise UsageError(f"{label} must be a list of strings, or one string split as a shell would")
    if not words or not words[0]:
        raise UsageError(f"{label} is empty")
    return tuple(words)


def refuse_nul(backend: str, fields: Sequence[tuple[str, str]]) -> None:
    """A NUL byte ends a C string: no argument, environment variable or path can carry one, and a
    command given one is never started (the operating system refuses it). ``fields`` are (how an
    error names it, text)."""
    for label, text in fields:
        if "\0" in text:
            raise UsageError(
                f"{label} of backend {backend} holds a NUL byte (\\0): no program can be given one"
            )


def env_from_table(value: Any, label: str) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and k and "=" not in k and isinstance(v, str) for k, v in value.items()
    ):
        raise UsageError(f'{label} must be a table of NAME = "value" strings')
    return tuple(value.items())


def backend_from_table(
    table: Any, source: str, index: int, probes: tuple[tuple[str, str], ...] = DEFAULT_PROBES
) -> BackendSpec:
    """One ``[[backend]]`` table of serve.toml (the ``index``-th, from 1)."""
    where = f"[[backend]] #{index}"
    if not isinstance(table, Mapping):
        raise UsageError(f"{source}: {where}: must be a table (name = ..., url = ...)")
    _unknown(list(table), BACKEND_KEYS, f"{source}: {where}")

    def key(name: str) -> str:
        return toml_key(source, where, name)

    for required in ("name", "url"):
        if not isinstance(table.get(required), str):
            raise UsageError(f"{key(required)} required, as a string")
    name = check_name(table["name"], key("name"))
    models = table.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise UsageError(f"{key('models')} must be a list of model names")
    prefix = table.get("prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise UsageError(f"{key('prefix')} must be a string such as /qwen")
    pid = table.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or not 0 < pid < PID_LIMIT):
        raise UsageError(
            f"{key('pid')} must be a process id, 1 to {PID_LIMIT - 1} (the most Linux allows), not {pid!r}"
        )
    idle = table.get("idle")
    cwd = table.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd):
        raise UsageError(f"{key('cwd')} must name a directory")
    health_path = table.get("health_path")
    if health_path is not None and (not isinstance(health_path, str) or not health_path.startswith("/")):
        raise UsageError(f"{key('health_path')} must be a path such as /health, not {health_path!r}")
    command = command_from_value(table["command"], key("command")) if "command" in table else ()
    if command and pid is not None:
        raise UsageError(
            f"{key('pid')} a backend started on demand (command) gets a new pid at each start: it is found "
            "from its address; give one or the other"
        )
    for started_only in ("cwd", "env", "start_timeout", "health_path"):
        if started_only in table and not command:
            raise UsageError(f"{key(started_only)} is for a backend started on demand: give its command")
    env = env_from_table(table["env"], key("env")) if "env" in table else ()
    url = check_url(table["url"], key("url"))
    check_port_macro(url, command, env, key)
    served_model = table.get("served_model")
    if served_model is not None and (not isinstance(served_model, str) or not served_model):
        raise UsageError(
            f"{key('served_model')} must be the model name the backend serves, not {served_model!r}"
        )
    refuse_nul(
        name,
        [
            *((f"{key('command')} word {i + 1}", word) for i, word in enumerate(command)),
            *((f"{key('env')} the name {variable!r}", variable) for variable, _ in env),
            *((f"{key('env')} {variable}", value) for variable, value in env),
            *([(f"{key('cwd')} the directory", cwd)] if cwd is not None else []),
        ],
    )
    return BackendSpec(
        name,
        url,
        tuple(models),
        check_prefix(prefix, key("prefix")) if prefix is not None else None,
        pid,
        check_seconds(idle, key("idle")) if idle is not None else None,
        probes_from_table(table["probes"], key("probes"), probes) if "probes" in table else probes,
        command,
        Path(cwd).expanduser() if cwd is not None else None,
        env,
        check_seconds(table.get("start_timeout", DEFAULT_START_TIMEOUT), key("start_timeout")),
        health_path,
        served_model,
    )


def check_port_macro(
    url: str, command: Sequence[str], env: Sequence[tuple[str, str]], key: Callable[[str], str]
) -> None:
    """``${PORT}`` in a url and in what starts its server go together: the port serve chooses must be
    the one the proxy connects to and the one the command is told to listen on."""
    in_url = PORT_MACRO in url
    told = any(PORT_MACRO in word for word in command) or any(PORT_MACRO in value for _, value in env)
    if in_url and not told:
        raise UsageError(
            f"{key('url')} {PORT_MACRO} is a port serve chooses: its command (or env) must say {PORT_MACRO} "
            "too, to listen there"
        )
    if told and not in_url:
        raise UsageError(
            f"{key('command')} {PORT_MACRO} is a port serve chooses: the url must say {PORT_MACRO} too "
            f"(http://127.0.0.1:{PORT_MACRO}), to reach the command there"
        )


def limits_from_table(table: Any, source: str) -> Limits:
    """The ``[limits]`` table of serve.toml."""
    if not isinstance(table, Mapping):
        raise UsageError(f"{source}: [limits]: must be a table")
    _unknown(list(table), LIMIT_KEYS, f"{source}: [limits]")
    values: dict[str, Any] = {}
    for key, value in table.items():
        label = toml_key(source, "[limits]", key)
        if key.endswith("_bytes") or key in ("max_connections", "max_requests"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{label} must be a positive integer, not {value!r}")
            values[key] = value
        else:
            values[key] = check_seconds(value, label)
    return Limits(**values)


def check_backends(backends: Sequence[BackendSpec]) -> tuple[BackendSpec, ...]:
    """At least one; names, models and prefixes each route to one backend only."""
    if not backends:
        raise UsageError("no backend: give --backend NAME=http://HOST:PORT (or [[backend]] in --config)")
    names = [s.name for s in backends]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UsageError(f"two backends are named {twice[0]!r}; each needs its own name")
    seen: dict[str, str] = {}
    for spec in backends:
        for key in (f"name {spec.name}", *(f"model {m}" for m in spec.model_names)):
            kind, value = key.split(" ", 1)
            # a backend's name and its first model are usually the same thing: only clashes between
            # different backends are refused
            owner = seen.setdefault(f"{kind} {value}", spec.name)
            if owner != spec.name:
                raise UsageError(f"backends {owner} and {spec.name} both claim {kind} {value!r}")
        if spec.prefix is not None:
            owner = seen.setdefault(f"prefix {spec.prefix}", spec.name)
            if owner != spec.name:
                raise UsageError(f"backends {owner} and {spec.name} both claim prefix {spec.prefix!r}")
    addresses = [s.host_port for s in backends if not s.port_chosen_by_serve]  # those get ports of their own
    if len(set(addresses)) != len(addresses):
        raise UsageError("two backends have the same address; each backend is one server")
    return tuple(backends)


def load_toml(path: Path) -> dict[str, Any]:
    """The TOML document of ``--config`` (tomllib: Python 3.11 and later)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise UsageError("--config needs Python 3.11 or later (tomllib); use the flags instead") from None
    try:
        with open(path, "rb") as f:
            document: dict[str, Any] = tomllib.load(f)
    except OSError as exc:
        raise UsageError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {path}: not valid TOML: {exc}") from None
    return document


def build_config(
    *,
    listen: str | None,
    to: Path | None,
    backend_flags: Sequence[str],
    idle: float | None,
    wake_timeout: float | None,
    gpu_budget: str | None,
    command: Sequence[str] = (),
    start: str | None = None,
    document: Mapping[str, Any] | None = None,
    source: str = "serve.toml",
    token_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
) -> ServeConfig:
    """The whole configuration: the TOML document (if any), with the flags given on top of it.

    ``source`` names the document in errors (the path given to --config); ``environ`` is where
    HIBERNATE_SERVE_TOKEN is looked for (default: none).
    """
    document = dict(document or {})
    _unknown(list(document), TOP_KEYS, source)

    def given(flag_value: Any, flag: str, key: str, default: Any = None) -> tuple[Any, str]:
        """A setting and how an error names it: the flag if it was given, else the TOML key."""
        if flag_value is not None:
            return flag_value, flag
        return document.get(key, default), toml_key(source, None, key)

    tables = document.get("backend", [])
    if not isinstance(tables, list):
        raise UsageError(f"{toml_key(source, None, 'backend')} backends are [[backend]] tables")
    probes = DEFAULT_PROBES
    if "probes" in document:
        probes = probes_from_table(document["probes"], toml_key(source, None, "probes"))
    backends = [backend_from_table(t, source, i + 1, probes) for i, t in enumerate(tables)]
    backends += [replace(parse_backend_flag(v), probes=probes) for v in backend_flags]
    directory, to_label = given(to, "--to", "to")
    if directory is None:
        raise UsageError("--to DIR is required: the directory where sleeping backends' memory goes")
    if not isinstance(directory, (str, Path)) or not str(directory):
        raise UsageError(f"{to_label} must name a directory, not {directory!r}")
    host, port = parse_listen(*given(listen, "--listen", "listen", DEFAULT_LISTEN))
    idle_value, idle_label = given(idle, "--idle", "idle")
    budget, budget_label = given(gpu_budget, "--gpu-budget", "gpu_budget")
    token_path, token_label = given(token_file, "--token-file", "token_file")
    token, token_source = None, None
    if token_path is not None:
        if not isinstance(token_path, (str, Path)) or not str(token_path):
            raise UsageError(f"{token_label} must name a file, not {token_path!r}")
        token, token_source = read_token(Path(token_path), token_label), f"{token_label} {token_path}"
    elif TOKEN_ENV in (environ or {}):  # set but empty is refused as a short token is, not taken for none
        token, token_source = check_token((environ or {})[TOKEN_ENV], TOKEN_ENV), TOKEN_ENV
    config = ServeConfig(
        host=host,
        port=port,
        to=Path(directory),
        backends=check_backends(backends),
        idle_limit=check_seconds(idle_value, idle_label) if idle_value is not None else None,
        wake_timeout=check_seconds(*given(wake_timeout, "--wake-timeout", "wake_timeout", 300.0)),
        sleep_timeout=check_seconds(*given(None, "", "sleep_timeout", 120.0)),
        gpu_budget=parse_size(budget, budget_label) if budget not in (None, AUTO) else None,
        measure_gpu=budget == AUTO,
        limits=limits_from_table(document.get("limits", {}), source),
        token=token,
        token_source=token_source,
    )
    return with_command(config, command, start)


def check_token(token: str, label: str) -> str:
    token = token.strip()
    if len(token) < 16 or any(c.isspace() for c in token):
        empty = " (it is set but empty: unset it for no token)" if not token else ""
        raise UsageError(f"{label}: a token is at least 16 characters, without spaces{empty}")
    return token


# A token is one short line: what a token file may hold, read from it and no more (one byte over says
# "too long" rather than reading a file of any size, or a device that never ends, into memory).
MAX_TOKEN_FILE_BYTES = 4096
# Opened once, never following a symbolic link, never waiting for a writer (a FIFO): what was opened is
# then checked on its descriptor, so nothing can be swapped between the check and the read.
TOKEN_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
FILE_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
)


def token_file_problem(info: os.stat_result, uid: int) -> tuple[str, str] | None:
    """Why a token file, as ``fstat`` describes it, cannot hold the token of a proxy run by ``uid``, and
    what to do about it; None if it can.

    As sshd treats a private key: a regular file, owned by whoever runs the proxy (or root), that
    nobody else may read or write. A file another user owns is refused even at mode 600: its owner
    could write a token of their own in it, and so sleep and wake every backend through the control
    endpoints (which root's proxy would then obey).
    """
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in FILE_KINDS if test(info.st_mode)), "not a regular file")
        return f"is {kind}, not a regular file", "give a regular file holding the token"
    owner = f"mode {stat.S_IMODE(info.st_mode):o}, owner {describe_user(info.st_uid)}"
    if info.st_uid not in (uid, 0):
        return (
            f"belongs to another user ({owner}): whoever owns it could put a token of theirs in it",
            f"keep the token in a file of your own: chown {user_name(uid)} FILE",
        )
    if info.st_mode & 0o077:
        return f"can be read or written by others ({owner})", "chmod 600 FILE"
    return None


def user_name(uid: int) -> str:
    """A user as ``chown`` takes one: the name, else the number."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def read_at_most(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``fd``, to its end if it is shorter (a read may return less)."""
    chunks: list[bytes] = []
    left = limit
    while left > 0:
        chunk = os.read(fd, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_token(path: Path, label: str) -> str:
    """The bearer token in ``path``: one line, in a file only the proxy's user (or root) controls.

    The file is opened once and what was opened is checked (:func:`token_file_problem`), then read
    from that descriptor, at most :data:`MAX_TOKEN_FILE_BYTES`: a FIFO or a device is refused at
    once, not waited on or read without end. Its directories are not checked (docs/security.md says
    why): a user who can change one can only lead the path to a file the checks refuse, or to another
    private file of the proxy's user, which they can read no more than the token.
    """
    path = path.expanduser()
    shown = f"{label} {path}"
    try:
        fd = os.open(path, TOKEN_OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(
                f"{shown} is a symbolic link; a token file is read only from the file itself",
                hint="give the path of the file the link points to",
            ) from None
        raise UsageError(f"{shown}: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        problem = token_file_problem(info, os.geteuid())
        if problem is not None:
            what, fix = problem
            raise UsageError(f"{shown} {what}", hint=fix.replace("FILE", shlex.quote(str(path))))
        data = read_at_most(fd, MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise UsageError(f"{shown}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise UsageError(f"{shown} is longer than {MAX_TOKEN_FILE_BYTES} bytes: a token file holds one token")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise UsageError(f"{shown}: not text") from None
    return check_token(text, shown)


def with_ports(config: ServeConfig, choose: Callable[[str], int]) -> ServeConfig:
    """The configuration with each ``${PORT}`` replaced by the port ``choose(host)`` gives for its
    backend (one per backend, the same in its url, command and env)."""
    specs = []
    for spec in config.backends:
        if spec.port_chosen_by_serve:
            port = str(choose(urlsplit(spec.url.replace(PORT_MACRO, "1")).hostname or "127.0.0.1"))
            spec = replace(
                spec,
                url=spec.url.replace(PORT_MACRO, port),
                command=tuple(word.replace(PORT_MACRO, port) for word in spec.command),
                env=tuple((name, value.replace(PORT_MACRO, port)) for name, value in spec.env),
            )
        specs.append(spec)
    return replace(config, backends=tuple(specs))


def with_command(config: ServeConfig, command: Sequence[str], start: str | None) -> ServeConfig:
    """``-- cmd...`` starts one backend: the one ``--start`` names, or the only one there is."""
    if not command:
        if start is not None:
            raise UsageError("--start names the backend that `-- COMMAND` starts; there is no command")
        return config
    names = [s.name for s in config.backends]
    if start is None:
        if len(names) != 1:
            raise UsageError(
                "`-- COMMAND` starts one backend: say which with --start NAME (one of "
                + ", ".join(names)
                + ")"
            )
        start = names[0]
    if start not in names:
        raise UsageError(f"--start {start}: no such backend (known: {', '.join(names)})")
    if any(s.command for s in config.backends if s.name == start):
        raise UsageError(
            f"--start {start}: that backend has its own command in serve.toml (started on demand); "
            "give one or the other"
        )
    return replace(config, command=tuple(command), start=start)
