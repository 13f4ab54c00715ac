"""The agent's socket: framing, versioning, sessions, and who may talk to it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import stat
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hibernate import procinfo
from hibernate.agent import controller, protocol
from hibernate.agent.client import AgentClient
from hibernate.agent.controller import Agent, Session
from hibernate.agent.paths import live_sockets, parse_socket_name, socket_name, sweep_stale_sockets
from hibernate.agent.server import AgentServer
from hibernate.errors import BusyError, ProtocolError, UsageError
from hibernate.pools.tensors import TensorPool
from tests.conftest import NOBODY, is_root, source_root_for, wait_until


@pytest.fixture
def served(runtime_dir: Path) -> Iterator[tuple[Agent, AgentServer]]:
    ident = procinfo.identity(os.getpid())
    assert ident is not None
    agent = Agent(ident)
    pool = TensorPool()
    pool.track(torch.arange(1 << 16, dtype=torch.int32), "weights", True, "w")
    agent.add_pool(pool)
    server = AgentServer(agent, runtime_dir)
    yield agent, server
    server.stop()


def raw_connect(server: AgentServer) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(server.path))
    return sock


def test_frames_round_trip() -> None:
    message = protocol.request(7, "hello", {"x": [1, "two", None]})
    frame = protocol.encode(message)
    (length,) = struct.unpack("!I", frame[:4])
    assert length == len(frame) - 4
    assert protocol.decode(frame[4:]) == message
    assert protocol.parse_request(message) == (7, "hello", {"x": [1, "two", None]})


@pytest.mark.parametrize(
    "message, problem",
    [
        ({"v": 2, "id": 1, "op": "hello"}, "protocol version 2 is not supported"),
        ({"v": 1, "id": -1, "op": "hello"}, "request id"),
        ({"v": 1, "id": True, "op": "hello"}, "request id"),
        ({"v": 1, "id": 1, "op": ""}, "request op"),
        ({"v": 1, "id": 1, "op": "x" * 65}, "request op"),
        ({"v": 1, "id": 1, "op": "hello", "args": []}, "args must be an object"),
    ],
)
def test_malformed_requests_are_refused(message: dict, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        protocol.parse_request(message)


def test_oversized_frames_are_refused_before_reading(served: tuple[Agent, AgentServer]) -> None:
    _, server = served
    with raw_connect(server) as sock:
        sock.sendall(struct.pack("!I", protocol.MAX_MESSAGE_BYTES + 1))
        reply = protocol.receive(sock)
        assert reply is not None and reply["type"] == "error"
        assert "exceeds" in reply["error"]["message"]
        assert protocol.receive(sock) is None  # and the connection is closed
    with pytest.raises(ProtocolError):
        protocol.encode({"blob": "x" * (protocol.MAX_MESSAGE_BYTES + 1)})


def test_wrong_version_is_answered_then_closed(served: tuple[Agent, AgentServer]) -> None:
    _, server = served
    with raw_connect(server) as sock:
        protocol.send(sock, {"v": 99, "id": 1, "op": "hello"})
        reply = protocol.receive(sock)
        assert reply is not None and reply["error"]["code"] == "protocol"
        assert "this agent speaks 1" in reply["error"]["message"]
        assert protocol.receive(sock) is None


def test_hello_reports_identity_pools_and_state(served: tuple[Agent, AgentServer]) -> None:
    agent, server = served
    with AgentClient(server.path) as client:
        status = client.call("hello")
    assert status["pid"] == os.getpid()
    assert status["start_time"] == agent.identity.start_time
    assert status["state"] == "running"
    assert status["pools"] == [
        {"pool": "torch", "tag": "weights", "keep": True, "count": 1, "bytes": 1 << 18}
    ]


def test_operations_need_a_session_and_sessions_exclude_each_other(
    served: tuple[Agent, AgentServer], work_dir: Path
) -> None:
    _, server = served
    with AgentClient(server.path) as first, AgentClient(server.path) as second:
        with pytest.raises(BusyError, match="begin a session first"):
            first.call("quiesce")
        first.call("begin")
        with pytest.raises(BusyError, match=rf"busy: hibernate \(pid {os.getpid()}"):
            second.call("begin")
        first.call("end")
        second.call("begin")


def test_a_command_right_after_one_that_exited_waits_for_its_session_to_be_wound_up() -> None:
    """The first command's exit closes its socket before the agent's connection thread has ended
    its session: the next command, run at once, waits for that rather than being told "busy"."""
    ident = procinfo.identity(os.getpid())
    assert ident is not None
    agent = Agent(ident)
    asked = threading.Event()

    def gone() -> bool:  # the agent asks whether the owner's client is gone: it is, and is being wound up
        asked.set()
        return True

    exited = Session("hibernate (pid 1, uid 0)", cancelled=gone)
    agent.begin(exited)

    def wind_up() -> None:
        asked.wait(60)
        agent.disconnect(exited)

    winding_up = threading.Thread(target=wind_up)
    winding_up.start()
    try:
        agent.begin(Session("hibernate (pid 2, uid 0)"))
    finally:
        winding_up.join(60)


def test_an_owner_whose_client_is_alive_is_busy_at_once_and_a_gone_one_only_for_a_while() -> None:
    ident = procinfo.identity(os.getpid())
    assert ident is not None
    agent = Agent(ident)
    agent.begin(Session("hibernate (pid 1, uid 0)"))
    with pytest.raises(BusyError, match=r"busy: hibernate \(pid 1"):
        agent.begin(Session("hibernate (pid 2, uid 0)"))
    stuck = Agent(ident)
    stuck.gone_owner_wait_s = 0.05
    stuck.begin(Session("hibernate (pid 3, uid 0)", cancelled=lambda: True))  # gone, never wound up
    with pytest.raises(BusyError, match=r"busy: hibernate \(pid 3"):
        stuck.begin(Session("hibernate (pid 4, uid 0)"))


def test_a_vanished_client_rolls_back_a_half_done_sleep(
    served: tuple[Agent, AgentServer], work_dir: Path
) -> None:
    agent, server = served
    client = AgentClient(server.path)
    client.call("begin")
    client.call("quiesce", {"timeout": 1})
    client.call("spill", {"dir": str(work_dir)})
    assert agent.state.value == "spilled"
    client.close()
    wait_until(lambda: agent.status()["busy"] is None, 30, "the agent to end the vanished client's turn")
    assert agent.state.value == "running"
    assert not agent.guard.closed
    with AgentClient(server.path) as again:
        again.call("begin")  # ownership was released too


def test_a_hello_counts_the_pools_unless_told_not_to(
    served: tuple[Agent, AgentServer], work_dir: Path
) -> None:
    """A sleep's hello leaves the pools uncounted (a walk of every tracked tensor) and its spill says
    what it spilled, per tag and on each device; a hello without arguments counts them, as always."""
    _, server = served
    with AgentClient(server.path) as client:
        counted = client.call("hello")
        brief = client.call("hello", {"contents": False})
        with pytest.raises(UsageError, match="contents must be true or false"):
            client.call("hello", {"contents": "no"})
        client.call("begin")
        client.call("quiesce", {"timeout": 1})
        spilled = client.call("spill", {"dir": str(work_dir)})
        asleep = client.call("hello")
    assert counted["pools"] == [
        {"pool": "torch", "tag": "weights", "keep": True, "count": 1, "bytes": 1 << 18}
    ]
    assert "pools" not in brief and "device_bytes" not in brief and brief["pid"] == counted["pid"]
    assert spilled["pools"] == counted["pools"] == asleep["pools"]
    assert spilled["device_bytes"] == {} == asleep["device_bytes"]  # host memory only


def test_asleep_outlives_its_client(served: tuple[Agent, AgentServer], work_dir: Path) -> None:
    agent, server = served
    with AgentClient(server.path) as client:
        for op, args in (("begin", {}), ("quiesce", {}), ("spill", {"dir": str(work_dir)}), ("release", {})):
            client.call(op, args)
    wait_until(lambda: agent.status()["busy"] is None, 30, "the agent to end the client's session")
    assert agent.state.value == "asleep"
    with AgentClient(server.path) as client:
        client.call("begin")
        client.call("restore")
        client.call("resume")
    assert agent.state.value == "running"


def test_a_restore_says_it_is_preparing_before_its_first_byte(
    runtime_dir: Path, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wake of a million tensors parses its manifest and maps each storage back before it reads,
    for seconds: it reports that work as it goes (no bytes yet, the total known), so that a client
    bounding the agent's silence hears it. Here every step of it pulses (the interval at zero)."""
    monkeypatch.setattr(controller, "PREPARING_PULSE_S", 0.0)
    ident = procinfo.identity(os.getpid())
    assert ident is not None
    agent = Agent(ident)
    pool = TensorPool()
    for index in range(50):
        pool.track(torch.full((256,), index, dtype=torch.int32), "weights", True, f"t{index}")
    agent.add_pool(pool)
    server = AgentServer(agent, runtime_dir)
    events: list[dict] = []
    try:
        with AgentClient(server.path) as client:
            client.call("begin")
            client.call("quiesce")
            client.call("spill", {"dir": str(work_dir)})
            client.call("release")
            client.call("restore", progress=events.append)
            client.call("resume")
    finally:
        server.stop()
    total = 50 * 256 * 4
    preparing = list(itertools.takewhile(lambda event: event["done"] == 0, events))
    assert preparing, events
    assert {(event["phase"], event["total"]) for event in preparing} == {("restore", total)}
    assert events[-1] == {"phase": "restore", "done": total, "total": total}


