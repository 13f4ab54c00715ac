"""Measure hibernate's sleep and wake on a latency-bound filesystem against raw transfers, in one run.

  scripts/bench-latency [--size-mb 512] [--delay-ms 2] [--reps 3] [--dir DIR] [--json-out FILE]

The filesystem is the test suite's stand-in (tests/standins/latencyfs.py): a FUSE
passthrough over a directory of DIR (default: TMPDIR) that sleeps ``--delay-ms``
before serving each read and write request, serves requests on many threads, and
caps them at 1 MiB. There throughput comes only from requests in flight at once:
what a network or parallel filesystem asks of a reader and a writer.

Each repetition measures, on one mount:

- raw reads of the same N MiB file with ``O_DIRECT``: one thread with one 1 MiB
  ``pread`` in flight, and 8 threads each with one 1 MiB positional ``pread``
  in flight (the limit a wake is judged against);
- raw writes of N MiB with ``O_DIRECT``: one thread writing 1 MiB ``pwrite``s to
  one file, and 8 threads each writing 1 MiB ``pwrite``s to a file of its own
  (N/8 MiB each; the kernel lets one ``write`` call into a FUSE file at a time,
  so eight writers of one file would have one request in flight), each file then
  fsynced (the limit a sleep is judged against);
- the real commands on a live demo target of N MiB of weights
  (``python -m hibernate.demo serve``): ``hibernate sleep PID --to DIR --json``
  to a fresh directory on the mount (so nothing is reused from the previous
  repetition), then ``hibernate wake PID --json``. A wake's rate is its
  ``restored_bytes`` over its ``restore`` step; a sleep's its ``written_bytes``
  over its ``spill`` step (docs/json-schema); the commands' wall times (their
  start-up included) are shown beside them.

Every raw 8-in-flight transfer is paired with the hibernate step it judges, in
alternating order, and the ratio reported is the median of the per-repetition
ratios with their lowest and highest. Before every read the page cache is
dropped (``echo 3 > /proc/sys/vm/drop_caches``, where this user may; the header
says whether it could) and the backing files are evicted (POSIX_FADV_DONTNEED)
in any case. For each step the filesystem's own counts are shown: the most
requests it served at once and the largest request, and the CPU time its
server took per GiB moved (it shares the machine's cores with what it serves),
and beside it the CPU time the client took per GiB: this process's for a raw
transfer (its threads issue the requests), the target's for a sleep or a wake
(where its agent stages, hashes, verifies, copies and faults memory in; the
command's own start-up is not beside the step, and is not counted).

Targets: a wake at 0.80x or more of the raw read with 8 requests in flight, and a
sleep at 0.80x or more of the raw write with 8. Prints a header, a table and the
targets (PASS/FAIL); exits 1 if a target fails.
"""

from __future__ import annotations

import argparse
import contextlib
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # the project root: the stand-in lives under tests/

from host import drop_caches, filesystem_of  # noqa: E402  (beside this script)

from tests.standins.latencyfs import DIRECT_IO_MODES, MAX_REQUEST, Server, unavailable  # noqa: E402

MiB = 1 << 20
REQUEST = MiB
IN_FLIGHT = 8
TARGET = 0.80
DEMO_START_TIMEOUT_S = 600.0


class BenchError(Exception):
    """The run could not measure (exit status 2, where 1 is a target not met)."""


# -- the raw transfers ---------------------------------------------------------------------------------


def aligned(size: int) -> mmap.mmap:
    """A page-aligned buffer of ``size`` bytes, faulted in (O_DIRECT needs the alignment)."""
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    return buffer


def fill(buffer: mmap.mmap, seed: int) -> None:
    """Distinct bytes in every MiB of ``buffer`` (cheap, not compressible by accident)."""
    block = os.urandom(REQUEST)
    for offset in range(0, len(buffer), REQUEST):
        buffer[offset : offset + REQUEST] = block
        buffer[offset : offset + 16] = (offset + seed).to_bytes(16, "little")


