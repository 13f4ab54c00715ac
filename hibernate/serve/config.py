"""What ``hibernate serve`` is told: flags and ``serve.toml``, parsed and checked as pure functions.

Every bad value is refused here, before a port is opened or a backend touched,
with a :class:`~hibernate.errors.UsageError` that names the flag (or the TOML
key) and what would be accepted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from hibernate.errors import UsageError

DEFAULT_LISTEN = "127.0.0.1:8000"
AUTO = "auto"  # --gpu-budget auto: measured free memory rather than a size
MAX_SECONDS = 86400.0
# A name is a label in metrics and logs, and by default the model name routed to the backend: what
# model names are made of (vLLM serves "Org/Model-7B" by default), nothing that needs quoting.
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")
SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
SIZE_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


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
    idle: float | None = None  # its own --idle (serve.toml), else the proxy's

    @property
    def model_names(self) -> tuple[str, ...]:
        return self.models or (self.name,)

    @property
    def host_port(self) -> tuple[str, int]:
        parts = urlsplit(self.url)
        return parts.hostname or "127.0.0.1", parts.port or 80


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
    idle: float | None = None  # None: never put to sleep for being idle
    wake_timeout: float = 300.0
    sleep_timeout: float = 120.0  # the --timeout of each sleep (drain and quiesce)
    gpu_budget: int | None = None  # bytes of tracked memory that may be awake at once
    measure_gpu: bool = False  # --gpu-budget auto: the GPUs' free memory (NVML) decides instead
    command: tuple[str, ...] = ()  # `-- cmd...`: started by the proxy as backend `start`
    start: str | None = None
    limits: Limits = field(default_factory=Limits)

    @property
    def is_local(self) -> bool:
        return self.host in ("127.0.0.1", "localhost", "::1")


def parse_listen(value: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:PORT`` for IPv6) -> (host, port); port 0 takes a free one."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--listen must be HOST:PORT (e.g. {DEFAULT_LISTEN}), not {value!r}")
    return host, int(port)


def parse_size(value: str | int, option: str) -> int:
    """Bytes from ``40GiB``, ``40G``, ``512MiB`` or a plain number of bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = SIZE_PATTERN.match(str(value))
    if not match or float(match.group(1)) <= 0:
        raise UsageError(f"{option} must be a size such as 40GiB, 512MiB or a number of bytes, not {value!r}")
    return int(float(match.group(1)) * SIZE_UNITS[match.group(2).lower()])


