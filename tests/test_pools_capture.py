"""Every CUDA graph captured after the first track or pool is seen, alive until reset or collected.

The graph classes are the stand-ins of tests/standins/cuda_graphs.py, which
keep torch's contract (``capture_begin``, ``reset``, ``pool``, the ``graph``
context): what ``hibernate.pools.capture.watch`` wraps in torch itself.
"""

from __future__ import annotations

import gc
import inspect
import sys
from types import SimpleNamespace

import torch

from hibernate.pools import capture
from hibernate.pools.provided import (
    MAP_GRANULARITY,
    PER_MAPPING_MARGIN,
    ROOM_HEADROOM_BYTES,
    Span,
    bytes_to_map,
    resume_margin,
)
from tests.standins import cuda_graphs

STANDINS = SimpleNamespace(CUDAGraph=cuda_graphs.CUDAGraph, graph=cuda_graphs.graph)


def seen_here(line: int) -> list[capture.SeenGraph]:
    return [g for g in capture.live_graphs() if g.captured_at.startswith(f"{__file__}:{line} ")]


def test_a_graph_is_seen_where_the_program_began_it_until_it_is_reset() -> None:
    capture.watch(STANDINS)
    graph = cuda_graphs.CUDAGraph()
    out = torch.empty(8)
    with cuda_graphs.graph(graph):
        torch.add(torch.ones(8), 1, out=out)
    line = inspect.currentframe().f_lineno - 2  # type: ignore[union-attr]
    [seen] = seen_here(line)
    assert seen.captured_at.endswith("(in test_a_graph_is_seen_where_the_program_began_it_until_it_is_reset)")
    assert seen.pool == graph.pool() and seen.hibernate_pool is False and seen.through is None
    assert seen.describe().startswith(f"a CUDA graph captured at {__file__}:{line} ")
    graph.reset()
    assert seen_here(line) == []


def test_a_graph_begun_by_hand_is_seen_and_a_collected_one_is_gone() -> None:
    capture.watch(STANDINS)
    graph = cuda_graphs.CUDAGraph()
    graph.capture_begin()
    line = inspect.currentframe().f_lineno - 1  # type: ignore[union-attr]
    graph.capture_end()
    assert len(seen_here(line)) == 1
    del graph
    gc.collect()
    assert seen_here(line) == []


def test_watching_twice_wraps_each_class_once() -> None:
    capture.watch(STANDINS)
    wrapped = cuda_graphs.CUDAGraph.capture_begin
    capture.watch(STANDINS)
    assert cuda_graphs.CUDAGraph.capture_begin is wrapped


def test_a_capture_by_torch_compile_is_named_so_at_the_programs_line() -> None:
    """torch.compile's graph trees capture from torch/_inductor: the program's line is outside torch."""
    library = "/site-packages/torch"
    inner = compile("frame = sys._getframe()", f"{library}/_inductor/cudagraph_trees.py", "exec")
    scope: dict[str, object] = {"sys": sys}
    exec(inner, scope)  # a frame of torch's graph trees, called from this test
    where, through = capture.program_frame(scope["frame"], [library])  # type: ignore[arg-type]
    assert where.startswith(f"{__file__}:") and through == 'torch.compile(mode="reduce-overhead")'


def test_what_a_provider_maps_back_is_rounded_per_allocation_and_its_margin_grows_with_them() -> None:
    spans = [Span("w", 0, 0, 1), Span("w", 0, 8 << 20, MAP_GRANULARITY + 1), Span("w", 1, 0, MAP_GRANULARITY)]
    assert bytes_to_map(spans) == {0: 3 * MAP_GRANULARITY, 1: MAP_GRANULARITY}
    assert resume_margin(0) == ROOM_HEADROOM_BYTES
    assert resume_margin(1000) - resume_margin(0) == 1000 * PER_MAPPING_MARGIN
