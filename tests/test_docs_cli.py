"""The docs against the CLI: every command and option README.md and docs/ name is one the CLI has.

A doc that names a command ``hibernate`` does not list, or gives a command an
option it does not take, sends a reader to a usage error. So every piece of
code in the docs (fenced and indented blocks, inline spans, a span running over
several lines included) is read as a shell line would be:

- ``hibernate WORD`` where a command starts (the start of the code, after ``|``,
  ``;``, ``&&``, ``$(``, ``sudo``, ``exec``, ``-m``, ``--``, an option or a
  ``NAME=value``) must be a command ``hibernate -h`` lists;
- the options that follow it (up to the end of that command: a pipe, a ``;``,
  a ``)``, a ``#``, or ``--``, after which they are the program's) must be
  options of that command; likewise for ``hibernate-job``, ``hibernate-suspend``
  and ``hibernate-resume`` against their ``--help`` (what follows their ``--``
  goes to ``hibernate node-step``), and for the project's scripts
  (``scripts/gpu-check``, ``scripts/bench-store``, ...) against theirs;
- an option table under a heading that names a command (``## hibernate sleep``,
  the page ``hibernate serve``) lists that command's options;
- an option named on its own (a span that starts with it) is an option of a
  ``hibernate`` command, of the project's scripts (their ``--help``), or of one
  of the other programs below, each listed with its program.

The CLI is read from the typer app itself; the scripts' options from their help.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import typer

from hibernate.cli.app import app
from tests.conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

# Options of programs other than hibernate and its scripts that the docs name on their own.
FOREIGN = {
    "vllm serve": {
        "--host", "--port", "--uds", "--ssl-*", "--api-key", "--enable-sleep-mode", "--sleep-mode-backend",
        "--served-model-name", "--gpu-memory-utilization", "--disable-custom-all-reduce",
        "--enable-nccl-comm-suspend", "--sleep-mode-offload-cudagraph",
    },
    "Slurm (sbatch, srun, scancel)": {
        "--overlap", "--kill-on-bad-exit", "--wait", "--signal", "--gpus-per-node", "--jobid", "--batch",
        "--uid", "--gid", "--nodelist", "--requeue",
    },
    "cuda-checkpoint": {"--get-state", "--action", "--pid", "--toggle"},
    "pytest": {"-n", "-k", "-x", "-m"},
}  # fmt: skip


def script_help() -> dict[str, list[str]]:
    """The project's own scripts whose options the docs name, and how to ask each for its help: the
    Slurm commands, the Python scripts of scripts/ (gpu-check, ...), those the bench wrappers run
    (which would set up a virtual environment first), and the demo target."""
    commands = {
        name: [str(REPO / "scripts/slurm" / name), "--help"]
        for name in ("hibernate-job", "hibernate-suspend", "hibernate-resume")
    }
    for path in sorted((REPO / "scripts").iterdir()):
        if path.is_file() and "python" in path.read_text(errors="replace").partition("\n")[0]:
            commands[path.name] = [sys.executable, str(path), "--help"]
    for name in ("bench_store", "bench_serve", "bench_tensors", "bench_latency"):
        commands[name] = [sys.executable, str(REPO / "scripts/lib" / f"{name}.py"), "--help"]
    commands["hibernate.demo serve"] = [sys.executable, "-m", "hibernate.demo", "serve", "--help"]
    return commands


# Where what follows a script's `--` goes: hibernate-job and hibernate-suspend pass it to every node's step.
AFTER_DASHES = {"hibernate-job": "node-step", "hibernate-suspend": "node-step"}

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
OPTION = re.compile(r"(?<![\w./$-])(--?[a-zA-Z][\w-]*\*?)")
SUBSTITUTION = re.compile(r"\$\([^()]*\)")
# Where a command may start: the code's start, a shell connector, a prefix command, NAME=value.
STARTS = r"(?:^|[|;&(:]\s*|\$\(\s*|\b(?:sudo|exec|nohup|-m|--)\s+|[A-Z_][A-Z0-9_]*=\S*\s+)"
# A command, also after a launcher's option with its value (`srun ... --wait=0 hibernate node-step`).
HIBERNATE = re.compile(r"(?:" + STARTS + r"|--[\w-]+=\S*\s+)hibernate[ \t]+([a-z][\w-]*)")
HIBERNATE_OPTION = re.compile(STARTS + r"hibernate[ \t]+(--?[a-zA-Z][\w-]*)")
# What follows a word that is invoked as a command: nothing, or one space and an argument. A label in a
# program's output (`hibernate spill    2.36`, `hibernate restore (cold)`) is not a command named.
INVOKED = re.compile(r"\s*$| (?=[^\s(,])")
SCRIPT = re.compile(r"(?<![\w.-])(?:scripts/slurm/)?(hibernate-(?:job|suspend|resume))\b")
PROJECT_SCRIPT = re.compile(r"(?<![\w.-])(?:\./)?scripts/([\w-]+)\b(?!/)")


@dataclass(frozen=True)
class Code:
    """A piece of code in a doc, with where it is and the commands its section is about."""

    where: str
    text: str
    span: bool  # an inline span (else a line of a block)
    table_head: bool  # in the first cell of a table row
    section: frozenset[str]  # commands named by the innermost heading that names any


def section_commands(heading: str, commands: frozenset[str]) -> frozenset[str]:
    """The commands a heading is about (`## hibernate status and hibernate ls`)."""
    named = re.findall(r"(?<![\w.-])hibernate ([a-z][\w-]*)", heading.replace("`", ""))
    return frozenset(named) & commands


def code_in(markdown: str, name: str, commands: frozenset[str]) -> Iterator[Code]:
    """Every piece of code of a markdown page, in order; ``commands``: those a heading may be about."""
    headings: list[tuple[int, frozenset[str]]] = []  # (level, commands) of the headings above

    def section() -> frozenset[str]:
        return next((named for _, named in reversed(headings) if named), frozenset())

    fenced = indented = False
    previous_blank = True
    paragraph: list[tuple[int, str]] = []

    def spans() -> Iterator[Code]:
        """The inline spans of the paragraph read so far (a span may run over its lines)."""
        if not paragraph:
            return
        start = paragraph[0][0]
        text = "\n".join(line for _, line in paragraph)
        for match in CODE_SPAN.finditer(text):
            line_no = start + text.count("\n", 0, match.start())
            column = match.start() - text.rfind("\n", 0, match.start()) - 1
            head = in_first_cell(paragraph[line_no - start][1], column)
            yield Code(f"{name}:{line_no}", " ".join(match.group(2).split()), True, head, section())
        paragraph.clear()

    for number, line in enumerate(markdown.split("\n"), 1):
        if FENCE.match(line):
            yield from spans()
            fenced = not fenced
            previous_blank = False
            continue
        if fenced:
            yield Code(f"{name}:{number}", line.strip(), False, False, section())
            continue
        if line.startswith("    ") and (previous_blank or indented) and not paragraph:
            indented = True
            yield Code(f"{name}:{number}", line.strip(), False, False, section())
            continue
        indented = False
        previous_blank = not line.strip()
        heading = HEADING.match(line)
        if heading:
            yield from spans()
            level = len(heading.group(1))
            above = [h for h in headings if h[0] < level]
            headings = [*above, (level, section_commands(heading.group(2), commands))]
            continue
        if not line.strip() or line.lstrip().startswith("|"):
            yield from spans()  # a table row is a paragraph of its own
        if line.strip():
            paragraph.append((number, line))
            if line.lstrip().startswith("|"):
                yield from spans()
    yield from spans()


def in_first_cell(line: str, column: int) -> bool:
    """Whether ``column`` of ``line`` is in the first cell of a table row (``| here | ... |``)."""
    if not line.lstrip().startswith("|"):
        return False
    first = line.index("|")
    second = line.find("|", first + 1)
    return first < column < (second if second != -1 else len(line))


def joined_blocks(pieces: list[Code]) -> Iterator[Code]:
    """The pieces, a block's lines that end in a backslash joined with the next (one shell line)."""
    carried: Code | None = None
    for piece in pieces:
        if carried is not None and not piece.span:
            piece = Code(carried.where, carried.text[:-1] + " " + piece.text, False, False, carried.section)
        elif carried is not None:
            yield carried  # the block ended on a backslash
        carried = None
        if not piece.span and piece.text.endswith("\\"):
            carried = piece
            continue
        yield piece
    if carried is not None:
        yield carried


