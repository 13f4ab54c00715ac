"""Address-preserving pools: memory that leaves the GPU and comes back at the same addresses.

``hibernate.track`` releases a storage by resizing it to zero; it comes back
wherever the allocator puts it, which breaks every CUDA graph captured over it
(see hibernate.pools.graphs). ``hibernate.pool(tag)`` instead allocates through
a *provider*: a library that reserves virtual address ranges and maps physical
memory into them, so that the physical memory can go while the addresses stay
reserved, and be mapped back at the very same addresses. Two such libraries
are in the field:

* torch_memory_saver, in its ``torch`` hook mode (a ``CUDAPluggableAllocator``
  behind a ``torch.cuda.MemPool`` per tag; no ``LD_PRELOAD``): the
  ``hibernate[pools]`` extra (hibernate.pools.tms);
* vLLM's ``CuMemAllocator`` (hibernate.pools.vllm), where vLLM is installed.

The provider does the mapping; hibernate moves the bytes: each allocation is
spilled through the store before the provider releases it, and written back,
verified, after the provider mapped it again. The provider's own backups stay
off.

This module holds the contract, the choice of a provider
(``HIBERNATE_POOL_PROVIDER``), the process's provider once chosen, and which
address ranges it covers: those are left to its pool by ``hibernate.track``.
Importing it imports neither torch nor a provider.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from hibernate.errors import UnsupportedError, UsageError
from hibernate.pools.base import Pool
from hibernate.pools.graphs import PoolId

PROVIDER_ENV = "HIBERNATE_POOL_PROVIDER"
TORCH_MEMORY_SAVER = "torch_memory_saver"
VLLM_CUMEM = "vllm"
# In the order ``auto`` tries them: torch_memory_saver takes any tag; vLLM's allocator is a
# singleton shared with vLLM itself, where one runs.
PROVIDERS = (TORCH_MEMORY_SAVER, VLLM_CUMEM)

# What each provider needs, for the error that says none is usable.
NEEDS: Mapping[str, str] = {
    TORCH_MEMORY_SAVER: (
        "pip install 'hibernate[pools]' (torch-memory-saver, prebuilt for CUDA 12 and 13) with a CUDA "
        "build of torch, and PYTORCH_CUDA_ALLOC_CONF without expandable_segments:True"
    ),
    VLLM_CUMEM: "a CUDA build of vLLM (its cumem allocator extension loads only with a GPU driver)",
}

# Free memory a wake leaves on a GPU beyond the pools it maps back: the CUDA runtime and the
# caching allocator need some to run the program's first kernels.
ROOM_HEADROOM_BYTES = 64 << 20
# What cuMemCreate maps for an allocation is its size rounded up to the allocation granularity:
# 2 MiB for device memory on every NVIDIA GPU so far (cuMemGetAllocationGranularity's minimum).
MAP_GRANULARITY = 2 << 20
# Before a provider maps its allocations back, beyond the headroom, per allocation: the driver's own
# bookkeeping of each mapping, and a margin against another process's growth that scales with the work.
PER_MAPPING_MARGIN = 256 << 10


@dataclass(frozen=True)
class Span:
    """One allocation of a provider: ``nbytes`` at ``address`` on CUDA device ``device``."""

    tag: str
    device: int
    address: int
    nbytes: int

    def holds(self, address: int) -> bool:
        return self.address <= address < self.address + self.nbytes


class PoolProvider(Protocol):
    """A library whose allocations keep their addresses across a release (see the module docstring)."""

    name: str

    def region(self, tag: str) -> AbstractContextManager[None]:
        """CUDA memory allocated inside, on this thread, comes from the provider under ``tag``."""
        ...

    def graph_pool(self, tag: str) -> AbstractContextManager[PoolId]:
        """Inside: the id of a memory pool of the provider to capture a CUDA graph into (``pool=``)."""
        ...

    def declare(self, tag: str, keep: bool) -> None:
        """Hibernate ``tag``: its contents written to the snapshot (``keep``) or dropped."""
        ...

    def pool(self) -> Pool:
        """The hibernate pool over the declared tags' allocations (the agent sleeps and wakes it)."""
        ...

    def spans(self) -> list[Span]:
        """Every allocation of the declared tags now: what ``hibernate.track`` must leave alone."""
        ...


def declare_once(declared: dict[str, bool], tag: str, keep: bool) -> None:
    """Record ``tag``'s keep; a tag declared again with the other keep is refused.

    Its memory, allocated under the first, would silently follow the second:
    weights declared again with ``keep=False`` would come back zero-filled.
    """
    if declared.get(tag, keep) != keep:
        raise UsageError(
            f"hibernate.pool({tag!r}) was first opened with keep={declared[tag]}; a pool keeps one "
            f"keep for the life of the process, so it cannot be opened with keep={keep}",
            hint="use another tag for memory with the other keep",
        )
    declared[tag] = keep


