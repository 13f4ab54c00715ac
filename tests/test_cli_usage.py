"""A bad command line under --json: one error document on stdout, exit 2, for every command.

Scripts parse stdout; the first thing to go wrong in a script is often a flag
(a variable left empty, an option of a newer version), and a rich box on
stderr with nothing on stdout leaves the script nothing to parse.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jsonschema
import pytest
import typer

from hibernate.cli.app import app, main, wants_json
from hibernate.errors import ExitCode
from tests.conftest import REPO, run_cli

ERROR_SCHEMA = json.loads((REPO / "docs" / "json-schema" / "error.schema.json").read_text())


def commands_with_json() -> dict[str, Any]:
    """Every command that takes --json, by name (click's commands, as typer builds them)."""
    group = typer.main.get_command(app)
    return {
        name: command
        for name, command in group.commands.items()  # type: ignore[attr-defined]
        if any("--json" in param.opts and not getattr(param, "hidden", False) for param in command.params)
    }


def a_usage_error_document(stdout: str) -> dict[str, Any]:
    """The one JSON document of stdout, checked against the error schema as a usage error."""
    document: dict[str, Any] = json.loads(stdout)  # one document: json.loads refuses anything after it
    assert list(jsonschema.Draft202012Validator(ERROR_SCHEMA).iter_errors(document)) == []
    assert document["error"]["code"] == "usage" and document["error"]["exit_code"] == ExitCode.USAGE
    return document


def run_in_process(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> Any:
    monkeypatch.setattr(sys, "argv", ["hibernate", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    return exited.value.code, capsys.readouterr()


WITH_JSON = ["sleep", "wake", "recover", "status", "ls", "gc", "export", "node-step", "doctor"]


@pytest.mark.parametrize(
    "args, words",
    [
        (["sleep", "--json"], "Missing option '--to'"),
        (["sleep", "--to", "/tmp/unused", "--frobnicate", "--json"], "No such option: --frobnicate"),
        (["sleep", "abc", "--to", "/tmp/unused", "--json"], "'abc'"),
        (["sleep", "--to", "", "--json"], "an empty string names no directory"),
        (["sleep", "--to", "/tmp/unused", "--buffer-mb", "lots", "--json"], "--buffer-mb"),
    ],
    ids=["missing --to", "unknown option", "abc as a pid", "empty --to", "a word as a number"],
)
def test_a_sleep_s_usage_errors_are_one_json_document(args: list[str], words: str) -> None:
    result = run_cli(*args)
    assert result.returncode == ExitCode.USAGE
    document = a_usage_error_document(result.stdout)
    assert words in document["error"]["message"]
    assert "hibernate sleep --help" in document["error"]["hint"]


@pytest.mark.parametrize("name", WITH_JSON)
def test_every_command_with_json_reports_an_unknown_option_as_json(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert sorted(commands_with_json()) == sorted(WITH_JSON)
    code, output = run_in_process(capsys, monkeypatch, name, "--no-such-flag", "--json")
    assert code == ExitCode.USAGE, output.err
    assert "No such option: --no-such-flag" in a_usage_error_document(output.out)["error"]["message"]
    code, output = run_in_process(capsys, monkeypatch, name, "--no-such-flag")  # without: as it was
    assert code == ExitCode.USAGE and output.out == "" and "No such option" in output.err


@pytest.mark.parametrize(
    "args",
    [
        ["sleep", "12", "x3", "--to", "/tmp/unused"],
        ["wake", "abc"],
        ["recover", "abc"],
        ["status", "abc"],
        ["doctor", "abc"],
        ["node-step", "sleep", "abc", "--barrier", "/tmp/unused"],
        ["node-step", "sleep"],
        ["gc"],
        ["export"],
    ],
)
def test_bad_and_missing_values_are_reported_as_json(
    args: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, output = run_in_process(capsys, monkeypatch, *args, "--json")
    assert code == ExitCode.USAGE, output.err
    a_usage_error_document(output.out)
    assert output.err == ""


@pytest.mark.parametrize(
    "args, expected",
    [
        (["sleep", "--json"], True),
        (["sleep", "12"], False),
        (["run", "--to", "d", "--", "job", "--json"], False),
        (["run", "--json", "--to", "d", "--", "job", "--json"], True),
        (["run", "true", "--json"], False),  # the job's: run's options end at its first word
        (["run", "--to", "d", "job", "--json"], False),
        (["run", "--to", "d", "--json", "job"], True),
        (["run", "--to=d", "--json", "job"], True),
    ],
)
def test_json_is_asked_for_by_the_command_s_own_words_not_a_job_s(args: list[str], expected: bool) -> None:
    assert wants_json(args) is expected


def test_a_job_s_json_does_not_turn_run_s_usage_error_into_a_document(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    code, output = run_in_process(capsys, monkeypatch, "run", "true", "--json")  # --to is missing
    assert code == ExitCode.USAGE
    assert output.out == "" and "Missing option '--to'" in output.err
