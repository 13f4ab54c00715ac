"""The torch.cuda graph stand-in keeps torch's contract: a capture records, a replay runs.

On a GPU, the ops inside ``torch.cuda.graph`` are recorded, not run: their
outputs are fresh memory of the capture's pool, garbage until the first
replay, and a replay runs the kernels on the addresses they were captured
with. The capture's pool is the graph's own (``(N, 0)``), another graph's, or
a MemPool's given as ``pool=`` (torch_memory_saver's, vLLM's).
"""

from __future__ import annotations

import ctypes
import gc
from collections.abc import Iterator

import pytest
import torch

from tests.standins import cuda_graphs, tms
from tests.standins.cuda_graphs import CUDAGraph, graph
from tests.standins.vllm_memory import PAGE, POISON, HostReservations, StandInFault


@pytest.fixture
def saver() -> Iterator[tms.TorchMemorySaver]:
    with tms.installed(fatal_raises=True) as module:
        module.torch_memory_saver.hook_mode = "torch"
        yield module.torch_memory_saver


def garbage(tensor: torch.Tensor) -> bool:
    return set(tensor.detach().reshape(-1).view(torch.uint8).tolist()) == {POISON}


def segments_of(pool: tuple[int, int]) -> list[dict[str, object]]:
    return [s for s in cuda_graphs.memory_snapshot() if s["segment_pool_id"] == pool]


def inside(tensor: torch.Tensor, segments: list[dict[str, object]]) -> bool:
    address = tensor.data_ptr()
    return any(
        int(s["address"]) <= address < int(s["address"]) + int(s["total_size"])  # type: ignore[call-overload]
        for s in segments
    )


def test_a_capture_records_without_running_and_a_replay_runs_on_the_captured_addresses() -> None:
    linear = torch.nn.Linear(8, 5)
    inputs = torch.randn(3, 8)
    steps = torch.zeros(1)
    g = CUDAGraph()
    with torch.no_grad(), graph(g):
        out = torch.relu(linear(inputs)) * 2
        steps.add_(1)  # an in-place kernel on memory made before the capture
    assert garbage(out), "outputs hold garbage until the first replay"
    assert torch.equal(steps, torch.zeros(1)), "nothing ran during the capture"
    assert g.kernels == 4  # addmm, relu, mul, add_ (the transpose is a view: no kernel)
    address = out.data_ptr()

    g.replay()
    with torch.no_grad():
        assert torch.equal(out, torch.relu(linear(inputs)) * 2)
        inputs.copy_(torch.randn(3, 8))  # new data in the static input, in place
        g.replay()
        assert torch.equal(out, torch.relu(linear(inputs)) * 2)
    assert out.data_ptr() == address and torch.equal(steps, torch.full((1,), 2.0))


def test_new_tensors_of_a_capture_come_from_its_private_pool_and_one_it_shares() -> None:
    inputs = torch.randn(64)
    first, second = CUDAGraph(), CUDAGraph()
    with graph(first):
        doubled = inputs * 2
    pool = first.pool()
    assert pool[0] >= 1 and pool[1] == 0
    assert inside(doubled, segments_of(pool)) and inside(doubled, cuda_graphs.graph_segments())
    with graph(second, pool=pool):
        tripled = inputs * 3
    assert second.pool() == pool and inside(tripled, segments_of(pool))
    handle = cuda_graphs.graph_pool_handle()
    third = CUDAGraph()
    with graph(third, pool=handle):
        quadrupled = inputs * 4
    assert third.pool() == handle and inside(quadrupled, segments_of(handle))

    for captured in (first, second, third):
        captured.replay()
    assert torch.equal(doubled, inputs * 2) and torch.equal(tripled, inputs * 3)
    assert torch.equal(quadrupled, inputs * 4)
    first.reset()
    second.reset()
    del doubled, tripled
    gc.collect()
    assert segments_of(pool) == [], "a private pool no graph uses gives its segments back"
    assert segments_of(handle) != []