def choose(requested: str | None, unusable: Mapping[str, str | None]) -> str:
    """The provider to use: ``requested`` (``HIBERNATE_POOL_PROVIDER``), else the first usable one.

    ``unusable`` maps each provider to why it cannot be used here, or None where
    it can. A provider asked for by name that cannot be used is an error of its
    own; none usable names every provider, why, and what each needs.
    """
    wanted = (requested or "auto").strip() or "auto"
    if wanted != "auto" and wanted not in PROVIDERS:
        raise UsageError(
            f"{PROVIDER_ENV}={wanted!r} is not a pool provider",
            hint=f"use one of auto, {', '.join(PROVIDERS)}",
        )
    candidates = PROVIDERS if wanted == "auto" else (wanted,)
    for name in candidates:
        if unusable.get(name) is None:
            return name
    reasons = "; ".join(f"{name}: {unusable.get(name)}" for name in candidates)
    needs = "; ".join(f"{name} needs {NEEDS[name]}" for name in candidates)
    raise UnsupportedError(
        f"hibernate.pool() has no address-preserving allocator to use ({reasons})",
        hint=needs,
    )


def shortfalls(
    need: Mapping[int, int], free: Callable[[int], int | None], headroom: int = ROOM_HEADROOM_BYTES
) -> list[tuple[int, int, int]]:
    """Devices (device, bytes needed with headroom, bytes free) whose free memory cannot take ``need``.

    A device whose free memory cannot be read is not a shortfall: the
    provider's own map would then be the first to know, as it is without
    hibernate.
    """
    short = []
    for device, nbytes in sorted(need.items()):
        available = free(device)
        if available is not None and nbytes + headroom > available:
            short.append((device, nbytes + headroom, available))
    return short


def no_room(short: Sequence[tuple[int, int, int]], what: str) -> UnsupportedError:
    """The refusal of a wake whose GPUs lack room (``shortfalls``) to map ``what`` back."""
    described = ", ".join(
        f"cuda:{device} needs {needed} bytes and has {free} free" for device, needed, free in short
    )
    return UnsupportedError(
        f"not enough free GPU memory to map back {what} ({described}); nothing of it was mapped and the "
        "process stays asleep",
        hint="free memory on that GPU (put another process to sleep), then wake again",
    )


def bytes_to_map(spans: Iterable[Span], granularity: int = MAP_GRANULARITY) -> dict[int, int]:
    """Per device, what mapping ``spans`` back takes: each one rounded up to the granularity."""
    total: dict[int, int] = {}
    for span in spans:
        total[span.device] = total.get(span.device, 0) + -(-span.nbytes // granularity) * granularity
    return total


def resume_margin(mappings: int) -> int:
    """The free memory a provider leaves beyond what it maps back, for ``mappings`` allocations."""
    return ROOM_HEADROOM_BYTES + mappings * PER_MAPPING_MARGIN


# -- which provider this process uses -----------------------------------------------------

_lock = threading.Lock()
_provider: PoolProvider | None = None


def _importable(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def unusable_here() -> dict[str, str | None]:
    """Why each provider cannot be used in this process (None: it can), without importing either."""
    torch = sys.modules.get("torch")
    no_cuda = (
        f"torch {torch.__version__} is not a CUDA build"
        if torch is not None and getattr(torch.version, "cuda", None) is None
        else None
    )
    reasons: dict[str, str | None] = {}
    if not _importable("torch_memory_saver"):
        reasons[TORCH_MEMORY_SAVER] = "torch_memory_saver is not installed"
    else:
        reasons[TORCH_MEMORY_SAVER] = no_cuda
    if not _importable("vllm"):
        reasons[VLLM_CUMEM] = "vLLM is not installed"
    else:
        reasons[VLLM_CUMEM] = no_cuda
    return reasons


def current(make: Callable[[str], PoolProvider]) -> PoolProvider:
    """This process's provider, chosen on first use (``HIBERNATE_POOL_PROVIDER``, default auto).

    ``make`` builds the provider of a name: the providers import this module,
    so it cannot import them.
    """
    global _provider
    with _lock:
        if _provider is None:
            _provider = make(choose(os.environ.get(PROVIDER_ENV), unusable_here()))
        return _provider


def install(provider: PoolProvider) -> None:
    """Use ``provider`` for every later ``hibernate.pool()`` (one built with its own seams, say).

    Refused once another provider holds memory: two providers' pools would
    each need the other's tags.
    """
    global _provider
    with _lock:
        if _provider is not None and _provider is not provider and _provider.spans():
            raise UsageError(
                f"this process already allocates through {_provider.name}; a second pool provider "
                "cannot be installed"
            )
        _provider = provider


def installed() -> PoolProvider | None:
    with _lock:
        return _provider


def covered_spans() -> Sequence[Span]:
    """What the process's provider holds now ([] before any ``hibernate.pool()``); never chooses one."""
    provider = installed()
    return provider.spans() if provider is not None else []
