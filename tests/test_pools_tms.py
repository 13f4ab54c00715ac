"""hibernate.pool() and hibernate.cuda_graph() over torch_memory_saver, in this process.

The provider is hibernate's own TmsProvider over the torch_memory_saver
stand-in (tests/standins/tms.py): its allocations sit at fixed host
addresses, a pause unmaps them and gives their memory back to the device's
budget, a resume maps them back at the same addresses with poison in them,
and every path where the real library calls ``exit(1)`` raises StandInExit
instead (a test that met one fails). Graphs are the torch.cuda graph
stand-in (tests/standins/cuda_graphs.py): a capture records, a replay runs
on the raw addresses captured.
"""

from __future__ import annotations

import ctypes
import inspect
import mmap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch

import hibernate
from hibernate import faults
from hibernate.agent.controller import Agent, AgentState
from hibernate.agent.local import local_agent
from hibernate.errors import (
    AddressesWouldMoveError,
    ExitCode,
    UnsupportedError,
    UsageError,
    WrongStateError,
)
from hibernate.pools import capture, provided
from hibernate.pools.provided import PROVIDER_ENV, ROOM_HEADROOM_BYTES, TORCH_MEMORY_SAVER, resume_margin
from hibernate.pools.tensors import TensorPool
from hibernate.pools.tms import CAPTURE_SUFFIX, TAG_PREFIX, TmsPool, TmsProvider
from tests.pooled import agent_with, assert_same, bits, fingerprint
from tests.standins import cuda_graphs, tms
from tests.standins.cuda_graphs import readable
from tests.standins.vllm_memory import PAGE, HostDeviceMemory, StandInFault, libc

MIB = 1 << 20
SMALL_CHUNKS = {"buffer_mb": 2, "chunk_mb": 1}  # a 12 MiB allocation spans many chunks
BUDGET = 1 << 30  # the stand-in device's free memory at the start of each test


@dataclass
class Setup:
    module: ModuleType
    world: tms.StandInTms
    provider: TmsProvider

    @property
    def saver(self) -> Any:
        return self.module.torch_memory_saver

    @property
    def agent(self) -> Agent:
        return local_agent()

    def allocations(self, *tags: str) -> list[tms.Allocation]:
        """The stand-in's allocations of hibernate's ``tags`` (``hibernate:<tag>`` in torch_memory_saver)."""
        return [a for a in self.world.allocations() if untagged(a.tag) in tags]

    def mapped(self, *tags: str) -> list[bool]:
        return [self.world.is_mapped(a.address) for a in self.allocations(*tags)]


