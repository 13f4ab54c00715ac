"""Per-tensor cost end to end: `hibernate sleep` and `hibernate wake` of a real target holding many
small tensors, through the CLI, beside safetensors saving and loading the same tensors.

  scripts/bench-tensors [--tensors 100000] [--tensor-kib 1] [--reps 3] [--dir DIR] [--json-out FILE]

The target is a process of its own (this file run with --target): it builds ``--tensors``
float32 tensors of ``--tensor-kib`` KiB, each its own storage and no two alike, tracks them with
``hibernate.track`` (kept, tag "weights") and waits. Each repetition runs, as a user would,
``hibernate sleep PID --to DIR --json`` into a fresh directory (a first sleep, nothing to reuse)
and ``hibernate wake PID --json``, each a process of its own, and checks afterwards that the
target's tensors are bit-exact.

The peer runs in this process, on the same tensors built the same way (what a user of safetensors
waits for, in a process that already holds its model): ``safetensors.torch.save_file`` + fsync,
and a cold ``load_file`` with every tensor materialised (load_file's tensors are views of a file
mapping; a wake leaves each in memory of its own). Each repetition runs the sleep beside the save
and the wake beside the load, which of each pair goes first alternating; the ratios are the
medians of the paired ratios, with their range. Before each cold read (the wake's and the
peer's) the files read are dropped from the page cache (POSIX_FADV_DONTNEED); with
--drop-caches (root) the whole page cache is dropped too.

Each command's wall time is split by its --json report: every step's seconds (``phases``), what
lies between the steps inside the command's own report (``seconds`` less its steps), and the
command's start and exit (its wall time less its report's ``seconds``: interpreter, imports,
connecting, rendering). The CPU cost of a sleep and a wake is the user plus system time of the
target (/proc/PID/stat, before and after) and of the command (its resource usage as a child)
over the whole operation, in core-seconds per GiB of tensors; the peer's is this process's own.

Prints the options, a table of shares and the ratios against the goals (sleep and wake at most
0.5x the peer); exits 1 where a goal is not met.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from host import drop_caches, filesystem_of  # beside this script

ROOT = Path(__file__).resolve().parents[2]
KiB = 1 << 10
GiB = 1 << 30
GOAL_RATIO = 0.5  # sleep and wake, each at most this fraction of the peer's save and load
SEED = 20261206
# The agent's steps in the order a sleep and a wake run them (reports list them by name).
STEP_ORDER = ("begin", "close_leases", "quiesce", "spill", "release", "restore", "resume")


def make_tensors(count: int, tensor_kib: int) -> dict[str, Any]:
    """``count`` float32 tensors of ``tensor_kib`` KiB, each its own storage, no two alike.

    Built the same way in the target and in the bench (same seed), so the bench's digest of its
    own copy is what the target must hold after a wake.
    """
    import torch

    elements = tensor_kib * KiB // 4
    generator = torch.Generator().manual_seed(SEED)
    block = torch.randint(-(2**31), 2**31 - 1, (count * elements,), dtype=torch.int32, generator=generator)
    flat = block.view(torch.float32)
    return {f"layers.{i}.weight": flat[i * elements : (i + 1) * elements].clone() for i in range(count)}


def digest(tensors: dict[str, Any]) -> str:
    """Every tensor's bytes, by name: equal digests mean a bit-exact round trip."""
    import ctypes

    import xxhash

    h = xxhash.xxh3_128()
    for name, tensor in sorted(tensors.items()):
        h.update(name.encode())
        h.update((ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr()))
    return h.hexdigest()


# -- the target ----------------------------------------------------------------


def serve_target(count: int, tensor_kib: int, ready: Path) -> int:
    """The target: track the tensors, say so in ``ready``, then answer "digest" lines on stdin
    (under hibernate.guard(), as a program touches its tensors) until stdin closes."""
    import hibernate

    tensors = make_tensors(count, tensor_kib)
    hibernate.track(tensors, tag="weights")
    tmp = ready.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid()}))
    os.rename(tmp, ready)
    for line in sys.stdin:
        if line.strip() == "digest":
            with hibernate.guard():
                answer = digest(tensors)
            print(answer, flush=True)
    return 0


