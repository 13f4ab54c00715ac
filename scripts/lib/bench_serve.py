"""What `hibernate serve` costs and what it saves, on the demo target (python -m hibernate.demo).

One demo serves its OpenAI-style HTTP API; ``hibernate serve`` runs in front of it.

* added latency: the same completion, one at a time, ``--requests`` times directly and
  through the proxy (backend awake); p50 and p99 of each, and the differences;
* the part of it the leases take: a lease on the demo's agent taken and given back, as the
  proxy does for every request (over one open link), ``--requests`` times; p50 and p99;
* time to first byte of a request that wakes the backend (put to sleep with
  ``hibernate sleep`` first, behind the proxy's back, ``--wakes`` times) against restarting
  the backend from scratch (a new process: import, build the model, listen) and asking it;
* requests per second with ``--concurrency`` clients, directly and through the proxy.

Every answer is checked against the first one (same bytes); a failed request fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[2]
PROMPT = json.dumps({"model": "demo", "prompt": "hello"}).encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


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


async def latencies(session: aiohttp.ClientSession, url: str, count: int, expected: bytes) -> list[float]:
    out = []
    for _ in range(count):
        started = time.perf_counter()
        async with session.post(url + "/v1/completions", data=PROMPT) as answer:
            body = await answer.read()
        out.append(time.perf_counter() - started)
        if body != expected:
            raise SystemExit(f"bench-serve: {url} answered differently: {body[:200]!r}")
    return out


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


def hibernate_cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "hibernate", *args, "--quiet"], cwd=REPO, check=True)


async def bench(args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    snapshots = scratch / "snapshots"
    demo = Demo(args.size_mb, scratch)
    proxy_port = free_port()
    proxy: subprocess.Popen[bytes] | None = None
    try:
        async with aiohttp.ClientSession() as session:
            cold_start, expected = await until_answered(session, demo.url, time.perf_counter() + 300)
            proxy = subprocess.Popen(
                [sys.executable, "-m", "hibernate", "serve", "--listen", f"127.0.0.1:{proxy_port}",
                 "--to", str(snapshots), "--backend", f"demo={demo.url}"],
                cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            via = f"http://127.0.0.1:{proxy_port}"
            await until_answered(session, via, time.perf_counter() + 120)
            direct = await latencies(session, demo.url, args.requests, expected)
            proxied = await latencies(session, via, args.requests, expected)
            leased = await lease_round_trips(demo.proc.pid, args.requests)
            wakes = []
            for _ in range(args.wakes):
                # Behind the proxy's back: its next request finds the backend asleep (its lease is
                # refused) and wakes it.
                hibernate_cli("sleep", str(demo.proc.pid), "--to", str(snapshots))
                seconds, body = await first_byte(session, via)
                if body != expected:
                    raise SystemExit("bench-serve: the woken backend answered differently")
                wakes.append(seconds)
            demo.stop()
            restart = Demo(args.size_mb, scratch)
            demo = restart
            restarted, body = await until_answered(session, restart.url, time.perf_counter() + 300)
            if body != expected:
                raise SystemExit("bench-serve: the restarted backend answered differently")
        rate_direct = await throughput(demo.url, args.requests, args.concurrency, expected)
        proxy.terminate()
        proxy.wait()
        proxy = subprocess.Popen(
            [sys.executable, "-m", "hibernate", "serve", "--listen", f"127.0.0.1:{proxy_port}",
             "--to", str(snapshots), "--backend", f"demo={demo.url}"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        async with aiohttp.ClientSession() as session:
            await until_answered(session, via, time.perf_counter() + 120)
        rate_proxied = await throughput(via, args.requests, args.concurrency, expected)
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
        "latency_direct": {"p50": percentile(direct, 50), "p99": percentile(direct, 99)},
        "latency_proxy": {"p50": percentile(proxied, 50), "p99": percentile(proxied, 99)},
        "lease_round_trip": {"p50": percentile(leased, 50), "p99": percentile(leased, 99)},
        "first_byte_waking": {"median": statistics.median(wakes), "each": wakes},
        "first_byte_cold_restart": restarted,
        "first_byte_first_start": cold_start,
        "rps_direct": rate_direct,
        "rps_proxy": rate_proxied,
    }


def report(r: dict[str, Any]) -> str:
    ms = 1000.0
    d, p = r["latency_direct"], r["latency_proxy"]
    return "\n".join(
        [
            f"bench-serve: demo target, {r['size_mb']} MiB of float32 weights, {r['cpus']} CPUs, "
            f"{r['requests']} requests",
            f"  latency, awake backend     direct p50 {d['p50'] * ms:7.2f} ms  p99 {d['p99'] * ms:7.2f} ms",
            f"                             proxy  p50 {p['p50'] * ms:7.2f} ms  p99 {p['p99'] * ms:7.2f} ms",
            f"                             added  p50 {(p['p50'] - d['p50']) * ms:7.2f} ms  "
            f"p99 {(p['p99'] - d['p99']) * ms:7.2f} ms",
            f"                             leases p50 {r['lease_round_trip']['p50'] * ms:7.2f} ms  "
            f"p99 {r['lease_round_trip']['p99'] * ms:7.2f} ms (part of added)",
            f"  first byte, asleep backend woken by the request  {r['first_byte_waking']['median']:7.3f} s "
            f"(median of {len(r['first_byte_waking']['each'])})",
            f"  first byte, backend restarted from scratch       {r['first_byte_cold_restart']:7.3f} s",
            f"  requests/s, {r['concurrency']} clients          direct {r['rps_direct']:8.1f}   "
            f"proxy {r['rps_proxy']:8.1f}",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench-serve", description=__doc__)
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--wakes", type=int, default=3)
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hb-bench-serve-"))
    try:
        result = asyncio.run(bench(args, scratch))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(report(result))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
