"""STAND-IN for a vLLM 0.33 API server (tests only): its sleep endpoints, over stand-in workers.

    python -m tests.standins.vllm_server --cudart LIB --port P --ready FILE [--host H] [--workers N] [--mb M]
                                   [--enable-sleep-mode] [--sleep-mode-backend NAME] [--served-model-name M]
                                   [--enable-nccl-comm-suspend] [--disable-custom-all-reduce]

Like ``vllm serve`` it is the parent of its workers: each is a separate
process forked once vLLM is imported, as vLLM's executor forks them by default,
that runs ``tests.standins.vllm_worker`` (vLLM's plugin loader, real
``AllocationData`` over host memory, hibernate's backend created by vLLM's
factory), driven over its stdin as vLLM's executor drives its workers (every
worker, then gather).
Each worker is told its ``RANK``, the ``WORLD_SIZE`` and a directory where its
collectives meet (``tests/standins/vllm_parallel_state.py``).
The server loads vLLM's general plugins too, so it has a hibernate agent with
an empty pool, as the real API server does. The flags after ``--ready`` are
accepted as ``vllm serve`` accepts them (hibernate reads them from the command
line; ``--enable-nccl-comm-suspend`` also reaches the workers, whose sleep and
wake then suspend and resume their communicators as vLLM's do); the others are
the stand-in's.

What it serves, and how, follows vLLM 0.33 (read from the released package):

* with ``VLLM_SERVER_DEV_MODE=1`` only (``vllm/entrypoints/launchers/api_server/routers.py``):
  ``POST /sleep?level=0..2&mode=abort|wait|keep`` -> ``{"status": "sleeping", "level": L}``;
  ``POST /wake_up[?tags=...]`` -> ``{"status": "awake"|"sleeping", "tags": [...]|null}``;
  ``GET /is_sleeping`` -> ``{"is_sleeping": bool}`` (``vllm/entrypoints/serve/dev/sleep/api_router.py``);
* always ``GET /version``, ``GET /health``, and of the OpenAI API ``GET /v1/models`` and
  ``POST /v1/completions`` (``"stream": true``: server-sent events, chunked); a completion for
  another model is a 404 ``NotFoundError``; one that arrives while the engine is paused or asleep
  waits until it is resumed, as a request queued in a paused vLLM does. The stand-in's
  "inference" is the workers' weights: its text is a digest of every worker's ``weights`` regions,
  so the same answer before and after a sleep means they came back bit for bit. Any other route is a 404;
* the engine (``vllm/v1/engine/core.py``): a sleep first pauses scheduling
  (``abort`` aborts running requests, ``wait`` waits for them to finish,
  ``keep`` keeps them); level 0 stops there. A pending pause is not called off
  by a wake. Level >= 1 then has the executor put every worker to sleep unless
  ``weights`` already sleep; ``wake_up`` drops ``scheduling`` from the tags,
  wakes the executor (nothing if it does not sleep, nothing if a tag is not
  asleep), and resumes scheduling once nothing sleeps. ``is_sleeping`` is
  "paused or asleep". One engine call runs at a time (its busy loop);
* the executor (``vllm/v1/executor/abstract.py``): ``sleeping_tags`` becomes
  ``{"weights", "kv_cache"}`` only after every worker slept; a failing worker
  makes the call fail and leaves it unset;
* errors: ``{"error": {"message", "type", "param", "code"}}`` with the HTTP
  status; a worker's failure is a 500 "Call to sleep method failed: Worker
  failed with error '...', please check the stack trace above for the root
  cause"; a bad query a 400 (vLLM's validation handler).

Stand-in controls, under ``/standin/`` (no vLLM equivalent; hibernate never calls them):
``GET /standin/workers`` (pids, digests, the fake runtime's counters),
``POST /standin/busy?requests=N`` (N requests running that only an abort ends),
``POST /standin/worker-fault?index=I&spec=S`` (``HIBERNATE_FAULT`` in a worker),
``POST /standin/die-during-sleep`` (the server kills itself once one worker slept).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import parse_qs, urlsplit

from tests.forkserver import run_then_exit
from tests.standins.vllm_parallel_state import COLLECTIVE_DIR_ENV

PAUSE_MODES = ("abort", "wait", "keep")
SLEEP_TAGS = frozenset(("weights", "kv_cache"))  # vllm/v1/executor/abstract.py
VERSION = "0.33.0"


class EngineError(Exception):
    """A failed engine call: vLLM's exception handler makes it a 500."""


