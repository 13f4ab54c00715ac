"""`hibernate serve` as an operator meets it: the official ``openai`` SDK, health probes and scrapes,
models started on demand, and the control endpoints, against the real command in front of the demo.

The fixtures are tests/test_serve.py's (the demo with its HTTP API, the proxy in its own process).
Order comes from real states: the demo's agent, the proxy's /hibernate/status and /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from hibernate import orchestrator
from tests.conftest import wait_until
from tests.test_serve import (
    DEMO_MB,
    HttpDemo,
    Proxy,
    backend_flag,
    completion,
    fetch,
    free_port,
    start_http_demo,
    start_proxy,
)

__all__ = ["start_http_demo", "start_proxy"]  # fixtures, used by name

TOKEN = "a-long-enough-token-0123456789"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


async def _exchange(
    method: str, url: str, headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session:
        data = json.dumps(body).encode() if body is not None else None
        async with session.request(method, url, headers=headers, data=data) as answer:
            return answer.status, dict(answer.headers), await answer.read()


def exchange(
    method: str, url: str, headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, dict[str, str], bytes]:
    """A request, and its status, headers and body."""
    return asyncio.run(_exchange(method, url, headers, body))


def sdk(proxy: Proxy) -> OpenAI:
    # No retries: each answer seen is the proxy's own, 503s included.
    return OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client: OpenAI, model: str, kind: str, stream: bool) -> str:
    """What the model answers, through the SDK: a chat's message or a completion's text, whole."""
    if kind == "chat":
        if stream:
            chunks = client.chat.completions.create(model=model, messages=MESSAGES, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks)
        chat = client.chat.completions.create(model=model, messages=MESSAGES)
        return chat.choices[0].message.content or ""
    if stream:
        pieces = client.completions.create(model=model, prompt="hello", stream=True)
        return "".join(c.choices[0].text for c in pieces)
    return client.completions.create(model=model, prompt="hello").choices[0].text


def direct_answers(demo: HttpDemo) -> dict[str, str]:
    chat = fetch("POST", demo.url + "/v1/chat/completions", {"model": demo.model, "messages": MESSAGES})
    text = fetch("POST", demo.url + "/v1/completions", completion(demo.model))
    assert chat[0] == text[0] == 200
    return {
        "chat": json.loads(chat[1])["choices"][0]["message"]["content"],
        "completion": json.loads(text[1])["choices"][0]["text"],
    }


@pytest.mark.slow
def test_the_openai_sdk_chats_and_completes_streaming_or_not_each_time_through_a_sleep(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy]
) -> None:
    demo = start_http_demo()
    direct = direct_answers(demo)
    assert direct["chat"] == direct["completion"] and direct["chat"]
    proxy = start_proxy("--backend", backend_flag(demo))
    client = sdk(proxy)
    cases = [(kind, stream) for stream in (False, True) for kind in ("chat", "completion")]
    for index, (kind, stream) in enumerate(cases):
        status, _, body = exchange("POST", proxy.url + "/hibernate/models/demo/sleep")  # loopback: open
        assert status == 200 and json.loads(body)["state"] == "asleep", body
        assert demo.state() == "asleep"
        assert ask(client, "demo", kind, stream) == direct[kind], (kind, stream)
        assert demo.state() == "running"
        assert (
            proxy.metric("hibernate_serve_transitions_total", backend="demo", operation="wake") == index + 1
        )
    # Sleeps after the first reuse the weights they find unchanged in the snapshot: counted apart.
    written = proxy.metric("hibernate_serve_spilled_bytes_total", backend="demo")
    reused = proxy.metric("hibernate_serve_reused_bytes_total", backend="demo")
    assert reused >= (len(cases) - 1) * DEMO_MB * (1 << 20), (written, reused)
    assert 0 < written < reused, (written, reused)
    models = [m.id for m in client.models.list()]
    assert models == ["demo"]


@pytest.mark.slow
def test_a_model_with_a_command_is_started_by_its_first_request_then_sleeps_and_wakes(
    start_proxy: Callable[..., Proxy], runtime_dir: Path, tmp_path: Path
) -> None:
    port, broken_port = free_port(), free_port()
    command = [
        sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve", "--size-mb", str(DEMO_MB),
        "--dtype", "float32", "--control", str(tmp_path / "own.sock"), "--http-port", str(port),
        "--model-name", "own",
    ]  # fmt: skip
    broken = [sys.executable, "-c", "print(1 + 1, 'no model here'); exit(3)"]
    config = tmp_path / "serve.toml"
    config.write_text(
        f'[[backend]]\nname = "own"\nurl = "http://127.0.0.1:{port}"\ncommand = {json.dumps(command)}\n'
        'health_path = "/health"\nstart_timeout = 120\n\n'
        f'[[backend]]\nname = "broken"\nurl = "http://127.0.0.1:{broken_port}"\n'
        f"command = {json.dumps(broken)}\n"
    )
    # Its health_path is asked directly, whatever proxy the environment names (here one that is not there).
    dead = f"http://127.0.0.1:{free_port()}"
    no_proxy = {"http_proxy": dead, "HTTP_PROXY": dead, "no_proxy": "", "NO_PROXY": ""}
    proxy = start_proxy("--config", str(config), env={"HIBERNATE_SERVE_TOKEN": TOKEN, **no_proxy})
    status = proxy.status()
    assert (status["own"]["state"], status["own"]["pid"]) == ("stopped", None)
    assert proxy.lines("own: not running; its first request starts it")
    health = json.loads(fetch("GET", proxy.url + "/health")[1])
    assert health == {"status": "ok", "backends": {"own": "stopped", "broken": "stopped"}}

    client = sdk(proxy)
    answer = ask(client, "own", "chat", stream=False)
    pid = proxy.status()["own"]["pid"]
    assert pid is not None and proxy.state("own") == "awake"
    assert (
        answer
        == json.loads(fetch("POST", f"http://127.0.0.1:{port}/v1/completions", completion("own"))[1])[
            "choices"
        ][0]["text"]
    )
    started = proxy.lines("own: stopped -> awake (started pid")
    assert len(started) == 1, started
    log = Path(started[0].split(", log ")[1].rstrip(")"))
    assert log.parent.parent == runtime_dir and (log.parent.stat().st_mode & 0o777) == 0o700
    assert TOKEN.encode() not in Path(f"/proc/{pid}/environ").read_bytes()  # serve's token stays its own

    # From now on it sleeps and wakes; it is not started again.
    assert exchange("POST", proxy.url + "/hibernate/models/own/sleep")[0] == 401  # a token is set
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert exchange("POST", proxy.url + "/hibernate/models/own/sleep", good)[0] == 200
    assert orchestrator.status([pid])[0]["state"] == "asleep"
    assert ask(client, "own", "completion", stream=True) == answer
    assert proxy.status()["own"]["pid"] == pid and len(proxy.lines("started pid")) == 1

    # A command that fails: a 503 that says why, with the end of its log, and when to retry.
    code, headers, body = exchange(
        "POST", proxy.url + "/v1/completions", body={"model": "broken", "prompt": "x"}
    )
    message = json.loads(body)["error"]["message"]
    assert code == 503 and headers["Retry-After"].isdigit(), (code, headers)
    assert message.startswith("backend broken could not be started: backend broken's command exited with")
    assert "status 3" in message and "2 no model here" in message, message
    assert proxy.state("broken") == "stopped"
    assert proxy.metric("hibernate_serve_transition_failures_total", backend="broken", operation="start") == 1

    assert proxy.stop() == 0
    assert not Path(f"/proc/{pid}").exists()  # started by the proxy: stopped (and reaped) with it


@pytest.mark.slow
def test_probes_and_scrapes_every_half_second_never_wake_a_model_nor_keep_it_awake(
    start_http_demo: Callable[..., HttpDemo],
    start_proxy: Callable[..., Proxy],
    tmp_path: Path,
    work_dir: Path,
) -> None:
    demo = start_http_demo()
    orchestrator.sleep([demo.pid], work_dir, orchestrator.Options())
    config = tmp_path / "serve.toml"
    config.write_text(
        f'idle = 3\n[[backend]]\nname = "demo"\nurl = "{demo.url}"\nprefix = "/demo"\n'
        'probes = { "/ready" = "forward_or_503", "/demo/stats" = "answer" }\n'
    )
    proxy = start_proxy("--config", str(config))
    assert proxy.state("demo") == "asleep"
    paths = (
        "/demo/health",
        "/demo/metrics",
        "/demo/v1/models",
        "/health",
        "/healthz",
        "/metrics",
        "/v1/models",
    )
    seen: list[tuple[str, int, bytes]] = []

    def probe_round() -> None:
        for path in paths:
            status, body = fetch("GET", proxy.url + path)
            seen.append((path, status, body))

    # Asleep: 10 s of probes every 0.5 s wake nothing, each answered by the proxy.
    for _ in range(20):
        probe_round()
        time.sleep(0.5)  # the probes' own pace, as a scraper's; no ordering rests on it
    assert demo.state() == "asleep" and proxy.state("demo") == "asleep"
    assert proxy.metric("hibernate_serve_transitions_total", backend="demo", operation="wake") == 0
    assert {(p, s) for p, s, _ in seen} == {(p, 200) for p in paths}
    answers = {p: b for p, _, b in seen}
    assert json.loads(answers["/demo/health"]) == {"status": "ok", "backend": "demo", "state": "asleep"}
    assert answers["/demo/metrics"] == b""
    assert json.loads(answers["/demo/v1/models"])["data"][0]["state"] == "asleep"
    assert json.loads(answers["/healthz"]) == {"status": "ok", "backends": {"demo": "asleep"}}
    code, headers, body = exchange("GET", proxy.url + "/demo/ready")
    assert code == 503 and headers["Retry-After"] == "5" and b"is asleep" in body, (code, headers, body)

    # Awake: probes go on every 0.5 s, are forwarded to the demo, and its idle sleep still comes.
    seen.clear()
    assert proxy.post(completion("demo"))[0] == 200
    # An "answer" probe is the proxy's even while the backend is awake: never forwarded.
    stats = json.loads(fetch("GET", proxy.url + "/demo/demo/stats")[1])
    assert stats == {"status": "ok", "backend": "demo", "state": "awake"}
    stop = threading.Event()

    def keep_probing() -> None:
        while not stop.is_set():
            probe_round()
            stop.wait(0.5)

    prober = threading.Thread(target=keep_probing)
    prober.start()
    try:
        wait_until(lambda: proxy.state("demo") == "asleep", 60, "the idle sleep, probes or not")
    finally:
        stop.set()
        prober.join(timeout=60)
    assert demo.state() == "asleep"
    assert len(proxy.lines("demo: awake -> asleep (sleep, idle")) == 1
    assert (("/demo/health", 200, b"{}")) in seen  # the demo's own answer: forwarded while awake
    assert proxy.metric("hibernate_serve_transitions_total", backend="demo", operation="wake") == 1


@pytest.mark.slow
def test_keep_alive_zero_puts_the_model_to_sleep_right_after_its_request(
    start_http_demo: Callable[..., HttpDemo], start_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    demo = start_http_demo()
    config = tmp_path / "serve.toml"  # no idle: only the request says when
    config.write_text(f'[[backend]]\nname = "demo"\nurl = "{demo.url}"\nprefix = "/demo"\n')
    proxy = start_proxy("--config", str(config))
    before = proxy.post(completion("demo"))
    code, _, body = exchange(
        "POST", proxy.url + "/v1/completions", {"X-Hibernate-Keep-Alive": "0"}, completion("demo")
    )
    assert (code, body) == before
    wait_until(lambda: proxy.state("demo") == "asleep", 30, "the sleep right after the request")
    assert demo.state() == "asleep"
    assert proxy.lines("demo: awake -> asleep (sleep, keep-alive 0, ")  # the log says what asked for it
    # In the body, as Ollama's keep_alive: taken out, and obeyed (negative: no idle sleep).
    code, _, body = exchange("POST", proxy.url + "/v1/completions", None, completion("demo", keep_alive=-1))
    assert (code, body) == before
    models = json.loads(exchange("GET", proxy.url + "/hibernate/models")[2])["data"]
    assert [(m["name"], m["state"], m["keep_alive"]) for m in models] == [("demo", "awake", -1)]
    # Under a prefix too: taken out, and obeyed.
    code, _, body = exchange(
        "POST", proxy.url + "/demo/v1/completions", None, completion("demo", keep_alive="0")
    )
    assert (code, body) == before
    wait_until(lambda: proxy.state("demo") == "asleep", 30, "the sleep right after the prefixed request")
    assert demo.state() == "asleep"
    assert proxy.post(completion("demo"))[0] == 200
    assert demo.stats()["keep_alive_received"] == 0  # the backend never saw the field
    code, _, body = exchange(
        "POST", proxy.url + "/v1/completions", None, completion("demo", keep_alive="soon")
    )
    assert code == 400 and "keep_alive must be a number of seconds" in json.loads(body)["error"]["message"]


@pytest.mark.slow
def test_off_loopback_the_control_endpoints_are_off_without_a_token_and_need_it_with_one(
    start_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    backend = ("--backend", f"q=http://127.0.0.1:{free_port()}")  # nothing there: adopted as failed
    open_to_all = start_proxy(*backend, host="0.0.0.0")
    assert open_to_all.lines("control endpoints OFF: listening beyond loopback without a token")
    code, _, body = exchange(
        "GET", open_to_all.url + "/hibernate/models", {"Authorization": f"Bearer {TOKEN}"}
    )
    assert code == 403 and "no token is configured" in json.loads(body)["error"]["message"]
    assert exchange("POST", open_to_all.url + "/hibernate/models/q/wake")[0] == 403
    assert exchange("GET", open_to_all.url + "/hibernate/status")[0] == 403  # pids and command lines

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    guarded = start_proxy(*backend, "--token-file", str(token_file), host="0.0.0.0")
    assert guarded.lines(f"control endpoints on, with the token of --token-file {token_file}")
    for headers in (None, {"Authorization": "Bearer wrong-token-0123456789"}):
        code, answer_headers, body = exchange("GET", guarded.url + "/hibernate/models", headers)
        assert code == 401 and answer_headers["WWW-Authenticate"] == "Bearer", body
        assert exchange("POST", guarded.url + "/hibernate/models/q/sleep", headers)[0] == 401
        assert exchange("GET", guarded.url + "/hibernate/status", headers)[0] == 401
    good = {"Authorization": f"Bearer {TOKEN}"}
    code, _, body = exchange("GET", guarded.url + "/hibernate/status", good)
    assert code == 200 and [b["name"] for b in json.loads(body)["backends"]] == ["q"]
    code, _, body = exchange("GET", guarded.url + "/hibernate/models", good)
    assert code == 200 and [m["name"] for m in json.loads(body)["data"]] == ["q"]
    code, _, body = exchange("POST", guarded.url + "/hibernate/models/q/sleep", good)
    assert code == 200 and json.loads(body)["state"] == "failed"  # not running: nothing to put to sleep
    code, headers, body = exchange("POST", guarded.url + "/hibernate/models/q/wake", good)
    assert code == 503 and headers["Retry-After"].isdigit() and "could not be woken" in body.decode()
    assert exchange("POST", guarded.url + "/hibernate/models/zz/wake", good)[0] == 404


@pytest.mark.slow
def test_logs_are_json_lines_with_every_request_when_verbose_and_warnings_only_when_quiet(
    start_proxy: Callable[..., Proxy],
) -> None:
    backend = ("--backend", f"q=http://127.0.0.1:{free_port()}")  # nothing there: adopted as failed
    verbose = start_proxy(*backend, "--log-format", "json", "--verbose")
    assert fetch("GET", verbose.url + "/v1/models")[0] == 200
    assert verbose.stop() == 0
    entries = [json.loads(line) for line in verbose.log.read_text().splitlines()]
    assert all(set(e) == {"time", "level", "logger", "message"} for e in entries), entries
    assert any(e["level"] == "debug" and e["message"].startswith("GET /v1/models -> 200 (") for e in entries)
    assert any(e["level"] == "warning" and e["message"].startswith("q: not adopted: ") for e in entries)

    quiet = start_proxy(*backend, "--quiet", wait=False)
    wait_until(
        lambda: quiet.proc.poll() is not None or fetch_or_none(quiet.url + "/health") == 200, 60, "/health"
    )
    assert fetch("GET", quiet.url + "/v1/models")[0] == 200
    assert quiet.stop() == 0
    lines = quiet.log.read_text().splitlines()
    assert lines and all(" WARNING hibernate serve: " in line for line in lines), lines


def fetch_or_none(url: str) -> int | None:
    try:
        return fetch("GET", url)[0]
    except aiohttp.ClientError:
        return None


@pytest.mark.slow
def test_a_backend_without_hibernate_is_refused_with_its_reason_said_once_and_when_to_retry(
    start_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    port = free_port()
    plain = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: fetch_or_none(f"http://127.0.0.1:{port}/") == 200, 30, "the plain server")
        proxy = start_proxy("--backend", f"plain=http://127.0.0.1:{port}")
        code, headers, body = exchange("POST", proxy.url + "/v1/completions", None, completion("plain"))
        reason = f"no hibernate agent in process {plain.pid}"
        assert code == 503 and headers["Retry-After"] == "10", (code, headers)
        assert json.loads(body)["error"]["message"] == f"backend plain could not be woken: {reason}"
    finally:
        plain.kill()
        plain.wait()


def demo_command(tmp_path: Path, name: str, port: int) -> list[str]:
    """The demo with its HTTP API, as a backend's ``command`` (started by the proxy)."""
    return [
        sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve", "--size-mb", str(DEMO_MB),
        "--dtype", "float32", "--control", str(tmp_path / f"{name}.sock"), "--http-port", str(port),
        "--model-name", name,
    ]  # fmt: skip


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their command names."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if int(rest[1]) == pid:
            found[int(entry.name)] = name
    return found