def test_unknown_op_is_an_error_not_a_crash(served: tuple[Agent, AgentServer]) -> None:
    _, server = served
    with AgentClient(server.path) as client:
        with pytest.raises(ProtocolError, match="unknown operation 'explode'"):
            client.call("explode")
        assert client.call("hello")["state"] == "running"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=0, max_size=512))
def test_garbage_never_crashes_the_agent(served: tuple[Agent, AgentServer], garbage: bytes) -> None:
    _, server = served
    with raw_connect(server) as sock, contextlib.suppress(ConnectionResetError, BrokenPipeError):
        sock.sendall(garbage)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(4096):  # the agent answers or hangs up; either way it must survive
            pass
    with AgentClient(server.path) as client:
        assert client.call("hello")["state"] == "running"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    document=st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=20),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
        max_leaves=20,
    )
)
def test_well_framed_nonsense_is_answered_with_an_error(
    served: tuple[Agent, AgentServer], document: object
) -> None:
    _, server = served
    body = json.dumps(document).encode()
    with raw_connect(server) as sock:
        sock.sendall(struct.pack("!I", len(body)) + body)
        reply = protocol.receive(sock)
    assert reply is not None and reply["type"] in ("error", "result")


def test_runtime_directory_and_socket_are_private(
    served: tuple[Agent, AgentServer], runtime_dir: Path
) -> None:
    _, server = served
    assert stat.S_IMODE(runtime_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE(server.path.stat().st_mode) & 0o077 == 0
    ident = parse_socket_name(server.path.name)
    assert ident is not None and ident.pid == os.getpid()


def test_stale_sockets_are_removed_never_trusted(runtime_dir: Path) -> None:
    runtime_dir.mkdir(mode=0o700, exist_ok=True)
    ghost = procinfo.ProcessIdentity(pid=os.getpid(), start_time=1)  # our pid, another start time
    stale = runtime_dir / socket_name(ghost)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(stale))
    assert stale.exists()
    assert live_sockets(runtime_dir) == [], "a stale socket is never taken for an agent"
    assert stale.exists(), "listing deletes nothing"
    sweep_stale_sockets(runtime_dir)
    assert not stale.exists()


