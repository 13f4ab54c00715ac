"""A demo target: a small transformer language model that hibernate can put to sleep.

    python -m hibernate.demo serve [--size-mb 512] [--control PATH]   # the target
    python -m hibernate.demo infer --control PATH                     # ask it for an output
    python -m hibernate.demo hold --control PATH --seconds 5          # hold the guard (a long step)

The model has random (seeded) weights, tracked as ``weights``, and a KV cache
tracked with ``keep=False``. Each ``infer`` request runs a fixed prompt through
the model inside ``hibernate.guard()`` (prefill into the KV cache, then a few
greedy decode steps) and answers the SHA-256 of the final logits' bytes and the
generated tokens: equal digests before and after a sleep mean bit-exact weights.
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

PROMPT_TOKENS = 16
DECODE_STEPS = 4
VOCAB = 8192
MAX_SEQ = 64


def _dimensions(size_bytes: int, element_size: int) -> tuple[int, int]:
    """(d_model, layers) giving about ``size_bytes`` of weights."""
    d_model = 1024 if size_bytes >= 256 << 20 else 512 if size_bytes >= 32 << 20 else 256
    per_layer = 12 * d_model * d_model * element_size
    embedding = VOCAB * d_model * element_size
    return d_model, max(1, round((size_bytes - embedding) / per_layer))


def build(size_mb: int, dtype_name: str, device: str, seed: int) -> Any:
    """Build the model and KV cache, track them with hibernate; returns the runner."""
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
        model = model.to(device=device, dtype=dtype).eval()
    kv_cache = torch.zeros(layers, 2, MAX_SEQ, d_model, dtype=dtype, device=device)
    hibernate.track(model, tag="weights")
    hibernate.track(kv_cache, tag="kv_cache", keep=False, name="kv_cache")
    prompt = torch.randint(0, VOCAB, (PROMPT_TOKENS,), generator=generator).to(device)

    def infer() -> dict[str, Any]:
        started = time.perf_counter()
        with hibernate.guard(), torch.no_grad():
            logits = model(prompt, kv_cache, 0)
            generated = []
            position = PROMPT_TOKENS
            for _ in range(DECODE_STEPS):
                token = logits[-1].float().argmax().reshape(1)
                generated.append(int(token))
                logits = model(token, kv_cache, position)
                position += 1
            final = logits.float().cpu().contiguous()
        digest = hashlib.sha256(ctypes.string_at(final.data_ptr(), final.nbytes)).hexdigest()
        return {
            "digest": digest,
            "tokens": generated,
            "seconds": round(time.perf_counter() - started, 4),
        }

    weight_bytes = sum(p.nbytes for p in model.parameters())
    return infer, {
        "d_model": d_model,
        "layers": layers,
        "weight_bytes": weight_bytes,
        "kv_bytes": kv_cache.nbytes,
    }


def serve(args: argparse.Namespace) -> int:
    import hibernate

    infer, shape = build(args.size_mb, args.dtype, args.device, args.seed)
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

    def handle(conn: socket.socket) -> None:
        with conn, conn.makefile("rw") as stream:
            command = stream.readline().strip()
            if command == "infer":
                stream.write(json.dumps(infer()) + "\n")
            elif command.startswith("hold "):
                with hibernate.guard():  # a long step: a sleep must wait for it
                    stream.write('{"holding": true}\n')
                    stream.flush()
                    time.sleep(float(command.split()[1]))
            elif command == "quit":
                stream.write('{"bye": true}\n')
                stop.set()
            else:
                stream.write(json.dumps({"error": f"unknown command {command!r}"}) + "\n")

    def handle_quietly(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            handle(conn)

    server.settimeout(0.2)
    try:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            threading.Thread(target=handle_quietly, args=(conn,), daemon=True).start()
        return 0
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            control.unlink()


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
    for name in ("infer", "quit", "hold"):
        client = sub.add_parser(name, help=f"send '{name}' to a serving demo")
        client.add_argument("--control", required=True)
        if name == "hold":
            client.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    command = f"hold {args.seconds}" if args.command == "hold" else args.command
    print(json.dumps(request(args.control, command)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
