"""`hibernate serve` end to end: the real command in front of real demo targets, over real HTTP.

Each backend is ``python -m hibernate.demo serve --http-port`` (an agent target
with an OpenAI-style API, forked from the session's fork server); the proxy is
``python -m hibernate serve`` in its own process; the client is aiohttp. Wakes
are counted three ways: the proxy's log line per transition, its /metrics, and
the answers (same bytes as before the sleep).
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hibernate import orchestrator
from hibernate.errors import ExitCode
from hibernate.serve import httplog
from tests import test_vllm_server as vllm_standin
from tests.conftest import REPO, flip_a_bit_in_a_chunk, forkserver, free_port, stays_false, wait_until
from tests.demo_control import DemoControl
from tests.standins.world import GIB, World

# The stand-in vLLM server's fixture, offered to this module's tests under its own name.
start_server = vllm_standin.start_server
DEMO_MB = 8
STATUS_SCHEMA = jsonschema.Draft202012Validator(
    json.loads((REPO / "docs" / "json-schema" / "serve-status.schema.json").read_text())
)
MIB = 1 << 20
# A log line: UTC time to the millisecond, level, then the words.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) hibernate serve: ")


async def _fetch(
    method: str, url: str, body: Any = None, data: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session:
        payload = json.dumps(body).encode() if body is not None else data
        async with session.request(method, url, data=payload, headers=headers) as answer:
            return answer.status, await answer.read()


def fetch(
    method: str, url: str, body: Any = None, data: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    return asyncio.run(_fetch(method, url, body, data, headers))


GZIP = {"Content-Encoding": "gzip"}


def completion(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hello", **extra}


@dataclass
class HttpDemo(DemoControl):
    proc: Any
    port: int
    model: str
    control: str
    host: str = "127.0.0.1"

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stats(self) -> dict[str, int]:
        status, body = fetch("GET", self.url + "/demo/stats")
        assert status == 200
        counts: dict[str, int] = json.loads(body)
        return counts

    def state(self) -> str:
        states = {entry["state"] for entry in orchestrator.status([self.pid])}
        assert len(states) == 1, states
        return states.pop()


@pytest.fixture
def start_http_demo(runtime_dir: Path) -> Iterator[Callable[..., HttpDemo]]:
    started: list[HttpDemo] = []
    scratch = Path(tempfile.mkdtemp(prefix="hb-serve-", dir="/tmp"))

    def start(
        model: str = "demo", seed: int = 0, port: int | None = None, host: str = "127.0.0.1"
    ) -> HttpDemo:
        index = len(started)
        ready = scratch / f"demo{index}.ready"
        port = port or free_port()
        argv = [
            "serve", "--size-mb", str(DEMO_MB), "--dtype", "float32", "--seed", str(seed),
            "--control", str(scratch / f"demo{index}.sock"), "--ready-file", str(ready),
            "--http-port", str(port), "--http-host", host, "--model-name", model,
        ]  # fmt: skip
        proc = forkserver().start(
            argv, {**os.environ, "PYTHONPATH": str(REPO)}, REPO, scratch / f"demo{index}.log"
        )
        demo = HttpDemo(proc, port, model, str(scratch / f"demo{index}.sock"), host)
        started.append(demo)
        wait_until(lambda: ready.exists() or proc.poll() is not None, 120, "the demo to start")
        assert proc.poll() is None, (scratch / f"demo{index}.log").read_text()
        return demo

    yield start
    for demo in started:
        demo.proc.kill()
        demo.proc.wait(timeout=10)


@dataclass
class Proxy:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    token: str | None = None  # HIBERNATE_SERVE_TOKEN it was started with: /hibernate/status needs it then

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(
        self,
        body: Any = None,
        path: str = "/v1/completions",
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, bytes]:
        return fetch("POST", self.url + path, body, data, headers)

    def status(self) -> dict[str, dict[str, Any]]:
        """GET /hibernate/status, checked against its published schema, by backend name."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
        status, body = fetch("GET", self.url + "/hibernate/status", headers=headers)
        assert status == 200, body
        document = json.loads(body)
        problems = [e.message for e in STATUS_SCHEMA.iter_errors(document)]
        assert problems == [], problems
        return {b["name"]: b for b in document["backends"]}

    def state(self, name: str) -> str:
        value: str = self.status()[name]["state"]
        return value

    def metric(self, name: str, **labels: str) -> float:
        status, body = fetch("GET", self.url + "/metrics")
        assert status == 200
        total = 0.0
        for family in text_string_to_metric_families(body.decode()):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def lines(self, text: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if text in line]

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)


