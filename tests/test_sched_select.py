"""Selecting targets the way a scheduler sees them: --all, --job ID, --cgroup PATH.

The pure parts (cgroup layouts, process trees) are tested with made-up data;
the selectors with real demo processes, a cgroup tree each test builds (the
stand-in for /sys/fs/cgroup, through HIBERNATE_CGROUP_ROOT) and the real CLI.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from hibernate import procinfo
from hibernate.errors import ExitCode, UsageError
from hibernate.sched.cgroups import (
    cgroup_members,
    find_named_cgroups,
    parse_pid_list,
    resolve_cgroup_path,
    unified_cgroup_path,
)
from hibernate.sched.selectors import tree_roots
from hibernate.sched.slurm import (
    check_job_id,
    job_cgroups,
    job_dir_in_cgroup_path,
    on_this_node,
    pids_with_job_environment,
    slurmd_of,
)
from tests.conftest import REPO, Demo, run_cli, wait_until
from tests.slurm_cluster import (
    SCRIPTS,
    SlurmCluster,
    agent_state,
    as_user,
    demo_job,
    job_user,
    python_for,
    ready_demos,
    stopped_by_slurm,
)

V2_SCOPE = ("system.slice", "slurmstepd.scope")


def make_cgroup(
    root: Path, *parts: str, procs: list[int] | None = None, tasks: list[int] | None = None
) -> Path:
    """A cgroup directory; like the kernel's, every directory on the way lists its processes."""
    directory = root.joinpath(*parts)
    for depth in range(1, len(parts) + 1):
        level = root.joinpath(*parts[:depth])
        level.mkdir(exist_ok=True)
        listing = level / ("tasks" if tasks is not None else "cgroup.procs")
        if not listing.exists():
            listing.write_text("")
    if procs is not None:
        (directory / "cgroup.procs").write_text("".join(f"{p}\n" for p in procs))
    if tasks is not None:
        (directory / "tasks").write_text("".join(f"{t}\n" for t in tasks))
    return directory


# -- pure parts -------------------------------------------------------------------------


def test_cgroup_pid_lists_are_read_one_per_line() -> None:
    assert parse_pid_list("12\n345\n\n6\n") == [12, 345, 6]
    assert parse_pid_list("") == []


def test_the_job_directory_is_what_comes_before_the_first_step() -> None:
    path = "/system.slice/slurmstepd.scope/job_42/step_0/user/task_0"
    assert job_dir_in_cgroup_path(path) == "/system.slice/slurmstepd.scope/job_42"
    # Slurm 26.05 names job directories by SLUID unless CgroupJobIdPaths=yes
    assert job_dir_in_cgroup_path("/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_batch/user/task_0") == (
        "/system.slice/slurmstepd.scope/sEKNKTV3WPV500"
    )
    assert job_dir_in_cgroup_path("/user.slice/user-1000.slice/session-3.scope") is None


def test_the_unified_hierarchy_line_of_proc_cgroup() -> None:
    text = "12:memory:/slurm/uid_0/job_9/step_0\n0::/system.slice/slurmstepd.scope/job_9/step_0/user/task_0\n"
    assert unified_cgroup_path(text) == "/system.slice/slurmstepd.scope/job_9/step_0/user/task_0"
    assert unified_cgroup_path("12:memory:/slurm\n") is None


@pytest.mark.parametrize("text", ["42", " 42 "])
def test_job_ids_are_digits(text: str) -> None:
    assert check_job_id(text) == "42"


@pytest.mark.parametrize("text", ["123_4", "123+0", "job_42", "", "-1"])
def test_array_and_het_job_ids_are_refused_with_the_way_to_the_number(text: str) -> None:
    with pytest.raises(UsageError, match="not a Slurm job id") as caught:
        check_job_id(text)
    assert "squeue" in (caught.value.hint or "")