def check_seconds(value: Any, option: str, *, allow_zero: bool = False) -> float:
    low_ok = (value >= 0) if allow_zero else (value > 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or not low_ok:
        raise UsageError(f"{option} must be a number of seconds above 0 and at most one day, not {value!r}")
    if value > MAX_SECONDS:
        raise UsageError(f"{option} must be at most {MAX_SECONDS:g} seconds (one day), not {value!r}")
    return float(value)


def check_url(value: str, where: str) -> str:
    parts = urlsplit(value)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise UsageError(
            f"{where}: a backend's address must be http://HOST:PORT (no path, no query), not {value!r}"
        )
    try:
        parts.port  # noqa: B018  (raises on a port out of range)
    except ValueError:
        raise UsageError(f"{where}: bad port in {value!r}") from None
    return value.rstrip("/")


def check_name(name: str, where: str) -> str:
    if not NAME_PATTERN.match(name):
        raise UsageError(
            f"{where}: a backend name is 1 to 128 letters, digits, '.', '_', '-', '/' or ':' "
            f"(starting with a letter or digit), not {name!r}"
        )
    return name


def check_prefix(prefix: str, where: str) -> str:
    if not prefix.startswith("/") or prefix == "/" or "//" in prefix or "?" in prefix:
        raise UsageError(
            f"{where}: a path prefix starts with / and names a path, such as /qwen, not {prefix!r}"
        )
    if prefix.rstrip("/") in ("/v1", "/metrics", "/hibernate"):
        raise UsageError(f"{where}: the prefix {prefix!r} is the proxy's own; choose another")
    return prefix.rstrip("/")


def parse_backend_flag(value: str) -> BackendSpec:
    """``--backend NAME=http://HOST:PORT``."""
    name, sep, url = value.partition("=")
    if not sep:
        raise UsageError(f"--backend must be NAME=http://HOST:PORT, not {value!r}")
    where = f"--backend {value}"
    return BackendSpec(check_name(name, where), check_url(url, where))


TOP_KEYS = {"listen", "to", "idle", "wake_timeout", "sleep_timeout", "gpu_budget", "backend", "limits"}
BACKEND_KEYS = {"name", "url", "models", "prefix", "pid", "idle"}
LIMIT_KEYS = {f.name for f in fields(Limits)}


def _unknown(keys: Sequence[str], allowed: set[str], where: str) -> None:
    extra = sorted(set(keys) - allowed)
    if extra:
        raise UsageError(f"{where}: unknown key(s) {', '.join(extra)}; known: {', '.join(sorted(allowed))}")


def backend_from_table(table: Mapping[str, Any], where: str) -> BackendSpec:
    """One ``[[backend]]`` table of serve.toml."""
    _unknown(list(table), BACKEND_KEYS, where)
    if not isinstance(table.get("name"), str) or not isinstance(table.get("url"), str):
        raise UsageError(f"{where}: name and url are required strings")
    name = check_name(table["name"], where)
    models = table.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m for m in models):
        raise UsageError(f"{where}: models must be a list of model names")
    prefix = table.get("prefix")
    if prefix is not None and not isinstance(prefix, str):
        raise UsageError(f"{where}: prefix must be a string such as /qwen")
    pid = table.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 1):
        raise UsageError(f"{where}: pid must be a process id")
    idle = table.get("idle")
    return BackendSpec(
        name,
        check_url(table["url"], where),
        tuple(models),
        check_prefix(prefix, where) if prefix is not None else None,
        pid,
        check_seconds(idle, f"{where}: idle") if idle is not None else None,
    )


def limits_from_table(table: Mapping[str, Any], where: str = "[limits]") -> Limits:
    _unknown(list(table), LIMIT_KEYS, where)
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key.endswith("_bytes") or key in ("max_connections", "max_requests"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{where}: {key} must be a positive integer, not {value!r}")
            values[key] = value
        else:
            values[key] = check_seconds(value, f"{where} {key}")
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
    addresses = [s.host_port for s in backends]
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
) -> ServeConfig:
    """The whole configuration: the TOML document (if any), with the flags given on top of it."""
    document = dict(document or {})
    _unknown(list(document), TOP_KEYS, "--config")
    tables = document.get("backend", [])
    if not isinstance(tables, list):
        raise UsageError("--config: backends are [[backend]] tables")
    backends = [backend_from_table(t, f"--config [[backend]] #{i + 1}") for i, t in enumerate(tables)]
    backends += [parse_backend_flag(v) for v in backend_flags]
    directory = to if to is not None else document.get("to")
    if not directory:
        raise UsageError("--to DIR is required: the directory where sleeping backends' memory goes")
    host, port = parse_listen(listen or str(document.get("listen", DEFAULT_LISTEN)))
    idle_value = idle if idle is not None else document.get("idle")
    budget = gpu_budget if gpu_budget is not None else document.get("gpu_budget")
    config = ServeConfig(
        host=host,
        port=port,
        to=Path(directory),
        backends=check_backends(backends),
        idle=check_seconds(idle_value, "--idle") if idle_value is not None else None,
        wake_timeout=check_seconds(
            wake_timeout if wake_timeout is not None else document.get("wake_timeout", 300.0),
            "--wake-timeout",
        ),
        sleep_timeout=check_seconds(document.get("sleep_timeout", 120.0), "sleep_timeout"),
        gpu_budget=parse_size(budget, "--gpu-budget") if budget not in (None, AUTO) else None,
        measure_gpu=budget == AUTO,
        limits=limits_from_table(document.get("limits", {})),
    )
    return with_command(config, command, start)


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
    return replace(config, command=tuple(command), start=start)
