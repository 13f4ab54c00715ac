"""A re-sleep never reuses bytes it has not read back: the writer's reuse check, unit by unit.

The identity of a data file (inode, size, mtime, ctime) cannot see bytes that
changed below the filesystem. Here that is simulated by damaging a file in
place and letting the identity check pass (``_unchanged`` patched: writing
changes ctime, which nothing but the kernel can set back); the real case, a
byte flipped in the disk image under an ext4 file, is tests/test_store_reuse_check_disk.py.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hibernate.errors import SnapshotInvalidError
from hibernate.store import reuse, reusecheck, writer
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import ALIGNMENT, ChunkRef
from hibernate.store.options import WriteOptions
from hibernate.store.parse import parse_manifest
from hibernate.store.reader import SnapshotReader
from hibernate.store.reusecheck import plan_staging
from hibernate.store.writer import write_snapshot
from tests.test_store_roundtrip import BytesRegion

KiB = 1024
MiB = 1 << 20


@pytest.fixture
def identity_blind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file of the previous snapshot passes the identity check, as one damaged below the
    filesystem does (its inode, size, mtime and ctime stay what they were)."""
    monkeypatch.setattr(reuse, "_unchanged", lambda root, previous, name: True)


@pytest.fixture
def preads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The bytes each os.preadv of this process read, in order (the check's reads of the disk)."""
    counted: list[int] = []
    preadv = os.preadv

    def counting(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
        n = preadv(fd, buffers, offset, *rest)
        counted.append(n)
        return n

    monkeypatch.setattr(os, "preadv", counting)
    yield counted


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def sleep(root: SpillRoot, regions: list[Any], options: WriteOptions) -> writer.WriteResult:
    return write_snapshot(root, regions, producer={"test": True}, options=options)


def read_back(root: SpillRoot, snapshot: str, regions: list[BytesRegion]) -> list[bytearray]:
    blanks = [region.blank() for region in regions]
    with SnapshotReader(root, snapshot) as reader:
        reader.read_into(blanks, buffer_bytes=256 * KiB)
    return [blank.data for blank in blanks]


def chunk_of(result: writer.WriteResult, key: str) -> ChunkRef:
    """The first chunk of record ``key`` in a written snapshot."""
    manifest = parse_manifest((result.path / "manifest.json").read_bytes())
    columns = manifest.columns
    index = columns.first_chunks()[columns.keys.index(key)]
    return columns.chunks.refs()[index]


# Two budgets: one leaves room for the check beside the stream, one makes it run after the stream.
BUDGETS = {"beside": 128 * KiB, "after": 64 * KiB}


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_a_reused_chunk_the_disk_no_longer_holds_is_written_again(
    tmp_path: Path, identity_blind: None, budget: str
) -> None:
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(64 * KiB)) for i in range(3)]
    options = WriteOptions(chunk_bytes=16 * KiB, buffer_bytes=BUDGETS[budget])
    assert bool(plan_staging(options.buffer_bytes, 16 * KiB, 16 * KiB).check_bytes) == (budget == "beside")
    with SpillRoot(tmp_path / "proc", create=True) as root:
        first = sleep(root, regions, options)
        damaged = chunk_of(first, "w/1")
        flip(first.path / damaged.file, damaged.offset + 100)
        again = sleep(root, regions, options)
        assert (again.written_bytes, again.reused_bytes) == (16 * KiB, 192 * KiB - 16 * KiB)
        assert again.rewritten_bytes == 16 * KiB, "the damaged chunk, and only it, was written again"
        assert again.reuse_read_bytes >= 192 * KiB, "every reused chunk was read back"
        [warning] = again.warnings
        assert warning.startswith(
            f"{first.path / damaged.file}: 1 chunk(s) to reuse, 16.0 KiB, no longer read"
        )
        assert "checksum mismatch" in warning
        assert read_back(root, again.snapshot, regions) == [r.data for r in regions]
        assert again.staging_bytes <= options.buffer_bytes
        third = sleep(root, regions, options)  # what was written again is reused in turn, checked
        assert (third.written_bytes, third.rewritten_bytes, third.warnings) == (0, 0, [])
        assert read_back(root, third.snapshot, regions) == [r.data for r in regions]


def test_a_linked_file_that_cannot_be_read_has_its_chunks_written_again(
    tmp_path: Path, identity_blind: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(64 * KiB)) for i in range(3)]
    options = WriteOptions(chunk_bytes=16 * KiB, buffer_bytes=128 * KiB)
    with SpillRoot(tmp_path / "proc", create=True) as root:
        first = sleep(root, regions, options)
        unreadable = (first.path / "data-000.bin").stat().st_ino
        preadv = os.preadv

        def failing(fd: int, buffers: Any, offset: int, *rest: Any) -> int:
            if os.fstat(fd).st_ino == unreadable:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return preadv(fd, buffers, offset, *rest)

        monkeypatch.setattr(os, "preadv", failing)
        again = sleep(root, regions, options)
        monkeypatch.setattr(os, "preadv", preadv)
        assert (again.written_bytes, again.reused_bytes, again.rewritten_bytes) == (192 * KiB, 0, 192 * KiB)
        [warning] = again.warnings
        assert warning.startswith(f"{first.path / 'data-000.bin'}: 12 chunk(s) to reuse")
        assert "(Input/output error)" in warning
        assert read_back(root, again.snapshot, regions) == [r.data for r in regions]