@pytest.fixture
def start_proxy(work_dir: Path, tmp_path: Path) -> Iterator[Callable[..., Proxy]]:
    started: list[Proxy] = []

    def start(
        *args: str, env: dict[str, str] | None = None, wait: bool = True, host: str = "127.0.0.1"
    ) -> Proxy:
        # Waited for, it takes any free port and says which: no window for another to take it first.
        port = 0 if wait else free_port()
        log = tmp_path / f"proxy{len(started)}.log"
        command = [
            sys.executable, "-m", "hibernate", "serve", "--listen", f"{host}:{port}",
            "--to", str(work_dir), *args,
        ]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
            )  # fmt: skip
        proxy = Proxy(proc, port, log, (env or {}).get("HIBERNATE_SERVE_TOKEN"))
        started.append(proxy)
        if wait:
            wait_until(
                lambda: proxy.lines("listening on") or proc.poll() is not None, 120, "the proxy to listen"
            )
            assert proc.poll() is None, log.read_text()
            bound = re.search(r"listening on http://\[?[^ ]*?\]?:(\d+)", proxy.lines("listening on")[0])
            assert bound is not None, log.read_text()
            proxy.port = int(bound.group(1))
        return proxy

    yield start
    for proxy in started:
        if proxy.proc.poll() is None:
            # SIGTERM, as an operator stops it: serve then stops the backends it started itself
            # (their own process groups), which a SIGKILL would leave running.
            proxy.proc.terminate()
            try:
                proxy.proc.wait(60)
            except subprocess.TimeoutExpired:
                proxy.proc.kill()
                proxy.proc.wait()


def backend_flag(demo: HttpDemo) -> str:
    return f"{demo.model}={demo.url}"


# -- 1. routing and pass-through ---------------------------------------------------------------


