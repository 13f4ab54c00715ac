"""Every CUDA graph this process captures, seen at its capture: what a sleep must not move memory under.

A captured graph replays its kernels on the device addresses they were
captured with. Reading torch's allocator (hibernate.pools.graphs) shows only
graphs whose private pool holds memory: a capture into static buffers or
``out=`` tensors allocates nothing, a capture into a ``MemPool`` of the
program's own looks like any user pool, and both replay on the weights' old
addresses after a wake that moved them. So from the first ``hibernate.track``
or ``hibernate.pool`` in a process, the captures themselves are watched: the
capture entry points of torch (``torch.cuda.CUDAGraph.capture_begin`` and
``reset``, and ``torch.cuda.graph``'s entry, which ``make_graphed_callables``
and ``torch.compile(mode="reduce-overhead")`` go through) are wrapped, and
each graph captured is kept by weak reference with where the program began
it. A graph is alive until it is reset or collected.

What still cannot be seen: a graph captured before the first
``track``/``pool`` (its pool may still show in the allocator, which is read
too), and graphs made outside torch's Python classes (the CUDA runtime
called directly, a C++ extension, ``torch._C._CUDAGraph`` used bare).

Importing this module does not import torch; ``watch`` wraps whatever
``torch.cuda`` holds when it is called (a test's stand-ins included), each
class once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from hibernate.pools.graphs import PoolId

_WATCHED = "_hibernate_watched"  # set on a class whose capture entry points are wrapped
# hibernate's own frames between the program and a capture: cuda_graph() in the package's API, the hooks.
# Spelt as the import spelt this file (a code object's file name is, relative where its path entry was).
_OWN_FILES = (os.path.join(os.path.dirname(os.path.dirname(__file__)), "__init__.py"), __file__)


@dataclass(frozen=True)
class SeenGraph:
    """A live graph: where the program began its capture, its pool, and whether a provider's pool holds it."""

    captured_at: str
    pool: PoolId | None
    hibernate_pool: bool
    through: str | None = None  # what captured it for the program ("torch.compile"), if not the program

    def describe(self) -> str:
        via = f" by {self.through}" if self.through else ""
        pool = f", memory pool {self.pool}" if self.pool is not None else ""
        return f"a CUDA graph captured{via} at {self.captured_at}{pool}"

    def to_wire(self) -> dict[str, Any]:
        return {
            "captured_at": self.captured_at,
            "pool": list(self.pool) if self.pool is not None else None,
            "hibernate_pool": self.hibernate_pool,
            "through": self.through,
        }


@dataclass
class _Entry:
    graph: weakref.ref[Any]
    captured_at: str
    through: str | None
    order: int


class CaptureWatch:
    """The graphs captured since the watch began, by weak reference (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._order = itertools.count()
        self._in_hibernate_pool: set[int] = set()  # ids of graphs hibernate.cuda_graph captured

    def record(self, graph: Any, captured_at: str, through: str | None) -> None:
        """``graph`` began a capture at ``captured_at`` (the first record of a capture wins)."""
        key = id(graph)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.graph() is graph:
                return
            try:
                ref = weakref.ref(graph, functools.partial(self._collected, key))
            except TypeError:  # a class without weak references: seen by its pool only
                return
            self._entries[key] = _Entry(ref, captured_at, through, next(self._order))

    def _collected(self, key: int, ref: weakref.ref[Any]) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.graph is ref:
                del self._entries[key]
                self._in_hibernate_pool.discard(key)

    def forget(self, graph: Any) -> None:
        """``graph`` was reset: it holds no captured work any more."""
        key = id(graph)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.graph() is graph:
                del self._entries[key]
                self._in_hibernate_pool.discard(key)

    def mark_in_hibernate_pool(self, graph: Any) -> None:
        """``graph`` was captured by ``hibernate.cuda_graph``: its own memory keeps its addresses."""
        with self._lock:
            self._in_hibernate_pool.add(id(graph))

    def live(self) -> list[SeenGraph]:
        """The graphs alive now, in the order they were captured."""
        with self._lock:
            entries = sorted(self._entries.items(), key=lambda item: item[1].order)
            pooled = set(self._in_hibernate_pool)
        seen = []
        for key, entry in entries:
            graph = entry.graph()
            if graph is None:
                continue
            seen.append(SeenGraph(entry.captured_at, _pool_of(graph), key in pooled, entry.through))
        return seen


def _pool_of(graph: Any) -> PoolId | None:
    """The graph's memory pool, where it can say (a graph whose capture failed cannot)."""
    try:
        first, second = graph.pool()
        return int(first), int(second)
    except Exception:  # a graph not captured (yet), or one of a torch that will not say
        return None


