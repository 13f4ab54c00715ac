"""Whether a sleep would move memory that a captured CUDA graph may read: pure functions.

A CUDA graph replays its kernels against the device addresses it captured.
A tracked storage (``hibernate.track``) is released by resizing it to zero and
comes back wherever the allocator puts it; memory in ``hibernate.pool()`` comes
back at its own addresses. So a process that captured graphs over tracked
memory would, after a wake, replay them against memory that is no longer its
tensors: wrong answers or an illegal address, and no error anywhere.

What can be seen from inside the process is torch's allocator: every segment
names its pool (``segment_pool_id``). torch numbers the pools a user creates
(``torch.cuda.MemPool``: vLLM's, torch_memory_saver's, ``hibernate.pool()``'s)
``(0, N)``, and the private pools that CUDA graphs make for themselves
(``torch.cuda.graph`` without ``pool=``, ``graph_pool_handle()``, the graph
trees of ``torch.compile(mode="reduce-overhead")``) ``(N, 0)``. A live graph
pool is the sign that graphs were captured outside an address-preserving pool.
Graphs captured with ``hibernate.cuda_graph`` live in a user pool of the
provider's; the provider names those pools. What cannot be seen: a graph
captured into a user pool of the program's own (``pool=my_mempool.id``), a
graph that allocated nothing, and graphs made by other libraries directly
through the CUDA runtime. A graph pool whose graphs are gone may still hold
its segments until torch empties its cache: a sleep is then refused until it
does (``torch.cuda.empty_cache()``).
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


def moves_refusal(moving: Sequence[tuple[str, int]], pools: Sequence[PoolId]) -> str | None:
    """Why a sleep that moves ``moving`` (key, bytes) may not run beside graph ``pools``; None if it may.

    Nothing moves, or no graph pool is alive: nothing to refuse. Otherwise the
    message names the graphs' pools and the largest storages that would move.
    """
    if not moving or not pools:
        return None
    shown = sorted(moving, key=lambda item: -item[1])[:5]
    names = ", ".join(f"{key} ({nbytes} bytes)" for key, nbytes in shown)
    more = f" and {len(moving) - len(shown)} more" if len(moving) > len(shown) else ""
    total = sum(nbytes for _, nbytes in moving)
    plural = "s" if len(pools) > 1 else ""
    return (
        f"this process has captured CUDA graphs (private memory pool{plural} "
        f"{', '.join(map(str, pools))}) and {len(moving)} tracked storage(s) ({total} bytes) would come "
        f"back at new addresses after the wake: {names}{more}; a graph that reads any of them would, "
        "replayed after the wake, read memory that is no longer those tensors. Nothing was changed"
    )


MOVES_HINT = (
    "allocate that memory inside `with hibernate.pool():` (and capture graphs with "
    "hibernate.cuda_graph) so it keeps its addresses; or, if the program captures its graphs again "
    "after every wake, pass --allow-moves (hibernate.sleep(..., allow_moves=True))"
)
