"""The operation engine: the recovery table, fault points, and a third kind of target.

The toy kind (tests/toy_flow.py) is one module plus one registration line; it
goes through sleep, wake, a failure at each of its steps (undone) and a
SIGKILL of the CLI at each step (recovered) with nothing of its own but two
no-op memory steps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from hibernate import faults, orchestrator
from hibernate.errors import UnsupportedError, UsageError
from hibernate.operation import registry
from hibernate.operation.engine import sleep_points, wake_points
from hibernate.operation.recovery import Action, UnitRecord, decide
from tests import toy_flow
from tests.conftest import CliResult, wait_until
from tests.standins.world import GIB, World

REPO = Path(__file__).resolve().parent.parent

# -- pure rules ------------------------------------------------------------------------------


def record(op: str | None, marks: tuple[str, ...], asleep: bool, last: str = "release") -> UnitRecord:
    return UnitRecord(op=op, marks=marks, last_memory_step=last, asleep=asleep)


@pytest.mark.parametrize(
    ("units", "action"),
    [
        ([record(None, (), False)], Action.NOTHING),
        ([record("sleep", ("lock", "connect", "quiesce"), False)], Action.WAKE),
        ([record("sleep", ("lock", "connect", "quiesce", "spill", "release"), True)], Action.FINISH_SLEEP),
        ([record("sleep", ("lock", "release", "cuda-lock", "cuda"), True)], Action.CLEAR),
        ([record("sleep", ("lock", "release", "cuda-lock", "cuda"), False)], Action.WAKE),
        ([record("wake", ("lock", "connect", "cuda"), True)], Action.WAKE),
        # Two units: one finished its memory steps, the other did not; only a wake is safe.
        (
            [
                record("sleep", ("lock", "connect", "quiesce", "spill", "release"), True),
                record("sleep", ("lock", "connect", "configure"), True, last="vllm-sleep"),
            ],
            Action.WAKE,
        ),
        (
            [
                record("sleep", ("lock", "release"), True),
                record("sleep", ("lock", "configure", "drain", "vllm-sleep"), True, last="vllm-sleep"),
            ],
            Action.FINISH_SLEEP,
        ),
        # A unit the interrupted sleep never reached (no entry) and running: wake everything.
        ([record("sleep", ("lock", "release"), True), record(None, (), False)], Action.WAKE),
    ],
)
def test_recovery_decides_from_the_journal_and_the_real_states(
    units: list[UnitRecord], action: Action
) -> None:
    assert decide(units)[0] is action


def test_a_fault_point_can_name_its_nth_passage(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(faults.ENV, "test.point#2:fail")
    monkeypatch.setattr(faults, "_reached", {})
    faults.point("test.point")
    with pytest.raises(faults.InjectedFault):
        faults.point("test.point")
    faults.point("test.point")


def test_an_unknown_kind_is_refused_before_anything_changes() -> None:
    with pytest.raises(UnsupportedError, match="no flow for targets of kind 'sglang'"):
        registry.load("sglang")


# -- a third kind of target ----------------------------------------------------------------------


@pytest.fixture
def toy_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="hb-toy-"))
    monkeypatch.setenv(toy_flow.STATE_DIR_ENV, str(path))
    yield path


@pytest.fixture
def start_toy(runtime_dir: Path, toy_dir: Path, world: World) -> Iterator[Callable[[], int]]:
    """A toy target, registered with the stand-in driver as a CUDA holder (1 GiB)."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> int:
        ready = toy_dir / f"ready-{len(started)}.json"
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.toy_flow", "--ready", str(ready)],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        started.append(proc)
        wait_until(ready.exists, 60, "the toy target to start", process=proc)
        pid = int(json.loads(ready.read_text())["pid"])
        world.register(pid, nbytes=GIB)
        return pid

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def toy_cli(*args: str, env: dict[str, str] | None = None) -> CliResult:
    """``hibernate ARGS`` in a process that has the toy kind registered (one import)."""
    command = [sys.executable, "-c", "import tests.toy_flow; from hibernate.cli import main; main()", *args]
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def journal_is_empty(runtime_dir: Path) -> bool:
    journal = runtime_dir / "journal"
    return not (journal.exists() and any(journal.glob("*.json")))


