"""What the store streams: regions of memory, wherever they live.

The store never knows about torch or CUDA. A pool hands it regions; each
region copies a byte range out to, or in from, a host staging buffer. A region
in host memory may also expose a zero-copy view, which lets the writer hash an
unchanged chunk in place and skip both the copy and the write.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any, Protocol

_PyMemoryView_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_PyMemoryView_FromMemory.restype = ctypes.py_object
_PyMemoryView_FromMemory.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PyBUF_WRITE = 0x200


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte view of ``nbytes`` of host memory at ``address``; it does not own the memory.

    Not ``(ctypes.c_char * nbytes).from_address(...)``: ctypes makes, and
    caches for good, one array type per distinct length, at 13 us and about
    3 KiB each; a model of 100,000 tensors of varied sizes spent 1.3 s and
    300 MiB on them. ``PyMemoryView_FromMemory`` makes the view directly
    (0.6 us), whatever the length.
    """
    if nbytes == 0:
        return memoryview(bytearray())
    view: memoryview = _PyMemoryView_FromMemory(address, nbytes, _PyBUF_WRITE)
    return view


class Region(Protocol):
    @property
    def key(self) -> str:
        """Name unique within the snapshot (e.g. ``weights/model.embed.weight``)."""
        ...

    @property
    def tag(self) -> str: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def meta(self) -> Mapping[str, Any]:
        """Plain-JSON description checked again at read time (dtype, shape, address...)."""
        ...

    def copy_out(self, offset: int, dst: memoryview) -> None:
        """Copy ``len(dst)`` bytes starting at ``offset`` of the region into ``dst``.

        Done when it returns, unless the caller opened its pool's deferral
        block (pipeline.DeviceStaging): then ``dst`` holds them once the
        block's fence completed.
        """
        ...

    def copy_in(self, offset: int, src: memoryview) -> None:
        """Copy ``src`` into the region at ``offset`` (in a deferral block: ``src`` is read until the
        block's fence completed)."""
        ...

    def host_view(self, offset: int, length: int) -> memoryview | None:
        """A view of the range's host memory, or None (device memory).

        The writer hashes it in place (an unchanged chunk is then neither copied
        nor written) and copies small chunks out of it; the reader faults it in
        (MADV_POPULATE_WRITE) ahead of copying into it.
        """
        ...

    def host_address(self) -> int | None:
        """Where the region's writable host memory starts (valid until it is released), or None.

        The reader copies verified chunks straight there, a group of chunks in
        one call, bypassing copy_in: asked once per region and wake, not once
        per chunk (see SnapshotReader.read_into). The writer stages small
        chunks from there, a run of them in one call (see stream.Stream).
        """
        ...
