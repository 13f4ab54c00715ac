"""Root acting on other users' processes: careful with their files, explicit about scope.

The cases that need two users run as root against ``nobody`` and a user the
test creates with ``useradd``; without root (or without ``useradd``) they are
skipped, saying why.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import NOBODY, as_user_prefix, is_root, run_cli, source_root_for, wait_until

needs_root = pytest.mark.skipif(not is_root(), reason="acting on another user's process needs root")


@pytest.fixture(scope="session")
def second_user() -> Iterator[int]:
    """A throw-away system user (uid), created for this session and deleted after it."""
    if not is_root():
        pytest.skip("creating a second user needs root")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed: cannot create a second user")
    name = f"hbt{secrets.token_hex(4)}"
    made = subprocess.run(
        ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"useradd failed: {made.stderr.strip()}")
    import pwd

    try:
        yield pwd.getpwnam(name).pw_uid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def user_runtime(runtime_dir: Path, uid: int) -> Path:
    """A runtime directory of ``uid``'s own (the fixture's parent directory is world-writable)."""
    return runtime_dir.parent / f"run-{uid}"


def as_user(uid: int, runtime_dir: Path) -> dict[str, Any]:
    """``run_cli`` keywords for running the CLI as ``uid``, with its own runtime directory."""
    return {"uid": uid, "env": {"HIBERNATE_RUNTIME_DIR": str(user_runtime(runtime_dir, uid))}}


def start_user_demo(start_demo: Any, runtime_dir: Path, uid: int) -> Any:
    return start_demo(size_mb=8, uid=uid, env={"HIBERNATE_RUNTIME_DIR": str(user_runtime(runtime_dir, uid))})


def agent_state(pid: int) -> str:
    document = run_cli("status", str(pid), "--json").json()
    state: str = document["agents"][0]["state"]
    return state


def owner_and_mode(path: Path) -> tuple[int, int]:
    info = path.lstat()
    return info.st_uid, stat.S_IMODE(info.st_mode)


# -- the user's locks/ and journal/ swapped for a symbolic link --------------------------------


@needs_root
@pytest.mark.slow
@pytest.mark.parametrize("swapped", ["locks", "journal"])
def test_a_symlink_swapped_in_for_the_users_directory_is_refused_and_not_followed(
    start_demo: Callable[..., Any], cli: Callable[..., Any], runtime_dir: Path, work_dir: Path, swapped: str
) -> None:
    """Root refuses (exit 5) a symlink where the user's ``locks/`` or ``journal/`` should be.

    The link points at a root-owned 0755 directory: root must neither chmod it
    to 0700 nor chown it to the user, and the target must be left running.
    """
    demo = start_user_demo(start_demo, runtime_dir, NOBODY)
    reference = demo.infer()["digest"]
    victim = work_dir / "root-owned"
    victim.mkdir(mode=0o755)
    victim.chmod(0o755)
    link = user_runtime(runtime_dir, NOBODY) / swapped
    link.symlink_to(victim)
    os.lchown(link, NOBODY, NOBODY)  # planted by the user, in the user's own directory
    os.chmod(work_dir, 0o755)
    result = cli("sleep", str(demo.pid), "--to", str(work_dir / "snaps"))
    assert result.returncode == ExitCode.PERMISSION_DENIED, result.stderr
    # Named in full: the journal is read (for a call still running) before its locks are taken.
    assert re.search(
        rf"{re.escape(str(link))} is a symbolic link.*; refusing to (use|follow) it", result.stderr
    )
    assert owner_and_mode(victim) == (0, 0o755), "the directory behind the link was not touched"
    assert not any(victim.iterdir()), "nothing was created through the link"
    link.unlink()  # until the user removes it, status refuses the swapped journal too
    assert agent_state(demo.pid) == "running"
    assert demo.infer()["digest"] == reference


@needs_root
def test_a_directory_swapped_for_a_link_after_its_check_is_not_chmodded_or_chowned_through_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race the issue reproduced, made deterministic: the user's ``locks/`` is swapped for a
    link to a root-owned directory right after hibernate first looks at it. The checks and
    changes act on the opened directory, so the root-owned one keeps its owner and mode."""
    from hibernate.fsutil import ensure_private_dir

    victim = tmp_path / "root-owned"
    victim.mkdir()
    victim.chmod(0o755)
    locks = tmp_path / "locks"
    locks.mkdir()
    locks.chmod(0o755)  # loose and root's: hibernate would tighten it and hand it to the user
    real_lstat, real_fstat = os.lstat, os.fstat
    swapped: list[bool] = []

    def swap_after(real: Any) -> Any:
        def look(*args: Any, **kwargs: Any) -> os.stat_result:
            result = real(*args, **kwargs)
            if not swapped:
                swapped.append(True)
                locks.rename(tmp_path / "moved-away")
                locks.symlink_to(victim)
            return result

        return look

    monkeypatch.setattr(os, "lstat", swap_after(real_lstat))
    monkeypatch.setattr(os, "fstat", swap_after(real_fstat))
    try:
        ensure_private_dir(locks, owner_uid=NOBODY)
    except Exception as exc:  # refusing is fine too; acting through the link is not
        print(f"refused: {exc}")
    monkeypatch.undo()
    assert swapped, "the swap happened"
    assert owner_and_mode(victim) == (0, 0o755)