def test_the_toy_kind_is_one_registration_away_and_declares_its_steps() -> None:
    assert registry.load(toy_flow.KIND) is toy_flow.ToyUnit
    assert sleep_points(toy_flow.ToyUnit) == [
        "sleep.after-lock",
        "sleep.after-connect",
        "sleep.after-toy-pause",
        "sleep.after-toy-park",
        "sleep.after-cuda-lock",
        "sleep.after-cuda",
    ]
    assert wake_points(toy_flow.ToyUnit)[-1] == "wake.after-toy-unpark"


def test_a_toy_target_sleeps_and_wakes_through_the_engine(
    start_toy: Callable[[], int], world: World, work_dir: Path, runtime_dir: Path
) -> None:
    pid = start_toy()
    asleep = orchestrator.sleep([pid], work_dir, orchestrator.Options())
    assert toy_flow.state_of(pid) == "asleep" and world.state(pid) == "checkpointed"
    assert asleep.to_wire()["toy"] == {"pid": pid, "state": "asleep"}
    assert [p["pid"] for p in asleep.cuda["processes"]] == [pid]
    woken = orchestrator.wake([pid], orchestrator.Options())
    assert toy_flow.state_of(pid) == "running" and world.state(pid) == "running"
    assert woken.to_wire()["toy_all"] == [{"pid": pid, "state": "running"}]
    assert toy_flow.events() == ["pause", "park", "unpark"] and journal_is_empty(runtime_dir)


def test_a_toy_only_option_of_another_kind_is_refused(start_toy: Callable[[], int], work_dir: Path) -> None:
    pid = start_toy()
    options = orchestrator.Options(kind_options={"level": 2})
    with pytest.raises(
        UsageError, match=f"--level apply to a vLLM server, and process\\(es\\) {pid} are not one"
    ):
        orchestrator.sleep([pid], work_dir, options)
    assert toy_flow.events() == []


UNDONE = set(sleep_points(toy_flow.ToyUnit)) - {"sleep.after-lock", "sleep.after-connect"}


@pytest.mark.parametrize("point", sleep_points(toy_flow.ToyUnit))
def test_a_failure_at_each_toy_step_is_undone(
    point: str,
    start_toy: Callable[[], int],
    world: World,
    work_dir: Path,
    runtime_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pid = start_toy()
    monkeypatch.setenv(faults.ENV, point)
    monkeypatch.setattr(faults, "_reached", {})
    with pytest.raises(faults.InjectedFault) as failed:
        orchestrator.sleep([pid], work_dir, orchestrator.Options())
    assert toy_flow.state_of(pid) == "running" and world.state(pid) == "running", point
    ran = {"sleep.after-lock": [], "sleep.after-connect": [], "sleep.after-toy-pause": ["pause"]}
    assert toy_flow.events() == [*ran.get(point, ["pause", "park"]), *(["undo"] if point in UNDONE else [])]
    if "toy-" in point:
        assert failed.value.message.startswith(f"toy {pid} ("), failed.value.message
    assert journal_is_empty(runtime_dir)


@pytest.mark.slow
@pytest.mark.parametrize("point", [*sleep_points(toy_flow.ToyUnit), *wake_points(toy_flow.ToyUnit)])
def test_the_cli_killed_at_each_toy_step_is_recovered(
    point: str, start_toy: Callable[[], int], world: World, work_dir: Path, runtime_dir: Path
) -> None:
    pid = start_toy()
    if point.startswith("wake."):
        assert toy_cli("sleep", str(pid), "--to", str(work_dir), "-q").returncode == 0
    operation = point.partition(".")[0]
    args = ["sleep", str(pid), "--to", str(work_dir)] if operation == "sleep" else ["wake", str(pid)]
    killed = toy_cli(*args, env={faults.ENV: f"{point}:kill"})
    assert killed.returncode == -9, killed.stderr
    recovered = toy_cli("recover", str(pid), "--json")
    assert recovered.returncode == 0, recovered.stderr
    toy, cuda = toy_flow.state_of(pid), world.state(pid)
    assert (toy, cuda) in (("running", "running"), ("asleep", "checkpointed")), (point, toy, cuda)
    assert journal_is_empty(runtime_dir), point
    if toy == "asleep":
        assert toy_cli("wake", str(pid), "-q").returncode == 0
    assert (toy_flow.state_of(pid), world.state(pid)) == ("running", "running"), point
    assert toy_cli("recover", str(pid), "--json").json()["action"] == "none"
