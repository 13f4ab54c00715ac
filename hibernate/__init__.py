"""hibernate: put a live GPU process to sleep and wake it in place.

Inside the process to be hibernated::

    import hibernate
    hibernate.track(model)                              # weights: kept
    hibernate.track(kv_cache, tag="kv_cache", keep=False)  # dropped, back zero-filled
    with hibernate.guard():
        out = model(x)                                  # a sleep waits for this to finish

or, where CUDA graphs or compiled code hold the memory's addresses::

    with hibernate.pool():                              # same addresses after every wake
        model = build_model().cuda()
    graph = torch.cuda.CUDAGraph()
    with hibernate.cuda_graph(graph):                   # its private pool is hibernated too
        out = model(static_input)

From outside: ``hibernate sleep <pid> --to DIR`` and ``hibernate wake <pid>``.
The process itself may call :func:`sleep` and :func:`wake`.

Importing this package does not import torch; ``track`` does, on first use.

Where this process's agent cannot start (its runtime directory belongs to
another user), hibernate is *off* in the process, never its end: one line on
stderr says why and what to set; ``track`` records nothing, ``pool()`` and
``cuda_graph()`` are plain allocations and captures, and ``sleep()`` and
``wake()`` raise :class:`~hibernate.errors.UnsupportedError`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hibernate.version import __version__

__all__ = [
    "__version__",
    "adopt",
    "cuda_graph",
    "guard",
    "pool",
    "sleep",
    "state",
    "track",
    "untrack",
    "wake",
]


def track(
    obj: Any,
    tag: str = "weights",
    keep: bool = True,
    *,
    name: str | None = None,
    on_signal: str | None = None,
    wake_signal: str | None = None,
    to: str | Path | None = None,
    exit_after_sleep: bool = False,
) -> Any:
    """Register tensors to hibernate and start this process's agent; returns ``obj``.

    ``obj`` is an ``nn.Module`` (parameters, their gradients, buffers), an
    optimizer (its state), a tensor, or a dict/list of those. With
    ``keep=False`` (a KV cache, scratch space) the contents are dropped on
    sleep and come back zero-filled. Tracking the same object again updates
    its tag and keep.

    ``on_signal="USR1"`` makes that signal put the process to sleep into ``to``
    (and ``wake_signal`` wake it), for a scheduler's warning signal; the
    environment variables HIBERNATE_ON_SIGNAL, HIBERNATE_WAKE_SIGNAL and
    HIBERNATE_DIR do the same without changing the program. With
    ``exit_after_sleep`` (HIBERNATE_EXIT_AFTER_SLEEP=1) the process then exits,
    as the signal would have ended it, once the snapshot is written: a requeued
    job's next run adopts it.

    With HIBERNATE_ADOPT set to a path (a requeued job's snapshot directory),
    each object tracked is filled from the snapshot there, as :func:`adopt`
    fills it; where it holds no complete snapshot yet, the program starts
    afresh.
    """
    import os

    from hibernate.agent import signals as agent_signals
    from hibernate.agent.local import local_agent

    if exit_after_sleep and on_signal is None:
        from hibernate.errors import UsageError

        raise UsageError("exit_after_sleep=True needs on_signal: the signal whose sleep ends the process")
    if _off():
        return obj
    from hibernate.agent.adopt import ADOPT_ENV, adopt_on_track
    from hibernate.pools.tensors import TensorPool

    _watch_captures()
    agent = local_agent()
    if to is not None:
        agent.default_dir = Path(to).expanduser().absolute()
    if on_signal is not None:
        agent_signals.install(
            agent, on_signal, wake_signal, agent.default_dir, exit_after_sleep=exit_after_sleep
        )
        agent.signals_configured = True
    agent = _started_agent()
    pool = agent.pool(TensorPool.name)
    if pool is None:
        pool = TensorPool()
        agent.add_pool(pool)
    assert isinstance(pool, TensorPool)
    pool.track(obj, tag, keep, name)
    adopt_from = os.environ.get(ADOPT_ENV)
    if adopt_from:
        adopt_on_track(agent, pool, obj, adopt_from)
    return obj


@contextmanager
def pool(tag: str = "weights", keep: bool = True) -> Iterator[None]:
    """CUDA memory allocated inside (this thread) keeps its addresses across every sleep and wake.

    Its allocations come from an address-preserving allocator (the provider:
    torch_memory_saver, the ``hibernate[pools]`` extra, or vLLM's
    CuMemAllocator; ``HIBERNATE_POOL_PROVIDER`` picks one) and are hibernated
    under ``tag``: with ``keep`` their bytes are written to the snapshot and
    read back, verified, at the same addresses; without, they come back
    zero-filled. A tag keeps its first ``keep``. CUDA graphs and compiled code
    captured over this memory stay valid. No ``track`` is needed; tracking
    such tensors too changes nothing. The block holds ``guard()``: a sleep
    waits for it, and it waits for a wake. Starts this process's agent, as
    ``track`` does.
    """
    _check_tag(tag)
    if _off():
        yield
        return
    _watch_captures()
    agent, provider = _pool_provider(tag, keep)
    with agent.guard.hold(), provider.region(tag):
        yield


@contextmanager
def cuda_graph(graph: Any, *, tag: str = "cudagraph", keep: bool = True, **capture: Any) -> Iterator[None]:
    """``torch.cuda.graph(graph, ...)`` captured into an address-preserving pool.

    The memory the capture allocates (the graph's intermediates and outputs,
    and tensors created inside the block) is in ``tag``'s pool, shared by
    every capture and ``pool()`` block of that tag: released on sleep and
    mapped back at the same addresses on wake, with its bytes (``keep``, the
    default) or zero-filled. Memory the graph reads that was made outside
    (its weights, a static input) belongs in ``pool()`` too. The capture must
    allocate on this thread (not a backward pass captured by
    ``make_graphed_callables``). ``capture`` takes ``torch.cuda.graph``'s other
    arguments (``stream``, ``capture_error_mode``), not ``pool``.
    """
    import torch

    from hibernate.errors import UsageError
    from hibernate.pools.capture import watch_of_process

    if "pool" in capture:
        raise UsageError("hibernate.cuda_graph() chooses the graph's pool itself; do not pass pool=")
    _check_tag(tag)
    if _off():
        with torch.cuda.graph(graph, **capture):
            yield
        return
    _watch_captures()
    agent, provider = _pool_provider(tag, keep)
    with (
        agent.guard.hold(),
        provider.graph_pool(tag) as pool_id,
        torch.cuda.graph(graph, pool=pool_id, **capture),
    ):
        watch_of_process().mark_in_hibernate_pool(graph)
        yield


def _watch_captures() -> None:
    """From now on every CUDA graph captured in this process is seen (hibernate.pools.capture)."""
    import torch

    from hibernate.pools import capture

    capture.watch(torch.cuda)


def _check_tag(tag: Any) -> None:
    from hibernate.errors import UsageError

    if not isinstance(tag, str) or not tag or any(ch in tag for ch in "/\n\0"):
        raise UsageError(f"tag {tag!r} must be a non-empty name without '/', a newline or a NUL")


def _off() -> bool:
    """Whether hibernate is off in this process: its agent could not open its socket (said once, here).

    Then nothing outside can put the process to sleep, so nothing is tracked
    or pooled: memory is the program's own, as without hibernate.
    """
    from hibernate.agent import local

    local.local_agent()
    if local.unserved_reason() is None:
        return False
    local.say_unserved_once(
        "hibernate is off in this process: nothing is tracked, pools and graphs are plain ones, "
        "and hibernate.sleep() raises"
    )
    return True


def _pool_provider(tag: str, keep: bool) -> tuple[Any, Any]:
    """This process's agent, and its provider with ``tag`` declared and its pool added to the agent."""
    from hibernate.errors import UsageError
    from hibernate.pools import provided

    provider = provided.current(_make_provider)
    agent = _started_agent()
    pool = provider.pool()
    existing = agent.pool(pool.name)
    if existing is not None and existing is not pool:
        raise UsageError(
            f"this process's {pool.name} allocations are already hibernated by {agent.runtime} "
            "(in a vLLM worker, vLLM's sleep mode does it): hibernate.pool() cannot take them too",
            hint="allocate through vLLM's own pools there, or set HIBERNATE_POOL_PROVIDER=torch_memory_saver",
        )
    provider.declare(tag, keep)
    agent.add_pool(pool)
    return agent, provider


def _started_agent() -> Any:
    """This process's agent, with the sleep and wake signals its environment asks for (once)."""
    import os

    from hibernate.agent import signals as agent_signals
    from hibernate.agent.local import local_agent

    agent = local_agent()
    if not agent.signals_configured:
        agent_signals.install_from_environment(agent, dict(os.environ))
        agent.signals_configured = True
    return agent


def _make_provider(name: str) -> Any:
    from hibernate.pools import provided

    if name == provided.TORCH_MEMORY_SAVER:
        from hibernate.pools.tms import TmsProvider

        return TmsProvider()
    from hibernate.pools.vllm import CuMemProvider

    return CuMemProvider()


def untrack(obj: Any) -> bool:
    """Stop hibernating ``obj``; True if it was tracked."""
    from hibernate.agent.local import local_agent
    from hibernate.pools.tensors import TensorPool

    pool = local_agent().pool(TensorPool.name)
    return isinstance(pool, TensorPool) and pool.untrack(obj)


def sleep(
    to: str | Path,
    *,
    timeout: float = 30.0,
    buffer_mb: int = 256,
    verify: bool = False,
    skip_reuse_check: bool | None = None,
    allow_moves: bool | None = None,
) -> dict[str, Any]:
    """Hibernate this process's tracked memory to ``to`` (a directory), from inside.

    Waits up to ``timeout`` seconds for ``guard()`` holders. Must not be called
    from a thread holding the guard. Only tracked memory is released: a process
    cannot take its own CUDA context off the GPU (``hibernate sleep PID`` from
    another process can). ``verify`` reads the snapshot back whole before
    anything is released. ``skip_reuse_check`` (default: ``$HIBERNATE_SKIP_REUSE_CHECK``)
    reuses the previous snapshot's unchanged chunks without reading them back
    first; the result's ``spill.warnings`` then says how many bytes were trusted.
    ``allow_moves`` lets a sleep move tracked CUDA memory while the process
    has captured CUDA graphs (the program captures them again after each
    wake; default ``$HIBERNATE_ALLOW_MOVES``); without it such a sleep raises
    AddressesWouldMoveError.
    """
    from hibernate.agent.local import local_agent
    from hibernate.environ import ALLOW_MOVES_ENV, SKIP_REUSE_CHECK_ENV, flag_or_env

    _refuse_if_off("sleep")
    directory = Path(to).expanduser().absolute()
    args = {
        "buffer_mb": buffer_mb,
        "verify": verify,
        "skip_reuse_check": flag_or_env(skip_reuse_check, SKIP_REUSE_CHECK_ENV),
        "allow_moves": flag_or_env(allow_moves, ALLOW_MOVES_ENV),
    }
    return local_agent().sleep_here(directory, timeout, args)


def wake(*, buffer_mb: int = 256) -> dict[str, Any]:
    """Bring back what :func:`sleep` released, verified against its checksums."""
    from hibernate.agent.local import local_agent

    _refuse_if_off("wake")
    return local_agent().wake_here({"buffer_mb": buffer_mb})


def adopt(path: str | Path, *, timeout: float = 30.0, buffer_mb: int = 256) -> dict[str, Any]:
    """Fill every tracked tensor from the snapshot of a process that is gone (killed, requeued, moved).

    Call it in a new process of the same program, after tracking its model and
    optimizer, before using them. ``path`` is a snapshot (``.../snap-NNNNNN``),
    a process's directory in a ``--to`` directory (its newest complete
    snapshot), or the ``--to`` directory itself (the newest of its processes').
    Tensors are matched by name, whatever device the snapshot had them on; an
    optimizer that has not stepped yet gets its state from the snapshot, placed
    as ``load_state_dict`` would place it in this process. Every chunk
    is verified as a wake verifies it; any difference in names, dtypes, shapes
    or sizes is refused, all listed, before anything is written. A snapshot
    whose process still runs is refused (wake it instead); another user's is
    never read. Tags tracked with ``keep=False`` come back zero-filled. The
    CUDA context, kernels, graphs and communicators are the new program's own.
    Returns what was adopted, from which snapshot and why that one.
    """
    from hibernate.agent.adopt import adopt_here

    _refuse_if_off("adopt")
    return adopt_here(_started_agent(), Path(path), timeout=timeout, args={"buffer_mb": buffer_mb})


def _refuse_if_off(what: str) -> None:
    from hibernate.agent.local import unserved_reason
    from hibernate.errors import UnsupportedError

    if _off():
        raise UnsupportedError(
            f"hibernate.{what}(): hibernate is off in this process, whose agent did not start "
            f"({unserved_reason()}): nothing was tracked, so there is nothing to {what}",
            hint="set HIBERNATE_RUNTIME_DIR (or XDG_RUNTIME_DIR) to a directory only your user can write, "
            "then restart the program",
        )


def state() -> str:
    """``running``, ``asleep``, or a transitional state (``quiesced``, ``spilled``)."""
    from hibernate.agent.local import local_agent

    return local_agent().state.value


@contextmanager
def guard(*, wait: bool = True, timeout: float | None = None) -> Iterator[None]:
    """Hold while using tracked tensors; blocks while asleep (or raises, with ``wait=False``)."""
    from hibernate.agent.local import local_agent

    with local_agent().guard.hold(wait=wait, timeout=timeout):
        yield
