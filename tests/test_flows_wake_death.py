"""A process that dies while its memory comes back is reported dead, not "asleep, try again"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from hibernate.flows.members import describe_end
from tests.conftest import REPO, wait_until

BUS_ERROR_RECORD = (
    'Fatal Python error: Bus error\n\nThread 0x00007f (most recent call first):\n  File "x.py"\n'
)


def test_a_crash_record_names_the_signal_and_its_likely_cause() -> None:
    said = describe_end(None, BUS_ERROR_RECORD)
    assert said is not None and said.startswith("killed by SIGBUS: memory it had mapped could not be backed")


def test_a_zombies_wait_status_names_the_signal_or_the_exit_status() -> None:
    assert describe_end(signal.SIGKILL, "") == (
        "killed by SIGKILL: the kernel's out-of-memory killer, or someone, killed it"
    )
    assert describe_end(signal.SIGTERM, "") == "killed by SIGTERM"
    assert describe_end(3 << 8, "") == "exited with status 3"


def test_nothing_to_go_by_says_nothing() -> None:
    assert describe_end(None, "") is None
    assert describe_end(None, "Fatal Python error: something else\n") is None


def test_a_fatal_signal_during_a_restore_is_written_to_the_crash_record(tmp_path: Path) -> None:
    record = tmp_path / "agent-1-2.crash"
    code = (
        "import signal, sys; from pathlib import Path; from hibernate.agent.crash import recording_crashes\n"
        "with recording_crashes(Path(sys.argv[1])):\n"
        "    signal.raise_signal(signal.SIGSEGV)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONFAULTHANDLER", None)
    died = subprocess.run([sys.executable, "-c", code, str(record)], env=env, capture_output=True)
    assert died.returncode == -signal.SIGSEGV
    assert describe_end(None, record.read_text()) == "killed by SIGSEGV"


@pytest.mark.parametrize("program_has_its_own", [False, True])
def test_the_crash_record_lasts_only_as_long_as_the_restore_and_leaves_a_programs_own_handler(
    tmp_path: Path, program_has_its_own: bool
) -> None:
    record = tmp_path / "agent-1-2.crash"
    code = (
        "import faulthandler, sys; from pathlib import Path\n"
        "from hibernate.agent.crash import recording_crashes\n"
        "if sys.argv[2] == 'True': faulthandler.enable()\n"
        "with recording_crashes(Path(sys.argv[1])):\n"
        "    print(Path(sys.argv[1]).exists())\n"
        "print(Path(sys.argv[1]).exists(), faulthandler.is_enabled())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONFAULTHANDLER", None)
    argv = [sys.executable, "-c", code, str(record), str(program_has_its_own)]
    lines = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout.split("\n")
    assert lines[0] == str(not program_has_its_own)  # a program's own handler is not taken over
    assert lines[1] == f"False {program_has_its_own}"  # gone after, and the program's handler kept


def wake_json(cli: Any, pid: int) -> dict[str, Any]:
    result = cli("wake", str(pid), "--json")
    assert result.returncode == ExitCode.NO_SUCH_PROCESS, result.stdout + result.stderr
    error: dict[str, Any] = json.loads(result.stdout)["error"]
    return error


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, how",
    [
        ("SIGBUS", "killed by SIGBUS: memory it had mapped could not be backed"),
        ("kill", "killed by SIGKILL: the kernel's out-of-memory killer, or someone, killed it"),
    ],
)
def test_a_target_killed_by_a_signal_mid_wake_is_reported_dead_with_its_signal(
    start_demo: Any, cli: Any, work_dir: Path, fault: str, how: str
) -> None:
    demo = start_demo(size_mb=8, env={"HIBERNATE_FAULT": f"agent.restore:{fault}"})
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "-q").returncode == 0
    error = wake_json(cli, demo.pid)
    message = error["message"]
    assert message.startswith(f"process {demo.pid} died during its wake ({how}")
    assert "the memory it held is lost" in message
    assert "stays asleep" not in message and "hibernate wake" not in (error["hint"] or "")
    snapshot = Path(message.split("its snapshot stays in ")[1].split(" ")[0])
    assert (snapshot / "manifest.json").is_file(), "the snapshot is left where the report says"
    assert f"hibernate gc {work_dir}" in message
    demo.proc.wait(timeout=30)  # reaped: gone for gc too
    assert cli("gc", str(work_dir), "-q").returncode == 0
    assert not snapshot.exists(), "the gc the message names deletes it"


TRUNCATED_MAPPING_TARGET = """
import signal, sys, numpy, torch, hibernate
mapped = numpy.memmap(sys.argv[1], dtype=numpy.uint8, mode="c")  # a private mapping of the file
weights = torch.from_numpy(mapped)
weights[:] = 7  # copy-on-write: these bytes live only in this process
hibernate.track(weights, name="mapped")
open(sys.argv[2], "w").write("ready")
signal.pause()
"""


@pytest.mark.slow
def test_a_private_file_mapping_truncated_while_asleep_kills_the_wake_and_is_named(
    cli: Any, runtime_dir: Path, work_dir: Path, tmp_path: Path
) -> None:
    """What happens for real: the wake writes the bytes back where the file ends now, and SIGBUS."""
    data, ready = tmp_path / "weights.bin", tmp_path / "ready"
    data.write_bytes(bytes(4 << 20))
    target = subprocess.Popen(
        [sys.executable, "-c", TRUNCATED_MAPPING_TARGET, str(data), str(ready)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        wait_until(ready.exists, 120, "the target tracking its mapping")
        assert cli("sleep", str(target.pid), "--to", str(work_dir), "-q").returncode == 0
        os.truncate(data, 0)
        message = wake_json(cli, target.pid)["message"]
        assert message.startswith(f"process {target.pid} died during its wake (killed by SIGBUS: ")
        assert target.wait(timeout=60) == -signal.SIGBUS
    finally:
        target.kill()
        target.wait()
