"""The journal survives its writer; the per-target lock dies with its holder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hibernate import procinfo
from hibernate.checkpoint.base import DetachedCall
from hibernate.errors import BusyError
from hibernate.operation.journal import Entry, Journal, TargetLock, parse_entry
from hibernate.operation.ledger import Ledger
from hibernate.operation.targets import AgentRef
from tests.conftest import REPO


def this_process() -> procinfo.ProcessIdentity:
    ident = procinfo.identity(os.getpid())
    assert ident is not None
    return ident


def entry_for(ident: procinfo.ProcessIdentity, op: str = "sleep") -> Entry:
    return Entry(
        op=op,
        pid=ident.pid,
        start_time=ident.start_time,
        cli_pid=12345,
        directory="/snap",
        members=[[ident.pid, ident.start_time]],
        cuda_holders=[],
    )


def test_entries_record_every_completed_phase_durably(runtime_dir: Path) -> None:
    journal = Journal(runtime_dir)
    entry = entry_for(this_process())
    journal.record(entry)
    for phase in ("connect", "quiesce", "spill"):
        journal.mark(entry, phase)
    loaded = journal.load(this_process())
    assert loaded is not None
    assert loaded.marks == ["connect", "quiesce", "spill"] and loaded.last_mark == "spill"
    assert (runtime_dir / "journal").stat().st_mode & 0o777 == 0o700
    files = list((runtime_dir / "journal").iterdir())
    assert [f.name for f in files] == [f"{os.getpid()}-{this_process().start_time}.json"]
    assert files[0].stat().st_mode & 0o777 == 0o600
    journal.remove(this_process())
    assert journal.load(this_process()) is None


def test_detached_calls_are_journaled_with_their_helper_s_identity(runtime_dir: Path) -> None:
    journal = Journal(runtime_dir)
    entry = entry_for(this_process())
    helper = procinfo.ProcessIdentity(4242, 777)
    entry.calls.append(DetachedCall(this_process().pid, "restore", "cuCheckpointProcessRestore", helper))
    journal.record(entry)
    loaded = journal.load(this_process())
    assert loaded is not None and loaded.calls == entry.calls
    raw = json.loads(json.dumps(entry.to_wire()))
    raw["calls"][0]["helper"] = {"pid": 4242}  # no start time: a reused pid could not be told apart
    with pytest.raises(ValueError):
        parse_entry(json.dumps(raw).encode())


def test_entries_of_dead_processes_are_dropped(runtime_dir: Path) -> None:
    journal = Journal(runtime_dir)
    dead = procinfo.ProcessIdentity(os.getpid(), 1)  # our pid with another start time: not us
    journal.record(entry_for(dead))
    journal.record(entry_for(this_process()))
    assert [e.pid for e in journal.entries()] == [os.getpid()]
    assert len(list((runtime_dir / "journal").iterdir())) == 2, "listing deletes nothing"
    journal.sweep_dead_entries()
    assert [e.pid for e in journal.entries()] == [os.getpid()]
    assert len(list((runtime_dir / "journal").iterdir())) == 1


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"{",
        b"[]",
        b'{"version": 2}',
        b'{"version": 1, "op": "explode", "pid": 1, "start_time": 1, "cli_pid": 1}',
        b'{"version": 1, "op": "sleep", "pid": "1", "start_time": 1, "cli_pid": 1}',
    ],
)
def test_damaged_entries_are_refused(damage: bytes) -> None:
    with pytest.raises((ValueError, UnicodeDecodeError)):
        parse_entry(damage)


def test_a_damaged_entry_is_ignored_not_trusted(runtime_dir: Path) -> None:
    journal = Journal(runtime_dir)
    journal.record(entry_for(this_process()))
    path = next((runtime_dir / "journal").iterdir())
    path.write_bytes(b'{"version": 1, "op": "sleep", "pid": 1')
    assert journal.load(this_process()) is None


def test_the_lock_names_its_holder(runtime_dir: Path) -> None:
    first = TargetLock(runtime_dir, this_process())
    first.acquire("hibernate sleep (pid 111)")
    second = TargetLock(runtime_dir, this_process())
    with pytest.raises(BusyError, match=r"busy: hibernate sleep \(pid 111\) is operating on it"):
        second.acquire("hibernate wake (pid 222)")
    first.release()
    second.acquire("hibernate wake (pid 222)")
    second.release()


HOLD_LOCK = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from hibernate.operation.journal import TargetLock
from hibernate.procinfo import ProcessIdentity
ident = ProcessIdentity(int(sys.argv[3]), int(sys.argv[4]))
TargetLock(Path(sys.argv[2]), ident).acquire("holder")
print("locked", flush=True)
time.sleep(60)
"""


def test_the_lock_is_released_when_its_holder_is_killed(runtime_dir: Path) -> None:
    ident = this_process()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HOLD_LOCK,
            str(REPO),
            str(runtime_dir),
            str(ident.pid),
            str(ident.start_time),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
    with pytest.raises(BusyError):
        TargetLock(runtime_dir, ident).acquire("me")
    holder.send_signal(signal.SIGKILL)
    holder.wait()  # its flock went with it
    lock = TargetLock(runtime_dir, ident)
    lock.acquire("me")
    lock.release()


def test_an_operation_ended_by_an_interrupt_keeps_the_entry_of_a_call_still_running(
    runtime_dir: Path,
) -> None:
    """A second Ctrl-C in an undo (any error not a HibernateError) must not drop a call never cut."""
    helper = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        identity = procinfo.identity(helper.pid)
        assert identity is not None
        ref = AgentRef(this_process(), runtime_dir / "agent.sock", {})
        call = DetachedCall(ref.pid, "checkpoint", "cuCheckpointProcessCheckpoint", identity)
        ledger = Ledger("sleep", [ref])
        ledger.lock()
        ledger.record(None, [], "driver")
        ledger.journal_call(call)
        with pytest.raises(KeyboardInterrupt), ledger.concluding():
            raise KeyboardInterrupt
        kept = Journal(runtime_dir).load(this_process())
        assert kept is not None and kept.calls == [call]
        assert TargetLock(runtime_dir, this_process()).holder() is None  # only the locks went
    finally:
        assert helper.stdin is not None
        helper.stdin.close()
        helper.wait()
    # Once the call has returned, the same end leaves nothing behind.
    later = Ledger("sleep", [ref])
    later.lock()
    later.adopt()
    with pytest.raises(KeyboardInterrupt), later.concluding():
        raise KeyboardInterrupt
    assert Journal(runtime_dir).load(this_process()) is None
