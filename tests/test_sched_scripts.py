"""The example scripts of scripts/slurm/, submitted to a real Slurm cluster (tests/slurm_cluster.py).

Every script is shell-checked; each example runs end to end with the demo as
its GPU program: a preemptible server put to sleep by Slurm's own preemption
(a job of a higher partition suspends it) and woken when it resumes, a
training job that sleeps between phases on two nodes, and the site's
suspend/resume pair. The shipped batch scripts ask for GPUs; this cluster has
none, so they are submitted with ``--gpus-per-node=0``, which the command line
may override.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from hibernate.errors import ExitCode
from tests.conftest import process_state, wait_until
from tests.slurm_cluster import (
    SCRIPTS,
    SlurmCluster,
    agent_state,
    demo_command,
    demo_job,
    free_ports,
    ready_demos,
    stopped_by_slurm,
)

SHELL_SCRIPTS = sorted(p for p in SCRIPTS.iterdir() if p.is_file())


def test_there_are_scripts_to_check() -> None:
    names = {p.name for p in SHELL_SCRIPTS}
    assert {"hibernate-job", "hibernate-suspend", "hibernate-resume"} <= names
    assert {"vllm-preemptible.sbatch", "train-phases.sbatch"} <= names


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_every_script_passes_shellcheck(script: Path) -> None:
    result = subprocess.run(["shellcheck", "--external-sources", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("script", ["hibernate-job", "hibernate-suspend", "hibernate-resume"])
def test_the_commands_explain_themselves(script: str) -> None:
    result = subprocess.run([str(SCRIPTS / script), "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith(script), result.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["sleep", "--job", "12_3", "--to", "/tmp"], "not a numeric Slurm job id"),
        (["sleep", "--job", "12"], "sleep needs --to DIR"),
        (["hover", "--job", "12"], "hibernate-job sleep --to DIR"),
        (["wake", "--job", "12", "--barrier-timeout", "soon"], "not a number of seconds"),
    ],
)
def test_hibernate_job_refuses_bad_input_with_usage(args: list[str], words: str) -> None:
    result = subprocess.run([str(SCRIPTS / "hibernate-job"), *args], capture_output=True, text=True)
    assert result.returncode == ExitCode.USAGE and words in result.stderr


@pytest.mark.parametrize(
    "status, words",
    [
        (10, "every node is awake"),
        (13, "a node could not wake its processes again: fix the cause, then run hibernate-resume 42"),
        (137, "what it put to sleep may still be asleep; run hibernate-resume 42"),
    ],
)
def test_hibernate_suspend_says_what_holds_after_each_failure(
    tmp_path: Path, status: int, words: str
) -> None:
    """Only an abort that every node settled leaves every node awake; exit 13 and a killed node do not."""
    failing = tmp_path / "hibernate-job"
    failing.write_text(f"#!/bin/sh\nexit {status}\n")
    failing.chmod(0o755)
    result = subprocess.run(
        [str(SCRIPTS / "hibernate-suspend"), "42", "--to", str(tmp_path)],
        env={**os.environ, "HIBERNATE_JOB": str(failing)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == status and "job 42 was not suspended" in result.stderr, result.stderr
    assert words in result.stderr
    if status != 10:
        assert "every node is awake" not in result.stderr


def submit_script(slurm: SlurmCluster, script: str, *sbatch: str, env: dict[str, str]) -> int:
    """sbatch of a shipped script (this cluster has no GPUs: the command line asks for none)."""
    return slurm.submit(
        "--gpus-per-node=0", *sbatch, str(SCRIPTS / script), env={**slurm.outside_env(), **env}
    )


def output_of(slurm: SlurmCluster, job_id: int) -> Path:
    return slurm.scratch / f"slurm-{job_id}.out"


def command_line(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        raw = f.read()
    return int(raw[raw.rindex(")") + 2 :].split()[1])


@pytest.mark.slow
def test_a_preempted_server_sleeps_before_slurm_stops_it_and_serves_after(
    slurm_cluster: SlurmCluster, work_dir: Path
) -> None:
    """PreemptMode=SUSPEND,GANG: a job of the higher partition needs the node's CPUs, so Slurm suspends
    the server's job (SIGTSTP, then the freeze), and resumes it (thaw, SIGCONT) when the other ends."""
    slurm, node = slurm_cluster, slurm_cluster.nodes[0]
    files = slurm.scratch / f"server-{node}"
    done = slurm.scratch / "preemptor.done"
    server = f"hibernate-demo serve --size-mb 4 --control {files}.sock --ready-file {files}.ready"
    server_id = submit_script(
        slurm, "vllm-preemptible.sbatch", "--partition=low", f"--nodelist={node}", "--cpus-per-task=2",
        env={"VLLM_COMMAND": server, "SNAPSHOTS": str(work_dir)},
    )  # fmt: skip
    preemptor = None
    try:
        (demo,) = ready_demos(slurm, server_id, "server", [node])
        output = output_of(slurm, server_id)
        wrapper = parent_of(demo.pid)
        assert command_line(wrapper).startswith(
            f"{sys.executable} -m hibernate run"
        )  # the batch shell, exec'd
        resident = demo.rss()

        preemptor = slurm.submit(
            "--partition=high", f"--nodelist={node}", "--cpus-per-task=2",
            "--wrap", f"while [ ! -e {done} ]; do sleep 0.1; done",
        )  # fmt: skip
        slurm.wait_state(preemptor, "RUNNING")
        assert slurm.state(server_id) == "SUSPENDED"
        wait_until(
            lambda: stopped_by_slurm(demo.pid) and stopped_by_slurm(wrapper),
            60,
            "the server and its wrapper stopped by the suspension",
            0.05,
        )
        if slurm.proctrack == "proctrack/cgroup":  # frozen by the freezer cgroup, not stopped by SIGSTOP
            assert process_state(demo.pid) != "T" and process_state(wrapper) != "T"
        # Read while both are stopped: the wrapper logged the sleep before Slurm stopped it.
        assert f"asleep: pid {demo.pid}" in output.read_text(), output.read_text()
        assert list(work_dir.glob("*/snap-*/manifest.json"))
        assert demo.rss() < resident - 3 * 2**20  # its 4 MiB of weights are on disk, not in memory

        done.touch()
        slurm.wait_state(preemptor, "COMPLETED")
        slurm.wait_state(server_id, "RUNNING")  # the gang scheduler resumed it
        wait_until(lambda: f"awake: pid {demo.pid}" in output.read_text(), 90, "the wake on SIGCONT", 0.1)
        assert agent_state(slurm, demo) == "running"
        assert demo.infer() == demo.reference
    finally:
        done.touch()
        for job_id in (preemptor, server_id):
            if job_id is not None:
                slurm.cancel(job_id)


