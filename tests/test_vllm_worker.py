"""A stand-in vLLM worker process, seen and driven from outside like a real one.

The worker (tests/standins/vllm_worker.py) loads plugins with vLLM's own loader
and gets its backend from vLLM's own factory; the CLI here is the real one.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hibernate.agent.client import AgentClient
from hibernate.errors import ExitCode
from hibernate.operation.targets import find_agent
from tests.conftest import spill_root_of

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
STAGING_MB = 8


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[str]
    ready: dict[str, Any]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _line(self, timeout: float = 120) -> dict[str, Any]:
        assert self.proc.stdout is not None
        readable, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if readable else ""
        if not line:
            self.proc.kill()
            raise AssertionError(f"the worker did not answer:\n{self.log.read_text()}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, command: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        reply = self._line()
        assert reply["ok"], reply.get("trace") or reply
        return reply["result"]


@pytest.fixture
def start_worker(
    runtime_dir: Path, cudart_path: Path, work_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., WorkerProcess]]:
    started: list[WorkerProcess] = []

    def start(mb: int = 0) -> WorkerProcess:
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "HIBERNATE_DIR": str(work_dir),
            "HIBERNATE_BUFFER_MB": str(STAGING_MB),
            "HIBERNATE_CHUNK_MB": "2",
        }
        env.pop("VLLM_PLUGINS", None)
        env.pop("HIBERNATE_AGENT", None)
        log = tmp_path / f"worker{len(started)}.log"
        command = [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "tests.standins.vllm_worker",
            "--cudart",
            str(cudart_path),
        ]
        with open(log, "w") as stderr:
            proc = subprocess.Popen(
                [*command, "--mb", str(mb)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                cwd=REPO,
                env=env,
            )
        worker = WorkerProcess(proc, {}, log)
        started.append(worker)
        worker.ready = worker._line()
        return worker

    yield start
    for worker in started:
        if worker.proc.poll() is None:
            assert worker.proc.stdin is not None
            worker.proc.stdin.close()
            try:
                worker.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                worker.proc.kill()
                worker.proc.wait()


@pytest.mark.slow
def test_hibernate_ls_shows_the_worker_and_a_sleep_without_its_server_changes_nothing(
    start_worker: Callable[..., WorkerProcess], cli: Any, work_dir: Path
) -> None:
    worker = start_worker()
    assert worker.ready["backend"] == "HibernateBackend"
    assert worker.ready["backend_module"] == "hibernate.integrations.vllm"

    listed = cli("ls", "--json")
    assert listed.returncode == 0, listed.stderr
    entry = next(a for a in listed.json()["agents"] if a["pid"] == worker.pid)
    assert entry["kind"] == "vllm" and entry["sleep_driver"] == "vLLM" and entry["state"] == "running"
    assert entry["name"] == f"vllm-pid{worker.pid}" and entry["self_checkpoint"] is False
    pools = {(p["pool"], p["tag"]): p["keep"] for p in entry["pools"]}
    assert pools[("vllm-cumem", "weights")] is True
    assert pools[("vllm-cumem", "kv_cache")] is False
    assert {tag for _, tag in pools} == {
        "weights",
        "kv_cache",
        "runtime",
        "workspace",
        "cudagraph",
        "default",
    }

    # A vLLM process is put to sleep through its server's /sleep; with no server answering,
    # nothing is touched (the server's address is normally read from its command line).
    before = worker.ask("digests")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{probe.getsockname()[1]}"
    refused = cli("sleep", str(worker.pid), "--to", str(work_dir), "--vllm-url", nobody)
    assert refused.returncode == ExitCode.USAGE, refused.stderr
    assert f"no server answers at {nobody} (--vllm-url)" in refused.stderr
    assert worker.ask("digests") == before
    status = cli("status", str(worker.pid), "--json").json()["agents"][0]
    assert status["state"] == "running" and status["default_dir"] is None and status["interrupted"] is None


@pytest.mark.slow
def test_a_sleep_through_the_backend_spills_where_a_client_configured_and_wakes_in_two_steps(
    start_worker: Callable[..., WorkerProcess], cli: Any, tmp_path: Path
) -> None:
    worker = start_worker()
    before = worker.ask("digests")
    configured = tmp_path / "configured"
    ref = find_agent(worker.pid)
    assert ref is not None
    with AgentClient(ref.socket) as client:
        assert client.call("configure", {"dir": str(configured)})["default_dir"] == str(configured)

    assert worker.ask("suspend 1")["state"] == "SUSPENDED"
    status = cli("status", str(worker.pid), "--json").json()["agents"][0]
    assert status["state"] == "asleep"
    snapshot = Path(status["snapshot"]["path"])
    assert snapshot.parent == spill_root_of(configured, worker.pid, f"vllm-pid{worker.pid}")
    assert all(entry["asleep"] for entry in worker.ask("digests").values())

    assert worker.ask("resume weights")["state"] == "SUSPENDED"
    partly = worker.ask("digests")
    assert {e["tag"] for e in partly.values() if e["asleep"]} == {"kv_cache"}
    assert cli("status", str(worker.pid), "--json").json()["agents"][0]["state"] == "asleep"

    assert worker.ask("resume kv_cache")["state"] == "RUNNING"
    after = worker.ask("digests")
    for address, entry in before.items():
        if entry["tag"] in ("kv_cache", "workspace"):
            assert after[address]["zero"], address
        else:
            assert after[address]["digest"] == entry["digest"], address
    assert cli("status", str(worker.pid), "--json").json()["agents"][0]["state"] == "running"


@pytest.mark.slow
def test_sleep_and_wake_of_a_pool_far_larger_than_the_staging_budget_stay_within_it(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    worker = start_worker(mb=256)
    pool = worker.ready["pool_bytes"]
    assert pool > 30 * STAGING_MB * MIB
    baseline_peak = worker.ready["memory"]["peak"]  # the pool itself, filled, plus the interpreter

    asleep = worker.ask("suspend 1")
    memory = worker.ask("memory")
    assert worker.ready["memory"]["rss"] - memory["rss"] >= 0.9 * pool, "the pool's memory was not given back"
    woken = worker.ask("resume")
    assert woken["state"] == "RUNNING"

    # A host copy of even the largest allocation (128 MiB) would show; bounded staging must not.
    slack = 24 * MIB
    assert asleep["peak_after"] - baseline_peak <= 2 * STAGING_MB * MIB + slack, asleep
    assert woken["peak_after"] - baseline_peak <= 2 * STAGING_MB * MIB + slack, woken


@pytest.mark.slow
def test_a_process_forked_after_the_plugins_loaded_answers_for_itself(
    start_worker: Callable[..., WorkerProcess],
) -> None:
    worker = start_worker()
    child = worker.ask("fork")
    assert child["pid"] != worker.pid
    assert child["agent_pid"] == child["pid"]
    assert child["kind"] == "vllm" and set(child["pools"]) == {"vllm-cumem"}
    assert child["socket"] and str(child["pid"]) in child["socket"]
