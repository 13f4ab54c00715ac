"""The ``hibernate`` command: parse, call the orchestrator, render. Nothing else lives here.

The modules: ``app`` (the typer app, every command registered by name),
``options`` (the flags commands share, defined once; the orchestrator's
Options are built from them by ``orchestrator.options_from_flags``), the
commands by family (``operations``: sleep, wake, recover, status, ls, gc;
``sched``: run and node-step; ``serve``; ``doctor``, whose checks are the
package :mod:`hibernate.doctor`) and ``render`` (how results look).

Importing this package must stay light (no torch): it runs on login nodes and
in scheduler hooks where torch may be missing or slow to import. Each command
imports what it needs when it runs, so ``--help`` loads none of it.
"""

from __future__ import annotations

from hibernate.cli.app import main

__all__ = ["main"]
