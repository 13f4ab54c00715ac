"""What the store streams: regions of memory, wherever they live.

The store never knows about torch or CUDA. A pool hands it regions; each
region copies a byte range out to, or in from, a host staging buffer. A region
in host memory may also expose a zero-copy view, which lets the writer hash an
unchanged chunk in place and skip both the copy and the write.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


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
        """Copy ``len(dst)`` bytes starting at ``offset`` of the region into ``dst``."""
        ...

    def copy_in(self, offset: int, src: memoryview) -> None:
        """Copy ``src`` into the region at ``offset``."""
        ...

    def host_view(self, offset: int, length: int) -> memoryview | None:
        """A view of the range's host memory, or None (device memory).

        The writer hashes it in place (an unchanged chunk is then neither copied
        nor written); the reader faults it in (MADV_POPULATE_WRITE) ahead of
        copying into it. Neither changes its contents.
        """
        ...