def test_both_slurm_cgroup_layouts_are_found(tmp_path: Path) -> None:
    v1 = make_cgroup(tmp_path, "freezer", "slurm", "uid_1000", "job_42", "step_0", procs=[1])
    v1_memory = make_cgroup(tmp_path, "memory", "slurm_node3", "uid_1000", "job_42", procs=[1])
    v2 = make_cgroup(tmp_path, *V2_SCOPE, "job_42", "step_batch", "user", "task_0", procs=[1])
    make_cgroup(tmp_path, *V2_SCOPE, "job_420", procs=[2])  # another job, a longer id
    found = sorted(find_named_cgroups(tmp_path, "job_42"))
    assert found == sorted([v1.parent, v1_memory, v2.parent.parent.parent])


def test_several_slurmd_on_one_host_each_keep_their_own_job_directory(tmp_path: Path) -> None:
    """A job over two nodes whose slurmd share a host has a job_<id> under each: a node takes its own."""
    node0 = make_cgroup(tmp_path, "freezer", "slurm_node0", "uid_0", "job_42", "step_0", procs=[1]).parent
    node1 = make_cgroup(tmp_path, "freezer", "slurm_node1", "uid_0", "job_42", "step_0", procs=[2]).parent
    v2 = make_cgroup(tmp_path, "system.slice", "node1_slurmstepd.scope", "job_42", procs=[3])
    assert [slurmd_of(p, tmp_path) for p in (node0, node1, v2)] == ["node0", "node1", "node1"]
    single = make_cgroup(tmp_path, "freezer", "slurm", "uid_0", "job_42", procs=[4])
    assert slurmd_of(single, tmp_path) is None  # one slurmd on the host names no node
    found = [node0, node1, v2, single]
    assert on_this_node(found, tmp_path, "node1") == [node1, v2, single]
    assert on_this_node(found, tmp_path, None) == found  # outside a job's task: every node of the host
    assert sorted(job_cgroups("42", tmp_path, {"SLURMD_NODENAME": "node0"}, "")) == sorted([node0, single])


def test_job_cgroups_found_too_deep_are_not_looked_for(tmp_path: Path) -> None:
    make_cgroup(tmp_path, "a", "b", "c", "d", "job_42", procs=[1])
    assert find_named_cgroups(tmp_path, "job_42") == []


def test_a_process_inside_the_job_finds_its_job_directory_whatever_its_name(tmp_path: Path) -> None:
    job_dir = make_cgroup(tmp_path, *V2_SCOPE, "sEKNKTV3WPV500")
    own = "0::/system.slice/slurmstepd.scope/sEKNKTV3WPV500/step_3/user/task_0\n"
    assert job_cgroups("42", tmp_path, {"SLURM_JOB_ID": "42"}, own) == [job_dir]
    assert job_cgroups("43", tmp_path, {"SLURM_JOB_ID": "42"}, own) == []  # asked about another job


def test_every_process_below_a_cgroup_counts_once(tmp_path: Path) -> None:
    job = make_cgroup(tmp_path, "job_7", procs=[])
    make_cgroup(job, "step_0", "user", "task_0", procs=[10, 11])
    make_cgroup(job, "step_1", "user", "task_0", procs=[12, 10])
    assert sorted(cgroup_members(job)) == [10, 11, 12]


def test_a_v1_tasks_file_lists_threads_which_map_to_their_processes(tmp_path: Path) -> None:
    group = make_cgroup(tmp_path, "job_7", tasks=[100, 101, 102, 200])
    process_of = {100: 100, 101: 100, 102: 100, 200: 200}
    assert cgroup_members(group, process_of.get) == [100, 200]