_watch = CaptureWatch()


def watch_of_process() -> CaptureWatch:
    return _watch


def live_graphs() -> list[SeenGraph]:
    """The graphs this process captured since its first track/pool that are alive now."""
    return _watch.live()


# -- where a capture began ---------------------------------------------------------------------


def _skipped(filename: str, skip: Iterable[str]) -> bool:
    return filename in _OWN_FILES or any(
        filename == entry or filename.startswith(entry + os.sep) for entry in skip
    )


def program_frame(frame: FrameType | None, skip: Iterable[str]) -> tuple[str, str | None]:
    """Where the program began a capture, as ``file:line (function)``, and what captured for it.

    Frames of hibernate's API and hooks, of the library that defines the
    graph classes (torch, ``skip``) and of contextlib are passed over: the
    first frame left is the program's line. A capture made by torch.compile's CUDA graph
    trees (torch/_inductor) says so.
    """
    skip = [*skip, os.path.dirname(contextlib.__file__) + os.sep + "contextlib.py"]
    through = None
    while frame is not None:
        filename = frame.f_code.co_filename
        if f"{os.sep}_inductor{os.sep}" in filename or f"{os.sep}_dynamo{os.sep}" in filename:
            through = 'torch.compile(mode="reduce-overhead")'
        if not _skipped(filename, skip):
            return f"{filename}:{frame.f_lineno} (in {frame.f_code.co_name})", through
        frame = frame.f_back
    return "an unknown place", through


# -- the hooks -------------------------------------------------------------------------------


def _library_files(*classes: Any) -> list[str]:
    """The files and directories whose frames stand for the graph library, not the program: torch's
    package, and the modules that define ``classes`` (torch's, or a test's stand-ins)."""
    found = []
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if isinstance(torch_file, str):
        found.append(os.path.dirname(torch_file))
    for cls in classes:
        filename = getattr(sys.modules.get(getattr(cls, "__module__", "")), "__file__", None)
        if filename:
            found.append(filename)
    return found


def _wrap_capture_begin(original: Callable[..., Any], skip: list[str]) -> Callable[..., Any]:
    @functools.wraps(original)
    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        where, through = program_frame(sys._getframe(1), skip)
        _watch.record(self, where, through)
        return result

    return capture_begin


def _wrap_reset(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reset(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        _watch.forget(self)
        return result

    return reset


def _wrap_enter(original: Callable[..., Any], skip: list[str]) -> Callable[..., Any]:
    @functools.wraps(original)
    def enter(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        graph = getattr(self, "cuda_graph", None)
        if graph is not None:  # a graph object of a class watch() did not wrap is recorded here
            where, through = program_frame(sys._getframe(1), skip)
            _watch.record(graph, where, through)
        return result

    return enter


_hook_lock = threading.Lock()


def _unwatched(cls: Any) -> bool:
    return inspect.isclass(cls) and not cls.__dict__.get(_WATCHED)


def watch(cuda: Any) -> None:
    """Wrap the capture entry points of ``cuda`` (``torch.cuda``) once per class, from now on."""
    graph_class: Any = getattr(cuda, "CUDAGraph", None)
    context_class: Any = getattr(cuda, "graph", None)
    skip = _library_files(*(c for c in (graph_class, context_class) if c is not None))
    with _hook_lock:
        if _unwatched(graph_class):
            graph_class.capture_begin = _wrap_capture_begin(graph_class.capture_begin, skip)
            graph_class.reset = _wrap_reset(graph_class.reset)
            setattr(graph_class, _WATCHED, True)
        if _unwatched(context_class):
            context_class.__enter__ = _wrap_enter(context_class.__enter__, skip)
            setattr(context_class, _WATCHED, True)
