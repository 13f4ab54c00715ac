"""A re-sleep reads back what it reuses: bytes changed below the filesystem, through the real CLI.

The acceptance case: a snapshot directory on an ext4 filesystem in a loop-
mounted image file; after a sleep and a wake, one byte of a data file the next
sleep will reuse is flipped in the image, below the filesystem, so the file's
identity (inode, size, mtime, ctime) stays what the last wake recorded. The
next sleep finds the chunk changed on reading it back, writes it again from
memory and says so; the wake is bit-exact. With ``--skip-reuse-check`` the
same damage is reused unread: the report names that window, and the wake
refuses the snapshot (SNAPSHOT_INVALID), the process staying asleep.

Also the opt-out's other ways in: ``$HIBERNATE_SKIP_REUSE_CHECK`` as the CLI
flag's default, and as ``hibernate.sleep()``'s in the target.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hibernate.errors import ExitCode
from hibernate.store.manifest import ChunkRef
from hibernate.store.parse import parse_manifest
from tests.conftest import REPO, is_root
from tests.test_cli_json_schema import valid

_EXTENT = re.compile(r"^\s*\d+:\s*(\d+)\.\.\s*(\d+):\s*(\d+)\.\.\s*\d+:")


@dataclass
class LoopDisk:
    """An ext4 filesystem in an image file, mounted through a loop device."""

    image: Path
    mount: Path

    def device(self) -> str:
        found = subprocess.run(["losetup", "-j", str(self.image)], capture_output=True, text=True, check=True)
        return found.stdout.split(":", 1)[0]

    def flip_below(self, path: Path, offset: int) -> None:
        """Flip the byte at ``offset`` of ``path`` (a file on this filesystem) by writing the image.

        The filesystem never sees the write: the file's identity stays as it
        was. Its page cache, the loop device's and the image's are dropped,
        so the next read of the file comes from the changed block.
        """
        where = self._image_offset(path, offset)
        with open(self.image, "r+b") as image:
            byte = os.pread(image.fileno(), 1, where)
            os.pwrite(image.fileno(), bytes([byte[0] ^ 0xFF]), where)
            os.fsync(image.fileno())
        for cached in (path, Path(self.device()), self.image):
            fd = os.open(cached, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)

    def _image_offset(self, path: Path, offset: int) -> int:
        """Where byte ``offset`` of ``path`` lies in the image (``filefrag -v``'s extents)."""
        mapped = subprocess.run(["filefrag", "-v", str(path)], capture_output=True, text=True, check=True)
        block = int(re.search(r"blocks of (\d+) bytes", mapped.stdout).group(1))  # type: ignore[union-attr]
        wanted = offset // block
        for line in mapped.stdout.splitlines():
            extent = _EXTENT.match(line)
            if extent is not None:
                first, last, physical = map(int, extent.groups())
                if first <= wanted <= last:
                    return (physical + wanted - first) * block + offset % block
        raise AssertionError(f"no extent of {path} holds byte {offset}:\n{mapped.stdout}")


@pytest.fixture
def loop_disk(tmp_path: Path) -> Iterator[LoopDisk]:
    if not is_root():
        pytest.skip("mounting a loop device needs root")
    for tool in ("mkfs.ext4", "mount", "umount", "losetup", "filefrag"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed")
    image, mount = tmp_path / "disk.img", tmp_path / "mnt"
    mount.mkdir()
    with open(image, "wb") as f:
        f.truncate(256 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", str(image)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"mkfs.ext4 failed here: {made.stderr.strip()}")
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot loop-mount an image here (no loop device?): {mounted.stderr.strip()}")
    try:
        yield LoopDisk(image, mount)
    finally:
        if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def identity(path: Path) -> tuple[int, int, int, int, int]:
    info = path.stat()
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def direct_byte(path: Path, offset: int) -> int:
    """Byte ``offset`` of ``path`` as the disk gives it now (O_DIRECT: no page cache in the way)."""
    import mmap

    page = offset - offset % 4096
    buffer = mmap.mmap(-1, 4096)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        os.preadv(fd, [buffer], page)
    finally:
        os.close(fd)
    return buffer[offset - page]


def a_chunk_in(snapshot: Path, file: str) -> ChunkRef:
    """A chunk of ``snapshot`` that lies in its data file ``file`` (the one with the lowest offset)."""
    chunks = parse_manifest((snapshot / "manifest.json").read_bytes()).columns.chunks.refs()
    return min((ref for ref in chunks if ref.file == file), key=lambda ref: ref.offset)


def sleep_report(cli: Any, pid: int, to: Path, *flags: str) -> dict[str, Any]:
    result = cli("sleep", str(pid), "--to", str(to), "--json", *flags)
    document = valid("sleep", result)
    process: dict[str, Any] = document["processes"][0]
    return process


@pytest.mark.slow
def test_bytes_changed_below_the_filesystem_are_written_again_not_reused(
    loop_disk: LoopDisk, start_demo: Any, cli: Any
) -> None:
    demo = start_demo(size_mb=16)
    reference = demo.infer()["digest"]
    first = sleep_report(cli, demo.pid, loop_disk.mount)
    assert cli("wake", str(demo.pid), "--quiet").returncode == 0

    snapshot = Path(first["snapshot"])
    data = snapshot / "data-000.bin"
    chunk = a_chunk_in(snapshot, "data-000.bin")
    before, byte = identity(data), direct_byte(data, chunk.offset + 100)
    loop_disk.flip_below(data, chunk.offset + 100)
    assert identity(data) == before, "the file's identity did not change"
    assert direct_byte(data, chunk.offset + 100) == byte ^ 0xFF, "the disk now holds the flipped byte"

    again = sleep_report(cli, demo.pid, loop_disk.mount)
    assert again["written_bytes"] == chunk.length, "the damaged chunk, and only it, was written again"
    assert again["reused_bytes"] == again["total_bytes"] - chunk.length
    assert again["rewritten_bytes"] == chunk.length
    assert again["reuse_read_bytes"] >= again["reused_bytes"]
    assert any(
        w.startswith(f"{data}: 1 chunk(s) to reuse") and "checksum mismatch" in w for w in again["warnings"]
    )
    woken = cli("wake", str(demo.pid), "--json")
    assert woken.returncode == 0, woken.stdout + woken.stderr
    assert demo.infer()["digest"] == reference, "the wake is bit-exact"

    # The same damage with the check skipped: reused unread, the window named, the wake refuses.
    snapshot = Path(again["snapshot"])
    reused = snapshot / "reused-000.bin"
    chunk = a_chunk_in(snapshot, "reused-000.bin")
    before = identity(reused)
    loop_disk.flip_below(reused, chunk.offset + 100)
    assert identity(reused) == before
    trusting = sleep_report(cli, demo.pid, loop_disk.mount, "--skip-reuse-check")
    assert (trusting["written_bytes"], trusting["reuse_read_bytes"]) == (0, 0)
    assert trusting["reused_unread_bytes"] == trusting["reused_bytes"] == trusting["total_bytes"]
    assert any(
        f"reused from {snapshot} without reading them back" in w
        and "goes unnoticed until a wake reads them from the disk" in w
        for w in trusting["warnings"]
    ), trusting["warnings"]
    refused = cli("wake", str(demo.pid), "--json")
    assert refused.returncode == ExitCode.SNAPSHOT_INVALID, refused.stdout + refused.stderr
    message = refused.json()["error"]["message"]
    assert message.startswith(f"process {demo.pid} stays asleep: ") and "checksum mismatch" in message
    assert demo.alive()
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "asleep"


@pytest.mark.slow
def test_the_environment_skips_the_check_for_the_cli_and_a_bad_value_is_refused(
    start_demo: Any, cli: Any, work_dir: Path
) -> None:
    demo = start_demo(size_mb=8)
    assert cli("sleep", str(demo.pid), "--to", str(work_dir), "--quiet").returncode == 0
    assert cli("wake", str(demo.pid), "--quiet").returncode == 0
    unclear = cli("sleep", str(demo.pid), "--to", str(work_dir), env={"HIBERNATE_SKIP_REUSE_CHECK": "maybe"})
    assert unclear.returncode == ExitCode.USAGE, unclear.stdout + unclear.stderr
    assert "HIBERNATE_SKIP_REUSE_CHECK='maybe' is not a yes/no value" in unclear.stderr
    assert cli("status", str(demo.pid), "--json").json()["agents"][0]["state"] == "running"
    table = cli("sleep", str(demo.pid), "--to", str(work_dir), env={"HIBERNATE_SKIP_REUSE_CHECK": "1"})
    assert table.returncode == 0, table.stderr
    assert re.search(r"checked\s+no: [\d.]+ MiB reused unread \(--skip-reuse-check\)", table.stdout), (
        table.stdout
    )
    assert re.search(r"warning\s+[\d.]+ MiB reused from .* without reading them back", table.stdout)
    assert cli("wake", str(demo.pid), "--quiet").returncode == 0
    checked = cli("sleep", str(demo.pid), "--to", str(work_dir), env={"HIBERNATE_SKIP_REUSE_CHECK": "0"})
    assert re.search(r"checked\s+read back [\d.]+ MiB of the last snapshot", checked.stdout), checked.stdout
    assert "warning" not in checked.stdout


IN_PROCESS_TARGET = r"""
import json, sys, torch
import hibernate
weights = {"w": torch.randn(256, 1024)}
hibernate.track(weights, name="model")
hibernate.sleep(sys.argv[1], skip_reuse_check=False)
hibernate.wake()
reports = []
for skip in (None, False):  # None: as $HIBERNATE_SKIP_REUSE_CHECK says
    try:
        spill = hibernate.sleep(sys.argv[1], skip_reuse_check=skip)["spill"]
    except Exception as exc:
        reports.append({"error": f"{type(exc).__name__}: {exc.message}"})
        continue
    hibernate.wake()
    keys = ("reuse_read_bytes", "reused_unread_bytes", "total_bytes", "warnings")
    reports.append({key: spill[key] for key in keys})
print(json.dumps(reports))
"""


@pytest.mark.parametrize("value", ["1", "0", "sometimes"])
def test_the_environment_skips_the_check_for_an_in_process_sleep(work_dir: Path, value: str) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", IN_PROCESS_TARGET, str(work_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "HIBERNATE_AGENT": "0",
            "HIBERNATE_SKIP_REUSE_CHECK": value,
        },
    )
    assert ran.returncode == 0, ran.stderr
    by_environment, checked = json.loads(ran.stdout)
    if value == "sometimes":
        assert by_environment == {
            "error": "UsageError: HIBERNATE_SKIP_REUSE_CHECK='sometimes' is not a yes/no value"
        }
    elif value == "1":
        assert by_environment["reuse_read_bytes"] == 0
        assert by_environment["reused_unread_bytes"] == by_environment["total_bytes"] > 0
        [warning] = by_environment["warnings"]
        assert "without reading them back (the reuse check was skipped)" in warning
    else:
        assert by_environment["reuse_read_bytes"] >= by_environment["total_bytes"] > 0
        assert (by_environment["reused_unread_bytes"], by_environment["warnings"]) == (0, [])
    assert checked["reuse_read_bytes"] >= checked["total_bytes"], "an explicit False checks whatever the env"
    assert (checked["reused_unread_bytes"], checked["warnings"]) == (0, [])
