"""`hibernate gc --dry-run` says what `hibernate gc` then frees, snapshot by snapshot and in total.

Snapshots share data files through hard links (a re-sleep links the chunks it
reuses), so the space a deletion frees is that of the files whose last link
goes: a file shared with a snapshot that is kept frees nothing, one shared by
two deleted snapshots counts once. Both runs count so, the manifest included.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from hibernate.store.maintenance import collect_garbage
from tests.test_store_publish import KiB, content, write


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
