"""The help every command prints: `-h` as `--help`, placeholders a user can read, choices and defaults."""

from __future__ import annotations

import re
import sys

import pytest
import typer

from hibernate.cli.app import app, main

COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def help_of(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    monkeypatch.setattr(sys, "argv", ["hibernate", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    output = capsys.readouterr()
    assert exited.value.code in (0, None), output.err
    return output.out


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_h_is_help_everywhere(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    words = [command] if command else []
    long = help_of(capsys, monkeypatch, *words, "--help")
    assert long.startswith("Usage: ")
    assert help_of(capsys, monkeypatch, *words, "-h") == long
    assert "-h, --help" in long


@pytest.mark.parametrize("command", COMMANDS)
def test_placeholders_are_words_not_python_types(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = help_of(capsys, monkeypatch, command, "--help")
    assert not re.search(r"<(bool|int|float|str|path|Path|list\[\w+\])>", text), text
    assert not re.search(r"\{[A-Za-z_]+\}", text), text  # a required argument is DIR, not {DIR}
    for param in typer.main.get_command(app).commands[command].params:  # type: ignore[attr-defined]
        if not getattr(param, "is_flag", False) and param.name != "help":
            assert param.metavar, f"hibernate {command}: {param.name} has no placeholder"


def test_a_sleep_s_help_shows_placeholders_choices_and_defaults(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = " ".join(help_of(capsys, monkeypatch, "sleep", "-h").split())  # one line: wrapping aside
    assert re.search(r"^Usage: .*hibernate sleep \[OPTIONS\] \[PID\]\.\.\. ", text)
    for shown in (
        "--to DIR",
        "--timeout SECONDS",
        "--buffer-mb MIB",
        "--io-mode [auto|direct|buffered]",
        "--checkpointer [auto|driver|binary|none]",
        "--level [1|2]",
        "--drain [wait|abort]",
        "[default: 30.0]",
        "[default: 256]",
        "[default: auto]",
        "--to DIR Directory for the snapshots (created 0700 if missing). [required]",
    ):
        assert shown in text


def test_a_required_argument_is_named_plainly_in_the_usage_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert " gc [OPTIONS] DIR\n" in help_of(capsys, monkeypatch, "gc", "-h")
    assert " run [OPTIONS] COMMAND...\n" in help_of(capsys, monkeypatch, "run", "-h")
