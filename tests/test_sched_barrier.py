"""How the nodes of a job agree: the barrier's verdicts, and one node's step around it (in-process)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode, NothingToHibernateError, StorageError, UsageError, WrongStateError
from hibernate.orchestrator import Options
from hibernate.sched.barrier import ABORT, COMMIT, Barrier, Decision, NodeResult, decide
from hibernate.sched.nodestep import node_step, run_step


def ok(index: int) -> NodeResult:
    return NodeResult(index, f"n{index}", True)


def failed(index: int, code: ExitCode = ExitCode.TIMEOUT) -> NodeResult:
    return NodeResult(index, f"n{index}", False, int(code), "guard held too long")


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.now += seconds


# -- decide -------------------------------------------------------------------------


def test_every_node_ok_commits() -> None:
    decision = decide({0: ok(0), 1: ok(1), 2: ok(2)}, 3, timed_out=False)
    assert decision is not None and decision.verdict == COMMIT and decision.exit_code == 0


def test_the_verdict_stays_open_while_a_node_is_missing() -> None:
    assert decide({0: ok(0), 2: ok(2)}, 3, timed_out=False) is None


def test_one_failure_aborts_at_once_with_that_nodes_code() -> None:
    decision = decide({0: ok(0), 2: failed(2, ExitCode.IO_ERROR)}, 3, timed_out=False)
    assert decision is not None
    assert decision.verdict == ABORT and decision.exit_code == ExitCode.IO_ERROR
    assert "node 2 (n2) failed" in decision.reason


def test_of_several_failures_the_lowest_numbered_node_gives_the_code() -> None:
    decision = decide({1: failed(1, ExitCode.BUSY), 0: failed(0, ExitCode.IO_ERROR)}, 3, timed_out=False)
    assert decision is not None and decision.exit_code == ExitCode.IO_ERROR


def test_a_silent_node_past_the_timeout_aborts_with_timeout() -> None:
    decision = decide({0: ok(0), 1: ok(1)}, 3, timed_out=True, timeout=30)
    assert decision is not None
    assert decision.verdict == ABORT and decision.exit_code == ExitCode.TIMEOUT
    assert "node(s) 2 of 3 did not report within 30s" in decision.reason


def test_all_results_in_commit_even_when_time_is_up() -> None:
    decision = decide({0: ok(0)}, 1, timed_out=True)
    assert decision is not None and decision.verdict == COMMIT


# -- the barrier directory ---------------------------------------------------------------


def test_results_posted_by_each_node_are_read_back(tmp_path: Path) -> None:
    Barrier(tmp_path, 2, 0, "n0").post(ok(0))
    Barrier(tmp_path, 2, 1, "n1").post(failed(1))
    results = Barrier(tmp_path, 2, 0, "n0").results()
    assert results == {0: ok(0), 1: failed(1)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["node0.ok", "node1.failed"]


def test_a_node_index_reports_once(tmp_path: Path) -> None:
    Barrier(tmp_path, 2, 0, "n0").post(ok(0))
    with pytest.raises(UsageError, match="already reported"):
        Barrier(tmp_path, 2, 0, "other").post(failed(0))
    with pytest.raises(UsageError, match="already reported"):
        Barrier(tmp_path, 2, 0, "other").check()


def test_the_first_verdict_stands_for_everyone(tmp_path: Path) -> None:
    first = Barrier(tmp_path, 2, 0, "n0").settle(Decision(ABORT, "node 1 silent", int(ExitCode.TIMEOUT)))
    second = Barrier(tmp_path, 2, 1, "n1").settle(Decision(COMMIT, "all ok", 0))
    assert first == second == Decision(ABORT, "node 1 silent", int(ExitCode.TIMEOUT), "n0")


def test_racing_deciders_all_see_one_verdict(tmp_path: Path) -> None:
    verdicts: list[Decision] = []
    lock = threading.Lock()

    def settle(index: int) -> None:
        proposal = Decision(COMMIT if index % 2 else ABORT, f"by {index}", index)
        standing = Barrier(tmp_path, 8, index, f"n{index}").settle(proposal)
        with lock:
            verdicts.append(standing)

    threads = [threading.Thread(target=settle, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(verdicts) == 8 and len(set(verdicts)) == 1


@pytest.mark.parametrize(
    "setup, message",
    [
        (lambda d: None, "not a directory"),
        (lambda d: (d.mkdir(), (d / "decision").write_text('{"verdict": "commit"}')), "already used"),
        (lambda d: (d.mkdir(), (d / "node0.ok").write_text("{}")), "already reported"),
    ],
)
def test_a_missing_or_used_barrier_is_refused_before_anything_is_done(
    tmp_path: Path, setup: Callable[[Path], object], message: str
) -> None:
    directory = tmp_path / "barrier"
    setup(directory)
    step = Step()
    with pytest.raises(UsageError, match=message):
        run_step("sleep", Barrier(directory, 2, 0, "n0"), step.act, step.undo, deadline=1.0, timeout=1.0)
    assert step.calls == []


@pytest.mark.parametrize("index, nodes", [(2, 2), (0, 0)])
def test_an_index_outside_the_node_count_is_refused(tmp_path: Path, index: int, nodes: int) -> None:
    with pytest.raises(Exception, match=r"outside|at least 1"):
        Barrier(tmp_path, nodes, index, "n").check()


# -- one node's step ---------------------------------------------------------------------


REPORT: dict[str, Any] = {"operation": "sleep", "seconds": 1.5, "processes": [{"pid": 42}], "cuda": {}}


class Step:
    """A node's local operation and its undo, recorded."""

    def __init__(self, error: Exception | None = None, undo_error: Exception | None = None) -> None:
        self.error = error
        self.undo_error = undo_error
        self.calls: list[str] = []

    def act(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        self.calls.append("act")
        if self.error is not None:
            raise self.error
        return REPORT, {"pids": [42]}

    def undo(self) -> dict[str, Any]:
        self.calls.append("undo")
        if self.undo_error is not None:
            raise self.undo_error
        return {"operation": "wake"}


def run(directory: Path, step: Step, operation: str = "sleep", nodes: int = 2, **kwargs: Any) -> Any:
    clock = FakeClock()
    barrier = Barrier(directory, nodes, 0, "n0", clock=clock, pause=clock.pause, poll=1.0)
    return run_step(operation, barrier, step.act, step.undo, deadline=10.0, timeout=10.0, **kwargs)


def test_a_node_commits_when_every_node_slept(tmp_path: Path) -> None:
    Barrier(tmp_path, 2, 1, "n1").post(ok(1))
    step = Step()
    outcome = run(tmp_path, step)
    assert outcome.error is None and outcome.decision.verdict == COMMIT
    assert step.calls == ["act"]
    assert [r.index for r in outcome.results] == [0, 1]
    assert outcome.result.detail == {"pids": [42], "seconds": 1.5}


def test_when_another_node_fails_this_node_wakes_again_and_exits_with_its_code(tmp_path: Path) -> None:
    Barrier(tmp_path, 2, 1, "n1").post(failed(1, ExitCode.IO_ERROR))
    step = Step()
    outcome = run(tmp_path, step)
    assert step.calls == ["act", "undo"]
    assert outcome.decision.verdict == ABORT and outcome.undo == {"operation": "wake"}
    assert outcome.error.exit_code == ExitCode.IO_ERROR
    assert "woken again" in outcome.error.message and "node 1 (n1) failed" in outcome.error.message


def test_a_silent_node_makes_this_one_wake_again_after_the_timeout(tmp_path: Path) -> None:
    step = Step()
    outcome = run(tmp_path, step)
    assert step.calls == ["act", "undo"]
    assert outcome.error.exit_code == ExitCode.TIMEOUT
    assert "did not report within 10s" in outcome.decision.reason


def test_a_late_node_follows_the_abort_that_already_stands(tmp_path: Path) -> None:
    class Late(Step):
        def act(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
            # while this node was still putting its processes to sleep, the others gave up on it
            Barrier(tmp_path, 2, 1, "n1").settle(
                Decision(ABORT, "node 0 did not report", int(ExitCode.TIMEOUT))
            )
            return super().act()

    step = Late()
    outcome = run(tmp_path, step)
    assert step.calls == ["act", "undo"]
    assert outcome.decision.by == "n1" and outcome.error.exit_code == ExitCode.TIMEOUT


def test_a_node_that_starts_after_an_abort_does_nothing(tmp_path: Path) -> None:
    Barrier(tmp_path, 2, 1, "n1").settle(Decision(ABORT, "node 0 did not report", int(ExitCode.TIMEOUT)))
    step = Step()
    outcome = run(tmp_path, step)
    assert step.calls == []
    assert outcome.error.exit_code == ExitCode.TIMEOUT
    assert "nothing was put to sleep on this node" in outcome.error.message


def test_a_local_failure_is_posted_and_not_undone_here(tmp_path: Path) -> None:
    step = Step(error=StorageError("disk full"))
    outcome = run(tmp_path, step)
    assert step.calls == ["act"]  # the orchestrator already undid its own sleep
    assert (tmp_path / "node0.failed").exists()
    assert outcome.error.exit_code == ExitCode.IO_ERROR
    assert outcome.error.message.startswith("node 0 (n0): disk full")


def test_an_undo_that_fails_needs_recovery(tmp_path: Path) -> None:
    Barrier(tmp_path, 2, 1, "n1").post(failed(1))
    outcome = run(tmp_path, Step(undo_error=StorageError("snapshot unreadable")))
    assert outcome.error.exit_code == ExitCode.NEEDS_RECOVERY
    assert "snapshot unreadable" in outcome.error.message


def test_a_wake_where_nothing_sleeps_agrees(tmp_path: Path) -> None:
    Barrier(tmp_path, 2, 1, "n1").post(ok(1))
    outcome = run(tmp_path, Step(error=WrongStateError("nothing to wake: process 42 is running")), "wake")
    assert outcome.error is None and outcome.result.detail == {"already_awake": True}


def test_a_failed_wake_is_not_undone(tmp_path: Path) -> None:
    Barrier(tmp_path, 2, 1, "n1").post(failed(1, ExitCode.SNAPSHOT_INVALID))
    step = Step()
    outcome = run(tmp_path, step, "wake")
    assert step.calls == ["act"]
    assert outcome.error.exit_code == ExitCode.SNAPSHOT_INVALID
    assert "own wake succeeded" in outcome.error.message


@pytest.mark.parametrize("allow_empty", [False, True])
def test_a_node_with_nothing_selected_fails_unless_allowed(tmp_path: Path, allow_empty: bool) -> None:
    Barrier(tmp_path, 2, 1, "n1").post(ok(1))
    empty = NothingToHibernateError("Slurm job 7 has no processes on this node")
    outcome = run(tmp_path, Step(error=empty), allow_empty=allow_empty)
    if allow_empty:
        assert outcome.error is None and outcome.result.detail == {"empty": True}
    else:
        assert outcome.error.exit_code == ExitCode.NOTHING_TO_HIBERNATE


def test_an_interrupted_node_aborts_the_job_and_undoes_its_sleep(tmp_path: Path) -> None:
    clock = FakeClock()
    barrier = Barrier(tmp_path, 2, 0, "n0", clock=clock, poll=1.0)
    step = Step()

    def pause(seconds: float) -> None:
        raise KeyboardInterrupt  # SIGTERM from srun while waiting for the other node

    barrier.pause = pause
    with pytest.raises(KeyboardInterrupt):
        run_step("sleep", barrier, step.act, step.undo, deadline=10.0, timeout=10.0)
    assert step.calls == ["act", "undo"]
    decision = barrier.decision()
    assert decision is not None and decision.verdict == ABORT


def test_a_barrier_made_on_another_node_a_moment_ago_is_waited_for(tmp_path: Path) -> None:
    directory = tmp_path / "barrier"
    clock = FakeClock()

    def pause(seconds: float) -> None:
        clock.pause(seconds)
        if clock.now >= 3:
            directory.mkdir(exist_ok=True)  # the network file system shows it now

    Barrier(directory, 1, 0, "n0", clock=clock, pause=pause, poll=1.0, appear_timeout=10).check()
    assert clock.now == 3
    missing = Barrier(tmp_path / "never", 1, 0, "n0", clock=clock, pause=clock.pause, appear_timeout=5)
    with pytest.raises(UsageError, match="not a directory"):
        missing.check()


# -- node_step: the node-step command's logic ---------------------------------------


def no_options() -> Any:
    raise AssertionError("options were built before the node's place was checked")


@pytest.mark.parametrize(
    "operation, extra, words",
    [
        ("hover", {}, "must be sleep or wake"),
        ("sleep", {}, "needs --to DIR"),
        ("wake", {"node": "a/b"}, "cannot name a file"),
        ("wake", {"nodes": None}, "--nodes is not known here"),
        ("wake", {"node_index": None}, "--node-index is not known here"),
    ],
)
def test_node_step_checks_its_place_before_building_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str, extra: dict[str, Any], words: str
) -> None:
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    place: dict[str, Any] = {"nodes": 1, "node_index": 0, "node": "n0", **extra}
    with pytest.raises(UsageError, match=words):
        node_step(operation, tmp_path, options=no_options, pids=[1], **place)


def test_node_step_reports_a_local_failure_as_the_job_s_abort(tmp_path: Path) -> None:
    built: list[Options] = []

    def options() -> Options:
        built.append(Options())
        return built[-1]

    before = signal.getsignal(signal.SIGTERM)
    # pid 999999999 is above any pid_max: the selection fails, so this node fails and the job aborts.
    document, error = node_step(
        "wake", tmp_path, options=options, pids=[999999999], nodes=1, node_index=0, node="n0"
    )
    assert len(built) == 1 and signal.getsignal(signal.SIGTERM) == before
    assert error is not None and document["ok"] is False
    assert document["decision"]["verdict"] == ABORT and document["node"] == "n0"
    assert [r["ok"] for r in document["results"]] == [False]
    assert int(error.exit_code) == document["decision"]["exit_code"]
