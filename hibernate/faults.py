"""Fault injection: make hibernate fail, hang or die at a named point, for tests.

    HIBERNATE_FAULT="sleep.after-spill:kill"          # SIGKILL this process there
    HIBERNATE_FAULT="agent.spill:fail,wake.after-cuda:hang"

Actions: ``fail`` (raise InjectedFault, the default), ``hang`` (sleep for an
hour: a step that never returns), ``kill`` (SIGKILL ourselves: a process that
dies with no chance to clean up). Unset, a point costs one environment lookup.

Every phase boundary of sleep and wake is a point (see SLEEP_POINTS and
WAKE_POINTS, and VLLM_SLEEP_POINTS and VLLM_WAKE_POINTS for a vLLM server,
whose flow has phases of its own); tests check that each orchestrator phase
has one, so a new phase cannot be added without a way to break it on purpose.
"""

from __future__ import annotations

import os
import signal
import time

from hibernate.errors import HibernateError

ENV = "HIBERNATE_FAULT"
TRACE_ENV = "HIBERNATE_FAULT_TRACE"  # a file: every point reached is appended to it (tests)

# Orchestrator (CLI side) boundaries, in the order a sleep and a wake pass them.
SLEEP_POINTS = (
    "sleep.after-lock",
    "sleep.after-connect",
    "sleep.after-quiesce",
    "sleep.during-spill",
    "sleep.after-spill",
    "sleep.after-release",
    "sleep.after-cuda-lock",
    "sleep.after-cuda",
)
WAKE_POINTS = (
    "wake.after-lock",
    "wake.after-connect",
    "wake.after-cuda-restore",
    "wake.after-cuda",
    "wake.during-restore",
    "wake.after-restore",
    "wake.after-resume",
)
# The same for a vLLM server (hibernate/integrations/vllm_flow.py): the server's own
# /sleep and /wake_up move the workers' memory.
VLLM_SLEEP_POINTS = (
    "sleep.after-lock",
    "sleep.after-connect",
    "sleep.after-configure",
    "sleep.after-drain",
    "sleep.during-vllm-sleep",
    "sleep.after-vllm-sleep",
    "sleep.after-cuda-lock",
    "sleep.after-cuda",
)
VLLM_WAKE_POINTS = (
    "wake.after-lock",
    "wake.after-connect",
    "wake.after-cuda-restore",
    "wake.after-cuda",
    "wake.during-vllm-wake",
    "wake.after-vllm-wake",
)
# Inside the target: its agent, at the start of each operation it runs for a client, and the
# store, between writing a snapshot's data and publishing it.
AGENT_POINTS = ("agent.quiesce", "agent.spill", "agent.release", "agent.restore")
STORE_POINTS = ("store.write", "store.publish")


class InjectedFault(HibernateError):
    """A failure asked for by HIBERNATE_FAULT."""

    wire_name = "injected-fault"


def _actions() -> dict[str, str]:
    spec = os.environ.get(ENV, "")
    actions = {}
    for item in spec.split(","):
        name, _, action = item.strip().partition(":")
        if name:
            actions[name] = action or "fail"
    return actions


def point(name: str) -> None:
    """Trigger the fault configured for ``name``, if any."""
    trace = os.environ.get(TRACE_ENV)
    if trace:
        with open(trace, "a") as log:
            log.write(name + "\n")
    if ENV not in os.environ:
        return
    action = _actions().get(name)
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "hang":
        time.sleep(3600)
    raise InjectedFault(f"fault injected at {name}")
