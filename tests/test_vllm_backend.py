"""HibernateBackend over real vLLM AllocationData records, with host memory standing in for the GPU.

Every allocation sits at a fixed host reservation (tests/standins/vllm_memory.py):
released memory is really given back and made inaccessible, mapped memory
comes back filled with poison, so a byte that is right after a wake was put
there by the backend, at the address vLLM holds.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hibernate import procinfo
from hibernate.agent.controller import Agent, AgentState, Session
from hibernate.errors import (
    AbortedError,
    CudaCheckpointError,
    NeedsRecoveryError,
    SnapshotInvalidError,
    UnsupportedError,
    UsageError,
)
from hibernate.integrations.vllm import HibernateBackend
from hibernate.integrations.vllm_distributed import (
    MISSING_DISTRIBUTED_CHECKPOINT,
    PREPARED_REFUSAL,
    VOTE_BYTES,
    peer_timeout,
    vote_outcome,
    vote_table,
    world_size_from,
)
from hibernate.operation.reports import ProcessWake
from hibernate.pools.device import DeviceMemoryError
from hibernate.pools.vllm import keeps
from hibernate.store.layout import SpillRoot
from tests.conftest import spill_root_of, wait_until
from tests.standins import vllm_parallel_state
from tests.standins.vllm_memory import (
    LAYOUT,
    HostDeviceMemory,
    HostReservations,
    StandInCuMemAllocator,
    populate,
    reference_discard,
    reference_sleep,
    reference_wake_up,
)

STAGING = {"HIBERNATE_BUFFER_MB": "2", "HIBERNATE_CHUNK_MB": "1"}
AGENT_NAME = "vllm-test"


@dataclass
class World:
    """One stand-in worker: its allocator, memory, agent and backend, and what the memory held."""

    reservations: HostReservations
    allocator: StandInCuMemAllocator
    memory: HostDeviceMemory
    agent: Agent
    backend: HibernateBackend
    contents: dict[int, bytes]
    spill_dir: Path

    def tag(self, address: int) -> str:
        return self.allocator.pointer_to_data[address].tag

    def mapped(self, address: int) -> bool:
        return self.reservations.is_mapped(address)

    def read(self, address: int) -> bytes:
        return self.reservations.read(address, self.allocator.size_of(address))

    def asleep(self) -> list[bool]:
        return [d.is_asleep for d in self.allocator.pointer_to_data.values()]

    def snapshot_tags(self) -> list[str]:
        with SpillRoot(spill_root_of(self.spill_dir, os.getpid(), AGENT_NAME)) as root:
            manifest = root.latest_manifest()
        assert manifest is not None
        return [r.tag for r in manifest.records]


def make_world(
    spill_dir: Path,
    environ: dict[str, str] | None = None,
    helper: Any = None,
    parallel_state: Any = None,
) -> World:
    reservations = HostReservations()
    allocator = StandInCuMemAllocator(reservations)
    contents = populate(allocator, LAYOUT)
    memory = HostDeviceMemory(reservations)
    agent = Agent(procinfo.identity(os.getpid()), name=AGENT_NAME, runtime="test")  # type: ignore[arg-type]
    env = {"HIBERNATE_DIR": str(spill_dir), **STAGING, **(environ or {})}
    backend = HibernateBackend(
        allocator=allocator,
        device=memory,
        agent=agent,
        environ=env,
        helper=helper,
        parallel_state=lambda: parallel_state,
    )
    return World(reservations, allocator, memory, agent, backend, contents, spill_dir)


def free_world(world: World) -> None:
    for address in list(world.allocator.pointer_to_data):
        world.allocator.free(address)


@pytest.fixture
def world(work_dir: Path) -> Iterator[World]:
    made = make_world(work_dir)
    yield made
    free_world(made)


@pytest.fixture
def twin(tmp_path: Path) -> Iterator[World]:
    """The same allocations and bytes, put to sleep by vLLM's own rules instead (the oracle)."""
    made = make_world(tmp_path)
    yield made
    free_world(made)


def assert_awake_as_before(world: World, level: int = 1) -> None:
    """Everything mapped at its old address; kept bytes identical, dropped ones zero."""
    assert list(world.allocator.pointer_to_data) == list(world.contents)
    for address, before in world.contents.items():
        data = world.allocator.pointer_to_data[address]
        assert not data.is_asleep and data.cpu_backup_tensor is None
        assert world.mapped(address)
        if keeps(data.tag, level):
            assert world.read(address) == before, f"{data.tag} at {address:#x} differs"
        else:
            assert world.read(address) == bytes(len(before)), f"{data.tag} at {address:#x} is not zero"


