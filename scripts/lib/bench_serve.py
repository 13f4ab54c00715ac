"""What `hibernate serve` costs and what it saves, on the demo target (python -m hibernate.demo).

One demo serves its OpenAI-style HTTP API; ``hibernate serve`` runs in front of it.

* added latency, paired: the same completion, one at a time, ``--requests`` times through the
  proxy and as many times directly, the two ways alternating; each request is paired with the
  next (the other way), so which goes first alternates and a drift cancels. The proxy's added
  latency is each pair's difference, shown as the median, p90 and p99 of those differences, and
  the pairs' ratio (proxy / direct) likewise.
  Two percentiles of two separate runs are never subtracted: on a shared machine their difference
  is the machine's drift, and can come out negative;
* the part of it the leases take: a lease on the demo's agent taken and given back, as the
  proxy does for every request (over one open link), ``--requests`` times; p50 and p99;
* time to first byte of a request that wakes the backend (put to sleep with
  ``hibernate sleep`` first, behind the proxy's back, ``--wakes`` times) against restarting
  the backend from scratch (a new process: import, build the model, listen) and asking it;
* requests per second with ``--concurrency`` clients, directly and through the proxy.

Every answer is checked against the first one (same bytes); a failed request fails the run.
Each phase prints a line to stderr as it starts and as it goes (every tenth of the paired requests), so a
run is never silent; the report ends with each phase's wall time and its share of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
PROMPT = json.dumps({"model": "demo", "prompt": "hello"}).encode()
# Requests each way before the pairs, not counted: the first ones pay for connecting and warming caches.
WARMUP_REQUESTS = 3


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100), linear between the two nearest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not within 0-100")
    ordered = sorted(values)
    position = q / 100 * (len(ordered) - 1)
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def through_proxy(request: int) -> bool:
    """Whether request number ``request`` of the paired phase goes through the proxy (even) or direct (odd).

    The two ways strictly alternate: the demo answers a way asked twice in a row tens of
    milliseconds slower the second time (measured on both ways alike), so a pattern that repeats
    a way (proxy, direct, direct, proxy, ...) splits the differences into two clusters by order.
    """
    return request % 2 == 0


def adjacent_pairs(seconds: Sequence[float]) -> tuple[list[float], list[float]]:
    """The direct and proxied times of every two neighbouring requests of an alternating run.

    ``seconds[k]`` went through the proxy when ``through_proxy(k)``. Request k is paired with
    request k + 1, the other way, so which goes first alternates from pair to pair (a drift of the
    machine falls on both sides alike) and n requests give n - 1 pairs, each request in two.
    """
    direct: list[float] = []
    proxied: list[float] = []
    for first in range(len(seconds) - 1):
        pair = (seconds[first], seconds[first + 1])
        through, straight = pair if through_proxy(first) else pair[::-1]
        proxied.append(through)
        direct.append(straight)
    return direct, proxied


@dataclass(frozen=True)
class PairedLatency:
    """The proxy's added latency from paired requests (seconds; ratios proxy / direct)."""

    pairs: int
    direct_median: float
    proxy_median: float
    added_median: float
    added_p90: float
    added_p99: float
    ratio_median: float
    ratio_p90: float
    ratio_p99: float


def paired_latency(direct: Sequence[float], proxied: Sequence[float]) -> PairedLatency:
    """Statistics of the per-pair differences and ratios: pair i is ``direct[i]`` and ``proxied[i]``.

    The differences are taken pair by pair, then summarized; a difference of two percentiles
    would mix the two runs' slow outliers, which fall on different requests.
    """
    if len(direct) != len(proxied):
        raise ValueError(f"{len(direct)} direct and {len(proxied)} proxied times do not pair")
    if not direct:
        raise ValueError("no pairs")
    if min(direct) <= 0 or min(proxied) <= 0:
        raise ValueError("a request time is not positive")
    added = [through - straight for straight, through in zip(direct, proxied, strict=True)]
    ratios = [through / straight for straight, through in zip(direct, proxied, strict=True)]
    return PairedLatency(
        pairs=len(direct),
        direct_median=statistics.median(direct),
        proxy_median=statistics.median(proxied),
        added_median=statistics.median(added),
        added_p90=percentile(added, 90),
        added_p99=percentile(added, 99),
        ratio_median=statistics.median(ratios),
        ratio_p90=percentile(ratios, 90),
        ratio_p99=percentile(ratios, 99),
    )