class WorkerHandle:
    """One stand-in worker process, spoken to over its stdin/stdout.

    Forked from the server once it has imported vLLM, as vLLM's multiprocessing executor starts its
    workers by default (``VLLM_WORKER_MULTIPROC_METHOD=fork``): each is a separate process, a child of
    the server with the server's command line and its own environment, that loads the plugins itself.
    """

    def __init__(
        self, index: int, cudart: str, mb: int, world_size: int, collective_dir: Path, comm_suspend: bool
    ) -> None:
        # As vLLM's executor starts a worker: its rank in a world of `world_size`, with peers to meet
        # in collectives (tests/standins/vllm_parallel_state.py).
        env = {"RANK": str(index), "WORLD_SIZE": str(world_size), COLLECTIVE_DIR_ENV: str(collective_dir)}
        argv = [
            "--cudart",
            cudart,
            "--mb",
            str(mb),
            *(["--enable-nccl-comm-suspend"] if comm_suspend else []),
        ]
        self.index = index
        to_worker, from_worker = os.pipe(), os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.dup2(to_worker[0], 0)
            os.dup2(from_worker[1], 1)
            os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # no other worker's pipe: each sees its own EOF
            _run_worker(env, argv)
        os.close(to_worker[0])
        os.close(from_worker[1])
        self.stdin = os.fdopen(to_worker[1], "w")
        self.stdout = os.fdopen(from_worker[0], "r")
        self.lock = threading.Lock()
        self.ready: dict[str, Any] = {}

    def wait_ready(self) -> None:
        line = self.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.index} did not start")
        self.ready = json.loads(line)

    def call(self, command: str) -> dict[str, Any]:
        with self.lock:
            self.stdin.write(command + "\n")
            self.stdin.flush()
            line = self.stdout.readline()
        if not line:
            return {"ok": False, "error": f"worker {self.index} exited"}
        reply: dict[str, Any] = json.loads(line)
        return reply


def _run_worker(env: dict[str, str], argv: list[str]) -> NoReturn:
    """In the forked child: become the worker (tests/standins/vllm_worker.py)."""

    def worker_main() -> None:
        os.environ.update(env)
        sys.stdin = os.fdopen(0, "r")
        sys.stdout = os.fdopen(1, "w")
        sys.argv = ["tests.standins.vllm_worker", *argv]
        from tests.standins import vllm_worker

        vllm_worker.main()

    run_then_exit(worker_main)


