"""Multi-process CUDA jobs and NCCL: which settings a checkpoint needs, read from each process's environment.

cuda-checkpoint cannot checkpoint CUDA IPC memory, which NCCL's P2P and NVLS
transports, its SHM transport's CUDA buffers, vLLM's custom all-reduce and
vLLM's all-reduce through torch symmetric memory use: a multi-process NCCL job
checkpointed with them on fails or hangs. The job must run with
``NCCL_P2P_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_SHM_DISABLE=1`` (vLLM: also
``--disable-custom-all-reduce`` and ``VLLM_ALLREDUCE_USE_SYMM_MEM=0``; the
symmetric-memory all-reduce is on by default and independent of the flag). A
sleep of more than one CUDA process is refused without them (``--force``
overrides), and ``hibernate doctor`` explains the same traps. vLLM 0.33's own
preparation for a checkpoint (which the hibernate backend calls) tears down
FlashInfer's all-reduce and all-to-all workspaces only.

vLLM 0.33 also offers ``--enable-nccl-comm-suspend`` (``ncclCommSuspend``,
NCCL 2.29.7 or newer), which unmaps the buffers NCCL imported from peers while
a worker sleeps: where a process's vLLM has it and it is off, the refusal and
``doctor`` say so. Which vLLM a process runs is read from the files it maps
(every vLLM worker maps the package's compiled extensions), and what that
vLLM offers from the package's own sources, never by importing it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

NCCL_SAFE = {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_SHM_DISABLE": "1"}
NCCL_FIX = "start the job with NCCL_P2P_DISABLE=1 NCCL_NVLS_ENABLE=0 NCCL_SHM_DISABLE=1"
VLLM_FIX = (
    "vLLM: also --disable-custom-all-reduce and VLLM_ALLREDUCE_USE_SYMM_MEM=0, and "
    "--enable-nccl-comm-suspend where its vLLM has it (0.33+)"
)
VLLM_SAFE = {"VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}  # vLLM's all-reduce through torch symmetric memory
SYMM_MEM_ON = (
    "VLLM_ALLREDUCE_USE_SYMM_MEM is not 0 (vLLM's all-reduce through torch symmetric memory, on by "
    "default, maps peers' memory that cannot be checkpointed)"
)
COMM_SUSPEND_FLAG = "--enable-nccl-comm-suspend"
COMM_SUSPEND_OFF = (
    f"{COMM_SUSPEND_FLAG} is not on the command line (nor its parents'), and this process's vLLM has it"
)

# `vllm ...` (any path to it), `python -m vllm...`, vLLM's entry points; not a path that mentions vllm.
_VLLM_COMMAND = re.compile(r"(?:^|[\s/])vllm(?:\s|$)|(?:^|\s)-m\s+vllm(?:[.\s]|$)|\bvllm\.entrypoints\b")


def has_flag(cmdline: str, flag: str) -> bool:
    """Whether ``flag`` is on a command line, spelt with ``-`` or ``_`` (vLLM's parser takes both).

    A flag set in a ``--config`` file, or through the Python API, is not seen.
    """
    return any(word.split("=", 1)[0].replace("_", "-") == flag for word in cmdline.split())


def runs_vllm(cmdline: str) -> bool:
    """Whether a command line starts vLLM (a venv or checkout named like vllm-env is not enough)."""
    return _VLLM_COMMAND.search(cmdline) is not None


def nccl_traps(
    env: Mapping[str, str],
    cmdline: str,
    infiniband: bool,
    vllm: VllmFeatures | None = None,
    launched_by: str = "",
) -> list[str]:
    """The NCCL/vLLM settings of one process of a multi-process target that break a checkpoint.

    ``vllm``: what the process's vLLM offers, if known (a process is vLLM's
    if it maps a vLLM or its command line starts one). Its comm-suspend flag
    is named beside the other traps, never alone: with NCCL's peer transports
    off, nothing is left for it to unmap. The flags are looked for in
    ``cmdline`` and in ``launched_by``, the command lines of its ancestors (a
    worker vLLM started by spawn has none of the server's flags).
    """
    traps = [f"{name} is not {value}" for name, value in NCCL_SAFE.items() if env.get(name) != value]
    given = f"{cmdline} {launched_by}"
    is_vllm = vllm is not None or runs_vllm(cmdline)
    if runs_vllm(cmdline) and not has_flag(given, "--disable-custom-all-reduce"):
        traps.append("vLLM custom all-reduce is on (CUDA IPC buffers cannot be checkpointed)")
    if is_vllm and any(env.get(name) != value for name, value in VLLM_SAFE.items()):
        traps.append(SYMM_MEM_ON)
    if infiniband and env.get("NCCL_IB_DISABLE") != "1":
        traps.append("NCCL may use InfiniBand (registered RDMA memory cannot be checkpointed)")
    if traps and vllm is not None and vllm.comm_suspend and not has_flag(given, COMM_SUSPEND_FLAG):
        traps.append(COMM_SUSPEND_OFF)
    return traps


def ancestors_command_lines(pid: int) -> str:
    """The command lines of ``pid``'s ancestors, nearest first, one string."""
    from hibernate import procinfo

    return " ".join(procinfo.command_line(p) for p in procinfo.ancestors(pid))


def multi_process_traps(
    pids: Sequence[int],
    environment: Callable[[int], Mapping[str, str]],
    command_line: Callable[[int], str],
    vllm_of: Callable[[int], VllmFeatures | None] | None = None,
    launched_by: Callable[[int], str] | None = None,
) -> dict[int, list[str]]:
    """Per process of a job of two or more CUDA processes, the settings that make its checkpoint fail or hang.

    One process alone shares no CUDA memory with another: nothing to check.
    InfiniBand is left to ``doctor`` (a warning): RDMA may be unused.
    ``vllm_of`` tells what each process's vLLM offers and ``launched_by`` its
    ancestors' command lines (defaults: read from /proc).
    """
    if len(pids) < 2:
        return {}
    features_of = vllm_of or vllm_features_of
    ancestry = launched_by or ancestors_command_lines
    found = {}
    for pid in pids:
        env, line = environment(pid), command_line(pid)
        features = features_of(pid)
        launched = ancestry(pid) if features is not None else ""
        traps = nccl_traps(env, line, infiniband=False, vllm=features, launched_by=launched)
        if traps:
            found[pid] = traps
    return found


# -- which vLLM a process runs, and what it offers ------------------------------------


@dataclass(frozen=True)
class VllmFeatures:
    """What a vLLM installation offers for a checkpoint of a worker with peers."""

    package: str  # the package directory, as the process sees it
    distributed_checkpoint: bool  # checkpoint_prepare/restore_distributed_state (0.33+)
    comm_suspend: bool  # --enable-nccl-comm-suspend (0.33+)


def vllm_packages(mapped: Iterable[str]) -> list[str]:
    """The vLLM package directories among the paths of a process's mapped files, in order, once each."""
    found: list[str] = []
    for path in mapped:
        if "/vllm/" not in path:
            continue
        package = path.rsplit("/vllm/", 1)[0] + "/vllm"
        if package not in found:
            found.append(package)
    return found


def features_in(package: str, read: Callable[[str], str | None]) -> VllmFeatures | None:
    """What the vLLM at ``package`` offers, from its own sources (``read`` gives a file's text or None)."""
    parallel_state = read(f"{package}/distributed/parallel_state.py")
    arg_utils = read(f"{package}/engine/arg_utils.py")
    if parallel_state is None or arg_utils is None:
        return None  # not a vLLM package after all (or not readable)
    return VllmFeatures(
        package=package,
        distributed_checkpoint="def checkpoint_prepare_distributed_state(" in parallel_state,
        comm_suspend=f'"{COMM_SUSPEND_FLAG}"' in arg_utils,
    )


def _mapped_paths(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return []
    # A mapping "(deleted)" is of a file replaced since (vLLM upgraded under a running server):
    # what is on disk now is not what the process runs.
    return [
        fields[5]
        for fields in (line.split(maxsplit=5) for line in lines)
        if len(fields) == 6 and not fields[5].endswith(" (deleted)")
    ]


def vllm_features_of(pid: int) -> VllmFeatures | None:
    """What the vLLM process ``pid`` runs offers; None where it maps no vLLM (or it cannot be read).

    The files are read through the process's own root, so a process in a
    container is read as it sees its files.
    """

    def read(path: str) -> str | None:
        try:
            return Path(f"/proc/{pid}/root{path}").read_text(errors="replace")
        except OSError:
            return None

    for package in vllm_packages(_mapped_paths(pid)):
        features = features_in(package, read)
        if features is not None:
            return features
    return None
