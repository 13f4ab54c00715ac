"""The small rules behind the vLLM backend: what a level keeps, what a wake maps, where a spill goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.device_allocator import DEFERRABLE_TAGS

from hibernate.agent.controller import SleepDriver, plan_restore, refuse_client_sleep
from hibernate.environ import env_flag
from hibernate.errors import UnsupportedError, UsageError
from hibernate.integrations.vllm import (
    DEFAULT_DEFERRABLE_TAGS,
    rank_from,
    self_checkpoint_requested,
    spill_base,
    staging_args,
    worker_name,
)
from hibernate.pools.vllm import keeps, wakes

VLLM_TAGS = ("weights", "kv_cache", "runtime", "workspace", "cudagraph", "default")


# -- what a sleep keeps ---------------------------------------------------------


def test_level_1_keeps_weights_and_runtime_state_and_drops_kv_cache_and_workspace() -> None:
    kept = {tag for tag in VLLM_TAGS if keeps(tag, 1)}
    assert kept == {"weights", "runtime", "cudagraph", "default"}


def test_level_2_also_drops_weights_which_vllm_reloads() -> None:
    kept = {tag for tag in VLLM_TAGS if keeps(tag, 2)}
    assert kept == {"runtime", "cudagraph", "default"}


def test_a_tag_vllm_may_add_later_is_kept_rather_than_silently_lost() -> None:
    assert keeps("ec_cache", 1) and keeps("ec_cache", 2)


@pytest.mark.parametrize("level", [0, 3, -1, True])
def test_levels_other_than_1_and_2_are_refused(level: int) -> None:
    with pytest.raises(UsageError, match="sleep level"):
        keeps("weights", level)


# -- what a wake maps -----------------------------------------------------------


def test_our_default_deferrable_tags_are_vllms() -> None:
    assert tuple(DEFERRABLE_TAGS) == DEFAULT_DEFERRABLE_TAGS


def test_a_wake_of_everything_maps_every_tag() -> None:
    assert all(wakes(tag, None, DEFERRABLE_TAGS) for tag in VLLM_TAGS)


def test_waking_weights_maps_everything_but_the_kv_cache() -> None:
    woken = {tag for tag in VLLM_TAGS if wakes(tag, ["weights"], DEFERRABLE_TAGS)}
    assert woken == {"weights", "runtime", "workspace", "cudagraph", "default"}


def test_waking_the_kv_cache_maps_everything_but_the_weights() -> None:
    woken = {tag for tag in VLLM_TAGS if wakes(tag, ["kv_cache"], DEFERRABLE_TAGS)}
    assert woken == {"kv_cache", "runtime", "workspace", "cudagraph", "default"}


def test_asking_for_a_non_deferrable_tag_alone_still_defers_both_deferrable_ones() -> None:
    woken = {tag for tag in VLLM_TAGS if wakes(tag, ["runtime"], DEFERRABLE_TAGS)}
    assert woken == {"runtime", "workspace", "cudagraph", "default"}


# -- the controller's restore plan ----------------------------------------------


def test_a_full_restore_of_a_fresh_sleep_brings_back_everything_and_completes() -> None:
    assert plan_restore([True, True, True], [True, True, True]) == ([0, 1, 2], "restore")


def test_a_restore_that_leaves_a_pending_region_behind_is_partial() -> None:
    assert plan_restore([True, True, True], [True, False, True]) == ([0, 2], "restore_part")


def test_regions_already_restored_are_not_restored_again_and_do_not_keep_the_process_asleep() -> None:
    assert plan_restore([False, True, False], [True, True, True]) == ([1], "restore")
    assert plan_restore([False, True, False], [True, False, True]) == ([], "restore_part")


def test_a_plan_needs_one_answer_per_region() -> None:
    with pytest.raises(ValueError):
        plan_restore([True], [True, False])


def test_a_client_may_not_start_the_sleep_of_a_driven_process_but_the_process_may() -> None:
    driver = SleepDriver("vLLM", "POST /sleep")
    refuse_client_sleep(None, False, 7)
    refuse_client_sleep(driver, True, 7)
    with pytest.raises(UnsupportedError, match="process 7 is put to sleep by vLLM") as caught:
        refuse_client_sleep(driver, False, 7)
    assert caught.value.hint == "POST /sleep"


# -- names, directories, environment --------------------------------------------


def test_worker_directories_carry_the_rank_when_known_and_always_the_pid() -> None:
    assert worker_name(3, 1234) == "vllm-rank3-pid1234"
    assert worker_name(None, 1234) == "vllm-pid1234"


def test_the_rank_comes_from_torch_distributed_then_from_rank_env() -> None:
    assert rank_from(2, {"RANK": "5"}) == 2
    assert rank_from(None, {"RANK": "5"}) == 5
    assert rank_from(None, {"RANK": "x"}) is None
    assert rank_from(None, {}) is None


def test_the_spill_base_is_configured_then_env_then_a_per_user_cache(tmp_path: Path) -> None:
    configured = tmp_path / "configured"
    assert spill_base(configured, {"HIBERNATE_DIR": "/elsewhere"}) == configured
    assert spill_base(None, {"HIBERNATE_DIR": str(tmp_path / "env")}) == tmp_path / "env"
    assert spill_base(None, {"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "hibernate"
    assert spill_base(None, {"HOME": str(tmp_path)}) == tmp_path / ".cache" / "hibernate"


def test_yes_no_variables_refuse_what_they_cannot_read() -> None:
    assert env_flag({"X": "1"}, "X") and env_flag({"X": "yes"}, "X")
    assert not env_flag({}, "X") and not env_flag({"X": "0"}, "X") and not env_flag({"X": ""}, "X")
    with pytest.raises(UsageError, match="X='maybe'"):
        env_flag({"X": "maybe"}, "X")


def test_staging_budget_and_chunk_size_come_from_the_environment_validated() -> None:
    assert staging_args({}) == {}
    assert staging_args({"HIBERNATE_BUFFER_MB": "64", "HIBERNATE_CHUNK_MB": "8"}) == {
        "buffer_mb": 64,
        "chunk_mb": 8,
    }
    with pytest.raises(UsageError, match="whole number"):
        staging_args({"HIBERNATE_BUFFER_MB": "1.5"})
    with pytest.raises(UsageError, match=r"HIBERNATE_CHUNK_MB.*between 4 KiB and 1 GiB"):
        staging_args({"HIBERNATE_CHUNK_MB": "2048"})


def test_the_staging_each_worker_keeps_comes_from_the_environment_validated() -> None:
    assert staging_args({"HIBERNATE_KEEP_STAGING_MB": "512"}) == {"keep_staging_mb": 512}
    for bad in ("lots", "-1", "\u00b2"):  # a superscript two is a digit to str.isdigit, not a number
        with pytest.raises(UsageError, match=r"HIBERNATE_KEEP_STAGING_MB=.* is not a size in MiB"):
            staging_args({"HIBERNATE_KEEP_STAGING_MB": bad})


def test_verification_is_asked_for_through_the_environment() -> None:
    assert staging_args({"HIBERNATE_VERIFY": "1"}) == {"verify": True}
    assert staging_args({"HIBERNATE_VERIFY": "0"}) == {"verify": False}
    with pytest.raises(UsageError):
        staging_args({"HIBERNATE_VERIFY": "perhaps"})


def test_the_reuse_check_is_skipped_through_the_environment() -> None:
    assert staging_args({"HIBERNATE_SKIP_REUSE_CHECK": "1"}) == {"skip_reuse_check": True}
    assert staging_args({"HIBERNATE_SKIP_REUSE_CHECK": "no"}) == {"skip_reuse_check": False}
    with pytest.raises(UsageError, match="HIBERNATE_SKIP_REUSE_CHECK='later'"):
        staging_args({"HIBERNATE_SKIP_REUSE_CHECK": "later"})


@pytest.mark.parametrize(
    "io, refusal, hint",
    [
        ({"verify": True}, "--verify does not reach", "HIBERNATE_VERIFY=1"),
        (
            {"skip_reuse_check": True},
            r"--skip-reuse-check \(or HIBERNATE_SKIP_REUSE_CHECK\) does not reach",
            "HIBERNATE_SKIP_REUSE_CHECK=1",
        ),
    ],
)
def test_an_io_option_is_refused_for_a_vllm_server_whose_workers_it_cannot_reach(
    io: dict[str, Any], refusal: str, hint: str
) -> None:
    import os

    from hibernate import orchestrator, procinfo
    from hibernate.flows.vllm import VllmServerUnit
    from hibernate.flows.vllm_api import VllmServer, parse_url
    from hibernate.flows.vllm_processes import Server
    from hibernate.operation.targets import Target
    from hibernate.operation.unit import Context

    options = orchestrator.Options(io=orchestrator.IoOptions(**io))
    address = parse_url("http://127.0.0.1:9")
    identity = procinfo.identity(os.getpid())
    assert identity is not None
    server = Server(
        os.getpid(), identity, Target(os.getpid(), [os.getpid()]), address, VllmServer(address, 1.0)
    )
    unit = VllmServerUnit(Context("sleep", options, orchestrator.ProgressSink()), server)
    with pytest.raises(UsageError, match=f"{refusal} a vLLM server's workers") as caught:
        unit.check()  # before any lock, any request to the server
    assert caught.value.hint == f"start the server with {hint} in its environment"


def test_self_checkpoint_is_asked_for_with_a_clear_yes() -> None:
    assert not self_checkpoint_requested({})
    assert not self_checkpoint_requested({"HIBERNATE_SELF_CHECKPOINT": "0"})
    assert self_checkpoint_requested({"HIBERNATE_SELF_CHECKPOINT": "1"})
    with pytest.raises(UsageError, match="HIBERNATE_SELF_CHECKPOINT='sometimes'"):
        self_checkpoint_requested({"HIBERNATE_SELF_CHECKPOINT": "sometimes"})
    # Where raising would stop vLLM from starting (the plugin), an unclear value means no.
    assert not self_checkpoint_requested({"HIBERNATE_SELF_CHECKPOINT": "sometimes"}, strict=False)
