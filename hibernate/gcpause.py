"""Hold off the cyclic garbage collector while many small objects are built.

A manifest encoded or parsed, a wake's plan and a sleep's chunks (the store)
and a region per tracked storage (the pools) each make a few objects per
tensor; gc_paused says what the collector cost them.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector while many small containers are built.

    Parsing or building a manifest of N records makes ~15 N dicts, lists and
    tuples, none of them in a reference cycle, and every 700 new containers the
    collector walks the young ones and, ever more often, the whole heap: at
    100,000 records ``json.loads`` took 1.3 s with it and 0.4 s without. The
    collector is only deferred (and re-enabled as it was), never skipped:
    nothing made here needs it.

    On the way out, what was allocated meanwhile is moved to the oldest
    generation (``gc.freeze`` then ``gc.unfreeze``, which also zeroes the
    young generation's count) instead of being left young: otherwise the
    first allocation after re-enabling walks it all, then promotes it, and
    soon a full collection walks the whole heap again (0.7 s at 100,000
    tensors). The objects made here live until the wake anyway; any garbage
    cycle among them (or the program's) is still found, by the next full
    collection.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()
