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

The memory a view points at must stay mapped for the whole call, which runs
without the GIL: the views the store passes are of staging buffers and of
regions of a process that hibernate holds paused (see agent.guard), as for
the regions' own copies.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from hibernate.store.format import checksum

# (start, length, checksum, target): a chunk at ``start`` of a source, and where it goes (None: nowhere).
VerifyItem = tuple[int, int, str, "memoryview | None"]
# (position, padded, view): a chunk to copy to ``position`` of a staging buffer, zero-padded to ``padded``.
StageItem = tuple[int, int, memoryview]


# The _bulk.c this module expects (its VERSION): a module built from an older source is not used.
_COMPILED_VERSION = 2


def _load() -> ModuleType | None:
    """The extension, bound to xxhash's own xxh3 and checked against the Python functions on sample
    data (matches and a mismatch); None where it cannot be, which only costs speed."""
    if os.environ.get("HIBERNATE_NATIVE", "1") == "0":
        return None
    try:
        import hibernate.store._bulk as _bulk

        if getattr(_bulk, "VERSION", None) != _COMPILED_VERSION:
            return None
        hashes = importlib.import_module("xxhash._xxhash").__file__
        if hashes is None:
            return None
        _bulk.bind(hashes)
        if not _agrees(_bulk):
            return None
    except (ImportError, OSError, AttributeError, TypeError, ValueError):
        return None
    return _bulk


def _agrees(compiled: ModuleType) -> bool:
    """The compiled functions give the Python functions' results on a few chunks."""
    data = [bytes(range(256)) * 5, b"", b"hibernate"]
    source = memoryview(b"".join(data))
    slot = 3 * 512  # room for the largest sample, padded
    staged = [bytearray(len(data) * slot), bytearray(len(data) * slot)]
    items = [(i * slot, slot, memoryview(chunk)) for i, chunk in enumerate(data)]
    digests = python_checksums([memoryview(chunk) for chunk in data])
    check = [(0, 1280, digests[0], None), (1280, 0, digests[1], None), (1280, 9, digests[0], None)]
    return bool(
        compiled.checksums(data) == digests
        and compiled.stage(memoryview(staged[0]), items) == python_stage(memoryview(staged[1]), items)
        and staged[0] == staged[1]
        and compiled.verify_copy(source, check) == python_verify_copy(source, check) == 2
    )


def _bytes_of(buffer: object, *, writable: bool = False) -> memoryview:
    """A buffer as the compiled functions take it: contiguous bytes (else BufferError, as they raise).

    The store's own views (staging, a region's host view) are returned as they are, after three
    attribute checks: this runs once per chunk.
    """
    if type(buffer) is memoryview and buffer.format == "B" and buffer.c_contiguous:
        view = buffer
    else:
        view = memoryview(buffer)  # type: ignore[arg-type]  # anything else is a TypeError, as there
        if not view.contiguous:
            raise BufferError("a view must be contiguous")
        view = view.cast("B")
    if writable and view.readonly:
        raise BufferError("a target must be writable")
    return view


def _checked(items: Sequence[tuple[Any, ...]], size: int) -> tuple[tuple[Any, ...], ...]:
    """All items, each a tuple of ``size`` values (else TypeError, as the compiled functions raise)."""
    listed = tuple(items)
    if not all(type(item) is tuple and len(item) == size for item in listed):
        index = next(i for i, item in enumerate(listed) if type(item) is not tuple or len(item) != size)
        raise TypeError(f"item {index} must be a tuple of {size} values")
    return listed


def python_checksums(views: Sequence[memoryview]) -> list[str]:
    """The checksum of each view (format.checksum)."""
    return [checksum(view) for view in views]


def python_stage(target: memoryview, items: Sequence[StageItem]) -> list[str]:
    """Copy each item's view into ``target`` at its position and zero the rest of its padded size;
    the checksum of each copy, so that what is recorded is what is written. Items that do not fit
    are refused before anything is copied."""
    target = _bytes_of(target, writable=True)
    size = len(target)
    plan = [(position, padded, _bytes_of(view)) for position, padded, view in _checked(items, 3)]
    for position, padded, view in plan:
        if position < 0 or len(view) > padded or position + padded > size:
            raise ValueError(f"{len(view)} bytes padded to {padded} at {position} do not fit {size}")
    digests = []
    for position, padded, view in plan:
        end = position + len(view)
        target[position:end] = view
        if padded > len(view):
            target[end : position + padded] = bytes(padded - len(view))
        digests.append(checksum(target[position:end]))
    return digests


def python_verify_copy(source: memoryview, items: Sequence[VerifyItem]) -> int:
    """Check each item's bytes of ``source`` against its checksum, in order, and copy them to its
    target once they match; the index of the first that does not (nothing copied from it on), or -1.
    A checksum that is not 16 lower-case hex digits matches nothing. Items that lie outside the
    source, or whose target is not their length, are refused before anything is copied."""
    source = _bytes_of(source)
    size = len(source)
    plan = [
        (start, length, expected, None if target is None else _bytes_of(target, writable=True))
        for start, length, expected, target in _checked(items, 4)
    ]
    for start, length, _, target in plan:
        if start < 0 or length < 0 or start + length > size:
            raise ValueError(f"{length} bytes at {start} lie outside the {size}-byte source")
        if target is not None and len(target) != length:
            raise ValueError(f"a target of {len(target)} bytes for {length}")
    for index, (start, length, expected, target) in enumerate(plan):
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