def test_a_link_of_another_user_on_the_way_is_refused_one_of_root_or_ours_is_followed(tmp_path: Path) -> None:
    """Parents are reached one descriptor at a time: a link on the way is followed only if root's or ours."""
    from hibernate.errors import PermissionDeniedError
    from hibernate.fsutil import ensure_private_dir

    real = tmp_path / "real"
    real.mkdir()
    ours = tmp_path / "ours"
    ours.symlink_to(real)
    ensure_private_dir(ours / "locks")
    assert owner_and_mode(real / "locks") == (os.getuid(), 0o700)
    if not is_root():
        return
    theirs = tmp_path / "theirs"
    theirs.symlink_to(real)
    os.lchown(theirs, NOBODY, NOBODY)
    with pytest.raises(PermissionDeniedError, match="symbolic link owned by uid 65534"):
        ensure_private_dir(theirs / "journal", owner_uid=NOBODY)
    assert not (real / "journal").exists()


@needs_root
def test_root_gives_what_it_creates_for_a_user_to_that_user(tmp_path: Path) -> None:
    """Directories root creates for a user (parents too) and a root-owned leftover go to the user;
    a third user's directory is never given away."""
    from hibernate.errors import PermissionDeniedError
    from hibernate.fsutil import ensure_private_dir

    ensure_private_dir(tmp_path / "a" / "b", owner_uid=NOBODY)
    assert owner_and_mode(tmp_path / "a" / "b") == (NOBODY, 0o700)
    assert (tmp_path / "a").stat().st_uid == NOBODY
    leftover = tmp_path / "leftover"
    leftover.mkdir(mode=0o755)
    ensure_private_dir(leftover, owner_uid=NOBODY)
    assert owner_and_mode(leftover) == (NOBODY, 0o700)
    third = tmp_path / "third"
    third.mkdir(mode=0o755)
    os.chown(third, 12345, 12345)
    with pytest.raises(PermissionDeniedError, match="belongs to uid 12345, not to uid 65534"):
        ensure_private_dir(third, owner_uid=NOBODY)
    assert owner_and_mode(third) == (12345, 0o755)


# -- after root, the user's own commands still work -----------------------------------------------


@needs_root
@pytest.mark.slow
def test_after_root_slept_and_woke_a_users_process_the_user_can_too(
    start_demo: Callable[..., Any], cli: Callable[..., Any], runtime_dir: Path, work_dir: Path
) -> None:
    """Root's lock file and directories belong to the process's user, so the user's own
    ``hibernate sleep``/``wake`` of the same process work afterwards (on main: exit 1)."""
    demo = start_user_demo(start_demo, runtime_dir, NOBODY)
    reference = demo.infer()["digest"]
    os.chmod(work_dir, 0o755)
    snaps = work_dir / "snaps"
    assert cli("sleep", str(demo.pid), "--to", str(snaps), "-q").returncode == 0
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    run = user_runtime(runtime_dir, NOBODY)
    created = [run / "locks", run / "journal", *(run / "locks").iterdir()]
    assert any(p.suffix == ".lock" for p in created), "root took a lock file there"
    for path in created:
        assert path.lstat().st_uid == NOBODY, f"{path} belongs to uid {path.lstat().st_uid}"
    user = as_user(NOBODY, runtime_dir)
    slept = cli("sleep", str(demo.pid), "--to", str(snaps), "-q", **user)
    assert slept.returncode == 0, slept.stderr
    woke = cli("wake", str(demo.pid), "-q", **user)
    assert woke.returncode == 0, woke.stderr
    assert demo.infer()["digest"] == reference


