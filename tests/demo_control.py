"""What the tests ask a running demo (``python -m hibernate.demo serve``) over its control socket,
and read of its process, whoever started it (the fork server, a job, a proxy's test)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any


class DemoControl:
    """Mixed into each test's handle on a demo: it has the demo's ``control`` socket and ``pid``."""

    control: str
    if TYPE_CHECKING:  # a field of some handles, a property of others

        @property
        def pid(self) -> int: ...

    def request(self, command: str, timeout: float = 120) -> dict[str, Any]:
        from hibernate.demo import request

        reply: dict[str, Any] = request(self.control, command, timeout)
        return reply

    def hold(self, seconds: float) -> None:
        """Hold the demo's guard for ``seconds`` (a long step of its own): a sleep waits for it."""
        assert self.request(f"hold {seconds}") == {"holding": True}

    def release(self) -> None:
        """End the hold in progress: a sleep waiting for it goes on (a demo shared by several tests is
        left with none)."""
        assert self.request("release") == {"released": 1}

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