# -- suspend and resume ---------------------------------------------------------


def test_level_1_writes_the_kept_tags_to_disk_and_releases_every_allocation(world: World) -> None:
    world.backend.suspend(1)

    assert world.backend.state() == "SUSPENDED"
    assert world.agent.state is AgentState.ASLEEP
    for address, data in world.allocator.pointer_to_data.items():
        assert data.is_asleep and data.cpu_backup_tensor is None
        assert not world.mapped(address)
    assert sorted(world.snapshot_tags()) == sorted(tag for tag, _ in LAYOUT if keeps(tag, 1))
    spill = world.backend.last_report["spill"]
    assert spill["total_bytes"] == sum(len(b) for a, b in world.contents.items() if keeps(world.tag(a), 1))
    assert spill["dropped_bytes"] == sum(
        len(b) for a, b in world.contents.items() if not keeps(world.tag(a), 1)
    )
    # Staging went through the pool's pinner, within its budget, and was unpinned.
    assert 0 < world.memory.pinned_peak <= 2 << 20
    assert world.memory.pinned_now == 0


def test_resume_brings_every_byte_back_at_the_same_address_and_zeroes_what_was_dropped(world: World) -> None:
    world.backend.suspend(1)
    world.backend.resume()

    assert world.backend.state() == "RUNNING"
    assert world.agent.state is AgentState.RUNNING
    assert_awake_as_before(world)


def test_level_2_drops_the_weights_too(world: World) -> None:
    world.backend.suspend(2)
    assert "weights" not in world.snapshot_tags()
    world.backend.resume()
    assert_awake_as_before(world, level=2)


def test_many_cycles_reuse_the_unchanged_chunks_and_stay_exact(world: World) -> None:
    for _ in range(3):
        world.backend.suspend(1)
        world.backend.resume()
    spill = world.backend.last_report
    assert_awake_as_before(world)
    assert world.agent.status()["snapshot"] is not None
    assert spill["loose"] == {"mapped_bytes": 0, "from_backup_bytes": 0}


@pytest.mark.parametrize(
    "steps",
    [[["weights"], ["kv_cache"]], [["kv_cache"], ["weights"]], [["runtime"], None]],
    ids=["weights-then-kv", "kv-then-weights", "runtime-then-all"],
)
def test_a_deferred_wake_maps_what_vllms_own_wake_maps_step_by_step(
    world: World, twin: World, steps: list[list[str] | None]
) -> None:
    kept_tags = tuple(tag for tag, _ in LAYOUT if keeps(tag, 1))
    world.backend.suspend(1)
    reference_sleep(twin.allocator, twin.memory, kept_tags)
    assert world.asleep() == twin.asleep()

    for step, tags in enumerate(steps):
        world.backend.resume(tags)
        reference_wake_up(twin.allocator, twin.memory, tags)
        assert world.asleep() == twin.asleep(), f"after wake {step} ({tags})"
        for ours, theirs in zip(world.contents, twin.contents, strict=True):
            if world.mapped(ours) and keeps(world.tag(ours), 1):
                assert world.read(ours) == world.contents[ours] == twin.read(theirs)
        last = step == len(steps) - 1
        assert world.backend.state() == ("RUNNING" if last else "SUSPENDED")
        assert world.agent.state is (AgentState.RUNNING if last else AgentState.ASLEEP)
    assert_awake_as_before(world)


def test_discarding_the_kv_cache_while_running_then_waking_it_matches_vllm(world: World, twin: World) -> None:
    """vLLM's release_kv_cache_memory(): discard while paused, wake_up(["kv_cache"]) later."""
    world.backend.discard(("kv_cache",))
    reference_discard(twin.allocator, twin.memory, ("kv_cache",))
    assert world.asleep() == twin.asleep()
    assert world.backend.state() == "SUSPENDED"
    assert world.agent.state is AgentState.RUNNING  # the process is not asleep, only its KV cache

    world.backend.resume(["kv_cache"])
    reference_wake_up(twin.allocator, twin.memory, ["kv_cache"])
    assert world.asleep() == twin.asleep() == [False] * len(LAYOUT)
    assert world.backend.state() == "RUNNING"
    for address, before in world.contents.items():
        expected = bytes(len(before)) if world.tag(address) == "kv_cache" else before
        assert world.read(address) == expected


