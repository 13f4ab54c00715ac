"""The parts of the vLLM server flow and of self-checkpoint that can be tested on their own.

The server's address, the HTTP client's answers to each way a server can
fail (against a small HTTP server in this process), the rules that decide
when a long request has gone silent, the watcher that waits for vLLM's
``Worker.sleep`` to return, the order of checkpoint and restore around
vLLM's calls, and the helper process with the stand-in driver.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar

import pytest

from hibernate.errors import (
    ExitCode,
    HibernateTimeoutError,
    ServerFailedError,
    UnsupportedError,
    UsageError,
)
from hibernate.flows.vllm_api import (
    DevEndpointsMissingError,
    ServerAddress,
    ServerConnectionLost,
    ServerUnreachableError,
    VllmServer,
    address_from_argv,
    flag_values,
    parse_url,
    query_string,
)
from hibernate.flows.vllm_rules import (
    SilenceWatch,
    check_drain,
    check_level,
    holds_pools,
    progress,
    signature,
)
from hibernate.integrations.self_checkpoint import (
    HelperProcess,
    SelfCheckpointer,
    on_stack,
    wait_until_returned,
)
from tests.conftest import stays_false, wait_until
from tests.standins.world import World

# -- where the server listens --------------------------------------------------------------


def test_the_address_comes_from_the_servers_flags_with_vllms_defaults() -> None:
    default = address_from_argv(["vllm", "serve", "Qwen/Qwen3-8B", "--enable-sleep-mode"], 42)
    assert default.url == "http://127.0.0.1:8000"
    assert default.found == "vLLM's default address (port 8000): the command line of pid 42 sets no --port"
    spelled = address_from_argv(["vllm", "serve", "m", "--host=0.0.0.0", "--port", "9001"], 7)
    assert spelled.url == "http://127.0.0.1:9001"
    assert spelled.found == "--port 9001 --host 0.0.0.0 on the command line of pid 7"
    host_only = address_from_argv(["vllm", "serve", "m", "--host", "10.1.2.3"], 7)
    assert host_only.url == "http://10.1.2.3:8000" and "vLLM's default port 8000" in host_only.found
    assert address_from_argv(["x", "--host", "::", "--port", "1"], 1).url == "http://[::1]:1"
    assert address_from_argv(["x", "--host", "fe80::1", "--port", "1"], 1).url == "http://[fe80::1]:1"
    assert (
        address_from_argv(["x", "--ssl-certfile", "c.pem", "--port", "443"], 1).url == "https://127.0.0.1:443"
    )
    uds = address_from_argv(["x", "--port", "1", "--uds", "/run/vllm.sock"], 3)
    assert uds == ServerAddress("unix:/run/vllm.sock", "--uds on the command line of pid 3")
    config = address_from_argv(["vllm", "serve", "--config", "serve.yaml"], 5)
    assert "it reads --config serve.yaml, which may set another port" in config.found
    assert address_from_argv(["x", "--port", "notaport"], 1).url == "http://127.0.0.1:8000"


def test_flags_are_read_as_argparse_reads_them() -> None:
    argv = ["x", "--port", "1", "--port=2", "--sleep_mode_backend", "cumem", "--host", "--port", "3"]
    assert flag_values(argv) == {"--port": "3", "--sleep-mode-backend": "cumem"}


def test_a_given_url_is_checked_before_anything_is_touched() -> None:
    assert parse_url("http://10.0.0.1:8000/") == ServerAddress("http://10.0.0.1:8000", "--vllm-url")
    assert parse_url("https://gpu7/vllm").url == "https://gpu7/vllm"
    assert parse_url("unix:/run/v.sock").url == "unix:/run/v.sock"
    for bad, words in (
        ("localhost:8000", "is not an http(s) URL"),
        ("ftp://x", "is not an http(s) URL"),
        ("http://x:99999", "Port out of range"),
        ("http://x:8000/?a=1", "must not have a query"),
        ("unix:run/v.sock", "unix:/absolute/path"),
    ):
        with pytest.raises(UsageError, match=words.replace("(", r"\(").replace(")", r"\)")) as caught:
            parse_url(bad)
        assert caught.value.exit_code == ExitCode.USAGE


def test_query_strings_are_what_vllm_reads() -> None:
    assert query_string({"level": 1, "mode": "wait"}) == "level=1&mode=wait"
    assert query_string({"tags": ["weights", "kv_cache"]}) == "tags=weights&tags=kv_cache"
    assert query_string({"tags": None}) == ""


# -- the client against a server in this process ------------------------------------------


class _Scripted(BaseHTTPRequestHandler):
    """Answers by path from the class's ``routes``: (status, body) or a callable doing it itself."""

    routes: ClassVar[dict[str, Any]] = {}
    seen: ClassVar[list[str]] = []

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        type(self).seen.append(f"{self.command} {self.path}")
        route = self.routes.get(self.path.split("?")[0])
        if callable(route):
            route(self)
            return
        status, body = route if route is not None else (404, {"detail": "Not Found"})
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer


Scripted = tuple[VllmServer, type[_Scripted]]


@pytest.fixture
def scripted() -> Iterator[Scripted]:
    handler = type("Handler", (_Scripted,), {"routes": {}, "seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    address = ServerAddress(f"http://127.0.0.1:{httpd.server_address[1]}", "a test")
    try:
        yield VllmServer(address, timeout=2.0), handler
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_client_speaks_vllms_sleep_endpoints(scripted: Scripted) -> None:
    server, handler = scripted
    handler.routes = {
        "/is_sleeping": (200, {"is_sleeping": False}),
        "/sleep": (200, {"status": "sleeping", "level": 1}),
        "/wake_up": (200, {"status": "awake", "tags": ["weights"]}),
    }
    assert server.probe() is False
    assert server.sleep(0, "abort") == {"status": "sleeping", "level": 1}
    flight = server.start_sleep(1, "wait")
    assert flight.wait(5) and server.answer(flight)["status"] == "sleeping"
    assert server.wake_up(["weights"])["status"] == "awake"
    assert handler.seen == [
        "GET /is_sleeping",
        "POST /sleep?level=0&mode=abort",
        "POST /sleep?level=1&mode=wait",
        "POST /wake_up?tags=weights",
    ]


def test_vllm_without_dev_mode_is_told_from_something_else(
    scripted: Scripted,
) -> None:
    server, handler = scripted
    handler.routes = {"/version": (200, {"version": "0.33.0"})}
    with pytest.raises(DevEndpointsMissingError) as missing:
        server.probe()
    assert missing.value.exit_code == ExitCode.UNSUPPORTED
    assert (
        "VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --enable-sleep-mode --sleep-mode-backend hibernate"
        in str(missing.value.hint)
    )
    handler.routes = {}
    with pytest.raises(ServerUnreachableError, match="is not a vLLM server") as other:
        server.probe()
    assert other.value.exit_code == ExitCode.USAGE


def test_a_failing_request_carries_the_servers_own_words(
    scripted: Scripted,
) -> None:
    server, handler = scripted
    error = {"error": {"message": "Call to sleep method failed: disk full", "type": "InternalServerError"}}
    handler.routes = {"/sleep": (500, error), "/is_sleeping": (200, {"is_sleeping": "yes"})}
    with pytest.raises(ServerFailedError, match="HTTP 500: Call to sleep method failed: disk full") as failed:
        server.sleep(1, "wait")
    assert failed.value.exit_code == ExitCode.SERVER_FAILED
    with pytest.raises(ServerFailedError, match=r"not \{'is_sleeping': bool\}"):
        server.is_sleeping()


@pytest.mark.slow
def test_silence_and_a_dropped_connection_are_told_apart(
    scripted: Scripted,
) -> None:
    server, handler = scripted

    def slow(request: BaseHTTPRequestHandler) -> None:
        time.sleep(3)

    def hang_up(request: BaseHTTPRequestHandler) -> None:
        request.close_connection = True
        request.connection.shutdown(socket.SHUT_RDWR)

    handler.routes = {"/is_sleeping": slow, "/sleep": hang_up}
    started = time.monotonic()
    with pytest.raises(HibernateTimeoutError, match="did not answer GET /is_sleeping within 2s") as late:
        server.is_sleeping()
    assert late.value.exit_code == ExitCode.TIMEOUT and time.monotonic() - started < 3
    with pytest.raises(ServerConnectionLost, match="closed the connection during POST /sleep"):
        server.sleep(1, "wait")


def test_a_long_request_can_be_given_up(scripted: Scripted) -> None:
    server, handler = scripted
    handler.routes = {"/sleep": lambda request: time.sleep(30)}
    flight = server.start_sleep(1, "wait")
    assert not flight.wait(0.3)
    flight.abort()
    assert flight.wait(5), "the request's thread ends once its connection is closed"
    with pytest.raises(ServerConnectionLost):
        server.answer(flight)


def test_nothing_listening_is_a_usage_error_that_says_where_it_looked() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = VllmServer(ServerAddress(f"http://127.0.0.1:{port}", "--port 5 on the command line of pid 9"), 2)
    with pytest.raises(ServerUnreachableError, match=r"\(--port 5 on the command line of pid 9\)") as caught:
        server.probe()
    assert caught.value.exit_code == ExitCode.USAGE and "--vllm-url" in str(caught.value.hint)


def test_a_unix_socket_server_is_reached(tmp_path: Path) -> None:
    path = tmp_path / "vllm.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        body = b'{"is_sleeping": true}'
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        assert VllmServer(parse_url(f"unix:{path}"), 5).is_sleeping() is True
    finally:
        listener.close()


# -- the rules of the flow -------------------------------------------------------------------


def test_levels_and_drains_are_checked_with_what_each_means() -> None:
    assert check_level(None) == 1 and check_level(2) == 2
    with pytest.raises(UsageError, match="--level must be 1 or 2, not 0") as caught:
        check_level(0)
    assert "level 0 only pauses scheduling" in str(caught.value.hint)
    assert check_drain(None) == "wait" and check_drain("abort") == "abort"
    with pytest.raises(UsageError, match="--drain must be wait or abort, not 'keep'"):
        check_drain("keep")


def test_the_cli_accepts_exactly_the_levels_the_workers_know() -> None:
    """The CLI's rule (light, no store) and the workers' tag rules (in-process) name the same levels."""
    from hibernate.flows.vllm_rules import LEVELS
    from hibernate.pools.vllm import SLEEP_LEVELS

    assert LEVELS == SLEEP_LEVELS


def test_a_worker_is_a_process_whose_agent_lists_cumem_allocations() -> None:
    assert holds_pools({"pools": [{"pool": "vllm-cumem", "bytes": 10}]})
    assert not holds_pools({"pools": []}) and not holds_pools({"pools": None})
    assert not holds_pools({"pools": [{"pool": "tensors", "bytes": 10}]})


def test_only_a_change_the_workers_show_resets_the_silence() -> None:
    watch = SilenceWatch(limit=5.0, since=100.0)
    quiet = {1: {"state": "running", "busy": None, "transfer": None}}
    watch.observe(signature(quiet), 100.0)
    watch.observe(signature(quiet), 104.0)
    assert not watch.expired(104.0) and watch.expired(105.5)
    moving = {1: {"state": "quiesced", "busy": "this process", "transfer": {"phase": "spill", "done": 1}}}
    watch.observe(signature(moving), 105.5)
    assert not watch.expired(110.0)
    more = {1: {**moving[1], "transfer": {"phase": "spill", "done": 2}}}
    watch.observe(signature(more), 110.0)
    assert watch.silent_for(112.0) == 2.0
    assert signature({1: None}) != signature(quiet), "a worker that went away is a change"


def test_progress_counts_only_this_requests_transfers() -> None:
    found = {
        1: {"transfer": {"phase": "spill", "done": 5, "total": 10, "unix": 50.0}},
        2: {"transfer": {"phase": "spill", "done": 7, "total": 7, "unix": 10.0}},  # an older sleep
        3: {"transfer": {"phase": "restore", "done": 1, "total": 2, "unix": 60.0}},
        4: None,
    }
    assert progress(found, "spill", since=40.0) == (5, 10)
    assert progress(found, "restore", since=40.0) == (1, 2)


# -- waiting for vLLM's Worker.sleep to return ---------------------------------------------------


def test_a_frame_is_on_the_stack_of_its_callees_only() -> None:
    def inner(outer: FrameType) -> tuple[bool, bool]:
        here = sys._getframe()
        return on_stack(outer, here), on_stack(here, outer)

    assert inner(sys._getframe()) == (True, False)


def test_the_watcher_waits_until_the_caller_has_returned_and_can_be_called_off() -> None:
    inside, leave, finish = threading.Event(), threading.Event(), threading.Event()
    captured: list[FrameType] = []
    thread_ids: list[int] = []

    def caller() -> None:
        captured.append(sys._getframe())
        thread_ids.append(threading.get_ident())
        inside.set()
        leave.wait(10)

    def work() -> None:
        caller()
        finish.wait(10)

    worker = threading.Thread(target=work)
    worker.start()
    inside.wait(10)
    returned: list[bool] = []
    watcher = threading.Thread(
        target=lambda: returned.append(wait_until_returned(thread_ids[0], captured[0], threading.Event()))
    )
    watcher.start()
    stays_false(lambda: returned, 0.1, "the watcher returned while the caller still runs")
    leave.set()
    watcher.join(5)
    assert returned == [True] and worker.is_alive(), "the caller returned while its thread still runs"
    finish.set()
    worker.join()
    cancelled = threading.Event()
    cancelled.set()
    assert wait_until_returned(threading.get_ident(), sys._getframe(), cancelled) is False


class FakeHelper:
    """Records the order of requests; a 'sleep' can be held until released."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        self.in_sleep = threading.Event()
        self.closed = False

    def call(self, op: str) -> dict[str, Any]:
        if op == "sleep":
            self.in_sleep.set()
            self.hold.wait(10)
        self.calls.append(op)
        return {"status": "checkpointed" if op == "sleep" else "restored", "processes": [{"pid": 1}]}

    def close(self) -> None:
        self.closed = True


def _sleep_like_vllm(coordinator: SelfCheckpointer, events: list[str]) -> None:
    """vLLM's Worker.sleep: suspend (which asks for the checkpoint), then more device calls."""
    coordinator.after_return(sys._getframe(), threading.get_ident())
    time.sleep(0.2)
    events.append("device calls after suspend")


def test_the_checkpoint_comes_only_after_the_caller_of_suspend_returned() -> None:
    helper = FakeHelper()
    coordinator = SelfCheckpointer(helper)
    events: list[str] = []
    _sleep_like_vllm(coordinator, events)
    events.append("returned")
    wait_until(lambda: helper.calls, 5, "the checkpoint after the caller returned", 0.01)
    assert events == ["device calls after suspend", "returned"] and helper.calls == ["sleep"]
    assert coordinator.wake()["status"] == "restored"
    assert helper.calls == ["sleep", "wake"]


def test_a_wake_before_the_checkpoint_started_calls_it_off() -> None:
    helper = FakeHelper()
    coordinator = SelfCheckpointer(helper)

    def suspend_then_resume_in_one_call() -> None:
        coordinator.after_return(sys._getframe(), threading.get_ident())
        coordinator.wake()  # the same caller never returned in between

    suspend_then_resume_in_one_call()
    assert helper.calls == ["wake"]
    stays_false(lambda: helper.calls[1:], 0.1, "the called-off checkpoint ran")


def test_a_wake_during_the_checkpoint_waits_for_it_then_restores() -> None:
    helper = FakeHelper()
    helper.hold.clear()
    coordinator = SelfCheckpointer(helper)
    _sleep_like_vllm(coordinator, [])
    assert helper.in_sleep.wait(5)
    waking = threading.Thread(target=coordinator.wake)
    waking.start()
    stays_false(lambda: helper.calls, 0.2, "the wake called the helper before the checkpoint in flight ended")
    helper.hold.set()
    waking.join(5)
    assert helper.calls == ["sleep", "wake"]
    coordinator.close()
    assert helper.closed


# -- the helper process ------------------------------------------------------------------------


def test_the_helper_acts_only_on_the_process_that_started_it() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hibernate.checkpoint.helper", "--target", "1"],
        capture_output=True,
        text=True,
        input="",
        timeout=60,
    )
    reply = json.loads(out.stdout.splitlines()[0])
    assert reply["ok"] is False and "acts only on the process that started it" in reply["error"]["message"]


def test_without_a_checkpointer_the_helper_refuses_at_once(tmp_path: Path) -> None:
    environ = {
        **os.environ,
        "HIBERNATE_LIBCUDA": str(tmp_path / "no-libcuda.so.1"),
        "HIBERNATE_CUDA_CHECKPOINT": str(tmp_path / "no-cuda-checkpoint"),
    }
    with pytest.raises(UnsupportedError, match="neither is available") as caught:
        HelperProcess(environ)
    assert "unset HIBERNATE_SELF_CHECKPOINT" in str(caught.value.hint)


def test_the_helper_checkpoints_and_restores_its_parent(
    world: World, runtime_dir: Path, checkpointer_kind: str
) -> None:
    world.register(os.getpid())
    helper = HelperProcess({**os.environ, "HIBERNATE_CHECKPOINTER": checkpointer_kind})
    try:
        assert helper.description["checkpointer"]["name"] == checkpointer_kind
        slept = helper.call("sleep")
        assert slept["status"] == "checkpointed" and world.state(os.getpid()) == "checkpointed"
        assert helper.call("sleep")["status"] == "already checkpointed"
        # A helper that dies is replaced, and the new one decides from the real state.
        assert helper.pid is not None
        os.kill(helper.pid, signal.SIGKILL)
        woken = helper.call("wake")
        assert woken["status"] == "restored" and world.state(os.getpid()) == "running"
        assert [(s, p) for c, s, p, _ in world.calls() if c == checkpointer_kind] == [
            ("lock", os.getpid()),
            ("checkpoint", os.getpid()),
            ("restore", os.getpid()),
            ("unlock", os.getpid()),
        ]
        assert helper.call("wake")["status"] == "running (nothing to restore)"
    finally:
        helper.close()


def test_the_doctor_knows_a_vllm_command_line_from_a_path_that_mentions_vllm() -> None:
    from hibernate.checkpoint.nccl import runs_vllm

    for vllm in (
        "vllm serve Qwen/Qwen3-8B --port 8000",
        "/opt/venv/bin/vllm serve m",
        "python -m vllm.entrypoints.openai.api_server --model m",
        "python3 -m vllm serve m",
    ):
        assert runs_vllm(vllm), vllm
    for other in (
        "python /srv/wt-vllm2/tests/standins/tree_target.py --children 1",
        "/home/u/vllm-env/bin/python train.py",
        "python -m vllmish",
    ):
        assert not runs_vllm(other), other