def options_in(words: str) -> list[str]:
    """The options a command line gives, up to the end of that command (or its ``--``)."""
    words = SUBSTITUTION.sub(" ", words)
    end = re.search(r"\s#|;|&&|\)|\|\s*(?!-)[\w./]|\s--(?:\s|$)", words)
    return OPTION.findall(words[: end.start() if end else len(words)])


def after_dashes(words: str) -> str:
    """What follows a command's own ``--`` (before any other command)."""
    words = SUBSTITUTION.sub(" ", words)
    end = re.search(r"\s#|;|&&|\)|\|\s*(?!-)[\w./]", words)
    words = words[: end.start() if end else len(words)]
    dashes = re.search(r"\s--(?:\s|$)", words)
    return words[dashes.end() :] if dashes else ""


@dataclass(frozen=True)
class Cli:
    """What the real CLI has: the commands ``hibernate -h`` lists and each command's options."""

    listed: frozenset[str]
    options: dict[str, frozenset[str]]
    root: frozenset[str]
    scripts: dict[str, frozenset[str]]

    def anywhere(self) -> frozenset[str]:
        known = set(self.root).union(*self.options.values(), *self.scripts.values(), *FOREIGN.values())
        return frozenset(known)


def option_names(command: object) -> frozenset[str]:
    """The options a command offers (``-h`` included); a hidden one (``run --json``, there only to be
    refused with a clear error) is not offered."""
    names = {"-h", "--help"}
    for param in getattr(command, "params", []):
        if param.param_type_name == "option" and not getattr(param, "hidden", False):
            names |= set(param.opts) | set(param.secondary_opts)
    return frozenset(names)


