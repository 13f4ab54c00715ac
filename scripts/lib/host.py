"""What the benches read of the machine and do to it: the filesystem a path lives on, a cold page cache."""

from __future__ import annotations

import os
from pathlib import Path


def filesystem_of(path: Path) -> str:
    """The type of the filesystem ``path`` lives on (the longest mount point that holds it)."""
    best, kind = "", "?"
    where = str(path.resolve())
    with open("/proc/self/mountinfo") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[4]
            if (where == point or where.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
                best, kind = point, fields[fields.index("-") + 1]
    return kind


def drop_caches() -> bool:
    """Drop the kernel's whole page cache (root, where /proc/sys is writable); whether it could."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
    except OSError:
        return False
    return True
