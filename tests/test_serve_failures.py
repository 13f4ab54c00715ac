"""`hibernate serve` never leaves a backend in a transition that is over: a start, wake or sleep that
fails for any reason (not only the failures hibernate knows by name) ends in a settled state with a 503
that says why, and what can be refused before anything starts (a NUL byte no program can be given) is
refused at start."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode, NoSuchProcessError, UsageError
from hibernate.serve import starter
from hibernate.serve.backends import Fleet
from hibernate.serve.config import build_config
from hibernate.serve.control import Inspection
from hibernate.serve.decisions import STATES, State
from hibernate.serve.metrics import Recorder
from hibernate.serve.routing import ApiError
from tests.conftest import run_cli


def specs(**table: Any) -> Any:
    document = {"backend": [{"name": "q", "url": "http://127.0.0.1:8001", **table}]}
    return build_config(
        listen=None, to=Path("/snap"), backend_flags=[], idle=None, wake_timeout=None, gpu_budget=None,
        document=document,
    ).backends  # fmt: skip


@pytest.mark.parametrize(
    ("table", "words"),
    [
        ({"command": ["server", "--name", "a\0b"]}, "command: word 3 of backend q holds a NUL byte"),
        ({"command": 'server --name "a\0b"'}, "command: word 3 of backend q holds a NUL byte"),
        ({"command": "server", "env": {"MODEL": "a\0b"}}, "env: MODEL of backend q holds a NUL byte"),
        ({"command": "server", "env": {"M\0": "x"}}, "env: the name 'M\\x00' of backend q holds a NUL"),
        ({"command": "server", "cwd": "/srv\0"}, "cwd: the directory of backend q holds a NUL byte"),
    ],
)
def test_a_nul_byte_in_what_a_backend_is_started_with_is_refused_at_start_naming_backend_and_field(
    table: dict[str, Any], words: str
) -> None:
    with pytest.raises(UsageError) as refused:
        specs(**table)
    assert refused.value.message.startswith(f"serve.toml: [[backend]] #1 {words}"), refused.value.message


def test_serve_given_a_nul_byte_in_a_backends_environment_exits_2_in_one_line(tmp_path: Path) -> None:
    config = tmp_path / "serve.toml"
    config.write_text(
        '[[backend]]\nname = "q"\nurl = "http://127.0.0.1:9"\ncommand = "true"\n'
        'env = { MODEL = "a\\u0000b" }\n'
    )
    result = run_cli("serve", "--to", str(tmp_path), "--config", str(config), timeout=60)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert result.stderr.splitlines() == [
        f"hibernate: error: {config}: [[backend]] #1 env: MODEL of backend q holds a NUL byte (\\0): "
        "no program can be given one"
    ]


class Control:
    """The backend's agents as the fleet reaches them: not there (a start runs its command), or asleep;
    a wake that fails as ``wake_error`` says, a read of the state as ``adopt_error`` says."""

    def __init__(self, asleep_pid: int | None = None) -> None:
        self.asleep_pid = asleep_pid
        self.wake_error: Exception | None = None
        self.adopt_error: Exception | None = None

    def adopt(self, spec: Any, pid: int | None = None) -> Inspection:
        if self.adopt_error is not None:
            raise self.adopt_error
        if self.asleep_pid is None:
            raise NoSuchProcessError("nothing listens on its address")
        return Inspection(self.asleep_pid, awake=False, tracked_bytes=1 << 20)

    def wake(self, pid: int) -> int:
        assert self.wake_error is not None
        raise self.wake_error


def fleet_of(control: Control, **table: Any) -> Fleet:
    return Fleet(specs(**table), control, Recorder(STATES), idle_limit=None, wake_timeout=5.0, budget=None)  # type: ignore[arg-type]


def refused_wake(fleet: Fleet) -> ApiError:
    async def wake() -> ApiError:
        with pytest.raises(ApiError) as refused:
            await asyncio.wait_for(fleet.wake_now("q"), 10)
        return refused.value

    return asyncio.run(wake())


def test_a_start_that_fails_with_an_error_nobody_named_ends_stopped_with_its_503_and_is_tried_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HIBERNATE_RUNTIME_DIR", str(tmp_path / "runtime"))
    calls = []

    def spawn_fails(spec: Any, log: Path) -> Any:
        calls.append(spec.name)
        raise RuntimeError("injected: the command could not be run")

    monkeypatch.setattr(starter, "spawn", spawn_fails)
    fleet = fleet_of(Control(), command="server")
    backend = fleet.backends["q"]
    backend.state = State.STOPPED
    for attempt in (1, 2):  # stopped, so the next request starts it again rather than waiting for ever
        error = refused_wake(fleet)
        assert error.status == 503 and error.retry_after is not None, error.message
        assert error.message.startswith(
            "backend q could not be started: RuntimeError: injected: the command could not be run"
        ), error.message
        assert backend.state is State.STOPPED and backend.transition is not None
        assert backend.transition.done()
        assert calls == ["q"] * attempt


def test_a_wake_that_fails_with_an_error_nobody_named_reads_the_state_back_and_answers_503() -> None:
    control = Control(asleep_pid=4242)
    control.wake_error = ValueError("injected")
    fleet = fleet_of(control)
    backend = fleet.backends["q"]
    backend.state, backend.pid = State.ASLEEP, 4242
    error = refused_wake(fleet)
    assert (error.status, error.message) == (503, "backend q could not be woken: ValueError: injected")
    assert backend.state is State.ASLEEP and backend.pid == 4242  # as read back from its agents


def test_a_failure_even_while_settling_a_failed_wake_leaves_the_backend_failed_not_waking() -> None:
    control = Control(asleep_pid=4242)
    control.wake_error = ValueError("injected")
    control.adopt_error = OSError("injected too")
    fleet = fleet_of(control)
    backend = fleet.backends["q"]
    backend.state, backend.pid = State.ASLEEP, 4242
    error = refused_wake(fleet)
    assert (error.status, error.message) == (503, "backend q could not be woken: OSError: injected too")
    assert backend.state is State.FAILED and backend.pid is None  # looked for again by the next request
