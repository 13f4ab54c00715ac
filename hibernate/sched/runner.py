"""``hibernate run``: start a job under a wrapper that hibernates it on the scheduler's signal.

    hibernate run --on-signal USR1 --to DIR -- python train.py

The wrapper starts the command as its child and waits for it. When the sleep
signal arrives (Slurm's ``--signal=B:USR1@120`` warning, or ``kill -USR1``),
it puts the child's whole process tree to sleep from outside, CUDA stage
included; the wake signal (or ``hibernate wake <pid>`` from anywhere) wakes it.
SIGTERM and SIGHUP are passed on to the child; the wrapper exits with the
child's status. The child is told (HIBERNATE_SIGNALS_HANDLED_BY) to ignore the
two signals itself, so a signal sent to every process of a job step does not
kill it.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from hibernate import orchestrator
from hibernate.agent.triggers import ENV_HANDLED_BY, ENV_SLEEP, ENV_WAKE, trigger_signal
from hibernate.errors import HibernateError, UsageError

FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def _log(message: str) -> None:
    print(f"hibernate run: {message}", file=sys.stderr, flush=True)


def child_environment(sleep_signal: signal.Signals, wake_signal: signal.Signals | None) -> dict[str, str]:
    env = dict(os.environ)
    env[ENV_HANDLED_BY] = str(os.getpid())
    env[ENV_SLEEP] = sleep_signal.name
    if wake_signal is not None:
        env[ENV_WAKE] = wake_signal.name
    return env


def run(
    command: Sequence[str],
    directory: Path,
    sleep_signal: str,
    wake_signal: str | None,
    options: orchestrator.Options,
    *,
    on_report: Callable[[str, dict[str, object]], None] | None = None,
) -> int:
    """Run ``command`` until it exits, hibernating it on signals; returns its exit status."""
    if not command:
        raise UsageError("no command given", hint="hibernate run --to DIR -- CMD [ARGS...]")
    sleep_sig = trigger_signal(sleep_signal, "--on-signal")
    wake_sig = trigger_signal(wake_signal, "--wake-signal") if wake_signal else None
    if wake_sig == sleep_sig or sleep_sig in FORWARDED or wake_sig in FORWARDED:
        raise UsageError("the sleep and wake signals must differ from each other and from TERM/HUP")
    directory = Path(directory).expanduser().absolute()
    # SimpleQueue: its put is safe in a signal handler, which interrupts the main thread wherever it
    # is, possibly inside a Queue.get that holds the lock a Queue.put would wait for.
    requests: queue.SimpleQueue[str] = queue.SimpleQueue()

    def request(kind: str) -> Callable[[int, FrameType | None], None]:
        return lambda signum, frame: requests.put(kind)

    previous = {
        sig: signal.signal(sig, request("sleep" if sig == sleep_sig else "wake"))
        for sig in ([sleep_sig, wake_sig] if wake_sig else [sleep_sig])
    }
    try:
        child = subprocess.Popen(list(command), env=child_environment(sleep_sig, wake_sig))
    except OSError as exc:
        raise UsageError(f"cannot start {command[0]!r}: {exc.strerror}") from exc
    for sig in FORWARDED:
        previous[sig] = signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    _log(
        f"started pid {child.pid}; {sleep_sig.name} puts it to sleep in {directory}"
        + (f", {wake_sig.name} wakes it" if wake_sig else "")
        + f" (or: hibernate wake {child.pid})"
    )
    try:
        while child.poll() is None:
            try:
                kind = requests.get(timeout=0.2)
            except queue.Empty:
                continue
            _act(kind, child.pid, directory, options, on_report)
        return child.returncode if child.returncode >= 0 else 128 - child.returncode
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _act(
    kind: str,
    pid: int,
    directory: Path,
    options: orchestrator.Options,
    on_report: Callable[[str, dict[str, object]], None] | None,
) -> None:
    try:
        report: orchestrator.SleepReport | orchestrator.WakeReport = (
            orchestrator.sleep([pid], directory, options)
            if kind == "sleep"
            else orchestrator.wake([pid], options)
        )
    except HibernateError as exc:
        _log(f"{kind} of pid {pid} failed (exit code {int(exc.exit_code)}): {exc}")
        return
    _log(f"{'asleep' if kind == 'sleep' else 'awake'}: pid {pid} in {report.seconds:.2f}s")
    if on_report is not None:
        on_report(kind, report.to_wire())
