"""The progress lines of a transfer, piped (plain lines on stderr): no rate is said before there is
one, then the rate of the bytes moved since the step began."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hibernate.cli.render import TerminalProgress

GB = 10**9


def test_the_first_line_says_no_rate_until_bytes_have_moved(capsys: pytest.CaptureFixture[str]) -> None:
    times: Iterator[float] = iter((990.0, 1000.0, 1000.5, 1003.0, 1003.5))  # made, then each call
    with TerminalProgress(enabled=True, clock=lambda: next(times)) as progress:
        assert not progress.interactive  # stderr is not a terminal here: one line at a time
        progress.step("spill")  # 1000.0: the step begins
        progress.transfer("spill", 0, 4 * GB)  # 1000.5: the first line, nothing moved yet
        progress.transfer("spill", 3 * GB, 4 * GB)  # 1003.0: 2 s or more since the last line
        progress.transfer("spill", 4 * GB, 4 * GB)  # 1003.5: the last, held for the report's rate
    assert capsys.readouterr().err.splitlines() == [
        "step: spill",
        "spill: 0 B / 3.7 GiB",
        "spill: 2.8 GiB / 3.7 GiB at 1.00 GB/s",
        "spill: 3.7 GiB / 3.7 GiB at 1.14 GB/s",
    ]
