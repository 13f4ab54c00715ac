"""One rate for a transfer: the progress bar and the report show the same GB/s for the same sleep.

The bar once took rich's estimate over its last updates (leaving out the
step's start, and counting reused chunks that pass in a burst) while the
report divided the written bytes by the whole step: 2.3 GB/s against 0.74
for one sleep. Both come from progress.transfer_rate, and the bar's last
rate is the report's own figure: the same bytes over the same seconds
(progress.side_by_side; several processes: the report's total line).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.operation.progress import side_by_side, transfer_rate
from hibernate.operation.reports import ProcessSleep, ProcessWake, total_rate

GB = 10**9


def test_the_rate_is_bytes_over_seconds_in_decimal_gigabytes() -> None:
    assert transfer_rate(3 * GB, 2.0) == 1.5
    assert transfer_rate(1_234_567_890, 1.0) == 1.235
    assert transfer_rate(0, 0.0) == 0.0  # a step that took no measurable time and moved nothing


def test_a_sleep_s_rate_counts_reused_bytes_as_the_bar_does() -> None:
    spill = {"written_bytes": 1 * GB, "reused_bytes": 3 * GB, "total_bytes": 4 * GB, "seconds": 2.0}
    process = ProcessSleep.from_answers(1, "p", {"spill": spill})
    assert process.gb_per_s == transfer_rate(4 * GB, 2.0) == 2.0
    woken = ProcessWake.from_answers(1, "p", None, {"restore": {"total_bytes": 4 * GB, "seconds": 4.0}})
    assert woken.gb_per_s == 1.0


def last_rate(lines: list[str], prefix: str) -> str:
    """The rate (``0.42 GB/s``) of the last of ``lines`` that starts with ``prefix``."""
    line = [line for line in lines if line.startswith(prefix)][-1]
    found = re.search(r" at (\d+\.\d\d GB/s)", line)
    assert found, line
    return found.group(1)


@pytest.mark.slow
def test_the_bar_ends_on_the_report_s_rate(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    """Piped, the bar prints plain lines on stderr: its last rate is the one the report prints,
    for one process (its own line) and for several (the report's total line)."""
    one, two = start_demo(size_mb=16), start_demo(size_mb=16)
    slept = cli("sleep", str(one.pid), "--to", str(work_dir))
    assert slept.returncode == 0, slept.stderr
    bar, report = slept.stderr.splitlines(), slept.stdout.splitlines()
    assert last_rate(bar, "spill: ") == last_rate(report, "  kept "), (bar, report)
    assert re.search(r"GB/s \(\w+ I/O, \d+ requests? in flight, \d+ workers\)", slept.stdout), report
    woken = cli("wake", str(one.pid))
    assert woken.returncode == 0, woken.stderr
    bar, report = woken.stderr.splitlines(), woken.stdout.splitlines()
    assert last_rate(bar, "restore: ") == last_rate(report, "  restored "), (bar, report)
    assert re.search(r"GB/s \(\w+ I/O, \d+ requests? in flight, \d+ workers\)", woken.stdout), report

    both = cli("sleep", str(one.pid), str(two.pid), "--to", str(work_dir))
    assert both.returncode == 0, both.stderr
    bar, report = both.stderr.splitlines(), both.stdout.splitlines()
    assert last_rate(bar, "spill: ") == last_rate(report, "total: kept "), (bar, report)
    woken = cli("wake", str(one.pid), str(two.pid))
    assert woken.returncode == 0, woken.stderr
    bar, report = woken.stderr.splitlines(), woken.stdout.splitlines()
    assert last_rate(bar, "restore: ") == last_rate(report, "total: restored "), (bar, report)


def test_the_total_of_processes_moved_at_once_is_all_their_bytes_over_the_longest() -> None:
    assert side_by_side([(4 * GB, 2.0), (2 * GB, 4.0)]) == (6 * GB, 4.0)
    assert side_by_side([(4 * GB, 2.0)]) == (4 * GB, 2.0)  # one: its own figures
    one = {"spill": {"written_bytes": 1 * GB, "reused_bytes": 3 * GB, "seconds": 2.0}}
    other = {"spill": {"written_bytes": 2 * GB, "reused_bytes": 0, "seconds": 1.0}}
    processes = [ProcessSleep.from_answers(1, "p", one), ProcessSleep.from_answers(2, "q", other)]
    assert total_rate(processes) == (6 * GB, 3.0)
    assert total_rate(processes[:1]) is None


def test_a_report_keeps_the_tuning_its_agent_reports_and_an_older_agent_s_has_none() -> None:
    tuning = {"io_depth": 8, "workers": 2, "filesystem": "fuse", "kind": "network"}
    spill = {"written_bytes": GB, "reused_bytes": 0, "seconds": 1.0, "tuning": tuning}
    assert ProcessSleep.from_answers(1, "p", {"spill": spill}).tuning == tuning
    restore = {"total_bytes": GB, "seconds": 1.0, "tuning": tuning}
    assert ProcessWake.from_answers(1, "p", None, {"restore": restore}).tuning == tuning
    assert ProcessWake.from_answers(1, "p", None, {"restore": {"total_bytes": GB}}).tuning is None


def test_inside_a_transfer_begins_at_its_first_byte_not_at_a_report_that_it_is_preparing() -> None:
    """The ``during`` fault point of a spill or restore lands where bytes move: a report of the
    preparation (no bytes yet) leaves it for later; a transfer with nothing to move is inside at once."""
    from hibernate.operation.progress import ByteCounter, ProgressSink

    inside: list[str] = []
    update = ByteCounter(ProgressSink(), "restore", lambda: inside.append("during")).for_member(1)
    update({"phase": "restore", "done": 0, "total": 4096})
    assert inside == []
    update({"phase": "restore", "done": 1024, "total": 4096})
    assert inside == ["during"]
    empty: list[str] = []
    ByteCounter(ProgressSink(), "restore", lambda: empty.append("during")).for_member(1)(
        {"phase": "restore", "done": 0, "total": 0}
    )
    assert empty == ["during"]


@pytest.mark.parametrize(
    ("depth", "workers", "words"),
    [
        (8, 2, "direct I/O, 8 requests in flight, 2 workers"),
        (1, 1, "direct I/O, 1 request in flight, 1 worker"),
    ],
)
def test_how_a_transfer_ran_is_said_in_words(depth: int, workers: int, words: str) -> None:
    from hibernate.cli.render import _how

    assert _how("direct", {"io_depth": depth, "workers": workers}) == words
    assert _how("buffered", None) == "buffered I/O"  # an agent that does not report its tuning
    # A snapshot found in the page cache, whole or in part.
    assert _how("cached", {"io_depth": depth, "workers": workers}) == words.replace("direct", "page-cache")
    assert _how("cached+direct", None) == "page-cache and direct I/O"