def test_the_job_environment_marks_its_processes() -> None:
    environments = [
        (1, {"SLURM_JOB_ID": "42"}),
        (2, {"SLURM_JOBID": "42"}),
        (3, {"SLURM_JOB_ID": "4"}),
        (4, {}),
    ]
    assert pids_with_job_environment("42", environments) == [1, 2]
    # several slurmd on one host (no cgroups to tell them apart): each node's tasks say their node
    tasks = [
        (5, {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "node0"}),
        (6, {"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "node1"}),
    ]
    assert pids_with_job_environment("42", [*environments, *tasks], "node1") == [1, 2, 6]
    assert pids_with_job_environment("42", tasks) == [5, 6]


def test_a_cgroup_path_may_be_given_as_proc_pid_cgroup_prints_it(tmp_path: Path) -> None:
    directory = make_cgroup(tmp_path, *V2_SCOPE, "job_42", procs=[1])
    assert resolve_cgroup_path("/system.slice/slurmstepd.scope/job_42", tmp_path) == directory
    assert resolve_cgroup_path(directory, tmp_path) == directory
    with pytest.raises(UsageError, match="no cgroup there"):
        resolve_cgroup_path("/system.slice/missing", tmp_path)


PARENTS = {
    1: 0,  # init
    50: 1,  # slurmstepd (root)
    100: 50,  # the job's batch shell
    101: 100,  # hibernate run
    102: 101,  # the server (agent)
    103: 102,  # a worker (agent)
    104: 102,  # a worker (agent, CUDA)
    200: 50,  # a second step's task (agent)
    300: 1,  # a process outside the job
}
OWNERS = {pid: 1000 for pid in PARENTS} | {1: 0, 50: 0}


def test_each_agent_is_handed_over_through_its_topmost_process_in_the_job() -> None:
    members = {50, 100, 101, 102, 103, 104, 200}
    roots = tree_roots([103, 102, 104, 200], members, PARENTS.get, OWNERS.get)
    # slurmstepd (root-owned) is not climbed to; each tree is named once
    assert roots == [100, 200]


def test_climbing_stops_at_the_edge_of_the_selection() -> None:
    assert tree_roots([103, 104], {102, 103, 104}, PARENTS.get, OWNERS.get) == [102]
    assert tree_roots([300], {300}, PARENTS.get, OWNERS.get) == [300]


def test_topmost_keeps_order_and_drops_descendants() -> None:
    assert procinfo.topmost([103, 300, 100, 104, 100], PARENTS.get) == [300, 100]


def test_a_process_tree_lists_parents_before_children_from_one_walk_of_proc() -> None:
    children = {100: [102, 101], 101: [104, 103], 300: [301]}
    assert procinfo.descendants(100, children) == [100, 101, 102, 103, 104]
    assert procinfo.descendants(104, children) == [104]


def test_the_walk_of_proc_finds_a_real_child() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    ) as child:
        try:
            assert child.pid in procinfo.children_by_parent()[os.getpid()]
            assert procinfo.descendants(os.getpid())[:1] == [os.getpid()]
            assert child.pid in procinfo.descendants(os.getpid())
        finally:
            assert child.stdin is not None
            child.stdin.close()


# -- the selectors, with real processes ---------------------------------------------------


@dataclass
class Node:
    """This machine as one node: demos outside any job, listening in a runtime directory of their own."""

    root: Path
    demos: list[Demo] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {"HIBERNATE_RUNTIME_DIR": str(self.root / "run")}

    def start_demos(self, count: int, env: dict[str, str] | None = None) -> list[Demo]:
        """``count`` demos started at once (importing torch is most of their start-up time)."""
        started = []
        for _ in range(count):
            index = len(self.demos)
            control, ready, log = (self.root / f"demo{index}.{ext}" for ext in ("sock", "ready", "log"))
            command = [
                sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve", "--size-mb", "16",
                "--control", str(control), "--ready-file", str(ready),
            ]  # fmt: skip
            environment = {**os.environ, "PYTHONPATH": str(REPO), **self.env, **(env or {})}
            with open(log, "wb") as out:
                proc = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=environment
                )
            demo = Demo(proc, str(control), {}, log, {"ready": ready})
            self.demos.append(demo)
            started.append(demo)
        for demo in started:
            wait_until(demo.extra["ready"].exists, 180, "a demo to be ready", 0.05, process=demo.proc)
            demo.info = json.loads(demo.extra["ready"].read_text())
        return started


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    """This node with three demos, in no job: each test puts them in the cgroups it arranges."""
    here = Node(Path(tempfile.mkdtemp(prefix="hb-node-", dir="/tmp")))
    try:
        here.start_demos(3)
        yield here
    finally:
        for demo in here.demos:
            demo.stop()
        shutil.rmtree(here.root, ignore_errors=True)