def fan_out(threads: int, work: Callable[[int], None]) -> None:
    """Run ``work(index)`` on ``threads`` threads; re-raise the first failure."""
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            work(index)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    if errors:
        raise errors[0]


def raw_read(path: Path, buffer: mmap.mmap, threads: int) -> float:
    """Seconds to read ``path`` whole into ``buffer``: ``threads`` threads, each one 1 MiB pread in flight."""
    view = memoryview(buffer)
    size = len(buffer)
    next_offset = iter(range(0, size, REQUEST))
    lock = threading.Lock()
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)

    def work(index: int) -> None:
        while True:
            with lock:
                offset = next(next_offset, None)
            if offset is None:
                return
            length = min(REQUEST, size - offset)
            if os.preadv(fd, [view[offset : offset + length]], offset) != length:
                raise OSError(f"short read of {path} at {offset}")

    try:
        started = time.perf_counter()
        fan_out(threads, work)
        return time.perf_counter() - started
    finally:
        os.close(fd)
        view.release()


def raw_write(paths: list[Path], buffer: mmap.mmap) -> float:
    """Seconds to write ``buffer`` split evenly over ``paths``: a thread each, 1 MiB pwrites, then fsync."""
    view = memoryview(buffer)
    share = len(buffer) // len(paths)

    def work(index: int) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT | os.O_CLOEXEC
        fd = os.open(paths[index], flags, 0o600)
        try:
            base = index * share
            for offset in range(0, share, REQUEST):
                length = min(REQUEST, share - offset)
                if os.pwritev(fd, [view[base + offset : base + offset + length]], offset) != length:
                    raise OSError(f"short write of {paths[index]}")
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        started = time.perf_counter()
        fan_out(len(paths), work)
        return time.perf_counter() - started
    finally:
        view.release()


# -- the page cache ------------------------------------------------------------------------------------


def evict(directory: Path) -> None:
    """Drop every file under ``directory`` (the backing files) from the page cache."""
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


# -- the real commands ---------------------------------------------------------------------------------


class Demo:
    """A live demo target of ``size_mb`` MiB of weights, and the CLI run against it."""

    def __init__(self, sockets: Path, size_mb: int, env: dict[str, str]) -> None:
        self.env = env
        control, ready, self.log = sockets / "demo.sock", sockets / "demo.ready", sockets / "demo.log"
        argv = [
            sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve", "--size-mb", str(size_mb),
            "--control", str(control), "--ready-file", str(ready),
        ]  # fmt: skip
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + DEMO_START_TIMEOUT_S
        while not ready.exists() or not ready.read_text().strip():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise BenchError(
                    f"the demo target did not start: {self.log.read_text(errors='replace')[-2000:]}"
                )
            time.sleep(0.05)
        self.info = json.loads(ready.read_text())
        self.pid = int(self.info["pid"])

    def hibernate(self, *argv: str) -> tuple[dict[str, Any], float]:
        """Run ``hibernate ARGV --json``: its report and its wall time."""
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "hibernate", *argv, "--json"],
            cwd=REPO,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        wall = time.perf_counter() - started
        if done.returncode != 0:
            raise BenchError(
                f"hibernate {' '.join(argv)} failed ({done.returncode}): {done.stdout}{done.stderr}"
            )
        report: dict[str, Any] = json.loads(done.stdout)
        return report, wall

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


# -- one run -------------------------------------------------------------------------------------------


