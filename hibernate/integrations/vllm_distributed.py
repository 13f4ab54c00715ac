"""The vLLM workers' shared state across GPUs, for a sleep and a wake: the rules and the vote.

With more than one GPU, vLLM's all-reduce and all-to-all workspaces live in
memory shared across processes, which no CUDA checkpoint can take; vLLM tears
them down and builds them again with two collectives (the plugin's docstring,
:mod:`hibernate.integrations.vllm`, says when the backend calls them). Here:
whether this vLLM has them (:func:`distributed_checkpoint`), how wide the world
and one engine are (:func:`world_size_of`, :func:`engine_size`), the refusal of
a world wider than one engine, and the bounded vote by which one worker's
failure stops the others (:class:`DistributedCheckpoint`). They read vLLM's
modules only if this process loaded them, and are tested without vLLM or GPUs;
the backend's hooks that call them stay with the backend.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import Any

from hibernate.errors import HibernateError, UsageError

PEER_TIMEOUT_ENV = "HIBERNATE_VLLM_PEER_TIMEOUT_S"
# A peer still spilling is waited for this long at the vote after the spill: long enough for
# hundreds of GB on a slow disk, short enough that a hung peer does not hold the others forever.
DEFAULT_PEER_TIMEOUT_S = 600.0
PARALLEL_STATE_MODULE = "vllm.distributed.parallel_state"


@dataclass(frozen=True)
class DistributedCheckpoint:
    """vLLM's own preparation of its communicators for a process checkpoint, and their rebuilding.

    ``vote`` lets every worker of the world learn, at the points where one
    worker's failure must stop the others (before any releases its memory,
    before any tears down what the others use, before any rebuilds it), what
    failed where: each gives its own failure (None if it went well) and all get
    every failing worker's, by rank (empty if none failed). It waits for the
    peers at most the peer timeout, then raises. None where this vLLM cannot
    vote (it lacks the CPU-group all-reduce it is made of).

    ``tear_down`` is False where vLLM's own ``--enable-nccl-comm-suspend`` takes
    the workspaces down and up again around the backend's calls (a second
    prepare of the same workspaces is not something vLLM does itself).
    """

    prepare: Callable[[], None]
    restore: Callable[[], None]
    vote: Callable[[str | None], dict[int, str]] | None = None
    tear_down: bool = True


VOTE_BYTES = 240  # of each worker's failure, carried by a vote


def vote_table(rank: int, size: int, failure: str | None) -> list[list[int]]:
    """This worker's row of a vote (a flag, then its failure's UTF-8 bytes), zeros for the others."""
    table = [[0] * (VOTE_BYTES + 1) for _ in range(size)]
    if failure is not None:
        words = failure.encode()[:VOTE_BYTES]
        table[rank][0] = 1
        table[rank][1 : 1 + len(words)] = list(words)
    return table


def vote_outcome(summed: list[list[int]]) -> dict[int, str]:
    """The failing workers of a summed vote table (each row was written by its own worker only)."""
    return {
        rank: bytes(b for b in row[1:] if b).decode(errors="replace")
        for rank, row in enumerate(summed)
        if row[0]
    }


def voting(
    parallel_state: ModuleType | None, timeout_s: float
) -> Callable[[str | None], dict[int, str]] | None:
    """``vote`` over vLLM's world group: one bounded all-reduce of a table with a row per worker.

    vLLM's ``GroupCoordinator.cpu_all_reduce_`` waits without limit (the CPU
    group's timeout is unset by default), so the module's own
    ``cpu_all_reduce_(tensor, group, timeout)`` is called with the peer timeout.
    """
    group = getattr(parallel_state, "_WORLD", None)
    reduce = getattr(parallel_state, "cpu_all_reduce_", None)
    cpu_group = getattr(group, "cpu_group", None)
    rank, size = getattr(group, "rank_in_group", None), getattr(group, "world_size", None)
    if not callable(reduce) or cpu_group is None or rank is None or size is None:
        return None

    def vote(failure: str | None) -> dict[int, str]:
        import torch  # loaded in every vLLM worker

        table = torch.tensor(vote_table(int(rank), int(size), failure), dtype=torch.int64)
        return vote_outcome(reduce(table, cpu_group, timedelta(seconds=timeout_s)).tolist())

    return vote


def distributed_checkpoint(
    parallel_state: ModuleType | None, timeout_s: float, *, comm_suspend: bool = False
) -> DistributedCheckpoint | None:
    """vLLM's ``checkpoint_prepare/restore_distributed_state``, or None where this vLLM lacks them."""
    prepare = getattr(parallel_state, "checkpoint_prepare_distributed_state", None)
    restore = getattr(parallel_state, "checkpoint_restore_distributed_state", None)
    if not callable(prepare) or not callable(restore):
        return None
    return DistributedCheckpoint(prepare, restore, voting(parallel_state, timeout_s), not comm_suspend)


