"""The typed wire between an agent and its clients (hibernate/agent/wire.py).

An agent's status is read by one type on the CLI side, whatever hibernate the
agent runs: an older agent's status (the one of commit 5a727c1, before
``graphs``) and a newer one's (keys and states this hibernate does not know)
are read without error and given back as they came. Agent states are compared
through ``AgentState`` everywhere a status is read: a scan of those modules
finds no state compared as a word.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest

from hibernate.agent.wire import (
    AgentState,
    AgentStatus,
    ConfigureArgs,
    LeaseArgs,
    SpillArgs,
    TransferArgs,
    WaitArgs,
    parse_state,
    state_of,
)
from hibernate.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
OLD_COMMIT = "5a727c1"

# What an agent of commit 5a727c1 answers to `status` (a process asleep), key for key and in its
# order: everything today's sends but ``graphs``.
OLD_AGENT_STATUS: dict[str, Any] = {
    "hibernate": "0.1.0",
    "pid": 4242,
    "start_time": 987654,
    "pid_namespace": 4026531836,
    "uid": 1000,
    "name": "proc-4242",
    "kind": "torch",
    "state": "asleep",
    "busy": None,
    "guard_holders": 0,
    "leases": {"held": 0, "holders": [], "closed_by": []},
    "pools": [{"pool": "tensors", "device": "cpu", "keep": True, "regions": 2, "bytes": 8388608}],
    "device_bytes": {},
    "snapshot": {"dir": "/snapshots/proc-4242-ab12", "snapshot": "s-0001", "path": "/snapshots/x/s-0001"},
    "default_dir": None,
    "sleep_driver": None,
    "self_checkpoint": False,
    "transfer": {"phase": "spill", "done": 8388608, "total": 8388608, "unix": 1700000000.5},
    "last_operation": None,
    "restore_refusal": None,
    "torch": {"version": "2.5.1", "cuda": None, "warning": None},
}
TODAY_AGENT_STATUS: dict[str, Any] = {
    **OLD_AGENT_STATUS,
    "graphs": [{"id": 1, "pool_bytes": 0, "captured_unix": 1700000000.0}],
}


def test_the_status_of_todays_agent_comes_back_as_it_was_sent() -> None:
    status = AgentStatus.from_wire(TODAY_AGENT_STATUS)
    assert status.state is AgentState.ASLEEP and status.runtime == "torch" and status.version == "0.1.0"
    assert status.snapshot_path == "/snapshots/x/s-0001" and status.leases is not None
    assert status.graphs is not None and len(status.graphs) == 1
    assert status.extra == {} and status.absent == frozenset()
    wire = status.to_wire()
    assert wire == TODAY_AGENT_STATUS and list(wire) == list(TODAY_AGENT_STATUS)


def test_the_status_of_an_agent_of_5a727c1_reads_with_neutral_defaults_and_comes_back_unchanged() -> None:
    status = AgentStatus.from_wire(OLD_AGENT_STATUS)
    assert status.state is AgentState.ASLEEP and status.pid == 4242
    assert status.graphs is None, "an agent that reports no graphs is left out of doctor's graph check"
    assert status.absent == {"graphs"}
    wire = status.to_wire()
    assert wire == OLD_AGENT_STATUS and list(wire) == list(OLD_AGENT_STATUS)


def test_the_old_agent_fixture_holds_the_keys_its_commit_answers() -> None:
    """OLD_AGENT_STATUS against the status() of 5a727c1 itself, where the checkout has that commit."""
    shown = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{OLD_COMMIT}:hibernate/agent/controller.py"],
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        pytest.skip(f"commit {OLD_COMMIT} is not in this checkout's history (a shallow clone)")
    status = next(
        node
        for node in ast.walk(ast.parse(shown.stdout))
        if isinstance(node, ast.FunctionDef) and node.name == "status"
    )
    returned = next(n.value for n in ast.walk(status) if isinstance(n, ast.Return) and n.value is not None)
    assert isinstance(returned, ast.Dict)
    assert [ast.literal_eval(key) for key in returned.keys if key is not None] == list(OLD_AGENT_STATUS)


def test_a_newer_agents_unknown_keys_and_state_are_kept_without_error() -> None:
    newer = {**TODAY_AGENT_STATUS, "state": "hibernating", "pid_namespace": "ns:7", "future": {"a": 1}}
    status = AgentStatus.from_wire(newer)
    assert status.state is None and status.state_word == "hibernating"
    assert status.pid_namespace is None, "a value this hibernate cannot read is not guessed at"
    assert status.extra == {"state": "hibernating", "pid_namespace": "ns:7", "future": {"a": 1}}
    wire = status.to_wire()
    assert wire == newer and list(wire) == list(newer)


def test_an_agent_whose_pid_namespace_is_no_number_is_not_taken_for_the_target(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Identity decides which process is acted on: a namespace that cannot be read is not guessed
    at as "the same", whatever the rest of the answer says."""
    from hibernate import procinfo
    from hibernate.operation import targets

    ident = procinfo.identity(os.getpid())
    assert ident is not None
    hello = {**TODAY_AGENT_STATUS, "pid": ident.pid, "start_time": ident.start_time}

    class Answering:
        answer: ClassVar[dict[str, Any]] = {}

        def __init__(self, path: Path, timeout: float) -> None:
            pass

        def __enter__(self) -> Answering:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def call(self, op: str) -> dict[str, Any]:
            return self.answer

    monkeypatch.setattr(targets, "AgentClient", Answering)
    Answering.answer = {**hello, "pid_namespace": procinfo.pid_namespace()}
    assert targets.probe_agent(ident, Path("agent.sock")) is not None
    Answering.answer = {**hello, "pid_namespace": "ns:7"}
    assert targets.probe_agent(ident, Path("agent.sock")) is None


