"""Pinned staging kept from one sleep or wake to the next, within the bound each one is given.

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
from hibernate.pools.device import CudaCopies, CudaRuntime
from hibernate.pools.tensors import TensorPool
from hibernate.store.directio import KeptStaging, StagingPool
from tests.pooled import agent_with
from tests.standins.vllm_cumem import FakeCudaRT

MiB = 1 << 20


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
    kept.begin(4 * MiB)
    use(StagingPool(4 * MiB, MiB, pin, lazy=True, kept=kept), 3)
    assert kept.end() == {"reused_bytes": 0, "kept_bytes": 3 * MiB, "given_back_bytes": 0}
    assert pin.pins == 3 and sum(pin.pinned.values()) == 3 * MiB, "kept pinned"

    kept.begin(4 * MiB)
    use(StagingPool(4 * MiB, MiB, pin, lazy=True, kept=kept), 2)
    assert kept.end() == {"reused_bytes": 2 * MiB, "kept_bytes": 3 * MiB, "given_back_bytes": 0}
    assert pin.pins == 3, "the second transfer pinned nothing"

    kept.begin(0)  # asked to give it back
    assert kept.end() == {"reused_bytes": 0, "kept_bytes": 0, "given_back_bytes": 3 * MiB}
    assert pin.pinned == {}, "every buffer unpinned"


def test_nothing_is_kept_beyond_the_bound_nor_without_a_pin_nor_of_another_size() -> None:
    kept, pin = KeptStaging(), CountingPin()
    kept.begin(2 * MiB)
    use(StagingPool(4 * MiB, MiB, pin, lazy=True, kept=kept), 3)
    assert kept.end()["kept_bytes"] == 2 * MiB, "the bound, not the transfer, says how much"
    assert sum(pin.pinned.values()) == 2 * MiB, "the third buffer was unpinned"

    kept.begin(8 * MiB)
    use(StagingPool(4 * MiB, MiB, None, lazy=True, kept=kept), 2)  # a host-only target: nothing to pin
    assert kept.end() == {"reused_bytes": 0, "kept_bytes": 2 * MiB, "given_back_bytes": 0}

    kept.begin(8 * MiB)
    use(StagingPool(4 * MiB, 2 * MiB, pin, lazy=True, kept=kept), 2)  # buffers of another size: made anew
    account = kept.end()
    assert account["reused_bytes"] == 0 and account["kept_bytes"] == 6 * MiB
    kept.begin(0)
    kept.end()
    assert pin.pinned == {}


class FailingFence:
    def wait(self) -> None:
        raise RuntimeError("a device copy failed when it ran")


def test_a_transfer_whose_device_copy_failed_keeps_nothing() -> None:
    kept, pin = KeptStaging(), CountingPin()
    kept.begin(4 * MiB)
    pool = StagingPool(4 * MiB, MiB, pin, lazy=True, kept=kept)
    buffer = pool.take(threading.Event())
    pool.fence(buffer, FailingFence())
    pool.give(buffer)
    pool.close()
    assert kept.end()["kept_bytes"] == 0
    assert pin.pinned == {}, "unpinned and unmapped as before"


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
    ids = {t.untyped_storage()._cdata for t in tensors.values()}
    pool = TensorPool(
        copies=lambda: CudaCopies(CudaRuntime(cudart.lib)),
        device_of=lambda storage: 0 if storage._cdata in ids else None,
        graphs=list,
    )
    pool.track(tensors, "weights", True, "net")
    agent = agent_with(pool, "kept-staging-test")
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
    assert slept["spill"]["kept_staging"]["reused_bytes"] == kept_at_sleep["kept_bytes"], "the arenas again"
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


def test_a_target_without_device_memory_gives_all_its_staging_back(work_dir: Path) -> None:
    weights = torch.arange(1 << 18, dtype=torch.float32)
    pool = TensorPool()
    pool.track(weights, "weights", True, "w")
    agent = agent_with(pool, "host-only")
    slept = agent.sleep_here(work_dir, 5.0, {"buffer_mb": 2, "keep_staging_mb": 64})
    assert slept["spill"]["kept_staging"] == {"reused_bytes": 0, "kept_bytes": 0, "given_back_bytes": 0}
    woke = agent.wake_here({"buffer_mb": 2, "keep_staging_mb": 64})
    assert woke["restore"]["kept_staging"]["kept_bytes"] == 0
