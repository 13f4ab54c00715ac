"""Fault injection: make hibernate fail, hang or die at a named point, for tests.

    HIBERNATE_FAULT="sleep.after-spill:kill"          # SIGKILL this process there
    HIBERNATE_FAULT="agent.spill:fail,wake.after-cuda:hang"

Actions: ``fail`` (raise InjectedFaultError, the default), ``hang`` (sleep for an
hour: a step that never returns), ``kill`` (SIGKILL ourselves: a process that
dies with no chance to clean up), ``SIG<NAME>`` (raise that signal: ``SIGBUS``
is what touching a truncated file mapping raises; ``SIGSTOP`` holds the process there until
someone sends it SIGCONT, and it then goes on: a step caught in flight). Unset, a point costs
one environment lookup.

Every step boundary of sleep and wake is a point, ``sleep.after-<step>`` (and
``.during-<step>`` inside a transfer), derived from the declared step lists
(``hibernate.operation.engine.sleep_points``), so a new step cannot be added
without a way to break it on purpose. ``NAME#N`` acts only the Nth time the
point is reached in this process (``sleep.after-drain#2``: the second vLLM
server's drain of one command).
"""

from __future__ import annotations

import os
import signal
import time

from hibernate.errors import HibernateError

ENV = "HIBERNATE_FAULT"
TRACE_ENV = "HIBERNATE_FAULT_TRACE"  # a file: every point reached is appended to it (tests)

# Inside the target: its agent, at the start of each transition (``agent.<op>``, derived from
# its transition table: hibernate.agent.controller.AGENT_POINTS), and the store, between writing
# a snapshot's data and publishing it.
STORE_POINTS = ("store.write", "store.publish")
# And an address-preserving pool (hibernate.pool), before it pauses or resumes a tag.
POOL_POINTS = ("pool.pause", "pool.resume")


class InjectedFaultError(HibernateError):
    """A failure asked for by HIBERNATE_FAULT."""

    wire_name = "injected-fault"


InjectedFault = InjectedFaultError  # the former name, for code that catches it


_reached: dict[str, int] = {}


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
    _reached[name] = _reached.get(name, 0) + 1
    actions = _actions()
    action = actions.get(f"{name}#{_reached[name]}", actions.get(name))
    if action is None:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("SIG"):  # a fatal signal, as a crash in the middle of this point would raise
        signal.raise_signal(signal.Signals[action])
        return  # one that let it live (SIGSTOP, once continued): it goes on from here
    if action == "hang":
        time.sleep(3600)
    raise InjectedFaultError(f"fault injected at {name}")
