"""The suite ends every process it started, by pid, and fails the run when one was left running.

Every pytest process (each xdist worker, the xdist controller, the one process
of ``-n 0``) makes itself a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``)
when it is configured. A process a test starts then stays below the pytest
process that ran the test whatever it does next: a daemon's double fork, a
session of its own (``setsid``, ``start_new_session``), a parent killed under
it. The kernel gives an orphan to the nearest subreaper above it, not to init.
So what a pytest process started is its tree of descendants in /proc, walked by
parent pid, and it is ended by pid (through a pidfd, checked against the
process's start time so that a reused pid is never hit), never by name. A
cgroup per run would do the same but needs root and a delegated hierarchy; a
subreaper needs neither.

When it is checked:

- After each test's teardown. A process that appeared during the test must
  have ended by then (it gets ``LINGER_S`` to finish exiting, a safety net for
  a loaded machine); one still running is ended (SIGTERM, then SIGKILL) and the
  teardown fails, naming it: pid, command line, the test. Checking per test
  rather than only at the end names the test to fix, and keeps a stray process
  from disturbing the tests that follow.
- A fixture of a broader scope (module, class, package, session) owns the
  processes that appeared while it was set up: they must have ended once it is
  torn down, checked after the test whose teardown ended it (the private Slurm
  cluster's daemons, a module's shared demos).
- A process kept for the whole session by design (the fork server) is
  registered with :func:`keep`, with how to stop it: it is stopped when the
  session ends.
- At the end of the session whatever is still below the process is ended, and
  the run fails with a "processes left running" section naming each one.
- A worker that dies (pytest-timeout's thread method ends it with
  ``os._exit``; a crash) leaves its descendants to the controller, which ends
  them at once and names them at the end. pytest-timeout's default here is its
  signal method (SIGALRM; xdist runs tests in each worker's main thread): a test
  that times out fails, its fixtures are torn down, and it is checked like any
  other.

A subreaper must reap the orphans it inherits, or they stay zombies for the
rest of the run (and a test waiting for a process to vanish from /proc waits
for ever). A thread reaps them. It leaves alone the children this process
started itself (``subprocess``, ``os.fork``, ``os.posix_spawn``: recorded as
they start), whose exit status belongs to whoever waits for them, and gives any
other zombie child a second first (a C library's own ``waitpid`` takes its
child at once).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

PR_SET_CHILD_SUBREAPER = 36
# How long a process may take to finish exiting after the teardown that ended it: a safety net for a
# loaded machine (HIBERNATE_TEST_LINGER_S sets it; the reaper's own tests shorten it).
LINGER_S = float(os.environ.get("HIBERNATE_TEST_LINGER_S", "15"))
TERM_S = 5.0  # from SIGTERM to SIGKILL
KILL_S = 10.0  # for a SIGKILLed process to be gone
REAP_EVERY_S = 0.25
FOREIGN_ZOMBIE_S = 1.0  # a zombie child not started through Python, left this long to its own waiter
WORKER_OUTPUT = "hibernate_left_running"  # xdist: a worker's findings, sent to the controller
FREEZER = Path("/sys/fs/cgroup/freezer")

Key = tuple[int, int]  # (pid, start time): one process, for good


@dataclass(frozen=True)
class Entry:
    """One process as its /proc/PID/stat shows it."""

    pid: int
    ppid: int
    state: str
    start: int  # clock ticks after boot
    threads: int

    @property
    def key(self) -> Key:
        return (self.pid, self.start)

    @property
    def alive(self) -> bool:
        """Running: not a zombie, nor a zombie leader whose other threads still run."""
        return self.state not in "ZX" or self.threads > 1


def parse_stat(raw: str) -> Entry:
    """An Entry from the text of /proc/PID/stat (the command name may hold spaces and parentheses)."""
    fields = raw[raw.rindex(")") + 2 :].split()
    return Entry(int(raw[: raw.index(" ")]), int(fields[1]), fields[0], int(fields[19]), int(fields[17]))


def read_entry(pid: int) -> Entry | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read())
    except (OSError, ValueError, IndexError):
        return None


def process_table() -> dict[int, Entry]:
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (entry := read_entry(int(name))) is not None:
            table[entry.pid] = entry
    return table


def descendants(table: Mapping[int, Entry], root: int, skip: Collection[int] = ()) -> list[Entry]:
    """Every process below ``root`` (parents before their children), the subtrees of ``skip`` left out."""
    children: dict[int, list[Entry]] = {}
    for entry in table.values():
        if entry.pid != root:
            children.setdefault(entry.ppid, []).append(entry)
    found: list[Entry] = []
    queue = [root]
    while queue:
        for child in children.get(queue.pop(), []):
            if child.pid not in skip:
                found.append(child)
                queue.append(child.pid)
    return found


def same(entry: Entry) -> Entry | None:
    """``entry``'s process as it is now, or None once it is gone (its pid reused counts as gone)."""
    now = read_entry(entry.pid)
    return now if now is not None and now.start == entry.start else None


