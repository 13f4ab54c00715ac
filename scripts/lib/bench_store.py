"""Measure hibernate's spill and restore against raw O_DIRECT and the usual libraries, in one run.

  scripts/bench-store [--size-mb 2048] [--tensors 64] [--dir DIR] [--reps 5] [--json-out FILE]
  scripts/bench-store --pools [--size-mb 2048] ...   # hibernate.pool()'s pool beside the tensor pool
  scripts/bench-store --kept-staging [--size-mb 2048] [--reps 5]   # a target keeping its staging
  scripts/bench-store --page-cache [--size-mb 2048] [--reps 5]   # a wake of a snapshot in the page cache

With more than 1,000 tensors it measures per-tensor cost: the time a spill or a restore
takes beyond the raw transfer of the same bytes, per tensor, judged against 10 us.

An unchanged re-sleep is measured both ways, each against the first sleep of the same
repetition: as it runs by default (every reused chunk read back and checked beside the
hashing of the memory) and with the check skipped (--skip-reuse-check). The checked one is
also set beside the larger of a raw O_DIRECT read and a hash of the same bytes, measured
next to it: what it cannot beat, since it does both at once.

One disk, one set of tensors (bf16, pseudo-random bytes, no two chunks alike so
nothing is deduplicated by accident). The disk of a shared machine is noisy from
one second to the next, so hibernate is never compared with a limit measured at
another time: each repetition runs a raw O_DIRECT write next to a hibernate spill
and a raw O_DIRECT read next to a hibernate restore (in alternating order), and
the reported ratio is the median of those paired ratios, with its lowest and
highest. The raw runs are the limit because they are shaped as hibernate's own
transfers (its request sizes, its kind of staging pages, one request in flight):
"x raw" is "x what this disk does with the same requests". The plain loop of
64 MiB requests and a read into freshly allocated memory of the whole size (what
a wake of a CPU target cannot beat: it must fault its destination in) are
measured in the same repetition and shown beside them. The page cache is evicted
(POSIX_FADV_DONTNEED) before every read. torch.save/torch.load and safetensors
run once each, each paired with a raw write and read.

Peak extra RSS and page-cache growth are sampled every 2 ms by a separate
process reading /proc/PID/statm and /proc/meminfo (Cached). For a restore the
tensors are released first (as a sleep does) and reallocated by the restore, so
"extra" RSS is what the restore holds beyond the tensors it refills.

Prints a table, the targets (PASS/FAIL) and a JSON document; exits 1 if a target fails.
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project root

import torch
import xxhash
from host import filesystem_of  # beside this script

from hibernate.operation.options import StagingShare, share_staging
from hibernate.pools.base import Pool
from hibernate.pools.tensors import TensorPool
from hibernate.store import bulk
from hibernate.store.arena import arena_bytes_for
from hibernate.store.layout import SpillRoot
from hibernate.store.manifest import WrittenRecords
from hibernate.store.options import WriteOptions
from hibernate.store.reader import SnapshotReader
from hibernate.store.readplan import read_request_bytes
from hibernate.store.regions import memory_at
from hibernate.store.reuse import ReuseSource
from hibernate.store.tuning import Tuning, choose
from hibernate.store.writer import write_snapshot

MiB = 1 << 20
SIMPLE_REQUEST = 64 * MiB  # the single-request loop reported beside the shaped limits
TARGET_THROUGHPUT = 0.90
TARGET_SECOND_SPEEDUP = 5.0  # the re-sleep with the check skipped, against the first sleep
TARGET_UNCHECKED_SPEEDUP = 1.5  # the same, the floor it must keep
TARGET_CHECKED_SPEEDUP = 1.0  # the checked re-sleep must beat the first sleep
SLACK_RSS = 64 * MiB
CACHE_PER_2GIB = 64 * MiB
# Past this many tensors the run measures per-tensor cost: the targets are in
# microseconds per tensor, and the throughput ratios are shown but not judged.
MANY_TENSORS = 1000
TARGET_US_PER_TENSOR = 10.0


# -- measuring -----------------------------------------------------------------


# The sampler runs in its own process: a thread of ours would take the GIL every few
# milliseconds and slow the very transfers it measures.
_SAMPLER_CODE = r"""
import os, select, sys
pid, page = int(sys.argv[1]), os.sysconf("SC_PAGE_SIZE")
statm = os.open(f"/proc/{pid}/statm", os.O_RDONLY)
meminfo = os.open("/proc/meminfo", os.O_RDONLY)
def rss():
    return int(os.pread(statm, 128, 0).split()[1]) * page
def cached():
    data = os.pread(meminfo, 8192, 0)
    at = data.index(b"\nCached:") + 8
    return int(data[at : data.index(b"kB", at)]) * 1024
for command in sys.stdin:
    rss0, cached0 = rss(), cached()
    rss_peak, cached_peak = rss0, cached0
    print("ready", flush=True)
    while not select.select([sys.stdin], [], [], 0.002)[0]:
        rss_peak, cached_peak = max(rss_peak, rss()), max(cached_peak, cached())
    sys.stdin.readline()
    rss_peak, cached_peak = max(rss_peak, rss()), max(cached_peak, cached())
    print(rss0, rss_peak, cached0, cached_peak, flush=True)
"""


class Sampler:
    """Peak RSS of this process and peak page-cache size (/proc/meminfo Cached) while a step runs.

    Every measured step, raw ones included, runs under it, so its small cost
    (one core sampling every 2 ms) falls on both sides of each ratio.
    """

    _process: subprocess.Popen[str] | None = None

    def __enter__(self) -> "Sampler":
        if Sampler._process is None:
            Sampler._process = subprocess.Popen(
                [sys.executable, "-c", _SAMPLER_CODE, str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        self._talk("start", expect="ready")
        return self

    def __exit__(self, *exc: object) -> None:
        rss0, rss_peak, cached0, cached_peak = (int(x) for x in self._talk("stop").split())
        self.rss_growth = rss_peak - rss0
        self.cache_growth = cached_peak - cached0

    @staticmethod
    def _talk(line: str, expect: str | None = None) -> str:
        process = Sampler._process
        assert process is not None and process.stdin is not None and process.stdout is not None
        process.stdin.write(line + "\n")
        process.stdin.flush()
        answer = process.stdout.readline().strip()
        if expect is not None and answer != expect:
            raise RuntimeError(f"sampler answered {answer!r}")
        return answer

    @staticmethod
    def shutdown() -> None:
        if Sampler._process is not None:
            Sampler._process.kill()
            Sampler._process.wait()
            Sampler._process = None


def evict(path: Path) -> None:
    """Drop a file (or every file under a directory) from the page cache."""
    paths = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fsync_path(path: Path) -> None:
    """Make a file written through the page cache durable, as a fair save must."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sampled(step: Callable[[], float]) -> float:
    """Run a raw step under the sampler too, so the sampler's cost falls on both sides."""
    with Sampler():
        return step()


def timed(step: Callable[[], object]) -> float:
    """Seconds ``step`` takes."""
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


# -- the data ------------------------------------------------------------------