@dataclass
class Step:
    """One kind of measured step over the repetitions: its rates, wall times and the filesystem's counts."""

    name: str
    rates: list[float] = field(default_factory=list)  # bytes per second
    walls: list[float] = field(default_factory=list)  # seconds, for the commands
    in_flight: list[int] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)  # the filesystem's CPU seconds per GiB moved
    client_cpu: list[float] = field(default_factory=list)  # the client's (see the module's doc), the same
    largest: list[int] = field(default_factory=list)

    def add(
        self, nbytes: int, seconds: float, stats: dict[str, Any], kind: str, wall: float | None = None
    ) -> float:
        rate = nbytes / seconds
        self.rates.append(rate)
        if wall is not None:
            self.walls.append(wall)
        self.in_flight.append(int(stats[f"in_flight_max_{kind}"]))
        self.largest.append(int(stats[f"largest_{kind}"]))
        self.server_cpu.append(stats["cpu_seconds"] / (nbytes / (1 << 30)))
        self.client_cpu.append(stats["client_cpu_seconds"] / (nbytes / (1 << 30)))
        return rate


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


@contextlib.contextmanager
def measured(server: Server, client: int) -> Iterator[dict[str, Any]]:
    """The filesystem's counts of the block's requests, and the CPU time its server and process
    ``client`` took meanwhile.

    The dict yielded is filled when the block ends.
    """
    taken: dict[str, Any] = {}
    server.reset()
    before, client_before = cpu_seconds(server.process.pid), cpu_seconds(client)
    yield taken
    taken.update(
        server.stats(),
        cpu_seconds=cpu_seconds(server.process.pid) - before,
        client_cpu_seconds=cpu_seconds(client) - client_before,
    )


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process ``pid`` has taken (all its threads)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(args: argparse.Namespace, work: Path, sockets: Path) -> int:
    """Measure in ``work`` (the backing files, the mount); ``sockets``: a short path for Unix sockets."""
    nbytes = args.size_mb * MiB
    if nbytes < IN_FLIGHT * REQUEST or nbytes % (IN_FLIGHT * REQUEST):
        raise BenchError(f"--size-mb must be a multiple of {IN_FLIGHT}")
    server = Server(
        work / "backing",
        work / "mount",
        delay_ms=args.delay_ms,
        direct_io=args.direct_io,
        log=work / "fs.log",
    )
    runtime = sockets / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HIBERNATE_RUNTIME_DIR": str(runtime)}
    demo: Demo | None = None
    steps = {
        key: Step(key)
        for key in ("read_1", "read_8", "write_1", "write_8", "wake", "sleep")
    }  # fmt: skip
    ratios: dict[str, list[float]] = {"wake": [], "sleep": []}
    dropped: list[bool] = []
    reused: list[int] = []
    io_modes: set[str] = set()
    buffer = aligned(nbytes)
    fill(buffer, seed=1)
    mount = server.mountpoint

    def cold() -> None:
        dropped.append(drop_caches() if args.drop_caches else False)
        evict(server.backing)

    try:
        print(f"starting the demo target ({args.size_mb} MiB of weights) ...", file=sys.stderr, flush=True)
        demo = target = Demo(sockets, args.size_mb, env)
        single = mount / "raw-one.bin"
        for rep in range(args.reps):
            print(f"repetition {rep + 1} of {args.reps} ...", file=sys.stderr, flush=True)
            swap = rep % 2 == 1
            # -- writes: the raw ones, then the sleep (or the other way round) --
            with measured(server, os.getpid()) as taken:
                seconds = raw_write([single], buffer)
            steps["write_1"].add(nbytes, seconds, taken, "write")

            def raw_write_8() -> float:
                with measured(server, os.getpid()) as taken:
                    seconds = raw_write([mount / f"raw-{i}.bin" for i in range(IN_FLIGHT)], buffer)
                return steps["write_8"].add(nbytes, seconds, taken, "write")

            def sleep(rep: int = rep) -> float:
                with measured(server, target.pid) as taken:
                    report, wall = target.hibernate(
                        "sleep", str(target.pid), "--to", str(mount / f"snap-{rep}")
                    )
                process = report["processes"][0]
                io_modes.add(process["io_mode"])
                reused.append(int(process["reused_bytes"]))
                return steps["sleep"].add(
                    int(process["written_bytes"]), process["phases"]["spill"], taken, "write", wall
                )

            first, second = (sleep, raw_write_8) if swap else (raw_write_8, sleep)
            a, b = first(), second()
            sleep_rate, write_rate = (a, b) if swap else (b, a)
            ratios["sleep"].append(sleep_rate / write_rate)

            # -- reads: cold, the raw ones, then the wake (or the other way round) --
            cold()
            with measured(server, os.getpid()) as taken:
                seconds = raw_read(single, buffer, threads=1)
            steps["read_1"].add(nbytes, seconds, taken, "read")

            def raw_read_8() -> float:
                cold()
                with measured(server, os.getpid()) as taken:
                    seconds = raw_read(single, buffer, threads=IN_FLIGHT)
                return steps["read_8"].add(nbytes, seconds, taken, "read")

            def wake() -> float:
                cold()
                with measured(server, target.pid) as taken:
                    report, wall = target.hibernate("wake", str(target.pid))
                process = report["processes"][0]
                io_modes.add(process["io_mode"])
                return steps["wake"].add(
                    int(process["restored_bytes"]), process["phases"]["restore"], taken, "read", wall
                )

            first, second = (wake, raw_read_8) if swap else (raw_read_8, wake)
            a, b = first(), second()
            wake_rate, read_rate = (a, b) if swap else (b, a)
            ratios["wake"].append(wake_rate / read_rate)
            if rep > 0:  # the previous snapshot goes: the disk holds at most two
                shutil.rmtree(server.backing / f"snap-{rep - 1}", ignore_errors=True)
    finally:
        if demo is not None:
            demo.close()
        server.close()
        buffer.close()

    document = {
        "machine": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
            "backing_filesystem": filesystem_of(work),
        },
        "filesystem": {
            "kind": "latencyfs (tests/standins/latencyfs.py), FUSE over libfuse3",
            "delay_ms": args.delay_ms,
            "direct_io": args.direct_io,
            "max_request": MAX_REQUEST,
        },
        "options": {"size_mb": args.size_mb, "reps": args.reps, "in_flight": IN_FLIGHT},
        "page_cache_dropped": all(dropped) if dropped else False,
        "io_modes": sorted(io_modes),
        "reused_bytes": reused,
        "steps": {
            key: {
                "rate": spread(step.rates),
                "wall": spread(step.walls) if step.walls else None,
                "in_flight_max": max(step.in_flight),
                "largest_request": max(step.largest),
                "server_cpu_s_per_gib": statistics.median(step.server_cpu),
                "client_cpu_s_per_gib": statistics.median(step.client_cpu),
            }
            for key, step in steps.items()
        },
        "ratios": {key: spread(values) for key, values in ratios.items()},
        "target": TARGET,
    }
    return report(document, args.json_out)