# `vllm serve MODEL --host H --port P ...` as the demo with its HTTP API (vLLM's default host: every
# interface), recording the command line and VLLM_SERVER_DEV_MODE it was started with.
VLLM_STANDIN = """#!/usr/bin/env bash
printf '%s\\n' "VLLM_SERVER_DEV_MODE=${{VLLM_SERVER_DEV_MODE:-}}" "$@" >{record}
model=$2
shift 2
while (($#)); do
    case $1 in
    --host) host=$2 && shift 2 ;;
    --port) port=$2 && shift 2 ;;
    *) shift ;;
    esac
done
exec hibernate-demo serve --size-mb 4 --control {files}.sock --ready-file {files}.ready \\
    --http-host "${{host:-0.0.0.0}}" --http-port "$port" --model-name "$model"
"""


def node_address() -> str | None:
    """An IPv4 address of this machine other than loopback: where clients on other nodes come from."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not ipaddress.ip_address(address.address).is_loopback:
                return str(address.address)
    return None


def ask(
    host: str, port: int, method: str, path: str, body: object = None, token: str = ""
) -> tuple[int, bytes]:
    """One HTTP request, straight to HOST:PORT (no proxy from the environment); its status and body."""
    conn = http.client.HTTPConnection(host, port, timeout=60)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        answer = conn.getresponse()
        return answer.status, answer.read()
    finally:
        conn.close()


def ignores(pid: int, signum: int) -> bool:
    """Whether process ``pid`` ignores signal ``signum`` (its SigIgn mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigIgn in /proc/{pid}/status")


@pytest.mark.slow
def test_the_preemptible_server_keeps_vllm_on_loopback_and_lets_other_nodes_in_through_serve(
    slurm_cluster: SlurmCluster, work_dir: Path
) -> None:
    """vLLM's development endpoints (VLLM_SERVER_DEV_MODE=1) stay on 127.0.0.1; other nodes reach the
    OpenAI API through hibernate serve on the node's address, its control endpoints behind a token the
    script made (0600); a sleep by Slurm's signal still works with the proxy in the job."""
    address = node_address()
    if address is None:
        pytest.skip("this machine has no address but loopback: nothing to hold vLLM away from")
    slurm, node = slurm_cluster, slurm_cluster.nodes[0]
    standin = slurm.scratch / "vllm-bin" / "vllm"
    standin.parent.mkdir()
    record = slurm.scratch / "vllm-argv"
    standin.write_text(VLLM_STANDIN.format(record=record, files=f"{slurm.scratch}/vllm-$SLURMD_NODENAME"))
    standin.chmod(0o755)
    port = free_ports(2)
    job_id = submit_script(
        slurm, "vllm-preemptible.sbatch", f"--nodelist={node}", "--cpus-per-task=2",
        env={
            "MODEL": "demo", "LISTEN": f"{address}:{port}", "VLLM_PORT": str(port + 1),
            "SNAPSHOTS": str(work_dir), "PATH": f"{standin.parent}{os.pathsep}{slurm.env['PATH']}",
        },
    )  # fmt: skip
    try:
        (demo,) = ready_demos(slurm, job_id, "vllm", [node])
        output = output_of(slurm, job_id)
        wait_until(lambda: "hibernate serve: listening on" in output.read_text(), 60, "the proxy", 0.1)
        started = record.read_text().splitlines()
        assert started[0] == "VLLM_SERVER_DEV_MODE=1"
        assert started[1:] == [
            "serve", "demo", "--host", "127.0.0.1", "--port", str(port + 1),
            "--enable-sleep-mode", "--sleep-mode-backend", "hibernate",
        ]  # fmt: skip
        with pytest.raises(ConnectionRefusedError):  # vLLM, and its development endpoints: not out there
            socket.create_connection((address, port + 1), timeout=10).close()
        direct = ask("127.0.0.1", port + 1, "POST", "/v1/completions", {"model": "demo", "prompt": "x"})
        assert direct[0] == 200

        token_file = slurm.scratch / f"vllm-preemptible-{job_id}.token"
        assert str(token_file) in output.read_text()
        assert token_file.stat().st_mode & 0o777 == 0o600 and token_file.stat().st_uid == os.getuid()
        token = token_file.read_text().strip()
        assert len(token) == 64 and set(token) <= set("0123456789abcdef")
        assert ask(address, port, "POST", "/v1/completions", {"model": "demo", "prompt": "x"}) == direct
        assert ask(address, port, "GET", "/hibernate/models")[0] == 401
        status, models = ask(address, port, "GET", "/hibernate/models", token=token)
        assert status == 200 and json.loads(models)["data"][0]["pid"] == demo.pid
        for dev_path in ("/sleep?level=1", "/collective_rpc", "/is_sleeping"):  # never forwarded
            assert ask(address, port, "POST", dev_path, {})[0] == 404, dev_path

        # Slurm's SIGTSTP reaches every process of the job: the proxy ignores it, so that a request in
        # flight through it is answered and the sleep does not wait on a stopped proxy.
        proxy = next(p for p in psutil.Process(demo.pid).parent().children() if p.pid != demo.pid)
        assert ignores(proxy.pid, signal.SIGTSTP), proxy.cmdline()
        slurm.check("scancel", "--signal=TSTP", "--batch", str(job_id))
        wait_until(lambda: "hibernate run: asleep: pid" in output.read_text(), 60, "the sleep", 0.1)
        assert agent_state(slurm, demo) == "asleep"
        assert ask(address, port, "POST", "/v1/completions", {"model": "demo", "prompt": "x"}) == direct
        assert agent_state(slurm, demo) == "running"  # the request woke it, through the proxy
    finally:
        slurm.cancel(job_id)


def train_env(slurm: SlurmCluster, hibernate_job: Path | str, evaluate: str = "true") -> dict[str, str]:
    return {
        "TRAIN_COMMAND": demo_command(slurm, "trainer"),
        "EVAL_COMMAND": evaluate,
        "PHASES": "2",
        "PHASE_SECONDS": "0",
        "SNAPSHOTS": str(slurm.scratch / "snapshots"),
        "HIBERNATE_JOB": str(hibernate_job),
        "READY_TIMEOUT": "120",
    }


@pytest.mark.slow
def test_a_training_job_sleeps_between_phases_on_every_node(slurm_cluster: SlurmCluster) -> None:
    slurm = slurm_cluster
    evals = slurm.scratch / "evals"
    evals.mkdir()
    # the evaluation records what hibernate says about the trainer on its node
    evaluate = f"hibernate status --job $SLURM_JOB_ID --json >{evals}/$SLURMD_NODENAME-$PHASE"
    job_id = submit_script(
        slurm, "train-phases.sbatch", env=train_env(slurm, SCRIPTS / "hibernate-job", evaluate)
    )
    try:
        output = output_of(slurm, job_id)
        trainers = ready_demos(slurm, job_id, "trainer", slurm.nodes)
        wait_until(
            lambda: "phase 2: trainer awake" in output.read_text(),
            180,
            "both phases",
            0.1,
            detail=output.read_text,
        )
        for trainer in trainers:
            assert trainer.infer() == trainer.reference, trainer.node
            trainer.request("quit")
        info = slurm.wait_state(job_id, "COMPLETED", "FAILED")
        assert info["JobState"] == "COMPLETED", output.read_text()
    finally:
        slurm.cancel(job_id)
    for node in slurm.nodes:
        for phase in (1, 2):
            agents = json.loads((evals / f"{node}-{phase}").read_text())["agents"]
            assert [a["state"] for a in agents] == ["asleep"], (node, phase)
    assert sorted(p.name for p in (slurm.scratch / "snapshots").iterdir()) == slurm.nodes


def train_two_phases_ending_early(slurm: SlurmCluster, wrapper: Path) -> Path:
    """train-phases.sbatch over two phases with ``wrapper`` as its hibernate-job; it must end in failure.

    Returns the job's output file.
    """
    wrapper.chmod(0o755)
    job_id = submit_script(slurm, "train-phases.sbatch", env=train_env(slurm, wrapper))
    try:
        info = slurm.wait_state(job_id, "COMPLETED", "FAILED", timeout=180)
    finally:
        slurm.cancel(job_id)
    output = output_of(slurm, job_id)
    assert info["JobState"] == "FAILED", output.read_text()
    return output


@pytest.mark.slow
def test_a_training_job_ended_early_puts_its_woken_trainer_to_sleep_before_killing_it(
    slurm_cluster: SlurmCluster,
) -> None:
    """A restored CUDA process killed can hang its node: the job's ending sleeps it first."""
    slurm = slurm_cluster
    calls, wrapper = slurm.scratch / "job-calls", slurm.scratch / "hibernate-job-third-fails"
    # The third call (phase 2's sleep) fails, with the trainer woken once: the job ends early.
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$1" >> {calls}\n'
        f'[ "$(wc -l < {calls})" -eq 3 ] && exit 1\n'
        f'exec {SCRIPTS / "hibernate-job"} "$@"\n'
    )
    output = train_two_phases_ending_early(slurm, wrapper)
    assert "phase 1: trainer awake" in output.read_text()
    assert calls.read_text().split() == ["sleep", "wake", "sleep", "sleep"]  # the last: the ending's
    for node in slurm.nodes:  # each trainer's second snapshot: the sleep before it was killed
        assert list((slurm.scratch / "snapshots" / node).glob("*/snap-000002/manifest.json")), node


