"""STAND-IN for Slurm's sbatch: submit a batch script to the pretend cluster; it starts at once.

Follows sbatch(1) where hibernate's example scripts depend on it:

- options from ``#SBATCH`` lines at the top of the script (before its first command), then from
  the command line, which wins: -N/--nodes, -J/--job-name, -o/--output, -e/--error (``%j`` and
  ``%x`` expanded), --signal, --requeue/--no-requeue, -t/--time, --gres, --gpus-per-node, -n,
  --ntasks-per-node, -c, --mem, -p/--partition, --exclusive (the last ones only recorded);
- the script must start with ``#!``; it runs on the first node of the allocation with the
  submitting environment (--export=ALL) plus SLURM_JOB_ID, SLURM_JOB_NUM_NODES, SLURM_NNODES,
  SLURM_JOB_NODELIST, SLURMD_NODENAME, SLURM_SUBMIT_DIR...; output goes to slurm-%j.out;
- prints ``Submitted batch job ID`` (``--parsable``: ``ID``);
- ``-W/--wait`` waits for the job and exits with its exit code (1 if a signal ended it).

The stand-in never queues: the job starts as soon as it is submitted, on nodes
that may be running other jobs.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_world import World

WITH_VALUE = {
    "-N": "nodes",
    "--nodes": "nodes",
    "-J": "job_name",
    "--job-name": "job_name",
    "-o": "output",
    "--output": "output",
    "-e": "error",
    "--error": "error",
    "--signal": "signal",
    "-t": "time",
    "--time": "time",
    "--gres": "gres",
    "--gpus-per-node": "gpus_per_node",
    "-n": "ntasks",
    "--ntasks": "ntasks",
    "--ntasks-per-node": "ntasks_per_node",
    "-c": "cpus_per_task",
    "--cpus-per-task": "cpus_per_task",
    "--mem": "mem",
    "-p": "partition",
    "--partition": "partition",
}
FLAGS = {
    "--requeue": "requeue",
    "--no-requeue": "no_requeue",
    "--exclusive": "exclusive",
    "-W": "wait",
    "--wait": "wait",
    "--parsable": "parsable",
}


def fail(message: str) -> int:
    sys.stderr.write(f"sbatch: error: {message}\n")
    return 1


def parse(argv: list[str], options: dict[str, str], *, until_script: bool) -> list[str]:
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-") or arg == "-":
            if until_script:
                return argv[i:]
            raise SystemExit(fail(f"unexpected argument {arg!r} in an #SBATCH line"))
        name, eq, value = arg.partition("=")
        if not arg.startswith("--") and len(arg) > 2 and arg[:2] in WITH_VALUE:  # -N2, -W0
            name, eq, value = arg[:2], "=", arg[2:]
        if name in FLAGS:
            options[FLAGS[name]] = "1"
        elif name in WITH_VALUE:
            if not eq:
                if i + 1 >= len(argv):
                    raise SystemExit(fail(f"option '{name}' requires an argument"))
                i += 1
                value = argv[i]
            options[WITH_VALUE[name]] = value
        else:
            sys.stderr.write(
                f"sbatch: unrecognized option '{arg}'\nTry \"sbatch --help\" for more information\n"
            )
            raise SystemExit(1)
        i += 1
    return []


def directives(script: Path) -> list[str]:
    """The arguments of the ``#SBATCH`` lines before the script's first command."""
    found: list[str] = []
    for line in script.read_text().splitlines()[1:]:
        stripped = line.strip()
        if stripped.startswith("#SBATCH"):
            found.extend(shlex.split(stripped[len("#SBATCH") :], comments=True))
        elif stripped and not stripped.startswith("#"):
            break
    return found


def main(argv: list[str]) -> int:
    cli: dict[str, str] = {}
    rest = parse(argv, cli, until_script=True)
    if not rest:
        return fail("the stand-in sbatch needs a script file (no script on stdin)")
    script, args = Path(rest[0]), rest[1:]
    if not script.is_file():
        return fail(f"Unable to open file {script}")
    if not script.read_text().startswith("#!"):
        return fail(
            "This does not look like a batch script.  The first line must start with #! followed by "
            "the path to an interpreter."
        )
    options: dict[str, str] = {}
    parse(directives(script), options, until_script=False)
    options.update(cli)
    world = World.from_environment()
    nodes = int(options.get("nodes", "1").split("-")[0])
    name = options.get("job_name", script.name)
    try:
        job = world.allocate(nodes, name, batch=True, options=options)
    except ValueError as exc:
        return fail(f"Batch job submission failed: Requested node configuration is not available ({exc})")
    job_id = job["job_id"]
    spool = world.root / "spool"
    spool.mkdir(exist_ok=True)
    copy = spool / f"job{job_id}.script"
    shutil.copyfile(script, copy)
    copy.chmod(0o700)

    def expand(pattern: str) -> str:
        return pattern.replace("%j", str(job_id)).replace("%x", name)

    output = Path(expand(options.get("output", "slurm-%j.out")))
    error = Path(expand(options["error"])) if "error" in options else output
    with open(output, "ab") as out, open(error, "ab") if error != output else open(os.devnull, "wb") as err:
        world.launch(
            job,
            "batch",
            [job["nodes"][0]],
            [str(copy), *args],
            dict(os.environ),
            stdout=out.fileno(),
            stderr=(err.fileno() if error != output else out.fileno()),
        )
    print(str(job_id) if "parsable" in options else f"Submitted batch job {job_id}", flush=True)
    if "wait" not in options:
        return 0
    while True:
        record = world.job(job_id)
        if record is not None and record["exit_code"] is not None:
            return int(record["exit_code"])
        time.sleep(0.05)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
