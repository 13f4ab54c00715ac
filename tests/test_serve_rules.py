"""`hibernate serve`'s decisions on their own: configuration, routing, idle and budget, which process
serves an address (pure functions, and real listeners), and what it refuses at start."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode, PermissionDeniedError, ProtocolError, UsageError
from hibernate.procinfo import describe_user
from hibernate.serve.config import BackendSpec, build_config, parse_listen, parse_size
from hibernate.serve.control import BackendControl, refuse_other_user, refuse_tree_holding_proxy
from hibernate.serve.decisions import Candidate, State, idle_due, plan_room, plan_room_measured
from hibernate.serve.discovery import (
    Listener,
    Server,
    host_addresses,
    listeners,
    parse_address,
    reached,
    roots,
    server_at,
)
from hibernate.serve.httplog import LineBudget, OneLine
from hibernate.serve.leases import Verdict, refusal
from hibernate.serve.routing import ApiError, by_prefix, model_of, models_list, route
from tests.conftest import NOBODY, REPO, as_user_prefix, free_port, is_root, run_cli

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
    assert settings.idle_limit == 300.0 and settings.gpu_budget == 3 << 29 and not settings.measure_gpu
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
        ({"backend_flags": ["a=http://h:0"]}, "port 0 names no server"),
        ({"backend_flags": ["a=http://user:secret@h:1"]}, "a backend's address holds no user or password"),
        ({"backend_flags": ["a=http://user@h:1"]}, "a backend's address holds no user or password"),
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


@pytest.mark.parametrize(
    ("document", "words"),
    [
        (
            {"limits": {"max_body_bytes": -1}},
            "serve.toml: [limits] max_body_bytes: must be a positive integer",
        ),
        ({"limits": {"body_timeout": 0}}, "serve.toml: [limits] body_timeout: must be a number of seconds"),
        ({"limits": {"max_bdy_bytes": 1}}, "serve.toml: [limits]: unknown key(s) max_bdy_bytes"),
        ({"limits": 3}, "serve.toml: [limits]: must be a table"),
        ({"idel": 3}, "serve.toml: unknown key(s) idel"),
        ({"idle": -1}, "serve.toml: idle: must be a number of seconds above 0"),
        ({"wake_timeout": "x"}, "serve.toml: wake_timeout: must be a number of seconds"),
        ({"sleep_timeout": 0}, "serve.toml: sleep_timeout: must be a number of seconds"),
        ({"gpu_budget": "lots"}, "serve.toml: gpu_budget: must be a size"),
        ({"listen": 8000}, "serve.toml: listen: must be HOST:PORT"),
        ({"to": 5}, "serve.toml: to: must name a directory"),
        ({"backend": {"name": "q"}}, "serve.toml: backend: backends are [[backend]] tables"),
        ({"backend": [{"name": "q"}]}, "serve.toml: [[backend]] #1 url: required, as a string"),
        (
            {"backend": [{"name": "q", "url": "http://h:1", "pid": 0}]},
            "serve.toml: [[backend]] #1 pid: must be",
        ),
        (
            {"backend": [{"name": "q", "url": "http://h:1", "idle": 0}]},
            "serve.toml: [[backend]] #1 idle: must be",
        ),
        (
            {"backend": [{"name": "q", "url": "https://h:1"}]},
            "serve.toml: [[backend]] #1 url: a backend's address",
        ),
        (
            {"backend": [{"name": "q", "url": "http://h:1", "prefix": "/v1"}]},
            "serve.toml: [[backend]] #1 prefix: the prefix",
        ),
        (
            {"backend": [{"name": "q q", "url": "http://h:1"}]},
            "serve.toml: [[backend]] #1 name: a backend name",
        ),
        (
            {"backend": [{"name": "q", "url": "http://h:1", "modle": 1}]},
            "serve.toml: [[backend]] #1: unknown key",
        ),
    ],
)
def test_every_serve_toml_error_names_the_file_the_table_and_the_key(
    document: dict[str, Any], words: str
) -> None:
    flags: dict[str, Any] = {"backend_flags": [], "to": None} if "to" in document else {"backend_flags": []}
    if "backend" not in document:
        flags["backend_flags"] = ["a=http://127.0.0.1:8001"]
    with pytest.raises(UsageError) as refused:
        config(document={"to": "/snap", **document}, **flags)
    assert refused.value.message.startswith(words), refused.value.message


def test_a_serve_toml_error_reaches_the_terminal_whole(tmp_path: Path) -> None:
    """The table's brackets are text, not markup: nothing of the message is lost on the way."""
    toml = tmp_path / "serve.toml"
    toml.write_text(
        'to = "/snap"\n[[backend]]\nname = "a"\nurl = "http://127.0.0.1:9"\n[limits]\nmax_body_bytes = 0\n'
    )
    result = run_cli("serve", "--config", str(toml))
    assert result.returncode == ExitCode.USAGE
    assert result.stderr.splitlines()[0] == (
        f"hibernate: error: {toml}: [limits] max_body_bytes: must be a positive integer, not 0"
    )


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
        ("POST", "/v1/completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
        ("POST", "/v1/completions", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 400, "nested too deeply"),
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
    assert idle_due(backends, now=100.0, idle_limit=10.0) == ["quiet"]
    assert idle_due(backends, now=100.0, idle_limit=None) == []  # no --idle: never
    own = [
        Candidate("patient", State.AWAKE, 10, 0.0, 0, idle_limit=200.0),
        Candidate("eager", State.AWAKE, 10, 95.0, 0, idle_limit=1.0),
    ]
    assert idle_due(own, now=100.0, idle_limit=10.0) == ["eager"]  # a backend's own idle time wins
    assert idle_due(own, now=100.0, idle_limit=None) == ["eager"]


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


# As a little-endian machine prints them: 127.0.0.1:8001 and 127.0.0.2:8001 (one port, two
# addresses), a connection to the first, 0.0.0.0:8002, and in tcp6 [::1]:8001, [::]:8003 and
# [::ffff:127.0.0.3]:8004.
PROC_NET_TCP = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4242 1
   1: 0200007F:1F41 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1001        0 4343 1
   2: 0100007F:1F41 0100007F:9C40 01 00000000:00000000 00:00000000 00000000  1000        0 5151 1
   3: 00000000:1F42 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 6363 1
"""
PROC_NET_TCP6 = """\
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F41 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 7171 1
   1: 00000000000000000000000000000000:1F43 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 7272 1
   2: 0000000000000000FFFF00000300007F:1F44 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 7373 1
"""  # noqa: E501
SOCKETS = listeners(PROC_NET_TCP, "little") + listeners(PROC_NET_TCP6, "little")


def by_inode(found: list[Listener]) -> list[int]:
    return [s.inode for s in found]


def test_listening_sockets_are_read_from_proc_net_tcp_with_their_addresses() -> None:
    assert parse_address("0100007F", "little") == ip_address("127.0.0.1")
    assert parse_address("7F000001", "big") == ip_address("127.0.0.1")
    assert parse_address("00000000000000000000000001000000", "little") == ip_address("::1")
    assert parse_address("0000000000000000FFFF00000300007F", "little") == ip_address("127.0.0.3")  # mapped
    assert [(str(s), s.uid, s.inode) for s in SOCKETS] == [
        ("127.0.0.1:8001", 1000, 4242),  # not the established connection 5151
        ("127.0.0.2:8001", 1001, 4343),
        ("0.0.0.0:8002", 1000, 6363),
        ("[::1]:8001", 1000, 7171),
        ("[::]:8003", 1000, 7272),
        ("127.0.0.3:8004", 1000, 7373),
    ]


def test_a_connection_reaches_the_socket_bound_to_its_address_before_any_wildcard() -> None:
    loopback, other = ip_address("127.0.0.1"), ip_address("127.0.0.2")
    assert by_inode(reached(SOCKETS, loopback, 8001)) == [4242]  # not 127.0.0.2's, on the same port
    assert by_inode(reached(SOCKETS, other, 8001)) == [4343]
    assert by_inode(reached(SOCKETS, ip_address("127.0.0.9"), 8001)) == []
    assert by_inode(reached(SOCKETS, loopback, 8002)) == [6363]  # 0.0.0.0 covers every IPv4 address
    assert by_inode(reached(SOCKETS, ip_address("::1"), 8002)) == []  # ... and no IPv6 one
    assert by_inode(reached(SOCKETS, loopback, 8003)) == [7272]  # a dual-stack [::] covers IPv4 last
    assert by_inode(reached(SOCKETS, ip_address("::1"), 8003)) == [7272]
    assert by_inode(reached(SOCKETS, ip_address("127.0.0.3"), 8004)) == [7373]  # mapped: the same address
    bound_and_wildcard = [*SOCKETS, Listener(ip_address("0.0.0.0"), 8001, 0, 9999)]
    assert by_inode(reached(bound_and_wildcard, loopback, 8001)) == [4242]  # the exact address wins


def test_a_backend_host_names_its_addresses_and_localhost_names_both_loopbacks() -> None:
    assert host_addresses("localhost") == [ip_address("127.0.0.1"), ip_address("::1")]
    assert host_addresses("127.0.0.2") == [ip_address("127.0.0.2")]
    assert host_addresses("[::1]") == [ip_address("::1")]
    assert host_addresses("::ffff:127.0.0.1") == [ip_address("127.0.0.1")]
    resolved = host_addresses("models.internal", lambda name: ["10.0.0.5", "10.0.0.5", "fd00::5"])
    assert resolved == [ip_address("10.0.0.5"), ip_address("fd00::5")]


def test_the_servers_among_socket_holders_are_those_no_other_holder_started() -> None:
    parents = {10: 1, 11: 10, 12: 11, 20: 1, 30: 99, 99: 1}
    assert roots([12, 10, 11], parents.get) == [10]  # workers that inherited the server's socket
    assert roots([10, 20], parents.get) == [10, 20]  # two servers: ambiguous
    assert roots([30], parents.get) == [30]


def test_as_root_another_users_process_is_adopted_only_when_serve_toml_names_it() -> None:
    listener = Listener(ip_address("127.0.0.1"), 8001, 1000, 4242)
    theirs = Server(4321, 1000, listener, "python -m vllm serve")
    with pytest.raises(
        PermissionDeniedError, match=r"pid 4321 on 127.0.0.1:8001 .*belongs to .*uid 1000"
    ) as e:
        refuse_other_user("qwen", theirs, euid=0)
    assert e.value.hint is not None and "pid = 4321" in e.value.hint
    refuse_other_user("qwen", Server(4321, 0, listener, "x"), euid=0)  # root's own
    refuse_other_user("qwen", theirs, euid=1000)  # a user sees only their own processes' sockets


def test_a_refused_lease_says_what_the_backend_really_is() -> None:
    asleep = {"granted": False, "reason": "asleep", "state": "asleep"}
    busy = {"granted": False, "reason": "busy", "state": "quiesced", "by": ["hibernate (pid 7, uid 0)"]}
    closed = {"granted": False, "reason": "closed", "by": ["hibernate (pid 8, uid 0)"]}
    granted = {"granted": True, "held": 1}
    assert refusal([granted, asleep]) == Verdict(False, "asleep", "asleep")
    assert refusal([asleep, busy]).reason == "busy"  # a worker asleep while another is being woken
    assert "hibernate (pid 8, uid 0)" in refusal([closed, granted]).detail
    gone = refusal([granted, ConnectionResetError("reset")])
    assert gone.reason == "gone" and "reset" in gone.detail
    failed = refusal([ProtocolError("unknown operation 'lease'")])  # an agent of another version
    assert failed == Verdict(False, "failed", "unknown operation 'lease'")


def test_log_lines_are_bounded_per_window_and_say_how_many_were_held_back() -> None:
    budget = LineBudget(lines=2, window=10.0)
    admitted = [budget.admit(t) for t in (0.0, 1.0, 2.0, 3.0, 9.0, 10.5, 11.0, 12.0)]
    assert admitted == [
        (True, 0), (True, 0), (False, 0), (False, 0), (False, 0), (True, 3), (True, 0), (False, 0),
    ]  # fmt: skip


def test_a_bad_request_logged_by_aiohttp_becomes_one_line_without_its_traceback() -> None:
    now = [0.0]
    one_line = OneLine(LineBudget(lines=1, window=10.0), clock=lambda: now[0])
    try:
        raise ValueError("Invalid header token:\n\n    b'Bad Header'\n         ^")
    except ValueError:
        record = logging.LogRecord(
            "hibernate.serve.http", logging.ERROR, __file__, 1, "Error handling request from %s",
            ("127.0.0.1",), sys.exc_info(),
        )  # fmt: skip
    assert one_line.filter(record)
    assert record.exc_info is None and record.args is None
    assert (
        record.getMessage()
        == "Error handling request from 127.0.0.1: ValueError: Invalid header token: b'Bad Header' ^"
    )
    assert not one_line.filter(logging.LogRecord("h", logging.ERROR, __file__, 1, "again", None, None))
    now[0] = 11.0
    record = logging.LogRecord("h", logging.ERROR, __file__, 1, "later", None, None)
    assert one_line.filter(record) and record.getMessage() == "later (1 more like it not logged)"


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


LISTENER = """
import socket, sys
sock = socket.socket()
if sys.argv[3] == "reuse":
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
sock.bind((sys.argv[1], int(sys.argv[2])))
sock.listen()
print("listening", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def listen() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """A process listening on HOST:PORT, started and ended by the test."""
    started: list[subprocess.Popen[str]] = []

    def start(host: str, port: int, reuse: bool = False, uid: int | None = None) -> subprocess.Popen[str]:
        command = [sys.executable, "-c", LISTENER, host, str(port), "reuse" if reuse else "-"]
        proc = subprocess.Popen(
            [*as_user_prefix(uid), *command],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        started.append(proc)
        assert proc.stdout is not None and proc.stdout.readline() == "listening\n"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_two_listeners_on_one_port_each_serve_their_own_address(
    listen: Callable[..., subprocess.Popen[str]],
) -> None:
    port = free_port()
    other = listen("127.0.0.2", port)  # the first: the lower pid
    backend = listen("127.0.0.1", port)
    found = server_at("127.0.0.1", port)
    assert found is not None and (found.pid, str(found.listener)) == (backend.pid, f"127.0.0.1:{port}")
    assert getattr(server_at("localhost", port), "pid", None) == backend.pid  # localhost: the loopbacks
    assert getattr(server_at("127.0.0.2", port), "pid", None) == other.pid
    assert server_at("127.0.0.3", port) is None


def test_unrelated_processes_behind_one_address_are_refused_with_the_candidates_named(
    listen: Callable[..., subprocess.Popen[str]],
) -> None:
    port = free_port()
    first = listen("127.0.0.1", port, reuse=True)
    second = listen("127.0.0.1", port, reuse=True)
    with pytest.raises(UsageError) as refused:
        server_at("127.0.0.1", port)
    message = refused.value.message
    assert f"127.0.0.1:{port} is served by 2 unrelated processes" in message
    assert (
        f"pid {first.pid} on 127.0.0.1:{port} (" in message
        and f"pid {second.pid} on 127.0.0.1:{port} (" in message
    )
    assert (
        refused.value.hint is not None and "pid" in refused.value.hint and "serve.toml" in refused.value.hint
    )


@pytest.mark.skipif(not is_root(), reason="needs root (a process of another user)")
def test_as_root_a_process_of_another_user_found_from_its_address_is_refused(
    listen: Callable[..., subprocess.Popen[str]], tmp_path: Path
) -> None:
    port = free_port()
    theirs = listen("127.0.0.1", port, uid=NOBODY)
    control = BackendControl(tmp_path, 5.0)
    with pytest.raises(PermissionDeniedError) as refused:
        control.find(BackendSpec("qwen", f"http://127.0.0.1:{port}"))
    assert f"backend qwen: pid {theirs.pid} on 127.0.0.1:{port} (" in refused.value.message
    assert f"belongs to nobody (uid {NOBODY})" in refused.value.message
    assert refused.value.hint is not None and f"pid = {theirs.pid}" in refused.value.hint
    named = BackendSpec("qwen", f"http://127.0.0.1:{port}", pid=theirs.pid)
    assert control.find(named) == theirs.pid  # serve.toml names it: adopted as asked


@pytest.mark.slow
def test_inputs_given_at_start_are_refused_at_start_in_one_line(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    config = tmp_path / "serve.toml"
    config.write_text(f'[[backend]]\nname = "a"\nurl = "http://127.0.0.1:9"\npid = {gone.pid}\n')
    no_such_pid = tmp_path / "no-such-pid.toml"  # beyond any pid: a typo, not a process that is gone
    no_such_pid.write_text('[[backend]]\nname = "a"\nurl = "http://127.0.0.1:9"\npid = 99999999999\n')
    backend = ["--backend", "a=http://127.0.0.1:9"]
    on_demand = tmp_path / "on-demand.toml"
    on_demand.write_text(
        '[[backend]]\nname = "a"\nurl = "http://127.0.0.1:9"\ncommand = "/nonexistent/vllm serve"\n'
    )
    token = tmp_path / "token"
    token.write_text("a-long-enough-token-0123456789\n")
    token.chmod(0o644)
    cases = [
        ([*backend, "--to", "/etc/passwd"], ExitCode.USAGE, "--to /etc/passwd is a file, not a directory"),
        (
            [*backend, "--to", "/etc/passwd/snap"],
            ExitCode.USAGE,
            "--to /etc/passwd/snap cannot be created: /etc/passwd is a file, not a directory",
        ),
        (
            [*backend, "--to", str(tmp_path), "--listen", f"127.0.0.1:{port}"],
            ExitCode.USAGE,
            f"--listen 127.0.0.1:{port}: ",
        ),
        (
            ["--to", str(tmp_path), "--config", str(config)],
            ExitCode.NO_SUCH_PROCESS,
            f"backend a: no process with pid {gone.pid}",
        ),
        (
            ["--to", str(tmp_path), "--config", str(no_such_pid)],
            ExitCode.USAGE,
            f"{no_such_pid}: [[backend]] #1 pid: must be a process id, 1 to 4194303 (the most Linux allows), "
            "not 99999999999",
        ),
        (
            [*backend, "--to", str(tmp_path), "--", "/nonexistent/server"],
            ExitCode.USAGE,
            "-- /nonexistent/server: ",
        ),
        (
            ["--to", str(tmp_path), "--config", str(on_demand)],
            ExitCode.USAGE,
            "backend a: command /nonexistent/vllm: no such command",
        ),
        (
            [*backend, "--to", str(tmp_path), "--token-file", str(token)],
            ExitCode.USAGE,
            f"--token-file {token} can be read or written by others "
            f"(mode 644, owner {describe_user(os.geteuid())})",
        ),
        ([*backend, "--to", str(tmp_path), "--log-format", "xml"], ExitCode.USAGE, "--log-format must be"),
    ]
    try:
        for args, code, words in cases:
            result = run_cli("serve", *args, timeout=60)
            lines = result.stderr.splitlines()
            assert result.returncode == code, result.stderr
            assert lines[0].startswith(f"hibernate: error: {words}"), lines
            assert len(lines) <= 2 and all(line.startswith("  hint: ") for line in lines[1:]), lines
            if "--listen" in args:
                assert lines[1:] == ["  hint: another server listens there: stop it or choose another port"]
        # A backend started with the proxy that exits before it listens: the process is gone (3), not a
        # bug of hibernate's (1); its start was logged, then one error line.
        result = run_cli("serve", *backend, "--to", str(tmp_path), "--", sys.executable, "-c", "exit(3)")
        assert result.returncode == ExitCode.NO_SUCH_PROCESS, result.stderr
        assert result.stderr.splitlines()[-1] == "hibernate: error: backend a's command exited with status 3"
    finally:
        taken.close()
