"""Multi-process CUDA jobs and NCCL: which settings a checkpoint needs, read from each process's environment.

cuda-checkpoint cannot checkpoint CUDA IPC memory, which NCCL's P2P and NVLS
transports, its SHM transport's CUDA buffers and vLLM's custom all-reduce
use: a multi-process NCCL job checkpointed with them on fails or hangs. The
job must run with ``NCCL_P2P_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_SHM_DISABLE=1``
(vLLM: ``--disable-custom-all-reduce``). A sleep of more than one CUDA
process is refused without them (``--force`` overrides), and ``hibernate
doctor`` explains the same traps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence

NCCL_SAFE = {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_SHM_DISABLE": "1"}
NCCL_FIX = "start the job with NCCL_P2P_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_SHM_DISABLE=1"
VLLM_FIX = "vLLM: also --disable-custom-all-reduce"

# `vllm ...` (any path to it), `python -m vllm...`, vLLM's entry points; not a path that mentions vllm.
_VLLM_COMMAND = re.compile(r"(?:^|[\s/])vllm(?:\s|$)|(?:^|\s)-m\s+vllm(?:[.\s]|$)|\bvllm\.entrypoints\b")


def runs_vllm(cmdline: str) -> bool:
    """Whether a command line starts vLLM (a venv or checkout named like vllm-env is not enough)."""
    return _VLLM_COMMAND.search(cmdline) is not None


def nccl_traps(env: Mapping[str, str], cmdline: str, infiniband: bool) -> list[str]:
    """The NCCL/vLLM settings of one process of a multi-process target that break a checkpoint."""
    traps = [f"{name} is not {value}" for name, value in NCCL_SAFE.items() if env.get(name) != value]
    if runs_vllm(cmdline) and "--disable-custom-all-reduce" not in cmdline:
        traps.append("vLLM custom all-reduce is on (CUDA IPC buffers cannot be checkpointed)")
    if infiniband and env.get("NCCL_IB_DISABLE") != "1":
        traps.append("NCCL may use InfiniBand (registered RDMA memory cannot be checkpointed)")
    return traps


def multi_process_traps(
    pids: Sequence[int], environment: Callable[[int], Mapping[str, str]], command_line: Callable[[int], str]
) -> dict[int, list[str]]:
    """Per process of a job of two or more CUDA processes, the settings that make its checkpoint fail or hang.

    One process alone shares no CUDA memory with another: nothing to check.
    InfiniBand is left to ``doctor`` (a warning): RDMA may be unused.
    """
    if len(pids) < 2:
        return {}
    found = {pid: nccl_traps(environment(pid), command_line(pid), infiniband=False) for pid in pids}
    return {pid: traps for pid, traps in found.items() if traps}