@pytest.mark.slow
def test_requests_go_to_the_backend_their_model_names_unchanged(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    one, two = start_http_demo("one", seed=1), start_http_demo("two", seed=2)
    direct = {d.model: fetch("POST", d.url + "/v1/completions", completion(d.model)) for d in (one, two)}
    assert direct["one"][0] == direct["two"][0] == 200 and direct["one"][1] != direct["two"][1]
    proxy = start_proxy("--backend", backend_flag(one), "--backend", backend_flag(two))
    for model in ("one", "two", "one"):
        assert proxy.post(completion(model)) == direct[model]
    squeezed = gzip.compress(json.dumps(completion("two")).encode())  # routed by its decoded body
    assert proxy.post(data=squeezed, headers=GZIP) == direct["two"]
    models = json.loads(fetch("GET", proxy.url + "/v1/models")[1])["data"]
    assert [(m["id"], m["state"]) for m in models] == [("one", "awake"), ("two", "awake")]
    assert proxy.metric("hibernate_serve_requests_total", backend="one", code="200") == 2
    assert proxy.metric("hibernate_serve_added_latency_seconds_count", backend="two") == 2

    # Every metric /metrics exposes is in docs/serve.md's table, and nothing else is.
    documented = set(
        re.findall(r"^\| `(hibernate_serve_\w+)`", (REPO / "docs" / "serve.md").read_text(), re.MULTILINE)
    )
    exposed = re.findall(
        r"^# TYPE (hibernate_serve_\w+) ", fetch("GET", proxy.url + "/metrics")[1].decode(), re.M
    )
    assert documented == set(exposed)


def test_a_stream_arrives_chunk_by_chunk_and_a_client_that_leaves_cancels_it_upstream(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    demo = start_http_demo()
    status, whole = fetch("POST", demo.url + "/v1/completions", completion("demo", stream=True))
    assert status == 200 and whole.endswith(b"data: [DONE]\n\n")
    assert demo.stats()["streams_finished"] == 1
    proxy = start_proxy("--backend", backend_flag(demo))

    async def paced_stream() -> bytes:
        received = b""
        async with aiohttp.ClientSession() as session:
            body = json.dumps(completion("demo", stream=True, paced=True)).encode()
            async with session.post(proxy.url + "/v1/completions", data=body) as answer:
                assert answer.headers["Content-Type"] == "text/event-stream"
                first = await answer.content.readuntil(b"\n\n")
                # The first event is here and the backend has not produced the rest: pass-through
                # is chunk by chunk, not buffered. The stream counts as in flight.
                assert first.startswith(b"data: ")
                assert (await asyncio.to_thread(demo.stats))["streams_finished"] == 1
                assert (await asyncio.to_thread(proxy.status))["demo"]["in_flight"] == 1
                received = first
                while not received.endswith(b"data: [DONE]\n\n"):
                    await asyncio.to_thread(fetch, "POST", demo.url + "/demo/step")
                    received += await answer.content.readuntil(b"\n\n")
                # Read to the answer's end, as a client that stays does: leaving at [DONE], before
                # the proxy has read its backend's end, would be leaving a stream not yet over
                # (counted as the client's cancel: seen once in a loaded run).
                assert await answer.content.read() == b""
        return received

    assert asyncio.run(paced_stream()) == whole

    async def leave_after_first_chunk() -> None:
        async with aiohttp.ClientSession() as session:
            body = json.dumps(completion("demo", stream=True, paced=True)).encode()
            async with session.post(proxy.url + "/v1/completions", data=body) as answer:
                await answer.content.readuntil(b"\n\n")
            # leaving the block closes the connection with the answer unread

    asyncio.run(leave_after_first_chunk())
    wait_until(lambda: demo.stats()["cancelled"] == 1, 30, "the backend to see its client leave")
    wait_until(lambda: proxy.status()["demo"]["in_flight"] == 0, 30, "the proxy to count the stream ended")
    cancelled = {"backend": "demo", "outcome": "client_cancelled"}
    wait_until(
        lambda: proxy.metric("hibernate_serve_request_outcomes_total", **cancelled) == 1,
        30,
        "the stream its client left to be counted",
        detail=lambda: {  # how it was counted instead, should it ever be (failed once in a loaded CI run)
            outcome: proxy.metric("hibernate_serve_request_outcomes_total", backend="demo", outcome=outcome)
            for outcome in ("completed", "client_cancelled", "backend_failed")
        },
    )
    assert proxy.metric("hibernate_serve_request_outcomes_total", backend="demo", outcome="completed") == 1
    assert demo.stats()["streams_finished"] == 2  # the direct one and the paced one, not the one left


@pytest.mark.slow
def test_bad_input_gets_a_clear_4xx_and_wakes_nothing(
    start_http_demo: Callable[..., HttpDemo],
    start_proxy: Callable[..., Proxy],
    tmp_path: Path,
    work_dir: Path,
) -> None:
    demo = start_http_demo()
    orchestrator.sleep([demo.pid], work_dir, orchestrator.Options())
    config = tmp_path / "serve.toml"
    config.write_text(
        f'[[backend]]\nname = "demo"\nurl = "{demo.url}"\n\n'
        "[limits]\nmax_body_bytes = 4096\nbody_timeout = 1\nidle_timeout = 1\n"
    )
    proxy = start_proxy("--config", str(config))
    assert proxy.state("demo") == "asleep"

    def refused(status: int, body: bytes, code: int, words: str) -> None:
        assert status == code, body
        error = json.loads(body)["error"]
        assert words in error["message"] and error["code"] == code, error

    refused(*proxy.post(data=b"{not json"), 400, "not valid JSON")
    refused(*proxy.post(completion("nobody")), 404, "The model `nobody` does not exist")
    refused(*proxy.post(completion("demo", prompt="x" * 5000)), 413, "the limit is 4096 bytes")
    refused(*fetch("GET", proxy.url + "/v1/completions"), 404, "is not routed")
    refused(*proxy.post(data=b"not gzip", headers=GZIP), 400, "not valid gzip")

    # A slow client: headers promise 100 bytes, 10 come, then nothing.
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n" + b'{"model": '
        )
        answer = conn.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 408"), answer
    assert "did not arrive within 1s" in answer

    # A slower one: its headers never end. The connection is closed (idle_timeout), unanswered.
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert conn.recv(65536) == b""

    status, body = fetch("GET", proxy.url + "/v1/models")
    assert status == 200 and json.loads(body)["data"][0]["state"] == "asleep"
    assert proxy.state("demo") == "asleep" and demo.state() == "asleep"
    assert proxy.metric("hibernate_serve_transitions_total", operation="wake") == 0
    assert proxy.lines("-> awake") == []


MALFORMED = (
    b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nabc\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"GARBAGE\r\n\r\n",
)
LEAVES_MID_BODY = b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model": '


@pytest.mark.slow
def test_a_flood_of_malformed_requests_logs_a_few_lines_and_never_a_traceback(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    demo = start_http_demo()
    before = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    proxy = start_proxy("--backend", backend_flag(demo))
    status, body = proxy.post(data=b"[" * 100_000 + b"]" * 100_000)  # JSON nested past Python's parser
    assert status == 400, body
    error = json.loads(body)["error"]
    assert "nested too deeply" in error["message"] and error["type"] == "invalid_request_error"
    for index in range(100):
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as conn:
            if index % 5 == 4:
                conn.sendall(LEAVES_MID_BODY)  # and gone, the rest of the body never sent
                continue
            conn.sendall(MALFORMED[index % 5])
            status_line = conn.recv(65536).split(b"\r\n")[0]
            assert status_line.startswith(b"HTTP/1.") and b" 400 " in status_line, status_line
    assert proxy.post(completion("demo")) == before  # serving all along
    assert proxy.stop() == 0  # every handler has ended: whatever it logged is in the log
    lines = proxy.log.read_text().splitlines()
    assert not any("Traceback" in line or line.startswith("  File ") for line in lines), lines
    assert not any("RecursionError" in line for line in lines)
    served = lines[next(i for i, line in enumerate(lines) if "listening on" in line) + 1 :]
    reported = [line for line in served if "stopping" not in line and "serve: stopped; " not in line]
    assert 0 < len(reported) <= 2 * httplog.LINES, served
    assert all(LOG_LINE.match(line) for line in reported), reported


@pytest.mark.slow
def test_requests_beyond_max_requests_are_refused_at_once_not_queued(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    demo = start_http_demo()
    config = tmp_path / "serve.toml"
    config.write_text(f'[[backend]]\nname = "demo"\nurl = "{demo.url}"\n\n[limits]\nmax_requests = 1\n')
    proxy = start_proxy("--config", str(config))

    async def beside_a_stream() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session:
            body = json.dumps(completion("demo", stream=True, paced=True)).encode()
            async with session.post(proxy.url + "/v1/completions", data=body) as stream:
                await stream.content.readuntil(b"\n\n")
                refused = await _fetch("POST", proxy.url + "/v1/completions", completion("demo"))
                event = b""
                while not event.endswith(b"[DONE]\n\n"):
                    await asyncio.to_thread(fetch, "POST", demo.url + "/demo/step")
                    event = await stream.content.readuntil(b"\n\n")
                return refused

    status, body = asyncio.run(beside_a_stream())
    assert (
        status == 503 and "handling 1 requests already (max_requests)" in json.loads(body)["error"]["message"]
    )
    assert proxy.post(completion("demo"))[0] == 200  # the stream over, there is room again


# -- 2. wake on request ----------------------------------------------------------------------------


@pytest.mark.slow
def test_concurrent_requests_to_a_sleeping_backend_share_one_wake_and_get_the_same_bytes(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy], work_dir: Path
) -> None:
    demo = start_http_demo()
    before = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    assert before[0] == 200
    orchestrator.sleep([demo.pid], work_dir, orchestrator.Options())
    assert fetch("POST", demo.url + "/v1/completions", completion("demo"))[0] == 503  # asleep: refused
    proxy = start_proxy("--backend", backend_flag(demo))
    assert proxy.state("demo") == "asleep"

    async def many(count: int) -> list[tuple[int, bytes]]:
        body = json.dumps(completion("demo")).encode()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=count)) as session:

            async def one() -> tuple[int, bytes]:
                async with session.post(proxy.url + "/v1/completions", data=body) as answer:
                    return answer.status, await answer.read()

            return await asyncio.gather(*(one() for _ in range(count)))

    answers = asyncio.run(many(200))
    assert answers == [before] * 200
    assert len(proxy.lines("demo: asleep -> awake")) == 1
    assert proxy.metric("hibernate_serve_transitions_total", backend="demo", operation="wake") == 1
    assert proxy.metric("hibernate_serve_wait_seconds_count", backend="demo") >= 1
    assert demo.state() == "running"


