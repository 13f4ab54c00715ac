"""What an operator of `hibernate serve` configures and reads, checked on its own (pure functions, no
backend): probes, commands started on demand, the control endpoints' token, keep-alive, Retry-After,
the metrics that exist from the start, and the log lines."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.streams import EmptyStreamReader
from aiohttp.test_utils import make_mocked_request
from prometheus_client.parser import text_string_to_metric_families

from hibernate.errors import UsageError
from hibernate.serve.backends import Fleet, NoRoomError, TransitionOutcome, joined_reasons
from hibernate.serve.config import (
    DEFAULT_PROBES,
    PROBE_ANSWER,
    PROBE_FORWARD_OR_503,
    PROBE_FORWARD_OR_ANSWER,
    TOKEN_ENV,
    build_config,
)
from hibernate.serve.decisions import STATES, Candidate, State, idle_due, plan_start
from hibernate.serve.metrics import OPERATIONS, OUTCOMES, Recorder
from hibernate.serve.proxy import (
    Proxy,
    authorize,
    backend_for,
    error_response,
    keep_alive_of,
    parse_keep_alive,
)
from hibernate.serve.routing import ApiError, without_keep_alive
from hibernate.serve.server import JsonFormat, TextFormat, shutdown_words
from hibernate.serve.starter import child_environment, tail
from hibernate.version import __version__
from tests.conftest import wait_until

TOKEN = "s3cret-token-0123456789"


def config(**given: Any) -> Any:
    values: dict[str, Any] = {
        "listen": None, "to": Path("/snap"), "backend_flags": [], "idle": None, "wake_timeout": None,
        "gpu_budget": None,
    }  # fmt: skip
    values.update(given)
    return build_config(**values)


def backend(**table: Any) -> dict[str, Any]:
    return {"backend": [{"name": "q", "url": "http://127.0.0.1:8001", "prefix": "/q", **table}]}


# -- probes -----------------------------------------------------------------------------------------


def test_probes_are_gets_of_health_metrics_and_models_by_default_and_serve_toml_changes_them() -> None:
    spec = config(document=backend()).backends[0]
    assert spec.probes == DEFAULT_PROBES
    for path in ("/health", "/healthz", "/metrics", "/v1/models", "/metrics?x=1"):
        assert spec.probe_action("GET", path) == PROBE_FORWARD_OR_ANSWER, path
    assert spec.probe_action("HEAD", "/health") == PROBE_FORWARD_OR_ANSWER
    assert spec.probe_action("POST", "/metrics") is None  # only GET and HEAD are probes
    assert spec.probe_action("GET", "/v1/completions") is None
    assert spec.probe_action("GET", "/metrics/more") is None  # a path, not a prefix
    # Matched as the backend reads the path: escapes decoded, a trailing slash left out.
    for path in ("/%68ealth", "/health/", "/%68ealth/?x=1", "/v1/models/", "/metric%73"):
        assert spec.probe_action("GET", path) == PROBE_FORWARD_OR_ANSWER, path

    probes = {"/metrics": "forward_or_503", "/v1/models": "wake", "/status": "answer"}
    changed = config(document=backend(probes=probes)).backends[0]
    assert changed.probe_action("GET", "/metrics") == PROBE_FORWARD_OR_503
    assert changed.probe_action("GET", "/v1/models") is None  # "wake": an ordinary request again
    assert changed.probe_action("GET", "/status") == PROBE_ANSWER
    assert changed.probe_action("GET", "/health") == PROBE_FORWARD_OR_ANSWER  # the defaults stay

    # A top-level table applies to every backend, flags' included; a backend's own goes on top.
    document = {"probes": {"/ready": "answer"}, **backend(probes={"/ready": "forward_or_503"})}
    both = config(document=document, backend_flags=["b=http://127.0.0.1:8002"]).backends
    assert [s.probe_action("GET", "/ready") for s in both] == [PROBE_FORWARD_OR_503, PROBE_ANSWER]


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"probes": {"/metrics": "sometimes"}}, "probes: /metrics: the action is one of answer, "),
        ({"probes": {"metrics": "answer"}}, "probes: a probe path starts with /"),
        ({"probes": ["/metrics"]}, "probes: must be a table of path = action"),
        ({"command": []}, "command: is empty"),
        ({"command": "serve 'unclosed"}, "command: cannot be split into words"),
        ({"command": [1, 2]}, "command: must be a list of strings"),
        ({"cwd": "/tmp"}, "cwd: is for a backend started on demand: give its command"),
        ({"command": "x", "env": {"A": 1}}, 'env: must be a table of NAME = "value" strings'),
        ({"command": "x", "health_path": "health"}, "health_path: must be a path such as /health"),
        ({"command": "x", "start_timeout": 0}, "start_timeout: must be a number of seconds"),
        ({"prefix": "/health"}, "prefix: the prefix '/health' is the proxy's own"),
        ({"prefix": "/hibernate/models"}, "prefix: the prefix '/hibernate/models' is the proxy's own"),
        ({"command": "x", "pid": 42}, "pid: a backend started on demand (command) gets a new pid"),
    ],
)
def test_bad_backend_keys_are_refused_naming_the_key(table: dict[str, Any], words: str) -> None:
    with pytest.raises(UsageError) as refused:
        config(document=backend(**table))
    assert refused.value.message.startswith(f"serve.toml: [[backend]] #1 {words}"), refused.value.message


# -- commands -------------------------------------------------------------------------------------------


def test_a_command_is_a_list_as_given_or_a_string_split_as_a_shell_would() -> None:
    listed = config(document=backend(command=["vllm", "serve", "a b"])).backends[0]
    split = config(document=backend(command="vllm serve 'a b' --port 8001")).backends[0]
    assert listed.command == ("vllm", "serve", "a b")
    assert split.command == ("vllm", "serve", "a b", "--port", "8001")
    full = config(
        document=backend(
            command="x",
            cwd="/srv",
            env={"CUDA_VISIBLE_DEVICES": "0"},
            start_timeout=90,
            health_path="/health",
        )
    ).backends[0]
    assert (full.cwd, full.env, full.start_timeout, full.health_path) == (
        Path("/srv"), (("CUDA_VISIBLE_DEVICES", "0"),), 90.0, "/health",
    )  # fmt: skip


def test_a_failed_starts_log_tail_is_whole_lines_from_the_end(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    log.write_text("".join(f"line {i}\n" for i in range(1000)))
    end = tail(log, 100)
    assert end.endswith("line 999") and end.startswith("line ") and len(end) <= 100
    assert tail(tmp_path / "missing.log") == ""


def test_a_start_under_a_budget_puts_every_backend_holding_memory_to_sleep_first() -> None:
    def c(name: str, state: State, used: float, in_flight: int = 0) -> Candidate:
        return Candidate(name, state, 1 << 30, used, in_flight)

    assert plan_start([c("a", State.ASLEEP, 1), c("b", State.STOPPED, 2)]).action == "fits"
    room = plan_start([c("a", State.AWAKE, 5), c("b", State.AWAKE, 3), c("z", State.ASLEEP, 1)])
    assert (room.action, room.victim) == ("evict", "b")  # the least recently used awake one
    assert plan_start([c("a", State.AWAKE, 5, in_flight=1)]).action == "wait"
    # Starts run one at a time: another backend starting is queued behind this one, holding nothing.
    assert plan_start([c("a", State.STARTING, 5)]).action == "fits"


def test_a_start_that_finds_no_room_in_time_names_its_start_timeout() -> None:
    specs = config(
        document={
            "backend": [
                {"name": "a", "url": "http://127.0.0.1:8001", "command": "x", "start_timeout": 8},
                {"name": "b", "url": "http://127.0.0.1:8002"},
            ]
        }
    ).backends
    fleet = Fleet(specs, None, Recorder(STATES), idle_limit=None, wake_timeout=300.0, budget=1 << 30)  # type: ignore[arg-type]
    busy = fleet.backends["b"]
    busy.state, busy.in_flight = State.AWAKE, 1  # holds memory, and cannot be put to sleep now
    with pytest.raises(NoRoomError, match=r"stayed busy past its start_timeout 8s$"):
        asyncio.run(fleet._make_room(fleet.backends["a"], time.monotonic(), starting=True))


def test_a_failed_wake_says_its_reason_once() -> None:
    reason = "no hibernate agent in process 42"
    assert joined_reasons(reason, reason) == reason
    assert joined_reasons("checksum mismatch", "process 42 is gone") == (
        "checksum mismatch; then: process 42 is gone"
    )
    assert joined_reasons(reason, f"backend q: {reason}") == f"backend q: {reason}"


# -- keep-alive -----------------------------------------------------------------------------------------


def test_keep_alive_is_seconds_or_a_duration_zero_sleeps_at_once_negative_never() -> None:
    assert [parse_keep_alive(v) for v in (0, "0", 30, "30s", "5m", "1h", 2.5)] == [
        0.0, 0.0, 30.0, 30.0, 300.0, 3600.0, 2.5,
    ]  # fmt: skip
    assert parse_keep_alive(-1) == math.inf and parse_keep_alive("-1") == math.inf
    not_durations: tuple[object, ...] = ("soon", True, None, [], "nan")
    assert [parse_keep_alive(v) for v in not_durations] == [None] * 5
    assert keep_alive_of("0", 300) == 0.0  # the header first
    assert keep_alive_of(None, "5m") == 300.0 and keep_alive_of(None, None) is None
    with pytest.raises(ApiError, match="keep_alive must be a number of seconds"):
        keep_alive_of(None, "soon")


def test_a_bodys_keep_alive_is_taken_out_before_forwarding_and_other_bodies_pass_as_they_came() -> None:
    body = b'{"model": "q", "prompt": "hi", "keep_alive": 0}'
    forwarded, value = without_keep_alive(body)
    assert value == 0 and json.loads(forwarded) == {"model": "q", "prompt": "hi"}
    untouched = b'{"model": "q",   "prompt": "keep_alive"}'
    assert without_keep_alive(untouched) == (untouched, None)
    assert without_keep_alive(b"not json keep_alive") == (b"not json keep_alive", None)


def test_keep_alive_refuses_what_only_looks_like_a_duration_and_more_than_a_day() -> None:
    nonsense = ("inf", "-inf", "Infinity", "1_000", "5 m", "1e9h", "1e3", "0x10", "1.", ".5", "5d", "\u0663")
    assert [parse_keep_alive(v) for v in nonsense] == [None] * len(nonsense)
    assert [parse_keep_alive(v) for v in (math.inf, -math.inf, 10**400, 86401, "24.5h")] == [None] * 5
    assert parse_keep_alive("24h") == parse_keep_alive(86400) == 86400.0
    for zero in ("-0", -0.0, "-0.0s"):  # zero whatever its sign: sleep after this request
        seconds = parse_keep_alive(zero)
        assert seconds == 0 and math.copysign(1, seconds) == 1, zero
    assert parse_keep_alive(" 1.5H ") == 5400.0 and parse_keep_alive("-2m") == math.inf
    with pytest.raises(ApiError, match="at most 86400 seconds"):
        keep_alive_of("48h", None)


def test_a_request_that_is_not_served_leaves_the_keep_alive_as_it_was() -> None:
    from hibernate.serve.backends import Fleet

    specs = config(backend_flags=["q=http://127.0.0.1:8001"]).backends
    fleet = Fleet(specs, None, Recorder(STATES), idle_limit=None, wake_timeout=1.0, budget=None)  # type: ignore[arg-type]

    async def refused(backend: Any) -> Any:
        raise ApiError(503, "busy", "ServiceUnavailableError")

    fleet._hold = refused  # type: ignore[method-assign]

    async def request() -> None:
        async with fleet.use("q", 0.0):
            pass

    with pytest.raises(ApiError):
        asyncio.run(request())
    assert fleet.backends["q"].keep_alive is None


def test_a_body_with_keep_alive_is_written_back_as_valid_compact_json_or_refused() -> None:
    forwarded, value = without_keep_alive('{"model": "q", "prompt": "héllo ☃", "keep_alive": "5m"}'.encode())
    assert value == "5m" and forwarded == '{"model":"q","prompt":"héllo ☃"}'.encode()
    for body in (
        b'{"model": "q", "t": 1e400, "keep_alive": 0}',
        b'{"model": "q", "t": NaN, "keep_alive": 0}',
    ):
        with pytest.raises(ApiError) as refused:
            without_keep_alive(body)
        assert refused.value.status == 400 and "cannot be forwarded" in refused.value.message
    # Without the field, nothing is parsed again: a body the backend reads its own way passes as it came.
    odd = b'{"model": "q", "t": 1e400, "t": 2, "prompt": "\\u00e9"}'
    assert without_keep_alive(odd) == (odd, None)


def test_a_backend_kept_alive_forever_is_not_idle_and_zero_is_idle_at_once() -> None:
    forever = Candidate("a", State.AWAKE, 0, 0.0, 0, idle_limit=math.inf)
    at_once = Candidate("b", State.AWAKE, 0, 100.0, 0, idle_limit=0.0)
    assert idle_due([forever, at_once], 100.0, 1.0) == ["b"]


# -- the control endpoints ------------------------------------------------------------------------------


def test_the_control_endpoints_are_open_on_loopback_off_elsewhere_and_need_the_token_when_one_is_set(
    tmp_path: Path,
) -> None:
    flags = {"backend_flags": ["q=http://127.0.0.1:8001"]}
    local = config(**flags)
    assert authorize(local, None) is None
    for host in ("0.0.0.0", "192.168.1.5", "[::]"):
        off = config(listen=f"{host}:8000", **flags)
        refused = authorize(off, f"Bearer {TOKEN}")
        assert refused is not None and refused.status == 403 and "no token is configured" in refused.message

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    guarded = config(listen="0.0.0.0:8000", token_file=token_file, **flags)
    assert guarded.control_enabled and guarded.token == TOKEN
    assert authorize(guarded, f"Bearer {TOKEN}") is None
    for wrong in (None, TOKEN, f"Bearer {TOKEN}x", "Bearer ", f"Basic {TOKEN}"):
        refused = authorize(guarded, wrong)
        assert refused is not None and refused.status == 401, wrong
    from_env = config(listen="0.0.0.0:8000", environ={TOKEN_ENV: TOKEN}, **flags)
    assert from_env.token == TOKEN and from_env.token_source == TOKEN_ENV
    assert config(token_file=token_file, **flags).token == TOKEN  # on loopback too, once given

    token_file.chmod(0o644)
    with pytest.raises(UsageError, match="can be read or written by others"):
        config(token_file=token_file, **flags)
    token_file.chmod(0o600)
    token_file.write_text("short")
    with pytest.raises(UsageError, match="at least 16 characters"):
        config(token_file=token_file, **flags)


def test_a_control_request_names_a_backend_or_one_of_its_models() -> None:
    backends = config(
        document={"backend": [{"name": "q", "url": "http://127.0.0.1:8001", "models": ["Org/Q-8B"]}]}
    ).backends
    assert backend_for("q", backends).name == backend_for("Org/Q-8B", backends).name == "q"
    with pytest.raises(ApiError, match="no backend or model named 'z'"):
        backend_for("z", backends)


def proxy_of(document: dict[str, Any], **given: Any) -> tuple[Proxy, Fleet, Recorder]:
    """The proxy's request handling over ``document``'s backends, with no backend behind it (none is
    reached: every answer below is the proxy's own)."""
    settings = config(document=document, **given)
    recorder = Recorder(STATES)
    fleet = Fleet(settings.backends, None, recorder, idle_limit=None, wake_timeout=5.0, budget=None)  # type: ignore[arg-type]
    return Proxy(settings, fleet, recorder, None), fleet, recorder  # type: ignore[arg-type]


def mocked(method: str, path: str, headers: dict[str, str] | None = None) -> Any:
    return make_mocked_request(method, path, headers=headers, payload=EmptyStreamReader())


def test_every_503_says_when_to_retry() -> None:
    assert "Retry-After" not in error_response(ApiError(404, "no", "NotFoundError")).headers
    proxy, fleet, _ = proxy_of(backend(command="x", probes={"/ready": "forward_or_503"}))

    async def start_fails(backend: Any) -> TransitionOutcome:
        return TransitionOutcome(False, "its command exited with status 3")

    fleet._start = start_fails  # type: ignore[method-assign]
    fleet.backends["q"].state = State.STOPPED

    async def answers() -> list[Any]:
        starting = proxy.health()  # the proxy itself, before its backends are adopted
        proxy.ready.set()
        probe = await proxy.handle(mocked("GET", "/q/ready"))  # forward_or_503, the backend not awake
        failed = await proxy.handle(mocked("POST", "/q/v1/completions"))  # its start failed
        proxy.active = proxy.config.limits.max_requests
        full = await proxy.handle(mocked("POST", "/q/v1/completions"))
        return [starting, probe, failed, full]

    got = [(r.status, r.headers.get("Retry-After")) for r in asyncio.run(answers())]
    assert got == [(503, "1"), (503, "5"), (503, "10"), (503, "1")]


def test_probes_the_proxy_answers_and_refused_control_requests_are_counted_apart() -> None:
    proxy, fleet, recorder = proxy_of(backend(), environ={TOKEN_ENV: TOKEN})
    fleet.backends["q"].state = State.ASLEEP
    proxy.ready.set()

    async def answers() -> list[int]:
        paths = ("/q/health", "/q/%68ealth", "/hibernate/status", "/hibernate/models")
        return [(await proxy.handle(mocked("GET", path))).status for path in paths]

    assert asyncio.run(answers()) == [200, 200, 401, 401]
    text = recorder.exposition()[0].decode()
    assert 'hibernate_serve_request_outcomes_total{backend="q",outcome="probe_answered"} 2.0' in text
    assert 'hibernate_serve_request_outcomes_total{backend="q",outcome="completed"} 0.0' in text
    assert 'hibernate_serve_requests_total{backend="",code="401"} 2.0' in text


# -- metrics and logs -----------------------------------------------------------------------------------


def test_every_series_of_a_backend_exists_at_zero_from_the_start_with_the_version() -> None:
    recorder = Recorder(STATES)
    recorder.register("q", State.FAILED.value, ("Org/Q-8B", "q"))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(recorder.exposition()[0].decode())
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float | None:
        return samples.get((name, tuple(sorted({"backend": "q", **labels}.items()))))

    for operation in OPERATIONS:
        assert value("hibernate_serve_transitions_total", operation=operation) == 0
        assert value("hibernate_serve_transition_failures_total", operation=operation) == 0
    for counter in ("spilled", "reused", "restored"):
        assert value(f"hibernate_serve_{counter}_bytes_total") == 0
    for outcome in OUTCOMES:
        assert value("hibernate_serve_request_outcomes_total", outcome=outcome) == 0
    assert value("hibernate_serve_tracked_bytes") == 0
    assert value("hibernate_serve_requests_in_flight") == 0
    assert value("hibernate_serve_backend_state", state="failed") == 1
    assert value("hibernate_serve_backend_state", state="awake") == 0
    for model in ("Org/Q-8B", "q"):
        assert value("hibernate_serve_model_state", model=model, state="failed") == 1
        assert value("hibernate_serve_model_state", model=model, state="awake") == 0
    recorder.state("q", "asleep")
    assert samples[("hibernate_serve_build_info", (("version", __version__),))] == 1

    recorder.transition("q", "sleep", 1.0, written=10, reused=90)
    recorder.request("q", 200, "client_cancelled")
    recorder.request("q", 502)
    text = recorder.exposition()[0].decode()
    assert 'hibernate_serve_model_state{backend="q",model="Org/Q-8B",state="asleep"} 1.0' in text
    assert 'hibernate_serve_spilled_bytes_total{backend="q"} 10.0' in text
    assert 'hibernate_serve_reused_bytes_total{backend="q"} 90.0' in text
    assert 'hibernate_serve_request_outcomes_total{backend="q",outcome="client_cancelled"} 1.0' in text
    assert 'hibernate_serve_request_outcomes_total{backend="q",outcome="backend_failed"} 1.0' in text


def test_the_last_line_names_what_serve_stopped_and_what_it_left_running() -> None:
    assert shutdown_words([], []) == "stopped"
    assert shutdown_words([("own", 41), ("b", 42)], [("qwen", "asleep"), ("c", "awake")]) == (
        "stopped; stopped what it started: own (pid 41), b (pid 42); "
        "left as they are: qwen (asleep), c (awake)"
    )
    assert shutdown_words([], [("qwen", "awake")]) == "stopped; left as they are: qwen (awake)"


def test_log_lines_have_a_utc_time_and_a_level_as_text_or_json() -> None:
    record = logging.LogRecord("hibernate.serve", logging.WARNING, __file__, 1, "q: %s", ("gone",), None)
    record.created = 1767225600.25  # 2026-01-01T00:00:00.250Z
    assert TextFormat().format(record) == "2026-01-01T00:00:00.250Z WARNING hibernate serve: q: gone"
    assert json.loads(JsonFormat().format(record)) == {
        "time": "2026-01-01T00:00:00.250Z", "level": "warning", "logger": "hibernate.serve",
        "message": "q: gone",
    }  # fmt: skip


def test_a_request_for_a_model_started_on_demand_waits_for_its_start_timeout_if_longer() -> None:
    from hibernate.serve.backends import Fleet

    specs = config(
        document={
            "backend": [
                {"name": "slow", "url": "http://127.0.0.1:8001", "command": "x", "start_timeout": 900},
                {"name": "quick", "url": "http://127.0.0.1:8002", "command": "x", "start_timeout": 5},
                {"name": "plain", "url": "http://127.0.0.1:8003"},
            ]
        }
    ).backends
    fleet = Fleet(specs, None, Recorder(STATES), idle_limit=None, wake_timeout=300.0, budget=None)  # type: ignore[arg-type]
    assert [fleet.patience(b) for b in fleet.backends.values()] == [900.0, 300.0, 300.0]


def test_a_started_backend_gets_serves_environment_and_its_own_but_never_the_token() -> None:
    environ = {"PATH": "/bin", TOKEN_ENV: TOKEN, "CUDA_VISIBLE_DEVICES": "0,1"}
    assert child_environment((("CUDA_VISIBLE_DEVICES", "1"),), environ) == {
        "PATH": "/bin", "CUDA_VISIBLE_DEVICES": "1",
    }  # fmt: skip
    assert environ[TOKEN_ENV] == TOKEN  # serve's own is left as it is


def test_a_backend_with_its_own_command_is_not_also_the_one_dash_dash_command_starts() -> None:
    with pytest.raises(UsageError, match=r"--start q: that backend has its own command in serve\.toml"):
        config(document=backend(command="vllm serve x"), command=["vllm", "serve", "y"], start="q")


def dying_process() -> subprocess.Popen[bytes]:
    """A process caught as a SIGKILLed model is for a moment: its main thread ended (a zombie, as
    /proc shows it) while another thread still runs, so it cannot be reaped yet. That thread ends the
    process once its stdin closes, which this does once it has seen the moment (not after a fixed
    delay a loaded machine could outlast)."""
    code = (
        "import ctypes, os, sys, threading\n"
        "threading.Thread(target=lambda: (sys.stdin.buffer.read(), os._exit(0))).start()\n"
        "ctypes.CDLL(None).pthread_exit(None)\n"  # the GIL is let go: the other thread goes on
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
    wait_until(
        lambda: Path(f"/proc/{process.pid}/stat").read_text().split(") ")[1][0] == "Z",
        60,
        "its main thread to end",
    )
    assert process.poll() is None
    assert process.stdin is not None
    process.stdin.close()  # now it dies: whoever looks next finds it dying or gone
    return process


def fleet_of_a_started_model(process: subprocess.Popen[bytes]) -> Any:
    from hibernate.errors import NoSuchProcessError
    from hibernate.serve.backends import Fleet

    class AgentGone:
        def adopt(self, spec: Any, pid: int | None = None) -> Any:
            raise NoSuchProcessError(f"no hibernate agent in process {pid}")

    specs = config(
        document={"backend": [{"name": "a", "url": "http://127.0.0.1:8001", "command": "x"}]}
    ).backends
    fleet = Fleet(specs, AgentGone(), Recorder(STATES), idle_limit=None, wake_timeout=5.0, budget=None)  # type: ignore[arg-type]
    backend = fleet.backends["a"]
    backend.state, backend.pid, backend.process = State.AWAKE, process.pid, process
    return fleet


def test_a_started_model_seen_gone_while_it_dies_is_reaped_and_stopped_not_failed() -> None:
    """A killed model loses its agent before it can be reaped: a request or probe that finds the agent
    gone, and the periodic read of its state, wait for the exit, so the model is startable again."""
    from hibernate.serve.leases import Verdict

    fleet = fleet_of_a_started_model(dying := dying_process())
    assert asyncio.run(fleet._found_gone(fleet.backends["a"], Verdict(False, "gone", "went away")))
    assert fleet.backends["a"].state is State.STOPPED and dying.returncode == 0

    fleet = fleet_of_a_started_model(dying := dying_process())
    asyncio.run(fleet.refresh_states())
    assert fleet.backends["a"].state is State.STOPPED and dying.returncode == 0
