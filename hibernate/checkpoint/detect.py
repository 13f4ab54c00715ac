"""Which processes hold a CUDA context: an open NVIDIA device file is the sign.

``cuInit`` opens /dev/nvidiactl (and /dev/nvidia-uvm); creating a context opens
/dev/nvidia<N>. Reading /proc/<pid>/fd needs no driver, so this works on a
machine without a GPU (where it finds nothing) and before any CUDA library is
loaded in the caller.
"""

from __future__ import annotations

import os
import re

_NVIDIA_DEVICE = re.compile(r"^/dev/nvidia(\d+|ctl|-uvm)$")


def nvidia_device_files(pid: int) -> list[str]:
    """The NVIDIA device files ``pid`` holds open (empty if none or unreadable)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, PermissionError, ProcessLookupError):
        return []
    found = set()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if _NVIDIA_DEVICE.match(target):
            found.add(target)
    return sorted(found)


def holds_cuda_context(pid: int) -> bool:
    return bool(nvidia_device_files(pid))