def test_an_allocation_discarded_before_a_sleep_is_not_part_of_it_and_comes_back_zero(world: World) -> None:
    world.backend.discard(("kv_cache",))
    world.backend.suspend(1)
    assert "kv_cache" not in world.snapshot_tags()
    world.backend.resume()
    assert_awake_as_before(world)


def test_sleeping_again_while_partly_awake_first_finishes_the_wake(world: World) -> None:
    world.backend.suspend(1)
    world.backend.resume(["kv_cache"])  # the weights stay asleep
    world.backend.suspend(1)
    assert all(world.asleep())
    world.backend.resume()
    assert_awake_as_before(world)


def test_a_backup_left_by_vllms_own_allocator_sleep_is_honoured(world: World) -> None:
    reference_sleep(world.allocator, world.memory, ("weights",))
    world.backend.resume()
    for address, before in world.contents.items():
        expected = before if world.tag(address) == "weights" else bytes(len(before))
        assert world.read(address) == expected
    assert world.backend.last_report["loose"]["from_backup_bytes"] == sum(
        len(b) for a, b in world.contents.items() if world.tag(a) == "weights"
    )


def test_vllms_extension_leaves_the_error_of_freeing_an_asleep_allocation_to_its_next_map(
    world: World,
) -> None:
    """The stand-in keeps the flaw of vLLM 0.33's cumem extension that the next test works around."""
    world.backend.suspend(1)
    gone, other = world.allocator.by_tag("weights")[:2]
    world.allocator.free(gone)  # its unmap fails, and the error code stays set
    handle = world.allocator.pointer_to_data[other].handle
    with pytest.raises(RuntimeError, match="invalid argument"):
        world.memory.map(handle)
    assert not world.mapped(other) and world.reservations.leaked_bytes == world.allocator.size_of(other)
    world.memory.map(handle)  # the failing call cleared it
    assert world.mapped(other)
    world.memory.unmap(handle)


def test_an_allocation_vllm_frees_while_asleep_is_not_brought_back_and_the_error_it_leaves_is_outlived(
    world: World,
) -> None:
    world.backend.suspend(1)
    gone = world.allocator.by_tag("weights")[0]
    size = world.allocator.size_of(gone)
    world.allocator.free(gone)
    del world.contents[gone]
    world.backend.resume()
    assert_awake_as_before(world)
    warnings = world.backend.last_report["warnings"]
    assert len(warnings) == 2, warnings
    assert f"freed its weights allocation at {gone:#x} ({size} bytes) while it was asleep" in warnings[0]
    assert "mapped on a second try" in warnings[1] and "invalid argument" in warnings[1]
    assert world.reservations.stale_error is None
    # hibernate wake, watching from outside, reports them with the wake it read from the agent.
    last = world.backend._agent.status()["last_operation"]
    answers = {step: answer for step, answer in last.items() if isinstance(answer, dict)}
    assert ProcessWake.from_answers(os.getpid(), "worker", None, answers).warnings == warnings
    # The next cycle is clean: nothing to warn about, nothing retried.
    world.backend.suspend(1)
    world.backend.resume()
    assert_awake_as_before(world)
    assert world.backend.last_report["warnings"] == []


def test_an_allocation_freed_while_discarded_is_outlived_by_a_later_wake(world: World) -> None:
    world.backend.discard(("kv_cache",))
    gone = world.allocator.by_tag("kv_cache")[0]
    world.allocator.free(gone)
    del world.contents[gone]
    world.backend.resume(["kv_cache"])
    assert not any(world.asleep())
    for address, before in world.contents.items():
        expected = bytes(len(before)) if world.tag(address) == "kv_cache" else before
        assert world.read(address) == expected
    assert any(f"at {gone:#x}" in w for w in world.backend.last_report["warnings"])


def test_a_sleep_whose_first_unmap_meets_the_error_of_a_free_takes_it_as_done(world: World) -> None:
    """Partly woken, vLLM frees what still sleeps; the next sleep's first call is then an unmap."""
    world.backend.suspend(1)
    world.backend.resume(["weights"])  # the KV cache stays asleep
    for gone in world.allocator.by_tag("kv_cache"):
        world.allocator.free(gone)
        del world.contents[gone]
    world.backend.suspend(1)
    assert world.backend.state() == "SUSPENDED" and all(world.asleep())
    assert not any(world.mapped(a) for a in world.contents)
    warnings = world.backend.last_report["warnings"]
    assert len(warnings) == 3 and "met the error left by that free" in warnings[2], warnings
    assert world.reservations.leaked_bytes > 0 and world.reservations.stale_error is None
    world.backend.resume()
    assert_awake_as_before(world)
    assert world.backend.last_report["warnings"] == []


