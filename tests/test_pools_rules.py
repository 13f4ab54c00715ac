"""The rules around address-preserving pools: which provider, which graphs, what would move, what fits.

Pure functions, and the tensor pool's refusal run in this process over CPU
tensors whose allocator segments the test names (``segments=``), as torch's
snapshot would list them on a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from hibernate.agent.controller import AgentState
from hibernate.errors import AddressesWouldMoveError, ExitCode, UnsupportedError, UsageError
from hibernate.pools.graphs import graph_descriptions, graph_pools, is_graph_pool, moves_refusal
from hibernate.pools.provided import (
    PROVIDER_ENV,
    ROOM_HEADROOM_BYTES,
    TORCH_MEMORY_SAVER,
    VLLM_CUMEM,
    Span,
    choose,
    shortfalls,
)
from hibernate.pools.tensors import TensorPool
from tests.pooled import agent_with

MIB = 1 << 20


def segment(pool: tuple[int, int], address: int = 0x7000_0000, size: int = 2 * MIB) -> dict[str, Any]:
    return {"device": 0, "address": address, "total_size": size, "segment_pool_id": pool}


# -- which pools are graphs' ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("pool", "graph"),
    [((0, 0), False), ((0, 3), False), ((1, 0), True), ((7, 0), True)],
)
def test_only_pools_a_graph_made_for_itself_count_as_graphs(pool: tuple[int, int], graph: bool) -> None:
    assert is_graph_pool(pool) is graph


def test_graph_pools_are_listed_once_in_order_and_unnamed_pools_are_unknown() -> None:
    segments = [segment((0, 0)), segment((2, 0)), segment((0, 1)), segment((2, 0)), segment((5, 0))]
    segments.append({"device": 0, "address": 1, "total_size": 1})  # a torch that names no pool
    assert graph_pools(segments) == [(2, 0), (5, 0)]


def test_nothing_is_refused_without_both_graphs_and_moves() -> None:
    assert moves_refusal([], ["a CUDA graph captured at train.py:3"]) is None
    assert moves_refusal([("weights/w", 10)], []) is None


def test_a_refusal_names_the_graphs_and_the_largest_storages_that_would_move() -> None:
    moving = [(f"weights/layer{i}", (i + 1) * MIB) for i in range(8)]
    reason = moves_refusal(moving, ["a CUDA graph captured at train.py:3", "another at train.py:9"])
    assert reason is not None
    assert "captured at train.py:3; another at train.py:9" in reason and "8 tracked storage(s)" in reason
    assert "weights/layer7" in reason and "weights/layer0" not in reason and "and 3 more" in reason


def test_graphs_seen_at_their_capture_come_first_then_graph_pools_none_of_them_owns() -> None:
    live = [("a graph captured at a.py:1", (3, 0)), ("a graph captured at b.py:2", None)]
    described = graph_descriptions(live, [(3, 0), (5, 0)])
    assert described[:2] == ["a graph captured at a.py:1", "a graph captured at b.py:2"]
    assert len(described) == 3 and "private pool (5, 0)" in described[2]
    assert "captured before hibernate watched captures" in described[2]
    assert graph_descriptions([], []) == []


# -- which provider --------------------------------------------------------------------------


def test_auto_takes_torch_memory_saver_first_then_vllm() -> None:
    assert choose(None, {TORCH_MEMORY_SAVER: None, VLLM_CUMEM: None}) == TORCH_MEMORY_SAVER
    assert choose("auto", {TORCH_MEMORY_SAVER: "not installed", VLLM_CUMEM: None}) == VLLM_CUMEM


def test_a_provider_asked_for_by_name_is_used_or_refused_with_its_reason() -> None:
    assert choose(VLLM_CUMEM, {TORCH_MEMORY_SAVER: None, VLLM_CUMEM: None}) == VLLM_CUMEM
    with pytest.raises(UnsupportedError) as caught:
        choose(VLLM_CUMEM, {TORCH_MEMORY_SAVER: None, VLLM_CUMEM: "vLLM is not installed"})
    assert "vLLM is not installed" in caught.value.message and TORCH_MEMORY_SAVER not in caught.value.message


def test_none_usable_names_every_package_and_what_it_needs() -> None:
    with pytest.raises(UnsupportedError) as caught:
        choose(None, {TORCH_MEMORY_SAVER: "not installed", VLLM_CUMEM: "CPU-only torch"})
    error = caught.value
    assert error.exit_code == ExitCode.UNSUPPORTED
    assert "torch_memory_saver: not installed" in error.message and "vllm: CPU-only torch" in error.message
    assert error.hint is not None and "hibernate[pools]" in error.hint and "vLLM" in error.hint


def test_an_unknown_provider_name_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=PROVIDER_ENV):
        choose("tms", {TORCH_MEMORY_SAVER: None, VLLM_CUMEM: None})


def test_hibernate_pool_on_a_cpu_only_torch_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, fresh_agent: None
) -> None:
    import hibernate
    from hibernate.pools import provided

    monkeypatch.setattr(provided, "_provider", None)
    with pytest.raises(UnsupportedError) as caught, hibernate.pool():
        pass
    assert "not a CUDA build" in caught.value.message or "not installed" in caught.value.message
    assert provided.installed() is None


# -- what fits -------------------------------------------------------------------------------


def test_a_device_short_of_its_bytes_plus_headroom_is_a_shortfall() -> None:
    free = {0: 10 * MIB + ROOM_HEADROOM_BYTES, 1: 10 * MIB + ROOM_HEADROOM_BYTES - 1}
    assert shortfalls({0: 10 * MIB, 1: 10 * MIB}, free.get) == [(1, 10 * MIB + ROOM_HEADROOM_BYTES, free[1])]


def test_a_device_whose_free_memory_cannot_be_read_is_not_a_shortfall() -> None:
    assert shortfalls({0: 10 * MIB}, lambda device: None) == []


# -- the tensor pool: what moves, and what its pool keeps in place ------------------------------


def on_device(
    cudart_path: Path,
    tensors: list[torch.Tensor],
    segments: list[dict[str, Any]],
    covered: Sequence[Span] = (),
) -> TensorPool:
    """A tensor pool whose ``tensors`` are device storages on cuda:1 (copied through the stand-in
    CUDA runtime) and whose allocator lists ``segments``."""
    from hibernate.pools.device import CudaCopies, CudaRuntime
    from tests.standins.vllm_cumem import FakeCudaRT

    cudart = FakeCudaRT(cudart_path)
    ids = {t.untyped_storage()._cdata for t in tensors}
    return TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
        device_of=lambda storage: 1 if storage._cdata in ids else None,
        segments=lambda: segments,
        covered=lambda: list(covered),
        graphs=lambda: [],  # the graph pools in ``segments`` only: none seen at a capture
    )


def test_a_sleep_beside_a_graph_pool_is_refused_before_anything_changes(
    cudart_path: Path, work_dir: Path
) -> None:
    weights = torch.arange(4096, dtype=torch.float32)
    before = weights.clone()
    address = weights.data_ptr()
    pool = on_device(cudart_path, [weights], [segment((0, 0)), segment((1, 0))])
    pool.track(weights, "weights", True, "w")
    agent = agent_with(pool, "pool-rules")
    with pytest.raises(AddressesWouldMoveError) as caught:
        agent.sleep_here(work_dir, 5.0, {})
    assert caught.value.exit_code == ExitCode.ADDRESSES_WOULD_MOVE == 15
    assert "weights/w" in caught.value.message
    assert caught.value.hint is not None and "hibernate.pool()" in caught.value.hint
    assert agent.state is AgentState.RUNNING
    assert weights.data_ptr() == address and torch.equal(weights, before)
    assert list(work_dir.iterdir()) == []  # refused before the snapshot's directory was made


def test_allow_moves_sleeps_and_says_so(cudart_path: Path, work_dir: Path) -> None:
    weights = torch.arange(4096, dtype=torch.float32)
    before = weights.clone()
    pool = on_device(cudart_path, [weights], [segment((1, 0))])
    pool.track(weights, "weights", True, "w")
    agent = agent_with(pool, "pool-rules")
    report = agent.sleep_here(work_dir, 5.0, {"allow_moves": True})
    assert any("allowed: --allow-moves" in w for w in report["spill"]["warnings"])
    agent.wake_here({})
    assert torch.equal(weights, before)


def test_without_graphs_nothing_is_refused(cudart_path: Path, work_dir: Path) -> None:
    weights = torch.arange(4096, dtype=torch.float32)
    pool = on_device(cudart_path, [weights], [segment((0, 0)), segment((0, 4))])
    pool.track(weights, "weights", True, "w")
    agent = agent_with(pool, "pool-rules")
    agent.sleep_here(work_dir, 5.0, {})
    agent.wake_here({})


def test_host_memory_moving_beside_graphs_is_not_refused(work_dir: Path) -> None:
    """A graph reads device memory: tracked CPU tensors (an offloaded optimizer state) may move."""
    state = torch.arange(4096, dtype=torch.float32)
    pool = TensorPool(segments=lambda: [segment((1, 0))])
    pool.track(state, "optimizer", True, "adam")
    agent = agent_with(pool, "pool-rules")
    agent.sleep_here(work_dir, 5.0, {})
    agent.wake_here({})
    assert torch.equal(state, torch.arange(4096, dtype=torch.float32))


def test_storages_in_a_pool_are_left_to_it_even_when_tracked(cudart_path: Path) -> None:
    pooled = torch.arange(4096, dtype=torch.float32)
    moving = torch.ones(1024)
    span = Span("weights", 1, pooled.untyped_storage().data_ptr(), pooled.untyped_storage().nbytes())
    both = {"pooled": pooled, "moving": moving}
    pool = on_device(cudart_path, [pooled, moving], [segment((1, 0))], [span])
    pool.track(both, "weights", True, "m")
    assert [region.key for region in pool.regions()] == ["weights/m.moving"]
    assert pool.moves_refusal() is not None  # the one outside the pool still moves
    only_pooled = on_device(cudart_path, [pooled], [segment((1, 0))], [span])
    only_pooled.track(pooled, "weights", True, "p")
    assert list(only_pooled.regions()) == [] and only_pooled.moves_refusal() is None


# -- a wake that the GPUs have no room for ------------------------------------------------------


def test_a_wake_without_room_on_a_gpu_refuses_before_mapping_anything_and_stays_asleep(
    cudart_path: Path, work_dir: Path
) -> None:
    weights = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB, a "device" storage on cuda:1
    before = weights.clone()
    pool = on_device(cudart_path, [weights], [])
    pool.track(weights, "weights", True, "w")
    agent = agent_with(pool, "pool-rules")
    free = {1: MIB + ROOM_HEADROOM_BYTES - 1}
    agent.free_device_memory = free.get
    agent.sleep_here(work_dir, 5.0, {})
    with pytest.raises(UnsupportedError) as caught:
        agent.wake_here({})
    assert "cuda:1 needs" in caught.value.message and "stays asleep" in caught.value.message
    assert agent.state is AgentState.ASLEEP
    assert weights.untyped_storage().nbytes() == 0  # nothing was mapped back
    free[1] += 1
    agent.wake_here({})
    assert agent.state is AgentState.RUNNING and torch.equal(weights, before)


def test_serve_sleeps_its_backends_with_allow_moves_from_its_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from hibernate.serve.control import BackendControl

    control = BackendControl(tmp_path, sleep_timeout=5.0)
    monkeypatch.delenv("HIBERNATE_ALLOW_MOVES", raising=False)
    assert control.options().io.to_args()["allow_moves"] is False
    monkeypatch.setenv("HIBERNATE_ALLOW_MOVES", "1")
    assert control.options().io.to_args()["allow_moves"] is True
