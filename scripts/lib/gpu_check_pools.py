"""A child of scripts/gpu-check: torch_memory_saver's own CPU and disk backups, timed on the GPU.

    python scripts/lib/gpu_check_pools.py --bytes N --disk-dir DIR

hibernate's pools leave torch_memory_saver's backups off and move the bytes
through the store; this measures what the backups themselves do with the same
number of bytes, in a process of their own with the real package, so that the
pool section can print hibernate's spill and restore speeds beside them.

For each backup, one tensor of ``--bytes`` random bytes is allocated in a
region of its own tag (``enable_cpu_backup=True``: torch_memory_saver's
default, pinned host copies; ``enable_disk_backup=True`` with
``set_disk_backup_dir(DIR)``), then paused and resumed, each timed to its
return after a device synchronize. The disk backup's files are then made
durable (``os.sync``, timed apart: a sleep's snapshot is durable when it
returns) and evicted from the page cache before the resume, as a wake after
a sleep finds them. The bytes after the resume are compared with a copy kept
outside the pools, and the GPU's free memory is read around each pause.

Prints one JSON line and exits 0; a backup that fails is reported in its
entry (``error``), the other still measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

PACKAGE = "torch_memory_saver"


def rate(nbytes: int, seconds: float) -> float | None:
    """Decimal GB/s, as disks are rated; None for a time that measured nothing."""
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


def evict(directory: Path) -> int:
    """Drop every file under ``directory`` from the page cache; the bytes of those files."""
    total = 0
    for path in directory.rglob("*"):
        if not path.is_file():
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        total += path.stat().st_size
    return total


def measure(
    torch: Any,
    saver: Any,
    tag: str,
    nbytes: int,
    region: Callable[[], Any],
    between: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Allocate ``nbytes`` in ``region()``, pause ``tag``, run ``between``, resume it: times and checks."""
    out: dict[str, Any] = {"tag": tag, "bytes": nbytes}
    with region():
        tensor = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    expected = tensor.clone()  # outside every region: the normal allocator
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    started = time.perf_counter()
    saver.pause(tag)
    torch.cuda.synchronize()
    out["pause_seconds"] = round(time.perf_counter() - started, 4)
    free_paused, _ = torch.cuda.mem_get_info()
    out["freed_bytes"] = int(free_paused - free_before)
    out.update(between())
    started = time.perf_counter()
    saver.resume(tag)
    torch.cuda.synchronize()
    out["resume_seconds"] = round(time.perf_counter() - started, 4)
    out["bit_exact"] = bool(torch.equal(tensor, expected))
    out["pause_gb_per_s"] = rate(nbytes, out["pause_seconds"])
    out["resume_gb_per_s"] = rate(nbytes, out["resume_seconds"])
    del tensor, expected
    return out


def attempt(work: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    try:
        return work()
    except Exception as exc:  # reported: the other backup is still measured
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bytes", type=int, required=True, help="bytes of each backup's tensor")
    parser.add_argument("--disk-dir", type=Path, required=True, help="the disk backup's directory")
    args = parser.parse_args()

    import importlib.metadata

    import torch
    import torch_memory_saver

    saver = torch_memory_saver.torch_memory_saver
    saver.hook_mode = "torch"  # as hibernate.pool() uses it: no LD_PRELOAD
    result: dict[str, Any] = {
        "package": importlib.metadata.version(PACKAGE),
        "hook_mode": "torch",
        "torch": torch.__version__,
    }

    def cpu() -> dict[str, Any]:
        return measure(
            torch, saver, "cpu-backup", args.bytes,
            lambda: saver.region("cpu-backup", enable_cpu_backup=True), dict,
        )  # fmt: skip

    def disk() -> dict[str, Any]:
        args.disk_dir.mkdir(parents=True, exist_ok=True)
        saver.set_disk_backup_dir(str(args.disk_dir))

        def settle() -> dict[str, Any]:
            started = time.perf_counter()
            os.sync()
            synced = round(time.perf_counter() - started, 4)
            return {"sync_seconds": synced, "backup_file_bytes": evict(args.disk_dir), "evicted": True}

        return measure(
            torch, saver, "disk-backup", args.bytes,
            lambda: saver.region("disk-backup", enable_disk_backup=True), settle,
        )  # fmt: skip

    result["cpu_backup"] = attempt(cpu)
    result["disk_backup"] = attempt(disk)
    entry = result["disk_backup"]
    if "pause_seconds" in entry:  # durable on return, as a sleep's snapshot is
        entry["pause_and_sync_gb_per_s"] = rate(args.bytes, entry["pause_seconds"] + entry["sync_seconds"])
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