def test_a_changed_model_reads_back_only_what_it_reuses(tmp_path: Path, preads: list[int]) -> None:
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(256 * KiB)) for i in range(64)]
    options = WriteOptions(chunk_bytes=64 * KiB, buffer_bytes=1 * MiB)
    kept = {0, 21, 42, 63}  # apart from each other in the file by far more than a gap read through
    with SpillRoot(tmp_path / "proc", create=True) as root:
        sleep(root, regions, options)
        for i, region in enumerate(regions):
            if i not in kept:
                region.data[:] = os.urandom(region.nbytes)
        preads.clear()
        again = sleep(root, regions, options)
        assert again.reused_bytes == len(kept) * 256 * KiB
        assert sum(preads) == again.reuse_read_bytes == again.reused_bytes, "read: what is reused, no more"
        preads.clear()
        unchanged = sleep(root, regions, options)
        assert unchanged.reused_bytes == 64 * 256 * KiB
        assert sum(preads) == unchanged.reuse_read_bytes == unchanged.reused_bytes, "each chunk read once"


def test_with_the_check_skipped_the_damage_is_reused_unread_and_the_window_is_named(
    tmp_path: Path, identity_blind: None, preads: list[int]
) -> None:
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(64 * KiB)) for i in range(3)]
    options = WriteOptions(chunk_bytes=16 * KiB, buffer_bytes=128 * KiB, check_reuse=False)
    with SpillRoot(tmp_path / "proc", create=True) as root:
        first = sleep(root, regions, options)
        flip(first.path / "data-000.bin", 100)
        preads.clear()
        again = sleep(root, regions, options)
        assert preads == [], "nothing was read back"
        assert (again.written_bytes, again.reused_unread_bytes, again.reuse_read_bytes) == (0, 192 * KiB, 0)
        assert again.warnings == [
            f"192.0 KiB reused from {first.path} without reading them back (the reuse check was skipped): "
            "a change on the disk goes unnoticed until a wake reads them from the disk"
        ]
        with pytest.raises(SnapshotInvalidError, match="checksum mismatch"):
            read_back(root, again.snapshot, regions)


def test_a_first_sleep_neither_checks_nor_warns(tmp_path: Path, preads: list[int]) -> None:
    regions = [BytesRegion(f"w/{i}", "w", os.urandom(64 * KiB)) for i in range(3)]
    for check in (True, False):
        with SpillRoot(tmp_path / f"proc-{check}", create=True) as root:
            first = sleep(root, regions, WriteOptions(chunk_bytes=16 * KiB, check_reuse=check))
        assert (first.reuse_read_bytes, first.reused_unread_bytes, first.warnings) == (0, 0, [])
    assert preads == []


def test_a_failing_check_stops_the_stream_and_publishes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Reused host regions first, then many changed ones without a host view, staged one by one.
    kept = [BytesRegion(f"kept/{i}", "w", os.urandom(64 * KiB)) for i in range(4)]
    changing = [BytesRegion(f"changed/{i}", "w", os.urandom(4 * KiB), host=False) for i in range(4000)]
    regions = [*kept, *changing]
    options = WriteOptions(chunk_bytes=64 * KiB, buffer_bytes=2 * MiB)
    with SpillRoot(tmp_path / "proc", create=True) as root:
        first = sleep(root, regions, options)
    slept = [bytes(region.data) for region in regions]
    for region in changing:
        region.data[:] = os.urandom(region.nbytes)
    now = [bytes(region.data) for region in regions]
    broke = threading.Event()
    staged: list[str] = []

    def broken_plan(*args: Any) -> reusecheck.Plan:
        broke.set()
        raise RuntimeError("the reuse check broke")

    def copy_out(self: BytesRegion, offset: int, dst: memoryview) -> None:
        assert broke.wait(30), "the check never ran"
        staged.append(self.key)
        dst[:] = self.data[offset : offset + len(dst)]

    monkeypatch.setattr(reusecheck.Plan, "of", broken_plan)
    monkeypatch.setattr(BytesRegion, "copy_out", copy_out)
    with SpillRoot(tmp_path / "proc") as root:
        with pytest.raises(RuntimeError, match="the reuse check broke"):
            sleep(root, regions, options)
        assert root.published() == [first.snapshot], "nothing was published"
        # Each stager finishes the batch it holds (up to 256 chunks) when the pipeline aborts.
        assert len(staged) < len(changing) // 2, f"the stream went on: {len(staged)} chunks staged"
        monkeypatch.undo()
        assert [r.data for r in regions] == now, "the memory is as it was"
        assert [p.name for p in (tmp_path / "proc").iterdir() if p.name.startswith(".tmp")] == []
        assert read_back(root, first.snapshot, regions) == slept, "the previous snapshot is whole"
        after = sleep(root, regions, options)
        assert read_back(root, after.snapshot, regions) == now


