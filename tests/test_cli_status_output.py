"""What `status` and `ls` print for a person and for grep/awk: whole lines, piped or not.

The CLI's stdout is a pipe under these tests, as in a script: a table cut to
80 columns (what a rich table does off a terminal) would lose the snapshot's
path, which is what someone piping `status` most often looks for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.cli.render import AGENT_COLUMNS, LIST_COLUMNS, WIDE_COLUMNS, agent_lines, plain_columns

AGENT: dict[str, Any] = {
    "pid": 4242, "uid": 0, "name": "proc-4242", "kind": "torch", "state": "asleep", "busy": None,
    "pools": [{"bytes": 3 << 30, "keep": True}, {"bytes": 1 << 30, "keep": False}],
    "snapshot": {"path": "/scratch/" + "deep/" * 30 + "proc-4242/snap-000001"},
    "rss": 512 << 20, "command": "python train.py --epochs 3",
    "device_bytes": {"cuda:1": 2 << 30, "cuda:0": 1 << 30},
}  # fmt: skip


def test_columns_are_aligned_and_never_cut() -> None:
    lines = plain_columns(["PID", "STATE", "PATH"], [["7", "asleep", "/a/" * 60], ["12345", "running", "-"]],
                          right=frozenset({"PID"}))  # fmt: skip
    assert lines == ["  PID  STATE    PATH", "    7  asleep   " + "/a/" * 60, "12345  running  -"]
    assert plain_columns([], [["7", "x"]]) == ["7  x"]  # --no-headers
    assert plain_columns(["PID"], []) == ["PID"]


def test_a_row_is_one_line_whose_cells_split_on_blanks() -> None:
    (header, row) = agent_lines([AGENT], AGENT_COLUMNS)
    assert header.split() == AGENT_COLUMNS
    assert row.split() == [
        "4242",
        "torch",
        "asleep",
        "3.0GiB",
        "1.0GiB",
        "512.0MiB",
        AGENT["snapshot"]["path"],
    ]


def test_wide_adds_user_tracked_bytes_devices_and_the_command() -> None:
    (header, row) = agent_lines([AGENT], WIDE_COLUMNS)
    assert header.split() == WIDE_COLUMNS
    cells = row.split(maxsplit=len(WIDE_COLUMNS) - 1)
    shown = dict(zip(WIDE_COLUMNS, cells, strict=True))
    assert shown["USER"] == "root" and shown["BUSY"] == "-" and shown["TRACKED"] == "4.0GiB"
    assert shown["DEVICES"] == "cuda:0=1.0GiB,cuda:1=2.0GiB"
    assert shown["SNAPSHOT"] == AGENT["snapshot"]["path"] and shown["COMMAND"] == AGENT["command"]
    (row_alone,) = agent_lines([AGENT], LIST_COLUMNS, headers=False)
    assert row_alone.split() == ["4242", "root", "asleep", "torch", "proc-4242", *AGENT["command"].split()]


def test_ls_and_status_show_the_user_by_name_as_ps_does_else_by_number() -> None:
    nameless = 4_000_321  # no user of that number here: a container's, say
    rows = agent_lines(
        [AGENT, {**AGENT, "uid": nameless}, {**AGENT, "uid": None}], LIST_COLUMNS, headers=False
    )
    assert [row.split()[1] for row in rows] == ["root", str(nameless), "-"]
    (wide,) = agent_lines([AGENT], WIDE_COLUMNS, headers=False)
    assert wide.split()[1] == "root"


@pytest.mark.slow
def test_piped_status_prints_whole_lines_and_ls_lists_the_commands(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    deep = work_dir / ("a-directory-with-a-rather-long-name-" * 3)
    demo = start_demo(size_mb=16)
    assert cli("sleep", str(demo.pid), "--to", str(deep), "-q").returncode == 0
    agent = cli("status", str(demo.pid), "--json").json()["agents"][0]
    snapshot = agent["snapshot"]["path"]
    assert len(snapshot) > 120

    human = cli("status", str(demo.pid))
    assert human.returncode == 0, human.stderr
    header, row = human.stdout.splitlines()
    assert header.split() == AGENT_COLUMNS
    assert row.split()[:3] == [str(demo.pid), agent["kind"], "asleep"] and row.split()[-1] == snapshot

    (bare,) = cli("status", str(demo.pid), "--no-headers").stdout.splitlines()
    rss = AGENT_COLUMNS.index("RSS")  # the process's own, read anew by each call: it may move by a page

    def without_rss(cells: list[str]) -> list[str]:
        return cells[:rss] + cells[rss + 1 :]

    assert without_rss(bare.split()) == without_rss(row.split()) and len(bare.split()) == len(row.split())
    wide = cli("status", str(demo.pid), "--wide", "--no-headers").stdout.splitlines()
    (wide_row,) = wide
    assert wide_row.endswith(f"{snapshot}  {agent['command']}")

    listed = cli("ls").stdout.splitlines()
    assert listed[0].split() == LIST_COLUMNS
    (mine,) = [line for line in listed[1:] if line.split()[0] == str(demo.pid)]
    assert mine.endswith(agent["command"]) and snapshot not in mine
    assert cli("wake", str(demo.pid), "-q").returncode == 0
