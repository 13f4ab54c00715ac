"""The pure decisions of the CUDA stage, each on its own: error identification, plans, checks, structs."""

from __future__ import annotations

import ctypes

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hibernate.checkpoint import curesult
from hibernate.checkpoint.base import CheckpointStepError, CudaState, StepTimeouts, cuda_version_text
from hibernate.checkpoint.binary import parse_help
from hibernate.checkpoint.curesult import CuError, from_code, identify
from hibernate.checkpoint.detect import Holder
from hibernate.checkpoint.driver import uuid_bytes
from hibernate.checkpoint.driver_call import CheckpointArgs, GpuPair, LockArgs, RestoreArgs, UnlockArgs
from hibernate.checkpoint.group import Plan, check_sleepable, classify, memory_shortfalls, recovery_plan
from hibernate.checkpoint.nccl import nccl_traps
from hibernate.doctor.disk import mount_for
from hibernate.doctor.machine import ptrace_verdict
from hibernate.errors import (
    BusyError,
    CudaCheckpointError,
    ExitCode,
    HibernateTimeoutError,
    NeedsRecoveryError,
    UnsupportedError,
    UsageError,
    WrongStateError,
)
from hibernate.procinfo import ProcessIdentity

# -- CUresult from a cuda-checkpoint run --------------------------------------


def test_quoted_driver_string_and_truncated_exit_status_agree() -> None:
    out = 'Could not checkpoint on process ID 42: "OS call failed or operation not supported on this OS"'
    assert identify(304 & 0xFF, out) == from_code(304)
    assert (
        identify(
            401 & 0xFF,
            'Could not lock on process ID 1: "the operation cannot be performed in the present state"',
        ).name
        == "CUDA_ERROR_ILLEGAL_STATE"
    )


def test_exit_status_alone_is_not_trusted_when_ambiguous() -> None:
    # 1 (INVALID_VALUE) and no other known code truncate to 1: the status alone decides.
    assert identify(1, "").code == 1
    # An unknown text with a status matching a known code is not forced into that code.
    unknown = identify(2, 'Could not restore on process ID 3: "something new"')
    assert unknown.code is None and unknown.text == "something new"


def test_text_that_contradicts_the_exit_status_is_not_believed() -> None:
    error = identify(5, 'Error: "out of memory"')  # 2 would exit 2, not 5
    assert error.code is None


def test_out_of_memory_by_text() -> None:
    assert identify(2, 'Could not restore on process ID 9: "out of memory"') == from_code(2)


@given(st.sampled_from(sorted(c for c in curesult.KNOWN if c)))
def test_every_known_code_is_identified_from_what_the_binary_prints(code: int) -> None:
    name, text = curesult.KNOWN[code]
    found = identify(code & 0xFF, f'Could not lock on process ID 7: "{text}"')
    assert found.code == code and found.name == name


def test_cuerror_text_names_code_and_words() -> None:
    assert str(from_code(2)) == "CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
    assert str(CuError(None, "no answer", "x")) == "no answer: x"
    assert curesult.code_for_name("CUDA_ERROR_NOT_READY") == 600
    assert curesult.code_for_name("304") == 304


# -- help probing ---------------------------------------------------------------

R550_HELP = """CUDA checkpoint and restore utility.
Toggles the state of CUDA within a process between suspended and running.
Version 550.54.09. Copyright (C) 2024 NVIDIA Corporation. All rights reserved.

    --toggle --pid <value>
"""
R570_HELP = """CUDA checkpoint and restore utility.
Version 570.86.10. Copyright (C) 2025 NVIDIA Corporation. All rights reserved.
--get-state --pid <pid>
--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]
--toggle --pid <pid>
--get-restore-tid --pid <pid>
"""


def test_help_of_r550_has_toggle_only() -> None:
    caps = parse_help(R550_HELP)
    assert caps.version == "550.54.09" and caps.toggle
    assert not caps.actions and not caps.get_state and not caps.device_map


def test_help_of_r570_has_actions_and_timeout_not_device_map() -> None:
    caps = parse_help(R570_HELP)
    assert (caps.version, caps.actions, caps.lock_timeout, caps.restore_tid, caps.device_map) == (
        "570.86.10",
        True,
        True,
        True,
        False,
    )
    assert parse_help(R570_HELP + "--device-map <old>=<new>\n").device_map