class Engine:
    """The engine core and executor, as far as sleeping goes."""

    def __init__(self, workers: list[WorkerHandle]) -> None:
        self.workers = workers
        self.lock = threading.Lock()  # the engine core's busy loop: one call at a time
        self.changed = threading.Condition()
        self.paused = False
        self.sleeping_tags: set[str] = set()
        self.running_requests = 0
        self.die_during_sleep = False

    def _collective(self, command: str, after_first: Callable[[], None] | None = None) -> None:
        """Every worker runs ``command``; the first failure fails the call (after all have answered)."""
        with ThreadPoolExecutor(max_workers=len(self.workers)) as pool:
            futures = [pool.submit(w.call, command) for w in self.workers]
            replies = []
            for future in futures:
                replies.append(future.result())
                if after_first is not None and len(replies) == 1:
                    after_first()
        for reply in replies:
            if not reply.get("ok"):
                raise EngineError(
                    f"Worker failed with error '{reply.get('error')}', please check the stack trace above "
                    "for the root cause"
                )

    def sleep(self, level: int, mode: str) -> None:
        with self.lock:
            if mode == "abort":
                with self.changed:
                    self.running_requests = 0
                    self.changed.notify_all()
            self.paused = True
        if mode == "wait":  # a pending pause: the engine keeps serving other calls meanwhile
            with self.changed:
                self.changed.wait_for(lambda: self.running_requests == 0)
        if level < 1:
            return
        with self.lock:
            if "weights" in self.sleeping_tags:
                print("Executor is already sleeping.", file=sys.stderr, flush=True)
                return
            die = self._die if self.die_during_sleep else None
            try:
                self._collective(f"suspend {level}", after_first=die)
            except EngineError as exc:
                raise EngineError(f"Call to sleep method failed: {exc}") from None
            self.sleeping_tags |= SLEEP_TAGS

    @staticmethod
    def _die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def wake_up(self, tags: list[str] | None) -> bool:
        with self.lock:
            if tags is not None and "scheduling" in tags:
                tags = [t for t in tags if t != "scheduling"]
            if tags is None or tags:
                self._executor_wake_up(tags)
            fully_awake = not self.sleeping_tags
            if fully_awake:
                self.paused = False
                with self.changed:
                    self.changed.notify_all()
            return fully_awake

    def _executor_wake_up(self, tags: list[str] | None) -> None:
        if not self.sleeping_tags:
            print("Executor is not sleeping.", file=sys.stderr, flush=True)
            return
        for tag in tags or []:
            if tag not in self.sleeping_tags:
                print(f"Tag {tag} is not in sleeping tags {self.sleeping_tags}", file=sys.stderr, flush=True)
                return
        try:
            self._collective("resume" + "".join(f" {t}" for t in tags or []))
        except EngineError as exc:
            raise EngineError(f"Call to wake_up method failed: {exc}") from None
        if tags:
            self.sleeping_tags -= set(tags)
        else:
            self.sleeping_tags.clear()

    def is_sleeping(self) -> bool:
        with self.lock:
            return self.paused or bool(self.sleeping_tags)

    def complete(self, timeout: float = 300.0) -> str:
        """One "inference": waits while paused or asleep, counts as running meanwhile it computes."""
        with self.changed:
            if not self.changed.wait_for(lambda: not (self.paused or self.sleeping_tags), timeout):
                raise EngineError("the engine stayed paused")
            self.running_requests += 1
        try:
            with self.lock:
                regions = [w.call("digests").get("result") or {} for w in self.workers]
            # An answer depends on the weights; the KV cache is scratch (a sleep drops it, as vLLM's does).
            weights = [{k: v for k, v in r.items() if v.get("tag") == "weights"} for r in regions]
            return hashlib.sha256(json.dumps(weights, sort_keys=True).encode()).hexdigest()
        finally:
            with self.changed:
                self.running_requests -= 1
                self.changed.notify_all()


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error(param: str, message: str, value: str) -> dict[str, Any]:
    detail = {"type": "value_error", "loc": tuple(param.split(".")), "msg": message, "input": value}
    return error_body(f"1 validation error:\n  {detail}", "Bad Request", 400, param)


