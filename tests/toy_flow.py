"""A toy kind of target, for the engine's tests: one module plus one registration line.

Its agent names the sleep driver ``toy``; its "memory" steps only write the
target's state to a file (``$HIBERNATE_TOY_DIR/<pid>``) and an event log, so a
test can see what ran and what was undone. Everything else (locks, journal,
fault points, the CUDA stage, recovery) is the engine's.

    python -m tests.toy_flow --ready FILE     # a toy target: an agent driven by "toy"
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from hibernate.errors import HibernateError, WrongStateError
from hibernate.operation.registry import register_flow
from hibernate.operation.reports import UnitReport
from hibernate.operation.steps import Step
from hibernate.operation.targets import AgentRef, Target
from hibernate.operation.unit import Context, Unit

KIND = "toy"
STATE_DIR_ENV = "HIBERNATE_TOY_DIR"


def state_dir() -> Path:
    return Path(os.environ[STATE_DIR_ENV])


def state_of(pid: int) -> str:
    path = state_dir() / str(pid)
    return path.read_text() if path.exists() else "running"


def events() -> list[str]:
    path = state_dir() / "events"
    return path.read_text().split() if path.exists() else []


class ToyUnit(Unit):
    """One toy target per unit."""

    @classmethod
    def plan(cls, ctx: Context, agents: Sequence[AgentRef], targets: Sequence[Target]) -> list[Unit]:
        return [
            cls(ctx, [ref], [p for t in targets if ref in t.agents for p in t.processes]) for ref in agents
        ]

    @property
    def pid(self) -> int:
        return self.refs[0].pid

    def _set(self, state: str, event: str) -> None:
        (state_dir() / str(self.pid)).write_text(state)
        with open(state_dir() / "events", "a") as log:
            log.write(f"{event}\n")

    def asleep(self) -> bool:
        return state_of(self.pid) == "asleep"

    def connect(self) -> None:
        self.found = state_of(self.pid)
        if self.ctx.op == "sleep" and self.found != "running":
            raise WrongStateError(f"toy {self.pid} is {self.found}; nothing was changed")

    def pause(self) -> None:
        self._set("paused", "pause")

    def park(self) -> None:
        self._set("asleep", "park")

    def undo(self, error: BaseException) -> None:
        self._set("running", "undo")

    def annotate(self, step: str, error: HibernateError) -> None:
        error.add_context(f"toy {self.pid} ({step})", unless="toy")

    def has_sleeping(self) -> bool:
        return self.found != "running"

    def describe_state(self) -> str:
        return f"toy {self.pid} is {self.found}"

    def unpark(self) -> None:
        if self.has_sleeping():
            self._set("running", "unpark")

    def report(self) -> UnitReport:
        return UnitReport(extra_key="toy", extra={"pid": self.pid, "state": state_of(self.pid)})


ToyUnit.sleep_steps = (Step("toy-pause", ToyUnit.pause, undo=ToyUnit.undo), Step("toy-park", ToyUnit.park))
ToyUnit.wake_steps = (Step("toy-unpark", ToyUnit.unpark),)

register_flow(KIND, "tests.toy_flow:ToyUnit")


def serve(ready: Path) -> int:
    """A toy target: an agent (no torch, no pools) whose sleep driver is the toy."""
    from hibernate.agent.controller import SleepDriver
    from hibernate.agent.local import local_agent

    agent = local_agent(name="toy", runtime="toy")
    agent.sleep_driver = SleepDriver(KIND, "hibernate sleep PID, with the toy flow registered")
    ready.with_suffix(".tmp").write_text(json.dumps({"pid": os.getpid()}))
    os.replace(ready.with_suffix(".tmp"), ready)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready", required=True, type=Path)
    sys.exit(serve(parser.parse_args().ready))
