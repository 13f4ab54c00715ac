"""hibernate.pool() over vLLM's CuMemAllocator (CuMemProvider), in a program that is not vLLM.

The allocator is the stand-in of tests/standins/vllm_memory.py with vLLM
0.33's ``use_memory_pool(tag)`` and ``cudagraph_pool()``: a block's new
tensors come from a MemPool of the allocator, each segment one allocation
recorded under the current tag, at a fixed host address that an unmap makes
unreadable and a map brings back full of poison.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import hibernate
from hibernate.agent.local import local_agent
from hibernate.errors import WrongStateError
from hibernate.pools import provided
from hibernate.pools.vllm import CuMemProvider
from tests.pooled import assert_same, bits, fingerprint
from tests.standins import cuda_graphs
from tests.standins.mempool import SMALL_BUFFER
from tests.standins.vllm_memory import HostDeviceMemory, HostReservations, StandInCuMemAllocator, StandInFault

MIB = 1 << 20
SMALL_CHUNKS = {"buffer_mb": 2, "chunk_mb": 1}


@dataclass
class Cumem:
    allocator: StandInCuMemAllocator
    provider: CuMemProvider

    def tags(self) -> dict[str, int]:
        """Bytes the allocator holds per tag."""
        held: dict[str, int] = {}
        for data in self.allocator.pointer_to_data.values():
            held[data.tag] = held.get(data.tag, 0) + int(data.handle[1])
        return held

    def holder(self, tensor: torch.Tensor) -> Any:
        """The allocation record holding the tensor's memory."""
        address = tensor.data_ptr()
        [data] = [d for a, d in self.allocator.pointer_to_data.items() if a <= address < a + int(d.handle[1])]
        return data

    def mapped(self) -> dict[str, set[bool]]:
        found: dict[str, set[bool]] = {}
        for address, data in self.allocator.pointer_to_data.items():
            found.setdefault(data.tag, set()).add(self.allocator.reservations.is_mapped(address))
        return found


@pytest.fixture
def cumem(fresh_agent: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cumem]:
    """A stand-in CuMemAllocator as this process's pool provider."""
    reservations = HostReservations()
    allocator = StandInCuMemAllocator(reservations)
    memory = HostDeviceMemory(reservations)
    provider = CuMemProvider(allocator=lambda: allocator, device=lambda: memory)
    monkeypatch.setattr(provided, "_provider", None)
    provided.install(provider)
    yield Cumem(allocator, provider)
    for pools in allocator.allocator_and_pools.values():
        for pool in pools:
            pool.release_free_segments()


def sleep(work_dir: Path) -> dict[str, Any]:
    return local_agent().sleep_here(work_dir, 5.0, dict(SMALL_CHUNKS))


def wake() -> dict[str, Any]:
    return local_agent().wake_here({"buffer_mb": 2})


# -- the stand-in keeps vLLM's contract -------------------------------------------------------


def test_a_memory_pool_block_allocates_in_the_allocator_under_its_tag_and_trims_on_exit() -> None:
    allocator = StandInCuMemAllocator(HostReservations())
    with allocator.use_memory_pool("weights"):
        assert allocator.current_tag == "weights"
        linear = torch.nn.Linear(10, 7)
        scratch = torch.empty(3 * MIB, dtype=torch.uint8)  # a 20 MiB segment of its own
        scratch_at = scratch.data_ptr()
        del scratch  # its block is free: the segment goes on the way out
    assert allocator.current_tag == allocator.default_tag
    [(address, data)] = allocator.pointer_to_data.items()
    assert (data.tag, int(data.handle[1])) == ("weights", SMALL_BUFFER)
    assert address == linear.weight.data_ptr() and scratch_at not in allocator.pointer_to_data
    outside = linear(torch.ones(10))
    assert not any(a <= outside.data_ptr() < a + SMALL_BUFFER for a in allocator.pointer_to_data)

    with allocator.use_memory_pool():  # the default tag, a new pool
        cache = torch.zeros(100)
    assert allocator.pointer_to_data[cache.data_ptr()].tag == "default"
    assert len(allocator.allocator_and_pools["weights"]) == 1
    with allocator.cudagraph_pool() as pool_id:
        assert allocator.current_tag == "cudagraph"
        assert pool_id == allocator.allocator_and_pools["cudagraph"][0].id and pool_id[0] == 0
        graph = cuda_graphs.CUDAGraph()
        with cuda_graphs.graph(graph, pool=pool_id):
            doubled = cache * 2
    assert allocator.current_tag == "default"
    assert allocator.pointer_to_data[doubled.data_ptr()].tag == "cudagraph"


def test_a_tensor_in_an_asleep_allocation_faults() -> None:
    reservations = HostReservations()
    allocator = StandInCuMemAllocator(reservations)
    with allocator.use_memory_pool("weights"):
        kept = torch.ones(4)
        freed = torch.ones(4)
    del freed  # a free block in the segment
    data = allocator.pointer_to_data[kept.data_ptr()]
    HostDeviceMemory(reservations).unmap(data.handle)
    with pytest.raises(StandInFault, match="asleep"), allocator.use_memory_pool("weights"):
        allocator.allocator_and_pools["weights"][0].adopt(torch.ones(4).untyped_storage())


