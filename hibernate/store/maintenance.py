"""``hibernate gc``: reclaim what no published snapshot needs, across a --to directory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from hibernate.errors import UsageError
from hibernate.store.format import snapshot_sequence
from hibernate.store.layout import LOCK_NAME, TMP_PREFIX, SpillRoot


def _is_spill_root(path: Path) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n == LOCK_NAME or n.startswith(TMP_PREFIX) or snapshot_sequence(n) is not None for n in names)


def spill_roots(directory: Path) -> list[Path]:
    """``directory`` itself if it is one process's root, else the roots directly inside it."""
    if _is_spill_root(directory):
        return [directory]
    return sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink() and _is_spill_root(p))


def collect_garbage(directory: Path) -> dict[str, Any]:
    """Collect every spill root in ``directory``; one in use (a sleep or a wake running) is skipped."""
    directory = Path(directory).expanduser().absolute()
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory")
    roots: list[dict[str, Any]] = []
    for path in spill_roots(directory):
        with SpillRoot(path) as root:
            if not root.lock(exclusive=True):
                roots.append({"path": str(path), "freed_bytes": 0, "skipped": True, "warnings": []})
                continue
            freed, warnings = root.collect_garbage()
            roots.append({"path": str(path), "freed_bytes": freed, "skipped": False, "warnings": warnings})
    return {
        "directory": str(directory),
        "roots": roots,
        "freed_bytes": sum(r["freed_bytes"] for r in roots),
        "warnings": [w for r in roots for w in r["warnings"]],
    }
