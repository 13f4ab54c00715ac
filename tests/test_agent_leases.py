"""Leases: requests in flight through a proxy hold a process awake against a sleep from anywhere."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.agent.client import AgentClient
from hibernate.agent.leases import Leases
from hibernate.errors import AbortedError, BusyError, ExitCode
from hibernate.operation import targets
from tests.conftest import REPO, wait_until


def running() -> dict[str, Any] | None:
    return None


def test_a_sleep_waits_for_leases_and_refuses_new_ones_meanwhile() -> None:
    leases, proxy, sleep = Leases(), object(), object()
    assert leases.take(proxy, "proxy (pid 7)", running) == {"granted": True, "held": 1}
    assert leases.take(proxy, "proxy (pid 7)", running) == {"granted": True, "held": 2}
    waited: list[float] = []
    sleeper = threading.Thread(target=lambda: waited.append(leases.close(sleep, "a sleep", "process 9", 30)))
    sleeper.start()
    wait_until(lambda: leases.summary()["closed_by"] == ["a sleep"], 5, "the sleep to close the gate")
    refused = leases.take(object(), "another proxy (pid 8)", running)
    assert refused == {"granted": False, "reason": "closed", "by": ["a sleep"]}  # no starving the sleep
    assert leases.give_back(proxy) == 1
    assert sleeper.is_alive()  # one request still in flight
    assert leases.give_back(proxy) == 0
    sleeper.join(5)
    assert waited and leases.held == 0
    leases.reopen(sleep)  # the sleep was undone, or resumed
    assert leases.take(proxy, "proxy (pid 7)", running)["granted"] is True


def test_a_sleep_that_waits_too_long_is_refused_busy_naming_the_holders_and_reopens_the_gate() -> None:
    leases, proxy, sleep = Leases(), object(), object()
    leases.take(proxy, "hibernate serve (pid 7, uid 0)", running)
    leases.take(proxy, "hibernate serve (pid 7, uid 0)", running)
    with pytest.raises(BusyError) as refused:
        leases.close(sleep, "a sleep", "process 9", 0.2)
    assert refused.value.message == (
        "process 9 is held awake by 2 requests in flight through hibernate serve (pid 7, uid 0); "
        "nothing was changed"
    )
    assert refused.value.exit_code == ExitCode.BUSY
    assert leases.summary() == {
        "held": 2,
        "holders": [{"by": "hibernate serve (pid 7, uid 0)", "count": 2}],
        "closed_by": [],
    }
    assert leases.take(object(), "x", running)["granted"] is True
    with pytest.raises(AbortedError):
        leases.close(sleep, "a sleep", "process 9", 30, cancelled=lambda: True)  # its client went away
    assert leases.summary()["closed_by"] == []


def test_a_holder_that_goes_away_gives_its_leases_back_and_the_state_can_refuse() -> None:
    leases, proxy, sleep = Leases(), object(), object()
    leases.take(proxy, "proxy", running)
    sleeper = threading.Thread(target=leases.close, args=(sleep, "a sleep", "process 9", 30))
    sleeper.start()
    wait_until(lambda: leases.summary()["closed_by"], 5, "the sleep to close the gate")
    leases.drop(proxy)  # its connection closed: crashed, or stopped
    sleeper.join(5)
    assert not sleeper.is_alive() and leases.held == 0
    leases.drop(sleep)  # the sleeping client's connection ended too: the gate reopens
    asleep = {"reason": "asleep", "state": "asleep"}
    assert leases.take(proxy, "proxy", lambda: asleep) == {"granted": False, **asleep}
    assert leases.held == 0


LEASE_HOLDER = """
import sys
from hibernate.agent.client import AgentClient
client = AgentClient(sys.argv[1])
print(client.call("lease", {"by": "a test proxy"})["granted"], flush=True)
sys.stdin.readline()  # holds it until told, then gives it back
print(client.call("unlease")["held"], flush=True)
sys.stdin.readline()
"""


@pytest.mark.slow
def test_a_lease_holds_a_target_awake_against_hibernate_sleep_until_given_back(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=8)
    before = demo.infer()["digest"]
    agent = targets.find_agent(demo.pid)
    assert agent is not None
    holder = subprocess.Popen(
        [sys.executable, "-c", LEASE_HOLDER, str(agent.socket)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert holder.stdin is not None and holder.stdout is not None
    try:
        assert holder.stdout.readline() == "True\n"
        status = cli("status", str(demo.pid))
        assert (
            f"pid {demo.pid}: held awake (leases) by 1 request through a test proxy (pid {holder.pid},"
            in status.stdout
        )

        refused = cli("sleep", str(demo.pid), "--to", str(work_dir), "--timeout", "1")
        assert refused.returncode == ExitCode.BUSY, refused.stderr
        assert (
            f"process {demo.pid} is held awake by 1 request in flight through a test proxy "
            f"(pid {holder.pid}, uid " in refused.stderr
        )
        assert "nothing was changed" in refused.stderr
        assert (
            demo.infer()["digest"] == before
            and cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
        )

        # A sleep that waits: new leases are refused meanwhile; once the lease is given back it goes on.
        command = ["sleep", str(demo.pid), "--to", str(work_dir), "--timeout", "60"]
        waiting = subprocess.Popen(
            [sys.executable, "-m", "hibernate", *command],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        with AgentClient(agent.socket) as other:
            wait_until(
                lambda: other.call("status")["leases"]["closed_by"], 60, "the sleep to wait for the lease"
            )
            refusal = other.call("lease")
            assert refusal["granted"] is False and refusal["reason"] == "closed", refusal
            holder.stdin.write("\n")
            holder.stdin.flush()
            assert holder.stdout.readline() == "0\n"
            _, errors = waiting.communicate(timeout=120)
            assert waiting.returncode == 0, errors
            assert other.call("lease") == {"granted": False, "reason": "asleep", "state": "asleep"}
        assert cli("wake", str(demo.pid), "-q").returncode == 0
        assert demo.infer()["digest"] == before
    finally:
        holder.kill()
        holder.wait()

    # A holder that dies gives its leases back: nothing is left to wait for.
    with AgentClient(agent.socket) as client:
        assert client.call("lease")["granted"] is True
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "--timeout", "5", "-q").returncode == 0


# A stand-in for a target still running a hibernate from before leases (started before the
# command's hibernate was upgraded): its status has no "leases" and it knows no lease operation.
AGENT_BEFORE_LEASES = """
from hibernate.agent import controller, server
from hibernate.errors import ProtocolError

_status, _dispatch = controller.Agent.status, server._Connection._dispatch


def status(self, *args, **kwargs):
    answer = _status(self, *args, **kwargs)
    del answer["leases"]
    return answer


def dispatch(self, op, args):
    if op in ("lease", "unlease", "close_leases"):
        raise ProtocolError(f"unknown operation {op!r}")
    return _dispatch(self, op, args)


controller.Agent.status = status
server._Connection._dispatch = dispatch
"""


@pytest.mark.slow
def test_a_target_running_a_hibernate_from_before_leases_still_sleeps_and_wakes(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, tmp_path: Path
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(AGENT_BEFORE_LEASES)
    demo = start_demo(size_mb=8, env={"PYTHONPATH": f"{site}:{REPO}"})
    before = demo.infer()["digest"]
    assert "leases" not in cli("status", str(demo.pid), "--json").json()["agents"][0]
    slept = cli("sleep", str(demo.pid), "--to", str(work_dir))
    assert slept.returncode == 0, slept.stderr
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    assert demo.infer()["digest"] == before