@pytest.fixture
def cgroups(node: Node) -> Iterator[Path]:
    """A cgroup root this test arranges (the node's own is left alone)."""
    root = Path(tempfile.mkdtemp(prefix="hb-cg-", dir="/tmp"))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def hibernate(node: Node, cgroups: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    environment = {**node.env, "HIBERNATE_CGROUP_ROOT": str(cgroups), **(env or {})}
    return run_cli(*args, env=environment)


def selected(result: Any) -> list[int]:
    assert result.returncode == 0, result.stderr + result.stdout
    return sorted(agent["pid"] for agent in result.json()["agents"])


def test_job_selects_the_processes_in_the_jobs_cgroups(node: Node, cgroups: Path) -> None:
    a, b, c = node.demos[:3]
    make_cgroup(cgroups, *V2_SCOPE, "job_4200", "step_0", "user", "task_0", procs=[a.pid])
    make_cgroup(cgroups, *V2_SCOPE, "job_4200", "step_1", "user", "task_0", procs=[b.pid])
    make_cgroup(cgroups, *V2_SCOPE, "job_4201", "step_0", "user", "task_0", procs=[c.pid])
    result = hibernate(node, cgroups, "status", "--job", "4200", "--json")
    assert selected(result) == sorted([a.pid, b.pid])
    source = result.json()["selection"]["sources"][0]
    assert (
        source["via"] == "cgroup"
        and source["job"] == "4200"
        and sorted(source["agents"]) == sorted([a.pid, b.pid])
    )


def test_job_selects_through_a_v1_hierarchy_of_threads(node: Node, cgroups: Path) -> None:
    a = node.demos[0]
    threads = sorted(int(t) for t in os.listdir(f"/proc/{a.pid}/task"))
    assert len(threads) > 1  # torch and the agent run threads
    make_cgroup(cgroups, "freezer", "slurm", "uid_0", "job_4200", "step_0", tasks=threads[1:])
    assert selected(hibernate(node, cgroups, "status", "--job", "4200", "--json")) == [a.pid]


@pytest.mark.slow
def test_job_falls_back_to_the_environment_without_a_cgroup(node: Node, cgroups: Path) -> None:
    (tagged,) = node.start_demos(1, env={"SLURM_JOB_ID": "777"})
    result = hibernate(node, cgroups, "status", "--job", "777", "--json")
    assert selected(result) == [tagged.pid]
    assert result.json()["selection"]["sources"][0]["via"] == "environment"
    tagged.stop()


def test_cgroup_selects_a_directory_and_everything_below_it(node: Node, cgroups: Path) -> None:
    a, b, c = node.demos[:3]
    make_cgroup(cgroups, "work", "left", procs=[a.pid])
    make_cgroup(cgroups, "work", "right", "deep", procs=[b.pid])
    make_cgroup(cgroups, "elsewhere", procs=[c.pid])
    assert selected(hibernate(node, cgroups, "status", "--cgroup", "/work", "--json")) == sorted(
        [a.pid, b.pid]
    )
    absolute = str(cgroups / "work" / "right")
    assert selected(hibernate(node, cgroups, "status", "--cgroup", absolute, "--json")) == [b.pid]


@pytest.mark.slow
def test_all_selects_every_agent_of_this_node_and_combines_with_pids(node: Node, cgroups: Path) -> None:
    demos = node.demos[:3]
    result = hibernate(node, cgroups, "status", "--all", "--json")
    assert selected(result) == sorted(d.pid for d in demos)
    # a process listening elsewhere (another runtime directory) is not "this node's" ...
    (elsewhere,) = node.start_demos(1, env={"HIBERNATE_RUNTIME_DIR": str(cgroups / "run")})
    assert elsewhere.pid not in selected(hibernate(node, cgroups, "status", "--all", "--json"))
    # ... but a pid names it, and pids and selectors add up
    both = hibernate(node, cgroups, "status", "--all", str(elsewhere.pid), "--json")
    assert selected(both) == sorted([*(d.pid for d in demos), elsewhere.pid])
    elsewhere.stop()


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--job", "31337"], ExitCode.NOTHING_TO_HIBERNATE, "has no processes on this node"),
        (["--job", "12_3"], ExitCode.USAGE, "not a Slurm job id"),
        (["--cgroup", "/no/such/group"], ExitCode.USAGE, "no cgroup there"),
        (["--cgroup", "/empty"], ExitCode.NOTHING_TO_HIBERNATE, "has no processes"),
        (["--cgroup", "/sleepers"], ExitCode.NOTHING_TO_HIBERNATE, "runs a hibernate agent"),
    ],
)
def test_selectors_that_find_nothing_say_so_with_a_distinct_code(
    node: Node, cgroups: Path, args: list[str], code: ExitCode, words: str
) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        make_cgroup(cgroups, "empty", procs=[])
        make_cgroup(cgroups, "sleepers", procs=[sleeper.pid])
        result = hibernate(node, cgroups, "sleep", *args, "--to", str(cgroups / "snap"), "--json")
    finally:
        sleeper.kill()
        sleeper.wait()
    assert result.returncode == code, result.stdout
    error = result.json()["error"]
    assert words in error["message"] and error["hint"]


