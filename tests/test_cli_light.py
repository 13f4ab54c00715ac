"""The CLI starts on machines without torch: importing it and --help never import torch.

Nor does it load the in-process side (the agent's controller, the pools, the
store): a command on a login node or in a scheduler hook only talks to agents.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

PROBE = """
import sys
sys.argv = ["hibernate", *{args!r}]
from hibernate.cli import main
try:
    main()
except SystemExit:
    pass
heavy = sorted(m for m in ("torch", "vllm", "numpy", "aiohttp", "prometheus_client", "hibernate.serve")
               if m in sys.modules)
print("IN-PROCESS:", ",".join(sorted(
    m for m in sys.modules
    if m in ("hibernate.agent.controller", "xxhash") or m.startswith(("hibernate.store", "hibernate.pools"))
)))
print("HEAVY:", ",".join(heavy))
"""


def run_probe(*args: str, line: int = -1) -> str:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=list(args))],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    return out.strip().splitlines()[line].rstrip()


def test_import_does_not_import_torch() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, hibernate.cli; print('torch' in sys.modules, 'vllm' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    ).stdout
    assert out.strip() == "False False"


@pytest.mark.slow
def test_help_of_every_command_does_not_import_torch() -> None:
    for command in (
        [],
        ["sleep"],
        ["wake"],
        ["recover"],
        ["status"],
        ["ls"],
        ["gc"],
        ["export"],
        ["run"],
        ["node-step"],
        ["doctor"],
    ):
        assert run_probe(*command, "--help") == "HEAVY:", command


def test_serve_help_loads_nothing_of_its_extra() -> None:
    # `hibernate serve` lives in an extra (aiohttp, prometheus-client): its help must work without it.
    assert run_probe("serve", "--help") == "HEAVY:"


def test_ls_does_not_import_torch(runtime_dir: Path) -> None:
    assert run_probe("ls") == "HEAVY:"


def test_status_of_a_live_agent_loads_neither_torch_nor_the_in_process_side(
    start_demo: Callable[..., Any],
) -> None:
    demo = start_demo(size_mb=8)
    assert run_probe("status", str(demo.pid), "--json", line=-2) == "IN-PROCESS:"
    assert run_probe("status", str(demo.pid), "--json") == "HEAVY:"


def test_a_sleep_checks_its_numbers_without_loading_the_in_process_side(tmp_path: Path) -> None:
    # pid 999999999 is above any pid_max: the command ends after its option checks ran.
    args = ("sleep", "999999999", "--to", str(tmp_path), "--buffer-mb", "64", "--timeout", "5")
    assert run_probe(*args, line=-2) == "IN-PROCESS:"


def test_the_cli_floor_for_staging_is_above_the_store_s() -> None:
    from hibernate import limits
    from hibernate.store import options

    assert limits.MIN_BUFFER_MB * limits.MIB >= options.MIN_BUFFER_BYTES


def test_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "hibernate", "--version"], capture_output=True, text=True, cwd=REPO
    )
    assert out.returncode == 0 and out.stdout.startswith("hibernate ")
