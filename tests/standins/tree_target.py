"""A test target of several processes: a parent and its children, like a server and its workers.

    python tree_target.py --ready FILE [--children N] [--agent]

The parent starts N children (plain sleepers) and writes ``{"pid", "children"}``
to FILE once they run. With ``--agent`` it also tracks a small CPU tensor with
hibernate, so ``hibernate sleep/wake`` accept the tree as a target. Register
the pids with the stand-in driver to make them CUDA holders. The children exit
when the parent does (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

CHILD = (
    "import ctypes, signal, time\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"  # PR_SET_PDEATHSIG: die with the parent
    "while True: time.sleep(3600)\n"
)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ready", required=True)
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--agent", action="store_true")
    args = parser.parse_args()
    if args.agent:
        import torch

        import hibernate

        hibernate.track(torch.arange(1 << 16, dtype=torch.float32), tag="weights")
    children = [subprocess.Popen([sys.executable, "-c", CHILD]) for _ in range(args.children)]
    tmp = f"{args.ready}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "children": [c.pid for c in children]}, f)
    os.rename(tmp, args.ready)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
