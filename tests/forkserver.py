"""A fork server for test targets: torch is imported once, each target is a fork of it.

Starting a demo target costs ~3 s, two of them importing torch. The suite
starts dozens, so this server imports torch and hibernate.demo once, and for
each request forks a child that becomes a demo target with its own
environment, working directory and log. The child is a real, separate
process like any other target (its own pid, agent and socket); only its
parent is this server rather than the test. The server runs no torch
computation before forking, so no thread pools are inherited.

Protocol: one JSON line per connection, one JSON line back.
    {"op": "start", "argv": [...], "env": {...}, "cwd": "...", "log": "..."} -> {"pid": N}
    {"op": "status", "pid": N} -> {"returncode": null | int}
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

# Written only by the SIGCHLD handler, read only while SIGCHLD is held. Python runs a signal handler
# in the main thread, between two bytecodes of whatever that thread is doing: a lock shared with the
# handler deadlocks the server the first time a child exits while the main thread holds it (a
# status request waited on it for ten minutes). Holding the signal is the right exclusion.
_exited: dict[int, int] = {}


def _reap(signum: int, frame: object) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _exited[pid] = os.waitstatus_to_exitcode(status)


@contextlib.contextmanager
def _sigchld_held() -> Iterator[None]:
    """No exit is recorded inside: SIGCHLD waits, and its handler runs when the block ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})


def run_then_exit(main: Callable[[], int | None]) -> NoReturn:
    """In a forked child: run ``main``, then end the process with its status, whatever happens: it
    never returns into the code it was forked from."""
    code = 1
    try:
        code = main() or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _become_target(request: dict[str, Any], listener: socket.socket, conn: socket.socket) -> NoReturn:
    """In the child: drop the server's sockets and handlers, then run the demo."""

    def demo_main() -> int:
        listener.close()
        conn.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgid(0, 0)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sys.argv = ["hibernate.demo", *request["argv"]]
        from hibernate import demo

        return demo.main(request["argv"])

    run_then_exit(demo_main)


def serve(path: str) -> None:
    import torch  # noqa: F401  (the point of this server: imported once, inherited by every fork)

    from hibernate import demo  # noqa: F401

    signal.signal(signal.SIGCHLD, _reap)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except InterruptedError:
            continue
        with conn, conn.makefile("rw") as stream:
            request = json.loads(stream.readline())
            if request["op"] == "start":
                # Pids wrap (at 32768 on small machines): a new target may get the pid of one that
                # exited long ago, whose exit status is kept. It is forgotten before the reaper can
                # record the new one's (SIGCHLD is held until then), or status would call the new
                # target dead at once.
                with _sigchld_held():
                    pid = os.fork()
                    if pid == 0:
                        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                        _become_target(request, listener, conn)
                    _exited.pop(pid, None)
                stream.write(json.dumps({"pid": pid}) + "\n")
            elif request["op"] == "status":
                with _sigchld_held():
                    code = _exited.get(request["pid"])
                stream.write(json.dumps({"returncode": code}) + "\n")


if __name__ == "__main__":
    serve(sys.argv[1])
