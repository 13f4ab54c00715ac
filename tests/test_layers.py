"""The layers of the package: no import cycle, no layer importing one above it, code inside a
target reaching nothing of the CLI side, and one place per fact (the kinds this hibernate ships).

The import graph is read from the source (``ast``), imports inside functions included.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from hibernate.integrations import VLLM_KIND
from hibernate.operation import registry

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "hibernate"

# Lower layers never import the engine or anything above it; the engine never imports a flow.
ABOVE_THE_ENGINE = (
    "hibernate.orchestrator",
    "hibernate.flows",
    "hibernate.integrations",
    "hibernate.cli",
    "hibernate.doctor",
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
    "hibernate.doctor",
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