# -- sleep and wake through the provider ------------------------------------------------------


def test_pooled_memory_comes_back_at_the_same_addresses_bit_exact(cumem: Cumem, work_dir: Path) -> None:
    torch.manual_seed(0)
    with hibernate.pool():
        model = torch.nn.Sequential(torch.nn.Linear(300, 257), torch.nn.Tanh(), torch.nn.Linear(257, 3))
        big = torch.randn((11 * MIB + 999) // 4)
    with hibernate.pool("state"):
        state = torch.arange(3 * MIB // 8 + 5, dtype=torch.float64)
    tensors = {**{n: p for n, p in model.named_parameters()}, "big": big, "state": state}
    before = fingerprint(tensors)
    inputs = torch.randn(5, 300)
    with torch.no_grad():
        expected = model(inputs)
    held = cumem.tags()
    assert held == {"weights": 2 * MIB + 12 * MIB, "state": 20 * MIB}

    report = sleep(work_dir)
    pools = {(p["tag"], p["keep"]): p["bytes"] for p in report["spill"]["pools"]}
    assert pools == {("weights", True): held["weights"], ("state", True): held["state"]}
    assert cumem.mapped() == {"weights": {False}, "state": {False}}
    wake()
    assert cumem.mapped() == {"weights": {True}, "state": {True}}
    assert_same(tensors, before)
    with torch.no_grad():
        assert torch.equal(model(inputs), expected)


def test_a_dropped_tag_comes_back_zero_filled_and_keep_follows_each_declared_tag(
    cumem: Cumem, work_dir: Path
) -> None:
    with hibernate.pool():
        weights = torch.randn(4099)
    with hibernate.pool("kv_cache", keep=False):
        cache = torch.full((MIB // 4 + 3,), 7.0)
    with hibernate.pool("scratch", keep=False):
        scratch = torch.full((1000,), 5.0)
    before = fingerprint({"weights": weights})
    report = sleep(work_dir)
    keeps = {p["tag"]: p["keep"] for p in report["spill"]["pools"]}
    assert keeps == {"weights": True, "kv_cache": False, "scratch": False}
    assert report["spill"]["dropped_bytes"] == 20 * MIB + SMALL_BUFFER
    wake()
    assert_same({"weights": weights}, before)
    for tensor in (cache, scratch):
        _, size, address, _ = cumem.holder(tensor).handle
        assert cumem.allocator.reservations.read(address, size) == bytes(size), "zero, not poison"


def test_memory_of_tags_nobody_declared_is_kept(cumem: Cumem, work_dir: Path) -> None:
    with hibernate.pool("kv_cache", keep=False):
        _cache = torch.ones(100)
    with cumem.allocator.use_memory_pool("runtime"):  # the allocator used directly, not hibernate.pool
        runtime = torch.arange(7777, dtype=torch.int32)
    before = fingerprint({"runtime": runtime})
    assert {span.tag for span in cumem.provider.spans()} == {"kv_cache"}  # only declared tags are left
    report = sleep(work_dir)
    assert {p["tag"]: p["keep"] for p in report["spill"]["pools"]} == {"kv_cache": False, "runtime": True}
    assert cumem.mapped()["runtime"] == {False}
    wake()
    assert_same({"runtime": runtime}, before)


def test_allocating_in_a_pool_while_it_sleeps_is_refused(cumem: Cumem, work_dir: Path) -> None:
    with hibernate.pool():
        weights = torch.randn(1000)
    before = fingerprint({"weights": weights})
    count = len(cumem.allocator.pointer_to_data)
    sleep(work_dir)
    # The provider refuses an asleep tag (hibernate.pool() itself waits in the guard for the wake).
    with pytest.raises(WrongStateError, match="is asleep"), cumem.provider.region("weights"):
        torch.ones(4)
    with pytest.raises(WrongStateError, match="is asleep"), cumem.provider.graph_pool("weights"):
        pass
    assert len(cumem.allocator.pointer_to_data) == count
    wake()
    assert_same({"weights": weights}, before)


def test_a_graph_captured_into_vllms_graph_pool_replays_bit_exact_after_a_wake(
    cumem: Cumem, work_dir: Path
) -> None:
    with hibernate.pool():
        linear = torch.nn.Linear(64, 33)
        inputs = torch.randn(3, 64)
    with cuda_graphs.patched_torch_cuda(), torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with hibernate.cuda_graph(graph, tag="graphs"):
            out = torch.tanh(linear(inputs))
        graph.replay()
        expected = bits(out)
    assert graph.pool() == cumem.allocator.allocator_and_pools["cudagraph"][0].id
    assert cumem.holder(out).tag == "graphs"  # vLLM's pool, recorded under the tag asked for
    assert cumem.allocator.current_tag == "default"
    report = sleep(work_dir)
    assert ("graphs", True) in {(p["tag"], p["keep"]) for p in report["spill"]["pools"]}
    with pytest.raises(StandInFault, match="not mapped"):
        graph.replay()
    wake()
    out.zero_()
    graph.replay()
    assert torch.equal(bits(out), expected)
