"""The agent's extensions for vLLM: partial restore, a sleep driver, and the configure op.

These use the agent's own torch pool of CPU tensors (real memory, really
freed), so they test the controller, not the vLLM pool.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hibernate import procinfo
from hibernate.agent.client import AgentClient
from hibernate.agent.controller import Agent, AgentState, Session, SleepDriver
from hibernate.agent.server import AgentServer
from hibernate.errors import SnapshotInvalidError, UnsupportedError, UsageError
from hibernate.pools.tensors import TensorPool

ARGS = {"buffer_mb": 2, "chunk_mb": 1}


@pytest.fixture
def agent() -> Agent:
    return Agent(procinfo.identity(os.getpid()), name="ctl-test")  # type: ignore[arg-type]


@pytest.fixture
def tensors(agent: Agent) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    made = {
        "weights": torch.randn(300_000),
        "kv_cache": torch.randn(200_000),
        "runtime": torch.randn(50_000),
    }
    pool = TensorPool()
    pool.track(made["weights"], "weights", True, "w")
    pool.track(made["kv_cache"], "kv_cache", False, "kv")
    pool.track(made["runtime"], "runtime", True, "rt")
    agent.add_pool(pool)
    return made


def tagged(*tags: str):  # type: ignore[no-untyped-def]
    return lambda region: region.tag in tags


def released(t: torch.Tensor) -> bool:
    return t.untyped_storage().nbytes() == 0


def test_a_partial_restore_keeps_the_process_asleep_until_nothing_is_pending(
    agent: Agent, tensors: dict[str, torch.Tensor], work_dir: Path
) -> None:
    before = {k: v.clone() for k, v in tensors.items()}
    agent.sleep_here(work_dir, 5.0, ARGS)
    assert all(released(t) for t in tensors.values())

    first = agent.wake_here(ARGS, tagged("weights", "runtime"))
    assert agent.state is AgentState.ASLEEP
    assert first["restore"]["complete"] is False and "resume" not in first
    assert agent.guard.closed
    assert torch.equal(tensors["weights"], before["weights"])
    assert torch.equal(tensors["runtime"], before["runtime"])
    assert released(tensors["kv_cache"])

    second = agent.wake_here(ARGS, tagged("kv_cache"))
    assert agent.state is AgentState.RUNNING and not agent.guard.closed
    assert second["restore"]["complete"] is True and second["restore"]["total_bytes"] == 0
    assert torch.count_nonzero(tensors["kv_cache"]) == 0


def test_asking_again_for_what_is_already_back_changes_nothing(
    agent: Agent, tensors: dict[str, torch.Tensor], work_dir: Path
) -> None:
    agent.sleep_here(work_dir, 5.0, ARGS)
    agent.wake_here(ARGS, tagged("weights"))
    tensors["weights"].fill_(7.0)  # the program changed them since (an RL weight update)
    report = agent.wake_here(ARGS, tagged("weights"))
    assert report["restore"]["restored_regions"] == 0
    assert torch.all(tensors["weights"] == 7.0)
    agent.wake_here(ARGS)
    assert agent.state is AgentState.RUNNING and torch.all(tensors["weights"] == 7.0)


def test_a_failed_partial_restore_releases_only_its_own_regions(
    agent: Agent, tensors: dict[str, torch.Tensor], work_dir: Path
) -> None:
    agent.sleep_here(work_dir, 5.0, ARGS)
    agent.wake_here(ARGS, tagged("weights"))
    tensors["weights"].fill_(3.0)
    snapshot = Path(agent.status()["snapshot"]["path"])
    for data in snapshot.glob("data-*.bin"):
        data.write_bytes(b"\0" * data.stat().st_size)  # every chunk now fails its checksum

    with pytest.raises(SnapshotInvalidError):
        agent.wake_here(ARGS, tagged("runtime"))
    assert agent.state is AgentState.ASLEEP
    assert released(tensors["runtime"]) and released(tensors["kv_cache"])
    assert torch.all(tensors["weights"] == 3.0), "a region restored earlier must not be touched"


def test_a_full_restore_after_nothing_partial_is_the_plain_restore(
    agent: Agent, tensors: dict[str, torch.Tensor], work_dir: Path
) -> None:
    before = {k: v.clone() for k, v in tensors.items()}
    agent.sleep_here(work_dir, 5.0, ARGS)
    report = agent.wake_here(ARGS)
    assert report["restore"]["complete"] is True and "resume" in report
    assert agent.state is AgentState.RUNNING
    assert torch.equal(tensors["weights"], before["weights"])
    assert report["restore"]["zeroed_bytes"] == tensors["kv_cache"].nbytes


def test_a_driven_process_refuses_a_clients_sleep_but_sleeps_itself(
    agent: Agent, tensors: dict[str, torch.Tensor], work_dir: Path
) -> None:
    agent.sleep_driver = SleepDriver("vLLM", "POST /sleep to the server")
    client = Session("hibernate (pid 1)")
    agent.begin(client)
    try:
        with pytest.raises(UnsupportedError, match="put to sleep by vLLM"):
            agent.quiesce(client, 1.0)
        assert agent.state is AgentState.RUNNING and not agent.guard.closed
    finally:
        agent.end(client)
    agent.sleep_here(work_dir, 5.0, ARGS)
    assert agent.state is AgentState.ASLEEP
    agent.wake_here(ARGS)


# -- over the socket ----------------------------------------------------------------


@pytest.fixture
def served(agent: Agent, runtime_dir: Path) -> Iterator[AgentClient]:
    server = AgentServer(agent, runtime_dir)
    try:
        with AgentClient(server.path, timeout=10) as client:
            yield client
    finally:
        server.stop()


def test_configure_sets_where_the_process_spills_its_own_sleeps(
    agent: Agent, served: AgentClient, work_dir: Path
) -> None:
    status = served.call("configure", {"dir": str(work_dir)})
    assert status["default_dir"] == str(work_dir) and agent.default_dir == work_dir
    assert served.call("configure", {"dir": None})["default_dir"] is None
    with pytest.raises(UsageError, match="absolute path"):
        served.call("configure", {"dir": "relative/dir"})


def test_a_client_gets_the_drivers_hint_over_the_socket_and_nothing_changes(
    agent: Agent, tensors: dict[str, torch.Tensor], served: AgentClient
) -> None:
    agent.sleep_driver = SleepDriver("vLLM", "POST /sleep to the server")
    assert served.call("begin")["sleep_driver"] == "vLLM"
    with pytest.raises(UnsupportedError, match="put to sleep by vLLM") as caught:
        served.call("quiesce", {"timeout": 1})
    assert caught.value.hint == "POST /sleep to the server"
    assert served.call("status")["state"] == "running"
