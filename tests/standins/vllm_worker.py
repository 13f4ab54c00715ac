"""A stand-in vLLM worker process: what a worker does that matters to hibernate, on CPU.

Like a real worker it loads vLLM's general plugins with vLLM's own loader
(which finds hibernate's entry point), holds CuMemAllocator allocations (the
stand-in allocator over host memory, REAL ``AllocationData`` records, reached
through a stand-in ``vllm.device_allocator.cumem`` module whose ``libcudart``
is the fake CUDA runtime), and has vLLM's own factory create the sleep-mode
backend, which then runs hibernate's real CUDA seam.

    python -m tests.standins.vllm_worker --cudart LIB [--mb N] [--enable-nccl-comm-suspend]

It prints one JSON line when ready, then answers commands on stdin, one JSON
line each: ``suspend LEVEL``, ``resume [TAG...]``, ``digests``, ``memory``,
``fork`` (a forked child reports its own agent), ``fault SPEC`` (sets
``HIBERNATE_FAULT`` in this process; ``-`` clears it), ``cuda`` (the fake
runtime's counters), ``exit``; end of input ends it too (as a real worker ends
with its server).

``suspend`` and ``resume`` go through :meth:`Worker.sleep` and
:meth:`Worker.wake_up`, which call the backend as vLLM 0.33's ``Worker.sleep``
/ ``Worker.wake_up`` do, including the device calls vLLM makes right after
``suspend`` (it synchronizes the device and reads its memory figures): with
the stand-in NVIDIA driver those calls block while this process is locked or
checkpointed, exactly what a self-checkpoint must not cause.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import sys
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import xxhash

from tests.standins import vllm_parallel_state
from tests.standins.vllm_cumem import MODULE_NAME, FakeCudaRT, make_module
from tests.standins.vllm_memory import LAYOUT, MIB, HostReservations, StandInCuMemAllocator, fill


def layout(total_mb: int) -> list[tuple[str, int]]:
    """The standard layout, with weights and KV cache grown to about ``total_mb`` in all."""
    if total_mb <= 0:
        return LAYOUT
    big = total_mb * MIB
    weights = [("weights", big // 2 + 12345), ("weights", big // 8)]
    kv = [("kv_cache", big // 4), ("kv_cache", big // 16 + 777)]
    return weights + kv + LAYOUT


def map_vllm_extension(package: Path) -> mmap.mmap | None:
    """Map vLLM's cumem extension read-only, as a real worker has it mapped (loaded, there).

    Only the mapping matters: it is how hibernate finds which vLLM a process
    runs (``/proc/PID/maps``). The library is never loaded: it needs a driver.
    """
    extension = package / "cumem_allocator.abi3.so"
    if not extension.is_file():
        return None
    with open(extension, "rb") as f:
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Worker:
    def __init__(self, cudart: Path, total_mb: int, comm_suspend: bool = False) -> None:
        # What the backend may read of vLLM's Worker (its caller): the model config's flag.
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(enable_nccl_comm_suspend=comm_suspend)
        )
        self.reservations = HostReservations()
        self.allocator = StandInCuMemAllocator(self.reservations)
        StandInCuMemAllocator.instance = self.allocator
        # What `import vllm.device_allocator.cumem` gives a real worker.
        sys.modules[MODULE_NAME] = make_module(self.reservations, FakeCudaRT(cudart))
        # And vllm.distributed.parallel_state, with its world and its checkpoint collectives.
        self.world, with_checkpoint, engine_size = vllm_parallel_state.from_environment()
        sys.modules[vllm_parallel_state.MODULE_NAME] = vllm_parallel_state.make_module(
            self.world, with_checkpoint, engine_size
        )
        for index, (tag, size) in enumerate(layout(total_mb)):
            address = self.allocator.allocate(size, tag)
            fill(self.reservations, address, self.allocator.size_of(address), index)

        import vllm.plugins
        from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

        self.mapped_extension = map_vllm_extension(Path(vllm.plugins.__file__).parent.parent)

        vllm.plugins.load_general_plugins()
        self.cudart = sys.modules[MODULE_NAME].libcudart
        # What create_backend reads of vLLM's ModelConfig.
        config: Any = SimpleNamespace(sleep_mode_backend="hibernate")
        self.backend = SleepModeBackendFactory.create_backend(config)

    def sleep(self, level: int) -> None:
        """vLLM's Worker.sleep: the backend's suspend, vLLM's own communicator suspend if asked, then
        device calls (synchronize, memory info)."""
        self.backend.suspend(level)
        if self.vllm_config.model_config.enable_nccl_comm_suspend:
            sys.modules[vllm_parallel_state.MODULE_NAME].suspend_device_comms()
        self.cudart.lib.cudaDeviceSynchronize()

    def wake_up(self, tags: list[str] | None) -> None:
        """vLLM's Worker.wake_up: the backend's resume first, then its communicators, then device calls."""
        self.backend.resume(tags)
        if self.vllm_config.model_config.enable_nccl_comm_suspend:
            sys.modules[vllm_parallel_state.MODULE_NAME].resume_device_comms()
        self.cudart.lib.cudaDeviceSynchronize()

    def digests(self) -> dict[str, Any]:
        out = {}
        for address, data in self.allocator.pointer_to_data.items():
            if data.is_asleep:
                out[f"{address:#x}"] = {"tag": data.tag, "asleep": True}
                continue
            content = self.reservations.read(address, self.allocator.size_of(address))
            out[f"{address:#x}"] = {
                "tag": data.tag,
                "asleep": False,
                "digest": xxhash.xxh3_64_hexdigest(content),
                "zero": content.count(0) == len(content),
            }
        return out

    def answer(self, words: list[str]) -> dict[str, Any]:
        command = words[0]
        if command == "suspend":
            before = peak_rss_bytes()
            self.sleep(int(words[1]))
            return {"state": self.backend.state(), "peak_before": before, "peak_after": peak_rss_bytes()}
        if command == "resume":
            before = peak_rss_bytes()
            self.wake_up(words[1:] or None)
            return {"state": self.backend.state(), "peak_before": before, "peak_after": peak_rss_bytes()}
        if command == "fault":
            if words[1] == "-":
                os.environ.pop("HIBERNATE_FAULT", None)
            else:
                os.environ["HIBERNATE_FAULT"] = words[1]
            return {"fault": os.environ.get("HIBERNATE_FAULT")}
        if command == "cuda":
            return {
                "calls_while_suspended": self.cudart.counter("fake_calls_while_suspended"),
                "synchronizations": self.cudart.counter("fake_device_synchronizations"),
            }
        if command == "digests":
            return self.digests()
        if command == "memory":
            return {"rss": rss_bytes(), "peak": peak_rss_bytes()}
        if command == "fork":
            return self.fork()
        raise ValueError(f"unknown command {command!r}")

    def fork(self) -> dict[str, Any]:
        """A child forked after the plugins loaded (vLLM's default start method) gets its own agent."""
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            try:
                from hibernate.agent.local import local_agent, server_path

                agent = local_agent()
                report = {
                    "pid": os.getpid(),
                    "agent_pid": agent.identity.pid,
                    "kind": agent.runtime,
                    "socket": server_path(),
                    "pools": [p["pool"] for p in agent.status()["pools"]],
                }
                os.write(write_end, json.dumps(report).encode())
            finally:
                os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            report = json.loads(pipe.read())
        os.waitpid(child, 0)
        return dict(report)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cudart", type=Path, required=True)
    parser.add_argument("--mb", type=int, default=0)
    parser.add_argument("--enable-nccl-comm-suspend", action="store_true")
    args = parser.parse_args()
    worker = Worker(args.cudart, args.mb, args.enable_nccl_comm_suspend)
    from hibernate.agent.local import local_agent

    agent = local_agent()
    ready = {
        "pid": os.getpid(),
        "backend": type(worker.backend).__name__,
        "backend_module": type(worker.backend).__module__,
        "agent": agent.name,
        "memory": {"rss": rss_bytes(), "peak": peak_rss_bytes()},
        "pool_bytes": sum(worker.allocator.size_of(a) for a in worker.allocator.pointer_to_data),
    }
    print(json.dumps(ready), flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "exit":
            break
        try:
            reply = {"ok": True, "result": worker.answer(words)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
