"""STAND-IN for slurmstepd: start one task of a job step on a pretend node, and account for it.

    python slurm_stepd.py JOB STEP NODE INDEX -- COMMAND...   (environment: the task's)

Detaches at once (double fork), so the task is not a child of srun or sbatch,
as on a real cluster where it runs on another machine. Then it starts the
task, keeps the step's ``cgroup.procs`` equal to the task's process tree (a
real cgroup gets a forked child by itself; here it is listed within 50 ms),
forwards SIGTERM/SIGINT to every process of the step, kills the whole step
when srun leaves a kill request (however early), and when the task ends
kills what is left of the step, removes the step's cgroup and writes the exit
status (128+N for a signal, as srun reports it) for the launcher to collect.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_world import World, alive, cgroup_pids, descendants, is_stepd, write_json, write_members

PR_SET_CHILD_SUBREAPER = 36


def step_processes() -> list[int]:
    """This step's processes: below this daemon, but not other steps' daemons it adopted.

    A step daemon started from this step (srun in a batch script) is orphaned
    on purpose and reparented here, the nearest subreaper; on a real cluster it
    would run on its node, in its own step's cgroup.
    """
    return [p for p in descendants(os.getpid(), prune=is_stepd)[1:] if alive(p)]


def reap(keep: int | None) -> None:
    """Collect exited orphans (they are ours, as the subreaper), but never the task itself."""
    for pid in descendants(os.getpid())[1:]:
        if pid != keep:
            with contextlib.suppress(ChildProcessError, OSError):
                os.waitpid(pid, os.WNOHANG)


def main(argv: list[str]) -> int:
    job_id, step, node, index = int(argv[0]), argv[1], argv[2], int(argv[3])
    command = argv[argv.index("--") + 1 :]
    world = World.from_environment()
    if os.fork() > 0:
        os._exit(0)  # the launcher's child returns at once; the step daemon lives on, reparented
    os.setsid()
    # A child subreaper: what the task leaves behind is reparented here, not to init, so it stays
    # in the step (a real cgroup keeps orphans too) and is killed with the step.
    ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    world.stepd_pid_path(job_id, step, index).write_text(str(os.getpid()))
    cgroup = world.task_cgroup(node, job_id, step)
    cgroup.mkdir(parents=True, exist_ok=True)
    kill_request = world.kill_request_path(node, job_id, step)
    try:
        task = subprocess.Popen(command, env=dict(os.environ))
    except OSError as exc:
        sys.stderr.write(f"slurmstepd (stand-in): error: execve(): {command[0]}: {exc.strerror}\n")
        write_json(world.status_path(job_id, step, index), {"exit_code": 2})
        return 0

    world.task_pid_path(job_id, step, index).write_text(str(task.pid))

    def forward(signum: int, frame: object) -> None:
        for pid in cgroup_pids(cgroup):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    listed: list[int] = []
    while task.poll() is None:
        tree = [p for p in step_processes() if alive(p)]
        if kill_request.exists():  # srun ended the step before (or while) the tree was listed
            for pid in tree:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        if tree != listed:
            write_members(cgroup, tree)
            listed = tree
        reap(task.pid)
        time.sleep(0.05)
    code = task.returncode if task.returncode >= 0 else 128 - task.returncode
    for _ in range(50):  # the step is over: nothing of it outlives it
        left = [p for p in step_processes() if alive(p)]
        if not left:
            break
        for pid in left:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
        reap(None)
    shutil.rmtree(cgroup.parent.parent, ignore_errors=True)
    kill_request.unlink(missing_ok=True)
    signalled = task.returncode < 0
    write_json(world.status_path(job_id, step, index), {"exit_code": code, "signalled": signalled})
    if step == "batch":  # the batch script is the job: when it ends, so does everything else of the job
        world.end_job(job_id, 1 if signalled else code)
    with contextlib.suppress(FileNotFoundError):
        world.stepd_pid_path(job_id, step, index).unlink()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