def test_all_with_no_agents_says_where_it_looked(cgroups: Path) -> None:
    result = run_cli("wake", "--all", env={"HIBERNATE_RUNTIME_DIR": str(cgroups / "nobody-here")})
    assert result.returncode == ExitCode.NOTHING_TO_HIBERNATE
    assert "nobody-here" in result.stderr and "hint:" in result.stderr


def test_no_targets_at_all_is_a_usage_error(cgroups: Path) -> None:
    result = run_cli("sleep", "--to", str(cgroups))
    assert result.returncode == ExitCode.USAGE and "no targets named" in result.stderr


# -- one unit: all asleep, or none ----------------------------------------------------------


@pytest.mark.slow
def test_a_job_sleeps_and_wakes_as_one_unit(node: Node, cgroups: Path, work_dir: Path) -> None:
    a, b, c = node.demos[:3]
    reference = {d.pid: d.infer()["digest"] for d in (a, b)}
    make_cgroup(cgroups, *V2_SCOPE, "job_4200", "step_0", "user", "task_0", procs=[a.pid, b.pid])
    asleep = hibernate(node, cgroups, "sleep", "--job", "4200", "--to", str(work_dir), "--json")
    assert asleep.returncode == 0, asleep.stderr
    assert sorted(p["pid"] for p in asleep.json()["processes"]) == sorted([a.pid, b.pid])
    states = {
        e["pid"]: e["state"] for e in json.loads(hibernate(node, cgroups, "ls", "--json").stdout)["agents"]
    }
    assert (states[a.pid], states[b.pid], states[c.pid]) == ("asleep", "asleep", "running")
    assert hibernate(node, cgroups, "wake", "--job", "4200", "-q").returncode == 0
    assert {d.pid: d.infer()["digest"] for d in (a, b)} == reference


@pytest.mark.slow
def test_when_one_target_of_a_job_fails_the_whole_job_is_undone(
    node: Node, cgroups: Path, work_dir: Path
) -> None:
    a, b, c = node.demos[:3]
    make_cgroup(cgroups, *V2_SCOPE, "job_4200", "step_0", "user", "task_0", procs=[a.pid, b.pid, c.pid])
    b.hold(60)  # b is in a long step (longer than a loaded machine takes to start the CLI): --timeout 1
    try:
        result = hibernate(
            node, cgroups, "sleep", "--job", "4200", "--to", str(work_dir), "--timeout", "1", "--json"
        )
    finally:
        b.release()  # the demos are shared: the next test finds no step running
    assert result.returncode == ExitCode.TIMEOUT, result.stdout
    assert f"process {b.pid}" in result.json()["error"]["message"]
    listing = json.loads(hibernate(node, cgroups, "ls", "--json").stdout)["agents"]
    assert {e["pid"]: e["state"] for e in listing if e["pid"] in (a.pid, b.pid, c.pid)} == {
        a.pid: "running",
        b.pid: "running",
        c.pid: "running",
    }
    assert a.infer()["digest"]  # serving again


