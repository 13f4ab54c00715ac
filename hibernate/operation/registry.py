"""Kinds of target, each registered by name and loaded only when a target of its kind is met.

The pattern of vLLM's own sleep-mode backend factory (which hibernate
registers into): a registration names a module and a class, never imports
them, so the CLI stays light and the engine never imports a flow.

A process's kind is the sleep driver its agent names (``sleep_driver`` in its
status); an agent with none moves its own pools, the plain kind.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from hibernate.agent.wire import AgentStatus
from hibernate.errors import UnsupportedError

PLAIN = "agent"  # the kind of an agent that moves its own pools (no sleep driver)


@dataclass(frozen=True)
class Registration:
    kind: str
    module: str
    attribute: str
    options: tuple[str, ...] = ()  # Options.kind_options names only this kind takes
    noun: str = "a target of this kind"  # in messages: "--level applies to <noun>"


_REGISTRY: dict[str, Registration] = {}


def register_flow(
    kind: str, where: str, *, options: tuple[str, ...] = (), noun: str = "a target of this kind"
) -> None:
    """Register the unit class at ``where`` ("package.module:Class") for targets of ``kind``."""
    module, _, attribute = where.partition(":")
    if not module or not attribute:
        raise ValueError(f"a flow is registered as 'package.module:Class', not {where!r}")
    _REGISTRY[kind] = Registration(kind, module, attribute, options, noun)


def registrations() -> list[Registration]:
    return list(_REGISTRY.values())


def kind_of(status: AgentStatus) -> str:
    return status.sleep_driver or PLAIN


def load(kind: str) -> Any:
    """The unit class of ``kind``, imported now."""
    registration = _REGISTRY.get(kind)
    if registration is None:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise UnsupportedError(
            f"this hibernate has no flow for targets of kind {kind!r} (known: {known}); nothing was changed",
            hint="upgrade hibernate, or install the integration that registers this kind",
        )
    return getattr(importlib.import_module(registration.module), registration.attribute)
