"""A sleep never frees memory that its snapshot cannot bring back, and hibernate never touches
what it did not create: each test is a way an earlier version lost a process's memory or a file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import hibernate.store.manifest as manifest_module
from hibernate.errors import ExitCode, UnsupportedError
from hibernate.store.layout import SpillRoot
from hibernate.store.options import WriteOptions
from hibernate.store.owner import Owner
from hibernate.store.parse import parse_manifest
from hibernate.store.reader import SnapshotReader
from hibernate.store.writer import write_snapshot
from tests.conftest import NOBODY, REPO, is_root, spill_root_of, wait_until
from tests.test_store_roundtrip import BytesRegion

KiB = 1024


def state(cli: Any, pid: int) -> str:
    value: str = cli("status", str(pid), "--json").json()["agents"][0]["state"]
    return value


def only_snapshot(root: Path) -> Path:
    snapshots = sorted(root.glob("snap-*"))
    assert len(snapshots) == 1, snapshots
    return snapshots[0]


def flip_one_byte(path: Path, *, keep_mtime: bool = False) -> None:
    """Damage a data file as a stray writer would (optionally putting its mtime back)."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


# -- 1. a corrupted previous snapshot is never reused --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("keep_mtime", [False, True], ids=["plain-write", "mtime-put-back"])
def test_a_corrupted_previous_snapshot_is_rewritten_not_reused(
    start_demo: Any, cli: Any, work_dir: Path, keep_mtime: bool
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "--quiet").returncode == 0
    assert cli("wake", str(demo.pid), "--quiet").returncode == 0
    root = spill_root_of(work_dir, demo.pid)
    flip_one_byte(only_snapshot(root) / "data-000.bin", keep_mtime=keep_mtime)
    again = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json")
    assert again.returncode == 0, again.stderr
    spill = again.json()["processes"][0]
    assert spill["written_bytes"] > 0, "the damaged file's bytes were written again, not reused"
    woken = cli("wake", str(demo.pid), "--json")
    assert woken.returncode == 0, woken.stdout + woken.stderr
    assert demo.infer()["digest"] == reference


def test_an_unchanged_snapshot_is_still_reused_in_full(tmp_path: Path) -> None:
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(64 * KiB)) for i in range(3)]
    options = WriteOptions(chunk_bytes=16 * KiB, buffer_bytes=128 * KiB)
    with SpillRoot(tmp_path / "proc", create=True) as root:
        write_snapshot(root, regions, producer={}, options=options)
        again = write_snapshot(root, regions, producer={}, options=options)
        third = write_snapshot(root, regions, producer={}, options=options)
    assert (again.written_bytes, again.reused_bytes) == (0, 192 * KiB)
    assert (third.written_bytes, third.reused_bytes) == (0, 192 * KiB), "a reused file stays reusable"


def test_of_two_files_only_the_damaged_one_is_written_again(tmp_path: Path) -> None:
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(64 * KiB)) for i in range(3)]
    options = WriteOptions(chunk_bytes=16 * KiB, buffer_bytes=128 * KiB)
    with SpillRoot(tmp_path / "proc", create=True) as root:
        write_snapshot(root, regions, producer={}, options=options)
        regions[2].data[:] = os.urandom(64 * KiB)
        second = write_snapshot(root, regions, producer={}, options=options)
        assert sorted(second.manifest.files) == ["data-000.bin", "reused-000.bin"]
        flip_one_byte(second.path / "data-000.bin", keep_mtime=True)  # region 2's bytes, damaged
        third = write_snapshot(root, regions, producer={}, options=options)
        assert (third.written_bytes, third.reused_bytes) == (64 * KiB, 128 * KiB)
        blanks = [BytesRegion(r.key, r.tag, bytes(r.nbytes)) for r in regions]
        with SnapshotReader(root, third.snapshot) as reader:
            reader.read_into(blanks, buffer_bytes=128 * KiB)
    assert [b.data for b in blanks] == [r.data for r in regions]