@pytest.fixture
def standin(fresh_agent: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[Setup]:
    """The torch_memory_saver stand-in installed as this process's pool provider, with a 1 GiB device."""
    module = tms.install(fatal_raises=True)
    world = module.standin
    world.set_free_bytes(0, BUDGET)
    provider = TmsProvider(
        saver=module,
        segments=world.memory_snapshot,
        copies=lambda: HostDeviceMemory(world.reservations),
        free_bytes=world.free_bytes,
        device=lambda: world.current_device,
    )
    monkeypatch.setattr(provided, "_provider", None)
    provided.install(provider)
    local_agent().free_device_memory = world.free_bytes
    try:
        yield Setup(module, world, provider)
    finally:
        tms.uninstall()


def untagged(tms_tag: str) -> str:
    """hibernate's tag of a torch_memory_saver tag (a capture's own tag is its tag's)."""
    return tms_tag.removeprefix(TAG_PREFIX).partition(CAPTURE_SUFFIX)[0]


def sleep(work_dir: Path, **args: Any) -> dict[str, Any]:
    return local_agent().sleep_here(work_dir, 5.0, {**SMALL_CHUNKS, **args})


def wake() -> dict[str, Any]:
    return local_agent().wake_here({"buffer_mb": 2})


@dataclass
class Pooled:
    """A small model and state in two kept tags, at sizes that are not multiples of anything."""

    model: torch.nn.Sequential
    big: torch.Tensor
    state: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {f"model.{n}": p for n, p in self.model.named_parameters()}
        return {**named, "big": self.big, "state": self.state}


def pooled() -> Pooled:
    torch.manual_seed(0)
    with hibernate.pool():  # "weights"
        model = torch.nn.Sequential(torch.nn.Linear(300, 257), torch.nn.ReLU(), torch.nn.Linear(257, 129))
        big = torch.randn((11 * MIB + 12345) // 4)  # a 12 MiB allocation of its own
    with hibernate.pool("state"):
        state = torch.arange(3 * MIB // 8 + 7, dtype=torch.float64)  # a 20 MiB allocation
    return Pooled(model, big, state)


# -- sleep and wake -----------------------------------------------------------------------------


def test_pooled_memory_comes_back_at_the_same_addresses_bit_exact(standin: Setup, work_dir: Path) -> None:
    made = pooled()
    tensors = made.tensors()
    before = fingerprint(tensors)
    inputs = torch.randn(4, 300)
    with torch.no_grad():
        expected = made.model(inputs)
    sizes = {untagged(a.tag): 0 for a in standin.allocations("weights", "state")}
    for allocation in standin.allocations("weights", "state"):
        sizes[untagged(allocation.tag)] += allocation.allocation_size
    assert sizes == {"weights": 2 * MIB + 12 * MIB, "state": 20 * MIB}

    report = sleep(work_dir)
    pools = {(p["pool"], p["tag"]): (p["count"], p["bytes"]) for p in report["spill"]["pools"]}
    assert pools == {
        (TORCH_MEMORY_SAVER, "weights"): (2, sizes["weights"]),
        (TORCH_MEMORY_SAVER, "state"): (1, sizes["state"]),
    }
    assert report["spill"]["total_bytes"] == sum(sizes.values())
    assert standin.world.pauses == 2 and hibernate.state() == "asleep"

    wake()
    assert hibernate.state() == "running" and standin.world.resumes == 2
    assert_same(tensors, before)
    with torch.no_grad():
        assert torch.equal(made.model(inputs), expected)


def test_the_public_sleep_and_wake_bring_pooled_memory_back(standin: Setup, work_dir: Path) -> None:
    made = pooled()
    before = fingerprint(made.tensors())
    hibernate.sleep(work_dir)
    assert hibernate.state() == "asleep"
    hibernate.wake()
    assert_same(made.tensors(), before)


def test_a_dropped_tag_comes_back_zero_filled(standin: Setup, work_dir: Path) -> None:
    made = pooled()
    before = fingerprint(made.tensors())
    with hibernate.pool("kv_cache", keep=False):
        cache = torch.full((MIB // 4 + 99,), 7.0)  # 1 MiB + 396 bytes: a 20 MiB allocation
    address = cache.data_ptr()
    [allocation] = standin.allocations("kv_cache")

    report = sleep(work_dir)
    assert report["spill"]["dropped_bytes"] == allocation.allocation_size
    assert report["spill"]["total_bytes"] == 34 * MIB  # the dropped tag is not written
    wake()
    assert cache.data_ptr() == address
    whole = standin.world.reservations.read(allocation.address, allocation.allocation_size)
    assert whole == bytes(allocation.allocation_size), (
        "the whole allocation is zero, not the poison it came back with"
    )
    assert_same(made.tensors(), before)


def test_asleep_the_pools_are_unmapped_and_their_memory_given_back(standin: Setup, work_dir: Path) -> None:
    made = pooled()
    world = standin.world
    held = sum(a.allocation_size for a in standin.allocations("weights", "state"))
    free_awake = world.free_bytes(0)
    assert free_awake == BUDGET - held and world.used_bytes(0) == held

    sleep(work_dir)
    assert standin.mapped("weights", "state") == [False, False, False]
    assert world.free_bytes(0) == free_awake + held and world.used_bytes(0) == 0
    with pytest.raises(StandInFault, match="not mapped"):
        world.reservations.read(made.big.data_ptr(), 4)

    wake()
    assert standin.mapped("weights", "state") == [True, True, True]
    assert world.free_bytes(0) == free_awake


# -- a wake the device has no room for --------------------------------------------------------


def test_the_agent_refuses_a_wake_without_room_before_mapping_anything(
    standin: Setup, work_dir: Path
) -> None:
    made = pooled()
    before = fingerprint(made.tensors())
    held = sum(a.allocation_size for a in standin.allocations("weights", "state"))
    sleep(work_dir)
    standin.world.set_free_bytes(0, held + ROOM_HEADROOM_BYTES - 1)
    with pytest.raises(UnsupportedError) as caught:
        wake()
    assert "this process's memory" in caught.value.message and "cuda:0 needs" in caught.value.message
    assert hibernate.state() == "asleep" and standin.world.resumes == 0
    assert standin.mapped("weights", "state") == [False, False, False]

    standin.world.set_free_bytes(0, held + resume_margin(3))  # each tag's own check, right before it
    wake()
    assert_same(made.tensors(), before)


def free_that_drops(world: tms.StandInTms, to: int) -> Callable[[int], int | None]:
    """The agent reads the free memory as it is; right after, another process takes most of it."""

    def read(device: int) -> int | None:
        free = world.free_bytes(device)
        world.set_free_bytes(device, to)
        return free

    return read


@pytest.mark.parametrize("agent_sees", ["nothing", "memory that drops after"])
def test_the_pool_refuses_a_tag_without_room_and_puts_back_the_tags_it_mapped(
    standin: Setup, work_dir: Path, agent_sees: str
) -> None:
    made = pooled()
    before = fingerprint(made.tensors())
    world = standin.world
    sleep(work_dir)
    # weights (14 MiB) fit with the headroom; state (20 MiB) then does not
    room = ROOM_HEADROOM_BYTES + 14 * MIB + 19 * MIB
    if agent_sees == "nothing":
        standin.agent.free_device_memory = lambda device: None
        world.set_free_bytes(0, room)
    else:
        standin.agent.free_device_memory = free_that_drops(world, room)
    with pytest.raises(UnsupportedError) as caught:
        wake()
    assert "hibernate.pool('state')" in caught.value.message and "stays asleep" in caught.value.message
    assert hibernate.state() == "asleep"
    assert world.resumes == 1 and world.pauses == 3, "weights was mapped, then paused again"
    assert standin.mapped("weights", "state") == [False, False, False]

    standin.agent.free_device_memory = world.free_bytes
    world.set_free_bytes(0, BUDGET)
    wake()
    assert_same(made.tensors(), before)


def test_each_allocation_a_tag_maps_back_needs_its_margin_beyond_the_headroom(
    standin: Setup, work_dir: Path
) -> None:
    """Exactly the bytes plus the flat headroom is not enough: each allocation mapped costs the
    driver something, and the margin against another process's growth scales with them."""
    made = pooled()
    before = fingerprint(made.tensors())
    held = sum(a.allocation_size for a in standin.allocations("weights", "state"))
    sleep(work_dir)
    standin.agent.free_device_memory = lambda device: None  # only the pool's own checks
    standin.world.set_free_bytes(0, held + ROOM_HEADROOM_BYTES)
    with pytest.raises(UnsupportedError) as caught:
        wake()
    assert "stays asleep" in caught.value.message and hibernate.state() == "asleep"
    assert standin.mapped("weights", "state") == [False, False, False]
    standin.world.set_free_bytes(0, held + resume_margin(3))
    wake()
    assert_same(made.tensors(), before)


# -- memory allocated in a tag while it sleeps --------------------------------------------------


def test_allocating_in_a_pool_while_it_sleeps_is_refused(standin: Setup, work_dir: Path) -> None:
    """The provider refuses an asleep tag; hibernate.pool() does not get there: it waits for the wake."""
    made = pooled()
    before = fingerprint(made.tensors())
    count = len(standin.world.allocations())
    sleep(work_dir)
    with pytest.raises(WrongStateError, match="is asleep"), standin.provider.region("weights"):
        torch.ones(4)
    with pytest.raises(WrongStateError, match="is asleep"), standin.provider.graph_pool("state"):
        pass
    assert len(standin.world.allocations()) == count
    wake()
    assert_same(made.tensors(), before)


def test_a_pool_opened_while_asleep_waits_for_the_wake(standin: Setup, work_dir: Path) -> None:
    made = pooled()
    before = fingerprint(made.tensors())
    sleep(work_dir)
    seen: list[bool] = []  # whether the pool was asleep when the block got in

    def allocate() -> None:
        with hibernate.pool():
            seen.append(standin.provider.pool().asleep("weights"))
            torch.ones(4)

    thread = threading.Thread(target=allocate)
    thread.start()
    guard = standin.agent.guard
    while guard.waiting == 0 and thread.is_alive():
        threading.Event().wait(0.01)  # until the thread is blocked in the guard (a state, not a time)
    assert guard.waiting == 1 and seen == []
    wake()
    thread.join(30)
    assert seen == [False]
    assert_same(made.tensors(), before)


def test_memory_allocated_behind_hibernates_back_keeps_the_process_asleep_not_ended(
    standin: Setup, work_dir: Path
) -> None:
    made = pooled()
    sleep(work_dir)
    with standin.saver.region(TAG_PREFIX + "weights"):  # its own region, in hibernate's tag, unseen
        sneaked = torch.empty(3 * MIB, dtype=torch.uint8)  # a new 20 MiB allocation, mapped
    [new] = [a for a in standin.allocations("weights") if a.state is tms.AllocationState.ACTIVE]
    assert sneaked.data_ptr() == new.address
    with pytest.raises(WrongStateError) as caught:  # torch_memory_saver would exit(1): StandInExit
        wake()
    assert "while it slept" in caught.value.message and hex(new.address) in caught.value.message
    assert hibernate.state() == "asleep" and standin.world.resumes == 0
    assert [a.state for a in standin.allocations("state")] == [tms.AllocationState.PAUSED]
    assert not standin.world.is_mapped(made.big.data_ptr())  # the first block of its allocation


# -- faults in the pool's own steps -------------------------------------------------------------


def test_a_failed_pause_leaves_the_process_running_with_everything_in_place(
    standin: Setup, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = pooled()
    before = fingerprint(made.tensors())
    monkeypatch.setenv(faults.ENV, "pool.pause")
    with pytest.raises(faults.InjectedFault):
        sleep(work_dir)
    assert hibernate.state() == "running" and standin.world.pauses == 0
    assert standin.mapped("weights", "state") == [True, True, True]
    assert_same(made.tensors(), before)


def test_a_failed_pause_leaves_dropped_memory_it_never_released_as_it_was(
    standin: Setup, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pooled()
    with hibernate.pool("kv_cache", keep=False):
        cache = torch.full((1000,), 7.0)
    scratch = torch.full((1000,), 3.0)
    hibernate.track(scratch, tag="scratch", keep=False)
    monkeypatch.setenv(faults.ENV, "pool.pause")
    with pytest.raises(faults.InjectedFault):
        sleep(work_dir)
    assert hibernate.state() == "running" and standin.world.pauses == 0
    assert torch.equal(cache, torch.full((1000,), 7.0)), "never paused, yet zero-filled"
    assert torch.equal(scratch, torch.full((1000,), 3.0)), "never released, yet zero-filled"


def test_a_failed_second_pause_puts_the_first_tag_back(
    standin: Setup, work_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = pooled()
    before = fingerprint(made.tensors())
    monkeypatch.setattr(faults, "_reached", {})
    monkeypatch.setenv(faults.ENV, "pool.pause#2")
    with pytest.raises(faults.InjectedFault):
        sleep(work_dir)
    assert hibernate.state() == "running"
    assert (standin.world.pauses, standin.world.resumes) == (1, 1)
    assert standin.mapped("weights", "state") == [True, True, True]
    assert_same(made.tensors(), before)


@pytest.mark.parametrize("fault", ["pool.resume", "pool.resume#2"])
def test_a_failed_resume_leaves_the_process_asleep_and_a_second_wake_brings_it_back(
    standin: Setup, work_dir: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    made = pooled()
    before = fingerprint(made.tensors())
    sleep(work_dir)
    monkeypatch.setattr(faults, "_reached", {})
    monkeypatch.setenv(faults.ENV, fault)
    with pytest.raises(faults.InjectedFault):
        wake()
    assert hibernate.state() == "asleep"
    assert standin.mapped("weights", "state") == [False, False, False]
    assert standin.world.resumes == (1 if fault.endswith("#2") else 0)
    monkeypatch.delenv(faults.ENV)
    wake()
    assert_same(made.tensors(), before)


# -- pooled and tracked memory together ---------------------------------------------------------


def test_pooled_and_tracked_tensors_sleep_together_and_a_pooled_one_only_once(
    standin: Setup, work_dir: Path
) -> None:
    made = pooled()
    plain = {"a": torch.randn(1000), "b": torch.arange(12345, dtype=torch.int16)}
    hibernate.track(plain, name="plain")
    hibernate.track(made.model)  # already pooled: left to its pool
    before = fingerprint({**made.tensors(), **plain})
    sizes = sum(a.allocation_size for a in standin.allocations("weights", "state"))

    report = sleep(work_dir)
    counts = {(p["pool"], p["tag"]): (p["count"], p["bytes"]) for p in report["spill"]["pools"]}
    plain_bytes = sum(t.nbytes for t in plain.values())
    assert counts[("torch", "weights")] == (2, plain_bytes), "the tracked model is not in the torch pool"
    assert counts[(TORCH_MEMORY_SAVER, "weights")][0] == 2
    assert report["spill"]["total_bytes"] == sizes + plain_bytes
    assert all(t.untyped_storage().nbytes() == 0 for t in plain.values())
    first = made.model[0]
    assert isinstance(first, torch.nn.Linear)
    assert first.weight.untyped_storage().nbytes() > 0, "a pooled storage is never resized"

    wake()
    assert_same(made.tensors(), {k: v for k, v in before.items() if k not in plain})
    for name, tensor in plain.items():
        assert torch.equal(bits(tensor), before[name][1])


def test_tracking_only_pooled_tensors_adds_nothing_to_the_sleep(standin: Setup, work_dir: Path) -> None:
    made = pooled()
    hibernate.track(made.model)
    hibernate.track(made.state, tag="state")
    before = fingerprint(made.tensors())
    report = sleep(work_dir)
    assert {p["pool"] for p in report["spill"]["pools"]} == {TORCH_MEMORY_SAVER}
    wake()
    assert_same(made.tensors(), before)


# -- CUDA graphs --------------------------------------------------------------------------------


def test_a_graph_captured_over_pooled_weights_replays_bit_exact_after_a_wake(
    standin: Setup, work_dir: Path
) -> None:
    made = pooled()
    with hibernate.pool("inputs"):
        inputs = torch.randn(4, 300)  # a static input keeps its address too
    with cuda_graphs.patched_torch_cuda(), torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        with hibernate.cuda_graph(graph):
            out = made.model(inputs) * 2
        graph.replay()
        expected = bits(out)
    [graph_memory] = standin.allocations("cudagraph")
    assert graph.pool() in {pool.id for pool in standin.world.pools()}
    assert graph_memory.address <= out.data_ptr() < graph_memory.address + graph_memory.allocation_size

    report = sleep(work_dir)
    assert ("cudagraph", True) in {(p["tag"], p["keep"]) for p in report["spill"]["pools"]}
    with pytest.raises(StandInFault, match="paused"):
        graph.replay()
    wake()
    assert torch.equal(bits(out), expected), "the graph's static output is kept"
    out.zero_()
    graph.replay()
    assert torch.equal(bits(out), expected)
    with torch.no_grad():
        inputs.mul_(-1)
        graph.replay()
        assert torch.equal(out, made.model(inputs) * 2)


def test_memory_a_graph_writes_is_never_handed_to_a_later_pool_allocation_of_its_tag(
    standin: Setup, work_dir: Path
) -> None:
    """An intermediate the capture freed is back in the capture's pool, and every replay writes it:
    a pool of the capture's own keeps it from ``hibernate.pool(tag)``'s next tensors."""
    made = pooled()
    with hibernate.pool("scratch"):
        inputs = torch.randn(4, 300)
    with cuda_graphs.patched_torch_cuda(), torch.no_grad():
        graph = torch.cuda.CUDAGraph()
        assert isinstance(graph, cuda_graphs.CUDAGraph)  # torch.cuda's, patched: the stand-in
        with hibernate.cuda_graph(graph, tag="scratch"):
            out = made.model(inputs) * 2  # the linear layer's result is freed inside the capture
        graph.replay()
        expected = bits(out)
        with hibernate.pool("scratch"):
            later = [torch.full((4, 300), 7.0) for _ in range(4)]  # the freed block's size and more
        written = [(w.address, w.address + w.nbytes) for w in graph.writes]
        for tensor in later:
            start = tensor.data_ptr()
            assert not any(a < start + tensor.nbytes and start < b for a, b in written), "shares graph memory"
        graph.replay()
    assert all(torch.equal(tensor, torch.full((4, 300), 7.0)) for tensor in later)
    assert torch.equal(bits(out), expected)
    assert {untagged(a.tag) for a in standin.world.allocations()} >= {"scratch"}
    assert len({a.tag for a in standin.world.allocations() if untagged(a.tag) == "scratch"}) == 2

    sleep(work_dir)  # the capture's own pool sleeps and wakes with its tag
    assert standin.mapped("scratch") == [False] * len(standin.allocations("scratch"))
    wake()
    with cuda_graphs.patched_torch_cuda():
        graph.replay()
    assert torch.equal(bits(out), expected)
    assert all(torch.equal(tensor, torch.full((4, 300), 7.0)) for tensor in later)


def test_cuda_graph_chooses_the_pool_itself(standin: Setup) -> None:
    with pytest.raises(UsageError, match="do not pass pool"), hibernate.cuda_graph(object(), pool=(0, 1)):
        pass


def mappings() -> list[tuple[int, int]]:
    """This process's mappings, as (start, end) from /proc/self/maps."""
    with open("/proc/self/maps") as maps:
        spans = [line.split()[0].split("-") for line in maps]
    return [(int(start, 16), int(end, 16)) for start, end in spans]


def mapping_at(address: int) -> tuple[int, int]:
    """The mapping that holds ``address``."""
    return next(span for span in mappings() if span[0] <= address < span[1])


def block(address: int, nbytes: int, fill: int) -> tuple[int, int] | None:
    """Map host memory at ``[address, address + nbytes)`` (pages around it) if nothing is mapped there."""
    start = address - address % PAGE
    length = -(-(address + nbytes - start) // PAGE) * PAGE
    fixed_noreplace = 0x100000  # MAP_FIXED_NOREPLACE: fails where anything is mapped
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | fixed_noreplace
    got = libc.mmap(start, length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if got != start:
        return None
    ctypes.memset(start, fill, length)
    return start, length


def test_a_graph_over_tracked_weights_refuses_the_sleep_and_allowed_it_replays_wrong(
    work_dir: Path, cudart_path: Path
) -> None:
    weights = torch.randn(33 * MIB // 4)  # beyond glibc's mmap threshold: freed, it is unmapped
    inputs = torch.randn(1024)
    watch_standin_captures()
    graph = cuda_graphs.CUDAGraph()
    with cuda_graphs.graph(graph):  # its own pool, (N, 0)
        out = weights[:1024] * inputs
    captured_at = f"{__file__}:{inspect.currentframe().f_lineno - 2}"  # type: ignore[union-attr]
    graph.replay()
    expected = bits(out)
    before = fingerprint({"weights": weights})
    pool = tracked_on_device(weights, cudart_path)
    agent = agent_with(pool, "pool-tms")

    with pytest.raises(AddressesWouldMoveError) as caught:
        agent.sleep_here(work_dir, 5.0, {})
    assert caught.value.exit_code == ExitCode.ADDRESSES_WOULD_MOVE == 15
    assert str(graph.pool()) in caught.value.message and "weights/w" in caught.value.message
    assert f"a CUDA graph captured at {captured_at} (in test_a_graph_over" in caught.value.message
    assert agent.state is AgentState.RUNNING
    assert_same({"weights": weights}, before)

    old = before["weights"][0]
    mapped = mapping_at(old)
    report = agent.sleep_here(work_dir, 5.0, {"allow_moves": True})
    assert any("allowed: --allow-moves" in w for w in report["spill"]["warnings"])
    assert mapped not in mappings(), "the released storage's memory went back to the system"
    # Unless a mapping of another thread of this process took the address since (any new mapping
    # may land in the hole), a GPU faults on it:
    if not readable(old, 4096):
        with pytest.raises(StandInFault, match="not mapped"):
            graph.replay()
    held = block(old, 1024 * 4, 0x3C)  # something else lives there by the wake
    assert held is not None or readable(old, 4096)
    agent.wake_here({})
    assert weights.data_ptr() != old
    assert torch.equal(bits(weights), before["weights"][1]), "eager code reads the tensor: right"
    assert torch.equal(bits(weights[:1024] * inputs), expected)
    graph.replay()
    assert not torch.equal(bits(out), expected), "the graph reads the old address: wrong"
    if held is not None:
        libc.munmap(*held)


def tracked_on_device(weights: torch.Tensor, cudart_path: Path) -> TensorPool:
    """``weights`` tracked as a device storage of cuda:0 (copied through the stand-in CUDA runtime),
    beside the stand-in graphs' pools and every graph seen at its capture."""
    from hibernate.pools.device import CudaCopies, CudaRuntime
    from tests.standins.vllm_cumem import FakeCudaRT

    cudart = FakeCudaRT(cudart_path)
    pool = TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
        device_of=lambda storage: 0 if storage._cdata == weights.untyped_storage()._cdata else None,
        segments=cuda_graphs.memory_snapshot,
        covered=lambda: [],
    )
    pool.track(weights, "weights", True, "w")
    return pool


def watch_standin_captures() -> None:
    """The captures of the stand-in graph classes seen from now on, as ``track``/``pool`` would
    start seeing torch's (whether an earlier test already did is no matter: once per class)."""
    capture.watch(SimpleNamespace(CUDAGraph=cuda_graphs.CUDAGraph, graph=cuda_graphs.graph))


def test_a_graph_that_allocated_nothing_over_tracked_weights_refuses_the_sleep_naming_its_capture(
    work_dir: Path, cudart_path: Path
) -> None:
    """A capture into static buffers (``out=``) makes no memory of its own: torch's allocator shows
    no graph, yet its replay reads the weights where they were."""
    weights = torch.randn(33 * MIB // 4)  # beyond glibc's mmap threshold: freed, it is unmapped
    inputs, static_out = torch.randn(1024), torch.empty(1024)
    watch_standin_captures()
    graph = cuda_graphs.CUDAGraph()
    with cuda_graphs.graph(graph):
        torch.mul(weights[:1024], inputs, out=static_out)
    line = inspect.currentframe().f_lineno - 2  # type: ignore[union-attr]
    graph.replay()
    expected = bits(static_out)
    assert not [s for s in cuda_graphs.memory_snapshot() if s["segment_pool_id"] == graph.pool()]
    pool = tracked_on_device(weights, cudart_path)
    agent = agent_with(pool, "pool-tms")
    [seen] = [g for g in agent.status()["graphs"] if g["captured_at"].startswith(f"{__file__}:{line} ")]
    assert seen["pool"] == list(graph.pool()) and seen["hibernate_pool"] is False

    with pytest.raises(AddressesWouldMoveError) as caught:
        agent.sleep_here(work_dir, 5.0, {})
    assert f"captured at {__file__}:{line}" in caught.value.message and "weights/w" in caught.value.message
    assert agent.state is AgentState.RUNNING and not any(work_dir.iterdir())

    old = weights.data_ptr()
    agent.sleep_here(work_dir, 5.0, {"allow_moves": True})
    held = block(old, 1024 * 4, 0x3C)  # something else lives where the weights were
    assert held is not None or readable(old, 4096)
    agent.wake_here({})
    assert weights.data_ptr() != old
    assert torch.equal(bits(weights[:1024] * inputs), expected), "eager code reads the tensor: right"
    graph.replay()
    assert not torch.equal(bits(static_out), expected), "the graph reads the old address: wrong"
    if held is not None:
        libc.munmap(*held)
    graph.reset()
    assert not [g for g in agent.status()["graphs"] if g["captured_at"].startswith(f"{__file__}:{line} ")]


# -- which provider ----------------------------------------------------------------------------


@pytest.fixture
def installed_module(fresh_agent: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in as the importable torch_memory_saver, no provider chosen yet."""
    monkeypatch.setattr(provided, "_provider", None)
    with tms.installed() as module:
        yield module


def test_the_provider_named_in_the_environment_is_used(
    installed_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build, as far as the choice goes
    monkeypatch.setenv(PROVIDER_ENV, TORCH_MEMORY_SAVER)
    with hibernate.pool("weights"):
        weights = torch.ones(10)
    chosen = provided.installed()
    assert isinstance(chosen, TmsProvider) and isinstance(chosen.pool(), TmsPool)
    found = tms.find_allocation(weights.data_ptr(), weights.nbytes)
    assert found is not None and found[1].tag == "hibernate:weights"
    assert installed_module.torch_memory_saver._impl._hook_mode == "torch"


def test_auto_takes_torch_memory_saver_when_it_can_be_used(
    installed_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv(PROVIDER_ENV, "auto")
    with hibernate.pool("kv", keep=False):
        pass
    assert isinstance(provided.installed(), TmsProvider)


def test_an_unknown_provider_or_a_cpu_only_torch_is_refused_and_nothing_is_chosen(
    installed_module: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setenv(PROVIDER_ENV, "tms")
    with pytest.raises(UsageError, match=PROVIDER_ENV) as caught, hibernate.pool():
        pass
    assert caught.value.hint is not None and TORCH_MEMORY_SAVER in caught.value.hint
    assert provided.installed() is None
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv(PROVIDER_ENV, TORCH_MEMORY_SAVER)
    with pytest.raises(UnsupportedError, match="not a CUDA build"), hibernate.pool():
        pass
    assert provided.installed() is None and installed_module.standin.allocations() == []
