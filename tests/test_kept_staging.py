"""Staging kept from one sleep or wake to the next, within the bound each one is given.

The store's part (directio.KeptStaging with StagingPool) is pinned with a counting pin; the
agent's (a tracked device model's sleeps and wakes, --keep-staging-mb and
HIBERNATE_KEEP_STAGING_MB) runs on the stand-in CUDA runtime (tests/standins/vllm_fake_cudart.c),
which counts page-locked bytes and cudaHostRegister calls as the driver would see them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hibernate.agent.controller import Agent
from hibernate.environ import KEEP_STAGING_ENV
from hibernate.errors import UsageError
from hibernate.pools.tensors import TensorPool
from hibernate.store.directio import KeptStaging, StagingPool
from tests.pooled import agent_with, standin_device_pool
from tests.standins.vllm_cumem import FakeCudaRT

MiB = 1 << 20
# Buffers a transfer may keep map whole huge pages (2 MiB): the sizes below are of those.
UNIT = 2 * MiB


class CountingPin:
    """A pin that records what is pinned now (by buffer address) and how many pins were made."""

    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.pins = 0

    def __call__(self, view: memoryview) -> Callable[[], None]:
        address = id(view.obj)
        self.pinned[address] = len(view)
        self.pins += 1

        def unpin() -> None:
            del self.pinned[address]

        return unpin


def use(pool: StagingPool, count: int) -> None:
    """A transfer that takes ``count`` buffers at once, gives them back, and ends well."""
    abort = threading.Event()
    taken = [pool.take(abort) for _ in range(count)]
    for buffer in taken:
        pool.give(buffer)
    pool.settle()
    pool.close()


def test_a_transfer_within_the_bound_leaves_its_buffers_pinned_for_the_next_one() -> None:
    kept, pin = KeptStaging(), CountingPin()
    kept.begin(4 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, pin, lazy=True, kept=kept), 3)
    assert kept.end() == {"reused_bytes": 0, "kept_bytes": 3 * UNIT, "given_back_bytes": 0}
    assert pin.pins == 3 and sum(pin.pinned.values()) == 3 * UNIT, "kept pinned"

    kept.begin(4 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, pin, lazy=True, kept=kept), 2)
    assert kept.end() == {"reused_bytes": 2 * UNIT, "kept_bytes": 3 * UNIT, "given_back_bytes": 0}
    assert pin.pins == 3, "the second transfer pinned nothing"

    kept.begin(0)  # asked to give it back
    assert kept.end() == {"reused_bytes": 0, "kept_bytes": 0, "given_back_bytes": 3 * UNIT}
    assert pin.pinned == {}, "every buffer unpinned"


def test_nothing_is_kept_beyond_the_bound_and_a_buffer_of_another_size_is_made_anew() -> None:
    kept, pin = KeptStaging(), CountingPin()
    kept.begin(2 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, pin, lazy=True, kept=kept), 3)
    assert kept.end()["kept_bytes"] == 2 * UNIT, "the bound, not the transfer, says how much"
    assert sum(pin.pinned.values()) == 2 * UNIT, "the third buffer was unpinned"

    kept.begin(8 * UNIT)
    use(StagingPool(4 * UNIT, 2 * UNIT, pin, lazy=True, kept=kept), 2)  # buffers of another size: made anew
    account = kept.end()
    assert account["reused_bytes"] == 0 and account["kept_bytes"] == 6 * UNIT
    kept.begin(0)
    kept.end()
    assert pin.pinned == {}


def test_a_kept_buffer_a_little_larger_serves_a_transfer_that_needs_less_and_a_much_larger_does_not() -> None:
    """A snapshot smaller than the staging sizes the buffers to what it holds, which moves by a few
    pages from one sleep to the next: a kept buffer up to a quarter larger is taken, as that size."""
    kept, pin = KeptStaging(), CountingPin()
    kept.begin(64 * UNIT)
    use(StagingPool(4 * UNIT, 5 * UNIT, pin, lazy=True, kept=kept), 1)
    kept.end()
    pool = StagingPool(8 * UNIT, 3 * UNIT, pin, lazy=True, kept=kept)  # 5 units are too many for 3
    kept.begin(64 * UNIT)
    use(pool, 1)
    assert kept.end()["reused_bytes"] == 0 and pin.pins == 2

    kept.begin(64 * UNIT)
    pool = StagingPool(8 * UNIT, 4 * UNIT, pin, lazy=True, kept=kept)
    buffer = pool.take(threading.Event())
    assert buffer.size == 4 * UNIT and buffer.mapped_bytes == 5 * UNIT, "the buffer of 5 units, used as 4"
    assert pool.total_bytes == 5 * UNIT, "what the transfer holds, as mapped"
    pool.give(buffer)
    pool.settle()
    pool.close()
    assert kept.end() == {"reused_bytes": 5 * UNIT, "kept_bytes": 8 * UNIT, "given_back_bytes": 0}
    assert pin.pins == 2, "taken pinned"
    kept.begin(0)
    assert kept.end()["given_back_bytes"] == 8 * UNIT and pin.pinned == {}


def test_plain_staging_is_kept_too_and_pinned_when_a_transfer_that_pins_takes_it() -> None:
    kept, pin = KeptStaging(), CountingPin()
    kept.begin(8 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, None, lazy=True, kept=kept), 2)  # a host-only target: nothing pinned
    assert kept.end() == {"reused_bytes": 0, "kept_bytes": 2 * UNIT, "given_back_bytes": 0}
    assert pin.pins == 0

    kept.begin(8 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, pin, lazy=True, kept=kept), 2)
    assert kept.end()["reused_bytes"] == 2 * UNIT
    assert pin.pins == 2 and sum(pin.pinned.values()) == 2 * UNIT, "pinned when taken, kept pinned"

    kept.begin(8 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, pin, lazy=True, kept=kept), 2)
    assert pin.pins == 2, "pinned once"
    kept.begin(0)
    kept.end()
    assert pin.pinned == {}


class FailingFence:
    def wait(self) -> None:
        raise RuntimeError("a device copy failed when it ran")


@pytest.mark.parametrize("found_by", ["the end", "a worker taking the buffer again"])
def test_a_transfer_whose_device_copy_failed_keeps_nothing(found_by: str) -> None:
    """Whoever waits for the failed copy (the end's settle, or a worker that takes the buffer again
    and is raised the failure), the pool remembers it and keeps none of its buffers."""
    kept, pin = KeptStaging(), CountingPin()
    kept.begin(4 * UNIT)
    pool = StagingPool(4 * UNIT, UNIT, pin, lazy=True, kept=kept)
    buffer = pool.take(threading.Event())
    pool.fence(buffer, FailingFence())
    pool.give(buffer)
    if found_by != "the end":
        with pytest.raises(RuntimeError, match="failed when it ran"):
            pool.take(threading.Event())
    pool.close()
    assert kept.end()["kept_bytes"] == 0
    assert pin.pinned == {}, "unpinned and unmapped as before"


def test_a_kept_buffer_whose_pinning_fails_is_unmapped_not_lost() -> None:
    kept = KeptStaging()
    kept.begin(4 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, None, lazy=True, kept=kept), 1)  # kept, not pinned
    kept.end()

    def refused(view: memoryview) -> Callable[[], None]:
        raise OSError("cannot page-lock")

    kept.begin(4 * UNIT)
    pool = StagingPool(4 * UNIT, UNIT, refused, lazy=True, kept=kept)
    with pytest.raises(OSError, match="cannot page-lock"):
        pool.take(threading.Event())
    assert pool.total_bytes == 0
    pool.close()
    assert kept.end() == {"reused_bytes": UNIT, "kept_bytes": 0, "given_back_bytes": 0}


def test_a_buffer_the_runtime_would_not_page_lock_is_asked_again_by_the_next_transfer() -> None:
    """A refused page-lock leaves the buffer pageable (it works, only slower); kept so, it is not
    taken for page-locked: the next transfer asks again, and keeps it locked once that works."""
    kept, pin = KeptStaging(), CountingPin()
    refusals = []

    def refusing(view: memoryview) -> Callable[[], None] | None:
        refusals.append(len(view))
        return None  # as the CUDA runtime's pin answers a range it refused

    kept.begin(4 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, refusing, lazy=True, kept=kept), 1)
    assert kept.end()["kept_bytes"] == UNIT and refusals == [UNIT]

    kept.begin(4 * UNIT)
    use(StagingPool(4 * UNIT, UNIT, pin, lazy=True, kept=kept), 1)
    assert kept.end()["reused_bytes"] == UNIT
    assert pin.pins == 1 and sum(pin.pinned.values()) == UNIT, "page-locked now, and kept so"
    kept.begin(0)
    kept.end()
    assert pin.pinned == {}


@pytest.fixture
def cudart(cudart_path: Path) -> FakeCudaRT:
    lib = FakeCudaRT(cudart_path)
    lib.set_counter("fake_fail_copy_at", -1)
    lib.set_counter("fake_fail_run_at", -1)
    lib.lib.cudaGetLastError()  # this thread's error slot, as a test before this one may have left it
    return lib


@pytest.fixture
def device_model(cudart: FakeCudaRT) -> Iterator[tuple[Agent, dict[str, torch.Tensor]]]:
    """An agent tracking 4 MiB of "device" weights (the stand-in's device 0), given back at the end."""
    generator = torch.Generator().manual_seed(5)
    tensors = {
        f"w{i}": torch.randint(0, 256, (MiB,), dtype=torch.uint8, generator=generator) for i in range(4)
    }
    agent = agent_with(standin_device_pool(cudart, tensors, 0), "kept-staging-test")
    yield agent, tensors
    agent.kept_staging.begin(0)  # whatever the test did, the stand-in's registrations go back
    agent.kept_staging.end()


def test_a_device_target_keeps_its_staging_pinned_through_the_sleep_and_its_wake_pins_nothing(
    cudart: FakeCudaRT, device_model: tuple[Agent, dict[str, torch.Tensor]], work_dir: Path
) -> None:
    agent, tensors = device_model
    before = {name: t.clone() for name, t in tensors.items()}
    registered = cudart.counter("fake_registered_bytes")
    transfer = {"buffer_mb": 2, "chunk_mb": 1, "keep_staging_mb": 8}

    slept = agent.sleep_here(work_dir, 5.0, transfer)
    kept_at_sleep = slept["spill"]["kept_staging"]
    assert kept_at_sleep["reused_bytes"] == 0 and kept_at_sleep["kept_bytes"] > 0
    assert cudart.counter("fake_registered_bytes") - registered == kept_at_sleep["kept_bytes"], (
        "page-locked while the process sleeps"
    )

    woke = agent.wake_here(transfer)
    assert all(torch.equal(tensors[n], before[n]) for n in tensors), "bit-exact"
    pins_after_wake = cudart.counter("fake_host_registrations")
    kept_at_wake = woke["restore"]["kept_staging"]
    assert kept_at_wake["kept_bytes"] >= kept_at_sleep["kept_bytes"]

    slept = agent.sleep_here(work_dir, 5.0, transfer)
    # Its arenas again, and for its reuse check the wake's read buffers (both kept, of the same kind).
    assert slept["spill"]["kept_staging"]["reused_bytes"] > kept_at_sleep["kept_bytes"]
    woke = agent.wake_here(transfer)
    assert woke["restore"]["kept_staging"]["reused_bytes"] > 0
    assert cudart.counter("fake_host_registrations") == pins_after_wake, "the second cycle pinned nothing"
    assert all(torch.equal(tensors[n], before[n]) for n in tensors), "bit-exact again"

    woke_kept = woke["restore"]["kept_staging"]["kept_bytes"]
    agent.sleep_here(work_dir, 5.0, {**transfer, "keep_staging_mb": 0})  # asked to give it back
    assert cudart.counter("fake_registered_bytes") == registered
    agent.wake_here({"buffer_mb": 2})
    assert woke_kept > 0


def test_the_processs_own_variable_sets_the_bound_when_the_command_does_not(
    cudart: FakeCudaRT,
    device_model: tuple[Agent, dict[str, torch.Tensor]],
    work_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    agent, _ = device_model
    registered = cudart.counter("fake_registered_bytes")
    monkeypatch.setenv(KEEP_STAGING_ENV, "8")
    slept = agent.sleep_here(work_dir, 5.0, {"buffer_mb": 2, "chunk_mb": 1})
    assert slept["spill"]["kept_staging"]["kept_bytes"] > 0
    woke = agent.wake_here({"buffer_mb": 2, "keep_staging_mb": 0})  # the command's word first
    assert woke["restore"]["kept_staging"]["kept_bytes"] == 0
    assert cudart.counter("fake_registered_bytes") == registered

    monkeypatch.setenv(KEEP_STAGING_ENV, "lots")
    with pytest.raises(UsageError, match="HIBERNATE_KEEP_STAGING_MB='lots' is not a size in MiB"):
        agent.sleep_here(work_dir, 5.0, {"buffer_mb": 2})
    assert agent.state.value == "running", "refused before anything was touched"


def test_a_target_without_device_memory_keeps_plain_staging_when_asked(work_dir: Path) -> None:
    weights = torch.arange(1 << 20, dtype=torch.float32)
    before = weights.clone()
    pool = TensorPool()
    pool.track(weights, "weights", True, "w")
    agent = agent_with(pool, "host-only")
    transfer = {"buffer_mb": 2, "chunk_mb": 1, "keep_staging_mb": 64}
    slept = agent.sleep_here(work_dir, 5.0, transfer)
    kept = slept["spill"]["kept_staging"]["kept_bytes"]
    assert kept > 0
    agent.wake_here(transfer)
    weights.add_(1)  # changed: the next sleep writes every chunk again, through the kept arenas
    slept = agent.sleep_here(work_dir, 5.0, transfer)
    assert slept["spill"]["kept_staging"]["reused_bytes"] >= kept  # the reuse check's reads may take more
    woke = agent.wake_here({"buffer_mb": 2, "keep_staging_mb": 0})
    assert woke["restore"]["kept_staging"]["kept_bytes"] == 0 and torch.equal(weights, before + 1)
