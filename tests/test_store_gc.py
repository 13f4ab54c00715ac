"""`hibernate gc` (hibernate/store/maintenance.py): what it frees, what it keeps, what it never touches.

`gc --dry-run` says what `gc` then frees, snapshot by snapshot and in total.

Snapshots share data files through hard links (a re-sleep links the chunks it
reuses), so the space a deletion frees is that of the files whose last link
goes: a file shared with a snapshot that is kept frees nothing, one shared by
two deleted snapshots counts once. Both runs count so, the manifest included.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from hibernate.store.layout import SpillRoot
from hibernate.store.maintenance import collect_garbage
from hibernate.store.owner import Owner, liveness
from tests.conftest import spill_root_of
from tests.test_cli_json_schema import valid
from tests.test_store_publish import KiB, assert_clean, content, make_leftovers, newest_content, write


def blocks(path: Path) -> int:
    return os.stat(path).st_blocks * 512


def test_a_dry_run_foresees_what_gc_frees_counting_a_shared_file_only_where_its_last_link_goes(
    tmp_path: Path,
) -> None:
    root = tmp_path / "proc"
    write(root, content(4))
    newest = root / write(root, content(4)).snapshot  # a re-sleep: one data file, reused
    (shared,) = newest.glob("reused-*.bin")
    # What a re-sleep killed while writing leaves: its own new data, and a link to the chunks it reused.
    crashed = root / ".tmp-snap-000009-deadbeef"
    crashed.mkdir(mode=0o700)
    (crashed / "data-000.bin").write_bytes(os.urandom(64 * KiB))
    os.link(shared, crashed / "reused-000.bin")
    # An older snapshot still there: its own data, its manifest, and a link to a file the newest uses.
    older = root / "snap-000001"
    older.mkdir(mode=0o700)
    shutil.copy(newest / "manifest.json", older / "manifest.json")
    (older / "data-000.bin").write_bytes(os.urandom(32 * KiB))
    os.link(shared, older / "reused-000.bin")
    expected = {
        str(crashed): blocks(crashed / "data-000.bin"),
        str(older): blocks(older / "data-000.bin") + blocks(older / "manifest.json"),
    }

    planned = collect_garbage(tmp_path, dry_run=True)
    foreseen = {a["path"]: a["bytes"] for a in planned["roots"][0]["actions"] if a["delete"]}
    assert foreseen == expected  # the shared file counted nowhere: the newest keeps it
    assert planned["freed_bytes"] == 0 and crashed.exists() and older.exists()

    done = collect_garbage(tmp_path)
    freed = {a["path"]: a["bytes"] for a in done["roots"][0]["actions"] if a["delete"]}
    assert freed == expected and done["freed_bytes"] == sum(expected.values())
    assert not crashed.exists() and not older.exists() and shared.exists()


def test_a_file_two_deleted_snapshots_share_counts_once_with_the_last_of_them(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    write(root, content(4))
    newest = root / write(root, content(5)).snapshot
    first, second = root / ".tmp-snap-000007-aaaaaaaa", root / ".tmp-snap-000008-bbbbbbbb"
    for leftover in (first, second):
        leftover.mkdir(mode=0o700)
    (first / "data-000.bin").write_bytes(os.urandom(48 * KiB))
    os.link(first / "data-000.bin", second / "reused-000.bin")
    size = blocks(first / "data-000.bin")

    planned = collect_garbage(tmp_path, dry_run=True)
    foreseen = {a["path"]: a["bytes"] for a in planned["roots"][0]["actions"] if a["delete"]}
    assert foreseen == {str(first): 0, str(second): size}
    done = collect_garbage(tmp_path)
    assert {a["path"]: a["bytes"] for a in done["roots"][0]["actions"] if a["delete"]} == foreseen
    assert done["freed_bytes"] == size and newest.exists()


# -- leftovers of a crash, a root in use, a damaged manifest ------------------------------


def test_gc_frees_leftovers_and_keeps_the_newest(cli: Any, work_dir: Path) -> None:
    root_path = work_dir / "proc-1"
    paths = make_leftovers(root_path)
    result = cli("gc", str(work_dir), "--json")
    assert result.returncode == 0, result.stderr
    report = result.json()
    assert report["freed_bytes"] >= 96 * KiB
    assert [r["path"] for r in report["roots"]] == [str(root_path)]
    assert report["warnings"] == []
    assert not paths["tmp"].exists() and not paths["retired"].exists()
    assert_clean(root_path)
    assert newest_content(root_path) == [bytes(r.data) for r in content(5)]
    human = cli("gc", str(root_path))
    assert human.returncode == 0 and "total freed: 0 B" in human.stdout, human.stdout
    assert f"{paths['newest']}: kept: its process" in human.stdout, human.stdout


def test_gc_skips_a_root_in_use(cli: Any, work_dir: Path) -> None:
    root_path = work_dir / "proc-2"
    paths = make_leftovers(root_path)
    with SpillRoot(root_path) as root:
        assert root.lock(exclusive=False)  # a wake is reading it
        report = cli("gc", str(work_dir), "--json").json()
    assert report["roots"][0]["skipped"] is True
    assert paths["tmp"].exists(), "nothing was touched"


def test_gc_keeps_everything_when_the_newest_manifest_cannot_be_read(cli: Any, work_dir: Path) -> None:
    root_path = work_dir / "proc-3"
    write(root_path, content(6))
    newest = write(root_path, content(7))
    # A newer snapshot whose manifest got damaged: it may be what a sleeping process needs once repaired.
    broken = root_path / "snap-000003"
    shutil.copytree(root_path / newest.snapshot, broken)
    (broken / "manifest.json").write_text("{ damaged")
    report = cli("gc", str(work_dir), "--json").json()
    reasons = {a["path"]: a["reason"] for a in report["roots"][0]["actions"]}
    assert f"{broken}/manifest.json cannot be read" in reasons[str(broken)], reasons
    with SpillRoot(root_path) as root:
        assert root.published() == ["snap-000002", "snap-000003"]


def test_gc_of_a_missing_directory_is_a_usage_error(cli: Any, work_dir: Path) -> None:
    result = cli("gc", str(work_dir / "nope"))
    assert result.returncode == ExitCode.USAGE
    assert "is not a directory" in result.stderr


# -- 3. gc touches only what hibernate made ----------------------------------------------


def tree(directory: Path) -> list[tuple[str, int, int, bytes]]:
    """Every path under ``directory`` with its mode, mtime and (for files) contents."""
    found = []
    for path in sorted(directory.rglob("*")):
        info = path.lstat()
        content = path.read_bytes() if path.is_file() and not path.is_symlink() else b""
        found.append((str(path.relative_to(directory)), info.st_mode, info.st_mtime_ns, content))
    return found


@pytest.mark.slow
def test_gc_changes_nothing_in_a_tree_hibernate_did_not_make(cli: Any, work_dir: Path) -> None:
    for name in ("backups/snap-20240101", "backups/.tmp-export", "cache/snap-000001", "proc-42/.tmp-x"):
        (work_dir / name).mkdir(parents=True)
        (work_dir / name / "data.bin").write_bytes(os.urandom(4 * KiB))
    (work_dir / "cache" / ".lock").write_text("someone else's lock")
    (work_dir / ".tmp-upload").write_text("half an upload")
    (work_dir / "proc-42" / "snap-000003").mkdir()
    before = tree(work_dir)
    for args in (["--dry-run"], [], ["--awake"]):
        result = cli("gc", str(work_dir), *args, "--json")
        assert result.returncode == 0, result.stderr
        assert result.json()["roots"] == [] and result.json()["freed_bytes"] == 0
        assert tree(work_dir) == before, f"gc {args} changed something"
    for directory in ("backups", "cache", "proc-42"):
        assert cli("gc", str(work_dir / directory)).returncode == 0
        assert tree(work_dir) == before


# -- 7. gc reclaims what nobody needs, never a sleeping process's snapshot ------------------


@pytest.mark.slow
def test_gc_reclaims_dead_and_awake_processes_snapshots_never_an_asleep_ones(
    start_demo: Any, cli: Any, work_dir: Path
) -> None:
    asleep, dead, awake = start_demo(size_mb=8), start_demo(size_mb=8), start_demo(size_mb=8)
    reference = asleep.infer()["digest"]
    for demo in (asleep, dead, awake):
        assert cli("sleep", str(demo.pid), "--to", str(work_dir), "--quiet").returncode == 0
    assert cli("wake", str(awake.pid), "--quiet").returncode == 0
    roots = {
        name: spill_root_of(work_dir, d.pid)
        for name, d in (("asleep", asleep), ("dead", dead), ("awake", awake))
    }
    dead.stop()

    planned = valid("gc", cli("gc", str(work_dir), "--dry-run", "--json"))
    by_root = {r["path"]: r for r in planned["roots"]}
    assert by_root[str(roots["dead"])]["removed"] is True
    assert "is gone: it has exited" in by_root[str(roots["dead"])]["actions"][0]["reason"]
    assert [a["delete"] for a in by_root[str(roots["asleep"])]["actions"]] == [False]
    assert "is asleep" in by_root[str(roots["asleep"])]["actions"][0]["reason"]
    assert "--awake reclaims it" in by_root[str(roots["awake"])]["actions"][0]["reason"]
    assert all(root.exists() for root in roots.values()), "a dry run deletes nothing"

    collected = valid("gc", cli("gc", str(work_dir), "--json"))
    assert collected["freed_bytes"] >= 8 << 20
    assert not roots["dead"].exists()
    assert roots["asleep"].exists() and any(roots["awake"].glob("snap-*"))

    assert cli("gc", str(work_dir), "--awake", "--quiet").returncode == 0
    assert not any(roots["awake"].glob("snap-*")), "an awake process's kept snapshot goes with --awake"
    assert any(roots["asleep"].glob("snap-*")), "an asleep process's snapshot is never touched"
    assert cli("wake", str(asleep.pid), "--quiet").returncode == 0
    assert asleep.infer()["digest"] == reference
    assert cli("sleep", str(awake.pid), "--to", str(work_dir), "--quiet").returncode == 0


def test_liveness_is_judged_by_identity_not_by_pid() -> None:
    me = Owner.current()
    assert liveness(me)[0] == "alive"
    assert liveness(Owner(me.boot_id, me.pid_namespace, me.pid, me.start_time + 1))[0] == "dead"
    assert liveness(Owner("another-boot", 1, me.pid, me.start_time, "another-host"))[0] == "unknown"
    assert liveness(Owner("another-boot", 1, me.pid, me.start_time, me.hostname))[0] == "dead"