def progress_marks(total: int, steps: int = 10) -> set[int]:
    """The counts (1..total) after which to print progress: about ``steps`` of them, the last included."""
    if total <= 0:
        return set()
    return {max(1, round(total * step / steps)) for step in range(1, steps + 1)}


class Phases:
    """Says on stderr what the run is doing, and keeps each phase's wall time for the report."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self._current: str | None = None
        self._current_started = 0.0
        self._number = 0

    def begin(self, name: str, doing: str) -> None:
        self.end()
        self._number += 1
        self._current, self._current_started = name, time.perf_counter()
        self.say(f"[{self._number}/{self.count}] {doing}")

    def end(self) -> None:
        if self._current is not None:
            self.seconds[self._current] = time.perf_counter() - self._current_started
            self._current = None

    def say(self, line: str) -> None:
        elapsed = time.perf_counter() - self.started
        print(f"bench-serve: {elapsed:6.1f} s  {line}", file=sys.stderr, flush=True)

    @property
    def total(self) -> float:
        return time.perf_counter() - self.started


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Demo:
    """A demo target with its HTTP API, started as a user would start a model server."""

    def __init__(self, size_mb: int, scratch: Path) -> None:
        self.port = free_port()
        self.scratch = scratch
        self.proc = subprocess.Popen(
            [
                sys.executable, "-W", "ignore", "-m", "hibernate.demo", "serve", "--size-mb", str(size_mb),
                "--dtype", "float32", "--control", str(scratch / f"demo-{self.port}.sock"),
                "--http-port", str(self.port),
            ],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def start_proxy(port: int, snapshots: Path, backend_url: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "hibernate", "serve", "--listen", f"127.0.0.1:{port}",
         "--to", str(snapshots), "--backend", f"demo={backend_url}"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.DEVNULL,
    )  # fmt: skip


async def first_byte(session: aiohttp.ClientSession, url: str) -> tuple[float, bytes]:
    """Seconds to the first byte of a completion's answer, and the whole answer."""
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", data=PROMPT) as answer:
        first = await answer.content.readany()
        elapsed = time.perf_counter() - started
        rest = await answer.read()
        if answer.status != 200:
            raise SystemExit(f"bench-serve: {url} answered {answer.status}: {first + rest!r}")
        return elapsed, first + rest


async def until_answered(session: aiohttp.ClientSession, url: str, deadline: float) -> tuple[float, bytes]:
    """Ask until the server answers (it may not listen yet); the seconds from now to the first byte."""
    started = time.perf_counter()
    while True:
        try:
            _, body = await first_byte(session, url)
            return time.perf_counter() - started, body
        except aiohttp.ClientConnectionError:
            if time.perf_counter() > deadline:
                raise SystemExit(f"bench-serve: {url} never answered") from None
            await asyncio.sleep(0.05)


async def one_request(session: aiohttp.ClientSession, url: str, expected: bytes) -> float:
    """Seconds for one whole completion, its answer checked."""
    started = time.perf_counter()
    async with session.post(url + "/v1/completions", data=PROMPT) as answer:
        body = await answer.read()
    elapsed = time.perf_counter() - started
    if body != expected:
        raise SystemExit(f"bench-serve: {url} answered differently: {body[:200]!r}")
    return elapsed


async def paired_requests(
    session: aiohttp.ClientSession,
    direct_url: str,
    proxy_url: str,
    each_way: int,
    expected: bytes,
    phases: Phases,
) -> list[float]:
    """Seconds of ``each_way`` requests through the proxy and as many direct, in turn (``through_proxy``)."""
    for _ in range(WARMUP_REQUESTS):
        await one_request(session, proxy_url, expected)
        await one_request(session, direct_url, expected)
    total = 2 * each_way
    seconds: list[float] = []
    marks = progress_marks(total)
    for request in range(total):
        seconds.append(
            await one_request(session, proxy_url if through_proxy(request) else direct_url, expected)
        )
        if request + 1 in marks and request >= 1:
            so_far = paired_latency(*adjacent_pairs(seconds))
            phases.say(
                f"      {request + 1}/{total} requests, "
                f"added so far: median {so_far.added_median * 1000:+.2f} ms"
            )
    return seconds