def test_the_check_fits_in_the_staging_budget() -> None:
    plan = plan_staging(256 * MiB, 32 * MiB, 32 * MiB)  # a read holds a chunk at the least
    assert (plan.stream_bytes, plan.check_bytes, plan.request_bytes) == (192 * MiB, 64 * MiB, 32 * MiB)
    plan = plan_staging(128 * MiB, 8 * MiB, 8 * MiB)  # else an eighth of the budget, up to 32 MiB
    assert (plan.stream_bytes, plan.check_bytes, plan.request_bytes) == (96 * MiB, 32 * MiB, 16 * MiB)
    small = plan_staging(16 * MiB, 8 * MiB, 8 * MiB)  # two chunks fill the budget: the check comes after
    assert (small.stream_bytes, small.check_bytes, small.request_bytes) == (16 * MiB, 0, 8 * MiB)
    packed = plan_staging(1 * MiB, 64 * KiB, 5 * KiB)  # a packed small chunk may lie across a page more
    assert packed.request_bytes == 128 * KiB and packed.stream_bytes + packed.check_bytes == 1 * MiB
    for budget in (64 * KiB, 100 * KiB, 1 * MiB, 48 * MiB, 256 * MiB, 1024 * MiB):
        for task in (4 * KiB, 16 * KiB, budget // 4, budget // 2):
            plan = plan_staging(budget, task, task)
            assert plan.stream_bytes + plan.check_bytes <= budget
            assert plan.check_bytes in (0, 2 * plan.request_bytes)
            assert plan.request_bytes >= reusecheck.pages_bound(task)


def test_blocks_follow_the_file_and_reads_skip_what_is_not_reused() -> None:
    refs = [ChunkRef("a", i * 16 * KiB, 16 * KiB, f"{i:016x}") for i in range(8)]
    refs += [ChunkRef("b", 0, 100, "f" * 16), ChunkRef("b", 128, 100, "e" * 16)]  # packed in one page
    plan = reusecheck.Plan.of(reversed(refs), request_bytes=64 * KiB)
    assert plan.refs == refs, "in file order"
    assert [list(plan.block(b)) for b in range(plan.blocks)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    whole = reusecheck.whole_block(plan, 2)
    assert (whole.file, whole.offset, whole.size, whole.group) == ("b", 0, ALIGNMENT, [8, 9])
    far = [ChunkRef("c", i * 64 * KiB, 16 * KiB, f"{i:016x}") for i in range(4)]  # 48 KiB apart
    sparse = reusecheck.Plan.of(far, request_bytes=1 * MiB)
    gapped = reusecheck.reads_of(sparse, [0, 1, 3], 1 * MiB)
    assert [(r.offset, r.size, r.group) for r in gapped] == [(0, 3 * 64 * KiB + 16 * KiB, [0, 1, 3])]
    spread = [ChunkRef("d", i * MiB, 16 * KiB, f"{i:016x}") for i in range(4)]  # gaps past GAP_BYTES
    apart = reusecheck.Plan.of(spread, request_bytes=8 * MiB)
    reads = reusecheck.reads_of(apart, [0, 2], 8 * MiB)
    assert [(r.offset, r.size, r.group) for r in reads] == [(0, 16 * KiB, [0]), (2 * MiB, 16 * KiB, [2])]


# -- any model, any damage, any change -----------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(1, 40 * KiB), min_size=1, max_size=12),
    damage=st.lists(st.integers(0, 10**9), max_size=4),
    changed=st.lists(st.booleans(), max_size=12),
    buffer=st.sampled_from([32 * KiB, 64 * KiB, 256 * KiB]),
    seed=st.integers(0, 2**32 - 1),
)
def test_whatever_the_disk_lost_a_re_sleep_reads_back_as_the_memory_is(
    sizes: list[int], damage: list[int], changed: list[bool], buffer: int, seed: int
) -> None:
    import random
    import tempfile

    rng = random.Random(seed)
    regions = [BytesRegion(f"w/{i}", "w", rng.randbytes(size)) for i, size in enumerate(sizes)]
    options = WriteOptions(chunk_bytes=8 * KiB, buffer_bytes=buffer)
    unchanged: Callable[..., bool] = reuse._unchanged
    with (
        tempfile.TemporaryDirectory(prefix="hb-reuse-") as scratch,
        SpillRoot(Path(scratch) / "proc", create=True) as root,
    ):
        first = sleep(root, regions, options)
        data = first.path / "data-000.bin"
        for at in damage:
            flip(data, at % data.stat().st_size)
        for region, change in zip(regions, changed, strict=False):
            if change:
                region.data[: min(64, region.nbytes)] = rng.randbytes(min(64, region.nbytes))
        reuse._unchanged = lambda root, previous, name: True
        try:
            again = sleep(root, regions, options)
        finally:
            reuse._unchanged = unchanged
        assert again.written_bytes + again.reused_bytes == again.total_bytes
        assert again.staging_bytes <= buffer
        assert read_back(root, again.snapshot, regions) == [r.data for r in regions]
