"""Both checkpointers against the stand-in driver: the real contract, transition by transition.

These pin what the stand-ins do (and so what every other CUDA test relies on)
to the documented behaviour of the driver and of cuda-checkpoint: states and
their transitions, CUresult codes and strings, the 8-bit exit status, the lock
timeout that leaves a process running, the restore that runs out of memory and
wedges it, cuInit before restore, the GPU map of CUDA 13.0, old drivers.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hibernate.checkpoint import nvml
from hibernate.checkpoint.base import Checkpointer, CheckpointStepError, CudaState, StepTimeouts
from hibernate.checkpoint.binary import BinaryCheckpointer, BinaryUnavailable
from hibernate.checkpoint.driver import DriverCheckpointer, DriverUnavailable
from hibernate.checkpoint.selection import choose
from tests.standins.world import GIB, World, spec


def make(kind: str, timeouts: StepTimeouts | None = None) -> Checkpointer:
    return (
        DriverCheckpointer(timeouts=timeouts) if kind == "driver" else BinaryCheckpointer(timeouts=timeouts)
    )


@pytest.fixture
def sleeper() -> Iterator[int]:
    proc = subprocess.Popen(["sleep", "600"])
    yield proc.pid
    proc.kill()
    proc.wait()


def code_of(excinfo: pytest.ExceptionInfo[CheckpointStepError]) -> int | None:
    return excinfo.value.error.code


def test_full_cycle_and_its_transitions(world: World, checkpointer_kind: str, sleeper: int) -> None:
    world.register(sleeper, nbytes=3 * GIB)
    cp = make(checkpointer_kind)

    def free() -> int:
        snapshot = nvml.read_gpus()
        assert snapshot is not None
        return snapshot.gpus[0].free

    assert cp.state(sleeper) is CudaState.RUNNING
    on_gpu = free()
    cp.lock(sleeper, 1000)
    assert cp.state(sleeper) is CudaState.LOCKED
    with pytest.raises(CheckpointStepError) as twice:
        cp.lock(sleeper, 1000)
    assert (
        code_of(twice) == 401
        and "the operation cannot be performed in the present state" in twice.value.message
    )
    cp.checkpoint(sleeper)
    assert cp.state(sleeper) is CudaState.CHECKPOINTED
    assert free() == on_gpu + 3 * GIB  # a checkpointed process holds no GPU memory
    with pytest.raises(CheckpointStepError) as early:
        cp.unlock(sleeper)
    assert code_of(early) == 401
    cp.restore(sleeper)
    assert cp.state(sleeper) is CudaState.LOCKED  # restore ends LOCKED: unlock is separate
    cp.unlock(sleeper)
    assert cp.state(sleeper) is CudaState.RUNNING
    assert cp.restore_thread_id(sleeper) == sleeper
    steps = [(c, s) for c, s, _, r in world.calls() if r == "CUDA_SUCCESS"]
    assert steps == [(checkpointer_kind, s) for s in ("lock", "checkpoint", "restore", "unlock")]


def test_lock_timeout_fails_and_leaves_the_process_running(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    world.register(sleeper)
    cp = make(checkpointer_kind)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIBERNATE_STANDIN_FAULTS", spec(("lock", sleeper, "hang")))
        started = time.monotonic()
        with pytest.raises(CheckpointStepError) as timed_out:
            cp.lock(sleeper, 300)
        assert 0.25 < time.monotonic() - started < 5
    assert code_of(timed_out) == 600 and not timed_out.value.timed_out  # the driver's own timeout
    assert world.state(sleeper) == "running"


def test_restore_out_of_memory_stays_checkpointed_and_wedges(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    world.register(sleeper, nbytes=8 * GIB)
    cp = make(checkpointer_kind)
    cp.lock(sleeper, 1000)
    cp.checkpoint(sleeper)
    world.set_other_use(0, 75 * GIB)  # another job took the GPU meanwhile
    with pytest.raises(CheckpointStepError) as oom:
        cp.restore(sleeper)
    assert code_of(oom) == 2 and "out of memory" in oom.value.message
    assert world.state(sleeper) == "checkpointed" and world.wedged(sleeper)
    world.set_other_use(0, 0)
    with pytest.raises(CheckpointStepError) as later:  # NVIDIA/cuda-checkpoint#44
        cp.restore(sleeper)
    assert code_of(later) == 304
    assert world.state(sleeper) == "checkpointed"


def test_failed_state_and_processes_that_are_not_cuda(
    world: World, checkpointer_kind: str, sleeper: int
) -> None:
    cp = make(checkpointer_kind)
    with pytest.raises(CheckpointStepError) as not_cuda:
        cp.state(sleeper)  # not registered: no CUDA state
    assert code_of(not_cuda) == 1
    world.register(sleeper, state="failed")
    assert cp.state(sleeper) is CudaState.FAILED
    for step in (lambda: cp.lock(sleeper, 100), lambda: cp.restore(sleeper), lambda: cp.unlock(sleeper)):
        with pytest.raises(CheckpointStepError) as refused:
            step()
        assert code_of(refused) == 401


@pytest.mark.parametrize(
    "code", ["CUDA_ERROR_OPERATING_SYSTEM", "CUDA_ERROR_NOT_PERMITTED", "CUDA_ERROR_NOT_SUPPORTED"]
)
def test_injected_failure_reaches_the_caller_exactly(
    world: World, checkpointer_kind: str, sleeper: int, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.register(sleeper)
    cp = make(checkpointer_kind)
    cp.lock(sleeper, 1000)
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("checkpoint", sleeper, code)))
    with pytest.raises(CheckpointStepError) as failed:
        cp.checkpoint(sleeper)
    assert (
        failed.value.error.name == code and failed.value.pid == sleeper and failed.value.step == "checkpoint"
    )
    assert world.state(sleeper) == "locked"


def test_binary_exit_status_is_the_code_truncated_to_8_bits(world: World, sleeper: int) -> None:
    world.register(sleeper)
    run = subprocess.run(
        [str(world.built.binary), "--action", "unlock", "--pid", str(sleeper)], capture_output=True, text=True
    )
    assert run.returncode == 401 & 0xFF == 145
    assert run.stderr.strip() == (
        f'Could not unlock on process ID {sleeper}: "the operation cannot be performed in the present state"'
    )
    toggle = [str(world.built.binary), "--toggle", "--pid", str(sleeper)]
    subprocess.run(toggle, check=True)
    assert world.state(sleeper) == "checkpointed"
    subprocess.run(toggle, check=True)
    assert world.state(sleeper) == "running"


def test_restore_onto_another_gpu(world: World, checkpointer_kind: str, sleeper: int) -> None:
    second = world.add_gpu()
    world.register(sleeper, gpu=0)
    cp = make(checkpointer_kind)
    cp.lock(sleeper, 1000)
    cp.checkpoint(sleeper)
    with pytest.raises(CheckpointStepError) as incomplete:  # the map must name every checkpointed GPU
        cp.restore(sleeper, {second.uuid: world.gpus[0].uuid})
    assert code_of(incomplete) == 1
    cp.restore(sleeper, {world.gpus[0].uuid: second.uuid})
    assert world.gpu_of(sleeper) == 1 and world.state(sleeper) == "locked"


RESTORE_WITHOUT_INIT = """
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
pid = int(sys.argv[2])
for f in ("cuCheckpointProcessLock", "cuCheckpointProcessCheckpoint", "cuCheckpointProcessRestore"):
    getattr(lib, f).argtypes = [ctypes.c_int, ctypes.c_void_p]