def test_an_empty_status_reads_as_all_neutral_and_gives_back_nothing() -> None:
    status = AgentStatus.from_wire({})
    assert status == AgentStatus(absent=status.absent)
    assert (
        status.state is None and status.leases is None and status.pools == () and status.snapshot_path is None
    )
    assert status.to_wire() == {}


def test_a_status_built_in_code_carries_every_key() -> None:
    wire = AgentStatus(pid=1, state=AgentState.RUNNING).to_wire()
    assert list(wire) == list(TODAY_AGENT_STATUS)
    assert (
        wire["state"] == "running" and wire["kind"] == "" and wire["pools"] == [] and wire["graphs"] is None
    )


def test_a_state_is_read_only_from_words_this_hibernate_knows() -> None:
    assert [parse_state(s.value) for s in AgentState] == list(AgentState)
    assert parse_state("hibernating") is None and parse_state(None) is None and parse_state(3) is None
    assert state_of({"state": "running"}) is AgentState.RUNNING
    assert state_of(None) is None and state_of({}) is None


# -- the requests -----------------------------------------------------------------------------


def test_each_requests_arguments_travel_with_their_wire_keys() -> None:
    transfer = TransferArgs(buffer_mb=64, chunk_mb=8, io_mode="buffered", verify=True)
    assert SpillArgs("/snapshots", transfer).to_wire() == {
        "dir": "/snapshots",
        "buffer_mb": 64,
        "chunk_mb": 8,
        "io_mode": "buffered",
        "verify": True,
        "skip_reuse_check": False,
        "allow_moves": False,
    }
    assert SpillArgs.from_wire(SpillArgs("/snapshots", transfer).to_wire()) == SpillArgs(
        "/snapshots", transfer
    )
    assert TransferArgs.from_wire(transfer.to_wire()) == transfer
    assert TransferArgs.from_wire({}) == TransferArgs()
    keeping = TransferArgs(keep_staging_mb=0)  # 0 is said (give it back), not left to the process
    assert keeping.to_wire()["keep_staging_mb"] == 0 and TransferArgs.from_wire(keeping.to_wire()) == keeping
    assert (
        WaitArgs.from_wire(WaitArgs(2.5).to_wire()) == WaitArgs(2.5)
        and WaitArgs.from_wire({}).timeout == 30.0
    )
    assert LeaseArgs.from_wire(LeaseArgs("serve").to_wire()) == LeaseArgs("serve")
    assert ConfigureArgs.from_wire(ConfigureArgs(None).to_wire()) == ConfigureArgs(None)
    assert ConfigureArgs(None).to_wire() == {"dir": None}


