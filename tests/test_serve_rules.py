"""`hibernate serve`'s decisions on their own: configuration, routing, idle and budget (pure functions)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode, UsageError
from hibernate.serve.backends import Candidate, State, idle_due, plan_room, plan_room_measured
from hibernate.serve.config import BackendSpec, build_config, parse_listen, parse_size
from hibernate.serve.discovery import listening_inodes
from hibernate.serve.hibernator import refuse_tree_holding_proxy
from hibernate.serve.routing import ApiError, by_prefix, model_of, models_list, route
from tests.conftest import REPO, run_cli

A = BackendSpec("a", "http://127.0.0.1:8001", prefix="/a")
B = BackendSpec("b", "http://127.0.0.1:8002", models=("org/model-b", "b-alias"))
BACKENDS = (A, B)


def config(**given: Any) -> Any:
    values: dict[str, Any] = {
        "listen": None, "to": Path("/snap"), "backend_flags": ["a=http://127.0.0.1:8001"],
        "idle": None, "wake_timeout": None, "gpu_budget": None,
    }  # fmt: skip
    values.update(given)
    return build_config(**values)


def test_flags_build_a_config_that_listens_on_localhost_by_default() -> None:
    settings = config(idle=300.0, gpu_budget="1.5GiB")
    assert (settings.host, settings.port, settings.is_local) == ("127.0.0.1", 8000, True)
    assert settings.idle == 300.0 and settings.gpu_budget == 3 << 29 and not settings.measure_gpu
    named = config(backend_flags=["Qwen/Qwen3-8B=http://127.0.0.1:8001"]).backends[0]
    assert (named.name, named.model_names) == ("Qwen/Qwen3-8B", ("Qwen/Qwen3-8B",))  # vLLM's default name
    measured = config(gpu_budget="auto")
    assert measured.gpu_budget is None and measured.measure_gpu
    assert settings.backends == (BackendSpec("a", "http://127.0.0.1:8001"),)


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"backend_flags": []}, "no backend"),
        ({"backend_flags": ["a"]}, "--backend must be NAME=http://HOST:PORT"),
        ({"backend_flags": ["a=https://h:1"]}, "must be http://HOST:PORT"),
        ({"backend_flags": ["a=http://h:1/v1"]}, "no path"),
        ({"backend_flags": ["a b=http://h:1"]}, "a backend name is"),
        ({"backend_flags": ["a=http://h:1", "a=http://h:2"]}, "two backends are named 'a'"),
        ({"backend_flags": ["a=http://h:1", "b=http://h:1"]}, "the same address"),
        ({"to": None}, "--to DIR is required"),
        ({"listen": "8000"}, "--listen must be HOST:PORT"),
        ({"idle": 0.0}, "--idle must be a number of seconds above 0"),
        ({"idle": 1e9}, "at most 86400"),
        ({"wake_timeout": float("nan")}, "--wake-timeout"),
        ({"gpu_budget": "lots"}, "--gpu-budget must be a size"),
        ({"command": ["x"], "backend_flags": ["a=http://h:1", "b=http://h:2"]}, "say which with --start"),
        ({"command": ["x"], "start": "zz"}, "--start zz: no such backend"),
        ({"start": "a"}, "there is no command"),
    ],
)
def test_bad_settings_are_refused_with_what_is_wrong(given: dict[str, Any], words: str) -> None:
    with pytest.raises(UsageError, match=words.replace("(", r"\(").replace("[", r"\[")):
        config(**given)


def test_toml_tables_give_models_prefixes_pids_idle_times_and_limits() -> None:
    document = {
        "listen": "0.0.0.0:9000",
        "to": "/nvme/snap",
        "idle": 60,
        "backend": [
            {
                "name": "q",
                "url": "http://127.0.0.1:8001",
                "models": ["Qwen/Qwen3-8B"],
                "prefix": "/q/",
                "pid": 42,
                "idle": 30,
            }
        ],
        "limits": {"max_body_bytes": 1024, "body_timeout": 2},
    }
    settings = config(to=None, backend_flags=[], document=document)
    assert (settings.host, settings.port, settings.is_local) == ("0.0.0.0", 9000, False)
    assert settings.backends == (
        BackendSpec("q", "http://127.0.0.1:8001", ("Qwen/Qwen3-8B",), "/q", 42, 30.0),
    )
    assert settings.limits.max_body_bytes == 1024 and settings.limits.body_timeout == 2.0
    with pytest.raises(UsageError, match="unknown key"):
        config(document={"idel": 3})
    with pytest.raises(UsageError, match="prefix '/v1' is the proxy's own"):
        config(document={"backend": [{"name": "q", "url": "http://h:1", "prefix": "/v1"}]})
    with pytest.raises(UsageError, match="max_body_bytes must be a positive integer"):
        config(document={"limits": {"max_body_bytes": -1}})


def test_sizes_and_listen_addresses() -> None:
    assert parse_size("40GiB", "x") == 40 << 30
    assert parse_size("512m", "x") == 512 << 20
    assert parse_size(1000, "x") == 1000
    assert parse_listen("[::1]:0") == ("::1", 0)
    with pytest.raises(UsageError):
        parse_size("0", "x")


def test_a_request_is_routed_by_prefix_first_then_by_model() -> None:
    assert by_prefix("/a/v1/completions?x=1", BACKENDS) == by_prefix("/a/v1/completions?x=1", BACKENDS)
    assert route("GET", "/a/health", b"", BACKENDS).path == "/health"
    assert route("POST", "/a", b"", BACKENDS).path == "/"
    assert route("POST", "/v1/completions", b'{"model": "b-alias"}', BACKENDS).backend == "b"
    assert route("POST", "/v1/chat/completions", b'{"model": "a"}', BACKENDS).backend == "a"
    assert by_prefix("/ab/v1", BACKENDS) is None  # a prefix is a whole path segment


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "words"),
    [
        ("POST", "/v1/completions", b"{not json", 400, "not valid JSON"),
        ("POST", "/v1/completions", b"", 400, "has no body"),
        ("POST", "/v1/completions", b"[1]", 400, "must be a JSON object"),
        ("POST", "/v1/completions", b'{"model": 3}', 400, "names no model"),
        ("POST", "/v1/completions", b'{"model": "zz"}', 404, "The model `zz` does not exist"),
        ("GET", "/elsewhere", b"", 404, "is not routed"),
    ],
)
def test_bad_requests_get_openai_style_errors(
    method: str, path: str, body: bytes, status: int, words: str
) -> None:
    with pytest.raises(ApiError) as caught:
        route(method, path, body, BACKENDS)
    assert caught.value.status == status
    error = caught.value.body()["error"]
    assert words in error["message"] and error["code"] == status and error["type"]


def test_model_of_reads_only_the_model_field() -> None:
    assert model_of(b'{"model": "m", "prompt": "hi"}') == "m"


def test_models_list_names_every_model_with_its_backend_and_state() -> None:
    listed = models_list(BACKENDS, {"a": "asleep", "b": "awake"})["data"]
    assert [(m["id"], m["backend"], m["state"]) for m in listed] == [
        ("a", "a", "asleep"), ("org/model-b", "b", "awake"), ("b-alias", "b", "awake"),
    ]  # fmt: skip


def candidate(name: str, state: State, nbytes: int = 10, used: float = 0.0, in_flight: int = 0) -> Candidate:
    return Candidate(name, state, nbytes, used, in_flight)


def test_idle_means_awake_nothing_in_flight_and_quiet_for_long_enough() -> None:
    backends = [
        candidate("quiet", State.AWAKE, used=0.0),
        candidate("recent", State.AWAKE, used=95.0),
        candidate("streaming", State.AWAKE, used=0.0, in_flight=1),
        candidate("asleep", State.ASLEEP, used=0.0),
        candidate("waking", State.WAKING, used=0.0),
    ]
    assert idle_due(backends, now=100.0, idle=10.0) == ["quiet"]
    assert idle_due(backends, now=100.0, idle=None) == []  # no --idle: never
    own = [
        Candidate("patient", State.AWAKE, 10, 0.0, 0, idle=200.0),
        Candidate("eager", State.AWAKE, 10, 95.0, 0, idle=1.0),
    ]
    assert idle_due(own, now=100.0, idle=10.0) == ["eager"]  # a backend's own idle time wins
    assert idle_due(own, now=100.0, idle=None) == ["eager"]


def test_room_is_made_from_the_least_recently_used_idle_backend() -> None:
    others = [
        candidate("old", State.AWAKE, used=1.0),
        candidate("older-but-busy", State.AWAKE, used=0.5, in_flight=2),
        candidate("new", State.AWAKE, used=5.0),
        candidate("asleep", State.ASLEEP, used=0.0),
    ]
    assert plan_room(10, 40, others).action == "fits"
    assert (plan_room(20, 40, others).action, plan_room(20, 40, others).victim) == ("evict", "old")
    busy = [candidate("busy", State.AWAKE, in_flight=1), candidate("going", State.SLEEPING)]
    assert plan_room(10, 20, busy).action == "wait"
    assert plan_room(50, 40, []).action == "never"


def test_measured_room_is_made_on_the_gpu_that_lacks_it() -> None:
    others = [
        Candidate("old-gpu1", State.AWAKE, 0, 0.0, 0, {"GPU-1": 30}),
        Candidate("old-gpu0", State.AWAKE, 0, 1.0, 0, {"GPU-0": 30}),
        Candidate("new-gpu0", State.AWAKE, 0, 2.0, 0, {"GPU-0": 30}),
    ]
    free = {"GPU-0": 10, "GPU-1": 50}
    assert plan_room_measured({"GPU-1": 40}, free, others).action == "fits"
    assert plan_room_measured({}, free, others).action == "fits"  # never seen awake: nothing to plan with
    room = plan_room_measured({"GPU-0": 20}, free, others)
    assert (room.action, room.victim) == ("evict", "old-gpu0")  # not old-gpu1: it is on the other GPU
    busy = [Candidate("busy", State.AWAKE, 0, 0.0, 1, {"GPU-0": 30})]
    assert plan_room_measured({"GPU-0": 20}, free, busy).action == "wait"
    assert plan_room_measured({"GPU-0": 20}, free, others[:1]).action == "never"  # held by someone else


PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1
   1: 0100007F:1F41 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 5151 1
   2: 00000000:1F42 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 6363 1
"""