# -- on a node of a real Slurm cluster ------------------------------------------------------


@pytest.mark.slow
def test_a_one_node_job_sleeps_and_wakes_with_job(slurm_cluster: SlurmCluster, work_dir: Path) -> None:
    """`hibernate sleep --job` run in the job on its node: the job's own cgroup on that node, and the
    demo (not the slurmstepd above it, root's like the job) is what is put to sleep."""
    slurm, node = slurm_cluster, slurm_cluster.nodes[1]
    job_id, (demo,) = demo_job(slurm, "single", [node])
    try:
        in_job = ["srun", f"--jobid={job_id}", "--overlap", "--ntasks=1", "hibernate"]
        asleep = slurm.run([*in_job, "sleep", "--job", str(job_id), "--to", str(work_dir), "--json"])
        assert asleep.returncode == 0, asleep.stderr + asleep.stdout
        report = json.loads(asleep.stdout)
        assert [p["pid"] for p in report["processes"]] == [demo.pid]
        if slurm.proctrack == "proctrack/cgroup":
            assert report["selection"]["sources"][0]["cgroups"] == [str(slurm.job_cgroup(node, job_id))]
        assert agent_state(slurm, demo) == "asleep"
        woken = slurm.run([*in_job, "wake", "--job", str(job_id), "-q"])
        assert woken.returncode == 0, woken.stderr
        assert agent_state(slurm, demo) == "running"
        assert demo.infer() == demo.reference
    finally:
        slurm.cancel(job_id)


@pytest.mark.slow
def test_root_hibernates_the_job_of_an_unprivileged_user(slurm_cluster: SlurmCluster) -> None:
    """An operator (root) suspends a user's job with hibernate-suspend and brings it back with
    hibernate-resume, bit-exact after the wake. Slurm refuses root a step in another user's job, so
    the node steps run as the job's owner, in directories the script hands them."""
    slurm, node = slurm_cluster, slurm_cluster.nodes[0]
    user = job_user()
    python, python_env = python_for(slurm, user)
    files = slurm.scratch / f"theirs-{node}"
    script = slurm.scratch / "theirs.sbatch"
    script.write_text(
        "#!/bin/sh\n"
        f"exec srun sh -c 'exec {python} -W ignore -m hibernate.demo serve --size-mb 16 "
        f"--control {files}.sock --ready-file {files}.ready'\n"
    )
    script.chmod(0o755)
    submitted = subprocess.run(
        [*as_user(user), "sbatch", "--parsable", f"--nodelist={node}", str(script)],
        env={
            **slurm.outside_env(),
            **python_env,
            "HIBERNATE_RUNTIME_DIR": str(slurm.runtime_dir(node, user.pw_uid)),
        },
        cwd=slurm.scratch,
        capture_output=True,
        text=True,
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = int(submitted.stdout.strip())
    try:
        (demo,) = ready_demos(slurm, job_id, "theirs", [node])
        assert procinfo.owner_uid(demo.pid) == user.pw_uid
        operator = {**slurm.outside_env(), "HIBERNATE_BARRIER_DIR": str(slurm.scratch / "barriers")}
        snapshots = slurm.scratch / "theirs-snapshots"  # made by the script, handed to the job's owner
        suspended = slurm.run(
            [str(SCRIPTS / "hibernate-suspend"), str(job_id), "--to", str(snapshots)], operator
        )
        assert suspended.returncode == 0, suspended.stderr + suspended.stdout
        assert slurm.state(job_id) == "SUSPENDED"
        wait_until(lambda: stopped_by_slurm(demo.pid), 60, "the demo stopped by the suspension", 0.05)
        manifests = list(snapshots.glob("*/*/snap-*/manifest.json"))
        assert manifests and all(p.stat().st_uid == user.pw_uid for p in manifests)  # the owner's files
        resumed = slurm.run([str(SCRIPTS / "hibernate-resume"), str(job_id)], operator)
        assert resumed.returncode == 0, resumed.stderr + resumed.stdout
        assert agent_state(slurm, demo) == "running"
        assert demo.infer() == demo.reference
    finally:
        slurm.cancel(job_id)