@pytest.mark.slow
def test_a_wake_that_fails_answers_503_leaves_the_backend_asleep_and_the_next_request_retries(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy], work_dir: Path
) -> None:
    demo = start_http_demo()
    before = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    report = orchestrator.sleep([demo.pid], work_dir, orchestrator.Options())
    data = Path(str(report.processes[0].snapshot)) / "data-000.bin"
    original = data.read_bytes()
    flip_a_bit_in_a_chunk(data)
    proxy = start_proxy("--backend", backend_flag(demo))

    for _ in range(2):  # each request tries again, and fails again while the snapshot is damaged
        status, body = proxy.post(completion("demo"))
        assert status == 503, body
        error = json.loads(body)["error"]
        assert error["message"].startswith("backend demo could not be woken: ") and error["code"] == 503
        assert "checksum mismatch; the data on disk is corrupted" in error["message"], error["message"]
        assert proxy.state("demo") == "asleep" and demo.state() == "asleep"
    assert proxy.metric("hibernate_serve_transition_failures_total", backend="demo", operation="wake") == 2
    assert len(proxy.lines("demo: wake failed after")) == 2

    data.write_bytes(original)  # repaired
    assert proxy.post(completion("demo")) == before
    assert proxy.state("demo") == "awake"


@pytest.mark.slow
def test_a_backend_put_to_sleep_by_hand_is_noticed_and_woken_by_the_next_request(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy], work_dir: Path
) -> None:
    demo = start_http_demo()
    proxy = start_proxy("--backend", backend_flag(demo))
    before = proxy.post(completion("demo"))
    orchestrator.sleep([demo.pid], work_dir, orchestrator.Options())  # `hibernate sleep`, not the proxy
    wait_until(lambda: proxy.state("demo") == "asleep", 30, "the proxy to read the new state back")
    assert proxy.lines("demo: found asleep (changed outside the proxy)")
    assert proxy.post(completion("demo")) == before
    assert len(proxy.lines("demo: asleep -> awake")) == 1


