"""The operation engine: layers, one place per fact, the recovery table, and a third kind of target.

The toy kind (tests/toy_flow.py) is one module plus one registration line; it
goes through sleep, wake, a failure at each of its steps (undone) and a
SIGKILL of the CLI at each step (recovered) with nothing of its own but two
no-op memory steps.
"""

from __future__ import annotations

import ast
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
from hibernate.integrations import VLLM_KIND
from hibernate.operation import registry
from hibernate.operation.engine import sleep_points, wake_points
from hibernate.operation.recovery import Action, UnitRecord, decide
from tests import toy_flow
from tests.conftest import CliResult, wait_until
from tests.standins.world import GIB, World

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hibernate"

# Lower layers never import the engine or anything above it; the engine never imports a flow.
ABOVE_THE_ENGINE = (
    "hibernate.orchestrator",
    "hibernate.flows",
    "hibernate.integrations",
    "hibernate.cli",
    "hibernate.sched",
    "hibernate.serve",
)
LOWER = ("hibernate.store", "hibernate.pools", "hibernate.agent", "hibernate.checkpoint")


# -- the shape -------------------------------------------------------------------------------


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def run_at_import(tree: ast.Module) -> Iterator[ast.AST]:
    """The nodes a module runs when it is imported: not function bodies, not ``if TYPE_CHECKING:``."""
    for statement in tree.body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(statement, ast.If) and "TYPE_CHECKING" in ast.unparse(statement.test):
            continue
        yield from ast.walk(statement)


def imports_of(path: Path, modules: set[str], *, at_import: bool = False) -> set[str]:
    """Every hibernate module ``path`` imports, at any depth of its code (lazy imports count), or
    only those importing it loads at once (``at_import``)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in run_at_import(tree) if at_import else ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            names = [f"{base}.{alias.name}" for alias in node.names]
            submodules = [name for name in names if name in modules]
            # `from package import module` loads the package first, as every import of a submodule
            # does: that is the parent relation, not a dependency on what the package's face offers.
            found.update(submodules if len(submodules) == len(names) else [base, *submodules])
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {name: imports_of(path, modules) - {name} for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "hibernate.operation.engine" in graph and graph["hibernate.orchestrator"]
    assert cycles(graph) == []


def test_no_layer_imports_one_above_it() -> None:
    graph = import_graph()
    wrong = [
        (module, imported)
        for module, imported_set in graph.items()
        for imported in imported_set
        if (within(module, LOWER) and within(imported, ("hibernate.operation", *ABOVE_THE_ENGINE)))
        or (within(module, ("hibernate.operation",)) and within(imported, ABOVE_THE_ENGINE))
    ]
    assert wrong == []


# -- the two sides of the program --------------------------------------------------------------
#
# Code inside a target runs in the user's program (loaded by `import hibernate`, or by vLLM's
# plugin loader); code outside it runs in the `hibernate` command, serve and scheduler hooks. A
# package's face may hold names both sides share (integrations.VLLM_KIND, checkpoint.HELPER_ENV)
# and loads nothing; every module of checkpoint/ acts on a process from outside it.

IN_THE_TARGET = (
    "hibernate.agent.local",
    "hibernate.agent.controller",
    "hibernate.agent.server",
    "hibernate.agent.guard",
    "hibernate.agent.leases",
    "hibernate.agent.signals",
    "hibernate.agent.crash",
    "hibernate.pools",
    "hibernate.store",
    "hibernate.integrations",
)
OUTSIDE_THE_TARGET = (
    "hibernate.cli",
    "hibernate.orchestrator",
    "hibernate.operation",
    "hibernate.flows",
    "hibernate.sched",
    "hibernate.serve",
)
SHARED_FACES = ("hibernate.integrations", "hibernate.checkpoint")


def in_the_target(name: str) -> bool:
    return within(name, IN_THE_TARGET) and name not in SHARED_FACES


def outside_the_target(name: str) -> bool:
    return within(name, OUTSIDE_THE_TARGET) or name.startswith("hibernate.checkpoint.")


def reachable(graph: dict[str, set[str]], start: list[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(start)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(graph[name])
    return seen


def test_code_inside_a_target_reaches_nothing_of_the_cli_side() -> None:
    graph = import_graph()
    inside = ["hibernate", *(name for name in graph if in_the_target(name))]
    assert "hibernate.agent.controller" in inside and "hibernate.store.reader" in inside
    assert sorted(name for name in reachable(graph, inside) if outside_the_target(name)) == []


def test_the_cli_side_loads_code_of_the_target_only_inside_the_commands_that_read_snapshots() -> None:
    # At import, nothing of the target side (a scheduler hook on a node without torch stays light);
    # inside a function, only the store: `gc` reads snapshots, `doctor` measures the disk under one.
    graph = import_graph()
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    cli_side = sorted(name for name in graph if outside_the_target(name))
    assert "hibernate.cli" in cli_side and "hibernate.flows.vllm" in cli_side
    at_import = {
        name: sorted(m for m in imports_of(files[name], set(files), at_import=True) if in_the_target(m))
        for name in cli_side
    }
    assert {name: found for name, found in at_import.items() if found} == {}
    anywhere = {m for name in cli_side for m in graph[name] if in_the_target(m)}
    assert sorted(m for m in anywhere if not m.startswith("hibernate.store.")) == []


def test_every_kind_this_hibernate_ships_is_a_module_of_flows() -> None:
    probe = (
        "import json, hibernate.flows\n"
        "from hibernate.operation import registry\n"
        "print(json.dumps({r.kind: r.module for r in registry.registrations()}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True)
    where = json.loads(out.stdout)
    assert set(where) == {registry.PLAIN, VLLM_KIND}
    assert {kind: module for kind, module in where.items() if not module.startswith("hibernate.flows.")} == {}
    assert not any(
        name.startswith("hibernate.flows") for name in import_graph()["hibernate.operation.engine"]
    )


def test_the_vllm_kind_is_named_in_one_place() -> None:
    places = [
        f"{path.relative_to(REPO)}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        for line in path.read_text().splitlines()
        if '"vLLM"' in line
    ]
    assert places == ['hibernate/integrations/__init__.py: VLLM_KIND = "vLLM"'], places


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
