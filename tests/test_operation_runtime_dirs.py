"""What a sleep reaches stays in sight, whatever runtime directory each agent listens in; a sleep of
a tree that holds the command itself is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode, UsageError
from hibernate.operation.targets import refuse_own_tree
from hibernate.procinfo import environment
from tests.conftest import REPO, wait_until

TARGET = """
import signal, sys, torch, hibernate
hibernate.track(torch.arange(1 << 18, dtype=torch.float32), name="w")
open(sys.argv[1], "w").write("ready")
signal.pause()
"""

LAUNCHER = """
import os, subprocess, sys
children = []
for runtime, ready in zip(sys.argv[1::2], sys.argv[2::2]):
    env = {**os.environ, "HIBERNATE_RUNTIME_DIR": runtime}
    children.append(subprocess.Popen([sys.executable, "-c", TARGET, ready], env=env))
for child in children:
    child.wait()
"""


def test_a_pid_whose_tree_holds_the_command_is_refused_a_sibling_is_not() -> None:
    me = os.getpid()
    with pytest.raises(UsageError, match="is this command itself"):
        refuse_own_tree(me, caller=me)
    with pytest.raises(UsageError, match=f"is an ancestor of this command \\(pid {me}\\)"):
        refuse_own_tree(1, caller=me)
    with pytest.raises(UsageError, match="is an ancestor"):
        refuse_own_tree(os.getppid(), caller=me)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as child:
        try:
            refuse_own_tree(child.pid, caller=me)  # a child of ours: its tree does not hold us
        finally:
            child.kill()


@pytest.mark.parametrize("whose", ["init", "the caller's parent"])
def test_sleep_of_a_tree_holding_the_command_is_refused_and_touches_nothing(
    start_demo: Any, cli: Any, work_dir: Path, whose: str
) -> None:
    demo = start_demo(size_mb=4)  # under this test's process: inside the tree named below
    pid = 1 if whose == "init" else os.getpid()  # the test process is the command's parent
    result = cli("sleep", str(pid), "--to", str(work_dir), "--json")
    assert result.returncode == ExitCode.USAGE, result.stdout + result.stderr
    assert (
        "a sleep of its tree would reach every hibernate agent under it" in result.json()["error"]["message"]
    )
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
    assert not any(work_dir.iterdir()), "nothing was written"


def states(cli: Any) -> dict[int, str]:
    result = cli("status", "--json")
    assert result.returncode == 0, result.stderr
    return {agent["pid"]: agent["state"] for agent in result.json()["agents"]}


@pytest.mark.slow
def test_agents_of_one_tree_in_two_runtime_directories_stay_in_sight_until_woken(
    cli: Any, runtime_dir: Path, work_dir: Path, tmp_path: Path
) -> None:
    other_runtime = tmp_path / "other-run"
    ready = [tmp_path / "ready-0", tmp_path / "ready-1"]
    launcher_code = f"TARGET = {TARGET!r}\n{LAUNCHER}"
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            launcher_code,
            str(runtime_dir),
            str(ready[0]),
            str(other_runtime),
            str(ready[1]),
        ],
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        wait_until(lambda: all(r.exists() for r in ready), 120, "both targets tracking their tensors")
        pids = [
            int(p) for p in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
        ]
        in_ours = [pid for pid in pids if environment(pid)["HIBERNATE_RUNTIME_DIR"] == str(runtime_dir)]
        children = [*in_ours, *(pid for pid in pids if pid not in in_ours)]  # ours, then the other's
        assert len(children) == 2 and len(in_ours) == 1
        assert set(states(cli)) == {children[0]}, "before a sleep, status sees its own runtime directory"
        asleep = cli("sleep", str(launcher.pid), "--to", str(work_dir), "--json")
        assert asleep.returncode == 0, asleep.stderr
        assert sorted(p["pid"] for p in asleep.json()["processes"]) == sorted(children)
        assert states(cli) == {children[0]: "asleep", children[1]: "asleep"}
        woken = cli("wake", "--all", "--json")
        assert woken.returncode == 0, woken.stdout + woken.stderr
        assert sorted(p["pid"] for p in woken.json()["processes"]) == sorted(children)
        assert states(cli) == {children[0]: "running"}, "awake again, the other is in sight where it listens"
        assert cli("status", str(children[1]), "--json").json()["agents"][0]["state"] == "running"
        assert not any((runtime_dir / "elsewhere").iterdir()), "its note went once it was awake"
    finally:
        for child in Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split():
            os.kill(int(child), 9)
        launcher.wait(timeout=60)


SQUATTED_PROGRAM = """
import json, sys, torch, hibernate
from hibernate.errors import UnsupportedError
from tests.standins.cuda_graphs import CUDAGraph, patched_torch_cuda

model = torch.nn.Linear(4, 4)
seen = {"track_returns": hibernate.track(model) is model}
with hibernate.guard():
    seen["guard"] = True
with hibernate.pool("weights"):
    seen["pooled"] = torch.ones(3).sum().item()  # a CPU torch has no pool provider: plain memory here
inputs = torch.ones(2, 4)
with patched_torch_cuda(), torch.no_grad():
    graph = CUDAGraph()
    with hibernate.cuda_graph(graph):
        out = model(inputs)
    graph.replay()
    seen["graph_replayed"] = torch.equal(out, model(inputs))
try:
    hibernate.sleep(sys.argv[1])
except UnsupportedError as exc:
    seen["sleep_error"] = exc.message
seen["state"] = hibernate.state()
seen["untracked"] = hibernate.untrack(model)
print(json.dumps(seen))
"""


@pytest.mark.slow
@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make the runtime directory another user's")
def test_a_runtime_directory_another_user_took_turns_hibernate_off_and_the_program_runs(
    tmp_path: Path, work_dir: Path
) -> None:
    squatted = tmp_path / f"hibernate-{os.getuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 65534, 65534)
    env = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "HIBERNATE_RUNTIME_DIR")}
    env.update(TMPDIR=str(tmp_path), PYTHONPATH=str(REPO), HIBERNATE_AGENT="1")
    result = subprocess.run(
        [sys.executable, "-c", SQUATTED_PROGRAM, str(work_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen["track_returns"] and seen["guard"] and seen["pooled"] == 3.0 and seen["graph_replayed"]
    assert "hibernate is off in this process" in seen["sleep_error"]
    assert "belongs to uid 65534" in seen["sleep_error"]
    assert seen["state"] == "running" and seen["untracked"] is False
    said = [line for line in result.stderr.splitlines() if line.startswith("hibernate:")]
    assert len(said) == 1, result.stderr
    assert "did not start" in said[0] and "HIBERNATE_RUNTIME_DIR" in said[0]
    assert not any(squatted.iterdir()), "nothing was made in another user's directory"
    assert not any(work_dir.iterdir()), "nothing was written"