def engine_size(parallel_state: ModuleType | None) -> int | None:
    """How many workers one engine has: its tensor x pipeline x prefill-context parallel groups
    (``world_size`` of vLLM's ``_TP``, ``_PP``, ``_PCP``); None where the first two are not set up."""
    size = 1
    for name in ("_TP", "_PP", "_PCP"):
        group_size = getattr(getattr(parallel_state, name, None), "world_size", None)
        if group_size is None and name != "_PCP":  # (_PCP is newer than the others)
            return None
        size *= int(group_size or 1)
    return size


def multi_engine_refusal(world_size: int, one_engine: int) -> str | None:
    """Why a sleep is refused when vLLM's world spans more than one engine (data parallelism)."""
    if world_size <= one_engine:
        return None
    return (
        f"this worker's world spans {world_size} workers while its engine has {one_engine} (data "
        "parallelism, or a torchrun world of several engines): the workers of every engine would wait "
        "for each other at this sleep, and an engine asked to sleep alone would wait for the others; "
        "nothing was changed"
    )


def comm_suspend_of(worker: Any) -> bool:
    """Whether vLLM's ``Worker`` (the caller of suspend) runs with ``--enable-nccl-comm-suspend``."""
    model_config = getattr(getattr(worker, "vllm_config", None), "model_config", None)
    return bool(getattr(model_config, "enable_nccl_comm_suspend", False))


def peer_timeout(environ: Mapping[str, str]) -> float:
    """``HIBERNATE_VLLM_PEER_TIMEOUT_S``: how long a worker waits for its peers at a vote."""
    raw = environ.get(PEER_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_PEER_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < 10**9:  # (nan and inf too)
        raise UsageError(f"{PEER_TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return seconds


def world_size_from(group_size: int | None, torch_size: int | None, environ: Mapping[str, str]) -> int:
    """How many workers share communicators: vLLM's world group, else torch.distributed's, else
    ``$WORLD_SIZE``, else one."""
    for size in (group_size, torch_size):
        if size is not None:
            return size
    raw = environ.get("WORLD_SIZE", "").strip()
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


RESTART_HINT = "restart the vLLM server"
PREPARED_REFUSAL = (
    "this vLLM worker's communicators across GPUs are torn down for its sleep, and only the server's own "
    "wake rebuilds them (with every worker together) before its memory comes back; brought back from "
    "outside, the worker would serve without them"
)
PREPARED_HINT = (
    "POST /wake_up to the server if it reports is_sleeping: true (`hibernate wake PID` does); "
    "else restart the vLLM server"
)


def failure_words(exc: BaseException | None) -> str | None:
    """An exception in one line, for a vote (None: no failure)."""
    if exc is None:
        return None
    return f"{type(exc).__name__}: {exc.message if isinstance(exc, HibernateError) else exc}"


def describe_failed(failed: Mapping[int, str], verb: str = "") -> str:
    """The first failing worker of a vote, in words (``failed`` is never empty here)."""
    rank = min(failed)
    more = len(failed) - 1
    return f"worker rank {rank}{f' {verb}' if verb else ''} ({failed[rank]})" + (
        f", and {more} more" if more else ""
    )


MISSING_DISTRIBUTED_CHECKPOINT = (
    "this vLLM has no checkpoint_prepare_distributed_state (vLLM 0.33 or newer has it): its all-reduce "
    "workspaces in memory shared across GPUs stay in place, and a CUDA checkpoint of this worker may fail "
    "or hang unless the server runs with --disable-custom-all-reduce"
)


def loaded_parallel_state() -> ModuleType | None:
    """vLLM's parallel_state if this process loaded it (every worker did); never imports vLLM."""
    return sys.modules.get(PARALLEL_STATE_MODULE)


def world_size_of(parallel_state: ModuleType | None, environ: Mapping[str, str]) -> int:
    group = getattr(parallel_state, "_WORLD", None)
    group_size = getattr(group, "world_size", None)
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None)
    torch_size = None
    if dist is not None and dist.is_available() and dist.is_initialized():
        torch_size = int(dist.get_world_size())
    return world_size_from(int(group_size) if group_size is not None else None, torch_size, environ)
