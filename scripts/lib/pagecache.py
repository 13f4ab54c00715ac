"""Cold reads for the benches: the kernel's page cache dropped, where the bench may."""

from __future__ import annotations

import os


def drop_caches() -> bool:
    """Drop the kernel's whole page cache (root, where /proc/sys is writable); whether it could."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as control:
            control.write("3\n")
    except OSError:
        return False
    return True
