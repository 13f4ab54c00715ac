"""Shared fixtures: real target processes (the demo), the real CLI, private runtime dirs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hibernate.checkpoint.nccl import NCCL_SAFE
from tests.demo_control import DemoControl

# Every plugin, registered once for the whole suite: the reaper (tests/reaper.py: no process the suite
# starts outlives it), then the fixtures (stand-ins of hardware, a private Slurm, a latency-bound filesystem).
pytest_plugins = ["tests.reaper", "tests.standins.fixtures", "tests.slurm_cluster", "tests.latencyfs_fixture"]

REPO = Path(__file__).resolve().parent.parent
NOBODY = 65534


def is_root() -> bool:
    return os.getuid() == 0


def free_port() -> int:
    """A TCP port nothing listens on at 127.0.0.1 now, for a server a test starts next.

    Drawn below the kernel's ephemeral range (``ip_local_port_range``): every outgoing connection of
    every test takes its local port from that range at any moment, so a port seen free there can be
    someone's before the server binds it. Where the server can take port 0 and say which it got,
    that is better still (no window at all).
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(1000):
        port = random.randrange(10000, max(low, 10001))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free TCP port found between 10000 and {low}")


def flip_a_bit_in_a_chunk(data_file: Path) -> None:
    """Damage a snapshot's data file where its manifest says a chunk lies (a third into the largest).

    Not at a fixed offset of the file: where the writer's threads place each chunk depends on which
    stages first, and between chunks lie bytes no chunk refers to (a duplicate's staged copy, the
    padding of a packed run), whose damage a wake rightly never sees.
    """
    length, offset = max((length, offset) for offset, length in chunks_in(data_file))
    flip_byte_at(data_file, offset + length // 3, 0x01)


def chunks_in(data_file: Path) -> list[tuple[int, int]]:
    """(offset, length) of every chunk the snapshot's manifest places in ``data_file``."""
    chunks = json.loads((data_file.parent / "manifest.json").read_text())["chunks"]
    here = [
        (offset, length)
        for name, offset, length in zip(chunks["file"], chunks["offset"], chunks["length"], strict=True)
        if name == data_file.name
    ]
    assert here, f"no chunk of the manifest lies in {data_file}"
    return here


def flip_byte_at(path: Path, at: int, mask: int = 0xFF) -> None:
    """Flip the bits ``mask`` names in the byte at offset ``at`` of ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ mask]))


def spill_root_of(base: Path, pid: int, label: str | None = None) -> Path:
    """Where process ``pid`` (of this pid namespace) keeps its snapshots under ``base``.

    A root's name has a random part its agent draws (store.owner.spill_root_name),
    so the root is found as gc finds roots: by the marker inside, naming the
    process by pid and start time. A path that does not exist when there is none.
    """
    from hibernate import procinfo

    label = label or f"proc-{pid}"
    started = procinfo.start_time(pid)
    assert started is not None, f"process {pid} is gone"
    found = []
    for path in sorted(base.glob(f"{label}-*")):
        try:
            owner = json.loads((path / ".hibernate-root").read_text())["owner"]
        except (OSError, ValueError, KeyError):
            continue
        if (owner["pid"], owner["start_time"]) == (pid, started):
            found.append(path)
    assert len(found) <= 1, f"process {pid} has {len(found)} roots under {base}: {found}"
    return found[0] if found else base / f"{label}-none"


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.02,
    *,
    process: Any = None,
    detail: Callable[[], Any] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something true, and return that.

    Tests order events by waiting for a real state (a file written, an agent's
    reported state, a thread's event), never by sleeping a guessed duration.
    On timeout it fails naming ``what`` was awaited, followed by ``detail()``
    (the state last seen, a log) where given. ``process`` (a Popen, or anything
    with ``poll()``) is the one that should bring the state about: if it exits
    first, the wait fails at once rather than running out its time.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if process is not None and process.poll() is not None:
            failure = f"process {process.pid} exited ({process.poll()}) while waiting for {what}"
        elif time.monotonic() > deadline:
            failure = f"timed out after {timeout:g}s waiting for {what}"
        else:
            time.sleep(interval)
            continue
        raise AssertionError(failure if detail is None else f"{failure}:\n{detail()}")


def stays_false(predicate: Callable[[], Any], seconds: float, what: str, interval: float = 0.02) -> None:
    """Check that ``predicate`` stays false for a whole window of ``seconds``.

    That something does not happen can only be watched for a while: the window
    is the test's claim, chosen longer than the thing would take if it were
    going to happen. ``what`` names the thing that must not happen; if it does,
    the check fails at once with what ``predicate`` returned.
    """
    started = time.monotonic()
    while True:
        value = predicate()
        elapsed = time.monotonic() - started
        if value:
            raise AssertionError(f"{what} after {elapsed:.2f}s of a {seconds:g}s window: {value!r}")
        if elapsed >= seconds:
            return
        time.sleep(min(interval, seconds - elapsed))


def process_state(pid: int) -> str:
    """The kernel's one-letter state of process ``pid`` (/proc/PID/stat): ``T`` once a stop signal took it."""
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    return raw[raw.rindex(")") + 2]


def as_user_prefix(uid: int | None) -> list[str]:
    """Command prefix that runs a program as ``uid`` (root only)."""
    if uid is None:
        return []
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


_readable_copy: Path | None = None
_cannot_run: dict[int, str | None] = {}  # per uid: why this interpreter cannot run as that user, if so


def source_root_for(uid: int | None) -> Path:
    """Where a process run as ``uid`` imports hibernate from.

    The checkout may sit in a directory another user cannot enter (a 0700 home
    or temporary directory), so processes of another user get a world-readable
    copy of the package, made once per session. If the interpreter itself is out
    of that user's reach, the test is skipped: the machine cannot run it.
    """
    global _readable_copy
    if uid is None:
        return REPO
    if _readable_copy is None:
        copy = Path(tempfile.mkdtemp(prefix="hb-src-", dir="/tmp"))
        shutil.copytree(REPO / "hibernate", copy / "hibernate", ignore=shutil.ignore_patterns("__pycache__"))
        for path in [copy, *copy.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        atexit.register(shutil.rmtree, copy, ignore_errors=True)
        _readable_copy = copy
    if uid not in _cannot_run:  # asked once per user: the probe imports torch (seconds)
        probe = subprocess.run(
            [*as_user_prefix(uid), sys.executable, "-c", "import hibernate, torch"],
            env={**os.environ, "PYTHONPATH": str(_readable_copy)},
            cwd=_readable_copy,
            capture_output=True,
        )
        _cannot_run[uid] = probe.stderr.decode()[-200:] if probe.returncode != 0 else None
    if _cannot_run[uid] is not None:
        pytest.skip(f"this interpreter cannot run as uid {uid} here: {_cannot_run[uid]}")
    return _readable_copy


@pytest.fixture(scope="session")
def cudart_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in CUDA runtime behind vLLM's device seam (tests/standins/vllm_cumem.py), built once."""
    from tests.standins.vllm_cumem import build_fake_cudart

    try:
        return build_fake_cudart(tmp_path_factory.mktemp("cudart"))
    except RuntimeError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def manifest_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The snapshots whose manifest is read from disk (SpillRoot.read_manifest) from now on, in order."""
    from hibernate.store.layout import SpillRoot

    names: list[str] = []
    read_manifest = SpillRoot.read_manifest

    def counting(self: SpillRoot, name: str) -> Any:
        names.append(name)
        return read_manifest(self, name)

    monkeypatch.setattr(SpillRoot, "read_manifest", counting)
    return names


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A short, private HIBERNATE_RUNTIME_DIR for this test and every process it starts."""
    path = Path(tempfile.mkdtemp(prefix="hb-run-", dir="/tmp"))
    os.chmod(path, 0o777)  # processes of another user make their own 0700 subdirectory
    run = path / "run"
    monkeypatch.setenv("HIBERNATE_RUNTIME_DIR", str(run))
    yield run
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def work_dir() -> Iterator[Path]:
    """A scratch directory for snapshots (HIBERNATE_TEST_DISK chooses the disk)."""
    path = Path(tempfile.mkdtemp(prefix="hb-work-", dir=os.environ.get("HIBERNATE_TEST_DISK")))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.stdout)
        return document


def run_cli(
    *args: str,
    uid: int | None = None,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: Path = REPO,
) -> CliResult:
    """Run ``hibernate ARGS`` as a separate process, as the user would."""
    command = [*as_user_prefix(uid), sys.executable, "-m", "hibernate", *args]
    source = source_root_for(uid)
    environment = {**os.environ, "PYTHONPATH": str(source), **(env or {})}
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=cwd if uid is None else source,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


@pytest.fixture
def cli() -> Any:
    return run_cli


class ForkedProcess:
    """A target forked by the fork server, with the part of Popen's interface tests use."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self._server = server
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.request({"op": "status", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The session's fork server (tests/forkserver.py): demo targets without re-importing torch."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="hb-fork-", dir="/tmp"))
        self.path = str(self.directory / "server.sock")
        plain = {k: v for k, v in os.environ.items() if not k.startswith(("HIBERNATE_", "XDG_RUNTIME"))}
        # A forked target's /proc/PID/environ is this server's: whatever test starts the server first,
        # its targets run as a multi-process job must for a checkpoint (a sleep of several CUDA holders
        # reads it). A test of a job without these starts its targets with an env of their own.
        plain.update(NCCL_SAFE)
        self.proc = subprocess.Popen(
            [sys.executable, "-W", "ignore", str(REPO / "tests" / "forkserver.py"), self.path],
            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**plain, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"

    def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """One request; a server that does not answer in a minute fails the test that asked, rather
        than every test after it at pytest's ten-minute limit."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60)
            conn.connect(self.path)
            with conn.makefile("rw") as stream:
                stream.write(json.dumps(message) + "\n")
                stream.flush()
                answer: dict[str, Any] = json.loads(stream.readline())
                return answer

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, log: Path) -> ForkedProcess:
        answer = self.request({"op": "start", "argv": argv, "env": env, "cwd": str(cwd), "log": str(log)})
        return ForkedProcess(self, answer["pid"])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


