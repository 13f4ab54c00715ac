"""Whether a sleep would move memory that a captured CUDA graph may read: pure functions.

A CUDA graph replays its kernels against the device addresses it captured.
A tracked storage (``hibernate.track``) is released by resizing it to zero and
comes back wherever the allocator puts it; memory in ``hibernate.pool()`` comes
back at its own addresses. So a process that captured graphs over tracked
memory would, after a wake, replay them against memory that is no longer its
tensors: wrong answers or an illegal address, and no error anywhere.

Two sources say which graphs live. The captures themselves, watched from the
first ``track``/``pool`` in the process (hibernate.pools.capture): every graph
torch captured since, whether it allocated anything or not. And torch's
allocator: every segment names its pool (``segment_pool_id``); torch numbers
the pools a user creates (``torch.cuda.MemPool``: vLLM's,
torch_memory_saver's, ``hibernate.pool()``'s) ``(0, N)``, and the private pools
that CUDA graphs make for themselves (``torch.cuda.graph`` without ``pool=``,
``graph_pool_handle()``, the graph trees of
``torch.compile(mode="reduce-overhead")``) ``(N, 0)``: a graph pool holding
memory that no watched graph owns was made by a graph captured before the
watch began (or by one that is gone, until ``torch.cuda.empty_cache()`` gives
its memory back). Graphs made outside torch's Python classes (the CUDA
runtime called directly) are seen by neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

PoolId = tuple[int, int]


def is_graph_pool(pool: PoolId) -> bool:
    """A private pool a CUDA graph made for itself (``(N, 0)``), not a user's MemPool or the default."""
    first, second = pool
    return first != 0 and second == 0


def graph_pools(segments: Iterable[Mapping[str, Any]]) -> list[PoolId]:
    """The graph pools that hold segments now, each once, in order; [] where torch does not name pools."""
    found: dict[PoolId, None] = {}
    for segment in segments:
        pool = segment.get("segment_pool_id")
        if pool is None:
            continue
        first, second = pool
        pool_id = (int(first), int(second))
        if is_graph_pool(pool_id):
            found[pool_id] = None
    return list(found)


def graph_descriptions(live: Sequence[tuple[str, PoolId | None]], pools: Sequence[PoolId]) -> list[str]:
    """Every graph a sleep must answer for, in words: the ``live`` graphs seen at their capture
    (description, pool), then the graph ``pools`` holding memory that none of those owns."""
    owned = {pool for _, pool in live if pool is not None}
    unseen = [
        f"a CUDA graph's private pool {pool} (captured before hibernate watched captures, or by a graph "
        "now deleted whose memory torch.cuda.empty_cache() would give back)"
        for pool in pools
        if pool not in owned
    ]
    return [description for description, _ in live] + unseen


def moves_refusal(moving: Sequence[tuple[str, int]], graphs: Sequence[str]) -> str | None:
    """Why a sleep moving ``moving`` (key, bytes) may not run beside ``graphs`` (described); None if it may.

    Nothing moves, or no graph is alive: nothing to refuse. Otherwise the
    message names the graphs and the largest storages that would move.
    """
    if not moving or not graphs:
        return None
    shown = sorted(moving, key=lambda item: -item[1])[:5]
    names = ", ".join(f"{key} ({nbytes} bytes)" for key, nbytes in shown)
    more = f" and {len(moving) - len(shown)} more" if len(moving) > len(shown) else ""
    total = sum(nbytes for _, nbytes in moving)
    listed = "; ".join(graphs[:5]) + (f"; and {len(graphs) - 5} more graphs" if len(graphs) > 5 else "")
    return (
        f"this process has captured CUDA graphs ({listed}) and {len(moving)} tracked storage(s) "
        f"({total} bytes) would come back at new addresses after the wake: {names}{more}; a graph that "
        "reads any of them would, replayed after the wake, read memory that is no longer those tensors. "
        "Nothing was changed"
    )


MOVES_HINT = (
    "allocate that memory inside `with hibernate.pool():` (and capture graphs with "
    'hibernate.cuda_graph; for torch.compile(mode="reduce-overhead"), build the model inside '
    "hibernate.pool()) so it keeps its addresses; or, if the program captures its graphs again "
    "after every wake, pass --allow-moves (hibernate.sleep(..., allow_moves=True))"
)