def test_verify_reads_the_snapshot_back_before_anything_is_released(
    start_demo: Any, cli: Any, work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    result = cli("sleep", str(demo.pid), "--to", str(work_dir), "--verify", "--json")
    assert result.returncode == 0, result.stderr
    spill = result.json()["processes"][0]
    assert spill["verify_seconds"] > 0
    assert cli("wake", str(demo.pid), "--quiet").returncode == 0
    assert demo.infer()["digest"] == reference


# -- 2. one pid, two pid namespaces, one --to --------------------------------------------

NAMESPACED_TARGET = r"""
import ctypes, hashlib, os, sys, torch
import hibernate
torch.manual_seed(int(sys.argv[2]))
weights = {"w": torch.randn(256, 1024)}
hibernate.track(weights, name="model")
def digest():
    w = weights["w"]
    return hashlib.sha256(ctypes.string_at(w.data_ptr(), w.nbytes)).hexdigest()
reference = digest()
print(f"ready {os.getpid()} {reference}", flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "sleep":
        hibernate.sleep(sys.argv[1])
        print("asleep", flush=True)
    elif command == "wake":
        hibernate.wake()
        print("awake", "same" if digest() == reference else "DIFFERENT", flush=True)
"""


class Namespaced:
    """A target that is pid 1 of a pid namespace of its own, driven line by line."""

    def __init__(self, to: Path, seed: int) -> None:
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c",
             NAMESPACED_TARGET, str(to), str(seed)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, "PYTHONPATH": str(REPO), "HIBERNATE_AGENT": "0"},
        )  # fmt: skip
        words = self.read().split()
        assert words[0] == "ready", words
        self.pid = int(words[1])

    def read(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            raise AssertionError(f"the target died: {self.proc.stderr.read()}")
        return line.strip()

    def ask(self, command: str) -> str:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.read()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture
def namespaced(work_dir: Path) -> Iterator[Any]:
    if not is_root():
        pytest.skip("unshare --pid needs root")
    started: list[Namespaced] = []

    def start(seed: int) -> Namespaced:
        target = Namespaced(work_dir, seed)
        started.append(target)
        return target

    yield start
    for target in started:
        target.proc.kill()
        target.proc.wait()


@pytest.mark.slow
def test_two_processes_with_one_pid_in_two_pid_namespaces_share_a_to_directory(
    namespaced: Any, work_dir: Path
) -> None:
    first, second = namespaced(1), namespaced(2)
    assert first.pid == second.pid == 1, "both are pid 1 of their own namespace"
    assert first.ask("sleep") == "asleep"
    assert second.ask("sleep") == "asleep"  # on main this retired the first one's snapshot
    assert first.ask("wake") == "awake same"
    assert second.ask("wake") == "awake same"
    roots = sorted(p.name for p in work_dir.iterdir())
    assert len(roots) == 2 and all(name.startswith("proc-1-") for name in roots), roots
    first.stop()
    second.stop()


def test_a_root_of_another_process_is_never_reused_retired_or_punched(tmp_path: Path) -> None:
    path = tmp_path / "proc-1-shared"
    other = Owner("another-boot", 1, 1, 99, "elsewhere", 0)
    regions = [BytesRegion("w/a", "w", os.urandom(64 * KiB))]
    with SpillRoot(path, create=True, owner=other) as root:
        theirs = write_snapshot(root, regions, producer={})
    before = sorted((p.name, p.stat().st_ino, p.stat().st_size) for p in path.rglob("*"))
    with pytest.raises(Exception, match="belongs to another process"):
        SpillRoot(path, create=True)
    assert sorted((p.name, p.stat().st_ino, p.stat().st_size) for p in path.rglob("*")) == before
    with SpillRoot(path, owner=other) as root, SnapshotReader(root, theirs.snapshot) as reader:
        blank = regions[0].blank()
        reader.read_into([blank])
    assert blank.data == regions[0].data


# -- 3. gc touches only what hibernate made: tests/test_store_gc.py ----------------------


# -- 4. limits agree ------------------------------------------------------------------------


def test_a_manifest_over_the_limit_is_refused_before_publishing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(manifest_module, "MANIFEST_LIMIT_BYTES", 64 * KiB)
    regions = [BytesRegion(f"w/{'x' * 200}{i}", "w", os.urandom(KiB)) for i in range(400)]
    path = tmp_path / "proc"
    with SpillRoot(path, create=True) as root, pytest.raises(UnsupportedError) as caught:
        write_snapshot(root, regions, producer={})
    assert "more than the 65536 allowed" in caught.value.message
    assert "nothing was published and the process keeps its memory" in caught.value.message
    assert not path.exists(), "nothing published, nothing left behind"


def test_the_writer_and_the_reader_apply_one_limit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    regions = [BytesRegion(f"w/{'y' * 100}{i}", "w", os.urandom(KiB)) for i in range(100)]
    with SpillRoot(tmp_path / "proc", create=True) as root:
        result = write_snapshot(root, regions, producer={})
    data = (result.path / "manifest.json").read_bytes()
    parse_manifest(data)
    monkeypatch.setattr(manifest_module, "MANIFEST_LIMIT_BYTES", len(data) - 1)
    with pytest.raises(Exception, match="allowed"):
        parse_manifest(data)
    with pytest.raises(Exception, match="allowed"):
        result.manifest.encode()


LONG_NAME_TARGET = r"""
import os, sys, time, torch
import hibernate
weights = {"w" * 1100: torch.ones(1024)}
hibernate.track(weights, name="model")
open(sys.argv[1], "w").write(str(os.getpid()))
while True:
    time.sleep(1)
"""


@pytest.mark.slow
def test_a_key_no_wake_could_read_is_refused_before_anything_is_written(
    cli: Any, work_dir: Path, tmp_path: Path, runtime_dir: Path
) -> None:
    ready = tmp_path / "ready"
    target = subprocess.Popen(
        [sys.executable, "-c", LONG_NAME_TARGET, str(ready)], env={**os.environ, "PYTHONPATH": str(REPO)}
    )

    def started() -> bool:
        return bool(ready.exists() and ready.read_text()) or target.poll() is not None

    try:
        wait_until(started, 120, "the target to write its pid")
        assert target.poll() is None, "the target died"
        result = cli("sleep", str(target.pid), "--to", str(work_dir), "--json")
        assert result.returncode == ExitCode.UNSUPPORTED, result.stdout + result.stderr
        assert "longer than 1024 characters" in result.json()["error"]["message"]
        assert state(cli, target.pid) == "running"
        assert list(work_dir.iterdir()) == []
    finally:
        target.kill()
        target.wait()


# -- 6. every snapshot is self-contained --------------------------------------------------


@pytest.mark.slow
def test_deleting_the_older_snapshot_after_a_re_sleep_leaves_the_process_wakeable(
    start_demo: Any, cli: Any, work_dir: Path
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "--quiet").returncode == 0
    root = spill_root_of(work_dir, demo.pid)
    first = only_snapshot(root)
    assert cli("wake", str(demo.pid), "--quiet").returncode == 0
    again = cli("sleep", str(demo.pid), "--to", str(work_dir), "--json")
    assert again.json()["processes"][0]["written_bytes"] == 0, "everything was reused"
    second = only_snapshot(root)
    assert second != first and not first.exists(), "the older snapshot is gone already"
    manifest = json.loads((second / "manifest.json").read_text())
    for name in manifest["files"]:
        assert (second / name).is_file(), f"{name} lies in the new snapshot's own directory"
    for older in root.glob("snap-*"):  # what a user cleaning up by hand would delete
        if older != second:
            older.rename(older.with_name("deleted"))
    assert cli("wake", str(demo.pid), "--quiet").returncode == 0
    assert demo.infer()["digest"] == reference


# -- 7. gc reclaims what nobody needs, never a sleeping process's snapshot: tests/test_store_gc.py


# -- 9. permission problems inside a snapshot tree are IO errors with the path ------------


@pytest.mark.slow
@pytest.mark.skipif(not is_root(), reason="needs root to run the target and the CLI as another user")
@pytest.mark.parametrize("what", ["root", "lock"])
def test_an_unreadable_snapshot_tree_is_an_io_error_naming_the_path(
    start_demo: Any, cli: Any, work_dir: Path, what: str
) -> None:
    demo = start_demo(size_mb=8, uid=NOBODY)
    reference = demo.infer()["digest"]
    os.chown(work_dir, NOBODY, NOBODY)
    as_nobody = lambda *a, **k: cli(*a, uid=NOBODY, **k)  # noqa: E731
    assert as_nobody("sleep", str(demo.pid), "--to", str(work_dir), "--quiet").returncode == 0
    assert as_nobody("wake", str(demo.pid), "--quiet").returncode == 0
    root = spill_root_of(work_dir, demo.pid)
    broken = root if what == "root" else root / ".lock"
    broken.chmod(0)
    result = as_nobody("sleep", str(demo.pid), "--to", str(work_dir), "--json")
    assert result.returncode == ExitCode.IO_ERROR, result.stdout + result.stderr
    assert str(broken) in result.json()["error"]["message"]
    assert "permission denied" in result.json()["error"]["message"].lower()
    assert state(as_nobody, demo.pid) == "running"
    assert demo.infer()["digest"] == reference


def test_a_retired_snapshot_and_one_never_published_are_told_apart(tmp_path: Path) -> None:
    regions = [BytesRegion("w/a", "w", os.urandom(16 * KiB))]
    path = tmp_path / "proc"
    with SpillRoot(path, create=True) as root:
        first = write_snapshot(root, regions, producer={}).snapshot
        second = write_snapshot(root, regions, producer={}).snapshot
        with pytest.raises(
            Exception, match=f"was retired: a newer sleep of this process replaced it with {second}"
        ):
            root.read_manifest(first)
        (path / "snap-000009").mkdir()
        with pytest.raises(Exception, match="the snapshot was never published, or its manifest was deleted"):
            root.read_manifest("snap-000009")
        with pytest.raises(Exception, match=r"snap-000010 does not exist \(it was deleted\)"):
            root.read_manifest("snap-000010")


def test_a_manifest_the_process_wrote_is_known_again_unparsed_and_any_other_bytes_are_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process that wrote a snapshot wakes from it without parsing its manifest again, but only
    while the file holds the very bytes it published: a manifest changed since is parsed and
    checked as any reader checks it (here: refused, its checksum no longer matching)."""
    import hibernate.store.layout as layout
    from hibernate.errors import SnapshotInvalidError
    from hibernate.store.manifest import MANIFEST_NAME, RememberedManifest

    parsed: list[str] = []

    def counted_parse(data: bytes, where: str) -> Any:
        parsed.append(where)
        return parse_manifest(data, where)

    monkeypatch.setattr(layout, "parse_manifest", counted_parse)
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(16 * KiB)) for i in range(3)]
    with SpillRoot(tmp_path / "proc", create=True) as root:
        written = write_snapshot(root, regions, producer={}, options=WriteOptions(chunk_bytes=4 * KiB))
    remembered = RememberedManifest(written.manifest_digest, written.manifest)
    blanks = [BytesRegion(r.key, r.tag, bytes(r.nbytes)) for r in regions]
    with (
        SpillRoot(tmp_path / "proc", remembered=remembered) as root,
        SnapshotReader(root, written.snapshot) as reader,
    ):
        assert reader.manifest is written.manifest
        reader.read_into(blanks)
    assert parsed == [] and [b.data for b in blanks] == [r.data for r in regions]

    path = written.path / MANIFEST_NAME
    path.write_bytes(path.read_bytes().replace(b'"w/0"', b'"w/9"'))
    with (
        SpillRoot(tmp_path / "proc", remembered=remembered) as root,
        pytest.raises(SnapshotInvalidError, match="checksum does not match"),
    ):
        SnapshotReader(root, written.snapshot)
    assert parsed == [str(path)]
