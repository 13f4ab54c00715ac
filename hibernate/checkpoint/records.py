"""What each checkpointed process held on each GPU, kept from sleep until wake.

A checkpointed process holds no GPU memory, so at wake nothing on the machine
says how much its restore will need; yet a restore that runs out of memory
wedges the process for good. ``hibernate sleep`` therefore writes, per
process, the bytes NVML saw it hold on each GPU just before the lock, and
``hibernate wake`` checks them against free memory before restoring.

Records live in the caller's runtime directory (0700), one small JSON file
per process named by its identity (pid and start time), so a reused pid never
inherits another process's record.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

from hibernate import procinfo
from hibernate.agent.paths import runtime_dir
from hibernate.errors import HibernateError
from hibernate.fsutil import ensure_private_dir, open_dir, read_small_file, write_file_atomic
from hibernate.procinfo import ProcessIdentity

_LIMIT = 64 << 10


def directory() -> Path:
    return runtime_dir() / "cuda"


def _name(ident: ProcessIdentity) -> str:
    return f"{ident.pid}-{ident.start_time}.json"


def _forget_the_dead(where: Path) -> None:
    """Drop the records of processes that no longer exist (they can never be woken)."""
    for entry in os.listdir(where):
        pid, _, start = entry.removesuffix(".json").partition("-")
        if not (entry.endswith(".json") and pid.isdigit() and start.isdigit()):
            continue
        if not procinfo.is_alive(ProcessIdentity(int(pid), int(start))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(where / entry)


def save(
    ident: ProcessIdentity,
    usage: dict[str, int] | None,
    checkpointer: str,
    drop: dict[str, int] | None = None,
    cohort: list[int] | None = None,
) -> None:
    """Remember ``usage`` and the device ``drop`` (GPU UUID -> bytes, None: unknown) for the wake."""
    where = directory()
    ensure_private_dir(where)
    _forget_the_dead(where)
    record: dict[str, Any] = {
        "pid": ident.pid,
        "start_time": ident.start_time,
        "gpus": usage,
        "drop": drop,
        "cohort": cohort if cohort is not None else [ident.pid],
        "checkpointer": checkpointer,
        "time": time.time(),
    }
    fd = open_dir(where)
    try:
        write_file_atomic(fd, _name(ident), json.dumps(record).encode())
    finally:
        os.close(fd)


def load(ident: ProcessIdentity) -> dict[str, Any] | None:
    """The record of ``ident``, or None if there is none (or it cannot be read)."""
    try:
        fd = open_dir(directory())
    except (OSError, HibernateError):
        return None
    try:
        document = json.loads(read_small_file(fd, _name(ident), _LIMIT))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return document if isinstance(document, dict) else None


def drop(ident: ProcessIdentity) -> None:
    with contextlib.suppress(FileNotFoundError):
        (directory() / _name(ident)).unlink()
