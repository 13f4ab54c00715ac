"""STAND-IN for Slurm's srun: launch a job step, one task per node, on the pretend cluster.

Follows srun(1) where hibernate's scripts depend on it:

- a step runs inside an existing job: ``--jobid`` or ``SLURM_JOB_ID`` (it never allocates);
- ``-N/--nodes``, ``-n/--ntasks``, ``--ntasks-per-node`` (one task per node only, here);
- without ``--overlap``, a step is not started while another step of the job that did not
  ask for ``--overlap`` runs (real srun waits, "Job step creation temporarily disabled,
  retrying"; the stand-in refuses at once so a missing ``--overlap`` fails a test fast);
- no step starts in a job that is not RUNNING (a SUSPENDED job, say);
- the tasks get the caller's environment plus the SLURM_* variables srun documents
  (SLURM_JOB_ID, SLURM_STEP_ID, SLURM_NODEID, SLURM_PROCID, SLURM_NNODES,
  SLURM_STEP_NUM_NODES, SLURMD_NODENAME, ...);
- ``-K/--kill-on-bad-exit[=0|1]`` and ``-W/--wait=S`` default to the site's KillOnBadExit and
  WaitTime; when they apply, the remaining tasks are terminated;
- SIGINT and SIGTERM are passed on to every task;
- the exit status is the highest exit code of all tasks (128+N for a task killed by signal N).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_world import World

WITH_VALUE = {
    "-N": "nodes",
    "--nodes": "nodes",
    "-n": "ntasks",
    "--ntasks": "ntasks",
    "--ntasks-per-node": "ntasks_per_node",
    "-W": "wait",
    "--wait": "wait",
    "--jobid": "jobid",
    "-J": "job_name",
    "--job-name": "job_name",
    "--gres": "gres",
    "-D": "chdir",
    "--chdir": "chdir",
    "--export": "export",
}
FLAGS = {"--overlap": "overlap", "-s": "overlap", "--oversubscribe": "overlap"}


def fail(message: str, code: int = 1) -> int:
    sys.stderr.write(f"srun: error: {message}\n")
    return code


def parse(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    options: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-"):
            return options, argv[i:]
        if arg == "--":
            return options, argv[i + 1 :]
        name, eq, value = arg.partition("=")
        if not arg.startswith("--") and len(arg) > 2 and arg[:2] in WITH_VALUE:  # -N2, -W0
            name, eq, value = arg[:2], "=", arg[2:]
        if arg.startswith("-K") or name == "--kill-on-bad-exit":
            value = arg[2:] if arg.startswith("-K") else value
            options["kill_on_bad_exit"] = value or "1"
        elif name in FLAGS:
            options[FLAGS[name]] = "1"
        elif name in WITH_VALUE:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(fail(f"option '{name}' requires an argument"))
                i += 1
                value = argv[i]
            options[WITH_VALUE[name]] = value
        else:
            sys.stderr.write(f"srun: unrecognized option '{arg}'\nTry \"srun --help\" for more information\n")
            raise SystemExit(1)
        i += 1
    return options, []


def main(argv: list[str]) -> int:
    options, command = parse(argv)
    if not command:
        return fail("no executable given")
    world = World.from_environment()
    job_text = options.get("jobid") or os.environ.get("SLURM_JOB_ID")
    if not job_text:
        return fail("the stand-in srun only launches steps in an existing job: set SLURM_JOB_ID or --jobid")
    job_id = int(job_text)
    job = world.job(job_id)
    if job is None:
        return fail(f"Unable to confirm allocation for job {job_id}: Invalid job id specified")
    if job["state"] != "RUNNING":
        return fail(f"Unable to create step for job {job_id}: job is {job['state']} (stand-in)")
    nodes = int(options.get("nodes", len(job["nodes"])))
    ntasks = int(options.get("ntasks", nodes))
    per_node = int(options.get("ntasks_per_node", 1))
    if nodes > len(job["nodes"]) or nodes < 1:
        return fail(f"Unable to create step for job {job_id}: requested node configuration is not available")
    if per_node != 1 or ntasks != nodes:
        return fail("the stand-in srun runs exactly one task per node (--ntasks-per-node=1, -n equal to -N)")
    overlap = "overlap" in options
    config = world.config
    kill_on_bad_exit = int(options.get("kill_on_bad_exit", config["KillOnBadExit"])) != 0
    wait_time = float(options.get("wait", config["WaitTime"]))

    def claim(record: dict) -> str | None:
        running = [s for s, info in record["steps"].items() if not info["overlap"] and _alive(info["srun"])]
        if not overlap and running:
            return None
        step = str(record["next_step"])
        record["next_step"] += 1
        record["steps"][step] = {"srun": os.getpid(), "overlap": overlap}
        return step

    step = world.update_job(job_id, claim)
    if step is None:
        return fail(
            f"Job {job_id} step creation temporarily disabled, retrying (Requested nodes are busy) "
            "[the stand-in does not wait: pass --overlap]"
        )
    chosen = job["nodes"][:nodes]
    indexes = world.launch(job, step, chosen, command, dict(os.environ), cwd=options.get("chdir"))

    def forward(signum: int, frame: object) -> None:
        for index in indexes:
            pid = world.stepd_pid(job_id, step, index)
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    codes: dict[int, int] = {}
    first_end: float | None = None
    terminated = False
    try:
        while len(codes) < len(indexes):
            for index in indexes:
                if index not in codes:
                    code = world.step_status(job_id, step, index)
                    if code is not None:
                        codes[index] = code
                        first_end = first_end or time.monotonic()
            if not terminated and len(codes) < len(indexes):
                bad = kill_on_bad_exit and any(c != 0 for c in codes.values())
                late = wait_time > 0 and first_end is not None and time.monotonic() - first_end > wait_time
                if bad or late:
                    sys.stderr.write(
                        "srun: error: "
                        + (
                            "a task exited with a non-zero code"
                            if bad
                            else f"first task ended {wait_time:g}s ago"
                        )
                        + "; terminating the job step's remaining tasks\n"
                    )
                    for node in chosen:  # as slurmstepd does: SIGKILL every process of the step
                        world.kill_step(node, job_id, step)
                    terminated = True
            time.sleep(0.02)
    finally:
        world.update_job(job_id, lambda record: record["steps"].pop(step, None))
    return max(codes.values(), default=0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
