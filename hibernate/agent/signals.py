"""Hibernate on a signal: a batch scheduler's warning signal puts the process to sleep.

Slurm can warn a job before preempting it (``--signal=USR1@120``). A process
that sets ``HIBERNATE_ON_SIGNAL=USR1`` (or passes ``on_signal`` to
``hibernate.track``) sleeps into ``HIBERNATE_DIR`` when that signal arrives,
and wakes on ``HIBERNATE_WAKE_SIGNAL`` or on ``hibernate wake PID``. The work
runs on a thread of its own: a signal handler runs on the main thread, which may
be inside ``hibernate.guard()``, and a sleep waits for the guard.

With ``HIBERNATE_EXIT_AFTER_SLEEP=1`` (``exit_after_sleep``) the process exits
once that sleep has ended, done or failed, with the status the signal would have
given it (128 + its number): the signal's own effect, deferred until the
snapshot is on disk. That is a requeued job's program on SIGTERM: the next run
is a new process that adopts the snapshot (``HIBERNATE_ADOPT``). A signal that
comes while such a run has adopted only part of its snapshot (between two
``track`` calls) writes none, and the process exits (see agent.adopt).

Under ``hibernate run`` the wrapper does the sleep from outside (so the CUDA
stage runs too) and sets ``HIBERNATE_SIGNALS_HANDLED_BY``: the agent then only
ignores the signals, so that one sent to the whole job step does not kill it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hibernate.agent.adopt import unfinished_adoption
from hibernate.agent.controller import Agent
from hibernate.agent.triggers import ENV_DIR, ENV_EXIT, ENV_HANDLED_BY, ENV_SLEEP, ENV_WAKE, trigger_signal
from hibernate.environ import ALLOW_MOVES_ENV, env_flag
from hibernate.errors import HibernateError, UsageError, WrongStateError


def _log(message: str) -> None:
    print(f"hibernate: {message}", file=sys.stderr, flush=True)


class _SignalWork:
    """Runs what the handlers ask for, in order, on one thread of its own.

    A handler only puts the work on a SimpleQueue, whose put is safe there: the handler
    interrupts the main thread wherever it is, and starting a thread takes locks that thread
    might hold at that moment.
    """

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Callable[[], Any], str, int | None]] = queue.SimpleQueue()
        threading.Thread(target=self._run_forever, name="hibernate-signals", daemon=True).start()

    def ask(self, work: Callable[[], Any], what: str, exit_status: int | None = None) -> None:
        """Run ``work``; with ``exit_status``, end the process with it afterwards, whatever the outcome."""
        self._requests.put((work, what, exit_status))

    def _run_forever(self) -> None:
        while True:
            work, what, exit_status = self._requests.get()
            try:
                work()
                _log(f"{what}: done")
            except HibernateError as exc:
                _log(f"{what} failed: {exc}")
            except BaseException as exc:
                if exit_status is None:
                    raise
                _log(f"{what} failed: {type(exc).__name__}: {exc}")
            if exit_status is not None:
                _exit(exit_status)


def _exit(status: int) -> None:
    """End the process now, from this thread (the main one may be waiting in guard() for a wake that
    will not come): what Python buffered for stdout and stderr is written first."""
    _log(f"exiting with status {status} ({ENV_EXIT})")
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # closed, or replaced by None
            stream.flush()
    os._exit(status)


def install(
    agent: Agent,
    sleep_signal: str | int,
    wake_signal: str | int | None,
    directory: Path | None,
    *,
    only_ignore: bool = False,
    timeout: float = 30.0,
    exit_after_sleep: bool = False,
) -> None:
    """Make ``sleep_signal`` hibernate this process (and ``wake_signal`` wake it); with
    ``exit_after_sleep``, the process then exits with 128 + the signal's number."""
    if threading.current_thread() is not threading.main_thread():
        raise UsageError("signal handlers can only be installed from the main thread")
    signals = [trigger_signal(sleep_signal, "sleep signal")]
    if wake_signal:
        signals.append(trigger_signal(wake_signal, "wake signal"))
    if only_ignore:
        for sig in signals:
            signal.signal(sig, signal.SIG_IGN)
        return
    target = directory or agent.default_dir
    if target is None:
        raise UsageError(f"{ENV_SLEEP} needs a snapshot directory", hint=f"set {ENV_DIR} or pass to=...")

    args = {"allow_moves": env_flag(os.environ, ALLOW_MOVES_ENV)}  # read here: a handler must not fail

    worker = _SignalWork()

    def sleep() -> None:
        unfinished = unfinished_adoption()  # HIBERNATE_ADOPT between two track() calls
        if unfinished is not None:
            raise WrongStateError(f"not slept: {unfinished}")
        agent.sleep_here(target, timeout, args)

    def on_sleep(signum: int, frame: object) -> None:
        then = 128 + signum if exit_after_sleep else None
        worker.ask(sleep, "sleep on signal", then)

    def on_wake(signum: int, frame: object) -> None:
        worker.ask(lambda: agent.wake_here({}), "wake on signal")

    signal.signal(signals[0], on_sleep)
    if len(signals) > 1:
        signal.signal(signals[1], on_wake)


def install_from_environment(agent: Agent, environ: dict[str, str]) -> None:
    """Apply HIBERNATE_ON_SIGNAL / HIBERNATE_WAKE_SIGNAL / HIBERNATE_DIR /
    HIBERNATE_EXIT_AFTER_SLEEP, if set."""
    sleep_signal = environ.get(ENV_SLEEP)
    if not sleep_signal:
        return
    directory = Path(environ[ENV_DIR]).expanduser().absolute() if environ.get(ENV_DIR) else None
    install(
        agent,
        sleep_signal,
        environ.get(ENV_WAKE) or None,
        directory,
        only_ignore=bool(environ.get(ENV_HANDLED_BY)),
        exit_after_sleep=env_flag(environ, ENV_EXIT),
    )
