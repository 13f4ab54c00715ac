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

The memory a view or an address points at must stay mapped for the whole
call, which runs without the GIL: the views the store passes are of staging
buffers and of regions of a process that hibernate holds paused (see
agent.guard), as for the regions' own copies, and an address of a region's
host memory (Region.host_address) is good for the region's ``nbytes``, which
the reader has checked against the snapshot's record before it copies.
"""

from __future__ import annotations

import ctypes
import importlib
import operator
import os
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from hibernate.store.manifest import checksum
from hibernate.store.regions import memory_at

# (position, padded, view): a chunk to copy to ``position`` of a staging buffer, zero-padded to ``padded``.
StageItem = tuple[int, int, memoryview]


# The _bulk.c this module expects (its VERSION): a module built from an older source is not used.
_COMPILED_VERSION = 4


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
    digests = python_checksums([memoryview(chunk) for chunk in data])
    copies = [bytearray(len(source)), bytearray(len(source))]
    holds = [ctypes.c_char.from_buffer(copy) for copy in copies]  # their addresses stay valid meanwhile
    # Chunks 0 and 2 match; chunk 1 claims the checksum of chunk 0; a fourth lies past what was read.
    offsets, lengths = [0, 1280, 1280, 1280], [1280, 0, 9, 16]
    sums = digests[0] + digests[0] + digests[2] + digests[2]
    results = [
        function(source, 0, len(source), [0, 2, 1, 3], offsets, lengths, sums, [ctypes.addressof(hold)] * 4)
        for function, hold in ((compiled.verify_copy_at, holds[0]), (python_verify_copy_at, holds[1]))
    ]
    del holds
    # The chunks staged from their addresses (those of a copy of the source, held meanwhile).
    held = bytearray(source)
    start = ctypes.addressof(ctypes.c_char.from_buffer(held))
    columns = ([i * slot for i in range(3)], [slot] * 3, [start, start + 1280, start + 1280], [1280, 0, 9])
    staged = [bytearray(len(data) * slot), bytearray(len(data) * slot)]
    staged_digests = [
        function(memoryview(buffer), *columns)
        for function, buffer in ((compiled.stage_at, staged[0]), (python_stage_at, staged[1]))
    ]
    return bool(
        compiled.checksums(data) == digests
        and staged_digests[0] == staged_digests[1] == digests
        and staged[0] == staged[1]
        and staged[0][slot * 2 : slot * 2 + 9] == b"hibernate"
        and results[0] == results[1] == (2, False)
        and copies[0] == copies[1]
        and copies[0][:9] == b"hibernate"
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
    """The checksum of each view (manifest.checksum)."""
    return [checksum(view) for view in views]


def _stage_views(target: memoryview, items: Sequence[StageItem]) -> list[str]:
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


def python_stage_at(
    target: memoryview, positions: list[int], paddeds: list[int], addresses: list[int], lengths: list[int]
) -> list[str]:
    """Copy the ``lengths[i]`` bytes of host memory at ``addresses[i]`` (a region's ``host_address``
    plus the chunk's offset) into ``target`` at ``positions[i]`` and zero the rest of ``paddeds[i]``;
    the checksum of each copy, so that what is recorded is what is written. Items that do not fit
    are refused before anything is copied. The memory must stay mapped for the call, as for the
    targets of verify_copy_at."""
    if not all(isinstance(values, list) for values in (positions, paddeds, addresses, lengths)):
        raise TypeError("the positions, paddeds, addresses and lengths must be lists")
    if not len(positions) == len(paddeds) == len(addresses) == len(lengths):
        raise ValueError("the positions, paddeds, addresses and lengths must be as many")
    items = []
    for i in range(len(positions)):
        position, padded = _entry(positions, i, "positions"), _entry(paddeds, i, "paddeds")
        address, length = _entry(addresses, i, "addresses"), _entry(lengths, i, "lengths")
        if length < 0:
            raise ValueError(f"item {i} has a negative length")
        if address <= 0 and length > 0:
            raise ValueError(f"item {i} has no address")
        items.append((position, padded, memory_at(address, length)))
    return _stage_views(target, items)


def _entry(values: list[int], index: int, name: str) -> int:
    """``values[index]``, refused as the compiled function refuses it (an index past it, not an int,
    past what a C Py_ssize_t holds)."""
    if not 0 <= index < len(values):
        raise IndexError(f"chunk {index} is not in {name}")
    value = values[index]
    if not isinstance(value, int):
        raise TypeError(f"{name}[{index}] must be an int")
    if not -(1 << 63) <= value < 1 << 63:
        raise ValueError(f"{name}[{index}] is out of range")
    return value


def python_verify_copy_at(
    source: memoryview,
    base: int,
    got: int,
    group: list[int],
    offsets: list[int],
    lengths: list[int],
    checksums: str,
    targets: list[int],
) -> tuple[int, bool]:
    """Check each chunk of ``group`` where it lies in ``source`` (which holds the file's bytes from
    offset ``base``, ``got`` of them read) against its checksum, in order, and copy it to its
    target address once it matches (a target of 0: verify only). ``offsets``, ``lengths``,
    ``checksums`` (16 hex digits each) and ``targets`` are by chunk index, as the manifest's columns.

    Returns the position in ``group`` of the first chunk that failed (nothing copied from it on)
    and whether it failed because the read ended before its end, else ``(-1, False)``; the chunks
    before one that was not read whole are still checked, and a mismatch among them is the
    failure. A chunk that lies before the source, or a list that is not one, is refused before
    anything is copied. The targets must stay mapped for the call, as with the regions' own copies.
    """
    source = _bytes_of(source)
    base, got = operator.index(base), operator.index(got)
    if not all(-(1 << 63) <= value < 1 << 63 for value in (base, got)):
        raise OverflowError("base or got is out of range")
    if not all(isinstance(values, list) for values in (group, offsets, lengths, targets)):
        raise TypeError("the group, offsets, lengths and targets must be lists")
    if not isinstance(checksums, str):
        raise TypeError("checksums must be a str")
    if not checksums.isascii():
        raise ValueError("checksums must be hex digits")
    if base < 0 or not 0 <= got <= len(source):
        raise ValueError(f"{got} bytes read from file offset {base} into a {len(source)}-byte source")
    plan = []
    stop, truncated = len(group), False
    for position in range(len(group)):
        chunk = _entry(group, position, "the group")
        offset, length = _entry(offsets, chunk, "offsets"), _entry(lengths, chunk, "lengths")
        address = _entry(targets, chunk, "targets")
        start = offset - base
        if start < 0 or length < 0 or 16 * chunk + 16 > len(checksums):
            raise ValueError(f"chunk {chunk} ({length} bytes at file offset {offset}) is not in the source")
        if start + length > got:
            stop, truncated = position, True
            break
        plan.append((start, length, checksums[16 * chunk : 16 * chunk + 16], address))
    # Copies of a writable source by ctypes.memmove, which lets the GIL go as the compiled one does.
    writable = not source.readonly and len(source) > 0  # ctypes takes no empty buffer
    source_address = ctypes.addressof(ctypes.c_char.from_buffer(source)) if writable else None
    for position, (start, length, expected, address) in enumerate(plan):
        view = source[start : start + length]
        if checksum(view) != expected:
            return position, False
        if address and source_address is not None:
            ctypes.memmove(address, source_address + start, length)
        elif address:
            memory_at(address, length)[:] = view
    return (stop, True) if truncated else (-1, False)


_native = _load()
# Whether the compiled helper does the work.
NATIVE = _native is not None
checksums = _native.checksums if _native is not None else python_checksums
stage_at = _native.stage_at if _native is not None else python_stage_at
verify_copy_at = _native.verify_copy_at if _native is not None else python_verify_copy_at
