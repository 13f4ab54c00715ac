"""The torch_memory_saver and CUDA-graph stand-ins keep the real contracts hibernate relies on.

torch_memory_saver 0.0.10 (torch hook mode): addresses survive pause/resume,
contents do not; wrong-state pauses/resumes and out-of-memory end the
process; allocations come from torch's caching allocator in a MemPool whose
id is (0, N). A captured graph reads raw addresses, so it sees whatever lies
at the old address when memory moves.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import importlib.util
import os
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.standins import cuda_graphs, tms
from tests.standins.vllm_memory import POISON, StandInFault

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20


@dataclass
class Installed:
    module: types.ModuleType
    saver: tms.TorchMemorySaver
    world: tms.StandInTms

    def pool_id(self, tag: str) -> tuple[int, int]:
        impl = self.saver._impl
        assert impl is not None
        return impl._mem_pools[(tag, False, False, "", 0)].id

    def allocation_of(self, tensor: torch.Tensor) -> tms.Allocation:
        found = tms.find_allocation(tensor.data_ptr(), tensor.nbytes)
        assert found is not None, f"{tensor.data_ptr():#x} is in no allocation"
        return found[1]


@pytest.fixture
def installed() -> Iterator[Installed]:
    # A graph an earlier test of this worker captured may still wait in a reference cycle (an
    # exception pytest.raises kept, with the frames that held it): its pool would show in this
    # test's snapshot of the whole device, so the collector runs first.
    gc.collect()
    with tms.installed(fatal_raises=True) as module:
        saver = module.torch_memory_saver
        saver.hook_mode = "torch"
        yield Installed(module, saver, module.standin)


def in_any_allocation(tensor: torch.Tensor) -> bool:
    return tms.find_allocation(tensor.data_ptr(), max(tensor.nbytes, 1)) is not None


# -- installing and the package's shape -------------------------------------------------------


def test_install_replaces_the_module_and_uninstall_restores_what_was_there() -> None:
    before = sys.modules.get(tms.MODULE_NAME)
    sentinel = types.ModuleType(tms.MODULE_NAME)
    sys.modules[tms.MODULE_NAME] = sentinel
    try:
        module = tms.install(fatal_raises=True)
        assert importlib.import_module(tms.MODULE_NAME) is module
        assert importlib.util.find_spec(tms.MODULE_NAME) is not None
        from torch_memory_saver import TorchMemorySaver, configure_subprocess, torch_memory_saver

        assert isinstance(torch_memory_saver, TorchMemorySaver)
        assert callable(configure_subprocess)
        with pytest.raises(RuntimeError, match="already installed"):
            tms.install()
        tms.uninstall()
        assert sys.modules[tms.MODULE_NAME] is sentinel
        del sys.modules[tms.MODULE_NAME]
        tms.install()
        tms.uninstall()
        assert tms.MODULE_NAME not in sys.modules
    finally:
        if before is None:
            sys.modules.pop(tms.MODULE_NAME, None)
        else:
            sys.modules[tms.MODULE_NAME] = before


def test_the_impl_is_made_on_first_use_and_configuration_closes_then() -> None:
    with tms.installed() as module:
        saver = module.TorchMemorySaver()
        assert saver._impl is None and saver._impl_ctor_kwargs == {}
        with pytest.raises(AttributeError):
            _ = saver.hook_mode
        saver.hook_mode = "torch"
        assert saver._impl_ctor_kwargs == {"hook_mode": "torch"}
        with pytest.raises(NotImplementedError, match="Only setter"):
            _ = saver.memory_margin_bytes
        saver.pause("nothing-yet")
        assert saver._impl is not None and saver._impl._hook_mode == "torch"
        assert not hasattr(saver, "_impl_ctor_kwargs")
        with pytest.raises(AttributeError):
            saver.hook_mode = "torch"
        assert saver.enabled


def test_the_default_preload_mode_needs_the_library_preloaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with tms.installed() as module, pytest.raises(AssertionError, match="invalid LD_PRELOAD"):
        module.torch_memory_saver.pause()


def test_backups_and_the_preload_features_are_refused_as_not_modelled(installed: Installed) -> None:
    backups: list[dict[str, Any]] = [{"enable_cpu_backup": True}, {"enable_disk_backup": True}]
    for kwargs in backups:
        with pytest.raises(NotImplementedError, match="models only what hibernate uses"):  # noqa: SIM117
            with installed.saver.region("weights", **kwargs):
                pass
    with pytest.raises(AssertionError, match="Only hook_mode=preload"):
        installed.saver.cuda_graph(object())
    with pytest.raises(NotImplementedError, match="models only what hibernate uses"):
        installed.module.configure_subprocess()


# -- regions: torch's MemPool and caching allocator in front of the core -----------------------


def test_a_region_puts_new_tensors_in_an_allocation_of_its_tag(installed: Installed) -> None:
    saver, world = installed.saver, installed.world
    with saver.region("weights"):
        linear = torch.nn.Linear(4, 3)
        literal = torch.tensor([1.0, 2.0])
    outside = linear(torch.ones(4))
    assert not in_any_allocation(outside)
    for tensor in (linear.weight, linear.bias, literal):
        allocation = installed.allocation_of(tensor)
        assert (allocation.tag, allocation.device, allocation.state) == (
            "weights",
            0,
            tms.AllocationState.ACTIVE,
        )
    [allocation] = world.allocations()  # small tensors share one 2 MiB segment
    assert allocation.raw_size == tms.SMALL_BUFFER == allocation.allocation_size
    assert world.used_bytes(0) == tms.SMALL_BUFFER
    assert linear.weight.data_ptr() == allocation.address
    assert torch.equal(linear(torch.ones(4)), outside)  # the moved parameters hold their values

    with saver.region("kv"):
        cache = torch.zeros(8)
    weights_pool, kv_pool = installed.pool_id("weights"), installed.pool_id("kv")
    assert weights_pool[0] == 0 and weights_pool[1] >= 1
    assert kv_pool == (0, weights_pool[1] + 1)
    assert installed.allocation_of(cache).tag == "kv"


def test_the_snapshot_shows_segments_and_blocks_and_freed_blocks_are_reused(installed: Installed) -> None:
    saver, world = installed.saver, installed.world
    with saver.region("weights"):
        first = torch.ones(100)  # 400 bytes: one 512-byte block
        second = torch.ones(300)  # 1200 bytes: 1536
    pool = installed.pool_id("weights")
    [segment] = world.memory_snapshot(pool)
    assert set(segment) >= {
        "device",
        "address",
        "total_size",
        "allocated_size",
        "active_size",
        "segment_type",
        "segment_pool_id",
        "blocks",
    }
    assert (segment["device"], segment["segment_pool_id"], segment["segment_type"]) == (0, pool, "small")
    assert segment["total_size"] == tms.SMALL_BUFFER
    assert segment["allocated_size"] == segment["active_size"] == 512 + 1536
    blocks = [(b["address"], b["size"], b["state"]) for b in segment["blocks"]]
    start = segment["address"]
    assert blocks == [
        (start, 512, "active_allocated"),
        (start + 512, 1536, "active_allocated"),
        (start + 2048, tms.SMALL_BUFFER - 2048, "inactive"),
    ]
    assert (first.data_ptr(), second.data_ptr()) == (start, start + 512)

    del first  # the block is free, the segment stays: torch keeps a live pool's segments
    [segment] = world.memory_snapshot(pool)
    assert segment["blocks"][0]["state"] == "inactive"
    assert world.used_bytes(0) == tms.SMALL_BUFFER
    with saver.region("weights"):
        third = torch.ones(10)  # best fit: the freed 512-byte block
    assert third.data_ptr() == start
    assert len(world.allocations()) == 1
    assert world.memory_snapshot() == world.memory_snapshot(pool)


def test_sizes_pick_the_segment_kinds_torch_uses(installed: Installed) -> None:
    with installed.saver.region("weights"):
        big = torch.empty(11 * MIB + 1, dtype=torch.uint8)  # >= 10 MiB: rounded to 2 MiB
        medium = torch.empty(3 * MIB, dtype=torch.uint8)  # 1..10 MiB: a 20 MiB segment
        fitting = torch.empty(2 * MIB, dtype=torch.uint8)  # best fit: the rest of the 20 MiB one
    assert installed.allocation_of(big).raw_size == 12 * MIB  # the 1 MiB left is not split off
    assert installed.allocation_of(medium).raw_size == tms.LARGE_BUFFER
    assert fitting.data_ptr() == medium.data_ptr() + 3 * MIB
    kinds = {s["total_size"]: s["segment_type"] for s in installed.world.memory_snapshot()}
    assert kinds == {tms.LARGE_BUFFER: "large", 12 * MIB: "large"}


def test_a_region_routes_only_the_thread_that_entered_it(installed: Installed) -> None:
    made_elsewhere: list[torch.Tensor] = []
    with installed.saver.region("weights"):
        worker = threading.Thread(target=lambda: made_elsewhere.append(torch.ones(4)))
        worker.start()
        worker.join()
        here = torch.ones(4)
    assert in_any_allocation(here)
    assert not in_any_allocation(made_elsewhere[0])


# -- pause, resume, free: the C++ core -------------------------------------------------------


def test_pause_and_resume_keep_addresses_and_bring_back_garbage(installed: Installed) -> None:
    saver, world = installed.saver, installed.world
    with saver.region("weights"):
        weights = torch.arange(64, dtype=torch.float32)
    with saver.region("kv"):
        cache = torch.full((64,), 3.0)
    address, weights_at = installed.allocation_of(weights).address, weights.data_ptr()

    saver.pause("weights")
    assert not world.is_mapped(address)
    assert world.is_mapped(installed.allocation_of(cache).address)
    assert world.used_bytes(0) == tms.SMALL_BUFFER
    assert installed.allocation_of(weights).state is tms.AllocationState.PAUSED
    saver.resume("weights")
    assert (world.pauses, world.resumes) == (1, 1)
    assert world.is_mapped(address) and weights.data_ptr() == weights_at
    assert set(weights.view(torch.uint8).tolist()) == {POISON}
    assert torch.equal(cache, torch.full((64,), 3.0))

    saver.pause()  # no tag: every allocation
    assert world.used_bytes(0) == 0
    assert {a.state for a in world.allocations()} == {tms.AllocationState.PAUSED}
    saver.resume()
    assert world.used_bytes(0) == 2 * tms.SMALL_BUFFER


def test_pausing_a_paused_tag_ends_the_process(
    installed: Installed, capfd: pytest.CaptureFixture[str]
) -> None:
    with installed.saver.region("weights"):
        kept = torch.ones(4)
    installed.saver.pause("weights")
    with pytest.raises(tms.StandInExit) as exited:
        installed.saver.pause("weights")
    assert exited.value.status == 1
    assert "Cannot pause allocation that is not active. tag=weights" in capfd.readouterr().err
    installed.saver.resume("weights")
    assert in_any_allocation(kept)


def test_resuming_an_active_tag_ends_the_process(
    installed: Installed, capfd: pytest.CaptureFixture[str]
) -> None:
    with installed.saver.region("weights"):
        _kept = torch.ones(4)
    with pytest.raises(tms.StandInExit):
        installed.saver.resume("weights")
    assert "Cannot resume allocation that is not paused" in capfd.readouterr().err


def test_a_resume_without_device_memory_ends_the_process(
    installed: Installed, capfd: pytest.CaptureFixture[str]
) -> None:
    with installed.saver.region("weights"):
        _kept = torch.ones(4)
    installed.saver.pause("weights")
    installed.world.set_free_bytes(0, tms.SMALL_BUFFER - 1)
    with pytest.raises(tms.StandInExit, match=r"cudaError error: 2 \(out of memory\)"):
        installed.saver.resume("weights")
    assert "cuMemCreate CUDA_ERROR_OUT_OF_MEMORY" in capfd.readouterr().err
    installed.world.set_free_bytes(0, tms.SMALL_BUFFER)
    installed.saver.resume("weights")
    assert installed.world.free_bytes(0) == 0


def test_a_new_segment_past_the_margin_or_the_free_memory_ends_the_process(
    installed: Installed, capfd: pytest.CaptureFixture[str]
) -> None:
    saver, world = installed.saver, installed.world
    world.set_free_bytes(0, 3 * MIB)
    saver.memory_margin_bytes = 2 * MIB  # 2 MiB segment + 2 MiB margin > 3 MiB free
    with pytest.raises(tms.StandInExit, match="tms_torch_malloc"), saver.region("weights"):
        torch.ones(4)
    assert "malloc return OOM since memory_margin_bytes=2097152" in capfd.readouterr().out
    assert world.allocations() == []

    saver.memory_margin_bytes = MIB
    with saver.region("weights"):
        kept = torch.ones(4)
    assert world.free_bytes(0) == MIB and world.used_bytes(0) == tms.SMALL_BUFFER
    saver.memory_margin_bytes = 0
    with pytest.raises(tms.StandInExit), saver.region("kv"):
        torch.ones(4)  # no margin, but cuMemCreate finds 1 MiB free
    assert "cuMemCreate CUDA_ERROR_OUT_OF_MEMORY" in capfd.readouterr().err
    assert in_any_allocation(kept)


def test_free_works_on_a_paused_allocation(installed: Installed) -> None:
    world = installed.world
    world.set_free_bytes(0, 10 * MIB)
    address = world.core.malloc(0, 3 * MIB, "weights")
    assert address is not None
    [allocation] = world.allocations()
    assert (allocation.raw_size, allocation.allocation_size) == (3 * MIB, 4 * MIB)
    installed.saver.pause("weights")
    assert world.free_bytes(0) == 10 * MIB
    assert world.core.free(address) == 0
    assert world.allocations() == [] and world.free_bytes(0) == 10 * MIB
    with pytest.raises(StandInFault, match="not the start of a reservation"):
        world.is_mapped(address)
    assert world.core.free(address) == tms.CUDA_ERROR_INVALID_VALUE  # forwarded to cudaFree, refused


def test_the_allocator_hooks_end_the_process_outside_a_region(installed: Installed) -> None:
    library = installed.world.library
    with pytest.raises(tms.StandInExit, match="only support interesting region"):
        library.tms_torch_malloc(tms.SMALL_BUFFER, 0)
    with installed.saver.region("weights"):
        address = library.tms_torch_malloc(tms.SMALL_BUFFER, 0)
    with pytest.raises(tms.StandInExit, match="only support interesting region"):
        library.tms_torch_free(address, tms.SMALL_BUFFER, 0)
    with installed.saver.region("weights"):
        library.tms_torch_free(address, tms.SMALL_BUFFER, 0)
    assert installed.world.allocations() == []


def test_a_new_tensor_in_a_paused_allocation_faults(installed: Installed) -> None:
    saver = installed.saver
    with saver.region("weights"):
        freed = torch.ones(4)
    del freed  # its block stays cached in the (soon paused) segment
    saver.pause("weights")
    with pytest.raises(StandInFault, match="paused allocation"), saver.region("weights"):
        torch.ones(4)
    saver.resume("weights")
    with saver.region("weights"):
        fine = torch.ones(4)
    assert torch.equal(fine, torch.ones(4))


def test_uninstall_gives_back_segments_no_tensor_uses() -> None:
    module = tms.install(fatal_raises=True)
    world = module.standin
    saver = module.torch_memory_saver
    saver.hook_mode = "torch"
    with saver.region("weights"):
        kept = torch.ones(4)
    with saver.region("kv"):
        dropped = torch.ones(4)
    del dropped
    tms.uninstall()
    assert [a.tag for a in world.allocations()] == ["weights"]
    assert torch.equal(kept, torch.ones(4))
    del kept
    assert world.allocations() == []


def test_the_real_default_is_to_end_the_process() -> None:
    script = (
        "import torch\n"
        "from tests.standins.tms import install\n"
        "saver = install().torch_memory_saver\n"
        "saver.hook_mode = 'torch'\n"
        "with saver.region('weights'):\n"
        "    kept = torch.ones(4)\n"
        "saver.pause('weights')\n"
        "try:\n"
        "    saver.pause('weights')\n"
        "except BaseException:\n"
        "    print('caught')\n"
        "    raise SystemExit(3)\n"
        "print('still alive')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 1
    assert "Cannot pause allocation that is not active" in run.stderr
    assert "caught" not in run.stdout and "still alive" not in run.stdout


# -- the CUDA graph stand-in -----------------------------------------------------------------


def forward(linear: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda inputs: torch.relu(linear(inputs)) * 2


@pytest.fixture(autouse=True)
def seeded() -> None:
    """The same weights and inputs in every run: unseeded, a relu output zero everywhere (1 run in
    64) equals the garbage a test needs it to differ from."""
    torch.manual_seed(0)


def test_a_replay_follows_the_bytes_at_the_captured_addresses(installed: Installed) -> None:
    with installed.saver.region("weights"):
        linear = torch.nn.Linear(4, 3)
    inputs = torch.randn(2, 4)
    graph = cuda_graphs.StandInGraph()
    with torch.no_grad():
        static = graph.capture(forward(linear), inputs)
        assert torch.equal(static, torch.relu(linear(inputs)) * 2)
        read_at = {read.address for read in graph.reads}
        assert {inputs.data_ptr(), linear.weight.data_ptr(), linear.bias.data_ptr()} <= read_at
        inputs.copy_(torch.randn(2, 4))  # new data in the static input, as a real graph is fed
        assert graph.replay() is static
        assert torch.equal(static, torch.relu(linear(inputs)) * 2)


def test_a_replay_reads_the_old_address_after_a_tensor_moved(installed: Installed) -> None:
    with installed.saver.region("weights"):
        linear = torch.nn.Linear(4, 3)
    inputs = torch.randn(2, 4)
    graph = cuda_graphs.StandInGraph()
    with torch.no_grad():
        graph.capture(forward(linear), inputs)
        old_address = linear.weight.data_ptr()
        linear.weight.data = linear.weight.data.clone()  # same values, elsewhere; the old block is free
        expected = torch.relu(linear(inputs)) * 2
        assert torch.equal(graph.replay(), expected)  # the old bytes are still there
        with installed.saver.region("weights"):
            reuse = torch.full((3, 4), 7.0)  # the freed block is handed out again
        assert reuse.data_ptr() == old_address
        assert not torch.equal(graph.replay(), expected)
        assert torch.equal(torch.relu(linear(inputs)) * 2, expected)  # eager reads the moved tensor


def test_a_replay_after_resume_reads_garbage_until_the_bytes_are_back(installed: Installed) -> None:
    with installed.saver.region("weights"):
        linear = torch.nn.Linear(4, 3)
    inputs = torch.randn(2, 4)
    graph = cuda_graphs.StandInGraph()
    with torch.no_grad():
        expected = graph.capture(forward(linear), inputs).clone()
        saved = [p.detach().clone() for p in linear.parameters()]
        installed.saver.pause("weights")
        with pytest.raises(StandInFault, match="paused torch_memory_saver allocation"):
            graph.replay()
        installed.saver.resume("weights")
        assert not torch.equal(graph.replay(), expected)
        for parameter, values in zip(linear.parameters(), saved, strict=True):
            parameter.copy_(values)  # the right bytes at the same addresses
        assert torch.equal(graph.replay(), expected)


def test_a_replay_of_host_memory_freed_or_reallocated_faults() -> None:
    held = [torch.randn(4, 4)]
    inputs = torch.randn(4)
    graph = cuda_graphs.StandInGraph()
    graph.capture(lambda x: held[0] @ x, inputs)
    graph.replay()
    storage = held[0].untyped_storage()
    storage.resize_(storage.nbytes() * 2)  # a new buffer: the graph still reads the old one
    with pytest.raises(StandInFault, match="reallocated"):
        graph.replay()
    del storage
    held.clear()
    with pytest.raises(StandInFault, match="freed"):
        graph.replay()


def test_graph_pools_show_in_the_snapshot_with_their_ids(installed: Installed) -> None:
    inputs = torch.randn(4)
    doubled = cuda_graphs.StandInGraph()
    doubled.capture(lambda x: x * 2, inputs)
    shared = cuda_graphs.graph_pool_handle()
    first, second = cuda_graphs.StandInGraph(), cuda_graphs.StandInGraph()
    first.capture(lambda x: x + 1, inputs, pool=shared)
    second.capture(lambda x: x - 1, inputs, pool=first.pool())
    with installed.saver.region("weights"):
        _kept = torch.ones(4)
    user_pool = installed.pool_id("weights")
    into_user = cuda_graphs.StandInGraph()
    into_user.capture(lambda x: x * 3, inputs, pool=user_pool)

    assert doubled.pool()[1] == 0 and doubled.pool()[0] >= 1
    assert shared == (doubled.pool()[0] + 1, 0)
    ours = {doubled.pool(), shared, user_pool}  # graphs of other tests may still be alive

    def graph_pool_ids() -> list[tuple[int, int]]:
        return sorted(
            s["segment_pool_id"] for s in cuda_graphs.graph_segments() if s["segment_pool_id"] in ours
        )

    assert graph_pool_ids() == sorted([doubled.pool(), shared, shared, user_pool])
    [segment] = [s for s in cuda_graphs.graph_segments() if s["segment_pool_id"] == doubled.pool()]
    assert segment["blocks"][0] == {
        "address": doubled.replay().data_ptr(),
        "size": 512,
        "requested_size": 16,
        "state": "active_allocated",
        "frames": [],
    }
    assert len(installed.world.memory_snapshot(user_pool)) == 2  # the tms segment and the graph's
    assert installed.world.memory_snapshot(doubled.pool()) == [segment]

    doubled.reset()
    del second
    gc.collect()
    assert graph_pool_ids() == sorted([shared, user_pool])


def test_a_capture_must_return_tensors_it_computed() -> None:
    inputs = torch.randn(4)
    with pytest.raises(ValueError, match="that it computed"):
        cuda_graphs.StandInGraph().capture(lambda x: x, inputs)
    with pytest.raises(ValueError, match="pool id"):
        cuda_graphs.StandInGraph().capture(lambda x: x * 2, inputs, pool=(0, 0))


def test_a_graph_reads_raw_memory_not_python_objects() -> None:
    """Rewriting the bytes at the address (not through the tensor) changes what the replay computes."""
    weight = torch.ones(4)
    graph = cuda_graphs.StandInGraph()
    inputs = torch.ones(4)
    graph.capture(lambda x: x * weight, inputs)
    ctypes.memmove(weight.data_ptr(), torch.full((4,), 5.0).numpy().tobytes(), weight.nbytes)
    assert torch.equal(graph.replay(), torch.full((4,), 5.0))
