"""The vLLM plugin against the real vLLM package: entry point, loader, factory, capability flags."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import vllm.plugins
from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

import hibernate.integrations.vllm as integration
from hibernate.agent.local import local_agent
from hibernate.integrations.vllm import HibernateBackend, register
from hibernate.pools.vllm import CuMemPool
from tests.standins.vllm_cumem import MODULE_NAME, make_module
from tests.standins.vllm_memory import HostReservations, StandInCuMemAllocator

REPO = Path(__file__).resolve().parent.parent
CONFIG: Any = SimpleNamespace(sleep_mode_backend="hibernate")  # what create_backend reads of ModelConfig


@pytest.fixture
def clean_vllm(monkeypatch: pytest.MonkeyPatch, fresh_agent: None) -> Iterator[None]:
    """vLLM's process-wide plugin state as in a fresh process; no agent socket, no fork hook here."""
    monkeypatch.setattr(SleepModeBackendFactory, "_registry", dict(SleepModeBackendFactory._registry))
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(integration, "_fork_hook_installed", True)  # never hook the test runner's forks
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    yield


@pytest.fixture
def usable_cumem(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's cumem module as a GPU worker has it (a stand-in: the real one cannot import here)."""
    monkeypatch.setitem(sys.modules, MODULE_NAME, make_module(HostReservations(), None))
    monkeypatch.setattr(StandInCuMemAllocator, "instance", None)
    yield


def test_vllms_loader_finds_our_entry_point(clean_vllm: None) -> None:
    plugins = vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    assert plugins["hibernate"] is register


def test_vllm_plugins_filters_us_in_and_out_by_name(
    clean_vllm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_PLUGINS", "someone-else")
    assert "hibernate" not in vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)
    monkeypatch.setenv("VLLM_PLUGINS", "someone-else,hibernate")
    assert "hibernate" in vllm.plugins.load_plugins_by_group(vllm.plugins.DEFAULT_PLUGINS_GROUP)


def test_loading_the_plugins_again_and_again_is_harmless(clean_vllm: None) -> None:
    vllm.plugins.load_general_plugins()
    vllm.plugins.plugins_loaded = False  # as in another process that inherited the registry
    vllm.plugins.load_general_plugins()
    register()
    assert SleepModeBackendFactory.get_backend_class("hibernate") is HibernateBackend
    agent = local_agent()
    assert agent.runtime == "vllm" and agent.status()["sleep_driver"] == "vLLM"
    assert isinstance(agent.pool(CuMemPool.name), CuMemPool)
    assert [p.name for p in agent._pools] == [CuMemPool.name]


def test_the_factory_creates_our_backend_where_the_cumem_allocator_is_usable(
    clean_vllm: None, usable_cumem: None
) -> None:
    vllm.plugins.load_general_plugins()
    backend = SleepModeBackendFactory.create_backend(CONFIG)
    assert isinstance(backend, HibernateBackend)
    assert backend.state() == "RUNNING"
    assert backend.pool is local_agent().pool(CuMemPool.name)  # the one register() gave the agent


def test_the_factory_refuses_our_backend_where_cumem_cannot_work(
    clean_vllm: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, MODULE_NAME, None)  # importing it fails, as without libcuda
    register()
    assert HibernateBackend.is_supported() is False
    with pytest.raises(ValueError, match="'hibernate' is not supported on this platform"):
        SleepModeBackendFactory.create_backend(CONFIG)


def test_the_capability_flags_say_what_survives() -> None:
    assert HibernateBackend.preserves_communicators()
    assert HibernateBackend.preserves_compiled_artifacts()
    assert HibernateBackend.preserves_graphs_with_communicators()
    assert not HibernateBackend.supports_durable_storage()


def test_register_does_not_stop_vllm_when_the_agent_cannot_start(
    clean_vllm: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise OSError("no runtime directory")

    monkeypatch.setattr(integration, "_process_agent", broken)
    with caplog.at_level(logging.WARNING, logger="vllm.hibernate"):
        register()
    assert SleepModeBackendFactory.get_backend_class("hibernate") is HibernateBackend
    assert "agent not started" in caplog.text


def test_without_its_control_socket_the_process_still_gets_an_agent_for_the_backend(
    fresh_agent: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import hibernate.agent.server

    def unbindable(*args: object) -> None:
        raise OSError(98, "Address already in use")

    monkeypatch.setenv("HIBERNATE_AGENT", "1")
    monkeypatch.setattr(hibernate.agent.server, "AgentServer", unbindable)
    with caplog.at_level(logging.WARNING, logger="vllm.hibernate"):
        agent = integration._process_agent()
    assert agent.runtime == "vllm" and isinstance(agent.pool(CuMemPool.name), CuMemPool)
    assert "control socket not started" in caplog.text


def test_register_leaves_a_backend_of_the_same_name_from_another_plugin_alone(
    clean_vllm: None, caplog: pytest.LogCaptureFixture
) -> None:
    SleepModeBackendFactory.register_backend(
        "hibernate", "vllm.device_allocator.sleep_mode_backend", "CuMemBackend"
    )
    with caplog.at_level(logging.ERROR, logger="vllm.hibernate"):
        register()
    assert SleepModeBackendFactory.get_backend_class("hibernate") is not HibernateBackend
    assert "another plugin registered" in caplog.text


def test_the_cli_imports_neither_torch_nor_vllm() -> None:
    probe = "import sys, hibernate.cli; print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True
    ).stdout
    assert out.strip() == "[]"