@pytest.mark.slow
def test_a_training_job_whose_wake_failed_part_way_sleeps_its_trainer_before_killing_it(
    slurm_cluster: SlurmCluster,
) -> None:
    """A wake that failed may have restored the trainer on some nodes: the ending sleeps it all the same."""
    slurm = slurm_cluster
    calls, wrapper = slurm.scratch / "job-calls-wake", slurm.scratch / "hibernate-job-wake-fails"
    # The second call (phase 1's wake) wakes every node, then reports a failure: the job ends early.
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$1" >> {calls}\n'
        f'{SCRIPTS / "hibernate-job"} "$@" || exit\n'
        f'[ "$(wc -l < {calls})" -ne 2 ]\n'
    )
    output = train_two_phases_ending_early(slurm, wrapper)
    assert "phase 1: trainer awake" not in output.read_text()
    assert calls.read_text().split() == ["sleep", "wake", "sleep"]  # the last: the ending's
    for node in slurm.nodes:  # each trainer's second snapshot: the sleep before it was killed
        assert list((slurm.scratch / "snapshots" / node).glob("*/snap-000002/manifest.json")), node


@pytest.mark.slow
def test_the_site_pair_frees_the_memory_before_suspending_and_wakes_after_resuming(
    slurm_cluster: SlurmCluster, work_dir: Path
) -> None:
    slurm = slurm_cluster
    job_id, demos = demo_job(slurm, "serving", slurm.nodes)
    try:
        resident = [d.rss() for d in demos]
        operator = {**slurm.outside_env(), "HIBERNATE_BARRIER_DIR": str(slurm.scratch / "barriers")}
        suspended = slurm.run(
            [str(SCRIPTS / "hibernate-suspend"), str(job_id), "--to", str(work_dir)], operator
        )
        assert suspended.returncode == 0, suspended.stderr
        assert slurm.state(job_id) == "SUSPENDED"
        wait_until(lambda: all(stopped_by_slurm(d.pid) for d in demos), 60, "both demos stopped", 0.05)
        for demo, before in zip(demos, resident, strict=True):
            assert demo.rss() < before - 12 * 2**20  # its 16 MiB of weights are on disk, not in memory
        assert sorted(p.name for p in work_dir.iterdir()) == slurm.nodes

        resumed = slurm.run([str(SCRIPTS / "hibernate-resume"), str(job_id)], operator)
        assert resumed.returncode == 0, resumed.stderr
        assert slurm.state(job_id) == "RUNNING"
        assert [agent_state(slurm, d) for d in demos] == ["running", "running"]
        assert [d.infer() for d in demos] == [d.reference for d in demos]
    finally:
        slurm.cancel(job_id)


