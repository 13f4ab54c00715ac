"""A child of scripts/gpu-check: does memory a later allocation gets overlap what a captured graph writes?

    python scripts/lib/gpu_check_graph_pool.py [--elements N]

A CUDA graph captured into a memory pool allocates its intermediates and
outputs there; a block freed during the capture goes back to that pool's free
list, and the graph writes it again on every replay. A tensor allocated later
in the same pool may be handed that block. The child shows what torch does,
twice, with the same capture (``tmp = x * 2; out = tmp + 1; del tmp``):

* ``plain``: captured into a ``torch.cuda.MemPool`` of the program's own, then
  a tensor allocated with ``torch.cuda.use_mem_pool`` on that pool;
* ``hibernate``: captured with ``hibernate.cuda_graph(tag=...)``, then a tensor
  allocated in ``hibernate.pool(tag)`` of the same tag, which must never be
  given memory the graph writes (a refusal of that allocation is an answer too).

For each: the ranges the capture allocated (``written``), the new tensor's
range (``probe``), whether they overlap, whether a replay changed the new
tensor's bytes (``clobbered``), and whether the graph computed ``x * 2 + 1``
(``replay_correct``). It prints one JSON line, then waits for a line on stdin
(the parent reads ``hibernate status`` meanwhile: the graphs the agent saw),
then waits to be checkpointed and killed, as every CUDA process of the run.

Run on a GPU, or in gpu-check's dry run with the stand-ins of
``tests/standins/site`` (torch_memory_saver, CUDA graphs, ``MemPool``) on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))

TAG = "gpu-check-graph"
PROBE_VALUE = 7.0


def overlaps(ranges: list[tuple[int, int]], start: int, nbytes: int) -> bool:
    """Whether ``[start, start + nbytes)`` meets any of ``ranges`` (address, bytes)."""
    return any(start < address + size and address < start + nbytes for address, size in ranges)


def shared(
    torch: Any,
    device: str,
    elements: int,
    capture: Callable[[Any], contextlib.AbstractContextManager[Any]],
    allocate_in: Callable[[], contextlib.AbstractContextManager[Any]],
) -> dict[str, Any]:
    """One capture (an intermediate freed inside it), then one tensor allocated in the same pool."""
    x = torch.arange(elements, dtype=torch.float32, device=device)
    written: list[tuple[int, int]] = []
    graph = torch.cuda.CUDAGraph()
    with capture(graph):
        tmp = x * 2
        out = tmp + 1
        written += [(int(tmp.data_ptr()), int(tmp.nbytes)), (int(out.data_ptr()), int(out.nbytes))]
        del tmp  # back to the pool's free list, while the graph goes on writing it on every replay
    graph.replay()
    if device == "cuda":
        torch.cuda.synchronize()
    found: dict[str, Any] = {
        "written": [{"address": a, "bytes": n} for a, n in written],
        "replay_correct": bool(torch.equal(out, x * 2 + 1)),
    }
    try:
        with allocate_in():
            probe = torch.full((elements,), PROBE_VALUE, dtype=torch.float32, device=device)
    except Exception as exc:  # refused: no memory of the graph's can be handed out
        found["refused"] = f"{type(exc).__name__}: {exc}"
        return found
    found["probe"] = {"address": int(probe.data_ptr()), "bytes": int(probe.nbytes)}
    found["overlap"] = overlaps(written, int(probe.data_ptr()), int(probe.nbytes))
    graph.replay()
    if device == "cuda":
        torch.cuda.synchronize()
    found["clobbered"] = not bool((probe == PROBE_VALUE).all())
    found["graph"] = graph  # kept alive until the parent has read the agent's status
    found["tensors"] = (x, out, probe)
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--elements", type=int, default=1 << 20, help="float32 elements of each tensor")
    args = parser.parse_args()

    import torch

    import hibernate

    # The agent first (serving `hibernate status`): from the first track or pool on, every capture
    # is seen, the plain one below too.
    hibernate.track([])
    device = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: the dry run's stand-ins
    plain_pool = torch.cuda.MemPool()
    plain_id: Any = plain_pool.id  # torch's stubs want a _POOL_HANDLE; the id is what torch documents

    @contextlib.contextmanager
    def plain_capture(graph: Any) -> Iterator[None]:
        with torch.cuda.graph(graph, pool=plain_id):
            yield

    def plain_allocate() -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.use_mem_pool(plain_pool)

    @contextlib.contextmanager
    def pooled_capture(graph: Any) -> Iterator[None]:
        with hibernate.cuda_graph(graph, tag=TAG):
            yield

    def pooled_allocate() -> contextlib.AbstractContextManager[Any]:
        return hibernate.pool(TAG)

    plain = shared(torch, device, args.elements, plain_capture, plain_allocate)
    pooled = shared(torch, device, args.elements, pooled_capture, pooled_allocate)
    answer = {
        "device": device,
        "elements": args.elements,
        "plain": {k: v for k, v in plain.items() if k not in ("graph", "tensors")},
        "hibernate": {k: v for k, v in pooled.items() if k not in ("graph", "tensors")},
    }
    print(json.dumps(answer), flush=True)
    sys.stdin.readline()  # the parent has read hibernate status; the graphs live until then
    sys.stdin.readline()  # then it checkpoints this process before it kills it
    return 0


if __name__ == "__main__":
    sys.exit(main())
