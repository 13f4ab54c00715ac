"""`hibernate serve` with llama-swap's habits: a backend's port written once as ``${PORT}`` (serve chooses
a free one when it starts, the same in the backend's url, command and env), and ``served_model``, the
name the backend serves its model as, put in the place of the alias a client asked for."""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import UsageError
from hibernate.serve.bodies import with_model
from hibernate.serve.config import build_config, with_ports
from hibernate.serve.routing import ApiError
from hibernate.serve.starter import choose_port
from tests.test_serve import DEMO_MB, Proxy, completion, fetch, start_proxy

__all__ = ["start_proxy"]  # a fixture, used by name


def config(*tables: dict[str, Any]) -> Any:
    return build_config(
        listen=None, to=Path("/snap"), backend_flags=[], idle=None, wake_timeout=None, gpu_budget=None,
        document={"backend": list(tables)},
    )  # fmt: skip


def started(name: str, **table: Any) -> dict[str, Any]:
    """A backend started on demand whose port serve chooses."""
    return {"name": name, "url": "http://127.0.0.1:${PORT}", "command": "server --port ${PORT}", **table}


def test_port_is_chosen_once_per_backend_and_written_into_its_url_command_and_env() -> None:
    settings = config(
        started("a"),
        started("b", command=["server"], env={"PORT": "${PORT}", "OTHER": "x"}),
        {"name": "c", "url": "http://127.0.0.1:8003"},
    )  # two backends at ${PORT}: not "the same address", each gets its own port
    ports = iter((41001, 41002))
    asked: list[str] = []

    def choose(host: str) -> int:
        asked.append(host)
        return next(ports)

    a, b, c = with_ports(settings, choose).backends
    assert asked == ["127.0.0.1", "127.0.0.1"]
    assert (a.url, a.command, a.host_port) == (
        "http://127.0.0.1:41001",
        ("server", "--port", "41001"),
        ("127.0.0.1", 41001),
    )
    assert (b.url, b.command, b.env) == (
        "http://127.0.0.1:41002",
        ("server",),
        (("PORT", "41002"), ("OTHER", "x")),
    )
    assert c == settings.backends[2]
    assert not a.port_chosen_by_serve and settings.backends[0].port_chosen_by_serve


@pytest.mark.parametrize(
    ("table", "words"),
    [
        (
            started("a", url="http://127.0.0.1:8001"),
            "command: ${PORT} is a port serve chooses: the url must say",
        ),
        (
            started("a", command="server --port 8001"),
            "url: ${PORT} is a port serve chooses: its command (or env)",
        ),
        ({"name": "a", "url": "http://127.0.0.1:${PORT}"}, "url: ${PORT} is a port serve chooses"),
        (started("a", url="http://${PORT}:8001"), "url: ${PORT} stands for the port alone"),
        (
            started("a", url="http://127.0.0.1:${PORT}/v1"),
            "url: a backend's address must be http://HOST:PORT (no",
        ),
        (started("a", served_model=""), "served_model: must be the model name the backend serves"),
        (started("a", served_model=3), "served_model: must be the model name the backend serves"),
    ],
)
def test_a_port_macro_or_served_model_that_cannot_work_is_refused_at_start(
    table: dict[str, Any], words: str
) -> None:
    with pytest.raises(UsageError) as refused:
        config(table)
    assert refused.value.message.startswith(f"serve.toml: [[backend]] #1 {words}"), refused.value.message


def test_a_port_macro_in_a_backend_flag_is_refused_it_has_no_command_to_tell() -> None:
    with pytest.raises(UsageError, match=r"\$\{PORT\} is a port serve chooses for a backend it starts"):
        build_config(
            listen=None, to=Path("/snap"), backend_flags=["a=http://127.0.0.1:${PORT}"], idle=None,
            wake_timeout=None, gpu_budget=None,
        )  # fmt: skip


def test_a_chosen_port_is_free_on_the_host_asked_for() -> None:
    for host in ("127.0.0.1", "localhost"):
        port = choose_port(host)
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # free: a server can take it
    with pytest.raises(UsageError, match=r"cannot choose a port for \$\{PORT\} on 192\.0\.2\.1"):
        choose_port("192.0.2.1")  # not an address of this machine (TEST-NET-1)


def test_the_served_model_takes_the_aliases_place_and_nothing_else_changes() -> None:
    body = json.dumps({"model": "alias", "prompt": "héllo", "max_tokens": 8, "stop": ["\n"]}).encode()
    rewritten = with_model(body, "Org/Model-7B")
    assert json.loads(rewritten) == {
        "model": "Org/Model-7B",
        "prompt": "héllo",
        "max_tokens": 8,
        "stop": ["\n"],
    }
    assert "héllo".encode() in rewritten  # written as it was, not escaped
    already = b'{ "model" : "Org/Model-7B", "prompt": "x" }'
    assert with_model(already, "Org/Model-7B") is already  # byte for byte
    with pytest.raises(ApiError) as refused:
        with_model(b'{"model": "alias", "temperature": NaN}', "Org/Model-7B")
    assert (
        refused.value.status == 400
        and "cannot be forwarded with the model its backend serves" in refused.value.message
    )


@pytest.mark.slow
def test_a_model_started_on_a_port_serve_chose_answers_the_alias_it_is_asked_by(
    start_proxy: Callable[..., Proxy], runtime_dir: Path, tmp_path: Path
) -> None:
    """The demo serves its model as "own" and answers 404 for any other name: asked for "alias" through
    the proxy it answers, because the proxy forwards the model it serves."""
    command = [
        sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve", "--size-mb", str(DEMO_MB),
        "--dtype", "float32", "--control", str(tmp_path / "own.sock"), "--http-port", "${PORT}",
        "--model-name", "own",
    ]  # fmt: skip
    settings = tmp_path / "serve.toml"
    settings.write_text(
        '[[backend]]\nname = "friendly"\nmodels = ["alias"]\nserved_model = "own"\n'
        f'url = "http://127.0.0.1:${{PORT}}"\ncommand = {json.dumps(command)}\nhealth_path = "/health"\n'
        "start_timeout = 120\n"
    )
    proxy = start_proxy("--config", str(settings))
    chosen = proxy.lines("friendly: ${PORT} is ")
    assert len(chosen) == 1, chosen
    port = int(chosen[0].split("${PORT} is ")[1].split()[0])
    assert proxy.status()["friendly"]["url"] == f"http://127.0.0.1:{port}"

    status, body = proxy.post(completion("alias"))
    assert status == 200, body
    direct = fetch("POST", f"http://127.0.0.1:{port}/v1/completions", completion("own"))  # where it listens
    assert (status, body) == direct
    assert fetch("POST", f"http://127.0.0.1:{port}/v1/completions", completion("alias"))[0] == 404