@pytest.mark.slow
def test_two_first_requests_for_two_stopped_models_under_a_budget_both_start_and_answer(
    start_proxy: Callable[..., Proxy], runtime_dir: Path, tmp_path: Path
) -> None:
    config = tmp_path / "serve.toml"
    tables = ""
    for name in ("a", "b"):
        port = free_port()
        tables += (
            f'[[backend]]\nname = "{name}"\nurl = "http://127.0.0.1:{port}"\n'
            f"command = {json.dumps(demo_command(tmp_path, name, port))}\nstart_timeout = 90\n\n"
        )
    config.write_text('gpu_budget = "1GiB"\n' + tables)
    proxy = start_proxy("--config", str(config))
    assert {n: proxy.state(n) for n in ("a", "b")} == {"a": "stopped", "b": "stopped"}

    async def both() -> list[tuple[int, dict[str, str], bytes]]:
        return list(
            await asyncio.gather(
                *(_exchange("POST", proxy.url + "/v1/completions", None, completion(n)) for n in ("a", "b"))
            )
        )

    answers = asyncio.run(both())
    assert [code for code, _, _ in answers] == [200, 200], answers
    assert len(proxy.lines("stopped -> awake (started pid")) == 2


@pytest.mark.slow
def test_sigterm_during_a_start_stops_its_command_at_once_and_exits_promptly(
    start_proxy: Callable[..., Proxy], tmp_path: Path
) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        f'[[backend]]\nname = "slow"\nurl = "http://127.0.0.1:{free_port()}"\n'
        'command = ["sleep", "1000"]\nstart_timeout = 100\n'
    )
    proxy = start_proxy("--config", str(config))
    answers: list[tuple[int, dict[str, str], bytes]] = []
    asking = threading.Thread(
        target=lambda: answers.append(
            exchange("POST", proxy.url + "/v1/completions", None, completion("slow"))
        )
    )
    asking.start()
    command = wait_until(
        lambda: [pid for pid, name in children(proxy.proc.pid).items() if name == "sleep"],
        60,
        "the proxy to start the command",
    )[0]
    assert proxy.state("slow") == "starting"
    stopped_at = time.monotonic()
    proxy.proc.send_signal(signal.SIGTERM)
    assert proxy.proc.wait(timeout=60) == 0
    took = time.monotonic() - stopped_at
    asking.join(timeout=60)
    assert took < 30, f"serve took {took:.1f} s to stop (shutdown_timeout: 30 s)"  # was 3 x 30 s
    assert not Path(f"/proc/{command}").exists()  # stopped and reaped, not left behind
    assert [code for code, _, _ in answers] == [503], answers