assert lib.cuCheckpointProcessLock(pid, None) == 0
assert lib.cuCheckpointProcessCheckpoint(pid, None) == 0
print(lib.cuCheckpointProcessRestore(pid, None))
"""


def test_restore_needs_cuinit_or_persistence_mode(world: World, sleeper: int) -> None:
    world.gpus[0].persistence = False
    world.set_other_use(0, 0)  # rewrite the GPU file with persistence off
    world.register(sleeper)
    bare = subprocess.run(
        [sys.executable, "-c", RESTORE_WITHOUT_INIT, str(world.built.libcuda), str(sleeper)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert bare.stdout.strip() == "3"  # CUDA_ERROR_NOT_INITIALIZED
    for cp in (DriverCheckpointer(), BinaryCheckpointer()):  # both call cuInit(0) first
        cp.restore(sleeper)
        assert world.state(sleeper) == "locked"
        cp.checkpoint(sleeper)
    inits = [c for c in world.calls(steps=("init",)) if c[0] == "driver"]
    assert inits and inits[0][3] == "CUDA_SUCCESS"


def test_a_checkpoint_that_hangs_runs_on_past_its_timeout_and_is_not_killed(
    world: World, checkpointer_kind: str, sleeper: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    world.register(sleeper)
    cp = make(checkpointer_kind, StepTimeouts(checkpoint=0.5))
    cp.lock(sleeper, 1000)
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("checkpoint", None, "hang")))
    monkeypatch.setenv("HIBERNATE_STANDIN_HANG_S", "3")
    started = time.monotonic()
    with pytest.raises(CheckpointStepError) as hung:
        cp.checkpoint(sleeper)
    assert hung.value.timed_out and time.monotonic() - started < 2
    assert hung.value.running is not None  # a checkpoint is never killed: it runs on in its own process
    assert world.state(sleeper) == "locked"
    # Let it return here, not in the next test.
    world.wait_for_call("checkpoint", sleeper)


def test_an_abandoned_call_logs_into_the_world_it_started_in(
    world: World, sleeper: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What keeps a test's stray driver call out of the next test's world (it once failed CI)."""
    world.register(sleeper)
    cp = make("driver", StepTimeouts(unlock=0.3))
    cp.lock(sleeper, 1000)
    monkeypatch.setenv("HIBERNATE_STANDIN_FAULTS", spec(("unlock", None, "hang")))
    monkeypatch.setenv("HIBERNATE_STANDIN_HANG_S", "1.5")
    with pytest.raises(CheckpointStepError) as hung:
        cp.unlock(sleeper)  # an unlock is waited for in a thread of this process, abandoned on timeout
    assert hung.value.timed_out and hung.value.running is None
    later = World(world.built, tmp_path / "later")  # what the next test would set up meanwhile
    monkeypatch.setenv("HIBERNATE_STANDIN_DIR", str(later.dir))
    world.wait_for_call("unlock", sleeper)
    assert later.calls() == []