class Target:
    """The target process, in a runtime directory of the bench's own (no other target of this
    user can be reached)."""

    def __init__(self, work: Path, count: int, tensor_kib: int) -> None:
        # With PYTHONDONTWRITEBYTECODE set every command would compile hibernate from source
        # again (see bench_store.Targets): an installed copy has its bytecode.
        environment = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        # Its sockets live in a directory of their own, short whatever --dir is (a socket's path
        # has at most 107 bytes), not on the disk measured.
        self.runtime = Path(tempfile.mkdtemp(prefix="hb-bench-run-"))
        self.env = {**environment, "HIBERNATE_RUNTIME_DIR": str(self.runtime / "run")}
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
        ready = work / "target.ready"
        self.log = open(work / "target.log", "wb")  # noqa: SIM115 (the target's lifetime)
        command = [sys.executable, "-W", "ignore", __file__, "--target", str(count), str(tensor_kib)]
        self.process = subprocess.Popen(
            [*command, str(ready)],
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        deadline = time.monotonic() + 600 + count / 1000
        while not ready.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise SystemExit(f"the target did not start; see {work / 'target.log'}")
            time.sleep(0.05)
        self.pid = int(json.loads(ready.read_text())["pid"])

    def digest(self) -> str:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None
        stdin.write("digest\n")
        stdin.flush()
        return stdout.readline().strip()

    def cpu_seconds(self) -> float:
        """User plus system time of the target so far, its threads and waited-for children included."""
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after the name's ")".
        return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.process.stdin is not None:
                self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        shutil.rmtree(self.runtime, ignore_errors=True)


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def hibernate_command(target: Target, *argv: str) -> dict[str, Any]:
    """One command through the CLI, as a user runs it: its --json report, wall time and the CPU
    time of the command and of the target over it."""
    command = [sys.executable, "-m", "hibernate", *argv, "--json"]
    target_cpu, command_cpu = target.cpu_seconds(), children_cpu()
    started = time.perf_counter()
    done = subprocess.run(command, env=target.env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - started
    command_cpu = children_cpu() - command_cpu
    target_cpu = target.cpu_seconds() - target_cpu
    if done.returncode != 0:
        # With --json the error is in the report on stdout, not on stderr.
        raise SystemExit(
            f"hibernate {' '.join(argv)} failed ({done.returncode}): {done.stdout} {done.stderr}"
        )
    report: dict[str, Any] = json.loads(done.stdout)
    return {"report": report, "wall": wall, "command_cpu": command_cpu, "target_cpu": target_cpu}


# -- cold reads ----------------------------------------------------------------


def evict_all(paths: list[Path], whole_cache: bool) -> bool:
    """Drop ``paths`` (files, or every file under directories) from the page cache; with
    ``whole_cache`` the whole page cache too. Whether the whole cache was dropped."""
    from bench_store import evict

    for path in paths:
        if path.exists():
            evict(path)
    return drop_caches() if whole_cache else False


# -- the run -------------------------------------------------------------------


A = TypeVar("A")
B = TypeVar("B")
R = TypeVar("R")


def in_turn(first: Callable[[], A], second: Callable[[], B], swap: bool) -> tuple[A, B]:
    """Run two measurements back to back, ``second`` first when ``swap``; returns (first's, second's)."""
    if swap:
        b = second()
        return first(), b
    a = first()
    return a, second()


def cold(dropped: list[bool], paths: list[Path], whole_cache: bool, read: Callable[[], R]) -> R:
    """``read`` once ``paths`` are out of the page cache (whether the whole cache was: ``dropped``)."""
    dropped.append(evict_all(paths, whole_cache))
    return read()


def steps_of(measured: dict[str, Any]) -> dict[str, float]:
    """Each step's seconds, what lies between them inside the command's report, and the
    command's start and exit, adding up to its wall time."""
    report, wall = measured["report"], measured["wall"]
    (process,) = report["processes"]
    phases = process["phases"]
    ordered = [name for name in STEP_ORDER if name in phases] + sorted(set(phases) - set(STEP_ORDER))
    steps = {name: float(phases[name]) for name in ordered}
    steps["between the steps"] = float(report["seconds"]) - sum(steps.values())
    steps["the command's start and exit"] = wall - float(report["seconds"])
    return steps


def timed(step: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds (this process) of ``step``."""
    cpu = self_cpu()
    started = time.perf_counter()
    step()
    return time.perf_counter() - started, self_cpu() - cpu


def repetition(
    args: argparse.Namespace,
    work: Path,
    target: Target,
    tensors: dict[str, Any],
    reference: str,
    dropped: list[bool],
    rep: int,
) -> dict[str, Any]:
    """One sleep beside one save, one wake beside one load, each pair in its turn; the figures."""
    from bench_store import safetensors_load, safetensors_save

    peer_file = work / "model.safetensors"
    swap = rep % 2 == 1  # alternate who goes first, so drift favours neither
    into = work / f"snapshots-{rep}"  # a first sleep each time: nothing to reuse
    sleep_argv = ["sleep", str(target.pid), "--to", str(into)]
    slept, peer_save = in_turn(
        lambda: hibernate_command(target, *sleep_argv),
        lambda: timed(lambda: safetensors_save(peer_file, tensors)),
        swap,
    )
    loaded: list[dict[str, Any]] = []
    woken, peer_load = in_turn(
        lambda: cold(
            dropped,
            [into],
            args.drop_caches,
            lambda: hibernate_command(target, "wake", str(target.pid)),
        ),
        lambda: cold(
            dropped,
            [peer_file],
            args.drop_caches,
            lambda: timed(lambda: loaded.append(safetensors_load(peer_file))),
        ),
        swap,
    )
    if target.digest() != reference:
        raise SystemExit("the target's tensors differ after its wake")
    if digest(loaded[0]) != reference:
        raise SystemExit("safetensors returned different bytes")
    loaded.clear()
    peer_file.unlink()
    shutil.rmtree(into)
    return {
        "sleep_seconds": slept["wall"],
        "wake_seconds": woken["wall"],
        "sleep_steps": steps_of(slept),
        "wake_steps": steps_of(woken),
        "sleep_cpu": slept["command_cpu"] + slept["target_cpu"],
        "wake_cpu": woken["command_cpu"] + woken["target_cpu"],
        "sleep_command_cpu": slept["command_cpu"],
        "wake_command_cpu": woken["command_cpu"],
        "peer_save_seconds": peer_save[0],
        "peer_load_seconds": peer_load[0],
        "peer_save_cpu": peer_save[1],
        "peer_load_cpu": peer_load[1],
        "sleep_ratio": slept["wall"] / peer_save[0],
        "wake_ratio": woken["wall"] / peer_load[0],
        "written_bytes": slept["report"]["processes"][0]["written_bytes"],
        "restored_bytes": woken["report"]["processes"][0]["restored_bytes"],
    }


def run(args: argparse.Namespace, work: Path, run_started: float) -> int:
    built_at = time.perf_counter()
    tensors = make_tensors(args.tensors, args.tensor_kib)
    build_seconds = time.perf_counter() - built_at
    reference = digest(tensors)
    total = sum(t.nbytes for t in tensors.values())
    target = Target(work, args.tensors, args.tensor_kib)
    dropped: list[bool] = []
    reps: list[dict[str, Any]] = []
    try:
        if target.digest() != reference:
            raise SystemExit("the target's tensors differ from the bench's before any sleep")
        for rep in range(args.reps):
            reps.append(repetition(args, work, target, tensors, reference, dropped, rep))
    finally:
        target.close()

    def median(key: str) -> float:
        return float(statistics.median(r[key] for r in reps))

    def spread(values: list[float]) -> dict[str, float]:
        return {"min": min(values), "median": float(statistics.median(values)), "max": max(values)}

    gib = total / GiB
    goals = [
        ("sleep <= 0.5x safetensors save_file + fsync", median("sleep_ratio"), GOAL_RATIO),
        ("wake <= 0.5x cold safetensors load_file", median("wake_ratio"), GOAL_RATIO),
    ]
    document: dict[str, Any] = {
        "machine": {
            "kernel": platform.release(),
            "cpus": os.cpu_count(),
            "filesystem": filesystem_of(work),
            "directory": str(work.parent),
            "python": platform.python_version(),
            "load_average": os.getloadavg(),
        },
        "data": {"tensors": args.tensors, "tensor_bytes": args.tensor_kib * KiB, "bytes": total},
        "build_seconds": build_seconds,
        "whole_cache_dropped": all(dropped) if args.drop_caches else None,
        "spread": {
            key: spread([r[key] for r in reps])
            for key in (
                "sleep_seconds",
                "wake_seconds",
                "peer_save_seconds",
                "peer_load_seconds",
                "sleep_ratio",
                "wake_ratio",
            )
        },
        "steps": {
            operation: {
                step: {
                    "seconds": spread([r[f"{operation}_steps"][step] for r in reps]),
                    "share": spread(
                        [r[f"{operation}_steps"][step] / r[f"{operation}_seconds"] for r in reps]
                    ),
                }
                for step in reps[0][f"{operation}_steps"]
            }
            for operation in ("sleep", "wake")
        },
        "core_seconds_per_gib": {
            "sleep": median("sleep_cpu") / gib,
            "wake": median("wake_cpu") / gib,
            "sleep_command": median("sleep_command_cpu") / gib,
            "wake_command": median("wake_command_cpu") / gib,
            "peer_save": median("peer_save_cpu") / gib,
            "peer_load": median("peer_load_cpu") / gib,
        },
        "goals": [
            {"goal": name, "value": value, "limit": limit, "pass": value <= limit}
            for name, value, limit in goals
        ],
        "repetitions": reps,
    }
    document["all_pass"] = all(g["pass"] for g in document["goals"])
    document["seconds"] = time.perf_counter() - run_started
    print_report(document, args)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(document, indent=1) + "\n")
    return 0 if document["all_pass"] else 1


def print_report(doc: dict[str, Any], args: argparse.Namespace) -> None:
    machine, data, spreads = doc["machine"], doc["data"], doc["spread"]
    load = ", ".join(f"{x:.1f}" for x in machine["load_average"])
    print(
        f"bench-tensors: {data['tensors']} tensors of {data['tensor_bytes'] // KiB} KiB "
        f"({data['bytes'] / GiB * 1024:.1f} MiB), {machine['filesystem']} at {machine['directory']}, "
        f"{machine['cpus']} CPUs, load average {load}, Python {machine['python']}, "
        f"{args.reps} repetitions"
    )
    if doc["whole_cache_dropped"] is None:
        cache = "the files read dropped from the page cache before each cold read (all of it: --drop-caches)"
    elif doc["whole_cache_dropped"]:
        cache = "the whole page cache dropped before each cold read (--drop-caches)"
    else:
        cache = "the whole page cache could not be dropped (not root?): the files read were dropped from it"
    built = doc["build_seconds"]
    print(
        f"peer: safetensors in the bench's process, the tensors built in {built:.2f} s (not timed); {cache}"
    )
    print()

    def cell(s: dict[str, float], digits: int = 2) -> str:
        return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"

    for operation, peer, peer_label in (
        ("sleep", "peer_save_seconds", "safetensors save_file + fsync"),
        ("wake", "peer_load_seconds", "safetensors load_file (cold)"),
    ):
        command = "hibernate sleep PID --to DIR" if operation == "sleep" else "hibernate wake PID"
        print(f"{command}: {cell(spreads[f'{operation}_seconds'])} s, median (range)")
        for step, figures in doc["steps"][operation].items():
            share = figures["share"]
            low, high = share["min"] * 100, share["max"] * 100
            print(
                f"  {step:<30} {cell(figures['seconds'], 3):>22} s  "
                f"{share['median'] * 100:5.1f}% of the wall time ({low:.0f}-{high:.0f}%)"
            )
        print(f"{peer_label}: {cell(spreads[peer])} s")
        print(f"{operation} / peer: {cell(spreads[f'{operation}_ratio'])}")
        print()
    cpu = doc["core_seconds_per_gib"]
    print(
        f"CPU, core-seconds per GiB (target + command; the command alone): sleep {cpu['sleep']:.1f} "
        f"({cpu['sleep_command']:.1f}), wake {cpu['wake']:.1f} ({cpu['wake_command']:.1f}); "
        f"peer save {cpu['peer_save']:.1f}, load {cpu['peer_load']:.1f}"
    )
    print()
    for goal in doc["goals"]:
        verdict = "PASS" if goal["pass"] else "FAIL"
        print(f"{verdict}  {goal['goal']}: {goal['value']:.2f} (limit {goal['limit']:.2f})")
    print(f"\nwhole run {doc['seconds']:.1f} s")


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--target":  # the target process (see Target)
        return serve_target(int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    parser = argparse.ArgumentParser(
        prog="bench-tensors",
        description="hibernate sleep and wake of a target of many small tensors, through the CLI, "
        "beside safetensors save_file and load_file of the same tensors",
    )
    parser.add_argument("--tensors", type=int, default=100_000, help="number of tensors (default 100000)")
    parser.add_argument("--tensor-kib", type=int, default=1, help="size of each tensor in KiB (default 1)")
    parser.add_argument(
        "--dir", type=Path, default=None, help="directory on the disk to measure (default: TMPDIR)"
    )
    parser.add_argument("--reps", type=int, default=3, help="paired repetitions (default 3)")
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="also drop the whole page cache before each cold read (root; every process on the machine "
        "loses its cache, the command's own imports included)",
    )
    parser.add_argument("--json-out", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    if args.tensors < 1 or args.tensor_kib < 1 or args.reps < 1:
        parser.error("--tensors, --tensor-kib and --reps must be >= 1")
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    if args.json_out is not None and not args.json_out.parent.is_dir():
        parser.error(f"--json-out {args.json_out}: {args.json_out.parent} is not a directory")
    sys.path.insert(0, str(ROOT))  # the project, for bench_store's imports
    run_started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="hibernate-bench-tensors-", dir=args.dir))
    os.chmod(work, 0o700)
    try:
        return run(args, work, run_started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
