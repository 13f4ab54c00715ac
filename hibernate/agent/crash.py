"""Last words of a process that dies while its memory comes back.

A wake writes every kept byte back into the process. If the memory under a
region cannot be backed any more (a private file mapping whose file was
truncated while asleep gets SIGBUS), or the machine runs out, the process
dies in the middle of it, and the command that woke it sees only a closed
connection. Its exit status goes to its parent, not to hibernate. So for the
length of a restore the agent has the interpreter's fault handler write to a
file beside its socket: a process killed by SIGSEGV, SIGBUS, SIGFPE, SIGILL
or SIGABRT leaves a line there naming the signal, which the command reads to
say how the process ended (see hibernate.flows.members.how_it_ended).

A program that enabled ``faulthandler`` itself keeps its own: its fatal
errors go where it chose, and the command says less.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def recording_crashes(path: Path | None) -> Iterator[None]:
    """While inside, a fatal signal in this process writes its name (and the threads' stacks) to ``path``."""
    if path is None or faulthandler.is_enabled():
        yield
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        yield  # a wake does not fail for want of its last words
        return
    with os.fdopen(fd, "w") as record:
        faulthandler.enable(record, all_threads=True)
        try:
            yield
        finally:
            faulthandler.disable()
            with contextlib.suppress(OSError):
                os.unlink(path)
