"""The one constructor of the orchestrator's Options from CLI flags (cli.options_from_flags).

Every command builds its Options through it, so these pin the mapping the
commands relied on when each built its own: what a flag sets, what a command
without that flag leaves at the default, and which bad value is refused first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hibernate import orchestrator
from hibernate.checkpoint.base import StepTimeouts
from hibernate.errors import UsageError
from hibernate.operation.options import options_from_flags


def test_no_flags_are_the_orchestrator_s_defaults() -> None:
    assert options_from_flags() == orchestrator.Options()


def test_a_sleep_s_flags_land_where_the_orchestrator_reads_them() -> None:
    options = options_from_flags(
        timeout=12.0,
        buffer_mb=64,
        io_mode="direct",
        verify=True,
        checkpointer="binary",
        cuda_checkpoint=Path("/opt/cuda-checkpoint"),
        lock_timeout=12.0,
        level=2,
        drain="abort",
        vllm_url="http://127.0.0.1:8000",
    )
    assert options.quiesce_timeout == options.agent_timeout == 12.0
    assert options.io == orchestrator.IoOptions(buffer_mb=64, io_mode="direct", verify=True)
    assert options.kind_options == {"level": 2, "drain": "abort", "vllm_url": "http://127.0.0.1:8000"}
    assert options.checkpointer_kind == "binary"
    assert options.cuda_checkpoint == "/opt/cuda-checkpoint"
    assert options.cuda_timeouts == StepTimeouts(lock=12.0)
    assert not options.all_users


def test_skipping_the_reuse_check_reaches_the_agents_arguments() -> None:
    assert options_from_flags().io.to_args()["skip_reuse_check"] is False
    options = options_from_flags(skip_reuse_check=True)
    assert options.io == orchestrator.IoOptions(skip_reuse_check=True)
    assert options.io.to_args()["skip_reuse_check"] is True


def test_an_agent_gets_five_seconds_to_answer_even_with_a_zero_timeout() -> None:
    options = options_from_flags(timeout=0.0, lock_timeout=0.0)
    assert options.quiesce_timeout == 0.0 and options.agent_timeout == 5.0
    assert options.cuda_timeouts == StepTimeouts(lock=0.001)  # the driver takes 0 as "no limit"


@pytest.mark.parametrize(
    "scope, expected",
    [
        ({}, False),
        ({"all_users": True}, True),
        ({"job": "123"}, True),
        ({"cgroup": "/sys/fs/cgroup/x"}, True),
    ],
)
def test_job_and_cgroup_selections_imply_all_users(scope: dict[str, object], expected: bool) -> None:
    assert options_from_flags(**scope).all_users is expected  # type: ignore[arg-type]


def test_a_bad_io_mode_is_reported_before_a_bad_checkpointer() -> None:
    with pytest.raises(UsageError, match="--io-mode must be auto, direct or buffered, not 'fast'"):
        options_from_flags(io_mode="fast", checkpointer="magic")
    with pytest.raises(UsageError, match="--checkpointer must be one of"):
        options_from_flags(checkpointer="magic")
    with pytest.raises(UsageError, match="cannot be used with --checkpointer driver"):
        options_from_flags(checkpointer="driver", cuda_checkpoint=Path("/bin/true"))