_forkserver: ForkServer | None = None


def forkserver() -> ForkServer:
    """Started on first use, stopped when the session ends (not a process left by the test that
    happened to start it: its demos are)."""
    from tests import reaper  # here: imported first as a plugin, to be assertion-rewritten

    global _forkserver
    if _forkserver is None:
        _forkserver = ForkServer()
        reaper.keep(_forkserver.proc.pid, "the fork server", _forkserver.close)
    return _forkserver


@dataclass
class Demo(DemoControl):
    """A running ``python -m hibernate.demo serve`` target."""

    proc: Any  # subprocess.Popen, or ForkedProcess
    control: str
    info: dict[str, Any]
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def infer(self) -> dict[str, Any]:
        return self.request("infer")

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/fd"))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):  # the reaper ends it if this runs out
            self.proc.wait(timeout=60)


@pytest.fixture
def start_demo(runtime_dir: Path) -> Iterator[Any]:
    started: list[Demo] = []
    scratch = Path(tempfile.mkdtemp(prefix="hb-demo-", dir="/tmp"))
    os.chmod(scratch, 0o777)

    def start(
        size_mb: int = 32,
        uid: int | None = None,
        env: dict[str, str] | None = None,
        dtype: str = "float32",
        fork: bool = True,
        args: Sequence[str] = (),
    ) -> Demo:
        index = len(started)
        control = scratch / f"demo{index}.sock"
        ready = scratch / f"demo{index}.ready"
        log = scratch / f"demo{index}.log"
        demo_args = [
            "serve", "--size-mb", str(size_mb), "--dtype", dtype,
            "--control", str(control), "--ready-file", str(ready), *args,
        ]  # fmt: skip
        proc: Any
        # A fork keeps the server's /proc/<pid>/environ (read by target discovery and --job), so
        # only targets with the session's plain environment are forked.
        if fork and uid is None and not env:
            proc = forkserver().start(
                demo_args, {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, REPO, log
            )
        else:
            with open(log, "wb") as log_file:
                proc = subprocess.Popen(
                    [
                        *as_user_prefix(uid),
                        sys.executable,
                        "-W",
                        "ignore",
                        "-m",
                        "hibernate.demo",
                        *demo_args,
                    ],
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    cwd=source_root_for(uid),
                    env={**os.environ, "PYTHONPATH": str(source_root_for(uid)), **(env or {})},
                )
        demo = Demo(proc, str(control), {}, log)
        started.append(demo)
        wait_until(ready.exists, 120, "the demo to become ready", 0.05, process=proc, detail=log.read_text)
        demo.info = json.loads(ready.read_text())
        return demo

    yield start
    for demo in started:
        demo.stop()
    shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def fresh_agent(monkeypatch: pytest.MonkeyPatch, runtime_dir: Path) -> Iterator[None]:
    """Reset this process's agent singleton so in-process API tests start clean."""
    import hibernate.agent.local as agent

    monkeypatch.setenv("HIBERNATE_AGENT", "0")
    agent._reset_after_fork()
    yield
    agent._reset_after_fork()
