"""Which signals may put a process to sleep or wake it, and the variables that carry them.

Read on both sides: inside the target by the signal handlers (:mod:`.signals`),
and outside it by ``hibernate run``, which checks the signals before it starts
the job and passes them on in the job's environment.
"""

from __future__ import annotations

import signal

from hibernate.errors import UsageError

ENV_SLEEP = "HIBERNATE_ON_SIGNAL"
ENV_WAKE = "HIBERNATE_WAKE_SIGNAL"
ENV_DIR = "HIBERNATE_DIR"
# Set to 1: after a sleep on the sleep signal the process exits (128 + the signal's number), as the
# signal would have ended it, once its snapshot is on disk: a requeued job's program, which a new
# process takes up (HIBERNATE_ADOPT), not a wake.
ENV_EXIT = "HIBERNATE_EXIT_AFTER_SLEEP"
ENV_HANDLED_BY = "HIBERNATE_SIGNALS_HANDLED_BY"


def parse_signal(name: str | int) -> signal.Signals:
    """``USR1``, ``SIGUSR1`` or ``10`` as a signal; a clear error otherwise."""
    text = str(name).strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise UsageError(f"{name!r} is not a signal name (try USR1, USR2, SIGTERM)") from None


# Signals a trigger cannot be: KILL and STOP cannot be caught at all; the fault signals are raised
# by the kernel on a crash (a handler would swallow the crash, and returning from it re-runs the
# faulting instruction); CHLD arrives whenever a child changes state.
_NOT_TRIGGERS: dict[signal.Signals, str] = {
    signal.SIGKILL: "cannot be caught",
    signal.SIGSTOP: "cannot be caught",
    signal.SIGSEGV: "is raised by the kernel when the process crashes",
    signal.SIGBUS: "is raised by the kernel when the process crashes",
    signal.SIGFPE: "is raised by the kernel when the process crashes",
    signal.SIGILL: "is raised by the kernel when the process crashes",
    signal.SIGTRAP: "is raised by the kernel for debuggers",
    signal.SIGABRT: "is raised when the process aborts",
    signal.SIGCHLD: "is sent whenever a child process stops or exits",
}


def trigger_signal(name: str | int, role: str) -> signal.Signals:
    """A signal that may trigger a sleep or wake (``role`` names which option gave it), or a UsageError.

    Checked before anything is started: ``signal.signal`` itself refuses KILL
    and STOP only with an OSError (EINVAL), after the job is running.
    """
    sig = parse_signal(name)
    why = _NOT_TRIGGERS.get(sig)
    if why is not None:
        raise UsageError(
            f"{role} {name}: {sig.name} {why}, so it cannot put a process to sleep or wake it",
            hint="use a signal the job is free to receive: USR1, USR2, or TSTP and CONT for a "
            "scheduler's suspend",
        )
    return sig