def test_a_free_noticed_between_calls_whose_error_vllm_met_itself_gets_no_retry_later(world: World) -> None:
    """The end of a backend call notices the vanished record; vLLM's own next call then meets (and
    clears) its error; a genuine failure of the next wake is the wake's, not retried (on a GPU, a
    retry after a real failure can leak another allocation)."""
    world.backend.suspend(1)
    world.backend.resume(["weights"])  # the KV cache stays asleep
    gone, other = world.allocator.by_tag("kv_cache")[:2]
    world.allocator.free(gone)  # the error code stays set
    del world.contents[gone]
    assert any(f"at {gone:#x}" in w for w in world.backend.pool.take_warnings())  # as a call's end does
    with pytest.raises(RuntimeError, match="invalid argument"):
        world.memory.map(world.allocator.pointer_to_data[other].handle)  # vLLM's own call meets it
    world.reservations.stale_error = "CUDA Error: out of memory (injected)"  # a real failure, next
    with pytest.raises(RuntimeError, match="out of memory"):
        world.backend.resume()
    assert world.backend.state() == "SUSPENDED"
    assert not any(world.mapped(a) for a in world.contents if world.tag(a) == "kv_cache")
    world.backend.resume()
    assert_awake_as_before(world)


def test_a_failing_map_with_no_allocation_freed_is_not_retried(world: World) -> None:
    """Only the error a free left behind is worth a second try; any other failure is the wake's."""
    world.backend.suspend(1)
    world.reservations.stale_error = "CUDA Error: out of memory (injected)"
    with pytest.raises(RuntimeError, match="out of memory"):
        world.backend.resume()
    assert world.backend.state() == "SUSPENDED" and all(world.asleep())
    assert not any(world.mapped(a) for a in world.contents)
    world.backend.resume()
    assert_awake_as_before(world)


# -- more than one GPU: vLLM's communicators -------------------------------------------


class Distributed:
    """vLLM's parallel_state of a worker in a world of ``size``, recording its calls (stand-in)."""

    def __init__(
        self, worlds: list[World], size: int = 2, with_checkpoint: bool = True, engine_size: int | None = None
    ) -> None:
        self.world = vllm_parallel_state.World(0, size, None)
        self.module = vllm_parallel_state.make_module(self.world, with_checkpoint, engine_size)
        self.calls: list[tuple[str, bool]] = []  # (call, were the pools released at that moment?)
        self.fail: set[str] = set()
        for name, step in (("prepare", self.world.prepare), ("restore", self.world.restore)):
            if with_checkpoint:
                setattr(
                    self.module, f"checkpoint_{name}_distributed_state", self._recorded(name, step, worlds)
                )

    def _recorded(self, name: str, step: Any, worlds: list[World]) -> Any:
        def call() -> None:
            self.calls.append((name, all(worlds[0].asleep())))
            if name in self.fail:
                raise RuntimeError(f"{name} failed (injected)")
            step()

        return call


def distributed_world(work_dir: Path, **kwargs: Any) -> tuple[World, Distributed]:
    worlds: list[World] = []
    distributed = Distributed(worlds, **kwargs)
    worlds.append(make_world(work_dir, parallel_state=distributed.module))
    return worlds[0], distributed


def test_with_peers_the_workspaces_are_torn_down_after_the_release_and_rebuilt_before_any_map(
    work_dir: Path,
) -> None:
    world, distributed = distributed_world(work_dir)
    try:
        world.backend.suspend(1)
        assert distributed.calls == [("prepare", True)]
        assert not distributed.world.workspaces_up
        world.backend.resume(["weights"])  # a deferred wake: the first one rebuilds them, once
        world.backend.resume()
        assert distributed.calls == [("prepare", True), ("restore", True)]
        assert distributed.world.workspaces_up
        assert_awake_as_before(world)
        assert world.backend.last_report["warnings"] == []
    finally:
        free_world(world)


def test_alone_in_its_world_a_worker_leaves_the_communicators_alone(work_dir: Path) -> None:
    world, distributed = distributed_world(work_dir, size=1)
    try:
        world.backend.suspend(1)
        world.backend.resume()
        assert distributed.calls == []
        assert_awake_as_before(world)
    finally:
        free_world(world)