def test_old_drivers_are_refused_with_the_version_they_lack(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HIBERNATE_LIBCUDA", str(world.built.libcuda_old))
    monkeypatch.setenv("HIBERNATE_STANDIN_CUDA_VERSION", "12040")
    with pytest.raises(DriverUnavailable, match=r"CUDA 12\.4\) has no cuCheckpointProcessLock.*570"):
        DriverCheckpointer()
    with pytest.raises(BinaryUnavailable, match="only --toggle"):  # R550's binary
        BinaryCheckpointer()
    monkeypatch.setenv("HIBERNATE_STANDIN_CUDA_VERSION", "12020")
    with pytest.raises(BinaryUnavailable, match="Insufficient driver"):
        BinaryCheckpointer()
    monkeypatch.setenv("HIBERNATE_STANDIN_CUDA_VERSION", "12080")
    assert not BinaryCheckpointer().capabilities.device_map  # --device-map is R580's
    monkeypatch.setenv("HIBERNATE_LIBCUDA", str(world.built.libcuda))
    driver = DriverCheckpointer()
    assert driver.describe()["cuda_version"] == "12.8" and not driver.supports_gpu_map


def test_auto_prefers_the_binary_below_the_validated_driver_api(
    world: World, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HIBERNATE_STANDIN_CUDA_VERSION", "12080")  # driver 570: the API is there
    chosen, passed_over = choose("auto")
    assert isinstance(chosen, BinaryCheckpointer)
    assert passed_over == [
        "driver API: CUDA 12.8 is below 13.0 (driver 580), where it is not validated; "
        "the binary is preferred there"
    ]
    explicit, _ = choose("driver")  # asked for by name, it is used
    assert isinstance(explicit, DriverCheckpointer)
    monkeypatch.setenv("HIBERNATE_CUDA_CHECKPOINT", str(tmp_path / "none-here"))
    monkeypatch.setenv("PATH", str(tmp_path))
    fallback, passed_over = choose("auto")  # no binary: the driver API all the same, and why
    assert isinstance(fallback, DriverCheckpointer)
    assert passed_over[0].startswith("cuda-checkpoint binary, preferred where CUDA 12.8 is below 13.0")
    monkeypatch.setenv("HIBERNATE_STANDIN_CUDA_VERSION", "13000")
    monkeypatch.setenv("HIBERNATE_CUDA_CHECKPOINT", world.env["HIBERNATE_CUDA_CHECKPOINT"])
    current, passed_over = choose("auto")
    assert isinstance(current, DriverCheckpointer) and passed_over == []


def test_missing_binary_and_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HIBERNATE_LIBCUDA", str(tmp_path / "nowhere" / "libcuda.so.1"))
    monkeypatch.delenv("HIBERNATE_CUDA_CHECKPOINT", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(DriverUnavailable, match="cannot load"):
        DriverCheckpointer()
    with pytest.raises(BinaryUnavailable, match="no cuda-checkpoint executable"):
        BinaryCheckpointer()
    (tmp_path / "cuda-checkpoint").write_text("not executable")
    with pytest.raises(BinaryUnavailable, match="no cuda-checkpoint executable"):
        BinaryCheckpointer()  # PATH lookup skips what cannot run
    with pytest.raises(BinaryUnavailable, match="not an executable"):
        BinaryCheckpointer(tmp_path / "cuda-checkpoint")