@pytest.mark.slow
@pytest.mark.skipif(not is_root(), reason="needs a second user")
def test_peer_credentials_refuse_another_user(served: tuple[Agent, AgentServer], runtime_dir: Path) -> None:
    _, server = served
    # Even if the directory were opened up by mistake, the peer check still refuses.
    os.chmod(runtime_dir, 0o755)
    os.chmod(server.path, 0o777)
    probe = (
        "import sys; sys.path.insert(0, sys.argv[2]);"
        "from hibernate.agent.client import AgentClient;"
        "from hibernate.errors import HibernateError\n"
        "try:\n    AgentClient(sys.argv[1]).call('hello')\n"
        "except HibernateError as e:\n    print(type(e).__name__, e.message)"
    )
    out = subprocess.run(
        [
            "setpriv",
            f"--reuid={NOBODY}",
            f"--regid={NOBODY}",
            "--clear-groups",
            sys.executable,
            "-c",
            probe,
            str(server.path),
            str(source_root_for(NOBODY)),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "PermissionDeniedError uid 65534 may not control process" in out.stdout, out.stderr


def test_an_agent_with_the_same_pid_and_start_time_does_not_take_a_live_socket_over(
    served: tuple[Agent, AgentServer], runtime_dir: Path
) -> None:
    """Two containers sharing a runtime directory can each hold a pid 1 started in the same clock
    tick. The second agent must not take the first's socket: the first's commands would reach it."""
    agent, server = served
    twin = Agent(agent.identity)  # what another container's process looks like from here
    with pytest.raises(UsageError, match=r"is the live socket of another process") as refused:
        AgentServer(twin, runtime_dir)
    assert "HIBERNATE_RUNTIME_DIR" in (refused.value.hint or "")
    with AgentClient(server.path) as client:
        assert client.call("hello")["pid"] == os.getpid(), "the first agent still answers"


def test_an_agent_of_another_pid_namespace_is_not_taken_for_the_target(
    served: tuple[Agent, AgentServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same pid and start tick in another pid namespace is another process: never acted on."""
    from hibernate.operation import targets

    agent, server = served
    with AgentClient(server.path) as client:
        assert client.call("hello")["pid_namespace"] == procinfo.pid_namespace()
    assert targets.probe_agent(agent.identity, server.path) is not None
    ours = procinfo.pid_namespace()
    assert ours is not None
    monkeypatch.setattr(procinfo, "pid_namespace", lambda pid="self": ours + 1 if pid != "self" else ours)
    assert targets.probe_agent(agent.identity, server.path) is None
