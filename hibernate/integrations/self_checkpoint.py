"""A vLLM worker that takes its own CUDA state off the GPU: ``HIBERNATE_SELF_CHECKPOINT=1``.

A process cannot lock or checkpoint itself (its own CUDA calls would block on
the lock it asked for), so each worker starts one helper process, a child it
keeps for its lifetime and speaks to over a pipe (one JSON line each way):

    python -m hibernate.checkpoint.helper --target <worker pid>

The helper acts only on the process that started it (its parent), with the
same checkpointer choice as the CLI (the driver API, else the
``cuda-checkpoint`` binary; ``HIBERNATE_CHECKPOINTER`` may force one), and
with the CLI's CUDA stage, so a failed step is undone the same way and the
same record of GPU use is kept for the wake's free-memory check. It exits
when the worker closes the pipe, whichever way the worker ends.

When the checkpoint happens matters. vLLM's ``Worker.sleep`` calls the
backend's ``suspend`` and then still synchronizes and reads memory figures
from the device; once the process is locked those calls would block, and the
``/sleep`` request with them, for good. So ``suspend`` only asks for a
checkpoint *once the call that asked for the sleep has returned*: a watcher
thread waits until the caller's frame has left its thread's stack, then has
the helper lock and checkpoint. ``resume`` first cancels a checkpoint that has
not started, waits for one in flight, and has the helper restore and unlock
(deciding from the driver's real state), all before the worker touches the
device again.

:func:`on_stack` and :class:`SelfCheckpointer` are the intricate parts, with
tests of their own; :class:`HelperProcess` is the pipe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

from hibernate.checkpoint import HELPER_ENV
from hibernate.errors import HibernateError, UnsupportedError, error_from_wire

log = logging.getLogger("vllm.hibernate")

# The helper, on the driver side of the package: this process only starts it and speaks to it.
HELPER_MODULE = "hibernate.checkpoint.helper"
START_TIMEOUT_S = 120.0
POLL_S = 0.002


# -- when the caller has returned ----------------------------------------------------


def on_stack(frame: FrameType, top: FrameType | None) -> bool:
    """Whether ``frame`` is ``top`` or one of its callers (the stack ``top`` belongs to)."""
    current = top
    while current is not None:
        if current is frame:
            return True
        current = current.f_back
    return False


def wait_until_returned(
    thread_id: int,
    frame: FrameType,
    cancelled: threading.Event,
    poll: float = POLL_S,
    frames: Callable[[], Mapping[int, FrameType]] = sys._current_frames,
) -> bool:
    """Wait until ``frame`` is no longer on thread ``thread_id``'s stack; False if cancelled first."""
    while not cancelled.is_set():
        top = frames().get(thread_id)
        if top is None or not on_stack(frame, top):
            return True
        del top
        cancelled.wait(poll)
    return False


# -- the coordinator (in the worker) -------------------------------------------------


class Helper(Protocol):
    """What the coordinator needs of the helper: one request, one answer."""

    def call(self, op: str) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass
class _Pending:
    cancelled: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    started: bool = False


