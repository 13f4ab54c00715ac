"""What this machine and a target can and cannot do, each with a fix: the checks of ``hibernate doctor``.

Every check answers ``ok``, ``warn`` (works, with a cost or a risk worth
knowing) or ``fail`` (a sleep would be refused or would fail), and says how to
fix what is not ok. Nothing here changes anything: the driver and the binary
are only asked for versions, help and states. It runs on a machine without a
GPU too, where it says what is missing.

The facts behind the checks: the checkpoint driver API needs
CUDA 12.8 / driver 570 (GPU remapping 13.0 / 580); the binary's ``--action``
needs R555; restore needs persistence mode or ``cuInit`` in the caller;
cuda-checkpoint supports neither MIG nor MPS, nor UVM or CUDA IPC memory;
multi-process NCCL jobs hang or fail to restore unless NCCL's P2P, NVLS and
SHM transports (and vLLM's custom all-reduce) are off.

The checks by what they look at: :mod:`.machine` (platform, driver,
cuda-checkpoint, GPUs, permissions), :mod:`.target` (a target's agents, CUDA
holders, torch, graphs, NCCL and vLLM peers) and :mod:`.disk` (where snapshots
would go); :mod:`.checks` is what a check is. The command
(``hibernate.cli.doctor``) parses, calls :func:`run` and renders; it imports
this package when it runs, so ``--help`` loads none of it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hibernate.doctor.checks import FAIL
from hibernate.doctor.disk import DiskChecks
from hibernate.doctor.machine import MachineChecks
from hibernate.doctor.target import TargetChecks


class Doctor(MachineChecks, TargetChecks, DiskChecks):
    """Runs every check once, in the order the report lists them."""

    def run(self) -> dict[str, Any]:
        self.check_platform()
        self.check_driver()
        self.check_binary()
        self.check_checkpointer()
        self.check_gpus()
        self.check_mig_mps()
        self.check_permissions()
        self.check_store_helper()
        if self.pid is not None:
            self.check_target()
            self.check_torch()
            self.check_graphs()
            self.check_nccl()
            self.check_vllm_peers()
        self.check_directory()
        ok = all(c.status != FAIL for c in self.checks)
        return {"ok": ok, "pid": self.pid, "checks": [c.to_wire() for c in self.checks]}


def run(
    pid: int | None, directory: Path | None, kind: str = "auto", binary_path: str | None = None
) -> dict[str, Any]:
    """Every check for this machine (and ``pid``'s process tree when given)."""
    from hibernate import procinfo
    from hibernate.checkpoint.selection import check_choice
    from hibernate.errors import NoSuchProcessError

    check_choice(kind, binary_path)
    if pid is not None and procinfo.identity(pid) is None:
        raise NoSuchProcessError(f"no process with pid {pid}")
    return Doctor(pid, directory, kind, binary_path).run()
