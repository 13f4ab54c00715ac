"""STAND-IN for Slurm's scontrol: show, suspend and resume jobs of the pretend cluster.

Follows scontrol(1) and slurm.conf(5) where hibernate's scripts depend on it:

- ``scontrol [-o|--oneliner] show job ID``: ``Key=Value`` fields (JobId, JobName, UserId,
  JobState, NodeList, NumNodes, BatchFlag, ExitCode...), one line per record with ``-o``;
  an unknown id prints ``slurm_load_jobs error: Invalid job id specified`` and exits 1;
- ``scontrol suspend ID[,ID...]``: the job becomes SUSPENDED; every process of the job gets
  SIGTSTP, then after PreemptParameters=suspend_grace_time (default 2 s) SIGSTOP. Like the
  real command it returns before the signals are sent (slurmd acts on them afterwards);
- ``scontrol resume ID[,ID...]``: SIGCONT to every process of the job; RUNNING again.

The stand-in does not check privileges (the real suspend/resume need an operator or root).
"""

from __future__ import annotations

import os
import pwd
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_world import World, compress_hostlist


def fail(message: str) -> int:
    sys.stderr.write(f"{message}\n")
    return 1


def show_job(world: World, job_text: str, oneliner: bool) -> int:
    job = world.job(int(job_text)) if job_text.isdigit() else None
    if job is None:
        return fail("slurm_load_jobs error: Invalid job id specified")
    try:
        user = pwd.getpwuid(job["user"]).pw_name
    except KeyError:
        user = str(job["user"])
    code = job["exit_code"] if job["exit_code"] is not None else 0
    lines = [
        [f"JobId={job['job_id']}", f"JobName={job['name']}"],
        [f"UserId={user}({job['user']})", f"GroupId={user}({job['user']})"],
        [f"JobState={job['state']}", "Reason=None", "Dependency=(null)"],
        [
            f"Requeue={1 if job.get('options', {}).get('requeue') else 0}",
            "Restarts=0",
            f"BatchFlag={1 if job.get('batch') else 0}",
            f"ExitCode={code}:0",
        ],
        [f"NodeList={compress_hostlist(job['nodes'])}"],
        [f"NumNodes={len(job['nodes'])}", f"NumCPUs={len(job['nodes'])}", "NumTasks=1"],
        [f"WorkDir={job['submit_dir']}"],
    ]
    if oneliner:
        print(" ".join(field for line in lines for field in line))
    else:
        print("\n".join(("   " if i else "") + " ".join(line) for i, line in enumerate(lines)) + "\n")
    return 0


def suspend(world: World, job_id: int) -> int:
    job = world.job(job_id)
    if job is None:
        return fail(f"Job {job_id}: Invalid job id specified")
    if job["state"] != "RUNNING":
        return fail(f"Job {job_id}: Job is not running (stand-in: it is {job['state']})")
    world.update_job(job_id, lambda record: record.update(state="SUSPENDED"))
    grace = float(world.config["suspend_grace_time"])
    if os.fork() == 0:  # slurmd's part, after the controller has answered
        os.setsid()
        world.signal_job(job_id, signal.SIGTSTP)
        time.sleep(grace)
        if (world.job(job_id) or {}).get("state") == "SUSPENDED":
            world.signal_job(job_id, signal.SIGSTOP)
            world.update_job(job_id, lambda record: record.update(stopped=True))
        os._exit(0)
    return 0


def resume(world: World, job_id: int) -> int:
    job = world.job(job_id)
    if job is None:
        return fail(f"Job {job_id}: Invalid job id specified")
    if job["state"] != "SUSPENDED":
        return fail(f"Job {job_id}: Job is not suspended (stand-in: it is {job['state']})")
    world.update_job(job_id, lambda record: record.update(state="RUNNING", stopped=False))
    world.signal_job(job_id, signal.SIGCONT)
    return 0


def main(argv: list[str]) -> int:
    oneliner = False
    args = []
    for arg in argv:
        if arg in ("-o", "--oneliner"):
            oneliner = True
        elif arg.startswith("-"):
            return fail(f"scontrol: unrecognized option '{arg}'")
        else:
            args.append(arg)
    world = World.from_environment()
    if len(args) == 3 and args[0] == "show" and args[1] in ("job", "jobs"):
        return show_job(world, args[2], oneliner)
    if len(args) == 2 and args[0] in ("suspend", "resume"):
        action = suspend if args[0] == "suspend" else resume
        worst = 0
        for job_text in args[1].split(","):
            if not job_text.isdigit():
                return fail(f"Invalid job id {job_text}")
            worst = max(worst, action(world, int(job_text)))
        return worst
    return fail(f"scontrol (stand-in): unsupported command: {' '.join(argv)}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
