"""The helper a vLLM worker starts to take its own CUDA state off the GPU (HIBERNATE_SELF_CHECKPOINT=1).

    python -m hibernate.checkpoint.helper --target <worker pid>

A process cannot lock or checkpoint itself, so the worker
(:mod:`hibernate.integrations.self_checkpoint`) keeps this child for its
lifetime and speaks to it over a pipe, one JSON line each way. It acts only on
the process that started it (its parent), with the CLI's checkpointer choice
(``HIBERNATE_CHECKPOINTER`` may force one) and the CLI's CUDA stage, so a failed
step is undone the same way. It exits when the worker closes the pipe.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hibernate import procinfo
from hibernate.checkpoint.base import Checkpointer, CudaState
from hibernate.checkpoint.detect import Holder, nvidia_device_files
from hibernate.checkpoint.group import GroupCheckpoint
from hibernate.checkpoint.selection import choose
from hibernate.errors import HibernateError, UnsupportedError, UsageError
from hibernate.procinfo import ProcessIdentity

# Forces the helper's checkpointer (auto|driver|binary), as --checkpointer does for the CLI.
CHECKPOINTER_ENV = "HIBERNATE_CHECKPOINTER"


def _answer(op: str, ident: ProcessIdentity, checkpointer: Checkpointer) -> dict[str, Any]:
    """Carry out one request on the target, from its real CUDA state."""
    group = GroupCheckpoint(checkpointer)
    state = checkpointer.state(ident.pid)
    holder = Holder(ident, nvidia_device_files(ident.pid), state)
    if op == "state":
        return {"state": state.value}
    if op == "sleep":
        if state is not CudaState.RUNNING:
            # Locked or checkpointed by someone else (a `hibernate sleep` of the server): leave it.
            return {"status": f"already {state.value}", "processes": []}
        report: dict[str, Any] = group.sleep([holder])
        return report
    if op == "wake":
        woken: dict[str, Any] = group.wake([holder])
        return woken
    raise UsageError(f"unknown request {op!r}")


def serve(target: int, requests: Any, replies: Any) -> int:
    """The helper's loop: answer ``requests`` (lines) on ``replies`` until the worker closes the pipe."""

    def send(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    ident = procinfo.identity(target)
    if ident is None or os.getppid() != target:
        send(
            {
                "ok": False,
                "error": UsageError(
                    f"the self-checkpoint helper acts only on the process that started it, not on {target}"
                ).to_wire(),
            }
        )
        return 2
    try:
        checkpointer, passed_over = choose(os.environ.get(CHECKPOINTER_ENV, "auto") or "auto")
        if checkpointer is None:
            raise UnsupportedError(
                "HIBERNATE_SELF_CHECKPOINT=1 needs the driver's checkpoint API or the cuda-checkpoint "
                f"binary, and neither is available ({'; '.join(passed_over)}); nothing was changed",
                hint="install an NVIDIA driver >= 570 or cuda-checkpoint, or unset HIBERNATE_SELF_CHECKPOINT",
            )
    except HibernateError as exc:
        send({"ok": False, "error": exc.to_wire()})
        return 12
    described = checkpointer.describe()
    send({"ok": True, "result": {"pid": os.getpid(), "target": target, "checkpointer": described}})
    for line in requests:
        try:
            request = json.loads(line)
            op = str(request.get("op")) if isinstance(request, dict) else ""
            send({"ok": True, "result": _answer(op, ident, checkpointer)})
        except HibernateError as exc:
            send({"ok": False, "error": exc.to_wire()})
        except Exception as exc:  # any failure goes back to the worker, which logs it
            send({"ok": False, "error": HibernateError(f"{type(exc).__name__}: {exc}").to_wire()})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the helper a vLLM worker starts to checkpoint itself")
    parser.add_argument("--target", type=int, required=True)
    args = parser.parse_args(argv)
    # Replies go to the pipe only: anything else printing to stdout goes to stderr instead.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return serve(args.target, sys.stdin, replies)


if __name__ == "__main__":
    sys.exit(main())
