"""The --json output of every command, run for real, against the published schemas (docs/json-schema/).

Each schema is also shown to reject what it must (a missing phase time, an
unknown exit name), so a schema that accepts anything would fail here.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from hibernate.errors import ExitCode
from tests.conftest import REPO, spill_root_of
from tests.standins.world import GIB, World

SCHEMAS = REPO / "docs" / "json-schema"
EXPECTED = {
    "sleep", "wake", "recover", "status", "ls", "doctor", "error", "gc", "export", "node-step", "serve-status"
}  # fmt: skip


def schema(name: str) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    return document


def problems(name: str, document: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema(name))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def valid(name: str, result: Any, code: int = 0) -> dict[str, Any]:
    """The JSON document of a CLI run, after checking its exit code and its schema."""
    assert result.returncode == code, result.stderr + result.stdout
    document: dict[str, Any] = json.loads(result.stdout)
    assert problems(name, document) == []
    return document


def test_every_schema_is_published_and_is_draft_2020_12() -> None:
    assert {p.name.removesuffix(".schema.json") for p in SCHEMAS.glob("*.schema.json")} == EXPECTED
    for name in EXPECTED:
        document = schema(name)
        jsonschema.Draft202012Validator.check_schema(document)
        assert document["$schema"] == "https://json-schema.org/draft/2020-12/schema"
        assert document["$id"] == f"urn:hibernate:json-schema:{name}" and document["title"]


def test_status_and_ls_print_the_same_shape() -> None:
    status, ls = schema("status"), schema("ls")
    for key in ("properties", "required", "$defs"):
        assert status[key] == ls[key]


def test_the_error_schema_knows_every_exit_code() -> None:
    names = schema("error")["$defs"]["error"]["properties"]["exit_name"]["enum"]
    assert sorted(names) == sorted(code.name for code in ExitCode if code != ExitCode.OK)


@pytest.mark.slow
def test_sleep_and_wake_with_cuda_have_a_timing_per_phase_and_per_step(
    world: World,
    start_demo: Callable[..., Any],
    cli: Callable[..., Any],
    work_dir: Path,
    checkpointer_kind: str,
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid, nbytes=2 * GIB)
    flags = ("--json", "--checkpointer", checkpointer_kind)
    asleep = valid("sleep", cli("sleep", str(demo.pid), "--to", str(work_dir), *flags))
    (process,) = asleep["processes"]
    assert set(process["phases"]) >= {"begin", "quiesce", "spill", "release"}
    (holder,) = asleep["cuda"]["processes"]
    assert holder["pid"] == demo.pid and set(holder["steps"]) == {"lock", "checkpoint"}

    status = valid("status", cli("status", str(demo.pid), "--json"))
    assert status["agents"][0]["state"] == "asleep"
    valid("ls", cli("ls", "--json"))

    woken = valid("wake", cli("wake", str(demo.pid), *flags))
    assert set(woken["processes"][0]["phases"]) >= {"begin", "restore", "resume"}
    assert set(woken["cuda"]["processes"][0]["steps"]) == {"restore", "unlock"}


def test_sleep_and_wake_without_cuda_and_with_a_selector(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demos = [start_demo(size_mb=16), start_demo(size_mb=16)]
    asleep = valid("sleep", cli("sleep", "--all", "--to", str(work_dir), "--json"))
    assert asleep["cuda"] == {"status": "none (skipped)", "processes": []}
    assert sorted(asleep["selection"]["agents"]) == sorted(d.pid for d in demos)
    valid("wake", cli("wake", "--all", "--json"))
    valid("gc", cli("gc", str(work_dir), "--json"))


@pytest.mark.slow
def test_sleep_all_lists_the_targets_it_skipped_because_they_already_sleep(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    first, second = start_demo(size_mb=16), start_demo(size_mb=16)
    assert cli("sleep", str(first.pid), "--to", str(work_dir), "-q").returncode == 0
    asleep = valid("sleep", cli("sleep", "--all", "--to", str(work_dir), "--json"))
    assert [p["pid"] for p in asleep["processes"]] == [second.pid]
    (skipped,) = asleep["skipped"]
    assert skipped["pid"] == first.pid and skipped["state"] == "asleep"
    assert skipped["snapshot"] and Path(skipped["snapshot"]).parent == spill_root_of(work_dir, first.pid)
    valid("wake", cli("wake", "--all", "--json"))


def test_doctor_on_this_machine_and_with_a_target(
    world: World, start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    world.register(demo.pid)
    report = valid("doctor", cli("doctor", str(demo.pid), "--to", str(work_dir), "--json"))
    assert report["ok"] is True and report["pid"] == demo.pid
    bare = {"HIBERNATE_LIBCUDA": "/nonexistent/libcuda.so.1", "HIBERNATE_CUDA_CHECKPOINT": "/nonexistent"}
    result = cli("doctor", "--json", env=bare)
    assert result.returncode in (0, ExitCode.UNSUPPORTED)
    assert problems("doctor", json.loads(result.stdout)) == []


@pytest.mark.parametrize(
    "args, code",
    [
        (["sleep", "999999999", "--to", "/tmp/unused"], ExitCode.NO_SUCH_PROCESS),
        (["wake", "--job", "12_3"], ExitCode.USAGE),
        (["status", "--cgroup", "/no/such/cgroup"], ExitCode.USAGE),
        (["doctor", "--checkpointer", "magic"], ExitCode.USAGE),
        (["gc", "/no/such/dir"], None),
    ],
)
def test_failures_print_the_error_document(
    cli: Callable[..., Any], runtime_dir: Path, args: list[str], code: int | None
) -> None:
    result = cli(*args, "--json")
    assert result.returncode != 0 and (code is None or result.returncode == code)
    document = json.loads(result.stdout)
    assert problems("error", document) == []
    assert document["error"]["exit_code"] == result.returncode


def test_recover_with_nothing_to_recover(start_demo: Callable[..., Any], cli: Callable[..., Any]) -> None:
    demo = start_demo(size_mb=16)
    document = valid("recover", cli("recover", str(demo.pid), "--json"))
    assert document["action"] == "none" and "nothing to recover" in document["message"]


@pytest.mark.slow
def test_recover_of_a_sleep_whose_command_was_killed(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    killed = cli(
        "sleep", str(demo.pid), "--to", str(work_dir), env={"HIBERNATE_FAULT": "sleep.after-release:kill"}
    )
    assert killed.returncode == -9, killed.stderr
    document = valid("recover", cli("recover", str(demo.pid), "--json"))
    # Every memory step had run: recover finishes the sleep (its CUDA stage, none here).
    assert document["action"] == "finished the interrupted sleep", document["action"]
    assert document["report"]["operation"] == "sleep" and document["report"]["directory"] is None
    assert valid("wake", cli("wake", str(demo.pid), "--json"))["processes"][0]["pid"] == demo.pid


def test_run_refuses_json_in_words_and_as_the_error_document(cli: Callable[..., Any], work_dir: Path) -> None:
    result = cli("run", "--to", str(work_dir), "--json", "--", sys.executable, "-c", "print('job output')")
    assert result.returncode == ExitCode.USAGE
    document = json.loads(result.stdout)
    assert problems("error", document) == []
    assert "run has no --json: the job owns stdout" in document["error"]["message"]


def test_node_step_reports_validate_on_commit_and_on_abort(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    barrier = work_dir / "barrier"
    barrier.mkdir()
    base = ["--barrier", str(barrier), "--node-index", "0", "--node-name", "n0", "--json"]
    committed = valid(
        "node-step", cli("node-step", "sleep", str(demo.pid), "--to", str(work_dir), "--nodes", "1", *base)
    )
    assert (
        committed["decision"]["verdict"] == "commit"
        and committed["report"]["processes"][0]["pid"] == demo.pid
    )
    assert spill_root_of(work_dir / "n0", demo.pid).is_dir()  # this node's snapshots go to DIR/<node>

    second = work_dir / "barrier2"
    second.mkdir()
    base[1] = str(second)
    aborted = cli("node-step", "wake", str(demo.pid), "--nodes", "2", "--barrier-timeout", "0.5", *base)
    document = valid("node-step", aborted, code=ExitCode.TIMEOUT)
    assert document["ok"] is False and document["decision"]["verdict"] == "abort"
    assert document["error"]["exit_name"] == "TIMEOUT"


# -- the schemas reject what they must ---------------------------------------------------------

SLEEP = {
    "ok": True,
    "operation": "sleep",
    "directory": "/snap",
    "seconds": 1.0,
    "processes": [
        {
            "pid": 42, "name": "proc-42", "snapshot": "/snap/proc-42/snap-000001", "total_bytes": 10,
            "written_bytes": 10, "reused_bytes": 0, "dropped_bytes": 0, "released_bytes": 10,
            "io_mode": "direct", "gb_per_s": 1.0, "rss_before": 100, "rss_after": 90, "pools": [],
            "phases": {"begin": 0.1, "quiesce": 0.1, "spill": 0.5, "release": 0.1},
        }
    ],
    "cuda": {
        "status": "checkpointed",
        "checkpointer": {"name": "driver", "path": "/usr/lib/libcuda.so.1"},
        "seconds": 0.2,
        "processes": [
            {"pid": 42, "state": "checkpointed", "seconds": 0.2, "steps": {"lock": 0.1, "checkpoint": 0.1}}
        ],
    },
}  # fmt: skip


def mutated(change: Any) -> dict[str, Any]:
    document = copy.deepcopy(SLEEP)
    change(document)
    return document


def test_a_complete_sleep_report_is_valid() -> None:
    assert problems("sleep", SLEEP) == []
    skipped = {"pid": 7, "name": "proc-7", "state": "asleep", "snapshot": "/snap/proc-7/snap-000001"}
    assert problems("sleep", {**SLEEP, "skipped": [skipped]}) == []


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["processes"][0]["phases"].pop("spill"),
        lambda d: d["processes"][0].pop("phases"),
        lambda d: d["cuda"]["processes"][0]["steps"].pop("checkpoint"),
        lambda d: d["cuda"].update(processes=[]),
        lambda d: d["processes"][0].update(written_bytes=-1),
        lambda d: d.update(operation="wake"),
        lambda d: d.update(ok=False),
        lambda d: d.update(skipped=[{"pid": 7, "name": None, "state": "running", "snapshot": None}]),
        lambda d: d.update(skipped=[{"pid": 7, "name": None, "state": "asleep"}]),
    ],
    ids=[
        "no spill time",
        "no phases",
        "no checkpoint step",
        "checkpointed nothing",
        "negative",
        "wake",
        "not ok",
        "skipped one awake",
        "skipped without its snapshot",
    ],
)
def test_a_sleep_report_missing_a_timing_or_a_field_is_not(change: Any) -> None:
    assert problems("sleep", mutated(change)) != []


def test_an_error_with_an_unknown_exit_name_or_no_hint_key_is_not_valid() -> None:
    error = {"code": "timeout", "message": "m", "hint": None, "exit_code": 10, "exit_name": "TIMEOUT"}
    assert problems("error", {"ok": False, "error": error}) == []
    assert problems("error", {"ok": False, "error": {**error, "exit_name": "SLOW"}}) != []
    assert problems("error", {"ok": False, "error": {k: v for k, v in error.items() if k != "hint"}}) != []


def test_a_recover_has_a_message_or_a_report_not_both() -> None:
    from hibernate.operation.reports import RecoverReport, SleepReport, WakeReport

    cuda = {"status": "running (nothing to restore)", "processes": []}
    finished = SleepReport(None, 0.5, [], {"status": "none (skipped)", "processes": []})
    for report in (
        RecoverReport("none", message="nothing to recover (42: running)"),
        RecoverReport("the interrupted sleep had completed"),
        RecoverReport("finished the interrupted sleep", finished),
        RecoverReport("undid the interrupted sleep", WakeReport(0.5, [], cuda)),
    ):
        assert problems("recover", {"ok": True, **report.to_wire()}) == [], report
    wire = {"ok": True, **RecoverReport("none", message="m").to_wire()}
    assert problems("recover", {**wire, "report": None}) != []
    assert problems("recover", {k: v for k, v in wire.items() if k != "action"}) != []
    assert problems("recover", {**wire, "operation": "wake"}) != []


def test_an_agent_in_an_unknown_state_is_not_valid() -> None:
    agent = {
        "pid": 1, "start_time": 2, "uid": 0, "name": "proc-1", "kind": "torch", "state": "asleep",
        "busy": None, "pools": [], "snapshot": None, "rss": 1, "command": "python",
    }  # fmt: skip
    assert problems("status", {"ok": True, "agents": [agent]}) == []
    assert problems("status", {"ok": True, "agents": [{**agent, "state": "dozing"}]}) != []


# -- shell completion ------------------------------------------------------------------------


def as_installed(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the CLI under the name its console script has (completion is keyed to the program name)."""
    code = "import sys; sys.argv[0] = 'hibernate'; from hibernate.cli import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, env=env
    )


def test_completion_is_offered_in_the_help() -> None:
    out = as_installed("--help").stdout
    assert "--install-completion" in out and "--show-completion" in out


def test_completion_completes_commands_and_the_new_options() -> None:
    def complete(words: str) -> list[str]:
        env = {**os.environ, "_HIBERNATE_COMPLETE": "complete_bash", "COMP_WORDS": words}
        env["COMP_CWORD"] = str(len(words.split()) - 1)
        return as_installed(env=env).stdout.split()

    assert complete("hibernate sle") == ["sleep"]
    assert {"--job", "--json"} <= set(complete("hibernate sleep --j"))
    assert complete("hibernate node") == ["node-step"]  # a command of its own: PBS users run it per node
    # The shell is named, not detected: typer detects it among this process's ancestors, and a test
    # run need not have one (typer's own tests set this variable for the same reason).
    named_shell = {**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    script = as_installed("--show-completion", "bash", env=named_shell).stdout
    assert "_HIBERNATE_COMPLETE=complete_bash" in script