@cache
def real_cli() -> Cli:
    group = typer.main.get_command(app)
    commands = getattr(group, "commands", {})
    scripts = {}
    for script, argv in script_help().items():
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert result.returncode == 0, (script, result.stderr)
        scripts[script] = frozenset(OPTION.findall(result.stdout))
    return Cli(
        listed=frozenset(name for name, command in commands.items() if not command.hidden),
        options={name: option_names(command) for name, command in commands.items()},
        root=option_names(group) | {"--install-completion", "--show-completion"},
        scripts=scripts,
    )


def problems(markdown: str, name: str, cli: Cli) -> list[str]:
    """What a page names that the CLI does not have, one line each."""
    found = []
    anywhere = cli.anywhere()
    for piece in joined_blocks(list(code_in(markdown, name, frozenset(cli.options)))):
        text, place = piece.text, piece.where
        for match in HIBERNATE_OPTION.finditer(text):
            if match.group(1) not in cli.root:
                found.append(f"{place}: `hibernate {match.group(1)}`: hibernate has no such option")
        for match in HIBERNATE.finditer(text):
            word = match.group(1)
            if word not in cli.listed:
                if INVOKED.match(text, match.end()):
                    found.append(f"{place}: `hibernate {word}`: no such command in `hibernate -h`")
                continue
            for option in options_in(text[match.end() :]):
                if option not in cli.options[word]:
                    found.append(f"{place}: `hibernate {word} ... {option}`: {word} has no option {option}")
        for match in SCRIPT.finditer(text):
            script, rest = match.group(1), text[match.end() :]
            for option in options_in(rest):
                if option not in cli.scripts[script]:
                    found.append(f"{place}: `{script} ... {option}`: {script} has no option {option}")
            if script in AFTER_DASHES:
                step = AFTER_DASHES[script]
                for option in OPTION.findall(after_dashes(rest)):
                    if option not in cli.options[step]:
                        what = f"hibernate {step} has no option {option}"
                        found.append(f"{place}: `{script} ... -- {option}`: {what}")
        for match in PROJECT_SCRIPT.finditer(text):
            name = match.group(1)
            known = cli.scripts.get(name, cli.scripts.get(name.replace("-", "_")))
            if known is None:  # a script without options of its own to check (./scripts/test: pytest's)
                continue
            for option in options_in(text[match.end() :]):
                if option not in known:
                    found.append(f"{place}: `scripts/{name} ... {option}`: it has no option {option}")
        if not piece.span or not text.startswith("-"):
            continue
        named = OPTION.match(text)
        if named is None:
            continue
        if piece.table_head and piece.section:
            allowed = frozenset().union(*(cli.options.get(c, frozenset()) for c in piece.section))
            if named.group(1) not in allowed:
                commands = " or ".join(f"hibernate {c}" for c in sorted(piece.section))
                what = f"in the options of {commands}, which has no such option"
                found.append(f"{place}: `{named.group(1)}` {what}")
        elif named.group(1) not in anywhere:
            what = "an option of no hibernate command, script or program named"
            found.append(f"{place}: `{named.group(1)}`: {what}")
    return found


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_and_option_a_doc_names_is_one_the_cli_has(doc: Path) -> None:
    found = problems(doc.read_text(), str(doc.relative_to(REPO)), real_cli())
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "line, expected",
    [
        ("    hibernate sleep --all --frobnicate --to /snap", "sleep has no option --frobnicate"),
        ("Run `hibernate resume 4242` after a suspend.", "`hibernate resume`: no such command"),
        ("Run `hibernate node-step sleep --barrier /b --nodes 2 --quorum 2`.", "no option --quorum"),
        ("    scripts/slurm/hibernate-job wake -- --frobnicate", "node-step has no option --frobnicate"),
        ("    hibernate-job sleep --to /snap --quorum 2", "hibernate-job has no option --quorum"),
        ("`--frobnicate` makes it faster.", "`--frobnicate`: an option of no hibernate command"),
        ("    hibernate --frobnicate", "hibernate has no such option"),
        ("## hibernate wake\n\n| option | meaning |\n|---|---|\n| `--to DIR` | where |", "hibernate wake"),
        ("A span `srun --overlap\n--wait=0 hibernate node-step sleep --frobnicate`.", "--frobnicate"),
        ("    hibernate sleep \\\n        --frobnicate --to /snap", "sleep has no option --frobnicate"),
        ("    python3 scripts/gpu-check --frobnicate", "scripts/gpu-check ... --frobnicate"),
        ("    ./scripts/bench-store --size-mb 64 --frobnicate", "scripts/bench-store ... --frobnicate"),
    ],
)
def test_a_doc_that_names_what_the_cli_lacks_is_caught(line: str, expected: str) -> None:
    found = problems(line, "doc.md", real_cli())
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(
    "line",
    [
        "    hibernate sleep \"$(pgrep -f 'vllm serve' | head -1)\" --to /snap   # any pid",
        "    hibernate status --json | jq -r '.agents[0].state'",
        "    hibernate run --on-signal USR1 --to /snap -- python train.py --epochs 3",
        "    hibernate sleep --all | --job ID | --cgroup PATH --to DIR [options]",
        "    kubectl exec POD -c server -- hibernate sleep --all --to /snap",
        "an error says `not a hibernate snapshot`",
        "    scripts/slurm/hibernate-job wake -- --force",
        "`--enable-sleep-mode` and `--host 127.0.0.1` are vLLM's",
    ],
)
def test_what_the_docs_may_say_is_not_taken_for_a_mistake(line: str) -> None:
    assert problems(line, "doc.md", real_cli()) == []


def commands_in_table(markdown: str) -> set[str]:
    """The commands of a page's table of commands (rows whose first cell is `hibernate COMMAND ...`)."""
    return set(re.findall(r"^\| `hibernate ([a-z][\w-]*)[^`]*` \|", markdown, re.MULTILINE))


@pytest.mark.parametrize("doc", ["README.md", "docs/cli.md"])
def test_the_command_tables_list_every_command_hibernate_lists(doc: str) -> None:
    assert commands_in_table((REPO / doc).read_text()) == set(real_cli().listed)


def test_what_the_docs_say_takes_json_is_what_does() -> None:
    """ "Every command but X, Y and Z takes --json": X, Y and Z are exactly the commands without it."""
    cli = real_cli()
    without = {name for name in cli.listed if "--json" not in cli.options[name]}
    claims = 0
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        for match in re.finditer(r"Every command (?:but|except) ((?:`[a-z-]+`(?:, | and |,? or )?)+)", text):
            claims += 1
            assert set(re.findall(r"`([a-z-]+)`", match.group(1))) == without, (doc.name, match.group(0))
    assert claims >= 2  # the README's and docs/cli.md's