@needs_root
@pytest.mark.slow
def test_a_journal_entry_root_leaves_belongs_to_the_user_who_can_recover(
    start_demo: Callable[..., Any], cli: Callable[..., Any], runtime_dir: Path, work_dir: Path
) -> None:
    """Root's command killed after the spill leaves a journal entry owned by the process's user,
    and the user's own ``hibernate recover`` resolves it."""
    demo = start_user_demo(start_demo, runtime_dir, NOBODY)
    reference = demo.infer()["digest"]
    os.chmod(work_dir, 0o755)
    killed = cli(
        "sleep",
        str(demo.pid),
        "--to",
        str(work_dir / "snaps"),
        env={"HIBERNATE_FAULT": "sleep.after-spill:kill"},
    )
    assert killed.returncode == -9, killed.stderr
    journal = user_runtime(runtime_dir, NOBODY) / "journal"
    entries = [p for p in journal.iterdir() if p.suffix == ".json"]
    assert len(entries) == 1
    assert owner_and_mode(entries[0]) == (NOBODY, 0o600)
    user = as_user(NOBODY, runtime_dir)
    recovered = cli("recover", str(demo.pid), "-q", **user)
    assert recovered.returncode == 0, recovered.stderr
    assert agent_state(demo.pid) == "running"
    assert demo.infer()["digest"] == reference


@pytest.mark.slow
@needs_root
def test_a_root_owned_lock_file_tells_the_user_how_to_clear_it(runtime_dir: Path) -> None:
    """A lock file an older root-run hibernate left is refused with exit 5 and the command to remove it,
    never a bare PermissionError (exit 1); root's next command hands it over instead."""
    from hibernate import procinfo
    from hibernate.errors import PermissionDeniedError
    from hibernate.operation.journal import TargetLock

    ident = procinfo.identity(os.getpid())
    assert ident is not None
    run = runtime_dir.parent / "nobody"  # the fixture's parent is reachable by every user
    run.mkdir(mode=0o700)
    os.chown(run, NOBODY, NOBODY)
    (run / "locks").mkdir(mode=0o700)
    os.chown(run / "locks", NOBODY, NOBODY)
    leftover = run / "locks" / f"{ident.pid}-{ident.start_time}.lock"
    leftover.write_text("")
    leftover.chmod(0o600)
    probe = subprocess.run(
        [
            *as_user_prefix(NOBODY),
            sys.executable,
            "-c",
            PROBE_LOCK,
            str(run),
            str(ident.pid),
            str(ident.start_time),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(source_root_for(NOBODY))},
        cwd=source_root_for(NOBODY),
    )
    answer = json.loads(probe.stdout or "{}")
    assert answer.get("exit_code") == ExitCode.PERMISSION_DENIED, probe.stderr
    assert f"rm {leftover}" in answer["hint"]
    lock = TargetLock(run, ident, owner_uid=NOBODY)
    lock.acquire("test")
    lock.release()
    assert owner_and_mode(leftover) == (NOBODY, 0o600)
    hardlinked = run / "locks" / "1-1.lock"
    os.link(leftover, hardlinked)
    with pytest.raises(PermissionDeniedError, match="not a plain file of its own"):
        TargetLock(run, ident, owner_uid=NOBODY).acquire("test")


PROBE_LOCK = """
import json, sys
from pathlib import Path
from hibernate.errors import HibernateError
from hibernate.operation.journal import TargetLock
from hibernate.procinfo import ProcessIdentity
try:
    TargetLock(Path(sys.argv[1]), ProcessIdentity(int(sys.argv[2]), int(sys.argv[3]))).acquire("user")
    print(json.dumps({"exit_code": 0}))
except HibernateError as exc:
    print(json.dumps({"exit_code": int(exc.exit_code), "hint": exc.hint}))
"""


# -- one command, several users: only when asked ------------------------------------------------


@dataclass
class Launcher:
    """A root process (a shell) whose children are demo targets of the given users."""

    proc: subprocess.Popen[bytes]
    demos: list[dict[str, Any]]

    @property
    def pid(self) -> int:
        return self.proc.pid


@pytest.fixture
def launch(runtime_dir: Path) -> Iterator[Any]:
    started: list[Launcher] = []
    scratch = Path(tempfile.mkdtemp(prefix="hb-launch-", dir="/tmp"))
    os.chmod(scratch, 0o777)

    def start(uids: list[int]) -> Launcher:
        lines, ready = [], []
        for index, uid in enumerate(uids):
            source = source_root_for(uid)
            control, done = (
                scratch / f"{len(started)}-{index}.sock",
                scratch / f"{len(started)}-{index}.ready",
            )
            ready.append(done)
            env = f"HIBERNATE_RUNTIME_DIR={user_runtime(runtime_dir, uid)} PYTHONPATH={source}"
            argv = [
                *as_user_prefix(uid), sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve",
                "--size-mb", "8", "--control", str(control), "--ready-file", str(done),
            ]  # fmt: skip
            lines.append(f"(cd {source} && {env} exec {' '.join(argv)}) &")
        proc = subprocess.Popen(["bash", "-c", "\n".join([*lines, "wait"])], stdout=subprocess.DEVNULL)
        launcher = Launcher(proc, [])
        started.append(launcher)
        try:
            wait_until(
                lambda: all(done.exists() for done in ready), 120, "the demos to be ready", 0.05, process=proc
            )
        finally:  # those that started are stopped with the launcher, even if another did not
            launcher.demos.extend(json.loads(done.read_text()) for done in ready if done.exists())
        return launcher

    yield start
    for launcher in started:
        for demo in launcher.demos:
            with contextlib.suppress(ProcessLookupError):
                os.kill(demo["pid"], 9)
        launcher.proc.kill()
        launcher.proc.wait()
    shutil.rmtree(scratch, ignore_errors=True)


