"""Environment variables both sides read: the in-target API and vLLM backend as much as the CLI.

A yes/no variable is read one way everywhere, and anything unclear is refused
rather than guessed, so ``HIBERNATE_SKIP_REUSE_CHECK=maybe`` fails loudly in
the CLI and inside a vLLM worker alike.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hibernate.errors import UsageError

# 1: a re-sleep reuses the previous snapshot's unchanged chunks without reading them back first (the
# default of `hibernate sleep --skip-reuse-check`, and of hibernate.sleep() and the vLLM backend).
SKIP_REUSE_CHECK_ENV = "HIBERNATE_SKIP_REUSE_CHECK"
# 1: a sleep may move tracked CUDA memory while the process has captured CUDA graphs, because the
# program captures them again after each wake (the default of `hibernate sleep --allow-moves`, and
# of hibernate.sleep() and of sleeps on a signal).
ALLOW_MOVES_ENV = "HIBERNATE_ALLOW_MOVES"
# MiB of staging a process keeps between its sleeps and wakes (store.directio.KeptStaging),
# read inside the target: the default of `--keep-staging-mb` and of every sleep and wake of the
# process, whoever asks for them. Unset: 0, nothing kept.
KEEP_STAGING_ENV = "HIBERNATE_KEEP_STAGING_MB"


def env_flag(environ: Mapping[str, str], name: str) -> bool:
    """A yes/no environment variable; anything unclear is refused rather than guessed."""
    raw = environ.get(name, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise UsageError(f"{name}={environ[name]!r} is not a yes/no value", hint=f"set {name}=1 or {name}=0")


def flag_or_env(given: bool | None, name: str) -> bool:
    """A yes/no setting as its caller gave it, else (None: not given) its variable ``name``.

    The one rule for the defaults of ``--skip-reuse-check`` and ``--allow-moves`` (the CLI, serve)
    and of hibernate.sleep()'s arguments of those names.
    """
    return env_flag(os.environ, name) if given is None else given


def env_mib(environ: Mapping[str, str], name: str) -> int | None:
    """A size in MiB (0 or more) from variable ``name``; None where it is unset or empty."""
    raw = environ.get(name, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise UsageError(
            f"{name}={environ[name]!r} is not a size in MiB",
            hint=f"set {name} to a whole number, e.g. {name}=256",
        )
    return int(raw)
