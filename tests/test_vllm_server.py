"""``hibernate sleep/wake/recover`` on a vLLM server, end to end: the real CLI, a stand-in server.

The server (tests/standins/vllm_server.py) serves vLLM 0.33's sleep endpoints
with vLLM's semantics over real stand-in worker processes (vLLM's plugin
loader, hibernate's backend from vLLM's factory, real AllocationData over host
memory). The workers are registered with the stand-in NVIDIA driver, so the
CUDA stage runs for real, and their fake CUDA runtime blocks (and counts) any
device call made while they are locked or checkpointed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from hibernate import faults, orchestrator, procinfo
from hibernate.agent.client import AgentClient
from hibernate.checkpoint.nccl import VLLM_SAFE
from hibernate.errors import ExitCode
from hibernate.flows.vllm import VllmServerUnit
from hibernate.integrations.vllm_distributed import PREPARED_REFUSAL
from hibernate.operation import targets
from hibernate.operation.engine import sleep_points, wake_points
from tests.conftest import free_port, spill_root_of, wait_until
from tests.standins.vllm_parallel_state import (
    COMM_RESUME_STEP,
    COMM_SUSPEND_FAULT,
    COMM_SUSPEND_STEP,
    PREPARE_STEP,
    RESTORE_STEP,
)
from tests.standins.world import GIB, World

VLLM_SLEEP_POINTS = sleep_points(VllmServerUnit)
VLLM_WAKE_POINTS = wake_points(VllmServerUnit)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private HIBERNATE_RUNTIME_DIR on tmpfs where there is one, as $XDG_RUNTIME_DIR is.

    Every journal step is an fsync (two per process and phase); on this suite's
    disks one costs tens of milliseconds, on tmpfs nothing. The code is the same.
    """
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None
    path = Path(tempfile.mkdtemp(prefix="hb-run-", dir=base or "/tmp"))
    run = path / "run"
    monkeypatch.setenv("HIBERNATE_RUNTIME_DIR", str(run))
    yield run
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class FakeServer:
    proc: subprocess.Popen[bytes]
    port: int
    ready: dict[str, Any]
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def workers(self) -> list[int]:
        return list(self.ready["workers"])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(self, method: str, path: str, timeout: float = 60) -> tuple[int, Any]:
        req = urllib.request.Request(self.url + path, method=method, data=b"" if method == "POST" else None)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as answer:
                return answer.status, json.loads(answer.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")

    def is_sleeping(self) -> bool:
        status, body = self.request("GET", "/is_sleeping")
        assert status == 200, body
        return bool(body["is_sleeping"])

    def workers_info(self) -> list[dict[str, Any]]:
        status, body = self.request("GET", "/standin/workers")
        assert status == 200, body
        return list(body)

    def digests(self) -> dict[int, dict[str, Any]]:
        return {w["pid"]: w["digests"] for w in self.workers_info()}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture
def start_server(
    world: World, runtime_dir: Path, cudart_path: Path, work_dir: Path, tmp_path: Path
) -> Iterator[Callable[..., FakeServer]]:
    """Start the stand-in server; its workers are registered with the stand-in driver (2 GiB each)."""
    started: list[FakeServer] = []

    def start(
        workers: int = 2, dev: bool = True, env: dict[str, str] | None = None, args: tuple[str, ...] = ()
    ) -> FakeServer:
        index = len(started)
        ready = tmp_path / f"server{index}.json"
        log = tmp_path / f"server{index}.log"
        port = free_port()
        environment = dict(os.environ)
        for name in ("VLLM_PLUGINS", "HIBERNATE_AGENT", "HIBERNATE_DIR", faults.ENV, faults.TRACE_ENV):
            environment.pop(name, None)
        environment.update(
            {
                "PYTHONPATH": str(REPO),
                "HIBERNATE_BUFFER_MB": "8",
                "HIBERNATE_CHUNK_MB": "2",
                "VLLM_SERVER_DEV_MODE": "1" if dev else "0",
                **VLLM_SAFE,  # as a multi-GPU server must run for a checkpoint (the refusal says so)
                **(env or {}),
            }
        )
        command = [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "tests.standins.vllm_server",
            "--cudart",
            str(cudart_path),
            "--workers",
            str(workers),
            "--ready",
            str(ready),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--enable-sleep-mode",
            "--sleep-mode-backend",
            "hibernate",
            *args,
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=environment)
        try:
            wait_until(
                ready.exists, 120, "the stand-in server to start", 0.05, process=proc, detail=log.read_text
            )
        except AssertionError:
            proc.kill()
            raise
        server = FakeServer(proc, port, json.loads(ready.read_text()), log)
        started.append(server)
        for pid in server.workers:
            world.register(pid, nbytes=2 * GIB)
        return server

    yield start
    for server in started:
        server.stop()


SCHEMAS = REPO / "docs" / "json-schema"
DRIVER_STEPS = ("lock", "checkpoint", "restore", "unlock")
VLLM_STEPS = (PREPARE_STEP, RESTORE_STEP)  # the stand-in parallel_state's collectives, in the same log
COMM_STEPS = (COMM_SUSPEND_STEP, COMM_RESUME_STEP)  # vLLM's own, with --enable-nccl-comm-suspend


def valid(name: str, document: dict[str, Any]) -> dict[str, Any]:
    """``document`` after checking it against the published schema of its command."""
    schema = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    problems = [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(document)]
    assert problems == [], problems
    return document


def agents(cli: Callable[..., Any], pid: int) -> dict[int, dict[str, Any]]:
    """What `hibernate status PID --json` lists, asked in this process (quicker than a command)."""
    return {a["pid"]: a for a in orchestrator.status([pid])}


def states(cli: Callable[..., Any], server: FakeServer) -> list[str]:
    found = agents(cli, server.pid)
    return [found[pid]["state"] for pid in server.workers]


def nothing_left_to_clean(runtime_dir: Path) -> None:
    journal = runtime_dir / "journal"
    assert not (journal.exists() and any(journal.iterdir())), list(journal.iterdir())


def assert_back_as_before(server: FakeServer, before: dict[int, dict[str, Any]], how: str = "") -> None:
    """Every allocation at its address again: kept tags byte for byte, dropped ones zero."""
    after = server.digests()
    assert set(after) == set(before), how
    for pid, allocations in before.items():
        assert set(after[pid]) == set(allocations), f"{how}: addresses changed in {pid}"
        for address, entry in allocations.items():
            now = after[pid][address]
            assert not now["asleep"], f"{how}: {pid} {address} still asleep"
            if entry["tag"] in ("kv_cache", "workspace"):
                assert now["zero"] or now["digest"] == entry["digest"], f"{how}: {pid} {address}"
            else:
                assert now["digest"] == entry["digest"], f"{how}: {pid} {address} {entry['tag']} differs"


def awake_and_whole(
    cli: Callable[..., Any], server: FakeServer, world: World, before: dict[int, Any], how: str
) -> None:
    assert states(cli, server) == ["running"] * len(server.workers), how
    assert [world.state(pid) for pid in server.workers] == ["running"] * len(server.workers), how
    assert not server.is_sleeping(), how
    assert_back_as_before(server, before, how)
    assert all(w["cuda"]["calls_while_suspended"] == 0 for w in server.workers_info()), how


def test_vllm_steps_have_fault_points() -> None:
    """The vLLM flow's declared steps give its fault points (and its journal phases)."""
    assert VLLM_SLEEP_POINTS == [
        "sleep.after-lock",
        "sleep.after-connect",
        "sleep.after-leases",
        "sleep.after-configure",
        "sleep.after-drain",
        "sleep.during-vllm-sleep",
        "sleep.after-vllm-sleep",
        "sleep.after-cuda-lock",
        "sleep.after-cuda",
    ]
    assert VLLM_WAKE_POINTS == [
        "wake.after-lock",
        "wake.after-connect",
        "wake.after-cuda-restore",
        "wake.after-cuda",
        "wake.during-vllm-wake",
        "wake.after-vllm-wake",
    ]


@pytest.mark.slow
def test_sleep_and_wake_through_the_servers_own_endpoints(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
    tmp_path: Path,
) -> None:
    server = start_server(workers=2)
    before = server.digests()
    trace = tmp_path / "trace"
    env = {faults.TRACE_ENV: str(trace)}

    # Any pid of the tree names the server: here its second worker.
    asleep = cli("sleep", str(server.workers[1]), "--to", str(work_dir), "--json", env=env)
    assert asleep.returncode == 0, asleep.stderr
    report = valid("sleep", asleep.json())
    vllm = report["vllm"]
    assert vllm["server_pid"] == server.pid and vllm["url"] == server.url
    assert f"--port {server.port}" in vllm["url_from"] and f"pid {server.pid}" in vllm["url_from"]
    assert (vllm["level"], vllm["mode"]) == (1, "wait") and vllm["workers"] == server.workers
    assert vllm["response"] == {"status": "sleeping", "level": 1}
    assert [p["pid"] for p in report["processes"]] == server.workers
    for rank, entry in enumerate(report["processes"]):
        snapshot = Path(entry["snapshot"])
        assert snapshot.parent == spill_root_of(work_dir, entry["pid"], f"vllm-rank{rank}-pid{entry['pid']}")
        assert entry["written_bytes"] > 0 and entry["released_bytes"] > entry["total_bytes"]
        assert set(entry["phases"]) == {"quiesce", "spill", "release"}
    cuda = report["cuda"]
    assert cuda["status"] == "checkpointed"
    assert [(p["pid"], p["state"]) for p in cuda["processes"]] == [
        (p, "checkpointed") for p in server.workers
    ]
    assert [world.state(pid) for pid in server.workers] == ["checkpointed", "checkpointed"]
    assert [s for _, s, _, _ in world.calls()] == ["lock", "lock", "checkpoint", "checkpoint"]
    # Every worker tore down its workspaces shared across GPUs (a collective) before the checkpoint.
    with_vllm = world.calls((*DRIVER_STEPS, *VLLM_STEPS))
    assert [s for _, s, _, _ in with_vllm[:2]] == ["vllm-prepare", "vllm-prepare"]
    assert sorted(p for _, _, p, _ in with_vllm[:2]) == sorted(server.workers)
    assert server.is_sleeping() and states(cli, server) == ["asleep", "asleep"]
    assert all(e["asleep"] for d in server.digests().values() for e in d.values())
    nothing_left_to_clean(runtime_dir)

    woken = cli("wake", str(server.pid), "--json", env=env)
    assert woken.returncode == 0, woken.stderr
    report = valid("wake", woken.json())
    assert report["cuda"]["status"] == "restored"
    assert report["vllm"]["response"] == {"status": "awake", "tags": None}
    assert report["vllm"]["woken_directly"] == []
    assert [p["pid"] for p in report["processes"]] == server.workers
    assert all(p["restored_bytes"] > 0 and p["zeroed_bytes"] > 0 for p in report["processes"])
    assert [s for _, s, _, _ in world.calls()][4:] == ["restore", "restore", "unlock", "unlock"]
    # ... and built them again once the CUDA state was back.
    with_vllm = world.calls((*DRIVER_STEPS, *VLLM_STEPS))
    assert [s for _, s, _, _ in with_vllm[6:]] == [
        "restore",
        "restore",
        "unlock",
        "unlock",
        RESTORE_STEP,
        RESTORE_STEP,
    ]
    assert sorted(p for _, _, p, _ in with_vllm[10:]) == sorted(server.workers)
    awake_and_whole(cli, server, world, before, "after the wake")
    assert trace.read_text().split() == [*VLLM_SLEEP_POINTS, *VLLM_WAKE_POINTS]
    nothing_left_to_clean(runtime_dir)

    human = cli("sleep", str(server.pid), "--to", str(work_dir), "--level", "2", "--drain", "abort")
    assert human.returncode == 0, human.stderr
    assert f"vllm: server pid {server.pid} at {server.url}" in human.stdout
    assert "level 2, drain abort" in human.stdout
    assert cli("wake", str(server.pid), "-q").returncode == 0
    assert states(cli, server) == ["running", "running"] and not server.is_sleeping()


@pytest.mark.slow
def test_a_server_without_its_development_endpoints_is_refused_with_how_to_start_it(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    server = start_server(workers=1, dev=False)
    refused = cli("sleep", str(server.pid), "--to", str(work_dir))
    assert refused.returncode == ExitCode.UNSUPPORTED, refused.stderr
    assert "does not serve GET /is_sleeping (404)" in refused.stderr
    assert "VLLM_SERVER_DEV_MODE=1" in refused.stderr
    assert "--enable-sleep-mode --sleep-mode-backend hibernate" in refused.stderr
    found = agents(cli, server.pid)
    assert [found[pid]["state"] for pid in server.workers] == ["running"]
    assert all(a["default_dir"] is None for a in found.values()), "the workers were not told anything"
    assert world.state(server.workers[0]) == "running" and world.calls() == []
    nothing_left_to_clean(runtime_dir)

    # Bad input is refused before anything is touched, each with its exit code.
    wrong = cli(
        "sleep", str(server.pid), "--to", str(work_dir), "--vllm-url", f"http://127.0.0.1:{free_port()}"
    )
    assert wrong.returncode == ExitCode.USAGE and "no server answers at" in wrong.stderr, wrong.stderr
    assert "pass the server's address with --vllm-url" in wrong.stderr
    level = cli("sleep", str(server.pid), "--to", str(work_dir), "--level", "0")
    assert level.returncode == ExitCode.USAGE and "--level must be 1 or 2" in level.stderr
    drain = cli("sleep", str(server.pid), "--to", str(work_dir), "--drain", "keep")
    assert drain.returncode == ExitCode.USAGE and "--drain must be wait or abort" in drain.stderr
    not_http = cli("wake", str(server.pid), "--vllm-url", "ftp://x")
    assert not_http.returncode == ExitCode.USAGE and "is not an http(s) URL" in not_http.stderr
    assert world.calls() == [] and server.request("GET", "/health")[0] == 200
    nothing_left_to_clean(runtime_dir)


@pytest.mark.slow
def test_a_failing_sleep_is_undone_and_a_server_dying_mid_sleep_leaves_nothing_asleep(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    server = start_server(workers=2)
    before = server.digests()
    # The second worker's sleep fails once its pools are spilled; the first one's succeeds.
    assert server.request("POST", "/standin/worker-fault?index=1&spec=agent.release")[0] == 200
    failed = cli("sleep", str(server.pid), "--to", str(work_dir), "--json")
    assert failed.returncode == ExitCode.SERVER_FAILED, failed.stderr
    error = valid("error", failed.json())["error"]
    assert error["exit_name"] == "SERVER_FAILED"
    assert f"vLLM server {server.pid} (vllm-sleep)" in error["message"]
    assert "HTTP 500: Call to sleep method failed" in error["message"]
    assert "fault injected at agent.release" in error["message"]
    # vLLM's executor never recorded the sleep, so /wake_up would not have woken worker 0:
    # hibernate woke it through its agent, then let scheduling resume.
    awake_and_whole(cli, server, world, before, "after the undo")
    assert world.calls() == [], "the CUDA state was never touched"
    found = agents(cli, server.pid)
    assert all(found[pid]["default_dir"] is None for pid in server.workers), "the spill directory was reset"
    nothing_left_to_clean(runtime_dir)

    # The server dies once its first worker has slept.
    workers = [procinfo.identity(pid) for pid in server.workers]
    assert server.request("POST", "/standin/worker-fault?index=1&spec=-")[0] == 200
    assert server.request("POST", "/standin/die-during-sleep")[0] == 200
    result = cli("sleep", str(server.pid), "--to", str(work_dir))
    assert result.returncode == ExitCode.NO_SUCH_PROCESS, result.stderr
    assert f"the vLLM server (pid {server.pid}) exited during POST /sleep?level=1&mode=wait" in result.stderr
    server.proc.wait(timeout=10)
    assert world.calls() == []
    # Its workers end with it (as vLLM's do); none is left asleep behind anyone's back.
    wait_until(
        lambda: not any(ident is not None and procinfo.is_alive(ident) for ident in workers),
        120,
        "the workers to end with their server",
        0.1,
    )
    assert cli("ls", "--json").json()["agents"] == []
    nothing_left_to_clean(runtime_dir)


def test_with_vllms_own_comm_suspend_the_workspaces_are_taken_down_and_up_once(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
) -> None:
    """--enable-nccl-comm-suspend: vLLM's Worker.sleep tears the workspaces down after the backend, and
    Worker.wake_up builds them after it; the backend does not do it a second time."""
    server = start_server(workers=2, args=("--enable-nccl-comm-suspend",))
    before = server.digests()
    asleep = cli("sleep", str(server.pid), "--to", str(work_dir))
    assert asleep.returncode == 0, asleep.stderr
    woken = cli("wake", str(server.pid))
    assert woken.returncode == 0, woken.stderr
    steps = [s for _, s, _, _ in world.calls((*DRIVER_STEPS, *VLLM_STEPS, *COMM_STEPS))]
    assert steps == [
        *[COMM_SUSPEND_STEP] * 2,
        *["lock", "lock", "checkpoint", "checkpoint", "restore", "restore", "unlock", "unlock"],
        *[COMM_RESUME_STEP] * 2,
    ]
    awake_and_whole(cli, server, world, before, "after sleep and wake with comm suspend")


def test_a_worker_whose_communicators_are_torn_down_is_not_woken_behind_vllms_back(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
) -> None:
    """Every worker slept and tore its workspaces down, then vLLM counts the sleep as failed (one
    worker's comm suspend fails after it): vLLM will not wake them, and woken through their agents they
    would serve without workspaces. So they stay asleep, scheduling stays paused, and the error says
    to restart the server."""
    server = start_server(workers=2, args=("--enable-nccl-comm-suspend",))
    assert server.request("POST", f"/standin/worker-fault?index=0&spec={COMM_SUSPEND_FAULT}")[0] == 200
    failed = cli("sleep", str(server.pid), "--to", str(work_dir), "--json")
    assert failed.returncode == ExitCode.NEEDS_RECOVERY, failed.stderr
    error = valid("error", failed.json())["error"]
    assert "HTTP 500: Call to sleep method failed" in error["message"]
    assert f"fault injected at {COMM_SUSPEND_FAULT}" in error["message"]
    assert "undoing it failed too" in error["message"] and PREPARED_REFUSAL in error["message"]
    assert "the server's scheduling stays paused" in error["message"]
    assert error["hint"] == "restart the vLLM server"
    assert states(cli, server) == ["asleep", "asleep"] and server.is_sleeping()
    assert world.calls() == [], "the CUDA state was never touched"


def test_an_interrupted_sleep_of_workers_with_peers_is_woken_by_vllm_which_rebuilds_first(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
) -> None:
    """The CLI dies while the server sleeps; the server finishes, its workers' workspaces torn down. The
    wake that follows leaves them to vLLM's /wake_up (which rebuilds them, then maps the memory), not
    to their agents (which refuse)."""
    server = start_server(workers=2)
    before = server.digests()
    killed = cli(
        "sleep",
        str(server.pid),
        "--to",
        str(work_dir),
        "-q",
        env={faults.ENV: "sleep.during-vllm-sleep:kill"},
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    wait_until(
        lambda: states(cli, server) == ["asleep", "asleep"], 60, "the server to finish its sleep", 0.05
    )
    woken = cli("wake", str(server.pid), "--json")
    assert woken.returncode == 0, woken.stderr
    assert woken.json()["vllm"]["woken_directly"] == []
    steps = [s for _, s, _, _ in world.calls(VLLM_STEPS)]
    assert steps == [PREPARE_STEP, PREPARE_STEP, RESTORE_STEP, RESTORE_STEP]
    awake_and_whole(cli, server, world, before, "after the wake")


@pytest.mark.slow
def test_timeouts_a_drain_is_called_off_abort_does_not_wait_a_hung_sleep_is_left_to_recover(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    server = start_server(workers=1)
    before = server.digests()
    assert server.request("POST", "/standin/busy?requests=1")[0] == 200  # a request that never finishes
    timed_out = cli("sleep", str(server.pid), "--to", str(work_dir), "--timeout", "1")
    assert timed_out.returncode == ExitCode.TIMEOUT, timed_out.stderr
    assert "did not answer POST /sleep?level=0&mode=wait within 1s" in timed_out.stderr
    assert f"vLLM server {server.pid} (drain)" in timed_out.stderr
    awake_and_whole(cli, server, world, before, "after the drain timed out")  # scheduling resumed
    assert world.calls() == []
    nothing_left_to_clean(runtime_dir)

    aborted = cli(
        "sleep", str(server.pid), "--to", str(work_dir), "--timeout", "1", "--drain", "abort", "--json"
    )
    assert aborted.returncode == 0, aborted.stderr
    assert aborted.json()["vllm"]["mode"] == "abort" and server.is_sleeping()
    assert cli("wake", str(server.pid), "-q").returncode == 0
    awake_and_whole(cli, server, world, before, "after abort, sleep and wake")

    # A worker whose sleep hangs: given up after --timeout (at least 5 s) without progress; the
    # server still carries the sleep out, so nothing is undone behind its back and the journal
    # says how to finish.
    worker = server.workers[0]
    world.clear_calls()
    assert server.request("POST", "/standin/worker-fault?index=0&spec=agent.spill:hang")[0] == 200
    started = time.monotonic()
    hung = cli("sleep", str(server.pid), "--to", str(work_dir), "--timeout", "1")
    assert hung.returncode == ExitCode.TIMEOUT, hung.stderr
    assert 5 <= time.monotonic() - started < 30
    assert "showed no progress on POST /sleep?level=1&mode=wait for 5s" in hung.stderr
    assert "the server is still carrying out the sleep, so nothing was undone" in hung.stderr
    assert f"`hibernate recover {server.pid}`" in hung.stderr
    interrupted = agents(cli, server.pid)[worker]["interrupted"]
    assert interrupted is not None and interrupted["resolve"] == f"hibernate recover {worker}"
    assert world.calls() == []


@pytest.mark.slow
def test_every_vllm_point_failing_is_undone_and_the_cli_killed_there_is_recovered(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    server = start_server(workers=1)
    before = server.digests()
    pid = str(server.pid)
    for point in VLLM_SLEEP_POINTS:
        result = cli("sleep", str(server.pid), "--to", str(work_dir), "-q", env={faults.ENV: point})
        assert result.returncode == ExitCode.FAILURE, f"{point}: {result.stderr}"
        assert f"fault injected at {point}" in result.stderr, point
        awake_and_whole(cli, server, world, before, point)
        nothing_left_to_clean(runtime_dir)

    def resolve(point: str) -> None:
        info = agents(cli, server.pid)[server.workers[0]]["interrupted"]
        assert info is not None and info["resolve"] == f"hibernate recover {server.workers[0]}", (point, info)
        recovered = cli("recover", pid, "--json")
        assert recovered.returncode == 0, f"{point}: {recovered.stderr}"
        if set(states(cli, server)) == {"asleep"}:  # recover finished the sleep: wake it for real
            assert recovered.json()["action"] in (
                "finished the interrupted sleep",
                "the interrupted sleep had completed",
            ), point
            assert {world.state(p) for p in server.workers} == {"checkpointed"}, point
            woken = cli("wake", pid, "-q")
            assert woken.returncode == 0, f"{point}: {woken.stderr}"
        awake_and_whole(cli, server, world, before, point)
        nothing_left_to_clean(runtime_dir)
        assert agents(cli, server.pid)[server.workers[0]]["interrupted"] is None, point

    for point in VLLM_SLEEP_POINTS:
        killed = cli("sleep", pid, "--to", str(work_dir), "-q", env={faults.ENV: f"{point}:kill"})
        assert killed.returncode == -signal.SIGKILL, f"{point}: {killed.returncode} {killed.stderr}"
        resolve(point)
    for point in VLLM_WAKE_POINTS:
        assert cli("sleep", pid, "--to", str(work_dir), "-q").returncode == 0
        killed = cli("wake", pid, "-q", env={faults.ENV: f"{point}:kill"})
        assert killed.returncode == -signal.SIGKILL, f"{point}: {killed.returncode} {killed.stderr}"
        resolve(point)


@pytest.mark.slow
def test_self_checkpoint_through_plain_sleep_and_wake_up(
    world: World,
    start_server: Callable[..., FakeServer],
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    server = start_server(workers=2, env={"HIBERNATE_SELF_CHECKPOINT": "1", "HIBERNATE_DIR": str(work_dir)})
    before = server.digests()
    found = agents(cli, server.pid)
    assert all(found[pid]["self_checkpoint"] for pid in server.workers)

    # Plain vLLM: no hibernate command at all.
    assert server.request("POST", "/sleep?level=1&mode=abort") == (200, {"status": "sleeping", "level": 1})
    # The checkpoint follows the answer: wait for it (and its log lines).
    wait_until(
        lambda: (
            [world.state(pid) for pid in server.workers] == ["checkpointed", "checkpointed"]
            and len(world.calls()) >= 4
        ),
        30,
        "both workers to checkpoint themselves",
        0.05,
        detail=lambda: ([world.state(pid) for pid in server.workers], world.calls()),
    )
    assert sorted((s, p) for _, s, p, _ in world.calls()) == sorted(
        [("lock", p) for p in server.workers] + [("checkpoint", p) for p in server.workers]
    )
    assert states(cli, server) == ["asleep", "asleep"] and server.is_sleeping()
    # vLLM's own device calls after suspend ran before the lock: nothing waited on it.
    info = server.workers_info()
    assert all(w["cuda"]["calls_while_suspended"] == 0 and w["cuda"]["synchronizations"] > 0 for w in info)

    assert server.request("POST", "/wake_up") == (200, {"status": "awake", "tags": None})
    assert [world.state(pid) for pid in server.workers] == ["running", "running"]
    # Each worker restored and unlocked itself before touching its memory.
    assert sorted((s, p) for _, s, p, _ in world.calls()[4:]) == sorted(
        [("restore", p) for p in server.workers] + [("unlock", p) for p in server.workers]
    )
    # Each tore down its workspaces shared across GPUs before its checkpoint, and built them after.
    for pid in server.workers:
        steps = [s for _, s, p, _ in world.calls((*DRIVER_STEPS, *VLLM_STEPS)) if p == pid]
        assert steps == [PREPARE_STEP, "lock", "checkpoint", "restore", "unlock", RESTORE_STEP], (pid, steps)
    awake_and_whole(cli, server, world, before, "after plain /sleep and /wake_up")

    # `hibernate sleep` on such a server leaves the CUDA stage to the workers and waits for it.
    asleep = cli("sleep", str(server.pid), "--to", str(work_dir), "--json")
    assert asleep.returncode == 0, asleep.stderr
    cuda = valid("sleep", asleep.json())["cuda"]
    assert cuda["status"] == "checkpointed (by the workers themselves)"
    assert [(p["pid"], p["by"]) for p in cuda["processes"]] == [(p, "itself") for p in server.workers]
    assert [world.state(pid) for pid in server.workers] == ["checkpointed", "checkpointed"]
    woken = cli("wake", str(server.pid), "-q")
    assert woken.returncode == 0, woken.stderr
    awake_and_whole(cli, server, world, before, "after hibernate sleep and wake")
    nothing_left_to_clean(runtime_dir)


@pytest.mark.slow
def test_sleep_all_skips_a_vllm_server_already_asleep_and_sleeps_the_rest(
    world: World,
    start_server: Callable[..., FakeServer],
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
) -> None:
    """--all with a sleeping vLLM server beside another target: the server is skipped, as a whole
    (its API process holds no pools and stays running), and the other target is put to sleep."""
    server = start_server(workers=2)
    assert cli("sleep", str(server.pid), "--to", str(work_dir), "-q").returncode == 0
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]

    asleep = cli("sleep", "--all", "--to", str(work_dir), "--json")
    assert asleep.returncode == 0, asleep.stderr
    report = valid("sleep", asleep.json())
    assert [p["pid"] for p in report["processes"]] == [demo.pid] and "vllm" not in report
    assert sorted(s["pid"] for s in report["skipped"]) == sorted(server.workers)
    assert server.is_sleeping() and states(cli, server) == ["asleep", "asleep"]

    again = cli("sleep", "--all", "--to", str(work_dir), "--json")
    assert again.returncode == ExitCode.WRONG_STATE, again.stderr
    assert again.json()["error"]["message"].startswith("nothing to put to sleep: ")

    assert cli("wake", str(demo.pid), "-q").returncode == 0
    assert cli("wake", str(server.pid), "-q").returncode == 0
    assert demo.infer()["digest"] == reference and not server.is_sleeping()


def selection_args(how: str, first: FakeServer, second: FakeServer, demo: Any, job: str) -> list[str]:
    """Three ways to name the same targets: pids (any pid of a server), every agent, a Slurm job."""
    return {
        "pids": [str(first.pid), str(second.workers[0]), str(demo.pid)],
        "all": ["--all"],
        "job": ["--job", job],
    }[how]


def all_three_awake_and_whole(
    cli: Callable[..., Any],
    world: World,
    servers: tuple[FakeServer, FakeServer],
    demo: Any,
    before: Any,
    how: str,
) -> None:
    """Both servers serving with every allocation as before, and the trainer's output as before."""
    for name, server in zip(("first", "second"), servers, strict=True):
        awake_and_whole(cli, server, world, before[server.pid], f"{how}: {name} server")
    assert agents(cli, demo.pid)[demo.pid]["state"] == "running"
    assert demo.infer()["digest"] == before["demo"] and world.state(demo.pid) == "running"


def as_before(first: FakeServer, second: FakeServer, demo: Any) -> dict[Any, Any]:
    return {first.pid: first.digests(), second.pid: second.digests(), "demo": demo.infer()["digest"]}


@pytest.fixture
def two_servers_and_a_trainer(
    world: World, start_server: Callable[..., FakeServer], start_demo: Callable[..., Any]
) -> Callable[[str], tuple[FakeServer, FakeServer, Any, str]]:
    def start(how: str) -> tuple[FakeServer, FakeServer, Any, str]:
        job = str(700000 + os.getpid() % 100000)
        env = {"SLURM_JOB_ID": job} if how == "job" else None
        first = start_server(workers=2, env=env)
        second = start_server(workers=1, env=env)
        demo = start_demo(size_mb=16, env=env)
        world.register(demo.pid, nbytes=GIB)
        return first, second, demo, job

    return start


@pytest.mark.slow
@pytest.mark.parametrize("how", ["pids", "all", "job"])
def test_two_servers_and_a_plain_agent_sleep_and_wake_as_one(
    how: str,
    two_servers_and_a_trainer: Callable[[str], tuple[FakeServer, FakeServer, Any, str]],
    world: World,
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    first, second, demo, job = two_servers_and_a_trainer(how)
    before = as_before(first, second, demo)
    holders = sorted([*first.workers, *second.workers, demo.pid])
    targets = selection_args(how, first, second, demo, job)

    asleep = cli("sleep", *targets, "--to", str(work_dir), "--json")
    assert asleep.returncode == 0, asleep.stderr
    report = valid("sleep", asleep.json())
    assert sorted(p["pid"] for p in report["processes"]) == holders
    assert sorted(s["server_pid"] for s in report["vllm_all"]) == sorted([first.pid, second.pid])
    assert "vllm" not in report  # one object only when one server took part
    assert first.is_sleeping() and second.is_sleeping()
    assert states(cli, first) == ["asleep"] * 2 and states(cli, second) == ["asleep"]
    assert agents(cli, demo.pid)[demo.pid]["state"] == "asleep"
    # One CUDA stage over every holder of every target: every lock before any checkpoint.
    steps = [step for _, step, _, _ in world.calls(("lock", "checkpoint"))]
    assert steps == ["lock"] * len(holders) + ["checkpoint"] * len(holders)
    assert [world.state(pid) for pid in holders] == ["checkpointed"] * len(holders)
    nothing_left_to_clean(runtime_dir)

    woken = cli("wake", *targets, "--json")
    assert woken.returncode == 0, woken.stderr
    report = valid("wake", woken.json())
    assert sorted(p["pid"] for p in report["processes"]) == holders
    all_three_awake_and_whole(cli, world, (first, second), demo, before, how)
    nothing_left_to_clean(runtime_dir)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["job"])  # the engine does not know how targets were named (see above)
def test_a_failure_in_the_second_servers_drain_leaves_all_three_running_and_a_kill_is_recovered(
    how: str,
    two_servers_and_a_trainer: Callable[[str], tuple[FakeServer, FakeServer, Any, str]],
    world: World,
    cli: Callable[..., Any],
    work_dir: Path,
    runtime_dir: Path,
) -> None:
    """The trainer and the first server were asleep when the second failed: all are undone. Killed
    later, after every memory step, the same command is finished by `hibernate recover`."""
    first, second, demo, job = two_servers_and_a_trainer(how)
    before = as_before(first, second, demo)
    targets = selection_args(how, first, second, demo, job)

    failed = cli(
        "sleep", *targets, "--to", str(work_dir), "--json", env={faults.ENV: "sleep.after-drain#2"}
    )  # fmt: skip
    assert failed.returncode == ExitCode.FAILURE, failed.stderr
    message = failed.json()["error"]["message"]
    second_root = max(first.pid, second.pid)  # servers go in pid order: the second is the younger
    assert message.startswith(f"vLLM server {second_root} (drain): fault injected"), message
    all_three_awake_and_whole(cli, world, (first, second), demo, before, how)
    assert not [step for _, step, _, _ in world.calls(("lock", "checkpoint"))]
    nothing_left_to_clean(runtime_dir)

    # The CLI killed once every target had slept, before the CUDA stage: recover finishes the sleep
    # of all three (the journal says every unit passed its memory steps), and a wake brings all back.
    killed = cli("sleep", *targets, "--to", str(work_dir), env={faults.ENV: "sleep.after-vllm-sleep#2:kill"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    holders = [*first.workers, *second.workers, demo.pid]
    assert [world.state(pid) for pid in holders] == ["running"] * len(holders)
    recovered = cli("recover", *targets, "--json")  # the same selection as the lost command
    assert recovered.returncode == 0, recovered.stderr
    assert recovered.json()["action"] == "finished the interrupted sleep"
    assert [world.state(pid) for pid in holders] == ["checkpointed"] * len(holders)
    assert first.is_sleeping() and second.is_sleeping()
    nothing_left_to_clean(runtime_dir)
    assert cli("wake", *targets, "-q").returncode == 0
    all_three_awake_and_whole(cli, world, (first, second), demo, before, f"{how}, recovered")


@pytest.mark.slow
def test_a_request_in_flight_through_a_proxy_refuses_the_sleep_before_the_server_is_drained(
    world: World, start_server: Callable[..., FakeServer], cli: Callable[..., Any], work_dir: Path
) -> None:
    """A proxy's lease is checked before the drain: a request forwarded to a paused server would
    wait there with its lease held, and the sleep would wait for the lease."""
    server = start_server(workers=1)
    before = server.digests()
    worker = targets.find_agent(server.workers[0])
    assert worker is not None
    with AgentClient(worker.socket) as proxy:
        assert proxy.call("lease", {"by": "hibernate serve"})["granted"] is True
        refused = cli("sleep", str(server.pid), "--to", str(work_dir), "--timeout", "1")
        assert refused.returncode == ExitCode.BUSY, refused.stderr
        assert (
            f"vLLM server {server.pid} (leases): process {server.workers[0]} is held awake by 1 request "
            in (refused.stderr)
        )
        assert f"through hibernate serve (pid {os.getpid()}," in refused.stderr
        awake_and_whole(cli, server, world, before, "after the refusal")  # never paused, nothing moved
        assert world.calls() == []
    assert cli("sleep", str(server.pid), "--to", str(work_dir), "-q").returncode == 0  # gone with its holder
    assert cli("wake", str(server.pid), "-q").returncode == 0
    awake_and_whole(cli, server, world, before, "after the wake")


@pytest.mark.slow
def test_vllm_url_is_refused_for_several_servers_at_once(
    start_server: Callable[..., FakeServer], cli: Callable[..., Any], work_dir: Path
) -> None:
    first, second = start_server(workers=1), start_server(workers=1)
    refused = cli(
        "sleep", str(first.pid), str(second.pid), "--to", str(work_dir), "--vllm-url", first.url, "--json"
    )  # fmt: skip
    assert refused.returncode == ExitCode.USAGE, refused.stderr
    assert "--vllm-url names one server" in refused.json()["error"]["message"]
    assert not first.is_sleeping() and not second.is_sleeping()


@pytest.mark.slow
def test_the_wake_counts_the_workers_pools_with_their_cuda_state(
    world: World, start_server: Callable[..., FakeServer], cli: Callable[..., Any], work_dir: Path
) -> None:
    """The pools' bytes each worker maps back (its agent's device_bytes) are needed too."""
    from hibernate.checkpoint.group import HEADROOM_BYTES

    server = start_server(workers=1)
    (worker,) = server.workers
    assert cli("sleep", str(server.pid), "--to", str(work_dir), "-q").returncode == 0
    pools = agents(cli, server.pid)[worker]["device_bytes"]
    assert set(pools) == {"cuda:0"} and pools["cuda:0"] > 0
    # Room for the CUDA state (2 GiB, and its headroom), not for the pools on top of it.
    free = 2 * GIB + HEADROOM_BYTES + pools["cuda:0"] // 2
    world.set_other_use(0, world.gpus[0].total - free)
    refused = cli("wake", str(server.pid))
    assert refused.returncode == ExitCode.UNSUPPORTED, refused.stderr
    assert "not enough free GPU memory" in refused.stderr and "missing" in refused.stderr
    assert world.state(worker) == "checkpointed" and states(cli, server) == ["asleep"]
    world.set_other_use(0, 0)
    woken = cli("wake", str(server.pid), "--json")
    assert woken.returncode == 0, woken.stderr
    assert woken.json()["cuda"]["memory"]["needed"] == {
        str(worker): {world.gpus[0].uuid: 2 * GIB + pools["cuda:0"]}
    }
    assert states(cli, server) == ["running"]