def dead_or_reaped(pid: int) -> bool:
    """Whether ``pid`` has died: a zombie, or already reaped (its /proc entry gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_a_started_model_killed_is_seen_stopped_by_a_probe_reaped_and_started_by_the_next_request(
    start_proxy: Callable[..., Proxy], runtime_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    config = tmp_path / "serve.toml"
    config.write_text(
        f'[[backend]]\nname = "own"\nurl = "http://127.0.0.1:{port}"\nprefix = "/own"\n'
        f"command = {json.dumps(demo_command(tmp_path, 'own', port))}\nstart_timeout = 120\n"
    )
    proxy = start_proxy("--config", str(config))
    assert proxy.post(completion("own"))[0] == 200
    pid = proxy.status()["own"]["pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: dead_or_reaped(pid), 30, "the kill")  # serve's own refresh may reap it first

    code, body = fetch("GET", proxy.url + "/own/health")
    assert (code, json.loads(body)) == (200, {"status": "ok", "backend": "own", "state": "stopped"})
    assert not Path(f"/proc/{pid}").exists()  # reaped, not left a zombie
    assert proxy.post(completion("own"))[0] == 200  # this very request starts it again
    again = proxy.status()["own"]
    assert again["state"] == "awake" and again["pid"] not in (None, pid)
    assert len(proxy.lines("own: stopped -> awake (started pid")) == 2
