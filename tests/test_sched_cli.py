"""The CLI for scripts and logs: --quiet where a log wants silence, and node-step's bad input."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import REPO, spill_root_of


def test_gc_quiet_prints_nothing_when_it_succeeds(cli: Callable[..., Any], work_dir: Path) -> None:
    loud = cli("gc", str(work_dir))
    quiet = cli("gc", str(work_dir), "--quiet")
    assert loud.returncode == quiet.returncode == 0
    assert "total freed" in loud.stdout and quiet.stdout == ""


def test_gc_quiet_still_reports_a_failure(cli: Callable[..., Any], work_dir: Path) -> None:
    result = cli("gc", str(work_dir / "missing"), "-q")
    assert result.returncode != 0 and "error" in result.stderr


def test_doctor_quiet_shows_only_what_is_not_ok(cli: Callable[..., Any]) -> None:
    bare = {"HIBERNATE_LIBCUDA": "/nonexistent/libcuda.so.1", "HIBERNATE_CUDA_CHECKPOINT": "/nonexistent"}
    full = cli("doctor", env=bare)
    quiet = cli("doctor", "--quiet", env=bare)
    assert full.returncode == quiet.returncode
    assert "ok   platform" in full.stdout and "platform" not in quiet.stdout
    assert "warn driver" in quiet.stdout  # no driver on this machine: a warning stays


@pytest.mark.parametrize(
    "args, words",
    [
        (["hover", "--barrier", "/tmp"], "must be sleep or wake"),
        (["sleep", "--barrier", "/tmp", "--all", "--nodes", "1", "--node-index", "0"], "needs --to DIR"),
        (["wake", "--barrier", "/tmp", "--all", "--node-index", "0"], "--nodes is not known here"),
        (["wake", "--barrier", "/tmp", "--all", "--nodes", "2", "--node-index", "2"], "outside 0..1"),
        (
            [
                "wake",
                "--barrier",
                "/nonexistent",
                "--barrier-timeout",
                "0.5",
                "--all",
                "--nodes",
                "1",
                "--node-index",
                "0",
            ],
            "not a directory",
        ),
        (
            ["wake", "--barrier", "/tmp", "--all", "--nodes", "1", "--node-index", "0", "--node-name", "a/b"],
            "a file",
        ),
    ],
)
def test_node_step_refuses_bad_input_before_touching_anything(
    cli: Callable[..., Any], args: list[str], words: str
) -> None:
    env = {"SLURM_STEP_NUM_NODES": "", "SLURM_NNODES": "", "SLURM_NODEID": ""}
    result = cli("node-step", *args, env=env)
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert words in result.stderr


def test_node_step_takes_its_place_from_srun_s_environment(
    cli: Callable[..., Any], start_demo: Callable[..., Any], tmp_path: Path
) -> None:
    demo = start_demo(size_mb=16)
    env = {"SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu-07"}
    result = cli(
        "node-step", "sleep", str(demo.pid), "--barrier", str(tmp_path), "--to", str(tmp_path), env=env
    )
    assert result.returncode == 0, result.stderr
    assert "node 0 (gpu-07): ok" in result.stdout and "commit" in result.stdout
    assert spill_root_of(tmp_path / "gpu-07", demo.pid).is_dir()
    assert cli("wake", str(demo.pid), "-q").returncode == 0


@pytest.mark.parametrize("args", [["node-step", "--help"], ["sleep", "--job", "12_3", "--to", "/tmp/unused"]])
def test_scheduler_paths_do_not_import_torch(args: list[str]) -> None:
    """Scheduler hooks run on nodes where torch may be missing or slow to import."""
    probe = (
        "import sys\n"
        f"sys.argv = ['hibernate', *{args!r}]\n"
        "from hibernate.cli import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "import hibernate.sched.nodestep, hibernate.sched.selectors\n"
        "print('HEAVY', sorted(m for m in ('torch', 'numpy', 'vllm') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO)
    assert result.stdout.strip().splitlines()[-1] == "HEAVY []", result.stderr


def test_node_step_takes_the_cuda_flags_a_job_forwards(
    cli: Callable[..., Any], start_demo: Callable[..., Any], tmp_path: Path
) -> None:
    # hibernate-job forwards what follows `--` to every node's node-step: --no-cuda and --force too.
    demo = start_demo(size_mb=16)
    env = {"SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu-07"}
    result = cli(
        "node-step", "sleep", str(demo.pid), "--barrier", str(tmp_path), "--to", str(tmp_path),
        "--no-cuda", "--force", "--json", env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.json()["report"]["cuda"]["status"] == "left on the GPU (--checkpointer none)"
    assert cli("wake", str(demo.pid), "-q").returncode == 0


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_node_steps_re_sleep_skips_the_reuse_check_as_sleep_does(
    cli: Callable[..., Any], start_demo: Callable[..., Any], tmp_path: Path, how: str
) -> None:
    demo = start_demo(size_mb=16)
    env = {"SLURM_STEP_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURMD_NODENAME": "gpu-07"}
    step = ["node-step", "sleep", str(demo.pid), "--to", str(tmp_path / "snap"), "--json"]
    (tmp_path / "b1").mkdir()
    (tmp_path / "b2").mkdir()  # a barrier directory each: a step's agreement stays in it
    first = cli(*step, "--barrier", str(tmp_path / "b1"), env=env)
    assert first.returncode == 0, first.stderr
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    extra, skip_env = (
        (["--skip-reuse-check"], {}) if how == "flag" else ([], {"HIBERNATE_SKIP_REUSE_CHECK": "1"})
    )
    again = cli(*step, *extra, "--barrier", str(tmp_path / "b2"), env={**env, **skip_env})
    assert again.returncode == 0, again.stderr
    (process,) = again.json()["report"]["processes"]
    assert process["reused_unread_bytes"] == process["reused_bytes"] > 0
    assert process["reuse_read_bytes"] == 0
    assert cli("wake", str(demo.pid), "-q").returncode == 0