def mbps(rate: float) -> str:
    return f"{rate / 1e6:7.0f} MB/s"


def report(doc: dict[str, Any], json_out: Path | None) -> int:
    machine, fs, options = doc["machine"], doc["filesystem"], doc["options"]
    load = ", ".join(f"{x:.1f}" for x in machine["load_average"])
    print(f"machine:     Linux {machine['kernel']}, {machine['cpus']} CPUs, load average {load}")
    print(
        f"filesystem:  latencyfs over {machine['backing_filesystem']}: {fs['delay_ms']:g} ms per read and "
        f"write request, requests of at most {fs['max_request'] // MiB} MiB, "
        f"FOPEN_DIRECT_IO: {fs['direct_io']}"
    )
    print(
        f"options:     {options['size_mb']} MiB, {options['reps']} repetitions, hibernate's io mode: "
        f"{', '.join(doc['io_modes']) or '?'}"
    )
    cache = (
        "dropped before every read" if doc["page_cache_dropped"] else "NOT dropped (not root?): evicted only"
    )
    print(f"page cache:  {cache}")
    if max(doc["reused_bytes"]) > options["size_mb"] * MiB // 100:
        print(f"warning:     a sleep reused bytes it did not write (not measured): {doc['reused_bytes']}")
    print()
    names = {
        "read_1": "raw read, 1 x 1 MiB in flight",
        "read_8": f"raw read, {IN_FLIGHT} x 1 MiB in flight",
        "wake": "wake: restore step",
        "write_1": "raw write, 1 x 1 MiB in flight",
        "write_8": f"raw write, {IN_FLIGHT} x 1 MiB in flight",
        "sleep": "sleep: spill step",
    }
    print(
        f"{'step':34s} {'median':>12s} {'range':>21s}  {'in flight':>9s}  {'largest':>9s}  {'fs CPU':>10s}"
        f"  {'client CPU':>10s}  command wall"
    )
    for key, name in names.items():
        step = doc["steps"][key]
        rate = step["rate"]
        wall = step["wall"]
        shown_wall = f"{wall['median']:.2f} s ({wall['min']:.2f}-{wall['max']:.2f})" if wall else ""
        print(
            f"{name:34s} {mbps(rate['median']):>12s} {rate['min'] / 1e6:9.0f}-{rate['max'] / 1e6:<6.0f} MB/s"
            f"  {step['in_flight_max']:>9d}  {step['largest_request'] // 1024:>5d} KiB"
            f"  {step['server_cpu_s_per_gib']:>4.2f} s/GiB  {step['client_cpu_s_per_gib']:>6.2f} s/GiB"
            f"  {shown_wall}"
        )
    print()
    failed = False
    for key, against in (
        ("wake", f"raw read, {IN_FLIGHT} in flight"),
        ("sleep", f"raw write, {IN_FLIGHT} in flight"),
    ):
        ratio = doc["ratios"][key]
        ok = ratio["median"] >= doc["target"]
        failed |= not ok
        wall = doc["steps"][key]["wall"]
        print(
            f"{key} x {against}: {ratio['median']:.2f} (repetitions {ratio['min']:.2f}-{ratio['max']:.2f}), "
            f"target {doc['target']:.2f}: {'PASS' if ok else 'FAIL'}; "
            f"hibernate {key} took {wall['median']:.2f} s"
        )
    if json_out is not None:
        json_out.write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description="hibernate's sleep and wake on a latency-bound FUSE filesystem, against raw transfers "
        f"with {IN_FLIGHT} requests of 1 MiB in flight."
    )
    parser.add_argument(
        "--size-mb", type=int, default=512, help="bytes moved, and the demo's weights (512 MiB)"
    )
    parser.add_argument("--delay-ms", type=float, default=2.0, help="delay per read and write request (2 ms)")
    parser.add_argument("--reps", type=int, default=3, help="paired repetitions (default 3)")
    parser.add_argument(
        "--direct-io",
        choices=DIRECT_IO_MODES,
        default="odirect",
        help="the filesystem's FOPEN_DIRECT_IO: for files opened O_DIRECT (default), all, or none "
        "(tests/standins/latencyfs.py)",
    )
    parser.add_argument("--dir", type=Path, default=None, help="where the backing files go (default: TMPDIR)")
    parser.add_argument(
        "--no-drop-caches", dest="drop_caches", action="store_false", help="only evict the backing files"
    )
    parser.add_argument("--json-out", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    reason = unavailable()
    if reason is not None:
        print(
            f"bench-latency: the latency-bound filesystem cannot be mounted here: {reason}", file=sys.stderr
        )
        return 2
    work = Path(tempfile.mkdtemp(prefix="hibernate-bench-latency-", dir=args.dir))
    sockets = Path(tempfile.mkdtemp(prefix="hb-lat-", dir="/tmp"))  # a Unix socket's path is short
    try:
        return run(args, work, sockets)
    except BenchError as exc:
        print(f"bench-latency: {exc}", file=sys.stderr)
        return 2
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(sockets, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