def make_handler(engine: Engine, dev_mode: bool, model: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            print(f"stand-in vllm: {format % args}", file=sys.stderr, flush=True)

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _not_found(self) -> None:
            self._send(404, error_body("Not Found", "Not Found", 404))

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            if url.path == "/version":
                self._send(200, {"version": VERSION})
            elif url.path == "/health":
                self._send(200, {})
            elif url.path == "/is_sleeping" and dev_mode:
                self._send(200, {"is_sleeping": engine.is_sleeping()})
            elif url.path == "/standin/workers":
                self._send(200, [self._worker(w) for w in engine.workers])
            elif url.path == "/v1/models":
                card = {"id": model, "object": "model", "created": 0, "owned_by": "vllm", "root": model}
                self._send(200, {"object": "list", "data": [card]})
            else:
                self._not_found()

        @staticmethod
        def _worker(worker: WorkerHandle) -> dict[str, Any]:
            return {
                "index": worker.index,
                "pid": worker.pid,
                "digests": worker.call("digests").get("result"),
                "cuda": worker.call("cuda").get("result"),
            }

        def do_POST(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            try:
                if url.path == "/sleep" and dev_mode:
                    self._sleep(query)
                elif url.path == "/wake_up" and dev_mode:
                    tags = query.get("tags") or None
                    fully_awake = engine.wake_up(list(tags) if tags else None)
                    self._send(200, {"status": "awake" if fully_awake else "sleeping", "tags": tags})
                elif url.path == "/standin/busy":
                    with engine.changed:
                        engine.running_requests = int(query["requests"][0])
                        engine.changed.notify_all()
                    self._send(200, {"running_requests": engine.running_requests})
                elif url.path == "/standin/worker-fault":
                    worker = engine.workers[int(query["index"][0])]
                    self._send(200, worker.call(f"fault {query['spec'][0]}"))
                elif url.path == "/v1/completions":
                    self._completion()
                elif url.path == "/standin/die-during-sleep":
                    engine.die_during_sleep = True
                    self._send(200, {"die_during_sleep": True})
                else:
                    self._not_found()
            except EngineError as exc:
                self._send(500, error_body(str(exc), "InternalServerError", 500))

        def _completion(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if request.get("model") != model:
                message = f"The model `{request.get('model')}` does not exist."
                self._send(404, error_body(message, "NotFoundError", 404, "model"))
                return
            text = engine.complete()
            answer = {"id": "cmpl-standin", "object": "text_completion", "created": 0, "model": model,
                      "choices": [{"index": 0, "text": text, "finish_reason": "length"}]}  # fmt: skip
            if not request.get("stream"):
                self._send(200, answer)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for piece in (text[:32], text[32:]):
                event = {**answer, "choices": [{"index": 0, "text": piece, "finish_reason": None}]}
                chunk = f"data: {json.dumps(event)}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            done = b"data: [DONE]\n\n"
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))

        def _sleep(self, query: dict[str, list[str]]) -> None:
            raw_level = (query.get("level") or ["1"])[0]
            mode = (query.get("mode") or ["abort"])[0]
            if not raw_level.lstrip("-").isdigit():
                self._send(400, validation_error("query.level", "Input should be a valid integer", raw_level))
                return
            level = int(raw_level)
            if not 0 <= level <= 2:
                self._send(400, validation_error("query.level", "Input should be between 0 and 2", raw_level))
                return
            if mode not in PAUSE_MODES:
                self._send(
                    400, validation_error("query.mode", "Input should be 'abort', 'wait' or 'keep'", mode)
                )
                return
            engine.sleep(level, mode)
            self._send(200, {"status": "sleeping", "level": level})

    return Handler


class ApiServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 2048  # uvicorn's default backlog, which vLLM's API server listens with


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cudart", required=True)
    parser.add_argument("--ready", required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mb", type=int, default=0)
    parser.add_argument("--host", default=None)
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--enable-sleep-mode", action="store_true")
    parser.add_argument("--sleep-mode-backend", default="cumem")
    parser.add_argument("--served-model-name", default="standin")
    # vLLM's parser takes a flag spelt with "_" as well as "-".
    parser.add_argument("--enable-nccl-comm-suspend", "--enable_nccl_comm_suspend", action="store_true")
    parser.add_argument("--disable-custom-all-reduce", action="store_true")
    args = parser.parse_args()
    dev_mode = bool(int(os.environ.get("VLLM_SERVER_DEV_MODE", "0")))

    collective_dir = Path(args.ready).parent / f"collectives-{os.getpid()}"  # beside the ready file
    collective_dir.mkdir()
    import vllm.plugins

    workers = [
        WorkerHandle(i, args.cudart, args.mb, args.workers, collective_dir, args.enable_nccl_comm_suspend)
        for i in range(args.workers)
    ]
    vllm.plugins.load_general_plugins()  # the API server's plugins too: hibernate's agent, an empty pool
    for worker in workers:
        worker.wait_ready()
    engine = Engine(workers)
    server = ApiServer(
        (args.host or "0.0.0.0", args.port), make_handler(engine, dev_mode, args.served_model_name)
    )
    ready = {"pid": os.getpid(), "port": args.port, "workers": [w.pid for w in workers]}
    tmp = Path(f"{args.ready}.tmp")
    tmp.write_text(json.dumps(ready))
    tmp.rename(args.ready)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    server.serve_forever()


if __name__ == "__main__":
    main()