@pytest.mark.slow
def test_the_site_pair_does_not_suspend_a_job_that_cannot_sleep(
    slurm_cluster: SlurmCluster, work_dir: Path
) -> None:
    slurm = slurm_cluster
    job_id, demos = demo_job(slurm, "serving-busy", slurm.nodes)
    try:
        demos[1].hold(30)  # node1's program is in a long step: its sleep times out
        operator = {**slurm.outside_env(), "HIBERNATE_BARRIER_DIR": str(slurm.scratch / "barriers")}
        command = [
            str(SCRIPTS / "hibernate-suspend"),
            str(job_id),
            "--to",
            str(work_dir),
            "--",
            "--timeout",
            "1",
        ]
        result = slurm.run(command, operator)
        assert result.returncode == ExitCode.TIMEOUT, result.stderr
        assert "was not suspended" in result.stderr and "every node is awake" in result.stderr
        assert slurm.state(job_id) == "RUNNING"
        assert [agent_state(slurm, d) for d in demos] == ["running", "running"]
        assert [d.infer() for d in demos] == [d.reference for d in demos]
    finally:
        slurm.cancel(job_id)


def test_resume_refuses_a_job_that_is_not_there(slurm_cluster: SlurmCluster) -> None:
    result = slurm_cluster.run([str(SCRIPTS / "hibernate-resume"), "99999"])
    assert result.returncode != 0 and "Invalid job id" in result.stderr, result.stderr