def test_the_listening_socket_of_a_port_is_found_in_proc_net_tcp() -> None:
    assert listening_inodes(PROC_NET_TCP, 8001) == {4242}  # not the established connection 5151
    assert listening_inodes(PROC_NET_TCP, 8002) == {6363}
    assert listening_inodes(PROC_NET_TCP, 9) == set()


# -- the command ------------------------------------------------------------------------------


def test_without_the_extra_serve_says_how_to_install_it(tmp_path: Path) -> None:
    missing = tmp_path / "aiohttp"
    missing.mkdir()
    (missing / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'aiohttp'\", name='aiohttp')\n"
    )
    result = run_cli(
        "serve", "--to", str(tmp_path), "--backend", "a=http://127.0.0.1:9",
        env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"},
    )  # fmt: skip
    assert result.returncode == ExitCode.UNSUPPORTED, result.stderr
    assert "hibernate serve needs aiohttp, which is not installed" in result.stderr
    assert "pip install 'hibernate[serve]'" in result.stderr


def test_bad_flags_are_refused_before_anything_starts(tmp_path: Path) -> None:
    result = run_cli("serve", "--to", str(tmp_path), "--backend", "a=http://127.0.0.1:9", "--idle", "-1")
    assert result.returncode == ExitCode.USAGE
    assert "--idle must be a number of seconds above 0" in result.stderr


def test_a_backend_pid_whose_tree_holds_the_proxy_is_refused() -> None:
    # pid 1, or the shell that started the proxy: a sleep would act on every process under it.
    for pid in (1, os.getppid(), os.getpid()):
        with pytest.raises(UsageError, match=f"pid {pid} is this proxy .* or one of its ancestors"):
            refuse_tree_holding_proxy("qwen", pid)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        refuse_tree_holding_proxy("qwen", child.pid)  # a process below the proxy is a backend it may act on
    finally:
        child.kill()
        child.wait()