def make_tensors(total: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` bf16 tensors of mixed sizes adding up to ``total`` bytes, all distinct.

    Up to MANY_TENSORS tensors: matrices (below); more: 1-D tensors, as a model
    of many experts, norms or optimizer states has (see _many_tensors).
    """
    if count > MANY_TENSORS:
        return _many_tensors(total, count)
    return _matrices(total, count)


def _many_tensors(total: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` 1-D bf16 tensors, each its own storage, their lengths varying from 1/2 to 3/2 the mean.

    Each is a copy of its own range of one random block, so no two chunks are
    equal (nothing to deduplicate by accident).
    """
    elements = total // 2
    mean = elements // count
    if mean < 2:
        raise SystemExit(f"--size-mb is too small for {count} tensors")
    generator = torch.Generator().manual_seed(20240501)
    block = torch.randint(-(2**62), 2**62, ((elements + 3) // 4,), dtype=torch.int64, generator=generator)
    flat = block.view(torch.bfloat16)[:elements]
    lengths = [max(1, mean // 2 + (i * 7919) % (mean + 1)) for i in range(count)]
    lengths[-1] += elements - sum(lengths)
    while lengths[-1] < 1:  # the varied lengths overshot: take it back from the others
        index = max(range(count - 1), key=lengths.__getitem__)
        give = min(lengths[index] - 1, 1 - lengths[-1])
        lengths[index] -= give
        lengths[-1] += give
    tensors: dict[str, torch.Tensor] = {}
    start = 0
    for index, length in enumerate(lengths):
        tensors[f"experts.{index}.weight"] = flat[start : start + length].clone()
        start += length
    return tensors


def _matrices(total: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` bf16 tensors of mixed sizes adding up to ``total`` bytes, all distinct.

    A few small 1-D tensors (like norms) and matrices of 4096 columns whose row
    counts vary, filled from one random block XORed with a per-tensor, per-block
    constant, so no two chunks are equal (fast to build, nothing to deduplicate).
    """
    row = 4096 * 2
    small = min(4, count - 1)
    big = count - small
    rows_total = (total - small * row) // row
    weights = [1 + (i % 4) for i in range(big)]
    rows = [max(1, rows_total * w // sum(weights)) for w in weights]
    rows[-1] += rows_total - sum(rows)
    generator = torch.Generator().manual_seed(20240501)
    block_elems = 16 * MiB // 8
    block = torch.randint(-(2**62), 2**62, (block_elems,), dtype=torch.int64, generator=generator)
    tensors: dict[str, torch.Tensor] = {}
    shapes = [(r, 4096) for r in rows] + [(4096,)] * small
    for index, shape in enumerate(shapes):
        tensor = torch.empty(shape, dtype=torch.bfloat16)
        words = tensor.view(-1).view(torch.int64)
        for start in range(0, words.numel(), block_elems):
            part = words[start : start + block_elems]
            torch.bitwise_xor(block[: part.numel()], (index << 40) | (start // block_elems), out=part)
        tensors[f"layers.{index}.weight"] = tensor
    return tensors


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """Every tensor's bytes, by name: equal digests mean a bit-exact round trip."""
    h = xxhash.xxh3_128()
    for name, tensor in sorted(tensors.items()):
        h.update(name.encode())
        h.update(_bytes(tensor))
    return h.hexdigest()


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A tensor's memory as bytes, without a copy."""
    return memory_at(tensor.data_ptr(), tensor.nbytes)


# -- the paths measured --------------------------------------------------------


class Raw:
    """The disk's limit: sequential O_DIRECT in ``request``-sized requests, one in flight.

    ``huge`` stages in transparent huge pages, as hibernate's reader does (the
    block layer then makes fewer, larger requests of each read). ``fresh``
    reads into a newly mapped destination of the whole size instead of one
    reused buffer, faulting it in as the reads land: the limit of a wake, which
    refills memory it has just allocated.

    A reused buffer is allocated (and filled) anew for every measurement,
    outside the timing, as hibernate allocates its staging for every transfer:
    on the VM this was tuned on, how fast the disk fills a buffer depends on
    where that buffer's pages happen to lie (one 64 MiB buffer read at 1.02x,
    another allocated in the same process at 0.66x, for minutes), so a buffer
    kept for the whole run would make the limit a matter of luck.
    """

    def __init__(
        self, path: Path, total: int, request: int, *, huge: bool = False, fresh: bool = False
    ) -> None:
        self.path = path
        self.total = total
        self.request = request
        self.huge = huge
        self.fresh = fresh

    def _buffer(self, size: int) -> mmap.mmap:
        buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if self.huge:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        buffer.write(os.urandom(MiB) * (size // MiB))
        return buffer

    def write(self, ready: Callable[[], object] | None = None) -> float:
        """Seconds to write; ``ready`` is called once the buffer is allocated, before the timing."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        buffer = self._buffer(self.request)
        view = memoryview(buffer)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            if ready is not None:
                ready()
            started = time.perf_counter()
            for offset in range(0, self.total, self.request):
                n = min(self.request, self.total - offset)
                if os.pwrite(fd, view[:n], offset) != n:
                    raise OSError("short write")
            os.fsync(fd)
            return time.perf_counter() - started
        finally:
            os.close(fd)
            view.release()
            buffer.close()

    def read(self, ready: Callable[[], object] | None = None) -> float:
        """Seconds to read; ``ready`` as for :meth:`write`."""
        evict(self.path)
        if self.fresh:
            buffer = mmap.mmap(-1, self.total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            buffer = self._buffer(self.request)
        view = memoryview(buffer)
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            if ready is not None:
                ready()
            started = time.perf_counter()
            for offset in range(0, self.total, self.request):
                n = min(self.request, self.total - offset)
                with view[offset : offset + n] if self.fresh else view[:n] as into:
                    if os.preadv(fd, [into], offset) != n:
                        raise OSError("short read")
            return time.perf_counter() - started
        finally:
            os.close(fd)
            view.release()
            buffer.close()

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


@dataclass
class Transfer:
    """One hibernate spill or restore, as measured."""

    seconds: float
    rss_growth: int
    cache_growth: int
    io_mode: str
    written_bytes: int = 0
    reuse_read_bytes: int = 0
    map_seconds: float = 0.0  # of a restore's seconds, those that brought the regions back before the read


def tuning_of(directory: Path) -> Tuning:
    """The threads and requests in flight a spill or a restore in ``directory`` runs with."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return choose(fd)
    finally:
        os.close(fd)


def hash_seconds(tensors: dict[str, torch.Tensor], chunk_bytes: int, threads: int) -> float:
    """Seconds to checksum every chunk of the tensors where they lie, over ``threads`` threads:
    what an unchanged re-sleep's stream does, with as many stagers."""
    views = [
        view[offset : offset + chunk_bytes]
        for tensor in tensors.values()
        for view in (_bytes(tensor),)
        for offset in range(0, len(view), chunk_bytes)
    ]
    ready = threading.Barrier(threads + 1)

    def work(share: list[memoryview]) -> None:
        ready.wait()
        bulk.checksums(share)

    workers = [threading.Thread(target=work, args=(views[n::threads],)) for n in range(threads)]
    for worker in workers:
        worker.start()
    ready.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    return time.perf_counter() - started


# The process whose snapshot a new one adopts: the bench's tensors built the same way, tracked under
# the same name, put to sleep into a directory, and gone (it exits asleep, as a killed job is).
_ADOPTED_PROCESS = r"""
import sys
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import bench_store, hibernate
tensors = bench_store.make_tensors(int(sys.argv[3]), int(sys.argv[4]))
hibernate.track(tensors, name="bench")
hibernate.sleep(sys.argv[5])
"""


def measure_adoption(
    args: argparse.Namespace,
    work: Path,
    tensors: dict[str, torch.Tensor],
    reference: str,
    limits: "RawLimits",
) -> list[dict[str, float]]:
    """Adoption of a gone process's snapshot by this one (hibernate.adopt), paired with a raw read.

    A child process builds the same tensors, sleeps into ``work/adopted`` and exits; this process
    tracks its own tensors under the same name (zeroed first, so a bit-exact result proves the
    bytes came from the snapshot) and adopts it, once per repetition, the page cache evicted
    before each read. The rate is the adoption's bytes over the call's whole time (finding the
    snapshot, pairing by name, reading and verifying), against the raw read of the same moment.
    """
    import hibernate

    directory = work / "adopted"
    here = Path(__file__).resolve().parent
    # Both agents listen in a directory of the run's own (short, whatever --dir is): the gone
    # process's socket is left behind there, not in the user's runtime directory.
    os.environ["HIBERNATE_RUNTIME_DIR"] = str(Path(tempfile.mkdtemp(prefix="hb-bench-run-")) / "run")
    environment = {k: v for k, v in os.environ.items() if k != "HIBERNATE_ADOPT"}
    subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            _ADOPTED_PROCESS,
            str(here.parents[1]),
            str(here),
            str(args.size_mb * MiB),
            str(args.tensors),
            str(directory),
        ],
        check=True,
        env=environment,
    )
    total = sum(t.nbytes for t in tensors.values())
    hibernate.track(tensors, name="bench")
    figures = []
    for rep in range(args.reps):
        for tensor in tensors.values():
            tensor.zero_()
        evict(directory)
        raw_read, adopted = paired(
            lambda: sampled(limits.read.read), lambda: timed(lambda: hibernate.adopt(directory)), rep % 2 == 1
        )
        if digest(tensors) != reference:
            raise SystemExit("hibernate.adopt returned different bytes")
        figures.append(
            {
                "adopt_gbps": gbps(total, adopted),
                "adopt_ratio": gbps(total, adopted) / gbps(limits.total, raw_read),
            }
        )
    hibernate.untrack(tensors)
    shutil.rmtree(Path(os.environ["HIBERNATE_RUNTIME_DIR"]).parent, ignore_errors=True)
    return figures


def tensor_pool(tensors: dict[str, torch.Tensor]) -> TensorPool:
    """The tensors tracked as ``hibernate.track(model)`` tracks them: kept, tagged weights."""
    pool = TensorPool()
    pool.track(tensors, tag="weights", keep=True, name="model")
    return pool


class Hibernate:
    """hibernate's store, driven the way the agent drives it, over one pool's regions."""

    def __init__(self, path: Path, pool: Pool, options: WriteOptions) -> None:
        self.path = path
        self.options = options
        self.pool = pool
        self.regions = list(self.pool.regions())
        self.total = sum(r.nbytes for r in self.regions)
        self.snapshot = ""
        self.known: ReuseSource | None = None
        self.written: WrittenRecords | None = None

    def fresh(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self.known = None

    def spill(self, *, check_reuse: bool = True) -> Transfer:
        """A sleep's spill; ``check_reuse=False``: what --skip-reuse-check does."""
        gc.collect()
        options = dataclasses.replace(self.options, check_reuse=check_reuse)
        with SpillRoot(self.path, create=True) as root, Sampler() as sampler:
            started = time.perf_counter()
            result = write_snapshot(
                root,
                self.regions,
                producer={"bench": "bench-store"},
                options=options,
                known=self.known,  # as an agent holds what its last wake read
                pin=self.pool.pinner(),
            )
            seconds = time.perf_counter() - started
        self.snapshot = result.snapshot
        self.known = ReuseSource.of(result.manifest)
        self.written = WrittenRecords.of(result.manifest.columns)  # as an agent keeps it for its wake
        return Transfer(
            seconds,
            sampler.rss_growth,
            sampler.cache_growth,
            result.io_mode,
            result.written_bytes,
            result.reuse_read_bytes,
        )

    def restore(self) -> Transfer:
        evict(self.path)
        for region in self.regions:
            region.release()
        self.pool.after_release()
        gc.collect()
        with Sampler() as sampler:
            started = time.perf_counter()
            for region in self.regions:
                region.reallocate()
            mapped = time.perf_counter() - started
            with SpillRoot(self.path) as root, SnapshotReader(root, self.snapshot) as reader:
                reader.check_matches(self.regions, written=self.written)
                result = reader.read_into(
                    self.regions, buffer_bytes=self.options.buffer_bytes, pin=self.pool.pinner()
                )
            seconds = time.perf_counter() - started
        # The restore legitimately grows RSS by the tensors it refills; the rest is its own.
        return Transfer(
            seconds, sampler.rss_growth - self.total, sampler.cache_growth, result.io_mode, map_seconds=mapped
        )


def torch_roundtrip(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[float, float]:
    """torch.save + fsync, then torch.load (weights_only: nothing from disk is executed)."""

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(tensors, f)
            f.flush()
            os.fsync(f.fileno())

    write = timed(save)
    evict(path)
    loaded: list[Any] = []
    read = timed(lambda: loaded.append(torch.load(path, weights_only=True)))
    assert digest(loaded[0]) == digest(tensors), "torch.load returned different bytes"
    loaded.clear()
    path.unlink()
    return write, read


def safetensors_save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """safetensors' save_file + fsync: what a user of safetensors waits for.

    save_file finds the tensors' memory through numpy; without numpy the same
    writer, serialize_file, is handed the pointers directly: the bytes written
    and the code writing them are the same (save_file's Python per tensor is not).
    """
    import importlib.util

    from safetensors import TensorSpec, serialize_file
    from safetensors.torch import save_file

    if importlib.util.find_spec("numpy") is not None:
        save_file(tensors, str(path))
    else:
        specs = {
            name: TensorSpec(
                dtype=str(t.dtype).removeprefix("torch."),
                shape=list(t.shape),
                data_ptr=t.data_ptr(),
                data_len=t.nbytes,
            )
            for name, t in tensors.items()
        }
        serialize_file(specs, str(path))
    fsync_path(path)


def safetensors_load(path: Path) -> dict[str, torch.Tensor]:
    """load_file, the tensors materialised: load_file's tensors are views of a file mapping
    (page cache); a loaded model holds its weights in its own memory, as a wake leaves them."""
    from safetensors.torch import load_file

    return {name: tensor.clone() for name, tensor in load_file(str(path)).items()}


def safetensors_roundtrip(path: Path, tensors: dict[str, torch.Tensor]) -> tuple[float, float]:
    """save_file + fsync, then load_file and materialise the tensors (safetensors_save, safetensors_load)."""
    write = timed(lambda: safetensors_save(path, tensors))
    evict(path)
    loaded: list[dict[str, torch.Tensor]] = []
    read = timed(lambda: loaded.append(safetensors_load(path)))
    assert digest(loaded[0]) == digest(tensors), "safetensors returned different bytes"
    loaded.clear()
    path.unlink()
    return write, read


# -- the run -------------------------------------------------------------------


def _holds(value: float, op: str, limit: float) -> bool:
    if op == ">":
        return value > limit
    return value >= limit if op == ">=" else value <= limit


def judged(checks: list[tuple[str, float, str, float]]) -> list[dict[str, Any]]:
    """Each (name, value, op, limit) as a judged target of the JSON document, with whether it held."""
    return [
        {"target": name, "value": value, "limit": limit, "pass": _holds(value, op, limit), "judged": True}
        for name, value, op, limit in checks
    ]


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s, as disks are rated."""
    return nbytes / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="bench-store",
        description="hibernate's spill and restore against raw O_DIRECT, torch.save and safetensors",
    )
    parser.add_argument("--size-mb", type=int, default=2048, help="bytes of bf16 tensors (default 2048 MiB)")
    parser.add_argument("--tensors", type=int, default=64, help="number of tensors (default 64)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="directory on the disk to measure (default: TMPDIR)"
    )
    parser.add_argument("--reps", type=int, default=5, help="paired repetitions (default 5)")
    parser.add_argument("--buffer-mb", type=int, default=256, help="hibernate staging memory (default 256)")
    parser.add_argument("--chunk-mb", type=int, default=32, help="hibernate chunk size (default 32)")
    parser.add_argument("--skip-baselines", action="store_true", help="no torch.save / safetensors")
    parser.add_argument(
        "--procs",
        type=int,
        default=1,
        help="N > 1: sleep and wake N target processes at once through the CLI, sharing --size-mb",
    )
    parser.add_argument(
        "--pools",
        action="store_true",
        help="hibernate.pool()'s torch_memory_saver pool (over host memory) beside the tensor pool",
    )
    parser.add_argument(
        "--kept-staging",
        action="store_true",
        help="two demo targets through the CLI, one keeping its staging (--keep-staging-mb), one not",
    )
    parser.add_argument(
        "--page-cache",
        action="store_true",
        help="a demo target through the CLI woken from a snapshot in the page cache, read through it or not",
    )
    parser.add_argument("--json-out", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    if args.size_mb < 64 or args.tensors < 2 or args.reps < 1 or args.procs < 1:
        parser.error("--size-mb must be >= 64, --tensors >= 2, --reps >= 1, --procs >= 1")
    if args.pools and args.procs > 1:
        parser.error("--pools measures one process: not with --procs")
    if args.kept_staging and (args.pools or args.procs > 1):
        parser.error("--kept-staging measures two processes of its own: not with --pools or --procs")
    if args.page_cache and (args.pools or args.procs > 1 or args.kept_staging):
        parser.error(
            "--page-cache measures one process of its own: not with --pools, --procs or --kept-staging"
        )
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    if args.json_out is not None and not args.json_out.parent.is_dir():
        # Checked before a run of minutes, not when its document is written at the end.
        parser.error(f"--json-out {args.json_out}: {args.json_out.parent} is not a directory")

    run_started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hibernate-bench-", dir=args.dir))
    os.chmod(work, 0o700)
    try:
        if args.procs > 1:
            return run_processes(args, work, run_started)
        if args.pools:
            return run_pools(args, work, run_started)
        if args.kept_staging:
            return run_kept_staging(args, work, run_started)
        if args.page_cache:
            return run_page_cache(args, work, run_started)
        return run(args, work, run_started)
    finally:
        Sampler.shutdown()
        shutil.rmtree(work, ignore_errors=True)


A = TypeVar("A")
B = TypeVar("B")


def paired(first: Callable[[], A], second: Callable[[], B], swap: bool) -> tuple[A, B]:
    """Run two measurements back to back, in either order; returns them as (first, second)."""
    if swap:
        b = second()
        return first(), b
    a = first()
    return a, second()


def between(
    before: Callable[[], A], measured: Callable[[], B], after: Callable[[], A], swap: bool
) -> tuple[A, B, A]:
    """Run ``measured`` between two baselines, swapping their order when ``swap``; returns
    (before's, measured's, after's) figures whatever the order."""
    if swap:
        second = after()
        result = measured()
        return before(), result, second
    first = before()
    result = measured()
    return first, result, after()


def run(args: argparse.Namespace, work: Path, run_started: float) -> int:
    tensors = make_tensors(args.size_mb * MiB, args.tensors)
    total = sum(t.nbytes for t in tensors.values())
    reference = digest(tensors)
    options = WriteOptions(buffer_bytes=args.buffer_mb * MiB, chunk_bytes=args.chunk_mb * MiB)
    limits = RawLimits(work / "raw.bin", total - total % SIMPLE_REQUEST, options)
    hib = Hibernate(work / "hibernate", tensor_pool(tensors), options)

    reps: list[dict[str, Any]] = []
    for rep in range(args.reps):
        swap = rep % 2 == 1  # alternate who goes first, so drift favours neither
        hib.fresh()
        raw_write, spill = paired(lambda: sampled(limits.write.write), hib.spill, swap)
        # The unchanged re-sleep both ways, in alternating order; the checked one beside a raw
        # read and a hash of the same bytes, the two things it does at once.
        second, unchecked = paired(hib.spill, lambda: hib.spill(check_reuse=False), swap)
        check_read = sampled(limits.read.read) * total / limits.total
        hashed = hash_seconds(tensors, options.effective_chunk_bytes, tuning_of(work).workers)
        check_limit = max(check_read, hashed)
        simple_write = sampled(limits.simple_write.write)
        raw_read, restore = paired(lambda: sampled(limits.read.read), hib.restore, swap)
        simple_read = sampled(limits.simple_read.read)
        fresh_read = sampled(limits.fresh_read.read)
        if digest(tensors) != reference:
            raise SystemExit("hibernate restore returned different bytes")
        raw_bytes = limits.total
        reps.append(
            {
                "raw_write_gbps": gbps(raw_bytes, raw_write),
                "raw_read_gbps": gbps(raw_bytes, raw_read),
                "simple_write_gbps": gbps(raw_bytes, simple_write),
                "simple_read_gbps": gbps(raw_bytes, simple_read),
                "fresh_read_gbps": gbps(raw_bytes, fresh_read),
                "spill_gbps": gbps(total, spill.seconds),
                "restore_gbps": gbps(total, restore.seconds),
                "spill_ratio": gbps(total, spill.seconds) / gbps(raw_bytes, raw_write),
                "restore_ratio": gbps(total, restore.seconds) / gbps(raw_bytes, raw_read),
                "spill_simple_ratio": gbps(total, spill.seconds) / gbps(raw_bytes, simple_write),
                "restore_simple_ratio": gbps(total, restore.seconds) / gbps(raw_bytes, simple_read),
                "restore_fresh_ratio": gbps(total, restore.seconds) / gbps(raw_bytes, fresh_read),
                "spill_seconds": spill.seconds,
                "second_spill_seconds": second.seconds,
                "second_spill_written_bytes": second.written_bytes,
                "second_spill_read_bytes": second.reuse_read_bytes,
                "second_spill_speedup": spill.seconds / second.seconds,
                "check_read_seconds": check_read,
                "check_hash_seconds": hashed,
                "second_spill_limit_ratio": second.seconds / check_limit,
                "second_spill_extra_rss": second.rss_growth,
                "second_spill_cache_growth": second.cache_growth,
                "unchecked_spill_seconds": unchecked.seconds,
                "unchecked_spill_written_bytes": unchecked.written_bytes,
                "unchecked_spill_speedup": spill.seconds / unchecked.seconds,
                # What a spill or restore takes beyond the raw transfer of the same bytes, per
                # tensor: the per-tensor cost, measured against the disk of the same moment.
                "spill_overhead_us_per_tensor": (spill.seconds - raw_write * total / raw_bytes)
                / len(tensors)
                * 1e6,
                "restore_overhead_us_per_tensor": (restore.seconds - raw_read * total / raw_bytes)
                / len(tensors)
                * 1e6,
                "second_spill_us_per_tensor": second.seconds / len(tensors) * 1e6,
                "unchecked_spill_us_per_tensor": unchecked.seconds / len(tensors) * 1e6,
                "spill_extra_rss": spill.rss_growth,
                "spill_cache_growth": spill.cache_growth,
                "restore_extra_rss": restore.rss_growth,
                "restore_cache_growth": restore.cache_growth,
                "spill_io_mode": spill.io_mode,
                "restore_io_mode": restore.io_mode,
            }
        )
    hib.fresh()
    adoptions = measure_adoption(args, work, tensors, reference, limits)
    for figures, adoption in zip(reps, adoptions, strict=True):
        figures.update(adoption)

    baselines: dict[str, dict[str, float]] = {}
    if not args.skip_baselines:
        for name, roundtrip in (("torch", torch_roundtrip), ("safetensors", safetensors_roundtrip)):
            limit_write = limits.write.write()
            limit_read = limits.read.read()
            write, read = roundtrip(work / f"model.{name}", tensors)
            baselines[name] = {
                "save_gbps": gbps(total, write),
                "load_gbps": gbps(total, read),
                "save_ratio": gbps(total, write) / gbps(limits.total, limit_write),
                "load_ratio": gbps(total, read) / gbps(limits.total, limit_read),
            }
    limits.close()

    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in reps))

    staging = options.buffer_bytes
    cache_allowance = CACHE_PER_2GIB * max(1.0, total / (2048 * MiB))
    worst = {
        key: max(r[key] for r in reps)
        for key in (
            "spill_extra_rss",
            "restore_extra_rss",
            "second_spill_extra_rss",
            "spill_cache_growth",
            "restore_cache_growth",
            "second_spill_cache_growth",
        )
    }
    many = len(tensors) > MANY_TENSORS
    checks = [
        ("spill >= 0.90x raw O_DIRECT write", median("spill_ratio"), ">=", TARGET_THROUGHPUT),
        ("cold restore >= 0.90x raw O_DIRECT read", median("restore_ratio"), ">=", TARGET_THROUGHPUT),
        (
            "adoption by a new process >= 0.90x raw O_DIRECT read",
            median("adopt_ratio"),
            ">=",
            TARGET_THROUGHPUT,
        ),
        (
            "cold restore >= 0.90x raw O_DIRECT read into fresh memory",
            median("restore_fresh_ratio"),
            ">=",
            TARGET_THROUGHPUT,
        ),
        ("peak extra RSS, spill <= staging + 64 MiB", worst["spill_extra_rss"], "<=", staging + SLACK_RSS),
        (
            "peak extra RSS, restore <= staging + 64 MiB",
            worst["restore_extra_rss"],
            "<=",
            staging + SLACK_RSS,
        ),
        ("page-cache growth, spill <= 64 MiB per 2 GiB", worst["spill_cache_growth"], "<=", cache_allowance),
        (
            "page-cache growth, restore <= 64 MiB per 2 GiB",
            worst["restore_cache_growth"],
            "<=",
            cache_allowance,
        ),
        (
            "peak extra RSS, checked re-sleep <= staging + 64 MiB",
            worst["second_spill_extra_rss"],
            "<=",
            staging + SLACK_RSS,
        ),
        (
            "page-cache growth, checked re-sleep <= 64 MiB per 2 GiB",
            worst["second_spill_cache_growth"],
            "<=",
            cache_allowance,
        ),
        (
            "unchanged re-sleep, checked, faster than the first sleep",
            median("second_spill_speedup"),
            ">",
            TARGET_CHECKED_SPEEDUP,
        ),
        (
            "unchanged re-sleep, --skip-reuse-check, >= 1.5x faster",
            median("unchecked_spill_speedup"),
            ">=",
            TARGET_UNCHECKED_SPEEDUP,
        ),
        (
            "unchanged re-sleep, --skip-reuse-check, >= 5x faster",
            median("unchecked_spill_speedup"),
            ">=",
            TARGET_SECOND_SPEEDUP,
        ),
    ]
    if many:
        checks += [
            (
                "spill overhead <= 10 us per tensor",
                median("spill_overhead_us_per_tensor"),
                "<=",
                TARGET_US_PER_TENSOR,
            ),
            (
                "restore overhead <= 10 us per tensor",
                median("restore_overhead_us_per_tensor"),
                "<=",
                TARGET_US_PER_TENSOR,
            ),
        ]
    # With many tensors the per-tensor targets are the point; the throughput ratios are shown.
    unjudged = {name for name, *_ in checks[:4]} if many else set()
    targets = [
        {
            "target": name,
            "value": value,
            "limit": limit,
            "pass": _holds(value, op, limit),
            "judged": name not in unjudged,
        }
        for name, value, op, limit in checks
    ]
    document = {
        "machine": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "directory": str(work.parent),
            "filesystem": filesystem_of(work),
            "torch": torch.__version__,
        },
        "data": {"bytes": total, "tensors": len(tensors), "dtype": "bfloat16"},
        "hibernate_options": {
            "buffer_bytes": options.buffer_bytes,
            "chunk_bytes": options.effective_chunk_bytes,
            "write_request_bytes": limits.write.request,
            "read_request_bytes": limits.read.request,
            "stage_threads": tuning_of(work).workers,
            "io_depth": tuning_of(work).io_depth,
        },
        "method": METHOD,
        "medians": {key: median(key) for key in SPREAD_KEYS + MEDIAN_ONLY_KEYS},
        "spread": {key: spread([r[key] for r in reps]) for key in SPREAD_KEYS},
        "worst": worst,
        "baselines": baselines,
        "repetitions": reps,
        "targets": targets,
        "all_pass": all(t["pass"] for t in targets if t["judged"]),
        "seconds": time.perf_counter() - run_started,
    }
    print_table(document)
    return emit(document, args.json_out)


# -- many processes, one disk (--procs N) ------------------------------------------


class Targets:
    """N demo targets (``python -m hibernate.demo serve``), each with its share of the bytes.

    Their agents live in a runtime directory of the bench's own, so the bench
    can never reach another hibernate target of this user; each has its own
    seed, so no two snapshots share a chunk.
    """

    def __init__(self, work: Path, count: int, size_mb: int) -> None:
        # With PYTHONDONTWRITEBYTECODE set (as on some CI machines) every command would compile
        # hibernate's modules from source again, 40-100 ms of each measured sleep and wake
        # (profiled); an installed copy has its bytecode (pip writes it), so these keep theirs.
        environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        self.env = {**environment, "HIBERNATE_RUNTIME_DIR": str(work / "run")}
        self.controls = [work / f"target-{n}.sock" for n in range(count)]
        self.processes: list[subprocess.Popen[bytes]] = []
        ready_files = [work / f"target-{n}.ready" for n in range(count)]
        for n in range(count):
            command = [sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve"]
            command += ["--size-mb", str(size_mb), "--seed", str(n), "--control", str(self.controls[n])]
            command += ["--ready-file", str(ready_files[n])]
            log = open(work / f"target-{n}.log", "wb")  # noqa: SIM115 (the target's lifetime)
            self.processes.append(
                subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)
            )
        deadline = time.monotonic() + 600
        while not all(f.exists() for f in ready_files):
            if any(p.poll() is not None for p in self.processes) or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"a demo target did not start; see the logs in {work}")
            time.sleep(0.1)
        self.pids = [str(p.pid) for p in self.processes]
        self.weight_bytes = sum(int(json.loads(f.read_text())["weight_bytes"]) for f in ready_files)

    def digests(self) -> list[str]:
        from hibernate.demo import request

        return [str(request(str(control), "infer")["digest"]) for control in self.controls]

    def hibernate(self, *argv: str) -> dict[str, Any]:
        """One hibernate command through the CLI, as a user runs it; its --json report."""
        command = [sys.executable, "-W", "ignore", "-m", "hibernate", *argv, "--json"]
        done = subprocess.run(command, env=self.env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            # With --json the error is in the report on stdout, not on stderr.
            raise SystemExit(
                f"hibernate {' '.join(argv)} failed ({done.returncode}): {done.stdout.strip()} {done.stderr}"
            )
        report: dict[str, Any] = json.loads(done.stdout)
        return report

    def close(self) -> None:
        for process in self.processes:
            process.kill()
            process.wait()


def run_processes(args: argparse.Namespace, work: Path, run_started: float) -> int:
    """--procs N: N processes sleep and wake at once against one disk, one staging budget."""
    count = args.procs
    snapshots = work / "snapshots"
    targets = Targets(work, count, max(1, args.size_mb // count))
    try:
        references = targets.digests()
        share = share_staging(args.buffer_mb, count)
        reps: list[dict[str, Any]] = []
        total = targets.weight_bytes - targets.weight_bytes % SIMPLE_REQUEST
        options = WriteOptions(buffer_bytes=args.buffer_mb * MiB)
        limits = RawLimits(work / "raw.bin", total, options)
        shares = RawShares(work, total, count, share, options.effective_chunk_bytes)
        budget_flag = ["--buffer-mb", str(args.buffer_mb)]
        for rep in range(args.reps):
            swap = rep % 2 == 1
            slept = None
            shutil.rmtree(snapshots, ignore_errors=True)  # the last repetition's

            # A new directory each time: a first sleep, with nothing to reuse from the last.
            into = snapshots / f"repetition-{rep}"

            def sleep(into: Path = into) -> float:
                nonlocal slept
                slept = targets.hibernate("sleep", *targets.pids, "--to", str(into), *budget_flag)
                return float(slept["seconds"])

            # The sleep between its two baselines, which of them goes first alternating.
            raw_write, sleep_seconds, shares_write = between(limits.write.write, sleep, shares.write, swap)
            assert slept is not None
            evict(snapshots)
            woken = None

            def wake() -> float:
                nonlocal woken
                woken = targets.hibernate("wake", *targets.pids, *budget_flag)
                return float(woken["seconds"])

            raw_read, wake_seconds, shares_read = between(limits.read.read, wake, shares.read, swap)
            assert woken is not None
            if targets.digests() != references:
                raise SystemExit("a target answered differently after its wake")
            written = sum(p["written_bytes"] for p in slept["processes"])
            restored = sum(p["restored_bytes"] for p in woken["processes"])
            reps.append(
                {
                    "raw_write_gbps": gbps(limits.total, raw_write),
                    "raw_read_gbps": gbps(limits.total, raw_read),
                    "sleep_gbps": gbps(written, sleep_seconds),
                    "wake_gbps": gbps(restored, wake_seconds),
                    "sleep_ratio": gbps(written, sleep_seconds) / gbps(limits.total, raw_write),
                    "wake_ratio": gbps(restored, wake_seconds) / gbps(limits.total, raw_read),
                    "shares_write_gbps": gbps(shares.total, shares_write),
                    "shares_read_gbps": gbps(shares.total, shares_read),
                    "sleep_shares_ratio": gbps(written, sleep_seconds) / gbps(shares.total, shares_write),
                    "wake_shares_ratio": gbps(restored, wake_seconds) / gbps(shares.total, shares_read),
                    "written_bytes": written,
                    "restored_bytes": restored,
                    "sleep_staging_bytes": [p["staging_bytes"] for p in slept["processes"]],
                    "wake_staging_bytes": [p["staging_bytes"] for p in woken["processes"]],
                    "spill_seconds": [p["phases"]["spill"] for p in slept["processes"]],
                    "restore_seconds": [p["phases"]["restore"] for p in woken["processes"]],
                }
            )
        limits.close()
        shares.close()
    finally:
        targets.close()

    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in reps))

    budget = args.buffer_mb * MiB
    staged_at_once = max(
        sum(sorted(r[key], reverse=True)[: share.at_once])
        for r in reps
        for key in ("sleep_staging_bytes", "wake_staging_bytes")
    )
    # Starved: a process whose own transfer took more than twice the median process's.
    unevenness = max(
        max(r[key]) / statistics.median(r[key]) for r in reps for key in ("spill_seconds", "restore_seconds")
    )
    checks = [
        ("aggregate sleep >= 0.90x raw O_DIRECT write", median("sleep_ratio"), ">=", TARGET_THROUGHPUT),
        ("aggregate wake >= 0.90x raw O_DIRECT read", median("wake_ratio"), ">=", TARGET_THROUGHPUT),
        (
            "staging of processes moving at once <= --buffer-mb",
            float(staged_at_once),
            "<=",
            float(budget),
        ),
        ("slowest process <= 2x the median process", unevenness, "<=", 2.0),
    ]
    targets_doc = judged(checks)
    document = {
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(), "filesystem": filesystem_of(work)},
        "data": {"processes": count, "bytes_per_process": max(1, args.size_mb // count) * MiB},
        "staging": {"budget_bytes": budget, "each_bytes": share.buffer_mb * MiB, "at_once": share.at_once},
        "share_requests": {"write_bytes": shares.write_request, "read_bytes": shares.read_request},
        "method": PROCS_METHOD,
        "spread": {
            key: spread([r[key] for r in reps])
            for key in (
                "raw_write_gbps",
                "raw_read_gbps",
                "shares_write_gbps",
                "shares_read_gbps",
                "sleep_gbps",
                "wake_gbps",
                "sleep_ratio",
                "wake_ratio",
                "sleep_shares_ratio",
                "wake_shares_ratio",
            )
        },
        "repetitions": reps,
        "targets": targets_doc,
        "all_pass": all(t["pass"] for t in targets_doc),
        "seconds": time.perf_counter() - run_started,
    }
    print_processes_table(document)
    return emit(document, args.json_out)


# -- staging kept between transfers (--kept-staging) -------------------------------

KEPT_METHOD = (
    "two demo targets of --size-mb each (other seeds, so no chunk is shared), slept and woken through the "
    "CLI as a user runs them: one with --keep-staging-mb (twice --buffer-mb: a sleep's arenas and a "
    "wake's read buffers), one with --keep-staging-mb 0 (each transfer allocates, faults in and gives "
    "back its own staging, the default); each repetition runs a cycle of each, which goes first "
    "alternating, after one cycle each to start with (the keeping target's fills what it keeps); a "
    "cycle is a sleep to a fresh directory (every byte written) and a wake with the snapshot dropped "
    "from the page cache; times are the commands' wall times and their spill and restore steps, ratios "
    "the medians of the paired ratios (keeping / not)"
)


def run_kept_staging(args: argparse.Namespace, work: Path, run_started: float) -> int:
    """--kept-staging: what a target keeping its staging between transfers saves its sleeps and wakes."""
    keep_mb = 2 * args.buffer_mb
    targets = Targets(work, 2, args.size_mb)
    names = ("plain", "kept")
    flags = {"plain": ["--keep-staging-mb", "0"], "kept": ["--keep-staging-mb", str(keep_mb)]}
    budget = ["--buffer-mb", str(args.buffer_mb)]
    snapshots = work / "snapshots"
    cycles: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    try:
        references = targets.digests()

        def cycle(index: int, label: str) -> dict[str, float]:
            into = snapshots / f"{label}-{len(cycles[names[index]])}"
            pid = targets.pids[index]
            started = time.perf_counter()
            slept = targets.hibernate("sleep", pid, "--to", str(into), *budget, *flags[names[index]])
            sleep_wall = time.perf_counter() - started
            evict(into)
            started = time.perf_counter()
            woken = targets.hibernate("wake", pid, *budget, *flags[names[index]])
            wake_wall = time.perf_counter() - started
            shutil.rmtree(into, ignore_errors=True)
            sleep_process, wake_process = slept["processes"][0], woken["processes"][0]
            return {
                "cycle_wall": sleep_wall + wake_wall,
                "sleep_wall": sleep_wall,
                "spill": float(sleep_process["phases"]["spill"]),
                "wake_wall": wake_wall,
                "restore": float(wake_process["phases"]["restore"]),
                "sleep_reused_bytes": (sleep_process.get("kept_staging") or {}).get("reused_bytes", 0),
                "wake_reused_bytes": (wake_process.get("kept_staging") or {}).get("reused_bytes", 0),
            }

        for index, name in enumerate(names):
            cycle(index, f"start-{name}")
        for rep in range(args.reps):
            order = (0, 1) if rep % 2 == 0 else (1, 0)
            for index in order:
                cycles[names[index]].append(cycle(index, names[index]))
        if targets.digests() != references:
            raise SystemExit("a target answered differently after its wakes")
    finally:
        targets.close()
    measures = ("cycle_wall", "sleep_wall", "spill", "wake_wall", "restore")
    ratios = {
        key: [k[key] / p[key] for k, p in zip(cycles["kept"], cycles["plain"], strict=True)]
        for key in measures
    }
    reused = min(min(c["sleep_reused_bytes"], c["wake_reused_bytes"]) for c in cycles["kept"])
    # The times are shown, not judged: what keeping saves a target without device memory here (the
    # faulting-in of its staging, partly done while the disk works) is within the disk's spread; on
    # a GPU node it also saves page-locking it, which scripts/gpu-check's kept-staging section times.
    checks = [
        ("every kept cycle's sleep and wake took staging kept by the one before", float(reused), ">", 0.0),
    ]
    targets_doc = judged(checks)
    document = {
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(), "filesystem": filesystem_of(work)},
        "data": {
            "bytes_per_process": args.size_mb * MiB,
            "buffer_mb": args.buffer_mb,
            "keep_staging_mb": keep_mb,
        },
        "method": KEPT_METHOD,
        "spread": {
            **{f"{name}_{key}": spread([c[key] for c in cycles[name]]) for name in names for key in measures},
            **{f"{key}_ratio": spread(values) for key, values in ratios.items()},
        },
        "repetitions": [
            {"plain": p, "kept": k} for p, k in zip(cycles["plain"], cycles["kept"], strict=True)
        ],
        "targets": targets_doc,
        "all_pass": all(t["pass"] for t in targets_doc),
        "seconds": time.perf_counter() - run_started,
    }
    print_kept_table(document)
    return emit(document, args.json_out)


def print_kept_table(doc: dict[str, Any]) -> None:
    data, spreads = doc["data"], doc["spread"]
    print(
        f"bench-store --kept-staging: {data['bytes_per_process'] / MiB:.0f} MiB a target, --buffer-mb "
        f"{data['buffer_mb']}, --keep-staging-mb {data['keep_staging_mb']}, {doc['machine']['filesystem']}, "
        f"{doc['machine']['cpus']} CPUs, {len(doc['repetitions'])} repetitions"
    )
    print(f"method: {doc['method']}.")
    print()
    print(f"{'seconds':<22} {'not kept':>20} {'kept':>20} {'kept / not':>20}")
    for label, key in (("sleep and wake (wall)", "cycle_wall"), ("sleep (wall)", "sleep_wall"),
                       ("  its spill step", "spill"), ("wake (wall)", "wake_wall"),
                       ("  its restore step", "restore")):  # fmt: skip
        cells = [spreads[f"plain_{key}"], spreads[f"kept_{key}"], spreads[f"{key}_ratio"]]
        print(
            f"{label:<22} " + " ".join(f"{c['median']:>6.3f} ({c['min']:.3f}-{c['max']:.3f})" for c in cells)
        )
    print()
    for target in doc["targets"]:
        verdict = "PASS" if target["pass"] else "FAIL"
        print(f"{verdict}  {target['target']}: {target['value']:.2f} (limit {target['limit']:.2f})")
    print(f"\nwhole run {doc['seconds']:.1f} s")


# -- a wake from the page cache (--page-cache) ---------------------------------------


PAGE_CACHE_METHOD = (
    "one demo target of --size-mb, slept and woken through the CLI as a user runs them; each repetition "
    "runs two cycles in alternating order, each a sleep (direct I/O, so nothing of the snapshot is cached) "
    "whose files are then read once through the page cache (as an operator warming a wake would), and a "
    "wake: with the default --io-mode auto, which finds them cached and reads through the cache, or with "
    "--io-mode direct, which reads the disk (what auto did before it looked at the page cache); beside "
    "each wake, a buffered read of the same cached files into freshly allocated memory, the most a wake "
    "of a CPU target from memory can reach (it must fault its destination in)"
)


def read_cached_into_fresh(directory: Path) -> float:
    """Seconds to read every file under ``directory`` (from the page cache) into new anonymous memory."""
    paths = sorted(p for p in directory.rglob("*.bin") if p.is_file())
    total = sum(p.stat().st_size for p in paths)
    memory = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    view = memoryview(memory)
    try:
        started = time.perf_counter()
        at = 0
        for path in paths:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                size, done = path.stat().st_size, 0
                while done < size:
                    n = os.preadv(fd, [view[at + done : at + min(size, done + SIMPLE_REQUEST)]], done)
                    if n <= 0:
                        raise SystemExit(f"{path} ended early")
                    done += n
            finally:
                os.close(fd)
            at += size
        return time.perf_counter() - started
    finally:
        view.release()
        memory.close()


def run_page_cache(args: argparse.Namespace, work: Path, run_started: float) -> int:
    """--page-cache: what reading a snapshot found in the page cache through it saves a wake."""
    targets = Targets(work, 1, args.size_mb)
    pid = targets.pids[0]
    budget = ["--buffer-mb", str(args.buffer_mb)]
    names = ("direct", "cached")
    flags = {"direct": ["--io-mode", "direct"], "cached": []}
    snapshots = work / "snapshots"
    cycles: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    try:
        reference = targets.digests()

        def cycle(name: str) -> dict[str, Any]:
            into = snapshots / f"{name}-{len(cycles[name])}"
            targets.hibernate("sleep", pid, "--to", str(into), *budget)
            warm = read_cached_into_fresh(into)  # also warms the files
            floor = read_cached_into_fresh(into)  # now all from the page cache
            started = time.perf_counter()
            woken = targets.hibernate("wake", pid, *budget, *flags[name])
            wake_wall = time.perf_counter() - started
            shutil.rmtree(into, ignore_errors=True)
            process = woken["processes"][0]
            restored = int(process["restored_bytes"])
            return {
                "wake_wall": wake_wall,
                "restore": float(process["phases"]["restore"]),
                "restore_gbps": gbps(restored, float(process["phases"]["restore"])),
                "cached_read_gbps": gbps(restored, floor),
                "warm_seconds": warm,
                "io_mode": process["io_mode"],
                "kind": (process.get("tuning") or {}).get("kind"),
            }

        cycle("cached")  # a first cycle unmeasured: the target's first wake faults in its code paths
        cycles["cached"].clear()
        for rep in range(args.reps):
            for name in names if rep % 2 == 0 else names[::-1]:
                cycles[name].append(cycle(name))
        if targets.digests() != reference:
            raise SystemExit("the target answered differently after its wakes")
    finally:
        targets.close()
    measures = ("wake_wall", "restore")
    ratios = {
        key: [c[key] / d[key] for c, d in zip(cycles["cached"], cycles["direct"], strict=True)]
        for key in measures
    }
    of_floor = [c["restore_gbps"] / c["cached_read_gbps"] for c in cycles["cached"]]
    read_through = all(c["io_mode"] == "cached" and c["kind"] == "memory" for c in cycles["cached"])
    # Only the reading is judged: whether the page cache beats the disk depends on the disk (on the
    # 2-core machine both are held by faulting in the fresh destination), see docs/performance.md.
    checks = [
        (
            "every wake with --io-mode auto read the cached snapshot through the page cache",
            float(read_through),
            ">=",
            1.0,
        )
    ]
    targets_doc = judged(checks)
    document = {
        "machine": {"kernel": platform.release(), "cpus": os.cpu_count(), "filesystem": filesystem_of(work)},
        "data": {"bytes_per_process": args.size_mb * MiB, "buffer_mb": args.buffer_mb},
        "method": PAGE_CACHE_METHOD,
        "spread": {
            **{f"{name}_{key}": spread([c[key] for c in cycles[name]]) for name in names for key in measures},
            **{f"{name}_restore_gbps": spread([c["restore_gbps"] for c in cycles[name]]) for name in names},
            **{f"{key}_ratio": spread(values) for key, values in ratios.items()},
            "cached_read_gbps": spread([c["cached_read_gbps"] for c in cycles["cached"]]),
            "cached_restore_of_cached_read": spread(of_floor),
        },
        "repetitions": [
            {"direct": d, "cached": c} for d, c in zip(cycles["direct"], cycles["cached"], strict=True)
        ],
        "targets": targets_doc,
        "all_pass": all(t["pass"] for t in targets_doc),
        "seconds": time.perf_counter() - run_started,
    }
    print_page_cache_table(document)
    return emit(document, args.json_out)


def print_page_cache_table(doc: dict[str, Any]) -> None:
    data, spreads = doc["data"], doc["spread"]
    print(
        f"bench-store --page-cache: {data['bytes_per_process'] / MiB:.0f} MiB, "
        f"--buffer-mb {data['buffer_mb']}, {doc['machine']['filesystem']}, "
        f"{doc['machine']['cpus']} CPUs, {len(doc['repetitions'])} repetitions"
    )
    print(f"method: {doc['method']}.")
    print()
    print(f"{'':<24} {'--io-mode direct':>20} {'auto (page cache)':>20} {'auto / direct':>20}")
    for label, key in (("wake (wall), s", "wake_wall"), ("  its restore step, s", "restore")):
        cells = [spreads[f"direct_{key}"], spreads[f"cached_{key}"], spreads[f"{key}_ratio"]]
        print(
            f"{label:<24} " + " ".join(f"{c['median']:>6.3f} ({c['min']:.3f}-{c['max']:.3f})" for c in cells)
        )
    cells = [spreads["direct_restore_gbps"], spreads["cached_restore_gbps"]]
    print(
        f"{'  restore GB/s':<24} "
        + " ".join(f"{c['median']:>6.2f} ({c['min']:.2f}-{c['max']:.2f})" for c in cells)
    )
    floor, share = spreads["cached_read_gbps"], spreads["cached_restore_of_cached_read"]
    print(
        f"a buffered read of the cached files into fresh memory: {floor['median']:.2f} GB/s "
        f"({floor['min']:.2f}-{floor['max']:.2f}); the page-cache restore {share['median']:.2f}x of it "
        f"({share['min']:.2f}-{share['max']:.2f})"
    )
    print()
    for target in doc["targets"]:
        print(f"{'PASS' if target['pass'] else 'FAIL'}  {target['target']}")
    print(f"\nwhole run {doc['seconds']:.1f} s")


# -- an address-preserving pool (--pools) ------------------------------------------


POOLS_METHOD = (
    "the tensors are copied into torch_memory_saver allocations (its stand-in over host memory: each "
    "allocation a fixed address range, paused by unmapping it and resumed at the same address, as on a "
    "GPU) and hibernate's pool for them (TmsPool) spills and restores them through the store, its bytes "
    "copied through the host device seam as a GPU's would be through CUDA copies; each repetition runs a "
    "raw O_DIRECT write, the pool's spill and the tensor pool's spill of the same tensors, each "
    "repetition starting with the next of the three (over three repetitions each runs first, second and "
    "third once), then the same with a raw read and the two restores; each restore releases its memory "
    "first (the pool's: the tag paused) and brings it back inside the timing (resumed, or reallocated), "
    "as a wake does; the pool's restore is judged on the store's read that follows the resume, since the "
    "stand-in's resume faults in and fills every page on the host where a GPU's map touches nothing, and "
    "shown with it too; every spill goes to a fresh directory; ratios are the medians of the paired "
    "ratios. torch_memory_saver's own CPU and disk backups need a GPU: scripts/gpu-check's pools section "
    "measures them beside hibernate's pool"
)


def in_turn(
    raw: Callable[[], float], pool: Callable[[], Transfer], plain: Callable[[], Transfer], rep: int
) -> tuple[float, Transfer, Transfer]:
    """The three measurements, starting with a different one each repetition (in three repetitions
    each takes the first, second and third place once: a disk that writes faster after a pause, or
    slower after a long write, favours none); returns (raw seconds, the pool's, the tensor pool's)."""
    steps: list[tuple[str, Callable[[], Any]]] = [("raw", raw), ("pool", pool), ("plain", plain)]
    results: dict[str, Any] = {}
    for turn in range(len(steps)):
        name, step = steps[(rep + turn) % len(steps)]
        results[name] = step()
    return results["raw"], results["pool"], results["plain"]


def run_pools(args: argparse.Namespace, work: Path, run_started: float) -> int:
    """--pools: a hibernate.pool() spills and restores at the store's speed, not the provider's.

    The provider is torch_memory_saver's stand-in (tests/standins/tms.py):
    hibernate's pool drives it as it drives the real package, and moves every
    byte through the store; only the device copies are host copies here.
    """
    from hibernate.pools.tms import TmsProvider
    from tests.standins import tms as standin_tms
    from tests.standins.vllm_memory import HostDeviceMemory

    tensors = make_tensors(args.size_mb * MiB, args.tensors)
    reference = digest(tensors)
    options = WriteOptions(buffer_bytes=args.buffer_mb * MiB, chunk_bytes=args.chunk_mb * MiB)
    reps: list[dict[str, Any]] = []
    with standin_tms.installed() as module:
        world = module.standin
        provider = TmsProvider(
            saver=module,
            segments=world.memory_snapshot,
            copies=lambda: HostDeviceMemory(world.reservations),
            free_bytes=world.free_bytes,
            device=lambda: world.current_device,
        )
        provider.declare("weights", True)
        with provider.region("weights"):
            pooled = {name: tensor.clone() for name, tensor in tensors.items()}
        pool = Hibernate(work / "pool", provider.pool(), options)
        plain = Hibernate(work / "tensors", tensor_pool(tensors), options)
        limits = RawLimits(work / "raw.bin", pool.total - pool.total % SIMPLE_REQUEST, options)
        try:
            for rep in range(args.reps):
                pool.fresh()
                plain.fresh()
                raw_write, pool_spill, plain_spill = in_turn(
                    lambda: sampled(limits.write.write), pool.spill, plain.spill, rep
                )
                raw_read, pool_restore, plain_restore = in_turn(
                    lambda: sampled(limits.read.read), pool.restore, plain.restore, rep
                )
                if digest(pooled) != reference or digest(tensors) != reference:
                    raise SystemExit("a restore returned different bytes")
                raw_write_gbps = gbps(limits.total, raw_write)
                raw_read_gbps = gbps(limits.total, raw_read)
                figures = {
                    "raw_write_gbps": raw_write_gbps,
                    "raw_read_gbps": raw_read_gbps,
                    "pool_spill_gbps": gbps(pool.total, pool_spill.seconds),
                    # The store's part of the pool's restore: what follows the provider's resume. The
                    # stand-in's resume faults in and poison-fills every page on the host, which a GPU's
                    # map does not; the whole restore is shown beside it.
                    "pool_restore_gbps": gbps(pool.total, pool_restore.seconds - pool_restore.map_seconds),
                    "pool_wake_gbps": gbps(pool.total, pool_restore.seconds),
                    "pool_resume_seconds": pool_restore.map_seconds,
                    "tensor_spill_gbps": gbps(plain.total, plain_spill.seconds),
                    "tensor_restore_gbps": gbps(plain.total, plain_restore.seconds),
                }
                figures.update(
                    {
                        "pool_spill_ratio": figures["pool_spill_gbps"] / raw_write_gbps,
                        "pool_restore_ratio": figures["pool_restore_gbps"] / raw_read_gbps,
                        "pool_wake_ratio": figures["pool_wake_gbps"] / raw_read_gbps,
                        "tensor_spill_ratio": figures["tensor_spill_gbps"] / raw_write_gbps,
                        "tensor_restore_ratio": figures["tensor_restore_gbps"] / raw_read_gbps,
                        "pool_spill_of_tensor": figures["pool_spill_gbps"] / figures["tensor_spill_gbps"],
                        "pool_restore_of_tensor": figures["pool_restore_gbps"]
                        / figures["tensor_restore_gbps"],
                        "pool_spill_extra_rss": pool_spill.rss_growth,
                        "pool_restore_extra_rss": pool_restore.rss_growth,
                    }
                )
                reps.append(figures)
        finally:
            pool.fresh()
            plain.fresh()
            limits.close()
            del pooled
        segments = len(pool.regions)
        pool_bytes = pool.total
    spreads = {key: spread([r[key] for r in reps]) for key in POOL_SPREAD_KEYS}
    judged = [
        ("pool spill >= 0.90x the tensor pool's spill", spreads["pool_spill_of_tensor"]["median"]),
        ("pool restore (the store's read) >= 0.90x the tensor pool's restore",
         spreads["pool_restore_of_tensor"]["median"]),
    ]  # fmt: skip
    shown = [
        ("pool spill >= 0.90x raw O_DIRECT write", spreads["pool_spill_ratio"]["median"]),
        (
            "pool restore (the store's read) >= 0.90x raw O_DIRECT read",
            spreads["pool_restore_ratio"]["median"],
        ),
        (
            "pool restore with the stand-in's resume >= 0.90x raw O_DIRECT read",
            spreads["pool_wake_ratio"]["median"],
        ),
    ]
    targets = [
        {"target": name, "value": value, "limit": TARGET_THROUGHPUT, "pass": value >= TARGET_THROUGHPUT,
         "judged": index < len(judged)}
        for index, (name, value) in enumerate(judged + shown)
    ]  # fmt: skip
    document = {
        "machine": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "directory": str(work.parent),
            "filesystem": filesystem_of(work),
            "torch": torch.__version__,
        },
        "data": {
            "bytes": sum(t.nbytes for t in tensors.values()),
            "tensors": len(tensors),
            "dtype": "bfloat16",
            "pool_bytes": pool_bytes,
            "pool_allocations": segments,
        },
        "hibernate_options": {
            "buffer_bytes": options.buffer_bytes,
            "chunk_bytes": options.effective_chunk_bytes,
            "write_request_bytes": limits.write.request,
            "read_request_bytes": limits.read.request,
        },
        "method": POOLS_METHOD,
        "spread": spreads,
        "repetitions": reps,
        "targets": targets,
        "all_pass": all(t["pass"] for t in targets if t["judged"]),
        "seconds": time.perf_counter() - run_started,
    }
    print_pools_table(document)
    return emit(document, args.json_out)


POOL_SPREAD_KEYS = [
    "raw_write_gbps",
    "raw_read_gbps",
    "pool_spill_gbps",
    "pool_restore_gbps",
    "pool_wake_gbps",
    "pool_resume_seconds",
    "tensor_spill_gbps",
    "tensor_restore_gbps",
    "pool_spill_ratio",
    "pool_restore_ratio",
    "pool_wake_ratio",
    "tensor_spill_ratio",
    "tensor_restore_ratio",
    "pool_spill_of_tensor",
    "pool_restore_of_tensor",
]


def print_pools_table(doc: dict[str, Any]) -> None:
    data, spreads, options = doc["data"], doc["spread"], doc["hibernate_options"]
    print(
        f"bench-store --pools: {data['bytes'] / MiB:.0f} MiB of {data['dtype']} in {data['tensors']} tensors "
        f"({data['pool_bytes'] / MiB:.0f} MiB in {data['pool_allocations']} torch_memory_saver allocations), "
        f"{doc['machine']['filesystem']} at {doc['machine']['directory']}, {doc['machine']['cpus']} CPUs, "
        f"{len(doc['repetitions'])} repetitions"
    )
    print(f"method: {doc['method']}.")
    print()

    def cell(key: str | None) -> str:
        if key is None:
            return ""
        s = spreads[key]
        return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"

    write_mib, read_mib = options["write_request_bytes"] // MiB, options["read_request_bytes"] // MiB
    rows = [
        (f"raw O_DIRECT write, {write_mib} MiB requests (the limit)", "raw_write_gbps", None, None),
        ("hibernate spill, tensor pool", "tensor_spill_gbps", "tensor_spill_ratio", None),
        (
            "hibernate spill, torch_memory_saver pool",
            "pool_spill_gbps",
            "pool_spill_ratio",
            "pool_spill_of_tensor",
        ),
        (f"raw O_DIRECT read, {read_mib} MiB requests (the limit)", "raw_read_gbps", None, None),
        ("hibernate restore, tensor pool", "tensor_restore_gbps", "tensor_restore_ratio", None),
        (
            "hibernate restore, torch_memory_saver pool: the store's read",
            "pool_restore_gbps",
            "pool_restore_ratio",
            "pool_restore_of_tensor",
        ),
        ("  ... with the stand-in's resume before it", "pool_wake_gbps", "pool_wake_ratio", None),
    ]
    width = max(len(row[0]) for row in rows)
    print(f"{'path':<{width}}  {'GB/s median (range)':>19}  {'x raw':>17}  {'x tensor pool':>17}")
    for name, speed, raw, plain in rows:
        print(f"{name:<{width}}  {cell(speed):>19}  {cell(raw):>17}  {cell(plain):>17}")
    resume = spreads["pool_resume_seconds"]
    print(
        f"the stand-in's resume (maps every allocation back and fills its pages on the host): "
        f"{resume['median']:.2f} s ({resume['min']:.2f}-{resume['max']:.2f})"
    )
    print()
    for target in doc["targets"]:
        verdict = ("PASS" if target["pass"] else "FAIL") if target["judged"] else "info"
        print(f"{verdict}  {target['target']}: {target['value']:.2f} (limit {target['limit']:.2f})")
    print(f"\nwhole run {doc['seconds']:.1f} s")


PROCS_METHOD = (
    "N demo targets (python -m hibernate.demo serve) share the bytes; each repetition runs `hibernate sleep "
    "PID...` and `hibernate wake PID...` through the CLI, each between two raw O_DIRECT writes or reads of "
    "the same number of bytes, which of them goes first alternating: the limit, shaped as one process's "
    "transfer with the whole budget (judged), and N writers or readers at once, each with its own file and "
    "the requests of its process's share of the budget (for scale); "
    "aggregate throughput is all processes' bytes over the operation's whole time as its report gives it "
    "(connect, quiesce, transfers, release, journal); the page cache is evicted before every wake; "
    "hibernate's modules keep their bytecode between commands, as an installed copy does"
)


def print_processes_table(doc: dict[str, Any]) -> None:
    data, staging, spreads = doc["data"], doc["staging"], doc["spread"]
    print(
        f"bench-store --procs {data['processes']}: {data['bytes_per_process'] / MiB:.0f} MiB each, "
        f"{doc['machine']['filesystem']}, {doc['machine']['cpus']} CPUs, "
        f"{len(doc['repetitions'])} repetitions"
    )
    print(f"method: {doc['method']}.")
    print(
        f"staging: --buffer-mb {staging['budget_bytes'] / MiB:.0f} shared: "
        f"{staging['each_bytes'] / MiB:.0f} MiB each, {staging['at_once']} processes at once"
    )
    print()
    requests = doc["share_requests"]
    write_mib, read_mib = requests["write_bytes"] // MiB, requests["read_bytes"] // MiB
    at_once = staging["at_once"]
    for label, key in (
        ("raw O_DIRECT write (the limit)", "raw_write_gbps"),
        (f"raw, {at_once} writers of {write_mib} MiB requests", "shares_write_gbps"),
        ("hibernate sleep, all processes", "sleep_gbps"),
        ("  x raw", "sleep_ratio"),
        (f"  x {at_once} writers (for scale)", "sleep_shares_ratio"),
        ("raw O_DIRECT read (the limit)", "raw_read_gbps"),
        (f"raw, {at_once} readers of {read_mib} MiB requests", "shares_read_gbps"),
        ("hibernate wake, all processes", "wake_gbps"),
        ("  x raw", "wake_ratio"),
        (f"  x {at_once} readers (for scale)", "wake_shares_ratio"),
    ):
        s = spreads[key]
        print(f"{label:<34} {s['median']:>6.2f} ({s['min']:.2f}-{s['max']:.2f})")
    print()
    for n, rep in enumerate(doc["repetitions"]):
        spills = " ".join(f"{t:.2f}" for t in rep["spill_seconds"])
        restores = " ".join(f"{t:.2f}" for t in rep["restore_seconds"])
        print(f"repetition {n + 1}: per-process spill s [{spills}], restore s [{restores}]")
    print()
    for target in doc["targets"]:
        verdict = "PASS" if target["pass"] else "FAIL"
        print(f"{verdict}  {target['target']}: {target['value']:.2f} (limit {target['limit']:.2f})")
    print(f"\nwhole run {doc['seconds']:.1f} s")


def emit(document: dict[str, Any], json_out: Path | None) -> int:
    """Print the JSON document after the table (and write it to ``json_out``); the exit status."""
    text = json.dumps(document, indent=1)
    print("\nJSON:")
    print(text)
    if json_out:
        json_out.write_text(text + "\n")
    return 0 if document["all_pass"] else 1


# Reported with their spread (min, median, max over the repetitions) as well as their median.
SPREAD_KEYS = [
    "raw_write_gbps",
    "raw_read_gbps",
    "simple_write_gbps",
    "simple_read_gbps",
    "fresh_read_gbps",
    "spill_gbps",
    "restore_gbps",
    "spill_ratio",
    "restore_ratio",
    "spill_simple_ratio",
    "restore_simple_ratio",
    "restore_fresh_ratio",
    "second_spill_speedup",
    "unchecked_spill_speedup",
    "second_spill_limit_ratio",
    "adopt_gbps",
    "adopt_ratio",
]
MEDIAN_ONLY_KEYS = [
    "spill_seconds",
    "second_spill_seconds",
    "unchecked_spill_seconds",
    "check_read_seconds",
    "check_hash_seconds",
    "spill_overhead_us_per_tensor",
    "restore_overhead_us_per_tensor",
    "second_spill_us_per_tensor",
    "unchecked_spill_us_per_tensor",
]


def spread(values: list[float]) -> dict[str, float]:
    """The lowest, median and highest of one figure over the repetitions."""
    return {"min": min(values), "median": float(statistics.median(values)), "max": max(values)}


class RawLimits:
    """The raw O_DIRECT runs each repetition measures, all over one file of ``total`` bytes.

    ``write`` and ``read`` are shaped as hibernate's own transfers (its request
    sizes, its staging pages, one request in flight as its one I/O thread
    keeps), so "x raw" says what this disk can do with the same requests;
    ``simple_*`` are the plain loop of 64 MiB requests from a small-page
    buffer, reported beside them; ``fresh_read`` reads into newly allocated
    memory of the whole size, the limit of a wake.
    """

    def __init__(self, path: Path, total: int, options: WriteOptions) -> None:
        self.total = total
        # The writer's and the reader's own sizing, for this many bytes.
        write_request = arena_bytes_for(options.buffer_bytes, total, options.effective_chunk_bytes)
        read_request = read_request_bytes(write_request, options.effective_chunk_bytes)
        self.write = Raw(path, total, write_request)
        self.read = Raw(path, total, read_request, huge=True)
        self.simple_write = Raw(path, total, SIMPLE_REQUEST)
        self.simple_read = Raw(path, total, SIMPLE_REQUEST)
        self.fresh_read = Raw(path, total, read_request, fresh=True)

    def close(self) -> None:
        self.write.close()


# A raw transfer that calls its argument once its buffer is allocated, before its timing starts.
RawTransfer = Callable[[Callable[[], object] | None], float]


class RawShares:
    """The same bytes split among ``count`` writers or readers at once, each with its own file and
    the requests its share of the staging budget gives hibernate's process (``at_once`` of them
    move together, as the CLI lets them): what this disk does with the transfers of a
    multi-process sleep or wake. Shown beside the one-transfer limit, which is what is judged.
    """

    def __init__(self, work: Path, total: int, count: int, share: StagingShare, chunk_bytes: int) -> None:
        each = total // count // MiB * MiB  # whole MiB: every O_DIRECT request stays aligned
        write_request = arena_bytes_for(share.buffer_mb * MiB, each, chunk_bytes)
        read_request = read_request_bytes(write_request, chunk_bytes)
        paths = [work / f"raw-share-{n}.bin" for n in range(count)]
        self.total = each * count
        self.at_once = share.at_once
        self.write_request, self.read_request = write_request, read_request
        self.writers = [Raw(path, each, write_request) for path in paths]
        self.readers = [Raw(path, each, read_request, huge=True) for path in paths]

    def write(self) -> float:
        return self._waves([raw.write for raw in self.writers])

    def read(self) -> float:
        return self._waves([raw.read for raw in self.readers])

    def _waves(self, transfers: list[RawTransfer]) -> float:
        """Seconds for all of them, ``at_once`` at a time."""
        waves = range(0, len(transfers), self.at_once)
        return sum(self._wave(transfers[start : start + self.at_once]) for start in waves)

    @staticmethod
    def _wave(wave: list[RawTransfer]) -> float:
        """From when every buffer of the wave is allocated to when its slowest transfer ends."""
        ready = threading.Barrier(len(wave))
        times: list[float] = []
        failures: list[BaseException] = []

        def run(transfer: RawTransfer) -> None:
            try:
                times.append(transfer(ready.wait))
            except BaseException as exc:  # reported below, on the calling thread
                failures.append(exc)
                ready.abort()

        threads = [threading.Thread(target=run, args=(transfer,)) for transfer in wave]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        return max(times)

    def close(self) -> None:
        for raw in self.writers:
            raw.close()


METHOD = (
    "each repetition pairs a raw O_DIRECT write with a hibernate spill and a raw O_DIRECT read with a "
    "hibernate restore, back to back, in alternating order; the raw runs are shaped as hibernate's own "
    "transfers (same request sizes, same kind of staging pages, one request in flight), so each 'x raw' "
    "is the median of the paired ratios against what this disk does with the same requests; the plain "
    "64 MiB loop and a read into freshly allocated memory of the whole size (a wake's limit) run in the "
    "same repetition and are shown beside them, with the spread (lowest-highest) over repetitions. The "
    "page cache is evicted before every read. A restore first releases the tensors and then refills "
    "freshly allocated memory, faulting it in as part of the restore, as a wake does. Raw runs allocate "
    "their buffer anew each time, as hibernate allocates its staging. Baselines are each paired with one "
    "shaped raw run. The unchanged re-sleeps (checked, and with --skip-reuse-check, in alternating "
    "order) are each handed the previous spill's files and chunks, as an agent keeps those of the "
    "manifest its last wake read; the checked one is set beside the larger of a shaped raw read and a "
    "hash (as many threads as the stream's stagers) of the same bytes, measured right after it. An "
    "adoption: a child process builds the same tensors, sleeps and exits; this one zeroes its own, "
    "tracks them under the same name and adopts the snapshot (hibernate.adopt: finding it, pairing by "
    "name, reading and verifying), paired with a shaped raw read, once per repetition"
)


def print_table(doc: dict[str, Any]) -> None:
    m, spreads, data, options = doc["medians"], doc["spread"], doc["data"], doc["hibernate_options"]
    print(
        f"bench-store: {data['bytes'] / MiB:.0f} MiB of {data['dtype']} in {data['tensors']} tensors, "
        f"{doc['machine']['filesystem']} at {doc['machine']['directory']}, {doc['machine']['cpus']} CPUs, "
        f"{len(doc['repetitions'])} repetitions"
    )
    print(f"method: {doc['method']}.")
    print(
        f"hibernate: staging {options['buffer_bytes'] / MiB:.0f} MiB, "
        f"chunks of {options['chunk_bytes'] / MiB:.0f} MiB, "
        f"write requests of {options['write_request_bytes'] / MiB:.0f} MiB, "
        f"read requests of {options['read_request_bytes'] / MiB:.0f} MiB"
    )
    print()

    def shown(speed: str, ratio: str | None) -> tuple[str, str]:
        s = spreads[speed]
        speeds = f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"
        if ratio is None:
            return speeds, ""
        r = spreads[ratio]
        return speeds, f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f})"

    write_mib, read_mib = options["write_request_bytes"] // MiB, options["read_request_bytes"] // MiB
    rows: list[tuple[str, tuple[str, str]]] = [
        (f"raw O_DIRECT write, {write_mib} MiB requests (the limit)", shown("raw_write_gbps", None)),
        (
            f"raw O_DIRECT write, {SIMPLE_REQUEST // MiB} MiB loop (for scale)",
            shown("simple_write_gbps", None),
        ),
        ("hibernate spill", shown("spill_gbps", "spill_ratio")),
        ("  ... against the 64 MiB loop", ("", shown("spill_gbps", "spill_simple_ratio")[1])),
    ]
    for name, b in doc["baselines"].items():
        label = "torch.save + fsync" if name == "torch" else "safetensors save_file + fsync"
        rows.append((label, (f"{b['save_gbps']:.2f}", f"{b['save_ratio']:.2f}")))
    rows += [
        (f"raw O_DIRECT read, {read_mib} MiB requests, huge pages (the limit)", shown("raw_read_gbps", None)),
        (f"raw O_DIRECT read, {SIMPLE_REQUEST // MiB} MiB loop (for scale)", shown("simple_read_gbps", None)),
        (f"raw O_DIRECT read into fresh memory, {read_mib} MiB requests", shown("fresh_read_gbps", None)),
        ("hibernate restore (cold)", shown("restore_gbps", "restore_ratio")),
        ("  ... against the 64 MiB loop", ("", shown("restore_gbps", "restore_simple_ratio")[1])),
        ("  ... against the read into fresh memory", ("", shown("restore_gbps", "restore_fresh_ratio")[1])),
        ("hibernate.adopt by a new process (cold)", shown("adopt_gbps", "adopt_ratio")),
    ]
    for name, b in doc["baselines"].items():
        label = "torch.load (cold)" if name == "torch" else "safetensors load_file (cold)"
        rows.append((label, (f"{b['load_gbps']:.2f}", f"{b['load_ratio']:.2f}")))
    width = max(len(name) for name, _ in rows)
    print(f"{'path':<{width}}  {'GB/s median (range)':>19}  {'x raw median (range)':>20}")
    for name, (speed, ratio) in rows:
        print(f"{name:<{width}}  {speed:>19}  {ratio:>20}")
    w = doc["worst"]
    print()
    limit = max(m["check_read_seconds"], m["check_hash_seconds"])
    print(
        f"unchanged re-sleep, checked: {m['second_spill_seconds']:.3f} s "
        f"(first {m['spill_seconds']:.3f} s, {m['second_spill_speedup']:.1f}x faster; "
        f"{m['second_spill_limit_ratio']:.2f}x the larger of a raw read, {m['check_read_seconds']:.3f} s, "
        f"and a hash, {m['check_hash_seconds']:.3f} s, of the same bytes: {limit:.3f} s)"
    )
    print(
        f"unchanged re-sleep, --skip-reuse-check: {m['unchecked_spill_seconds']:.3f} s "
        f"(first {m['spill_seconds']:.3f} s, {m['unchecked_spill_speedup']:.1f}x faster)"
    )
    print(
        f"peak extra RSS (worst): spill {w['spill_extra_rss'] / MiB:.0f} MiB, "
        f"restore {w['restore_extra_rss'] / MiB:.0f} MiB, "
        f"checked re-sleep {w['second_spill_extra_rss'] / MiB:.0f} MiB"
    )
    print(
        f"page-cache growth (worst): spill {w['spill_cache_growth'] / MiB:.1f} MiB, "
        f"restore {w['restore_cache_growth'] / MiB:.1f} MiB, "
        f"checked re-sleep {w['second_spill_cache_growth'] / MiB:.1f} MiB"
    )
    if data["tensors"] > MANY_TENSORS:  # with a few large tensors it is the disk's drift over a count
        print(
            f"per tensor: spill {m['spill_overhead_us_per_tensor']:.1f} us, "
            f"restore {m['restore_overhead_us_per_tensor']:.1f} us beyond the raw transfer; "
            f"unchanged re-sleep {m['second_spill_us_per_tensor']:.1f} us in all checked, "
            f"{m['unchecked_spill_us_per_tensor']:.1f} us with --skip-reuse-check"
        )
    print()
    for target in doc["targets"]:
        value, limit = target["value"], target["limit"]
        text = (
            f"{value / MiB:.1f} MiB (limit {limit / MiB:.0f} MiB)"
            if limit > 1024
            else f"{value:.2f} (limit {limit:.2f})"
        )
        verdict = ("PASS" if target["pass"] else "FAIL") if target["judged"] else "info"
        print(f"{verdict}  {target['target']}: {text}")
    print(f"\nwhole run {doc['seconds']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