async def throughput(url: str, count: int, concurrency: int, expected: bytes) -> float:
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        queue = list(range(count))

        async def client() -> None:
            while queue:
                queue.pop()
                async with session.post(url + "/v1/completions", data=PROMPT) as answer:
                    if await answer.read() != expected:
                        raise SystemExit(f"bench-serve: {url} answered differently under load")

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        return count / (time.perf_counter() - started)


async def lease_round_trips(pid: int, count: int) -> list[float]:
    """Seconds to take a lease on every agent of ``pid`` (given back at once, unawaited), ``count`` times."""
    from hibernate.operation import targets
    from hibernate.serve.leases import BackendLeases

    sockets = [ref.socket for target in targets.resolve([pid]) for ref in target.agents]
    leases = await BackendLeases.open(pid, sockets)
    out = []
    try:
        for _ in range(count):
            started = time.perf_counter()
            verdict = await leases.take()
            out.append(time.perf_counter() - started)
            if not verdict.granted:
                raise SystemExit(f"bench-serve: the demo refused a lease ({verdict.reason})")
            leases.give_back()
    finally:
        leases.close()
    return out


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def hibernate_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "hibernate", *args, "--quiet"], cwd=REPO, check=True)


PHASES = 7


async def bench(args: argparse.Namespace, scratch: Path, phases: Phases) -> dict[str, Any]:
    snapshots = scratch / "snapshots"
    phases.begin("backend start", f"starting the demo backend ({args.size_mb} MiB of float32 weights)")
    demo = Demo(args.size_mb, scratch)
    proxy_port = free_port()
    via = f"http://127.0.0.1:{proxy_port}"
    proxy: subprocess.Popen[bytes] | None = None
    try:
        async with aiohttp.ClientSession() as session:
            cold_start, expected = await until_answered(session, demo.url, time.perf_counter() + 300)
            phases.say(f"      the backend answered {cold_start:.2f} s after its start")
            phases.begin("proxy start", "starting hibernate serve in front of it")
            proxy = start_proxy(proxy_port, snapshots, demo.url)
            await until_answered(session, via, time.perf_counter() + 120)
            phases.begin(
                "paired latency",
                f"added latency: {args.requests} requests each way, alternating between the proxy and "
                f"direct, each paired with the next (after {WARMUP_REQUESTS} each way to warm up)",
            )
            alternating = await paired_requests(session, demo.url, via, args.requests, expected, phases)
            phases.begin("lease round trips", f"{args.requests} lease round trips on the demo's agent")
            leased = await lease_round_trips(demo.proc.pid, args.requests)
            phases.begin("wakes", f"{plural(args.wakes, 'request')} waking the backend, each after a sleep")
            wakes = []
            for wake in range(args.wakes):
                # Behind the proxy's back: its next request finds the backend asleep (its lease is
                # refused) and wakes it.
                hibernate_cli("sleep", str(demo.proc.pid), "--to", str(snapshots))
                seconds, body = await first_byte(session, via)
                if body != expected:
                    raise SystemExit("bench-serve: the woken backend answered differently")
                wakes.append(seconds)
                phases.say(f"      wake {wake + 1}/{args.wakes}: first byte after {seconds:.3f} s")
            phases.begin("cold restart", "restarting the backend from scratch, for comparison")
            demo.stop()
            demo = Demo(args.size_mb, scratch)
            restarted, body = await until_answered(session, demo.url, time.perf_counter() + 300)
            if body != expected:
                raise SystemExit("bench-serve: the restarted backend answered differently")
            phases.say(f"      first byte after {restarted:.3f} s")
        phases.begin(
            "throughput",
            f"requests per second: {args.requests} requests from {args.concurrency} clients, "
            "direct then through the proxy",
        )
        rate_direct = await throughput(demo.url, args.requests, args.concurrency, expected)
        phases.say(f"      direct: {rate_direct:.1f} requests/s")
        proxy.terminate()
        proxy.wait()
        proxy = start_proxy(proxy_port, snapshots, demo.url)
        async with aiohttp.ClientSession() as session:
            await until_answered(session, via, time.perf_counter() + 120)
        rate_proxied = await throughput(via, args.requests, args.concurrency, expected)
        phases.say(f"      through the proxy: {rate_proxied:.1f} requests/s")
        phases.end()
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait()
        demo.stop()
    return {
        "size_mb": args.size_mb,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "latency_paired": asdict(paired_latency(*adjacent_pairs(alternating))),
        # Each request's seconds in the order made, through the proxy first: for analysis beyond the summary.
        "latency_alternating_seconds": alternating,
        "lease_round_trip": {"p50": percentile(leased, 50), "p99": percentile(leased, 99)},
        "first_byte_waking": {"median": statistics.median(wakes), "each": wakes},
        "first_byte_cold_restart": restarted,
        "first_byte_first_start": cold_start,
        "rps_direct": rate_direct,
        "rps_proxy": rate_proxied,
        "phase_seconds": dict(phases.seconds),
        "whole_run_seconds": phases.total,
    }