@pytest.mark.slow
def test_a_backend_that_died_and_came_back_on_its_port_is_found_again(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    first = start_http_demo()
    before = fetch("POST", first.url + "/v1/completions", completion("demo"))
    proxy = start_proxy("--backend", backend_flag(first))
    first.proc.kill()
    first.proc.wait(timeout=10)
    status, body = proxy.post(completion("demo"))
    assert status == 502 and "backend demo did not answer" in json.loads(body)["error"]["message"]
    wait_until(lambda: proxy.state("demo") == "failed", 30, "the proxy to notice its backend gone")
    status, body = proxy.post(completion("demo"))  # nothing listens: a 503 that says so
    assert status == 503 and "no process of yours listens on port" in json.loads(body)["error"]["message"]
    second = start_http_demo(port=first.port)
    assert proxy.post(completion("demo")) == before
    assert proxy.status()["demo"]["pid"] == second.pid


@pytest.mark.slow
def test_a_backend_is_the_process_on_its_own_address_not_another_listening_on_its_port(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    port = free_port()
    other = start_http_demo("other", seed=1, port=port, host="127.0.0.2")  # started first: the lower pid
    demo = start_http_demo(port=port)  # 127.0.0.1, the same port
    before = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    proxy = start_proxy("--backend", backend_flag(demo), "--idle", "1")
    assert proxy.status()["demo"]["pid"] == demo.pid
    wait_until(lambda: proxy.state("demo") == "asleep", 30, "the idle backend to be put to sleep")
    assert demo.state() == "asleep" and other.state() == "running"
    assert proxy.post(completion("demo")) == before
    assert other.stats()["completions"] == 0


# -- 2b. several proxies, and sleeps by hand ------------------------------------------------------


async def _paced_stream(proxy: Proxy, demo: HttpDemo, while_open: Callable[[], Any]) -> bytes:
    """A paced stream through ``proxy``: ``while_open`` runs (in a thread) once its first event is
    here, then the rest is stepped out of the demo."""
    async with aiohttp.ClientSession() as session:
        body = json.dumps(completion("demo", stream=True, paced=True)).encode()
        async with session.post(proxy.url + "/v1/completions", data=body) as answer:
            assert answer.status == 200
            received = await answer.content.readuntil(b"\n\n")
            await asyncio.to_thread(while_open)
            while not received.endswith(b"data: [DONE]\n\n"):
                await asyncio.to_thread(fetch, "POST", demo.url + "/demo/step")
                received += await answer.content.readuntil(b"\n\n")
    return received


@pytest.mark.slow
def test_two_proxies_and_hand_sleeps_never_forward_a_request_into_a_sleep(
    start_http_demo: Callable[..., HttpDemo],
    start_proxy: Callable[..., Proxy],
    cli: Callable[..., Any],
    work_dir: Path,
) -> None:
    demo = start_http_demo()
    before = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    _, whole = fetch("POST", demo.url + "/v1/completions", completion("demo", stream=True))
    b = start_proxy("--backend", backend_flag(demo))

    # A stream through b holds the backend awake: a sleep by hand waits for it, then is refused as
    # busy, naming b; the backend runs on untouched.
    def hand_sleep_refused() -> None:
        refused = cli("sleep", str(demo.pid), "--to", str(work_dir), "--timeout", "1")
        assert refused.returncode == ExitCode.BUSY, refused.stderr
        assert f"1 request in flight through hibernate serve (pid {b.proc.pid}," in refused.stderr
        assert demo.state() == "running"

    assert asyncio.run(_paced_stream(b, demo, hand_sleep_refused)) == whole

    # Proxy b saw the backend awake; another proxy, a, puts it to sleep (idle): b's next request
    # wakes it rather than trusting what it saw.
    a = start_proxy("--backend", backend_flag(demo), "--idle", "1")
    assert b.post(completion("demo")) == before
    wait_until(lambda: a.state("demo") == "asleep", 120, "a's idle sleep")
    assert b.post(completion("demo")) == before

    # Requests through both proxies for as long as a sleep by hand runs: it closes the gate on new
    # leases, waits for those held, and puts the backend to sleep under them; every request is
    # answered by the backend awake (woken again where it slept).
    async def burst() -> tuple[list[tuple[int, bytes]], Any]:
        hand = asyncio.ensure_future(
            asyncio.to_thread(cli, "sleep", str(demo.pid), "--to", str(work_dir), "--timeout", "10", "-q")
        )
        answers: list[tuple[int, bytes]] = []
        while not answers or not hand.done():
            answers += await asyncio.gather(
                *(_fetch("POST", p.url + "/v1/completions", completion("demo")) for p in (a, b))
            )
        return answers, await hand

    # Each sleep by hand meets one of three legitimate orders, and the test holds in all of them: it
    # went through; it waited for leases and was refused as busy; or a's idle sleep got there first
    # (a stall of a second between requests on a loaded machine) and it found the backend asleep.
    slept_by_hand = 0
    for _ in range(20):  # until two sleeps by hand went through (a bound only a broken proxy reaches)
        answers, slept = asyncio.run(burst())
        assert answers == [before] * len(answers)
        if slept.returncode == ExitCode.WRONG_STATE:
            assert f"process {demo.pid} is already asleep" in slept.stderr, slept.stderr
        else:
            assert slept.returncode in (0, ExitCode.BUSY), slept.stderr
        slept_by_hand += slept.returncode == 0
        assert b.post(completion("demo")) == before  # the sleep is over by now: woken if it slept
        if slept_by_hand == 2:
            break
    assert slept_by_hand == 2
    for proxy in (a, b):
        assert proxy.metric("hibernate_serve_requests_total", code="503") == 0
        assert proxy.lines("Traceback") == []


# -- 3. idle -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_an_idle_backend_is_put_to_sleep_but_never_while_a_stream_is_open(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    demo = start_http_demo()
    before = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    rss_awake = demo.rss()
    proxy = start_proxy("--backend", backend_flag(demo), "--idle", "1")

    async def held_stream() -> None:
        async with aiohttp.ClientSession() as session:
            body = json.dumps(completion("demo", stream=True, paced=True)).encode()
            async with session.post(proxy.url + "/v1/completions", data=body) as answer:
                await answer.content.readuntil(b"\n\n")

                def not_awake_with_the_stream() -> Any:
                    backend = proxy.status()["demo"]
                    return (backend["state"], backend["in_flight"]) != ("awake", 1) and backend

                # Open for three idle periods: the backend stays awake throughout.
                await asyncio.to_thread(
                    stays_false,
                    not_awake_with_the_stream,
                    3,
                    "the backend left awake with a stream open",
                    0.1,
                )
                event = b""
                while not event.endswith(b"[DONE]\n\n"):
                    await asyncio.to_thread(fetch, "POST", demo.url + "/demo/step")
                    event = await answer.content.readuntil(b"\n\n")

    asyncio.run(held_stream())
    wait_until(lambda: proxy.state("demo") == "asleep", 30, "the idle backend to be put to sleep")
    assert demo.state() == "asleep"
    agents = proxy.status()["demo"]["agents"]
    assert agents and agents[0]["state"] == "asleep"
    assert demo.rss() < rss_awake - DEMO_MB * MIB // 2  # its memory given back
    status, _ = fetch("GET", proxy.url + "/v1/models")
    assert status == 200 and proxy.state("demo") == "asleep"  # listing models wakes nothing
    assert proxy.post(completion("demo")) == before
    assert len(proxy.lines("demo: awake -> asleep (sleep, idle")) == 1


@pytest.mark.slow
def test_a_request_that_arrives_during_a_sleep_waits_for_it_then_wakes_the_backend(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    demo = start_http_demo()
    before = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    proxy = start_proxy("--backend", backend_flag(demo), "--idle", "1")
    demo.hold(60)  # the idle sleep that comes waits for the demo's own step to end (released below)
    wait_until(lambda: proxy.state("demo") == "sleeping", 30, "the idle sleep to begin")

    async def during_the_sleep() -> tuple[int, bytes]:
        answer = asyncio.ensure_future(_fetch("POST", proxy.url + "/v1/completions", completion("demo")))
        waiting = lambda: answer.done() or proxy.status()["demo"]["waiting"] == 1  # noqa: E731
        await asyncio.to_thread(wait_until, waiting, 30, "the request to wait for the sleep")
        assert not answer.done()
        assert (await asyncio.to_thread(proxy.state, "demo")) == "sleeping"  # held while the sleep runs
        await asyncio.to_thread(demo.release)  # the step ends: the sleep goes on, then the wake
        return await answer

    assert asyncio.run(during_the_sleep()) == before
    transitions = [line.split("demo: ")[1].split(" (")[0] for line in proxy.lines(" -> ")]
    assert transitions == ["awake -> asleep", "asleep -> awake"]
    assert proxy.metric("hibernate_serve_transitions_total", backend="demo", operation="wake") == 1


# -- 5. time-sharing one GPU -------------------------------------------------------------------


@pytest.mark.slow
def test_three_backends_take_turns_in_a_budget_for_two_least_recently_used_first(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    demos = {name: start_http_demo(name, seed=seed) for seed, name in enumerate(("a", "b", "c"))}
    direct = {name: fetch("POST", d.url + "/v1/completions", completion(name)) for name, d in demos.items()}
    one = orchestrator.status([demos["a"].pid])[0]
    size = sum(pool["bytes"] for pool in one["pools"])
    proxy = start_proxy(
        *(f"--backend={backend_flag(d)}" for d in demos.values()), "--gpu-budget", str(size * 5 // 2)
    )

    def awake_now() -> set[str]:
        """Which backends are awake, from their agents (not from the proxy)."""
        return {name for name, d in demos.items() if d.state() == "running"}

    awake = awake_now()
    assert len(awake) == 2  # adopted three awake: the one over the budget was put to sleep
    order = sorted(awake)  # least recently used first
    for name in order:
        assert proxy.post(completion(name)) == direct[name]
    for name in ["c", "a", "b", "a", "c", "c", "b", "a", "b", "c"]:
        evicted = len(proxy.lines("put to sleep to make room"))
        if name not in awake:
            victim = order.pop(0)
            awake = (awake - {victim}) | {name}
        else:
            victim = None
            order.remove(name)
        order.append(name)
        assert proxy.post(completion(name)) == direct[name]
        assert awake_now() == awake
        made_room = [line.split("serve: ", 1)[1] for line in proxy.lines("put to sleep to make room")]
        assert made_room[evicted:] == ([f"{victim}: put to sleep to make room for {name} "
                                        "(least recently used)"] if victim else [])  # fmt: skip

    # The least recently used one is streaming: never put to sleep; the next one is.
    busy, spare = order[0], order[1]
    sleeper = next(n for n in demos if n not in awake)

    async def wake_beside_a_stream() -> tuple[int, bytes]:
        async with aiohttp.ClientSession() as session:
            body = json.dumps(completion(busy, stream=True, paced=True)).encode()
            async with session.post(proxy.url + "/v1/completions", data=body) as stream:
                await stream.content.readuntil(b"\n\n")
                answer = await _fetch("POST", proxy.url + "/v1/completions", completion(sleeper))
                event = b""
                while not event.endswith(b"[DONE]\n\n"):
                    await asyncio.to_thread(fetch, "POST", demos[busy].url + "/demo/step")
                    event = await stream.content.readuntil(b"\n\n")
                return answer

    assert asyncio.run(wake_beside_a_stream()) == direct[sleeper]
    last = proxy.lines("put to sleep to make room")[-1]
    assert last.endswith(f"{spare}: put to sleep to make room for {sleeper} (least recently used)"), last
    assert awake_now() == {busy, sleeper}


# -- 6. adoption, restarts, stopping ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sleep.after-release:kill", "wake.after-restore:kill"])
def test_a_proxy_killed_in_the_middle_of_a_transition_is_restarted_and_recovers_the_backend(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy], work_dir: Path, fault: str
) -> None:
    demo = start_http_demo()
    before = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    flags = ("--backend", backend_flag(demo), "--idle", "1")
    if fault.startswith("wake"):
        orchestrator.sleep([demo.pid], work_dir, orchestrator.Options())
        killed = start_proxy(*flags, env={"HIBERNATE_FAULT": fault})
        with pytest.raises(aiohttp.ClientError):
            killed.post(completion("demo"))
    else:
        killed = start_proxy(*flags, env={"HIBERNATE_FAULT": fault})
    assert killed.proc.wait(timeout=60) == -signal.SIGKILL
    assert orchestrator.status([demo.pid])[0]["interrupted"], "the transition was cut half-way"

    restarted = start_proxy(*flags)
    adopted = restarted.lines(f"demo: adopted pid {demo.pid}")
    # the recovery's own words follow the state: what `hibernate recover` would have done
    assert len(adopted) == 1 and re.search(r", (awake|asleep), .+ \(\d+\.\d+ s\)$", adopted[0]), adopted
    assert restarted.post(completion("demo")) == before
    assert not orchestrator.status([demo.pid])[0]["interrupted"]


@pytest.mark.slow
def test_sigterm_stops_accepting_lets_a_stream_finish_and_leaves_the_backend_as_it_is(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    demo = start_http_demo()
    proxy = start_proxy("--backend", backend_flag(demo))

    async def stream_across_the_stop() -> bytes:
        async with aiohttp.ClientSession() as session:
            body = json.dumps(completion("demo", stream=True, paced=True)).encode()
            async with session.post(proxy.url + "/v1/completions", data=body) as stream:
                received = await stream.content.readuntil(b"\n\n")
                proxy.proc.send_signal(signal.SIGTERM)
                await asyncio.to_thread(
                    wait_until,
                    lambda: proxy.lines("stopping: no new requests"),
                    30,
                    "the proxy to stop accepting",
                )
                with pytest.raises(aiohttp.ClientConnectionError):
                    await _fetch("GET", proxy.url + "/v1/models")  # no longer accepting
                while not received.endswith(b"[DONE]\n\n"):
                    await asyncio.to_thread(fetch, "POST", demo.url + "/demo/step")
                    received += await stream.content.readuntil(b"\n\n")
                return received

    streamed = asyncio.run(stream_across_the_stop())
    assert streamed.endswith(b"data: [DONE]\n\n") and streamed.count(b"data: ") == 6
    assert proxy.proc.wait(timeout=60) == 0
    assert demo.proc.poll() is None and demo.state() == "running"  # not started by the proxy: left running
    assert proxy.log.read_text().splitlines()[-1].endswith("serve: stopped; left as they are: demo (awake)")


@pytest.mark.slow
def test_a_backend_started_by_the_proxy_is_served_and_stopped_with_it(
    start_proxy: Callable[..., Proxy], runtime_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    proxy = start_proxy(
        "--backend", f"own=http://127.0.0.1:{port}", "--",
        sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve", "--size-mb", str(DEMO_MB),
        "--dtype", "float32", "--control", str(tmp_path / "own.sock"), "--http-port", str(port),
        "--model-name", "own",
    )  # fmt: skip
    pid = proxy.status()["own"]["pid"]
    status, answer = proxy.post(completion("own"))
    assert status == 200 and json.loads(answer)["model"] == "own"
    assert proxy.stop() == 0
    assert not Path(f"/proc/{pid}").exists()  # the proxy waited for it (and reaped it) before exiting
    last = proxy.log.read_text().splitlines()[-1]
    assert last.endswith(f"serve: stopped; stopped what it started: own (pid {pid})"), last


# -- in front of a vLLM server (the stand-in) ----------------------------------------------------


@pytest.mark.slow
def test_a_vllm_server_is_put_to_sleep_when_idle_and_woken_once_by_concurrent_requests(
    start_server: Callable[..., Any], world: World, start_proxy: Callable[..., Proxy]
) -> None:
    server = start_server()
    before = fetch("POST", server.url + "/v1/completions", completion("standin"))
    assert before[0] == 200
    proxy = start_proxy("--backend", f"standin={server.url}", "--idle", "1")
    wait_until(lambda: proxy.state("standin") == "asleep", 60, "the idle server to be put to sleep")
    assert server.is_sleeping()
    assert {world.state(pid) for pid in server.workers} == {"checkpointed"}  # the GPU given back
    status, body = fetch("GET", proxy.url + "/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["standin"]
    assert proxy.state("standin") == "asleep"  # listing models wakes nothing

    async def many(count: int) -> list[tuple[int, bytes]]:
        return await asyncio.gather(
            *(_fetch("POST", proxy.url + "/v1/completions", completion("standin")) for _ in range(count))
        )

    assert asyncio.run(many(50)) == [before] * 50
    assert len(proxy.lines("standin: asleep -> awake")) == 1
    assert {world.state(pid) for pid in server.workers} == {"running"}
    streamed = fetch("POST", proxy.url + "/v1/completions", completion("standin", stream=True))
    assert streamed[0] == 200 and streamed[1].endswith(b"data: [DONE]\n\n")
    events = [line[len(b"data: ") :] for line in streamed[1].split(b"\n\n") if line.startswith(b"data: {")]
    text = "".join(json.loads(event)["choices"][0]["text"] for event in events)
    assert len(events) == 2 and text == json.loads(before[1])["choices"][0]["text"]


@pytest.mark.slow
def test_with_a_measured_budget_a_wake_that_does_not_fit_the_gpu_puts_the_least_recently_used_to_sleep(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy], world: World, work_dir: Path
) -> None:
    demos = {name: start_http_demo(name, seed=seed) for seed, name in enumerate(("a", "b", "c"))}
    direct = {name: fetch("POST", d.url + "/v1/completions", completion(name)) for name, d in demos.items()}
    for demo in demos.values():
        world.register(demo.pid, nbytes=3 * GIB)  # each holds 3 GiB of the stand-in GPU
    orchestrator.sleep([demos["c"].pid], work_dir, orchestrator.Options())
    world.set_other_use(0, 80 * GIB - 7 * GIB)  # 7 GiB for the backends: a and b, not c as well
    proxy = start_proxy(*(f"--backend={backend_flag(d)}" for d in demos.values()), "--gpu-budget", "auto")
    for name in ("a", "b"):  # a is now the least recently used
        assert proxy.post(completion(name)) == direct[name]

    assert proxy.post(completion("c")) == direct["c"]
    assert {n: world.state(d.pid) for n, d in demos.items()} == {
        "a": "checkpointed",
        "b": "running",
        "c": "running",
    }
    assert proxy.post(completion("a")) == direct["a"]
    assert {n: world.state(d.pid) for n, d in demos.items()} == {
        "a": "running",
        "b": "checkpointed",
        "c": "running",
    }
    made_room = [line.split("serve: ")[1] for line in proxy.lines("put to sleep to make room")]
    assert made_room == [
        "a: put to sleep to make room for c (least recently used)",
        "b: put to sleep to make room for a (least recently used)",
    ]


@pytest.mark.slow
def test_a_backend_running_a_hibernate_from_before_leases_is_still_served_put_to_sleep_and_woken(
    runtime_dir: Path, start_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    """A proxy upgraded beside a backend started earlier: no lease to take there, so none is asked."""
    from tests.test_agent_leases import AGENT_BEFORE_LEASES

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AGENT_BEFORE_LEASES)
    port, ready = free_port(), tmp_path / "old.ready"
    argv = [
        sys.executable, "-m", "hibernate.demo", "serve", "--size-mb", str(DEMO_MB), "--dtype", "float32",
        "--ready-file", str(ready), "--http-port", str(port), "--model-name", "old",
    ]  # fmt: skip
    with open(tmp_path / "old.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONPATH": f"{site}:{REPO}"})  # fmt: skip
    try:
        wait_until(lambda: ready.exists() or proc.poll() is not None, 120, "the old backend to start")
        demo = HttpDemo(proc, port, "old", "")
        direct = fetch("POST", demo.url + "/v1/completions", completion("old"))
        assert direct[0] == 200
        proxy = start_proxy("--backend", backend_flag(demo), "--idle", "1")
        assert proxy.post(completion("old")) == direct
        wait_until(lambda: proxy.state("old") == "asleep", 60, "the idle backend to be put to sleep")
        assert proxy.post(completion("old")) == direct, "woken by the request, bit-exact"
    finally:
        proc.kill()
        proc.wait(timeout=10)
