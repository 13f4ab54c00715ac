"""A training job that Slurm preempts and requeues: the same program in every run of the job.

    python -m tests.requeue_program STEPS [RUN:STEP ...]

Trains STEPS steps of tests/adopt_program's model (tied weights, a LayerNorm, a
BatchNorm's running statistics, AdamW), each step on a batch drawn from the
step's number, so that a run going on from step K trains on what an
uninterrupted run trains on there. Its progress is a tensor it tracks with the
model and the optimizer: run under HIBERNATE_ADOPT (requeue-resume.sbatch does
that when SLURM_RESTART_COUNT > 0), it goes on from the step its predecessor
slept at, and says so (``resumed at step K``; ``started at step 0`` otherwise).

``RUN:STEP``: in run RUN of the job (SLURM_RESTART_COUNT, 0 for the first), it
stops before step STEP and waits, holding nothing, for the scheduler's signal
(``waiting at step STEP``); under HIBERNATE_ON_SIGNAL=TERM and
HIBERNATE_EXIT_AFTER_SLEEP=1 that signal puts it to sleep and ends it. At the
end it prints ``done: {"steps": N, "digest": ...}``, the digest of its weights,
buffers and optimizer state.

REQUEUE_PROGRAM_FAULT=RUN:POINT:ACTION sets HIBERNATE_FAULT=POINT:ACTION in run
RUN only (a sleep cut short in that run).

The tests import this module for ``command`` and ``results`` only: torch is
imported when the program runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from typing import Any

FAULT_ENV = "REQUEUE_PROGRAM_FAULT"


def command(steps: int, *waits: str) -> list[str]:
    """The program's command line, with this interpreter."""
    return [sys.executable, "-m", "tests.requeue_program", str(steps), *waits]


def results(output: str) -> list[dict[str, Any]]:
    """Every ``done:`` document in an output (one per process that finished)."""
    return [json.loads(found) for found in re.findall(r"^done: (\{.*\})$", output, re.MULTILINE)]


def uninterrupted(steps: int, env: dict[str, str], cwd: str) -> str:
    """The digest the program ends with after ``steps`` steps in one go (run here, as a process)."""
    import subprocess

    result = subprocess.run(command(steps), cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "started at step 0" in result.stdout, result.stdout
    (done,) = results(result.stdout)
    assert done["steps"] == steps, done
    return str(done["digest"])


def main(argv: list[str]) -> int:
    import torch

    import hibernate
    from tests.adopt_program import build, digest

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, 50, (32,), generator=generator)
        return tokens, torch.randint(0, 50, (32,), generator=generator)

    steps = int(argv[0])
    run = int(os.environ.get("SLURM_RESTART_COUNT") or 0)
    waits = {int(stop) for spec in argv[1:] for at, stop in [spec.split(":")] if int(at) == run}
    fault = os.environ.get(FAULT_ENV, "")
    if fault:
        at, point = fault.split(":", 1)
        if int(at) == run:
            os.environ["HIBERNATE_FAULT"] = point
    torch.set_num_threads(1)  # the same arithmetic in every run, whatever CPUs it is given

    model, optimizer = build("")
    progress = torch.zeros((), dtype=torch.int64)
    hibernate.track(model, name="model")
    hibernate.track(optimizer, name="optimizer")
    hibernate.track(progress, name="progress")
    with hibernate.guard():
        start = int(progress)
    print(f"resumed at step {start}" if start else "started at step 0", flush=True)
    while True:
        with hibernate.guard():
            step = int(progress)
        if step >= steps:
            break
        if step in waits:
            waits.discard(step)
            print(f"waiting at step {step}", flush=True)
            while True:  # until the signal's sleep ends the process
                signal.pause()
        tokens, targets = batch(step)
        with hibernate.guard():
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(tokens), targets).backward()
            optimizer.step()
            progress += 1
    with hibernate.guard():
        print("done: " + json.dumps({"steps": int(progress), "digest": digest(model, optimizer)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