def test_a_vllm_without_the_checkpoint_collectives_is_said_so_and_sleeps(work_dir: Path) -> None:
    world, _ = distributed_world(work_dir, with_checkpoint=False)
    try:
        world.backend.suspend(1)
        assert world.backend.last_report["spill"]["warnings"] == [MISSING_DISTRIBUTED_CHECKPOINT]
        world.backend.resume()
        assert_awake_as_before(world)
        world.backend.suspend(1)  # said at every sleep, not left behind by the first
        assert world.backend.last_report["spill"]["warnings"] == [MISSING_DISTRIBUTED_CHECKPOINT]
        world.backend.resume()
    finally:
        free_world(world)


def test_a_failing_prepare_brings_the_memory_back_and_says_the_server_must_be_restarted(
    work_dir: Path,
) -> None:
    """A prepare may tear down some workspaces and not others: no later sleep or wake trusts them."""
    world, distributed = distributed_world(work_dir)
    distributed.fail.add("prepare")
    try:
        with pytest.raises(NeedsRecoveryError, match="checkpoint_prepare_distributed_state failed") as failed:
            world.backend.suspend(1)
        assert "keeps serving" not in failed.value.message
        assert "must not serve" in failed.value.message and failed.value.hint == "restart the vLLM server"
        assert world.backend.state() == "RUNNING" and world.agent.state is AgentState.RUNNING
        for address, before in world.contents.items():
            data = world.allocator.pointer_to_data[address]
            assert world.mapped(address) and not data.is_asleep
            if keeps(data.tag, 1):
                assert world.read(address) == before
        assert "checkpoint_prepare_distributed_state failed" in world.agent.status()["restore_refusal"]
        distributed.fail.clear()
        with pytest.raises(NeedsRecoveryError, match="checkpoint_prepare_distributed_state failed"):
            world.backend.suspend(1)  # refused before anything is touched
        assert [c for c, _ in distributed.calls] == ["prepare"]
        assert not any(world.asleep())
    finally:
        free_world(world)


def test_when_one_workers_sleep_fails_every_worker_undoes_its_own_and_nothing_is_torn_down(
    work_dir: Path, tmp_path: Path
) -> None:
    """Two workers of one world, in threads: the second one's spill fails; neither is left waiting."""
    worlds: list[World] = []
    members = [vllm_parallel_state.World(rank, 2, tmp_path / "collectives") for rank in (0, 1)]
    (tmp_path / "collectives").mkdir()
    prepared: list[int] = []
    for rank, (member, spill_dir) in enumerate(zip(members, (work_dir, tmp_path / "spill"), strict=True)):
        module = vllm_parallel_state.make_module(member)
        module.checkpoint_prepare_distributed_state = lambda rank=rank: prepared.append(rank)  # type: ignore[attr-defined]
        worlds.append(make_world(spill_dir, parallel_state=module))
    worlds[1].memory.fail_copy_after = 0
    try:
        with ThreadPoolExecutor(2) as pool:
            outcomes = [pool.submit(w.backend.suspend, 1) for w in worlds]
            errors = [future.exception(timeout=60) for future in outcomes]
        assert isinstance(errors[1], DeviceMemoryError)
        assert isinstance(errors[0], AbortedError)
        assert "worker rank 1 could not sleep (DeviceMemoryError: copying" in errors[0].message
        assert "injected" in errors[0].message and "keeps serving" in errors[0].message
        assert prepared == []
        for rank, world in enumerate(worlds):
            assert world.backend.state() == "RUNNING" and world.agent.state is AgentState.RUNNING
            for address, before in world.contents.items():
                # Rank 0 slept and woke again: what its level dropped comes back zero-filled.
                kept = rank == 1 or keeps(world.tag(address), 1)
                assert world.mapped(address) and world.read(address) == (
                    before if kept else bytes(len(before))
                )
    finally:
        for world in worlds:
            free_world(world)


def test_a_failing_restore_is_said_at_this_wake_and_every_later_one(work_dir: Path) -> None:
    world, distributed = distributed_world(work_dir)
    distributed.fail.add("restore")
    try:
        world.backend.suspend(1)
        for _ in range(2):
            with pytest.raises(NeedsRecoveryError, match="checkpoint_restore_distributed_state failed") as e:
                world.backend.resume()
            assert e.value.hint == "restart the vLLM server"
            assert world.backend.state() == "SUSPENDED" and all(world.asleep())
        assert [c for c, _ in distributed.calls] == ["prepare", "restore"]  # a collective is not retried
    finally:
        free_world(world)


