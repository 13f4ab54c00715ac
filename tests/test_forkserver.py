"""The suite's fork server (tests/forkserver.py) records every exit, even one during a status read."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.conftest import REPO

# In a process of its own: the handler and the signal mask are process-wide.
EXIT_DURING_A_READ = textwrap.dedent(
    """
    import os, signal, time
    from tests import forkserver

    signal.signal(signal.SIGCHLD, forkserver._reap)
    with forkserver._sigchld_held():
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        # The child is a zombie, its SIGCHLD pending: the handler must not run inside the block.
        deadline = time.monotonic() + 30
        while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
            assert time.monotonic() < deadline, "the child did not exit"
            time.sleep(0.01)
        assert pid not in forkserver._exited, "an exit was recorded while SIGCHLD was held"
    assert forkserver._exited.get(pid) == 7, forkserver._exited
    print("recorded")
    """
)


def test_an_exit_during_a_status_read_is_recorded_when_the_read_ends() -> None:
    # A lock shared with the handler deadlocked the server here: the handler runs in the main
    # thread, which held the lock. The run's timeout turns such a hang into a failure.
    done = subprocess.run(
        [sys.executable, "-c", EXIT_DURING_A_READ],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "recorded", done.stderr