def ended(entry: Entry) -> bool:
    now = same(entry)
    return now is None or not now.alive


def environ_value(pid: int, name: str) -> str | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    prefix = name.encode() + b"="
    for item in raw.split(b"\0"):
        if item.startswith(prefix):
            return item[len(prefix) :].decode(errors="replace")
    return None


def describe(entry: Entry) -> str:
    """pid, command line, and the test it was started in (PYTEST_CURRENT_TEST, which it inherited)."""
    try:
        command = Path(f"/proc/{entry.pid}/cmdline").read_bytes().rstrip(b"\0").replace(b"\0", b" ")
        text = command.decode(errors="replace") or f"[{Path(f'/proc/{entry.pid}/comm').read_text().strip()}]"
    except OSError:
        text = "?"
    if len(text) > 300:
        text = text[:297] + "..."
    started = environ_value(entry.pid, "PYTEST_CURRENT_TEST")
    return f"pid {entry.pid} `{text}`" + (f", started during {started}" if started else "")


def thaw(pid: int) -> None:
    """Thaw the cgroup v1 freezer that holds ``pid``: a frozen process cannot die, even of SIGKILL."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if "freezer" in controllers.split(",") and path != "/":
                (FREEZER / path.lstrip("/") / "freezer.state").write_text("THAWED")


@dataclass(eq=False)
class Owner:
    """Who a process belongs to; once ``due``, its processes must have ended."""

    label: str
    due: bool = False
    stop: Callable[[], None] | None = None


class Reaper:
    """This pytest process's record of what it started, and the means to end it (see the module)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.owners: dict[Key, Owner] = {}
        self.fixtures: dict[int, Owner] = {}  # id(FixtureDef) -> its owner, while it is set up
        self.kept: list[Owner] = []
        self.spawned: set[Key] = set()  # children started through Python here: others wait for them
        self.left: list[str] = []  # every process found left running, for the summary
        self._zombies: dict[Key, float] = {}  # foreign zombie children: when first seen
        self._next_scan = 0.0
        self._reaping = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._patched: list[tuple[Any, str, Any]] = []

    # -- start and stop ------------------------------------------------------------------------

    def start(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
        self._record_spawns()
        self._thread = threading.Thread(target=self._reap_forever, name="hibernate-test-reaper", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def _record_spawns(self) -> None:
        """Wrap every way Python starts a child, to record it: its exit status is its waiter's."""
        import _posixsubprocess

        def first(result: Any) -> int:
            return int(result[0] if isinstance(result, tuple) else result)

        targets = [
            (subprocess, "_fork_exec"),
            (_posixsubprocess, "fork_exec"),
            (os, "fork"),
            (os, "forkpty"),
            (os, "posix_spawn"),
            (os, "posix_spawnp"),
        ]
        for module, name in targets:
            original = getattr(module, name, None)
            if original is None:
                continue

            def recording(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                result = _original(*args, **kwargs)
                self.record(first(result))
                return result

            setattr(module, name, recording)
            self._patched.append((module, name, original))

    def record(self, pid: int) -> None:
        """Note ``pid`` as a child this process started (lock-free: it runs in forked children too)."""
        if pid > 0 and os.getpid() == self.pid and (entry := read_entry(pid)) is not None:
            self.spawned.add(entry.key)

    # -- zombies ---------------------------------------------------------------------------------

    def _reap_forever(self) -> None:
        while not self._stopping.wait(REAP_EVERY_S):
            try:
                self.reap_orphans(FOREIGN_ZOMBIE_S)
            except Exception:  # a failed round is retried at the next: the thread must go on
                continue

    def reap_orphans(self, min_age: float) -> None:
        """Reap the zombie children this process did not start through Python (the orphans it
        inherited), each once it has been a zombie for ``min_age`` seconds."""
        try:
            if os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return  # no child is a zombie: the common case, one system call
        except ChildProcessError:
            return
        now = time.monotonic()
        if min_age and now < self._next_scan:
            return  # the zombies seen last are this process's own, waiting for their waiter
        with self._reaping:
            dead = {e.key: e for e in process_table().values() if e.ppid == self.pid and not e.alive}
            for key in set(self._zombies) - set(dead):
                del self._zombies[key]
            foreign = [entry for key, entry in dead.items() if key not in self.spawned]
            for entry in foreign:
                if now - self._zombies.setdefault(entry.key, now) >= min_age:
                    self._reap(entry)
            self._next_scan = now + (REAP_EVERY_S if foreign else 1.0)

    def _reap(self, entry: Entry) -> None:
        self._zombies.pop(entry.key, None)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(entry.pid, os.WNOHANG)

    # -- who owns what ---------------------------------------------------------------------------

    def alive_below(self, table: Mapping[int, Entry] | None = None) -> list[Entry]:
        return [e for e in descendants(process_table() if table is None else table, self.pid) if e.alive]

    def keep(self, pid: int, label: str, stop: Callable[[], None]) -> None:
        entry = read_entry(pid)
        if entry is None:
            return
        owner = Owner(label, stop=stop)
        self.owners[entry.key] = owner
        self.kept.append(owner)

    def fixture_set_up(self, fixture: object, label: str, before: Collection[Key]) -> None:
        """What appeared while ``fixture`` (of a broad scope) was set up is its own, until it is torn down."""
        owner = self.fixtures[id(fixture)] = Owner(label)
        for entry in self.alive_below():
            if entry.key not in before:
                self.owners.setdefault(entry.key, owner)

    def fixture_torn_down(self, fixture: object) -> None:
        owner = self.fixtures.pop(id(fixture), None)
        if owner is not None:
            owner.due = True

    # -- checks ----------------------------------------------------------------------------------

    def after_test(self, label: str) -> list[str]:
        """End what ``label`` (a test just torn down) or a fixture torn down with it left running."""
        return self._settle(Owner(label, due=True))

    def end_session(self) -> list[str]:
        """Stop what was kept for the session, then end whatever is still below this process."""
        left = []
        for owner in reversed(self.kept):
            try:
                assert owner.stop is not None
                owner.stop()
            except Exception as exc:  # whatever it left is ended below
                left.append(f"stopping {owner.label} failed: {exc!r}")
        self.left += left
        for owner in self.owners.values():
            owner.due = True
        left += self._settle(Owner("the session (started outside any test)", due=True))
        with self._reaping:
            for entry in process_table().values():
                if entry.ppid == self.pid and not entry.alive:
                    self._reap(entry)
        return left

    def sweep_orphans(self, label: str) -> list[str]:
        """End the processes below this one that it did not start itself: what a child that died left."""
        table = process_table()
        own = {e.pid for e in table.values() if e.ppid == self.pid and e.key in self.spawned}
        orphans = [e for e in descendants(table, self.pid, skip=own) if e.alive]
        owner = Owner(label, due=True)
        for entry in orphans:
            self.owners[entry.key] = owner
        left = self._end(orphans)
        self.left += left
        return left

    def _settle(self, newcomers: Owner) -> list[str]:
        """Give every process that appeared since the last check to ``newcomers``; wait up to LINGER_S
        for the due ones to end; end those still running. Lines naming them."""
        self.reap_orphans(0)
        left: list[str] = []
        for _ in range(3):  # a process that started one while it was being ended: once more
            spawned = set(self.spawned)  # before the table: one started after it is not forgotten
            table = process_table()
            alive = self.alive_below(table)
            for entry in alive:
                self.owners.setdefault(entry.key, newcomers)
            self._forget(table, {e.key for e in alive}, spawned)
            due = [e for e in alive if self.owners[e.key].due]
            if not due:
                break
            deadline = time.monotonic() + LINGER_S
            try:
                while due and time.monotonic() < deadline:
                    time.sleep(0.05)
                    self._reap_due(due)
                    due = [e for e in due if not ended(e)]
            finally:  # a timeout's exception in the middle of the wait too: end them now
                ended_now = self._end(due)
                self.left += ended_now
                left += ended_now
        return left

    def _forget(self, table: Mapping[int, Entry], alive: Collection[Key], spawned: Collection[Key]) -> None:
        """Drop what is known of processes gone: owners of the dead, children reaped by their waiters."""
        for key in [k for k in self.owners if k not in alive]:
            del self.owners[key]
        for key in spawned:
            if (entry := table.get(key[0])) is None or entry.start != key[1]:
                self.spawned.discard(key)

    def _reap_due(self, entries: Sequence[Entry]) -> None:
        """Reap the zombie children among ``entries``: whatever started them is done with them."""
        with self._reaping:
            for entry in entries:
                now = same(entry)
                if now is not None and now.ppid == self.pid and not now.alive:
                    self._reap(now)

    def _end(self, entries: Sequence[Entry]) -> list[str]:
        """SIGTERM, then SIGKILL what did not end; reaped where they are this process's children."""
        if not entries:
            return []
        lines = {e.key: f"{describe(e)}: left running by {self.owners[e.key].label}" for e in entries}
        fates: dict[Key, str] = {}
        with pidfds(entries) as handles, killed_on_the_way_out(entries, handles):
            for sig, name, wait in ((signal.SIGTERM, "SIGTERM", TERM_S), (signal.SIGKILL, "SIGKILL", KILL_S)):
                running = [e for e in entries if e.key not in fates]
                for entry in running:
                    if sig == signal.SIGKILL:
                        thaw(entry.pid)
                    send(handles.get(entry.key), sig)
                    send(handles.get(entry.key), signal.SIGCONT)  # a stopped one acts on SIGTERM only then
                deadline = time.monotonic() + wait
                while True:
                    self._reap_due(running)
                    for entry in running:
                        if entry.key not in fates and ended(entry):
                            fates[entry.key] = f"ended by {name}"
                    if all(e.key in fates for e in running) or time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
        for entry in entries:
            state = (same(entry) or entry).state
            fates.setdefault(entry.key, f"still running (state {state}): it could not be ended")
        return [f"{lines[e.key]}; {fates[e.key]}" for e in entries]


@contextlib.contextmanager
def pidfds(entries: Sequence[Entry]) -> Iterator[dict[Key, int]]:
    """A pidfd for each process still as it was seen: a signal through it reaches that process or none."""
    handles: dict[Key, int] = {}
    try:
        for entry in entries:
            with contextlib.suppress(OSError):
                fd = os.pidfd_open(entry.pid)
                if same(entry) is None:
                    os.close(fd)
                else:
                    handles[entry.key] = fd
        yield handles
    finally:
        for fd in handles.values():
            os.close(fd)


@contextlib.contextmanager
def killed_on_the_way_out(entries: Sequence[Entry], handles: Mapping[Key, int]) -> Iterator[None]:
    """An exception (a timeout's) between SIGTERM and SIGKILL still leaves none of ``entries`` running."""
    try:
        yield
    except BaseException:
        for entry in entries:
            thaw(entry.pid)
            send(handles.get(entry.key), signal.SIGKILL)
        raise


def send(pidfd: int | None, sig: int) -> None:
    if pidfd is not None:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, sig)


# -- what the rest of the suite calls -----------------------------------------------------------------

REAPER: Reaper | None = None


def keep(pid: int, label: str, stop: Callable[[], None]) -> None:
    """Let process ``pid`` live for the whole session, not counted as left by the test that started
    it; ``stop`` ends it when the session ends (at exit, outside pytest)."""
    if REAPER is None:
        atexit.register(stop)
    else:
        REAPER.keep(pid, label, stop)


# -- the plugin -----------------------------------------------------------------------------------

STARTED_HERE = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    global REAPER
    if REAPER is None:
        REAPER = Reaper()
        REAPER.start()
        config.stash[STARTED_HERE] = True


def pytest_unconfigure(config: pytest.Config) -> None:
    global REAPER
    if REAPER is not None and config.stash.get(STARTED_HERE, False):
        REAPER.close()
        REAPER = None


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> Any:
    if REAPER is None or fixturedef.scope == "function":
        return (yield)
    before = {e.key for e in REAPER.alive_below()}
    try:
        return (yield)
    finally:
        label = f"fixture {fixturedef.argname!r} ({fixturedef.scope} scope)"
        REAPER.fixture_set_up(fixturedef, label, before)


def pytest_fixture_post_finalizer(fixturedef: pytest.FixtureDef[Any], request: pytest.FixtureRequest) -> None:
    if REAPER is not None and fixturedef.scope != "function":
        REAPER.fixture_torn_down(fixturedef)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    if REAPER is None:
        return (yield)
    try:
        result = yield
    except BaseException:
        REAPER.after_test(f"test {item.nodeid}")  # named in the summary; the teardown's own error stands
        raise
    left = REAPER.after_test(f"test {item.nodeid}")
    if left:
        pytest.fail(
            f"{len(left)} process(es) left running after this test's teardown (now ended):\n"
            + "\n".join(f"  {line}" for line in left),
            pytrace=False,
        )
    return result


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    """xdist's controller: a worker is done. Take what it found; if it died, end what it left."""
    if REAPER is None:
        return
    name = node.gateway.id
    REAPER.left += [f"[{name}] {line}" for line in getattr(node, "workeroutput", {}).get(WORKER_OUTPUT, [])]
    if error:
        label = f"xdist worker {name}, which went down ({error})"
        # Its orphans are handed over as its exit ends: look again until none has come for a while.
        quiet_since = time.monotonic()
        while time.monotonic() - quiet_since < 1.0:
            if REAPER.sweep_orphans(label):
                quiet_since = time.monotonic()
            time.sleep(0.1)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Runs after xdist's controller stopped its workers, and inside a worker's own session end."""
    if REAPER is None:
        return
    REAPER.end_session()
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[WORKER_OUTPUT] = REAPER.left
    elif REAPER.left and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    if REAPER is not None and REAPER.left:
        terminalreporter.section("processes left running", sep="=", red=True, bold=True)
        terminalreporter.line("the suite ended each of these; a test must end what it starts:")
        for line in REAPER.left:
            terminalreporter.line(line, red=True)
