"""Atomic publish: a crash at any point leaves the old snapshot or the new one, never a mix.

A crash is simulated two ways: the writing process "dies" at its k-th file
system call (that call and every later one fail, cleanup code included, so
whatever a real crash would leave stays), for every k; and a real writer
process is killed with SIGKILL at random moments. Leftovers go with the next
write or ``hibernate gc``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hibernate.store.layout import SpillRoot
from hibernate.store.maintenance import collect_garbage
from hibernate.store.options import WriteOptions
from hibernate.store.reader import SnapshotReader
from hibernate.store.writer import write_snapshot
from tests.conftest import REPO
from tests.test_store_roundtrip import BytesRegion

KiB = 1024
OPTIONS = WriteOptions(chunk_bytes=16 * KiB, buffer_bytes=64 * KiB)
WRAPPED = ("mkdir", "open", "pwritev", "write", "fsync", "rename", "unlink", "rmdir")


def content(seed: int) -> list[BytesRegion]:
    rng = random.Random(seed)
    return [BytesRegion(f"weights/r{i}", "weights", rng.randbytes(40 * KiB + i)) for i in range(3)]


def write(root_path: Path, regions: list[BytesRegion], options: WriteOptions = OPTIONS) -> Any:
    with SpillRoot(root_path, create=True) as root:
        return write_snapshot(root, regions, producer={}, options=options)


def newest_content(root_path: Path) -> list[bytes] | None:
    """What a wake would read now: the newest published snapshot, verified (None: none is)."""
    with SpillRoot(root_path, inspect=True) as root:
        if not root.published():
            return None
        name = root.published()[-1]
        blanks = [r.blank() for r in content(0)]
        with SnapshotReader(root, name) as reader:
            reader.read_into(blanks)
    return [bytes(b.data) for b in blanks]


def assert_clean(root_path: Path) -> None:
    """One published snapshot; no temporaries; every data file left is referenced by it."""
    with SpillRoot(root_path, inspect=True) as root:
        published = root.published()
        assert len(published) == 1, published
        manifest = root.read_manifest(published[0])
    names = sorted(p.name for p in root_path.iterdir() if p.name not in (".lock", ".hibernate-root"))
    assert names == published, names
    files = {p.name for p in (root_path / published[0]).iterdir() if p.name != "manifest.json"}
    assert files == set(manifest.files), (files, manifest.files)


class Crash(BaseException):
    """The writing process died here (BaseException: no ``except OSError`` catches it)."""


class Death:
    """Makes the k-th file system call of the armed stretch, and every later one, raise Crash."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.armed = False
        self.k = 0
        self.seen: list[str] = []
        self.dead = False
        for name in WRAPPED:
            self._wrap(monkeypatch, name)

    def _wrap(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        real = getattr(os, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.armed:
                self.seen.append(name)
                if self.dead or len(self.seen) == self.k:
                    self.dead = True
                    raise Crash(f"died at call {len(self.seen)} ({name})")
            return real(*args, **kwargs)

        monkeypatch.setattr(os, name, call)

    def arm(self, k: int) -> None:
        self.armed, self.k, self.dead = True, k, False
        self.seen.clear()

    def disarm(self) -> None:
        self.armed = False


@pytest.fixture
def death(monkeypatch: pytest.MonkeyPatch) -> Death:
    return Death(monkeypatch)


def test_a_crash_at_every_step_leaves_old_or_new(tmp_path: Path, death: Death) -> None:
    template = tmp_path / "template"
    old, new = content(1), content(2)
    write(template, old)
    old_bytes, new_bytes = [bytes(r.data) for r in old], [bytes(r.data) for r in new]
    shutil.copytree(template, tmp_path / "counting")
    death.arm(0)  # never fires: counts the calls of a write that does not crash
    write(tmp_path / "counting", new)
    death.disarm()
    steps = len(death.seen)
    assert steps > 10 and {"pwritev", "fsync", "rename", "unlink"} <= set(death.seen), death.seen

    # The old snapshot is deleted once the new one's data is durable, just before the new
    # one is published (it is only a cache then: the process still holds its memory), so
    # a crash in between leaves neither; never a mix.
    outcomes = {"old": 0, "new": 0, "neither": 0}
    for k in range(1, steps + 1):
        root_path = tmp_path / f"crash-{k}"
        shutil.copytree(template, root_path)
        death.arm(k)
        with pytest.raises(Crash):
            write(root_path, new)
        death.disarm()
        now = newest_content(root_path)
        assert now in (old_bytes, new_bytes, None), (
            f"torn snapshot after a crash at step {k} ({death.seen[-1]})"
        )
        outcomes["neither" if now is None else "old" if now == old_bytes else "new"] += 1
        if k % 2:
            collect_garbage(root_path)
        else:
            write(root_path, new)
        if newest_content(root_path) is not None:
            assert_clean(root_path)
        assert newest_content(root_path) in (old_bytes, new_bytes, None)
        shutil.rmtree(root_path)
    assert outcomes["old"] and outcomes["new"], outcomes
    assert outcomes["neither"] < outcomes["old"], "the window without a snapshot is a few calls wide"


# A writer that publishes content(0), content(1), content(0)... until killed. It needs no
# torch, so it starts fast; its regions are built exactly as content() builds them.
WRITER = r"""
import ctypes, random, sys
sys.path.insert(0, sys.argv[2])
from hibernate.store.layout import SpillRoot
from hibernate.store.options import WriteOptions
from hibernate.store.writer import write_snapshot

class Region:
    def __init__(self, key, data):
        self.key, self.tag, self.data, self.meta = key, "weights", data, {"kind": "bytes"}
        self.nbytes = len(data)
        self.held = bytearray(data)  # where the writer reads small chunks from (host_address)
    def copy_out(self, offset, dst):
        dst[:] = self.data[offset : offset + len(dst)]
    def host_view(self, offset, length):
        return memoryview(self.data)[offset : offset + length]
    def host_address(self):
        return ctypes.addressof(ctypes.c_char.from_buffer(self.held))

def content(seed):
    rng = random.Random(seed)
    return [Region(f"weights/r{i}", rng.randbytes(40 * 1024 + i)) for i in range(3)]

options = WriteOptions(chunk_bytes=16 * 1024, buffer_bytes=64 * 1024, reuse=False)
with SpillRoot(sys.argv[1], create=True) as root:
    i = 0
    while True:
        write_snapshot(root, content(i % 2), producer={}, options=options)
        print(i, flush=True)
        i += 1
"""


def test_a_writer_killed_at_random_moments_leaves_old_or_new(tmp_path: Path) -> None:
    rng = random.Random(1234)
    expected = [[bytes(r.data) for r in content(i)] for i in (0, 1)]
    for attempt in range(8):
        root_path = tmp_path / f"killed-{attempt}"
        writer = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(root_path), str(REPO)], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None
        assert writer.stdout.readline().strip() == "0"  # one snapshot published
        time.sleep(rng.uniform(0, 0.05))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        assert newest_content(root_path) in [*expected, None], f"torn snapshot in attempt {attempt}"
        collect_garbage(root_path)
        assert not root_path.exists(), "gc removes the root of a process that is gone"


def test_published_snapshots_are_private(tmp_path: Path) -> None:
    root_path = tmp_path / "proc"
    result = write(root_path, content(3))
    for path in [root_path, *root_path.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    assert result.path == root_path / "snap-000001"


# -- what a crash leaves (`hibernate gc` of it: tests/test_store_gc.py) ---------------


def make_leftovers(root_path: Path) -> dict[str, Path]:
    """A root as crashes and failures leave it: a temporary, a retired snapshot, a newer one."""
    write(root_path, content(4))
    newest = write(root_path, content(5)).snapshot
    tmp = root_path / ".tmp-snap-000009-deadbeef"
    tmp.mkdir(mode=0o700)
    (tmp / "data-000.bin").write_bytes(os.urandom(64 * KiB))
    retired = root_path / "snap-000001"
    retired.mkdir(mode=0o700, exist_ok=True)
    (retired / "data-001.bin").write_bytes(os.urandom(32 * KiB))
    return {"tmp": tmp, "retired": retired, "newest": root_path / newest}


def test_the_next_write_cleans_what_a_crash_left(tmp_path: Path) -> None:
    root_path = tmp_path / "proc"
    paths = make_leftovers(root_path)
    result = write(root_path, content(5))
    assert result.written_bytes == 0, "the newest snapshot's chunks are reused"
    assert not paths["tmp"].exists() and not paths["retired"].exists()
    assert_clean(root_path)
    manifest = json.loads((result.path / "manifest.json").read_text())
    used = set(manifest["chunks"]["file"])
    assert used == set(manifest["files"]) and all((result.path / f).is_file() for f in used)