def test_a_capture_into_a_mempool_allocates_in_it(saver: tms.TorchMemorySaver) -> None:
    with saver.region("weights"):
        linear = torch.nn.Linear(16, 16)
    inputs = torch.randn(2, 16)
    assert saver._impl is not None
    with saver.region("cudagraph"):
        pool = saver._impl._mem_pools[("cudagraph", False, False, "", 0)]
        g = CUDAGraph()
        with torch.no_grad(), graph(g, pool=pool.id):
            out = linear(inputs) + 1
    assert g.pool() == pool.id
    found = tms.find_allocation(out.data_ptr(), out.nbytes)
    assert found is not None and found[1].tag == "cudagraph"
    g.replay()
    with torch.no_grad():
        assert torch.equal(out, linear(inputs) + 1)
    saver.pause("weights")
    with pytest.raises(StandInFault, match="paused torch_memory_saver allocation"):
        g.replay()
    saver.resume("weights")


def test_what_needs_the_host_or_the_data_is_refused_during_a_capture() -> None:
    values = torch.randn(16)
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"), graph(CUDAGraph()):
        (values * 2).sum().item()
    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"), graph(CUDAGraph()):
        torch.nonzero(values > 0)
    assert not cuda_graphs.is_current_stream_capturing()


def test_the_graph_api_refuses_what_torch_refuses() -> None:
    inputs = torch.ones(4)
    g = CUDAGraph()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()
    with pytest.raises(RuntimeError, match="Unknown capture error mode"):
        g.capture_begin(capture_error_mode="loose")
    with graph(g):
        assert cuda_graphs.is_current_stream_capturing()
        with pytest.raises(RuntimeError, match="already underway"):
            CUDAGraph().capture_begin()
        _out = inputs + 1
    with pytest.raises(RuntimeError, match="already owns a captured graph"), graph(g):
        pass
    with pytest.raises(RuntimeError, match="no memory pool with id"):
        CUDAGraph().capture_begin(pool=(0, 10**6))


def test_patched_torch_cuda_installs_the_stand_ins_for_the_block_only() -> None:
    before = (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle)
    with cuda_graphs.patched_torch_cuda():
        assert torch.cuda.CUDAGraph is CUDAGraph and torch.cuda.graph is graph
        g = torch.cuda.CUDAGraph()
        values = torch.arange(6.0)
        with torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
            out = values.flip(0) * 10
        g.replay()
        assert torch.equal(out, values.flip(0) * 10)
    assert (torch.cuda.CUDAGraph, torch.cuda.graph, torch.cuda.graph_pool_handle) == before


def test_a_replay_reads_whatever_lies_at_an_address_whose_tensor_moved() -> None:
    held = torch.full((16,), 3.0)
    g = CUDAGraph()
    with graph(g):
        out = held * 2
    g.replay()
    assert torch.equal(out, torch.full((16,), 6.0))
    old = held.untyped_storage().data_ptr()
    keep_old_mapped = held  # the old storage stays alive: its address holds what is written there
    held = held.clone()  # the program's tensor, elsewhere now
    keep_old_mapped.fill_(5.0)  # something else at the old address
    g.replay()
    assert torch.equal(out, torch.full((16,), 10.0)), "the graph reads the old address"
    assert torch.equal(held * 2, torch.full((16,), 6.0)) and held.data_ptr() != old


def test_a_replay_of_memory_no_longer_mapped_faults_instead_of_crashing() -> None:
    reservations = HostReservations()
    address = reservations.reserve(PAGE)
    values = torch.frombuffer((ctypes.c_uint8 * PAGE).from_address(address), dtype=torch.float32)
    values.fill_(1.0)
    g = CUDAGraph()
    with graph(g):
        out = values[:8] + 1
    g.replay()
    assert torch.equal(out, torch.full((8,), 2.0))
    reservations.unmap(address, PAGE)
    with pytest.raises(StandInFault, match="not mapped"):
        g.replay()
    reservations.map(address, PAGE)  # mapped again, with fresh (poison) contents
    g.replay()
    assert torch.equal(out, values[:8] + 1) and not torch.equal(out, torch.full((8,), 2.0))