@pytest.mark.parametrize(
    ("read", "args", "words"),
    [
        (WaitArgs.from_wire, {"timeout": -1}, "timeout must be a non-negative number, got -1"),
        (WaitArgs.from_wire, {"timeout": True}, "timeout must be a non-negative number, got True"),
        (LeaseArgs.from_wire, {"by": "x" * 65}, "by must be a short printable string"),
        (
            ConfigureArgs.from_wire,
            {"dir": "relative"},
            "dir must be an absolute path or null, got 'relative'",
        ),
        (SpillArgs.from_wire, {"dir": 3}, "dir must be an absolute path, got 3"),
        (SpillArgs.from_wire, {"buffer_mb": 0}, "buffer_mb must be a positive integer, got 0"),
        (TransferArgs.from_wire, {"chunk_mb": "8"}, "chunk_mb must be a positive integer, got '8'"),
        (
            TransferArgs.from_wire,
            {"keep_staging_mb": -1},
            "keep_staging_mb must be an integer of 0 or more, got -1",
        ),
    ],
)
def test_the_agent_refuses_arguments_it_cannot_use_naming_them(
    read: Any, args: dict[str, Any], words: str
) -> None:
    with pytest.raises(UsageError, match=words.replace("(", r"\(")):
        read(args)


# -- both sides import it ---------------------------------------------------------------------


def test_the_wire_loads_nothing_but_the_standard_library_and_the_errors() -> None:
    probe = (
        "import json, sys\n"
        "import hibernate\n"
        "before = set(sys.modules)\n"
        "import hibernate.agent.wire\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    loaded = json.loads(out.stdout)
    ours = {name for name in loaded if name.startswith("hibernate")}
    assert (
        ours <= {"hibernate.agent", "hibernate.agent.wire", "hibernate.errors"}
        and "hibernate.agent.wire" in ours
    )
    assert [
        name for name in loaded if name.split(".")[0] not in (*sys.stdlib_module_names, "hibernate")
    ] == []


# -- agent states are compared through the wire type ---------------------------------------
#
# Every module that reads an agent's status. A word of an agent state compared there (==, !=,
# in) or keying a table would be a second spelling of AgentState; the few comparisons of the same
# words that are not of an agent's state are named here, each with what it compares.

READERS = (
    "hibernate/operation",
    "hibernate/flows",
    "hibernate/serve/control.py",
    "hibernate/serve/leases.py",
    "hibernate/cli/render.py",
    "hibernate/cli/operations.py",
    "hibernate/doctor",
    "hibernate/store/maintenance.py",
)
NOT_AGENT_STATES = {
    ("hibernate/operation/cuda.py", "states.get(p) == 'running'"): "a CUDA holder's driver state",
    ("hibernate/operation/ledger.py", "'running': [call.describe()"): "a journal's helper calls under way",
    ("hibernate/serve/leases.py", "a.get('reason') != 'asleep'"): "why an agent refused a lease",
}
STATE_WORDS = {state.value for state in AgentState}


def _reader_files() -> list[Path]:
    found: list[Path] = []
    for name in READERS:
        path = REPO / name
        found.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return found


def _state_words_in(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in STATE_WORDS
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_state_words_in(item) for item in node.elts)
    return False


def _spells_a_state(node: ast.AST) -> bool:
    """A comparison with a state's word on either side, or a table keyed by one."""
    if isinstance(node, ast.Compare):
        return any(_state_words_in(n) for n in (node.left, *node.comparators))
    if isinstance(node, ast.Dict):
        return any(key is not None and _state_words_in(key) for key in node.keys)
    return False


def state_words_compared(tree: ast.AST) -> list[ast.AST]:
    return [node for node in ast.walk(tree) if _spells_a_state(node)]


def test_the_scan_finds_states_compared_as_words() -> None:
    written = """
if status.get("state") == "asleep": pass
if state not in ("running", "asleep"): pass
plan = {"asleep": ("restore", "resume")}.get(state, ())
if status.state is AgentState.ASLEEP: pass
"""
    assert [ast.unparse(n).split(":")[0] for n in state_words_compared(ast.parse(written))] == [
        "status.get('state') == 'asleep'",
        "state not in ('running', 'asleep')",
        "{'asleep'",
    ]


def test_agent_states_are_compared_through_the_wire_type_everywhere_a_status_is_read() -> None:
    files = _reader_files()
    assert len(files) > 10 and all(path.exists() for path in files)
    found = [
        (str(path.relative_to(REPO)), ast.unparse(node))
        for path in files
        for node in state_words_compared(ast.parse(path.read_text()))
    ]

    def excepted(where: str, source: str) -> tuple[str, str] | None:
        return next(((p, s) for p, s in NOT_AGENT_STATES if p == where and s in source), None)

    assert [(where, source) for where, source in found if excepted(where, source) is None] == []
    used = {excepted(where, source) for where, source in found}
    assert set(NOT_AGENT_STATES) <= used, "an exception that no longer exists: take it out of the list"
