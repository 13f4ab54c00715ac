"""The driver's argument structs, and the small program that makes one checkpoint or restore call.

    python -I -S driver_call.py LIBCUDA checkpoint|restore PID [OLD_UUID_HEX=NEW_UUID_HEX ...]
    python -I -S driver_call.py --exec PROGRAM [ARG ...]

A checkpoint or restore cut half-way (its caller killed, or exiting) can leave
the target in the driver's failed state, so the driver checkpointer makes
these two calls from this program, started in a session of its own
(:mod:`hibernate.checkpoint.detached`), never from a thread of the command. It
imports nothing but ctypes and is run by path, outside the package, to start
fast. It first reads stdin to its end: its starter writes ``go`` once it has
journaled this process (pid and start time), so a starter that died before
could not leave an unrecorded call behind; anything else means do nothing. A
restore needs ``cuInit(0)`` in the calling process (unless persistence mode
is on), so it calls that first. It prints one line, ``STEP RESULT``: the
CUresult of ``init`` if that failed, else of the call.

``--exec`` is the same gate in front of ``cuda-checkpoint``: once it has read
``go`` it becomes that program (same pid and start time, as journaled).
"""

from __future__ import annotations

import ctypes
import os
import sys

GO = b"go"


# The argument structs: 64 bytes each, all zero means default behaviour in every version.
class LockArgs(ctypes.Structure):
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),  # 0 = no timeout
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CheckpointArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class GpuPair(ctypes.Structure):
    _fields_ = [("oldUuid", ctypes.c_ubyte * 16), ("newUuid", ctypes.c_ubyte * 16)]


class RestoreArgs(ctypes.Structure):
    # 13.0+: gpuPairs/gpuPairsCount; 13.4 puts customStorageInfo_out at offset 16 (left NULL).
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(GpuPair)),
        ("gpuPairsCount", ctypes.c_uint),
        ("padding0", ctypes.c_uint),
        ("reserved", ctypes.c_uint64 * 6),
    ]


class UnlockArgs(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


for _struct in (LockArgs, CheckpointArgs, RestoreArgs, UnlockArgs):
    assert ctypes.sizeof(_struct) == 64, _struct
assert ctypes.sizeof(GpuPair) == 32


def pair_arguments(pairs: list[tuple[bytes, bytes]]) -> list[str]:
    """The command-line form of GPU pairs (16-byte UUIDs, old -> new)."""
    return [f"{old.hex()}={new.hex()}" for old, new in pairs]


def restore_args(texts: list[str]) -> tuple[RestoreArgs, ctypes.Array[GpuPair] | None]:
    """RestoreArgs for ``OLD_HEX=NEW_HEX`` pairs; the array is returned to be kept alive through the call."""
    args = RestoreArgs()
    if not texts:
        return args, None
    pairs = (GpuPair * len(texts))()
    for index, text in enumerate(texts):
        old, _, new = text.partition("=")
        ctypes.memmove(pairs[index].oldUuid, bytes.fromhex(old), 16)
        ctypes.memmove(pairs[index].newUuid, bytes.fromhex(new), 16)
    args.gpuPairs = ctypes.cast(pairs, ctypes.POINTER(GpuPair))
    args.gpuPairsCount = len(texts)
    return args, pairs


def call(library: str, step: str, pid: int, pair_texts: list[str]) -> tuple[str, int]:
    """Make the call; (what was called last, its CUresult)."""
    lib = ctypes.CDLL(library)
    if step == "checkpoint":
        function = lib.cuCheckpointProcessCheckpoint
        argument: ctypes.Structure = CheckpointArgs()
        pairs = None
    else:
        result = int(lib.cuInit(0))
        if result != 0:
            return "init", result
        function = lib.cuCheckpointProcessRestore
        argument, pairs = restore_args(pair_texts)
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_int, ctypes.c_void_p]
    result = int(function(pid, ctypes.byref(argument)))
    del pairs  # kept alive through the call
    return step, result


def become(argv: list[str]) -> int:
    """Replace this process with ``argv`` (its stdin /dev/null); returns only if that fails."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        sys.stderr.write(f"cannot run {argv[0]}: {exc.strerror}\n")
    return 127


def main(argv: list[str]) -> int:
    gate = argv[:1] == ["--exec"]
    if (gate and len(argv) < 2) or (not gate and (len(argv) < 3 or argv[1] not in ("checkpoint", "restore"))):
        sys.stderr.write(
            "usage: driver_call.py LIBCUDA checkpoint|restore PID [OLD=NEW ...] | --exec PROGRAM ...\n"
        )
        return 2
    if sys.stdin.buffer.read() != GO:
        return 3  # the starter did not journal this call: make none
    if gate:
        return become(argv[1:])
    what, result = call(argv[0], argv[1], int(argv[2]), argv[3:])
    sys.stdout.write(f"{what} {result}\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
