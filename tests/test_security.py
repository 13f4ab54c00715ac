"""Each claim of docs/security.md, checked."""

from __future__ import annotations

import ast
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from tests.conftest import REPO, spill_root_of


def modes_under(path: Path) -> dict[str, int]:
    found = {}
    for entry in [path, *path.rglob("*")]:
        found[str(entry.relative_to(path.parent))] = stat.S_IMODE(entry.lstat().st_mode)
    return found


def test_everything_hibernate_creates_is_private(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path, runtime_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    snapshots = work_dir / "snaps"
    assert cli("sleep", str(demo.pid), "--to", str(snapshots), "-q").returncode == 0
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    for tree in (snapshots, runtime_dir):
        for name, mode in modes_under(tree).items():
            path = tree.parent / name
            if path.is_socket():
                assert mode & 0o077 == 0, f"{name} is {oct(mode)}"
            elif path.is_dir():
                assert mode == 0o700, f"{name} is {oct(mode)}"
            else:
                assert mode == 0o600, f"{name} is {oct(mode)}"
    assert any(p.suffix == ".bin" for p in snapshots.rglob("*")), "the walk saw the data files"


def test_a_planted_symlink_for_a_process_directory_is_refused(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    """The root's name cannot be known before its first sleep, so the link is planted after it."""
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    snaps = work_dir / "snaps"
    assert cli("sleep", str(demo.pid), "--to", str(snaps), "-q").returncode == 0
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    root = spill_root_of(snaps, demo.pid)
    elsewhere = work_dir / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(root)
    root.symlink_to(elsewhere)
    result = cli("sleep", str(demo.pid), "--to", str(snaps))
    assert result.returncode == ExitCode.PERMISSION_DENIED, result.stderr
    assert "is a symbolic link; refusing to use it" in result.stderr
    assert not any(elsewhere.iterdir()), "nothing was written through the link"
    assert demo.infer()["digest"] == reference


def test_a_symlinked_runtime_directory_is_refused(tmp_path: Path) -> None:
    from hibernate.errors import PermissionDeniedError
    from hibernate.fsutil import ensure_private_dir

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(PermissionDeniedError, match="symbolic link"):
        ensure_private_dir(link)


def test_a_directory_of_another_user_is_not_adopted(tmp_path: Path) -> None:
    from hibernate.errors import PermissionDeniedError
    from hibernate.fsutil import ensure_private_dir

    if os.getuid() != 0:
        pytest.skip("needs root to create a directory owned by someone else")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(PermissionDeniedError, match="belongs to uid 65534"):
        ensure_private_dir(theirs)


FORBIDDEN_CALLS = {"eval", "exec", "compile", "__import__"}
FORBIDDEN_MODULES = {"pickle", "marshal", "shelve", "dill", "cloudpickle"}


def test_nothing_read_back_is_ever_executed() -> None:
    """No module of hibernate can turn bytes into code: no pickle, eval, exec or torch.load."""
    for source in sorted((REPO / "hibernate").rglob("*.py")):
        tree = ast.parse(source.read_text(), str(source))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = {a.name.split(".")[0] for a in node.names}
                if isinstance(node, ast.ImportFrom) and node.module:
                    names.add(node.module.split(".")[0])
                assert not names & FORBIDDEN_MODULES, f"{source}: imports {names & FORBIDDEN_MODULES}"
            if isinstance(node, ast.Call):
                func = node.func
                if isinstance(func, ast.Name):  # the builtins; re.compile and friends are fine
                    assert func.id not in FORBIDDEN_CALLS, f"{source}:{node.lineno}: calls {func.id}"
                if isinstance(func, ast.Attribute) and func.attr == "load":
                    owner = func.value.id if isinstance(func.value, ast.Name) else ""
                    assert owner not in ("torch", "pickle"), f"{source}:{node.lineno}: {owner}.load"


def _names_anyone_can_compute(pid: int) -> list[str]:
    """Every name of a process's root that public facts (boot id, pid namespace, pid, start time) give:
    the digest of them that named roots before, and the bare label."""
    import xxhash

    from hibernate import procinfo

    started = procinfo.start_time(pid)
    key = "\0".join(map(str, (procinfo.boot_id(), procinfo.pid_namespace(pid) or 0, pid, started)))
    digest = f"{xxhash.xxh3_64_intdigest(key.encode()):016x}"[:12]
    return [f"proc-{pid}-{digest}", f"proc-{pid}"]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create directories as another user")
def test_another_user_cannot_claim_a_processs_directory_in_a_shared_to_in_advance(
    start_demo: Callable[..., Any], cli: Callable[..., Any], work_dir: Path
) -> None:
    nobody = 65534
    shared = work_dir / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    demo = start_demo(size_mb=8)
    reference = demo.infer()["digest"]
    claimed = []
    for name in _names_anyone_can_compute(demo.pid):
        path = shared / name
        path.mkdir()
        os.chown(path, nobody, nobody)
        claimed.append(path)
    result = cli("sleep", str(demo.pid), "--to", str(shared), "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    root = spill_root_of(shared, demo.pid)
    assert root.is_dir() and root not in claimed
    assert root.stat().st_uid == os.getuid() and stat.S_IMODE(root.stat().st_mode) == 0o700
    assert all(not any(path.iterdir()) for path in claimed), "nothing was written into another's directory"
    assert cli("wake", str(demo.pid), "-q").returncode == 0
    assert demo.infer()["digest"] == reference


def test_two_agents_draw_different_directory_names() -> None:
    from hibernate import procinfo
    from hibernate.agent.controller import Agent

    ident = procinfo.identity(os.getpid())
    assert ident is not None
    first, second = Agent(ident), Agent(ident)
    assert len(first.root_token) == 12 and first.root_token != second.root_token