class SelfCheckpointer:
    """Orders this process's own checkpoints and restores around vLLM's sleep and wake calls."""

    def __init__(self, helper: Helper) -> None:
        self._helper = helper
        self._lock = threading.Lock()  # guards _pending
        self._calls = threading.Lock()  # one request to the helper at a time
        self._pending: _Pending | None = None
        self.last: dict[str, Any] | None = None  # the newest outcome, for logs and tests

    def after_return(self, frame: FrameType, thread_id: int) -> None:
        """Checkpoint this process once ``frame`` (the caller of ``suspend``) has returned."""
        pending = _Pending()
        with self._lock:
            previous, self._pending = self._pending, pending
        if previous is not None:
            previous.cancelled.set()
        threading.Thread(
            target=self._checkpoint,
            args=(pending, frame, thread_id),
            name="hibernate-self-checkpoint",
            daemon=True,
        ).start()

    def _checkpoint(self, pending: _Pending, frame: FrameType, thread_id: int) -> None:
        try:
            returned = wait_until_returned(thread_id, frame, pending.cancelled)
            del frame
            if not returned:
                return
            with self._calls:
                if pending.cancelled.is_set():
                    return
                pending.started = True
                started = time.perf_counter()
                report = self._helper.call("sleep")
            self.last = {"op": "sleep", "report": report}
            log.info(
                "hibernate: CUDA state of pid %d %s in %.2f s",
                os.getpid(),
                report.get("status", "checkpointed"),
                time.perf_counter() - started,
            )
        except HibernateError as exc:
            self.last = {"op": "sleep", "error": exc.message}
            log.error(
                "hibernate: the CUDA state of pid %d could not be checkpointed (%s); the pools stay "
                "released and the process keeps its CUDA context on the GPU",
                os.getpid(),
                exc.message,
            )
        finally:
            pending.done.set()

    def wake(self) -> dict[str, Any]:
        """CUDA running again before anything touches the device: cancel, or wait for, a checkpoint."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancelled.set()
            pending.done.wait()
        with self._calls:
            report = self._helper.call("wake")
        self.last = {"op": "wake", "report": report}
        if report.get("processes") and report.get("status") != "running (nothing to restore)":
            log.info("hibernate: CUDA state of pid %d %s", os.getpid(), report.get("status"))
        return report

    def close(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancelled.set()
        self._helper.close()


# -- the pipe (in the worker) ----------------------------------------------------------

_live_helpers: weakref.WeakSet[HelperProcess] = weakref.WeakSet()


def _forget_after_fork() -> None:
    """A forked child must never speak to its parent's helper (nor keep its pipe open)."""
    for helper in list(_live_helpers):
        helper._drop()


os.register_at_fork(after_in_child=_forget_after_fork)


def _package_root() -> str:
    return str(Path(__file__).resolve().parent.parent.parent)


class HelperProcess:
    """The helper child and its pipe; started at once, refused with the helper's own error."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = dict(os.environ if environ is None else environ)
        # The helper imports the same hibernate as this process, wherever that came from.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
        # Marks it as hibernate's own: a `hibernate sleep` of the server never takes it for a CUDA holder.
        env[HELPER_ENV] = str(os.getpid())
        self._command = [sys.executable, "-m", HELPER_MODULE, "--target", str(os.getpid())]
        self._env = env
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self.description: dict[str, Any] = {}
        self._start()
        _live_helpers.add(self)

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start(self) -> None:
        self._buffer = b""
        self._proc = subprocess.Popen(
            self._command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._env, close_fds=True
        )
        hello = self._read(START_TIMEOUT_S)
        if not hello.get("ok"):
            self.close()
            raise error_from_wire(hello.get("error"))
        self.description = dict(hello.get("result") or {})

    def _read(self, timeout: float | None) -> dict[str, Any]:
        """The helper's next line; the helper's exit or silence past ``timeout`` is an error."""
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if deadline is not None and time.monotonic() > deadline:
                raise UnsupportedError(f"the self-checkpoint helper (pid {proc.pid}) did not answer in time")
            readable, _, _ = select.select([fd], [], [], 1.0)
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = proc.wait()
                raise UnsupportedError(f"the self-checkpoint helper (pid {proc.pid}) exited (status {code})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        try:
            message = json.loads(line)
        except json.JSONDecodeError:
            message = None
        if not isinstance(message, dict):
            raise UnsupportedError(f"the self-checkpoint helper said something unexpected: {line[:200]!r}")
        return message

    def call(self, op: str) -> dict[str, Any]:
        """One request; a helper that died is started again once (it decides from real states)."""
        for attempt in (1, 2):
            proc = self._proc
            if proc is None or proc.poll() is not None:
                if proc is not None:
                    log.warning("hibernate: the self-checkpoint helper exited; starting another")
                self._start()
                proc = self._proc
            assert proc is not None and proc.stdin is not None
            try:
                proc.stdin.write(json.dumps({"op": op}).encode() + b"\n")
                proc.stdin.flush()
                reply = self._read(None)
            except (BrokenPipeError, UnsupportedError):
                if attempt == 2 or proc.poll() is None:
                    raise
                continue
            if reply.get("ok"):
                result = reply.get("result")
                return result if isinstance(result, dict) else {}
            raise error_from_wire(reply.get("error"))
        raise AssertionError("unreachable")

    def _drop(self) -> None:
        """Close this process's ends of the pipe without a word to the helper (after a fork)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                with contextlib.suppress(OSError):
                    if stream is not None:
                        stream.close()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(OSError):
            if proc.stdout is not None:
                proc.stdout.close()