def report(r: dict[str, Any]) -> str:
    ms = 1000.0
    lat = r["latency_paired"]
    lease = r["lease_round_trip"]
    share = lat["added_median"] / lat["proxy_median"] if lat["proxy_median"] else 0.0
    whole = r["whole_run_seconds"]
    lines = [
        f"bench-serve: demo target, {r['size_mb']} MiB of float32 weights, {r['cpus']} CPUs, "
        f"{r['requests']} requests",
        f"  a request through the proxy, awake backend: median {lat['proxy_median'] * ms:.2f} ms "
        f"(direct {lat['direct_median'] * ms:.2f} ms), "
        f"of which the proxy's {lat['added_median'] * ms:.2f} ms ({share:.1%})",
        f"  added latency, {lat['pairs']} pairs   median {lat['added_median'] * ms:7.2f} ms  "
        f"p90 {lat['added_p90'] * ms:7.2f} ms  p99 {lat['added_p99'] * ms:7.2f} ms",
        f"  proxy / direct, per pair   median {lat['ratio_median']:7.3f}x    p90 {lat['ratio_p90']:7.3f}x    "
        f"p99 {lat['ratio_p99']:7.3f}x",
        f"  leases (part of added)     p50    {lease['p50'] * ms:7.2f} ms  p99 {lease['p99'] * ms:7.2f} ms",
        f"  first byte, asleep backend woken by the request  {r['first_byte_waking']['median']:7.3f} s "
        f"(median of {len(r['first_byte_waking']['each'])})",
        f"  first byte, backend restarted from scratch       {r['first_byte_cold_restart']:7.3f} s",
        f"  requests/s, {r['concurrency']} clients          direct {r['rps_direct']:8.1f}   "
        f"proxy {r['rps_proxy']:8.1f}   ratio {r['rps_proxy'] / r['rps_direct']:.3f}",
        f"  wall time {whole:.1f} s in all, by phase:",
    ]
    width = max(len(name) for name in r["phase_seconds"])
    lines += [
        f"    {name:<{width}}  {seconds:6.1f} s  {seconds / whole:4.0%}"
        for name, seconds in r["phase_seconds"].items()
    ]
    return "\n".join(lines)


QUICK_REQUESTS = 50
QUICK_WAKES = 1


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="scripts/bench-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument(
        "--requests",
        type=int,
        help="requests each way in the paired phase, lease round trips, throughput requests (300)",
    )
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--wakes", type=int, help="requests that wake the backend (3)")
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_REQUESTS} requests and {QUICK_WAKES} wake unless given: about a quarter of the time",
    )
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    if args.requests is None:
        args.requests = QUICK_REQUESTS if args.quick else 300
    if args.wakes is None:
        args.wakes = QUICK_WAKES if args.quick else 3
    for name in ("size_mb", "requests", "concurrency", "wakes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    scratch = Path(tempfile.mkdtemp(prefix="hb-bench-serve-"))
    phases = Phases(PHASES)
    try:
        result = asyncio.run(bench(args, scratch, phases))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(report(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
