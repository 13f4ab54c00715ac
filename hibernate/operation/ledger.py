"""The locks and the journal of one operation: who else may act, and what a recovery will find.

The locks keep a second command off the same processes (the kernel drops them
if this command is killed). The journal says, durably and before the command
moves on, which steps are complete, so that ``hibernate status`` can show an
interrupted operation and ``hibernate recover`` can finish or undo it. A
completed (or cleanly undone) operation leaves no entry behind.

It also records each checkpoint or restore started in a process of its own
before the command waits for it; the next command on the same processes waits
for those still running (:meth:`Ledger.await_calls`) before it reads a state.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from hibernate import faults, procinfo
from hibernate.agent.paths import sweep_stale_sockets
from hibernate.checkpoint.base import DetachedCall, StillRunningError
from hibernate.errors import HibernateError
from hibernate.operation.journal import Entry, Journal, TargetLock
from hibernate.operation.targets import AgentRef
from hibernate.procinfo import ProcessIdentity

CALL_POLL_S = 0.05  # how often a call started by an earlier command is looked at while waited for


def _owner(ref: AgentRef) -> int | None:
    """Root acts for other users: their journal entries and lock files stay theirs."""
    return procinfo.owner_uid(ref.pid) if os.getuid() == 0 else None


class Ledger:
    """A lock and a journal entry per process an operation changes, and a fault point per step."""

    def __init__(self, op: str, refs: Sequence[AgentRef], *, supersedes: bool = False) -> None:
        self.op = op
        self.supersedes = supersedes  # recover's own operations: whatever their end, they replace it
        self.refs = list({ref.identity: ref for ref in refs}.values())
        self._locks: list[TargetLock] = []
        self._entries: dict[ProcessIdentity, tuple[Journal, Entry]] = {}
        # What an interrupted earlier operation left, replaced by this one's entry: put back if this
        # one fails, so that a refused or undone command never loses what `recover` needs.
        self._earlier: dict[ProcessIdentity, Entry] = {}
        self._fired: set[str] = set()
        self._writing = threading.Lock()  # calls are journaled from the threads of a step

    def lock(self) -> None:
        description = f"hibernate {self.op} (pid {os.getpid()}, since {time.strftime('%H:%M:%S')})"
        try:
            for ref in self.refs:
                lock = TargetLock(ref.socket.parent, ref.identity, _owner(ref))
                lock.acquire(description)
                self._locks.append(lock)
        except BaseException:
            self.release()
            raise

    def record(
        self, directory: Path | None, holders: Sequence[ProcessIdentity], checkpointer: str | None
    ) -> None:
        members = [[r.pid, r.identity.start_time] for r in self.refs]
        cuda = [[h.pid, h.start_time] for h in holders]
        for ref in self.refs:
            journal = Journal(ref.socket.parent, _owner(ref))
            earlier = None if self.supersedes else journal.load(ref.identity)
            if earlier is not None:
                self._earlier[ref.identity] = earlier
            entry = Entry(
                op=self.op,
                pid=ref.pid,
                start_time=ref.identity.start_time,
                cli_pid=os.getpid(),
                directory=str(directory) if directory else None,
                members=members,
                cuda_holders=cuda,
                checkpointer=checkpointer,
            )
            journal.record(entry)
            self._entries[ref.identity] = (journal, entry)

    def adopt(self) -> None:
        """Carry on the entries an interrupted operation left for these processes (finishing it)."""
        for ref in self.refs:
            journal = Journal(ref.socket.parent, _owner(ref))
            entry = journal.load(ref.identity)
            if entry is not None:
                self._entries[ref.identity] = (journal, entry)

    def passed(self, mark: str, scope: Sequence[AgentRef] | None = None) -> None:
        """``mark`` is complete for ``scope`` (everyone: None): journal it, then fire its fault point."""
        wanted = None if scope is None else {ref.identity for ref in scope}
        with self._writing:
            for identity, (journal, entry) in self._entries.items():
                if wanted is not None and identity not in wanted:
                    continue
                journal.mark(entry, mark)
        faults.point(f"{self.op}.after-{mark}")

    def journal_call(self, call: DetachedCall) -> None:
        """A checkpoint or restore started in a process of its own: recorded before it is waited for."""
        with self._writing:
            for journal, entry in self._entries.values():
                entry.calls.append(call)
                journal.record(entry)

    def running_calls(self) -> list[DetachedCall]:
        """The calls an earlier command journaled for these processes that are still running."""
        found: dict[DetachedCall, None] = {}
        for ref in self.refs:
            entry = Journal(ref.socket.parent, _owner(ref)).load(ref.identity)
            for call in entry.calls if entry is not None else []:
                if procinfo.is_alive(call.helper):
                    found[call] = None
        return list(found)

    def await_calls(self, bound: Callable[[str], float], note: Callable[[str], None]) -> None:
        """Wait for every journaled call still running, at most ``bound(step)`` seconds each.

        Before anything reads a state: a process in the middle of a checkpoint
        or restore must not be acted on. A call that outlives its bound raises
        StillRunningError, which keeps the journal (and so the call) for a
        later ``hibernate recover``.
        """
        pids = " ".join(str(ref.pid) for ref in self.refs)
        for call in self.running_calls():
            limit = bound(call.step)
            note(
                f"waiting (at most {limit:g}s) for {call.describe()}, started by an earlier hibernate "
                f"command, to return: a {call.step} is never cut"
            )
            deadline = time.monotonic() + limit
            while procinfo.is_alive(call.helper):
                if time.monotonic() >= deadline:
                    raise StillRunningError(
                        f"{call.describe()}, started by an earlier hibernate command, is still running "
                        f"after {limit:g}s; nothing was done",
                        hint=f"run `hibernate recover {pids}` again once it has returned; it must not "
                        f"be cut (a {call.step} stopped half-way can leave the process in the "
                        "driver's failed state)",
                    )
                time.sleep(CALL_POLL_S)

    def during(self, step: str) -> None:
        """Inside a long step (the first progress report of a transfer): its fault point, once."""
        if step not in self._fired:
            self._fired.add(step)
            faults.point(f"{self.op}.during-{step}")

    def finish(self, succeeded: bool = True) -> None:
        """Done, or cleanly undone: nothing of this operation to recover.

        Done: an entry an interrupted earlier operation left goes too (this one has moved the
        processes on). Failed or undone: that entry is put back as it was, since the processes are
        where it left them (a plain `hibernate sleep` refused because an interrupted one left the
        target asleep must not erase what `hibernate recover` needs to finish it), unless this
        operation ``supersedes`` it (one that recover runs).

        Except an entry that names a checkpoint or restore still running: an operation ended by
        something else than a HibernateError (a second Ctrl-C during an undo, an OSError, a bug)
        may leave one behind, never cut. Its entry stays, so that ``hibernate status`` shows it and
        the next command waits for it; only the locks go.
        """
        for ref in self.refs:
            journal = Journal(ref.socket.parent, _owner(ref))
            entry = journal.load(ref.identity)
            if entry is not None and any(procinfo.is_alive(call.helper) for call in entry.calls):
                continue
            earlier = None if succeeded else self._earlier.get(ref.identity)
            if earlier is not None:
                journal.record(earlier)
            else:
                journal.remove(ref.identity)
        self._entries.clear()
        self.release()

    @contextlib.contextmanager
    def concluding(self) -> Iterator[None]:
        """End the operation with the block that runs its steps.

        Success and a clean undo leave nothing to recover (``finish``); an
        error that ``keeps_journal`` keeps the entries for ``hibernate
        recover`` and only lets go of the locks, and so does any other end
        with a journaled call still running.
        """
        try:
            yield
        except HibernateError as exc:
            if exc.keeps_journal:
                self.release()
            else:
                self.finish(succeeded=False)
            raise
        except BaseException:
            self.finish(succeeded=False)
            raise
        self.finish()

    def release(self) -> None:
        for lock in self._locks:
            lock.release()
        self._locks.clear()
        for directory in {ref.socket.parent for ref in self.refs}:
            sweep_dead(directory)


def sweep_dead(directory: Path) -> None:
    """Sockets, journal entries and lock files of processes that no longer exist go."""
    sweep_stale_sockets(directory)
    journal = Journal(directory)
    journal.sweep_dead_entries()
    journal.sweep_locks()


def interrupted_operation(ref: AgentRef) -> dict[str, Any] | None:
    """An operation on ``ref`` that stopped half-way (its command died), and how to resolve it."""
    entry = Journal(ref.socket.parent, _owner(ref)).load(ref.identity)
    if entry is None:
        return None
    holder = TargetLock(ref.socket.parent, ref.identity).holder()
    if holder is not None:
        return {"op": entry.op, "phases": entry.marks, "in_progress": holder}
    return {
        "op": entry.op,
        "phases": entry.marks,
        "cli_pid": entry.cli_pid,
        "since_unix": entry.started_unix,
        # checkpoints and restores it started that run on (never cut): recover waits for them
        "running": [call.describe() for call in entry.calls if procinfo.is_alive(call.helper)],
        "resolve": f"hibernate recover {ref.pid}",
    }
