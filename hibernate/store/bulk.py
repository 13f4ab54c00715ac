"""Checksum and copy many chunks in one call: the per-chunk work of a sleep and a wake.

With many small tensors a sleep and a wake spend their time per chunk, not
per byte: slicing, hashing, comparing and copying a few KiB at a time, each
step a Python call under the GIL, with the page faults of every copy
stalling the other threads too. Each function here takes a whole group of
chunks. Where the ``_bulk`` extension was built (``hibernate/store/_bulk.c``,
compiled on install where a C compiler is present), the group is done in C
with the GIL released: at 100,000 tensors that took half a second off a wake
(see docs/performance.md). Elsewhere the same functions run in Python, with
the same results; ``HIBERNATE_NATIVE=0`` chooses them, to compare.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType

import xxhash

from hibernate.store.format import checksum

# (start, length, checksum, target): a chunk at ``start`` of a source, and where it goes (None: nowhere).
VerifyItem = tuple[int, int, str, "memoryview | None"]
# (position, padded, view): a chunk to copy to ``position`` of a staging buffer, zero-padded to ``padded``.
StageItem = tuple[int, int, memoryview]


def _load() -> ModuleType | None:
    """The extension, bound to xxhash's own xxh3 and checked against it; None where it cannot be."""
    if os.environ.get("HIBERNATE_NATIVE", "1") == "0":
        return None
    try:
        import hibernate.store._bulk as _bulk

        hashes = importlib.import_module("xxhash._xxhash").__file__
        if hashes is None:
            return None
        _bulk.bind(hashes)
        probe = [bytes(range(256)) * 5, b"", b"hibernate"]
        if _bulk.checksums(probe) != [checksum(data) for data in probe]:
            return None
    except (ImportError, OSError, AttributeError, TypeError):
        return None
    return _bulk


def python_checksums(views: Sequence[memoryview]) -> list[str]:
    """The checksum of each view (see format.checksum)."""
    return [f"{xxhash.xxh3_64_intdigest(view):016x}" for view in views]


def python_stage(target: memoryview, items: Sequence[StageItem]) -> list[str]:
    """Copy each item's view into ``target`` at its position and zero the rest of its padded size;
    the checksum of each copy, so that what is recorded is what is written."""
    digests = []
    for position, padded, view in items:
        length = len(view)
        if position < 0 or length > padded or position + padded > len(target):
            raise ValueError(f"{length} bytes padded to {padded} at {position} do not fit in {len(target)}")
        end = position + length
        target[position:end] = view
        if padded > length:
            target[end : position + padded] = bytes(padded - length)
        digests.append(checksum(target[position:end]))
    return digests


def python_verify_copy(source: memoryview, items: Sequence[VerifyItem]) -> int:
    """Check each item's bytes of ``source`` against its checksum, in order, and copy them to its
    target once they match; the index of the first that does not (nothing copied from it on), or -1.
    A checksum that is not 16 lower-case hex digits matches nothing. Items that lie outside the
    source, or whose target is not their length, are refused before anything is copied."""
    for start, length, _, target in items:
        if start < 0 or length < 0 or start + length > len(source):
            raise ValueError(f"{length} bytes at {start} lie outside the {len(source)}-byte source")
        if target is not None and len(target) != length:
            raise ValueError(f"a target of {len(target)} bytes for {length}")
    for index, (start, length, expected, target) in enumerate(items):
        view = source[start : start + length]
        if checksum(view) != expected:
            return index
        if target is not None:
            target[:] = view
    return -1


_native = _load()
# Whether the compiled helper does the work (the reader then copies chunks of any size itself).
NATIVE = _native is not None
checksums = _native.checksums if _native is not None else python_checksums
stage = _native.stage if _native is not None else python_stage
verify_copy = _native.verify_copy if _native is not None else python_verify_copy
