"""scripts/lib/venv.sh, which ./scripts/demo, ./scripts/test and ./scripts/lint run first: its first
install takes minutes, so it says what each step installs and how long the one before took, and
installs exactly what it always did.

Its pip is a stand-in that records what it is asked (a real install takes minutes and the network):
the steps, their order and their pins are read from those calls.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO

# The stand-in for the virtual environment's python: records each `-m pip install ...` call, does nothing.
RECORDING_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls"
"""


def ensure_venv(venv: Path) -> subprocess.CompletedProcess[str]:
    """venv.sh's ensure_venv, as the scripts run it, into ``venv``."""
    return subprocess.run(
        ["bash", "-c", f"source {REPO / 'scripts/lib/venv.sh'} && ensure_venv"],
        env={**os.environ, "HIBERNATE_VENV": str(venv)},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )


def test_the_first_install_says_what_each_step_installs_and_installs_what_it_always_did(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(RECORDING_PYTHON)
    python.chmod(0o755)

    first = ensure_venv(venv)
    assert first.returncode == 0, first.stderr
    pip = "-m pip install --disable-pip-version-check"
    assert (venv / "calls").read_text().splitlines() == [
        f"{pip} --upgrade pip",
        f"{pip} torch==2.13.0",
        f"{pip} -e {REPO}[dev]",
        f"{pip} --no-deps vllm==0.33.0",
        f"{pip} packaging regex",
    ]
    lines = first.stderr.splitlines()
    assert lines[0].startswith(f"installing what this checkout needs into {venv}, in 5 steps")
    assert "about 2 to 4 minutes" in lines[0] and f"pip's output goes to {venv}/install.log" in lines[0]
    steps = [line.strip() for line in lines[1:6]]
    assert [step[:5] for step in steps] == ["[1/5]", "[2/5]", "[3/5]", "[4/5]", "[5/5]"], lines
    assert "torch==2.13.0" in steps[1] and "vllm==0.33.0" in steps[3]
    assert all(step.endswith(" s)") and "(previous step: " in step for step in steps[1:])
    assert lines[6].startswith("installed in ") and len(lines) == 7, lines

    again = ensure_venv(venv)  # installed: nothing to do, nothing said
    assert again.returncode == 0 and again.stderr == ""
    assert len((venv / "calls").read_text().splitlines()) == 5