def client_restore(agent: Agent) -> dict[str, Any]:
    """A restore as a hibernate client sends it (the flow's direct wake of a worker)."""
    session = Session("pid 1, uid 0")
    agent.begin(session)
    try:
        return agent.restore(session, {})
    finally:
        agent.end(session)


def test_a_client_may_not_bring_back_a_worker_whose_communicators_are_torn_down(work_dir: Path) -> None:
    world, distributed = distributed_world(work_dir)
    try:
        world.backend.suspend(1)
        assert world.agent.status()["restore_refusal"] == PREPARED_REFUSAL
        with pytest.raises(NeedsRecoveryError) as refused:
            client_restore(world.agent)
        assert refused.value.message == PREPARED_REFUSAL and "POST /wake_up" in (refused.value.hint or "")
        assert all(world.asleep()) and distributed.world.workspaces_up is False
        world.backend.resume()  # the server's own wake rebuilds them, then the memory comes back
        assert world.agent.status()["restore_refusal"] is None
        assert_awake_as_before(world)
    finally:
        free_world(world)


def test_a_world_wider_than_its_engine_is_refused_before_anything_is_touched(work_dir: Path) -> None:
    """Data parallelism: the world holds two engines of one worker each; no vote is held."""
    world, distributed = distributed_world(work_dir, engine_size=1)
    try:
        with pytest.raises(UnsupportedError, match="world spans 2 workers while its engine has 1"):
            world.backend.suspend(1)
        assert not any(world.asleep()) and distributed.calls == []
        assert world.agent.state is AgentState.RUNNING
    finally:
        free_world(world)


def two_workers(work_dir: Path, tmp_path: Path, **environ: str) -> list[World]:
    """Two workers of one world (one engine), each with its own memory, meeting at real collectives."""
    (tmp_path / "collectives").mkdir()
    worlds = []
    for rank, spill_dir in enumerate((work_dir, tmp_path / "spill")):
        member = vllm_parallel_state.World(rank, 2, tmp_path / "collectives", hang_s=5.0)
        worlds.append(make_world(spill_dir, environ, parallel_state=vllm_parallel_state.make_module(member)))
    return worlds


def in_parallel(calls: list[Any]) -> list[BaseException | None]:
    with ThreadPoolExecutor(len(calls)) as pool:
        outcomes = [pool.submit(call) for call in calls]
        return [future.exception(timeout=60) for future in outcomes]


def test_a_peer_that_never_comes_to_the_vote_is_waited_for_only_the_peer_timeout(
    work_dir: Path, tmp_path: Path
) -> None:
    """Rank 1 fails in vLLM's Worker.sleep before it reaches the backend: rank 0 gives up, not hangs."""
    rank0, rank1 = two_workers(work_dir, tmp_path, HIBERNATE_VLLM_PEER_TIMEOUT_S="0.5")
    try:
        with pytest.raises(NeedsRecoveryError, match="could not vote whether every worker can sleep") as e:
            rank0.backend.suspend(1)
        assert "Timed out waiting" in e.value.message and e.value.hint == "restart the vLLM server"
        assert not any(rank0.asleep()) and rank0.agent.state is AgentState.RUNNING  # nothing released
    finally:
        for world in (rank0, rank1):
            free_world(world)


def test_a_check_failing_on_one_worker_stops_every_worker_before_any_releases_its_memory(
    work_dir: Path, tmp_path: Path
) -> None:
    rank0, rank1 = two_workers(work_dir, tmp_path)
    try:
        errors = in_parallel([lambda: rank0.backend.suspend(1), lambda: rank1.backend.suspend(3)])
        assert isinstance(errors[1], UsageError)
        assert isinstance(errors[0], AbortedError)
        assert "worker rank 1 cannot sleep (UsageError:" in errors[0].message
        assert "nothing was released" in errors[0].message
        for world in (rank0, rank1):
            assert not any(world.asleep()) and world.agent.status()["snapshot"] is None
    finally:
        for world in (rank0, rank1):
            free_world(world)


