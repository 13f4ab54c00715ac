"""Each claim of docs/security.md, checked."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from hibernate.errors import ExitCode
from tests.conftest import REPO, spill_root_of


def modes_under(path: Path) -> dict[str, int]:
    found = {}
    for entry in [path, *path.rglob("*")]:
        found[str(entry.relative_to(path.parent))] = stat.S_IMODE(entry.lstat().st_mode)
    return found


def test_everything_hibernate_creates_is_private(start_demo, cli, work_dir: Path, runtime_dir: Path) -> None:
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


def test_a_planted_symlink_for_a_process_directory_is_refused(start_demo, cli, work_dir: Path) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    elsewhere = work_dir / "elsewhere"
    elsewhere.mkdir()
    (work_dir / "snaps").mkdir()
    spill_root_of(work_dir / "snaps", demo.pid).symlink_to(elsewhere)
    result = cli("sleep", str(demo.pid), "--to", str(work_dir / "snaps"))
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
