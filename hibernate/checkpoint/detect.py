"""Which processes hold CUDA state: open NVIDIA device files, or the driver answering for them.

``cuInit`` opens /dev/nvidiactl (and /dev/nvidia-uvm); creating a context opens
/dev/nvidia<N>. Reading /proc/<pid>/fd needs no driver, so this works on a
machine without a GPU (where it finds nothing) and before any CUDA library is
loaded in the caller.

Device files are not the whole story. A CUDA-checkpointed process has closed
them (it "no longer refers to any GPU hardware at the OS level"), yet it must
be found to be woken; and a process that only uses NVML holds
/dev/nvidiactl without any CUDA state to checkpoint (gVisor filters these out
the same way). So when a checkpointer is at hand, its ``state(pid)`` decides:
an answer makes a holder; "not a CUDA process" from the driver on a process
with device files makes an NVML-only process, reported and left alone; any
other failure on a process with device files stops the operation before
anything changed.

hibernate's own helpers are never holders: the self-checkpoint helper a vLLM
worker starts loads libcuda (its ``cuInit`` opens the device files, and the
driver may answer for it), yet it serves the worker and must not be locked
with it. Each is started with ``HIBERNATE_HELPER_OF=<pid it serves>`` in its
environment, which is how it is recognised and set aside.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hibernate import procinfo
from hibernate.checkpoint import HELPER_ENV
from hibernate.checkpoint.base import Checkpointer, CheckpointStepError, CudaState
from hibernate.checkpoint.curesult import CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED
from hibernate.procinfo import ProcessIdentity
from hibernate.threads import run_each

_NVIDIA_DEVICE = re.compile(r"^/dev/nvidia(\d+|ctl|-uvm)$")
# What the driver answers for a pid with no CUDA state to checkpoint.
NOT_A_CUDA_PROCESS = frozenset({CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED})


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


def helper_of(pid: int) -> int | None:
    """The pid that ``pid`` serves if it is one of hibernate's own helpers, else None."""
    value = procinfo.environment(pid).get(HELPER_ENV, "")
    return int(value) if value.isdigit() else None


def holds_cuda_context(pid: int) -> bool:
    return bool(nvidia_device_files(pid))


@dataclass
class Holder:
    """A process with CUDA state, how it was recognised, and its state when asked."""

    identity: ProcessIdentity
    devices: list[str]
    state: CudaState | None  # None without a checkpointer to ask

    @property
    def pid(self) -> int:
        return self.identity.pid

    @property
    def evidence(self) -> str:
        if self.state is None:
            return "device files"
        return "device files and driver" if self.devices else "driver"


@dataclass
class Survey:
    """The holders of a set of processes, and the processes set aside with the reason."""

    holders: list[Holder] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)


def survey(pids: Sequence[int], checkpointer: Checkpointer | None) -> Survey:
    """Find the CUDA holders among ``pids`` (each asked once, all at once).

    Raises the checkpointer's CheckpointStepError for a process that has NVIDIA
    device files but whose state the driver cannot tell: hibernate must not
    go on without knowing it.
    """
    me = os.getpid()  # a process cannot lock itself: never a holder to drive
    identities = {pid: procinfo.identity(pid) for pid in dict.fromkeys(pids) if pid != me}
    result = Survey()
    for pid, ident in list(identities.items()):
        served = helper_of(pid) if ident is not None else None
        if served is not None:
            del identities[pid]
            result.skipped.append(
                {
                    "pid": pid,
                    "devices": nvidia_device_files(pid),
                    "reason": f"hibernate's own self-checkpoint helper of process {served}: never a target",
                }
            )
    alive = [pid for pid, ident in identities.items() if ident is not None]
    devices = {pid: nvidia_device_files(pid) for pid in alive}
    if checkpointer is None:
        for pid in alive:
            ident = identities[pid]
            if devices[pid] and ident is not None:
                result.holders.append(Holder(ident, devices[pid], None))
        return result
    outcomes = dict(zip(alive, run_each(alive, checkpointer.state), strict=True))
    for pid in alive:
        ident = identities[pid]
        outcome = outcomes[pid]
        if ident is None or not procinfo.is_alive(ident):
            continue  # exited meanwhile: nothing to hold
        if outcome.error is None and outcome.value is not None:
            result.holders.append(Holder(ident, devices[pid], outcome.value))
            continue
        error = outcome.error
        if not isinstance(error, CheckpointStepError):
            raise error  # type: ignore[misc]
        not_cuda = error.error.code in NOT_A_CUDA_PROCESS
        if devices[pid] and not not_cuda:
            raise error
        if devices[pid]:
            result.skipped.append(
                {
                    "pid": pid,
                    "devices": devices[pid],
                    "reason": f"holds NVIDIA device files but the driver reports no CUDA state "
                    f"({error.error.name}): an NVML-only process, left as it is",
                }
            )
    return result