def digest(demo: dict[str, Any]) -> str:
    from hibernate.demo import request

    value: str = request(demo["control"], "infer", 60)["digest"]
    return value


@needs_root
@pytest.mark.slow
def test_a_root_tree_holding_two_users_agents_needs_all_users(
    launch: Callable[..., Any], second_user: int, cli: Callable[..., Any], runtime_dir: Path, work_dir: Path
) -> None:
    """``hibernate sleep ROOT_PID`` reaching agents of two users is refused (exit 2, hint --all-users)
    with nothing quiesced; with ``--all-users`` the same command sleeps and wakes both."""
    launcher = launch([NOBODY, second_user])
    references = [digest(d) for d in launcher.demos]
    os.chmod(work_dir, 0o755)
    snaps = work_dir / "snaps"
    for command in (["sleep", str(launcher.pid), "--to", str(snaps)], ["wake", str(launcher.pid)],
                    ["status", str(launcher.pid)], ["recover", str(launcher.pid)]):  # fmt: skip
        refused = cli(*command, "--json")
        assert refused.returncode == ExitCode.USAGE, refused.stdout + refused.stderr
        error = refused.json()["error"]
        assert "hold hibernate agents of 2 users" in error["message"]
        assert f"(uid {NOBODY})" in error["message"] and f"(uid {second_user})" in error["message"]
        assert "--all-users" in error["hint"]
    assert [agent_state(d["pid"]) for d in launcher.demos] == ["running", "running"]
    assert not snaps.exists(), "nothing was written"
    slept = cli("sleep", str(launcher.pid), "--to", str(snaps), "--all-users", "--json")
    assert slept.returncode == 0, slept.stderr
    assert sorted(p["pid"] for p in slept.json()["processes"]) == sorted(d["pid"] for d in launcher.demos)
    assert [agent_state(d["pid"]) for d in launcher.demos] == ["asleep", "asleep"]
    assert owner_and_mode(snaps) == (0, 0o1777), "shared like /tmp: each agent makes its own 0700 dir"
    woke = cli("wake", str(launcher.pid), "--all-users", "-q")
    assert woke.returncode == 0, woke.stderr
    assert [digest(d) for d in launcher.demos] == references


@needs_root
@pytest.mark.slow
def test_a_root_tree_holding_one_users_agents_needs_no_flag(
    launch: Callable[..., Any], cli: Callable[..., Any], runtime_dir: Path, work_dir: Path
) -> None:
    """Root acting on one user's process through a root launcher (the common case) works as before."""
    launcher = launch([NOBODY])
    reference = digest(launcher.demos[0])
    os.chmod(work_dir, 0o755)
    slept = cli("sleep", str(launcher.pid), "--to", str(work_dir / "snaps"), "-q")
    assert slept.returncode == 0, slept.stderr
    assert agent_state(launcher.demos[0]["pid"]) == "asleep"
    woke = cli("wake", str(launcher.pid), "-q")
    assert woke.returncode == 0, woke.stderr
    assert digest(launcher.demos[0]) == reference


def test_several_users_agents_are_refused_before_anything_unless_asked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The rule itself, without processes: one user's agents pass; two users' need all_users."""
    from hibernate.errors import UsageError
    from hibernate.operation import targets
    from hibernate.procinfo import ProcessIdentity

    owners = {10: 1000, 11: 1000, 12: 1001}
    monkeypatch.setattr(targets.procinfo, "owner_uid", owners.get)

    def target(pid: int, agents: list[int]) -> targets.Target:
        refs = [targets.AgentRef(ProcessIdentity(a, 1), Path(f"/x/{a}"), {}) for a in agents]
        return targets.Target(requested_pid=pid, processes=[pid, *agents], agents=refs)

    targets.check_one_user([target(1, [10, 11])], all_users=False)
    with pytest.raises(
        UsageError, match=r"agents of 2 users .*uid 1000\): pids 10, 11; .*uid 1001\): pid 12"
    ) as err:
        targets.check_one_user([target(1, [10, 11, 12])], all_users=False)
    assert "--all-users" in (err.value.hint or "")
    targets.check_one_user([target(1, [10]), target(2, [12])], all_users=True)
