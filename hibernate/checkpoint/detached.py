"""Driver calls that nothing cuts: a process of their own session, waited for but never killed.

A checkpoint or restore stopped half-way can leave the target in the driver's
failed state, where only restarting it recovers. So both checkpointers make
these calls from a process started in a session of its own (the driver
checkpointer from :mod:`hibernate.checkpoint.driver_call`, the binary
checkpointer from ``cuda-checkpoint`` itself): a Ctrl-C to hibernate, a
SIGKILL of it, or its exit does not reach the call. Its output goes to
unlinked files, not pipes, so a write after hibernate is gone cannot kill it
with SIGPIPE either. hibernate waits for it up to the step's timeout, then
stops waiting and says so; it never kills it.

Before waiting, the starter is told (``on_start``) so that the operation can
journal the process (pid and start time): a later command waits for it
rather than act on the same target over it. Such a call is gated: it makes no
call until it has read ``go``, written only once that is done
(:mod:`hibernate.checkpoint.driver_call`, whose ``--exec`` puts the same gate
in front of ``cuda-checkpoint``).

:class:`Strays` keeps, per target, a call still running whose wait gave up
within this command (its timeout, or a Ctrl-C inside the wait): the next call
for that target waits for it (bounded) instead of overlapping it, and says so.
Once a wait gives up, a daemon thread reaps the process when it ends, so that
a long-lived caller keeps no zombie and no descriptor behind.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from hibernate import procinfo
from hibernate.checkpoint import HELPER_ENV, driver_call
from hibernate.checkpoint.base import CheckpointStepError, DetachedCall
from hibernate.checkpoint.curesult import CuError
from hibernate.checkpoint.driver_call import GO
from hibernate.procinfo import ProcessIdentity

# The gate (and the driver's own call), run by path with python -I -S: it imports nothing of hibernate.
CALL_PROGRAM = Path(driver_call.__file__)


class CannotStartError(OSError):
    """The program itself could not be started (not what it or ``on_start`` did once it was)."""


class Detached:
    """One process in a session of its own, its output in unlinked files; waited for, never killed."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        pid: int,
        step: str,
        what: str,
        gated: bool,
        env: Mapping[str, str] | None = None,
        on_start: Callable[[DetachedCall], None] | None = None,
    ) -> None:
        """Start ``argv``; tell ``on_start`` (when given) before it may act; then let a gated one go.

        A gated program makes its call only once it has read ``go`` (driver_call), so only a gated
        one can be journaled before it acts. If ``on_start`` raises, it is told to make no call and
        is waited for, and the error is raised.
        """
        if on_start is not None and not gated:
            raise ValueError("only a gated call can be told of before it acts")
        self.name = f"{what}({pid})"
        self._stdout: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 (kept past __init__, closed in _close)
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115
        self._output: tuple[str, str] | None = None
        try:
            self.proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE if gated else subprocess.DEVNULL,
                stdout=self._stdout,
                stderr=self._stderr,
                env=dict(env) if env is not None else None,
                start_new_session=True,  # no signal to hibernate's session, nor its end, reaches it
                close_fds=True,
            )
        except OSError as exc:
            self._close()
            raise CannotStartError(exc.errno, exc.strerror) from exc
        except BaseException:
            self._close()
            raise
        self._pidfd: int | None = None
        self._reaper: threading.Thread | None = None  # reaps it once a wait has given up
        self._ended = threading.Event()  # set by the reaper
        with contextlib.suppress(AttributeError, OSError):  # Linux 5.3+; Popen.wait polls otherwise
            self._pidfd = os.pidfd_open(self.proc.pid)
        helper = procinfo.identity(self.proc.pid) or ProcessIdentity(self.proc.pid, 0)
        self.call = DetachedCall(pid, step, what, helper)
        try:
            if on_start is not None:
                on_start(self.call)
        except BaseException:
            self._let_go(b"")
            self.proc.wait()
            self._close_pidfd()
            self._close()
            raise
        if gated:
            self._let_go(GO)

    def _let_go(self, word: bytes) -> None:
        stdin = self.proc.stdin
        assert stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died at once: its exit status says so
            stdin.write(word)
        with contextlib.suppress(BrokenPipeError):
            stdin.close()

    def wait(self, timeout: float | None) -> bool:
        """Whether it has exited within ``timeout`` seconds (None: wait for ever). It is never killed.

        Once a wait has given up (its timeout, or an exception such as a Ctrl-C
        raised inside it), a daemon thread reaps the process when it ends and
        lets go of its pidfd and files, so that a long-lived caller (``serve``)
        keeps neither a zombie nor a descriptor per call; later waits wait for
        that thread.
        """
        if self._reaper is not None:
            return self._ended.wait(timeout)
        try:
            exited = self._wait_here(timeout)
        except BaseException:
            self._hand_to_reaper()
            raise
        if not exited:
            self._hand_to_reaper()
            return False
        self._settle()
        return True

    def _wait_here(self, timeout: float | None) -> bool:
        if self.proc.returncode is None and self._pidfd is not None:
            # Woken the moment it exits (Popen.wait with a timeout polls, up to 50 ms late). poll, not
            # select: a caller holding over 1024 descriptors gets a pidfd that select cannot take.
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            if not poller.poll(None if timeout is None else max(0, math.ceil(timeout * 1000))):
                return False
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _hand_to_reaper(self) -> None:
        self._reaper = threading.Thread(target=self._reap, name=f"reap {self.name}", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        self.proc.wait()
        self._settle()
        self._ended.set()

    def _settle(self) -> None:
        """It has exited and been reaped: keep its output, let go of its pidfd and files."""
        texts = []
        for stream in (self._stdout, self._stderr):
            stream.seek(0)
            texts.append(stream.read().decode("utf-8", "replace"))
        self._output = (texts[0], texts[1])
        self._close_pidfd()
        self._close()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def output(self) -> tuple[str, str]:
        """Its stdout and stderr, once :meth:`wait` has said it exited."""
        if self._output is None:
            raise RuntimeError(f"{self.name} has not been waited for to its end")
        return self._output

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _close(self) -> None:
        for stream in (self._stdout, self._stderr):
            if not stream.closed:
                stream.close()


@dataclass
class _Stray:
    name: str
    wait: Callable[[float | None], bool]
    outcome: Callable[[], str]  # what it returned, in words, once it has


class Strays:
    """Per target pid, a call that may still be running: later calls for that pid wait for it first.

    A call is added before it is waited for, and discarded once it has returned to
    its caller: one whose wait gave up (its timeout, or a Ctrl-C inside it) stays.
    """

    def __init__(self) -> None:
        self._by_pid: dict[int, _Stray] = {}
        self._lock = threading.Lock()
        self._waits: list[str] = []

    def add(
        self, pid: int, name: str, wait: Callable[[float | None], bool], outcome: Callable[[], str]
    ) -> None:
        with self._lock:
            self._by_pid[pid] = _Stray(name, wait, outcome)

    def discard(self, pid: int, name: str) -> None:
        """The call ``name`` for ``pid`` returned while waited for: nothing stray is left of it."""
        with self._lock:
            stray = self._by_pid.get(pid)
            if stray is not None and stray.name == name:
                del self._by_pid[pid]

    def settle(self, pid: int, step: str, function_name: str, bound: float) -> None:
        """Wait (at most ``bound`` seconds) for a call for ``pid`` still running: never overlap."""
        with self._lock:
            stray = self._by_pid.get(pid)
        if stray is None:
            return
        started = time.perf_counter()
        if not stray.wait(bound):
            raise CheckpointStepError(
                pid,
                step,
                CuError(
                    None,
                    "not called",
                    f"{stray.name}, which was still running, had not returned {bound:g}s later; "
                    f"{function_name}({pid}) was not called over it",
                ),
                how=function_name,
                timed_out=True,
            )
        waited = time.perf_counter() - started
        with self._lock:
            if self._by_pid.get(pid) is stray:
                del self._by_pid[pid]
            self._waits.append(
                f"{function_name}({pid}) waited {waited:.1f}s for {stray.name}, which was still running, "
                f"to return ({stray.outcome()})"
            )

    def waits(self) -> list[str]:
        """The calls that waited for an earlier, timed-out call for the same process, since last asked."""
        with self._lock:
            waits, self._waits = self._waits, []
        return waits


def still_running(call: DetachedCall, timeout: float, how: str) -> CheckpointStepError:
    """The error of a checkpoint or restore that outlived ``timeout`` and runs on."""
    return CheckpointStepError(
        call.pid,
        call.step,
        CuError(
            None,
            "still running",
            f"{call.what} did not return within {timeout:g}s and is still running in process "
            f"{call.helper.pid}; it was not cut (a {call.step} stopped half-way can leave the process "
            "in the driver's failed state)",
        ),
        how=how,
        timed_out=True,
        running=call,
    )


def helper_environment(pid: int) -> dict[str, str]:
    """The environment of a helper acting on ``pid``: marked as hibernate's own, never a CUDA holder."""
    return {**os.environ, HELPER_ENV: str(pid)}