# -- driver structs -------------------------------------------------------------


def test_argument_structs_are_64_bytes_with_the_documented_layout() -> None:
    for struct in (LockArgs, CheckpointArgs, RestoreArgs, UnlockArgs):
        assert ctypes.sizeof(struct) == 64
    assert (
        LockArgs.timeoutMs.offset == 0 and LockArgs.reserved0.offset == 4 and LockArgs.reserved1.offset == 8
    )
    assert RestoreArgs.gpuPairs.offset == 0 and RestoreArgs.gpuPairsCount.offset == 8
    assert ctypes.sizeof(GpuPair) == 32 and GpuPair.newUuid.offset == 16
    assert bytes(LockArgs()) == bytes(64)  # all zero: default behaviour


def test_gpu_uuid_text_to_bytes() -> None:
    assert (
        uuid_bytes("GPU-00000001-1111-2222-3333-444455556667").hex()
        == "0000000111112222333344445555" + "6667"
    )
    with pytest.raises(UsageError):
        uuid_bytes("GPU-nope")


def test_versions_and_timeouts() -> None:
    assert cuda_version_text(12080) == "12.8" and cuda_version_text(13000) == "13.0"
    timeouts = StepTimeouts(lock=5)
    assert timeouts.for_step("lock") == 5 and timeouts.for_step("state") == timeouts.query


# -- recovery plan ------------------------------------------------------------

STATE_OR_NONE = st.one_of(st.none(), st.sampled_from(list(CudaState)))


def test_recovery_plan_restores_checkpointed_and_unlocks_locked() -> None:
    plan = recovery_plan(
        {
            1: CudaState.RUNNING,
            2: CudaState.LOCKED,
            3: CudaState.CHECKPOINTED,
            4: CudaState.FAILED,
            5: CudaState.RESTORING,
            6: None,
        }
    )
    assert plan == Plan(restore=(3,), unlock=(2, 3), failed=(4,), busy=(5,), unknown=(6,))
    assert recovery_plan({1: CudaState.RUNNING}).empty


@given(st.dictionaries(st.integers(1, 10_000), STATE_OR_NONE, max_size=12))
def test_recovery_plan_leads_every_process_to_running_or_names_it(
    states: dict[int, CudaState | None],
) -> None:
    plan = recovery_plan(states)
    # Apply the plan to the states: restore moves checkpointed to locked, unlock locked to running.
    after = dict(states)
    for pid in plan.restore:
        assert after[pid] is CudaState.CHECKPOINTED
        after[pid] = CudaState.LOCKED
    for pid in plan.unlock:
        assert after[pid] is CudaState.LOCKED
        after[pid] = CudaState.RUNNING
    named = set(plan.failed) | set(plan.busy) | set(plan.unknown)
    for pid, state in after.items():
        assert state is CudaState.RUNNING or pid in named
    assert list(plan.restore) == [p for p in states if states[p] is CudaState.CHECKPOINTED]  # order kept


# -- memory pre-check -----------------------------------------------------------


def test_memory_shortfall_sums_processes_sharing_a_gpu() -> None:
    needs = {1: {"GPU-a": 4 << 30}, 2: {"GPU-a": 4 << 30, "GPU-b": 1 << 30}}
    short = memory_shortfalls(needs, {"GPU-a": 8 << 30, "GPU-b": 10 << 30}, headroom=1 << 20)
    assert [(s.uuid, s.pids) for s in short] == [("GPU-a", (1, 2))]
    assert short[0].needed == (8 << 30) + (2 << 20)
    assert short[0].describe() == "GPU-a has 8.0 GiB free; processes 1, 2 need 8.0 GiB there: 2.0 MiB missing"
    assert memory_shortfalls(needs, {"GPU-a": 9 << 30, "GPU-b": 2 << 30}, headroom=1 << 20) == []


def test_memory_shortfall_for_a_gpu_not_on_this_machine() -> None:
    (short,) = memory_shortfalls({7: {"GPU-gone": 1}}, {"GPU-a": 1 << 40}, headroom=0)
    assert short.free is None and "not on this machine" in short.describe()


# -- classification -------------------------------------------------------------