def test_a_cuda_state_not_back_on_one_worker_keeps_every_worker_from_rebuilding_alone(
    work_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Self-checkpoint: rank 1's restore of its CUDA state fails; rank 0 must not enter the rebuild."""
    rank0, rank1 = two_workers(work_dir, tmp_path)
    try:
        assert in_parallel([lambda: rank0.backend.suspend(1), lambda: rank1.backend.suspend(1)]) == [
            None,
            None,
        ]
        failing = CudaCheckpointError("cuda-checkpoint --restore failed (injected)")

        def not_running() -> None:
            raise failing

        monkeypatch.setattr(rank1.backend, "_cuda_running", not_running)
        errors = in_parallel([lambda: rank0.backend.resume(), lambda: rank1.backend.resume()])
        assert errors[1] is failing
        assert isinstance(errors[0], CudaCheckpointError)
        assert "worker rank 1 could not get its CUDA state back" in errors[0].message
        assert "injected" in errors[0].message
        for world in (rank0, rank1):
            assert all(world.asleep()) and world.backend.state() == "SUSPENDED"
        monkeypatch.undo()  # fixed: the next wake of every worker rebuilds together and wakes
        assert in_parallel([lambda: rank0.backend.resume(), lambda: rank1.backend.resume()]) == [None, None]
        for world in (rank0, rank1):
            assert_awake_as_before(world)
    finally:
        for world in (rank0, rank1):
            free_world(world)


def test_the_peer_timeout_is_a_positive_number_of_seconds(work_dir: Path) -> None:
    assert peer_timeout({}) == 600.0 and peer_timeout({"HIBERNATE_VLLM_PEER_TIMEOUT_S": "2.5"}) == 2.5
    for bad in ("0", "-1", "soon", "nan", "inf"):
        with pytest.raises(UsageError, match="HIBERNATE_VLLM_PEER_TIMEOUT_S"):
            peer_timeout({"HIBERNATE_VLLM_PEER_TIMEOUT_S": bad})
    with pytest.raises(UsageError, match="not a positive number of seconds"):
        make_world(work_dir, {"HIBERNATE_VLLM_PEER_TIMEOUT_S": "0"})  # when vLLM creates the backend


def test_a_vote_carries_each_failing_workers_words_by_rank() -> None:
    tables = [vote_table(0, 3, None), vote_table(1, 3, "UsageError: é" + "x" * 500), vote_table(2, 3, "boom")]
    summed = [[sum(cells) for cells in zip(*rows, strict=True)] for rows in zip(*tables, strict=True)]
    outcome = vote_outcome(summed)
    assert sorted(outcome) == [1, 2] and outcome[2] == "boom"
    assert outcome[1].startswith("UsageError: é") and len(outcome[1].encode()) <= VOTE_BYTES
    assert vote_outcome([row for row in vote_table(0, 2, None)]) == {}


# -- where the spill goes ---------------------------------------------------------


def test_a_directory_configured_on_the_agent_wins_over_the_environment(world: World, tmp_path: Path) -> None:
    configured = tmp_path / "configured"
    world.agent.configure(configured)
    world.backend.suspend(1)
    assert Path(world.backend.last_report["spill"]["path"]).parent == spill_root_of(
        configured, os.getpid(), AGENT_NAME
    )
    world.backend.resume()
    assert_awake_as_before(world)


# -- failures leave the worker whole ---------------------------------------------------


def test_a_failing_device_copy_during_the_spill_leaves_everything_mapped_and_intact(world: World) -> None:
    world.memory.fail_copy_after = 3 << 20
    # The stagers copy runs of chunks concurrently, so which allocation crosses the 3 MiB mark
    # varies; the message must name that one: its tag, its address and the offset in it.
    with pytest.raises(
        DeviceMemoryError, match=r"copying (\w+)/(0x[0-9a-f]+) \(\+\d+\) to the host failed.*injected"
    ) as failed:
        world.backend.suspend(1)
    named = re.search(r"copying (\w+)/(0x[0-9a-f]+)", failed.value.message)
    assert named is not None and int(named[2], 16) in world.contents
    assert named[1] == world.allocator.pointer_to_data[int(named[2], 16)].tag
    assert world.backend.state() == "RUNNING"
    assert world.agent.state is AgentState.RUNNING
    for address, before in world.contents.items():
        assert world.mapped(address) and world.read(address) == before
    assert not spill_root_of(world.spill_dir, os.getpid(), AGENT_NAME).exists(), "nothing was published"


def test_a_corrupted_snapshot_is_refused_and_the_worker_stays_asleep_not_half_awake(world: World) -> None:
    world.backend.suspend(1)
    snapshot = Path(world.backend.last_report["spill"]["path"])
    data_file = next(snapshot.glob("data-*.bin"))
    with open(data_file, "r+b") as f:
        f.seek(4096 + 17)
        byte = f.read(1)
        f.seek(4096 + 17)
        f.write(bytes([byte[0] ^ 0xFF]))

    with pytest.raises(SnapshotInvalidError, match="checksum mismatch"):
        world.backend.resume()
    assert world.backend.state() == "SUSPENDED"
    assert world.agent.state is AgentState.ASLEEP
    assert all(world.asleep())
    assert not any(world.mapped(a) for a in world.contents)


def test_an_unknown_level_is_refused_before_anything_is_touched(world: World) -> None:
    with pytest.raises(UsageError, match="sleep level"):
        world.backend.suspend(3)
    assert world.backend.state() == "RUNNING"
    assert not any(world.asleep())


def test_without_a_cumem_allocator_a_sleep_says_how_to_get_one(work_dir: Path) -> None:
    agent = Agent(procinfo.identity(os.getpid()), name=AGENT_NAME)  # type: ignore[arg-type]
    reservations = HostReservations()
    backend = HibernateBackend(device=HostDeviceMemory(reservations), agent=agent, environ={})
    with pytest.raises(UnsupportedError, match="CuMemAllocator is not in use") as caught:
        backend.suspend(1)
    assert "--enable-sleep-mode" in str(caught.value.hint)


def test_self_checkpoint_without_a_checkpointer_is_refused_when_the_backend_is_made(work_dir: Path) -> None:
    agent = Agent(procinfo.identity(os.getpid()), name=AGENT_NAME)  # type: ignore[arg-type]

    def no_helper() -> Any:
        raise UnsupportedError("HIBERNATE_SELF_CHECKPOINT=1 needs the driver's checkpoint API")

    with pytest.raises(UnsupportedError, match="HIBERNATE_SELF_CHECKPOINT=1"):
        HibernateBackend(agent=agent, environ={"HIBERNATE_SELF_CHECKPOINT": "1"}, helper=no_helper)
    assert agent.state is AgentState.RUNNING


def test_with_self_checkpoint_the_checkpoint_follows_vllms_sleep_and_the_restore_precedes_its_wake(
    work_dir: Path,
) -> None:
    """The helper is asked to checkpoint once the caller of suspend returned, to restore before any remap."""
    order: list[tuple[str, bool | None]] = []
    worlds: list[World] = []

    class Helper:
        def call(self, op: str) -> dict[str, Any]:
            order.append((op, all(worlds[0].asleep())))  # were the pools released at that moment?
            return {"status": "checkpointed" if op == "sleep" else "restored", "processes": []}

        def close(self) -> None:
            pass

    world = make_world(work_dir, {"HIBERNATE_SELF_CHECKPOINT": "1"}, helper=Helper)
    worlds.append(world)
    try:
        assert world.agent.status()["self_checkpoint"] is True

        def worker_sleep() -> None:  # vLLM's Worker.sleep: suspend, then device calls
            world.backend.suspend(1)
            order.append(("device calls after suspend", None))

        worker_sleep()
        wait_until(
            lambda: len(order) >= 3, 5, "the checkpoint after suspend returned", 0.01, detail=lambda: order
        )
        world.backend.resume()
        assert order == [
            ("wake", False),  # suspend first makes sure CUDA runs (it always does here)
            ("device calls after suspend", None),
            ("sleep", True),  # after Worker.sleep returned, with every pool released
            ("wake", True),  # before resume maps anything back
        ]
        assert world.backend.state() == "RUNNING" and not any(world.asleep())
        assert all(world.read(a) == c for a, c in world.contents.items() if keeps(world.tag(a), 1))
    finally:
        free_world(world)


# -- what the agent shows ---------------------------------------------------------------


def test_the_agent_shows_the_pool_by_tag_with_what_the_level_keeps(world: World) -> None:
    status = world.agent.status()
    assert status["kind"] == "vllm" and status["sleep_driver"] == "vLLM"
    pools = {(p["pool"], p["tag"]): p for p in status["pools"]}
    weights = pools[("vllm-cumem", "weights")]
    assert weights["keep"] is True and weights["count"] == 4
    assert pools[("vllm-cumem", "kv_cache")]["keep"] is False

    world.backend.suspend(2)
    asleep = {p["tag"]: p["keep"] for p in world.agent.status()["pools"]}
    assert asleep["weights"] is False and asleep["runtime"] is True
    world.backend.resume()


def test_the_world_size_comes_from_vllm_then_torch_then_the_environment() -> None:
    assert world_size_from(4, 2, {"WORLD_SIZE": "8"}) == 4
    assert world_size_from(None, 2, {"WORLD_SIZE": "8"}) == 2
    assert world_size_from(None, None, {"WORLD_SIZE": "8"}) == 8
    assert world_size_from(None, None, {"WORLD_SIZE": "zero"}) == 1
    assert world_size_from(None, None, {}) == 1
