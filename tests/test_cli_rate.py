"""One rate for a transfer: the progress bar and the report show the same GB/s for the same sleep.

The bar once took rich's estimate over its last updates (leaving out the
step's start, and counting reused chunks that pass in a burst) while the
report divided the written bytes by the whole step: 2.3 GB/s against 0.74
for one sleep. Both now come from progress.transfer_rate, over the same
bytes and the same clock.
"""

from __future__ import annotations

import pytest

from hibernate.cli.render import TerminalProgress
from hibernate.operation.progress import transfer_rate
from hibernate.operation.reports import ProcessSleep, ProcessWake

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


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_bar_shows_the_report_s_rate_for_the_same_sleep(capsys: pytest.CaptureFixture[str]) -> None:
    clock = Clock()
    spill = {"written_bytes": 1 * GB, "reused_bytes": 3 * GB, "total_bytes": 4 * GB, "seconds": 2.0}
    with TerminalProgress(enabled=True, clock=clock) as bar:  # stderr is no terminal here: its lines
        bar.step("spill")
        clock.now += 0.5  # the staging and planning before the first bytes: part of the step
        bar.transfer("spill", 3 * GB, 4 * GB)  # reused chunks, in a burst
        clock.now += 1.5
        bar.transfer("spill", 4 * GB, 4 * GB)
    last = capsys.readouterr().err.splitlines()[-1]
    report = ProcessSleep.from_answers(1, "p", {"spill": spill})
    assert last.endswith(f" at {report.gb_per_s:.2f} GB/s") and report.gb_per_s == 2.0