def step_error(step: str, code: int | None, timed_out: bool = False) -> CheckpointStepError:
    error = from_code(code) if code is not None else CuError(None, "no answer", "slow")
    return CheckpointStepError(42, step, error, how="cuCheckpointProcessX", timed_out=timed_out)


@pytest.mark.parametrize(
    ("step", "code", "timed_out", "kind", "exit_code"),
    [
        ("lock", 600, False, HibernateTimeoutError, ExitCode.TIMEOUT),  # NOT_READY: lock timeout
        ("lock", 909, False, HibernateTimeoutError, ExitCode.TIMEOUT),
        ("checkpoint", None, True, HibernateTimeoutError, ExitCode.TIMEOUT),
        ("restore", 2, False, NeedsRecoveryError, ExitCode.NEEDS_RECOVERY),  # OOM wedges the process
        ("restore", 304, False, NeedsRecoveryError, ExitCode.NEEDS_RECOVERY),
        ("checkpoint", 801, False, UnsupportedError, ExitCode.UNSUPPORTED),
        ("lock", 800, False, CudaCheckpointError, ExitCode.CUDA_CHECKPOINT),
        ("unlock", 401, False, CudaCheckpointError, ExitCode.CUDA_CHECKPOINT),
        ("checkpoint", 304, False, CudaCheckpointError, ExitCode.CUDA_CHECKPOINT),
    ],
)
def test_classify_gives_each_failure_its_exit_code(
    step: str, code: int | None, timed_out: bool, kind: type, exit_code: ExitCode
) -> None:
    error = classify(step_error(step, code, timed_out), "; undone")
    assert type(error) is kind and error.exit_code == exit_code
    assert error.message.startswith(f"process 42 ({step}): ") and error.message.endswith("; undone")
    assert error.hint


def holder(pid: int, state: CudaState | None) -> Holder:
    return Holder(ProcessIdentity(pid, 1), [], state)


def test_check_sleepable_refuses_before_anything_changes() -> None:
    check_sleepable([holder(1, CudaState.RUNNING), holder(2, None)])
    with pytest.raises(WrongStateError, match="process 2 is CUDA-checkpointed") as wrong:
        check_sleepable([holder(1, CudaState.RUNNING), holder(2, CudaState.CHECKPOINTED)])
    assert "hibernate wake 2" in (wrong.value.hint or "")
    with pytest.raises(CudaCheckpointError, match="failed state"):
        check_sleepable([holder(1, CudaState.FAILED)])
    with pytest.raises(BusyError):
        check_sleepable([holder(1, CudaState.CHECKPOINTING)])


# -- doctor helpers -------------------------------------------------------------


def test_nccl_traps() -> None:
    safe = {"NCCL_P2P_DISABLE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_SHM_DISABLE": "1"}
    assert nccl_traps(safe, "python train.py", infiniband=False) == []
    traps = nccl_traps({}, "python -m vllm.entrypoints.openai.api_server", infiniband=True)
    assert (
        len(traps) == 6
        and any("custom all-reduce" in t for t in traps)
        and any("VLLM_ALLREDUCE_USE_SYMM_MEM" in t for t in traps)
        and any("InfiniBand" in t for t in traps)
    )
    vllm_safe = {**safe, "NCCL_IB_DISABLE": "1", "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}
    assert nccl_traps(vllm_safe, "vllm serve --disable-custom-all-reduce", True) == []


def test_mount_for_takes_the_longest_mount_point() -> None:
    mounts = [("/", "ext4"), ("/tmp", "tmpfs"), ("/tmpdata", "xfs"), ("/tmp/x", "nfs")]
    assert mount_for("/tmp/a", mounts) == ("/tmp", "tmpfs")
    assert mount_for("/tmpdata/a", mounts) == ("/tmpdata", "xfs")
    assert mount_for("/tmp/x/y", mounts) == ("/tmp/x", "nfs")
    assert mount_for("/home", mounts) == ("/", "ext4")


def test_ptrace_verdict() -> None:
    assert ptrace_verdict(None, False)[0] == "ok"
    assert ptrace_verdict(1, False)[0] == "ok"
    assert ptrace_verdict(2, True)[0] == "ok"
    assert ptrace_verdict(3, False)[0] == "warn"
