"""A demo target: a small transformer language model that hibernate can put to sleep.

    python -m hibernate.demo serve [--size-mb 512] [--control PATH]   # the target
    python -m hibernate.demo infer --control PATH                     # ask it for an output
    python -m hibernate.demo hold --control PATH --seconds 5          # hold the guard (a long step)
    python -m hibernate.demo release --control PATH                   # end the holds in progress now
    python -m hibernate.demo mark --control PATH                      # fill scratch, rewrite side (async)
    python -m hibernate.demo inspect --control PATH                   # scratch zeroed? side, private intact?
    python -m hibernate.demo serve --http-port 8001 [--model-name demo]  # also an OpenAI-style HTTP server
    python -m hibernate.demo serve --device cuda --pool --graphs      # same addresses, a CUDA graph replayed

The model has random (seeded) weights, tracked as ``weights``, and a KV cache
tracked with ``keep=False``. Each ``infer`` request runs a fixed prompt through
the model inside ``hibernate.guard()`` (prefill into the KV cache, then a few
greedy decode steps) and answers the SHA-256 of the final logits' bytes and the
generated tokens: equal digests before and after a sleep mean bit-exact weights.

Beside the model it holds what a sleep must handle and a check must see:
a ``scratch`` tensor tracked like the KV cache, dropped (``mark`` fills it, and
``inspect`` says whether a wake gave it back zero-filled), and on a GPU a
``side`` tensor that ``mark`` rewrites on a side stream after a spin kernel,
without waiting (a spill that read it before synchronizing would keep stale
bytes), and, where torch has ``torch.cuda.MemPool``, a ``private`` tensor in a
private memory pool (a sleep names it in its warnings). ``inspect`` checks
each against the pattern ``mark`` wrote. ``--untracked`` starts the agent but
tracks nothing, so a check of what the pools did can be shown to fail;
``--background-work`` runs a thread that does device work outside ``guard()``
all along (``inspect`` counts its rounds).

With ``--pool`` the weights, the KV cache and the probes are allocated inside
``hibernate.pool()`` instead of tracked (the weights kept, the cache and
scratch dropped), so they keep their addresses across every sleep (``infer``
answers the weights' addresses, ``pointers``, to show it, as it does with
``--graphs``). With ``--graphs`` it also captures a CUDA graph of the prompt's forward pass at start-up and
``infer`` replays that same graph (``graph_digest``) beside the eager run: with
``--pool`` through ``hibernate.cuda_graph``, so the graph's own memory is
hibernated too and its replay after a wake is bit-exact; without, through
``torch.cuda.graph`` over tracked weights, which a sleep must refuse (exit 15)
unless told ``--allow-moves``. ``--graphs static`` captures instead a graph that
allocates nothing: the prompt's embedding and the first block's MLP over
tracked weights, each result written with ``out=`` into buffers made before the
capture, so its own pool holds no memory (``graph_pool_bytes`` in the ready
answer) and only the graph itself knows which weights it reads.

With ``--http-port`` it also serves a small OpenAI-style API on 127.0.0.1
(``--http-host`` for another address) for ``hibernate serve``: ``GET
/v1/models``, ``POST /v1/completions`` and ``POST /v1/chat/completions`` (the
same inference, the tokens as the text or the assistant's message; ``"stream":
true`` sends one server-sent event per token, in the shape of OpenAI's
``text_completion`` or ``chat.completion.chunk``, then one with the finish reason
and, in an extra field, the output's ``digest``, then ``data: [DONE]``). While the
process sleeps a completion is refused (503), not held: a proxy that forwarded
one to a sleeping demo would be caught. Demo-only extensions, for tests: a
request with ``"paced": true`` streams each token after the first only once
``POST /demo/step`` allows it, and ``GET /demo/stats`` counts completions,
streams and streams whose client left before the end.

This module holds the target (the model, its probes and graphs), its control
commands on the Unix socket and the command line; the HTTP API is
:mod:`hibernate.demo_http`. The graphs are captured here: a check that a
sleep names where a graph was captured looks for ``demo.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hibernate.demo_http import HttpApi, serve_http

PROMPT_TOKENS = 16
DECODE_STEPS = 4
VOCAB = 8192
MAX_SEQ = 64
PROBE_BYTES = 1 << 20  # each of the scratch, side and private tensors
# The side stream's spin kernel before its write: about 3 s on an H200 (1.98 GHz). It must outlast
# what comes between ``mark`` and a sleep's spill (a CLI's start, discovery, the quiesce): a write
# that landed before the sleep began proves nothing about the spill waiting for it.
SPIN_CYCLES = 6_000_000_000


def _dimensions(size_bytes: int, element_size: int) -> tuple[int, int]:
    """(d_model, layers) giving about ``size_bytes`` of weights."""
    d_model = 1024 if size_bytes >= 256 << 20 else 512 if size_bytes >= 32 << 20 else 256
    per_layer = 12 * d_model * d_model * element_size
    embedding = VOCAB * d_model * element_size
    return d_model, max(1, round((size_bytes - embedding) / per_layer))


def pattern(torch: Any, nbytes: int, device: str) -> Any:
    """The bytes ``mark`` writes into the side and private tensors: never all zero, never a constant."""
    return (torch.arange(nbytes, dtype=torch.int64, device=device) % 251 + 1).to(torch.uint8)


class Probes:
    """What a sleep must handle beside the model: a dropped tensor, a side stream's write, a private pool.

    ``mark`` (inside ``hibernate.guard()``, as a program's step would) fills
    ``scratch`` and clears ``side`` and ``private``, waits for that, then
    queues on a side stream a spin kernel and the write of the pattern into
    ``side`` and returns without waiting: a sleep that spilled ``side`` before
    synchronizing the device would keep zeros. ``private`` is written at once.
    ``inspect`` reads all three back, and says in what state of hibernate the
    side write landed: only one that landed once a sleep had begun
    (``quiesced`` or later, not ``running``) shows that the spill waited for it.
    """

    def __init__(self, torch: Any, device: str, pooled: bool = False) -> None:
        import hibernate

        self.torch = torch
        self.device = device
        self.cuda = device.startswith("cuda")
        self.pooled = pooled  # in hibernate.pool(), not tracked: no private pool then (see below)
        with hibernate.pool("kv_cache", keep=False) if pooled else contextlib.nullcontext():
            self.scratch = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=device)
        with hibernate.pool("weights") if pooled else contextlib.nullcontext():
            self.side = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=device)
        self.stream = torch.cuda.Stream() if self.cuda else None
        self.private: Any = None
        self.background: threading.Thread | None = None
        self.tracked = False
        self.rounds = 0
        self.background_error: str | None = None
        self.private_pool: Any = None
        self.side_watch: threading.Thread | None = None
        self.side_landed: dict[str, Any] | None = None
        # A private pool beside expandable segments is left out: not every torch allows the two together.
        expandable = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if (
            self.cuda
            and not pooled  # a tracked storage outside the pools would move under the demo's graph
            and not expandable
            and hasattr(torch.cuda, "MemPool")
            and hasattr(torch.cuda, "use_mem_pool")
        ):
            self.private_pool = torch.cuda.MemPool()
            with torch.cuda.use_mem_pool(self.private_pool):
                self.private = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=device)

    def start_background(self) -> None:
        """A thread that keeps doing device work outside ``guard()`` on untracked tensors, counting its
        rounds: what a program's stray thread does while the process sleeps."""
        torch = self.torch
        self.rounds, self.background_error = 0, None

        def work() -> None:
            a = torch.ones(256, 256, device=self.device)
            try:
                while True:
                    b = a @ a
                    if self.cuda:
                        torch.cuda.synchronize()
                    else:
                        time.sleep(0.01)  # a CPU's cores are the test machine's too
                    if float(b[0, 0]) != 256.0:
                        raise RuntimeError(f"the background product went wrong: {float(b[0, 0])}")
                    self.rounds += 1
            except Exception as exc:  # reported by inspect
                self.background_error = f"{type(exc).__name__}: {exc}"

        self.background = threading.Thread(target=work, daemon=True, name="demo-background")
        self.background.start()

    def track(self) -> None:
        import hibernate

        self.tracked = True
        if self.pooled:
            return  # their pools hibernate them
        hibernate.track(self.scratch, tag="kv_cache", keep=False, name="scratch")
        hibernate.track(self.side, tag="weights", name="side")
        if self.private is not None:
            hibernate.track(self.private, tag="weights", name="private")

    def mark(self) -> dict[str, Any]:
        import hibernate

        torch = self.torch
        if self.private is not None and self.tracked:
            # A wake may give a storage back through the default pool: a fresh tensor in the private
            # pool, tracked in its place, makes every sleep meet one there.
            hibernate.untrack(self.private)
            with torch.cuda.use_mem_pool(self.private_pool):
                self.private = torch.zeros(PROBE_BYTES, dtype=torch.uint8, device=self.device)
            hibernate.track(self.private, tag="weights", name="private")
        with hibernate.guard():
            self.scratch.fill_(0xA5)
            self.side.zero_()
            if self.private is not None:
                self.private.copy_(pattern(torch, PROBE_BYTES, self.device))
            if self.stream is None:
                self.side.copy_(pattern(torch, PROBE_BYTES, self.device))
                return {"side_stream": False, "private_pool": False}
            torch.cuda.synchronize()
            source = pattern(torch, PROBE_BYTES, self.device)
            torch.cuda.synchronize()
            landed = torch.cuda.Event()
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(SPIN_CYCLES)
                self.side.copy_(source)
                landed.record(self.stream)
            source.record_stream(self.stream)
        self.watch_side(landed)
        return {"side_stream": True, "private_pool": self.private is not None}

    def watch_side(self, landed: Any) -> None:
        """Note hibernate's state (and the seconds since ``mark``) when the side write lands."""
        import hibernate

        queued = time.perf_counter()
        self.side_landed = None

        def watch() -> None:
            landed.synchronize()
            self.side_landed = {"state": hibernate.state(), "seconds": round(time.perf_counter() - queued, 3)}

        self.side_watch = threading.Thread(target=watch, daemon=True, name="demo-side-watch")
        self.side_watch.start()

    def inspect(self) -> dict[str, Any]:
        import hibernate

        torch = self.torch
        with hibernate.guard():
            if self.cuda:
                torch.cuda.synchronize()
            want = pattern(torch, PROBE_BYTES, self.device)
            if self.side_watch is not None:
                self.side_watch.join(60)
            return {
                "scratch_zeroed": bool((self.scratch == 0).all()),
                "side_kept": bool(torch.equal(self.side, want)),
                "side_stream": self.stream is not None,
                "side_landed": self.side_landed,
                "private_kept": None if self.private is None else bool(torch.equal(self.private, want)),
                "background": None
                if self.background is None
                else {
                    "alive": self.background.is_alive(),
                    "rounds": self.rounds,
                    "error": self.background_error,
                },
            }


def build(
    size_mb: int,
    dtype_name: str,
    device: str,
    seed: int,
    tracked: bool = True,
    pooled: bool = False,
    graphs: bool | str = False,
) -> Any:
    """Build the model, KV cache and probes, track them with hibernate; returns the runner and probes.

    ``tracked=False`` starts the agent with nothing tracked: every sleep then
    moves no byte, which is how a check of what the pools did is shown to fail.
    ``pooled`` allocates them in ``hibernate.pool()`` instead; ``graphs``
    captures a CUDA graph of the prompt's forward pass, or with ``"static"`` one that allocates
    nothing (see the module docstring).
    """
    import torch
    from torch import nn

    import hibernate

    dtype = getattr(torch, dtype_name)
    element_size = torch.empty(0, dtype=dtype).element_size()
    d_model, layers = _dimensions(size_mb << 20, element_size)
    heads = max(1, d_model // 64)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.RMSNorm(d_model)
            self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
            self.out = nn.Linear(d_model, d_model, bias=False)
            self.norm2 = nn.RMSNorm(d_model)
            self.up = nn.Linear(d_model, 4 * d_model, bias=False)
            self.down = nn.Linear(4 * d_model, d_model, bias=False)

        def forward(self, x: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
            steps = x.shape[0]
            q, k, v = self.qkv(self.norm1(x)).split(d_model, dim=-1)
            kv[0, start : start + steps] = k
            kv[1, start : start + steps] = v
            keys, values = kv[0, : start + steps], kv[1, : start + steps]

            def split(t: torch.Tensor) -> torch.Tensor:
                return t.view(t.shape[0], heads, d_model // heads).transpose(0, 1)

            mask = torch.ones(steps, start + steps, dtype=torch.bool, device=x.device).tril(diagonal=start)
            attn = nn.functional.scaled_dot_product_attention(
                split(q), split(keys), split(values), attn_mask=mask
            )
            x = x + self.out(attn.transpose(0, 1).reshape(steps, d_model))
            return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))

    class TinyLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, d_model)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm = nn.RMSNorm(d_model)

        def forward(self, tokens: torch.Tensor, kv: torch.Tensor, start: int) -> torch.Tensor:
            x = self.embed(tokens)
            for index, block in enumerate(self.blocks):
                x = block(x, kv[index], start)
            return self.norm(x) @ self.embed.weight.T  # tied output projection

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model = TinyLM()
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        with hibernate.pool("weights") if pooled else contextlib.nullcontext():
            for param in model.parameters():  # a copy each, made inside the pool (``to`` may not copy)
                param.data = param.data.to(device=device, dtype=dtype, copy=True)
        model = model.eval()
    with hibernate.pool("kv_cache", keep=False) if pooled else contextlib.nullcontext():
        kv_cache = torch.zeros(layers, 2, MAX_SEQ, d_model, dtype=dtype, device=device)
    probes = Probes(torch, device, pooled)
    if pooled:
        hibernate.track([])  # the agent and its signals; the pools hibernate everything
    elif tracked:
        hibernate.track(model, tag="weights")
        hibernate.track(kv_cache, tag="kv_cache", keep=False, name="kv_cache")
        probes.track()
    else:
        hibernate.track([])  # the agent alone
    prompt = torch.randint(0, VOCAB, (PROMPT_TOKENS,), generator=generator).to(device)
    graph = None
    if graphs:
        from hibernate.errors import HibernateError, UnsupportedError

        try:
            if graphs == "static":
                graph = capture_static_graph(torch, model, prompt)
            else:
                graph = capture_prompt_graph(torch, model, prompt, kv_cache, pooled)
        except HibernateError:
            raise
        except Exception as exc:  # a CPU torch has no CUDA graphs: the words, not a traceback
            raise UnsupportedError(
                f"--graphs: capturing a CUDA graph on {device} failed ({type(exc).__name__}: {exc})",
                hint="run the demo with --device cuda",
            ) from exc

    def infer() -> dict[str, Any]:
        started = time.perf_counter()
        with hibernate.guard(), torch.no_grad():
            graph_digest = graph.replay() if graph is not None else None
            logits = model(prompt, kv_cache, 0)
            generated = []
            position = PROMPT_TOKENS
            for _ in range(DECODE_STEPS):
                token = logits[-1].float().argmax().reshape(1)
                generated.append(int(token))
                logits = model(token, kv_cache, position)
                position += 1
            final = logits.float().cpu().contiguous()
        return {
            "digest": tensor_digest(final),
            "tokens": generated,
            "graph_digest": graph_digest,
            # Where pools or graphs are the point: one address per parameter is noise elsewhere.
            "pointers": weight_pointers(model, kv_cache) if pooled or graphs else None,
            "seconds": round(time.perf_counter() - started, 4),
        }

    weight_bytes = sum(p.nbytes for p in model.parameters())
    return (
        infer,
        probes,
        {
            "d_model": d_model,
            "layers": layers,
            "weight_bytes": weight_bytes,
            "kv_bytes": kv_cache.nbytes,
            "device": device,
            "tracked": tracked,
            "side_stream": probes.stream is not None,
            "private_pool": probes.private is not None,
            "pooled": pooled,
            "graphs": graph is not None,
            "graph_kind": None if graph is None else "static" if graphs == "static" else "forward",
            "graph_pool_bytes": None if graph is None else graph.pool_bytes(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        },
    )


def tensor_digest(tensor: Any) -> str:
    """SHA-256 of a CPU tensor's bytes."""
    return hashlib.sha256(ctypes.string_at(tensor.data_ptr(), tensor.nbytes)).hexdigest()


def weight_pointers(model: Any, kv_cache: Any) -> dict[str, int]:
    """Where the weights and the KV cache live: a pooled sleep and wake must leave every one in place."""
    pointers = {name: int(param.data_ptr()) for name, param in model.named_parameters()}
    pointers["kv_cache"] = int(kv_cache.data_ptr())
    return pointers


class PromptGraph:
    """A CUDA graph of the prompt's forward pass, captured once; each replay answers its output's digest."""

    def __init__(self, torch: Any, graph: Any, output: Any, buffers: tuple[Any, ...] = ()) -> None:
        self._torch = torch
        self._graph = graph
        self._output = output
        # The graph writes these on every replay, by address, and holds no reference to them: freed,
        # their memory would be handed out again and overwritten by each replay.
        self._buffers = buffers

    def replay(self) -> str:
        self._graph.replay()
        if self._output.is_cuda:
            self._torch.cuda.synchronize()
        return tensor_digest(self._output.float().cpu().contiguous())

    def pool_bytes(self) -> int | None:
        """What the graph's own memory pool holds (torch's allocator snapshot); None where unknown.

        A graph whose pool holds nothing is invisible in that snapshot: only the
        graph itself knows which weights it reads.
        """
        try:
            pool = tuple(self._graph.pool())
            segments = self._torch.cuda.memory_snapshot()
        except Exception:  # no snapshot on this torch or device: unknown, not zero
            return None
        return sum(int(s["total_size"]) for s in segments if tuple(s.get("segment_pool_id") or ()) == pool)


def capture_prompt_graph(torch: Any, model: Any, prompt: Any, kv_cache: Any, pooled: bool) -> PromptGraph:
    """Capture ``model(prompt, kv_cache, 0)``: in hibernate's pool where ``pooled``, else torch's own.

    As torch's documentation asks, the forward pass runs a few times on a side
    stream first, so that lazy initialisation is not captured.
    """
    import hibernate

    with torch.no_grad():
        if prompt.is_cuda:
            warmup = torch.cuda.Stream()
            warmup.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(warmup):
                for _ in range(3):
                    model(prompt, kv_cache, 0)
            torch.cuda.current_stream().wait_stream(warmup)
        graph = torch.cuda.CUDAGraph()
        with hibernate.cuda_graph(graph) if pooled else torch.cuda.graph(graph):
            output = model(prompt, kv_cache, 0)
    return PromptGraph(torch, graph, output)


def capture_static_graph(torch: Any, model: Any, prompt: Any) -> PromptGraph:
    """A graph over tracked weights that allocates nothing: the prompt's embedding, then the first
    block's MLP, each written with ``out=`` into a buffer made before the capture.

    On a GPU the warm-up runs on the capture's own stream, so that cuBLAS's
    workspace for that stream exists before the capture and does not come from
    the graph's pool either.
    """
    embed, block = model.embed.weight, model.blocks[0]
    rows, width = prompt.shape[0], embed.shape[1]
    hidden = torch.empty(rows, width, dtype=embed.dtype, device=embed.device)
    up = torch.empty(rows, block.up.weight.shape[0], dtype=embed.dtype, device=embed.device)
    down = torch.empty(rows, width, dtype=embed.dtype, device=embed.device)

    def forward() -> None:
        torch.index_select(embed, 0, prompt, out=hidden)
        torch.mm(hidden, block.up.weight.T, out=up)
        torch.mm(up, block.down.weight.T, out=down)

    stream = torch.cuda.Stream() if prompt.is_cuda else None
    with torch.no_grad():
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            forward()
    return PromptGraph(torch, graph, down, (hidden, up))


def serve(args: argparse.Namespace) -> int:
    import hibernate

    infer, probes, shape = build(
        args.size_mb, args.dtype, args.device, args.seed, not args.untracked, args.pool, args.graphs
    )
    if args.background_work:
        probes.start_background()
    api = HttpApi(infer, args.model_name)
    http = serve_http(api, args.http_port, args.http_host) if args.http_port is not None else None
    if http is not None:
        shape["http_port"] = http.server_address[1]
    control = Path(args.control) if args.control else Path(f"/tmp/hibernate-demo-{os.getpid()}.sock")
    with contextlib.suppress(FileNotFoundError):
        control.unlink()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(control))
    os.chmod(control, 0o600)
    server.listen(8)
    ready = {"pid": os.getpid(), "control": str(control), **shape}
    if args.ready_file:
        tmp = Path(f"{args.ready_file}.tmp")
        tmp.write_text(json.dumps(ready))
        tmp.rename(args.ready_file)
    print(json.dumps({"ready": ready}), flush=True)
    stop = threading.Event()
    holds: set[threading.Event] = set()  # one per hold in progress: set by a release
    holding = threading.Lock()

    def handle(conn: socket.socket) -> None:
        with conn, conn.makefile("rw") as stream:
            command = stream.readline().strip()
            if command == "infer":
                stream.write(json.dumps(infer()) + "\n")
            elif command == "mark":
                stream.write(json.dumps(probes.mark()) + "\n")
            elif command == "inspect":
                stream.write(json.dumps(probes.inspect()) + "\n")
            elif command.startswith("hold "):
                released = threading.Event()
                with holding:
                    holds.add(released)
                try:
                    with hibernate.guard():  # a long step: a sleep must wait for it
                        stream.write('{"holding": true}\n')
                        stream.flush()
                        released.wait(float(command.split()[1]))
                finally:
                    with holding:
                        holds.discard(released)
            elif command == "release":  # every hold in progress ends now
                with holding:
                    ended = len(holds)
                    for hold in holds:
                        hold.set()
                    holds.clear()  # a hold ended is not counted by the next release
                stream.write(json.dumps({"released": ended}) + "\n")
            elif command == "quit":
                stream.write('{"bye": true}\n')
                stop.set()
            else:
                stream.write(json.dumps({"error": f"unknown command {command!r}"}) + "\n")

    def handle_quietly(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            handle(conn)

    # Handlers still running when serve returns are waited for (a while): a daemon thread that
    # drops the last reference to the model while the interpreter shuts down is ended inside
    # torch's tensor deallocation, which aborts the process ("terminate called without an
    # active exception", seen after a wake and a quit).
    handlers: list[threading.Thread] = []
    server.settimeout(0.2)
    try:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            handlers = [thread for thread in handlers if thread.is_alive()]
            handlers.append(threading.Thread(target=handle_quietly, args=(conn,), daemon=True))
            handlers[-1].start()
        return 0
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            control.unlink()
        for thread in handlers:
            thread.join(timeout=10)


def request(control: str, command: str, timeout: float = 120.0) -> dict[str, Any]:
    """Send one command to a serving demo and return its JSON answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(timeout)
        conn.connect(control)
        with conn.makefile("rw") as stream:
            stream.write(command + "\n")
            stream.flush()
            answer: dict[str, Any] = json.loads(stream.readline())
            return answer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hibernate.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("serve", help="start the demo target")
    run.add_argument("--size-mb", type=int, default=512, help="weights size (default 512 MiB)")
    run.add_argument("--dtype", default="bfloat16", help="torch dtype of the weights")
    run.add_argument("--device", default="cpu", help="cpu or cuda")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--control", help="Unix socket to answer requests on")
    run.add_argument("--ready-file", help="write {pid, control, ...} here once serving")
    run.add_argument(
        "--http-port", type=int, help="also serve an OpenAI-style API on 127.0.0.1:PORT (0: any)"
    )
    run.add_argument("--http-host", default="127.0.0.1", help="the address the HTTP API listens on")
    run.add_argument("--model-name", default="demo", help="the model name the HTTP API answers to")
    run.add_argument(
        "--untracked", action="store_true", help="start the agent but track nothing (a check's negative case)"
    )
    run.add_argument(
        "--background-work", action="store_true", help="a thread doing device work outside guard() throughout"
    )
    run.add_argument(
        "--pool", action="store_true", help="allocate in hibernate.pool(): same addresses after every wake"
    )
    run.add_argument(
        "--graphs",
        nargs="?",
        const="forward",
        choices=("forward", "static"),
        help="capture a CUDA graph of the forward pass and replay it on every infer "
        "(with --pool through hibernate.cuda_graph); 'static': one that allocates nothing, "
        "writing into buffers made before it with out=",
    )
    for name in ("infer", "quit", "hold", "release", "mark", "inspect"):
        client = sub.add_parser(name, help=f"send '{name}' to a serving demo")
        client.add_argument("--control", required=True)
        if name == "hold":
            client.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.command == "serve" and args.pool and args.untracked:
        parser.error("--pool and --untracked contradict each other: a pool hibernates what it holds")
    if args.command == "serve" and args.pool and args.graphs == "static":
        parser.error("--graphs static is a graph over tracked weights; with --pool use --graphs")
    if args.command == "serve":
        from hibernate.errors import HibernateError

        try:
            return serve(args)
        except HibernateError as exc:  # --pool without a provider, say: the words, not a traceback
            print(f"demo: {exc}", file=sys.stderr)
            return int(exc.exit_code)
    command = f"hold {args.seconds}" if args.command == "hold" else args.command
    print(json.dumps(request(args.control, command)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
