"""How a wake reads a snapshot: requests in file order, the groups the workers take, where each chunk goes.

Worked out from the manifest's columns before anything is read, in bulk
rather than per chunk where it can be: a wake of 100,000 tensors has as many
chunks. Chunks are read in file order, and chunks that lie back to back in a
file are read with one request of up to 32 MiB (or one chunk, if larger).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from hibernate.store.arena import ARENAS, arena_bytes_for
from hibernate.store.manifest import ALIGNMENT, ChunkColumns, Columns
from hibernate.store.regions import Region

# One read request and one staging buffer (or the largest chunk, if larger). With
# huge-page staging (see directio.StagingBuffer) the disk gets its largest requests whatever
# the size of ours, so ours need not be large; small buffers taken as needed keep
# what a restore faults in small: the workers keep up with the disk, so three were
# allocated (96 MiB of a 256 MiB budget) where 2 x 128 MiB used to be. Paired with
# raw reads, 32 MiB restored at 1.90 GB/s (median of 8), 64 MiB at 1.70.
_READ_REQUEST_BYTES = 32 << 20
# A worker takes the small chunks of a request in groups of about this many bytes (a large
# chunk is a group of its own): handing them out one by one cost more than verifying them.
_GROUP_BYTES = 4 << 20


def read_request_bytes(arena: int, largest_chunk: int, holders: int = 2) -> int:
    """A restore's request and staging buffer size: the writer's staging budget (two arenas of
    ``arena`` bytes) as smaller buffers allocated only when none is free (see _READ_REQUEST_BYTES),
    small enough that ``holders`` (each reader's buffer, and one being verified) fit at once,
    never smaller than the largest chunk."""
    shared = ARENAS * arena // max(1, holders) // ALIGNMENT * ALIGNMENT
    return max(largest_chunk, min(_READ_REQUEST_BYTES, arena, max(ALIGNMENT, shared)))


def worker_groups(chunks: list[int], lengths: Sequence[int]) -> list[list[int]]:
    """A request's chunks as the workers take them: consecutive runs of about _GROUP_BYTES."""
    if len(chunks) == 1:
        return [chunks]
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for chunk in chunks:
        current.append(chunk)
        size += lengths[chunk]
        if size >= _GROUP_BYTES:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


def destinations(columns: Columns) -> tuple[Sequence[int], Sequence[int]]:
    """Each chunk's region (record index) and offset in it, by chunk index; in bulk, not per chunk."""
    counts = columns.counts
    if counts.count(1) == len(counts):  # one chunk per record, as with most tensors
        return range(len(counts)), [0] * len(counts)
    region_of = list(itertools.chain.from_iterable(map(itertools.repeat, range(len(counts)), counts)))
    covered = list(itertools.accumulate(columns.chunks.lengths, initial=0))
    starts = [covered[first] for first in columns.first_chunks()]
    return region_of, list(map(operator.sub, covered, map(starts.__getitem__, region_of)))


def chunk_addresses(
    regions: Sequence[Region], regions_of: Sequence[int], region_offsets: Sequence[int]
) -> list[int]:
    """Each chunk's address in host memory, by chunk index; 0 where its region has none (device memory).

    Asked of each region once per wake, so that verifying and copying a group of
    chunks is one call with no Python per chunk (bulk.verify_copy_at): asking for
    a view of each chunk's destination cost about 1 us a chunk, under the GIL.
    """
    bases = [region.host_address() or 0 for region in regions]
    if isinstance(regions_of, range):  # one chunk per region, at its start (see destinations)
        return bases
    placed = zip(regions_of, region_offsets, strict=True)
    return [bases[region] + offset if bases[region] else 0 for region, offset in placed]


def file_order(chunks: ChunkColumns) -> Sequence[int]:
    """The chunks' indices in file order (file, then offset): the order they are read in.

    A snapshot that one sleep wrote whole is in that order already, which is
    checked in bulk rather than sorted.
    """
    files, offsets = chunks.files, chunks.offsets
    if len(set(files)) > 1:
        return sorted(range(len(offsets)), key=list(zip(files, offsets, strict=True)).__getitem__)
    if all(map(operator.lt, offsets, itertools.islice(offsets, 1, None))):
        return range(len(offsets))
    # Two stagers fill the arenas side by side, so packed runs of small chunks interleave.
    return sorted(range(len(offsets)), key=offsets.__getitem__)


@dataclass
class Request:
    """Chunks (by index) lying back to back in one file, read with one request into one buffer."""

    file: str
    offset: int
    chunks: list[int] = field(default_factory=list)
    size: int = 0


def _split(request: Request, at: int, firsts: Sequence[int], stops: Sequence[int]) -> list[Request]:
    """``request`` as two requests, the first holding its first ``at`` chunks."""
    parts = []
    for chunks in (request.chunks[:at], request.chunks[at:]):
        part = Request(request.file, firsts[chunks[0]], chunks)
        part.size = max(stops[chunk] for chunk in chunks) - part.offset
        parts.append(part)
    return parts


def requests_in_order(
    files: Sequence[str], order: Sequence[int], firsts: Sequence[int], stops: Sequence[int], largest: int
) -> list[Request]:
    """The chunks in file ``order``, read in requests of whole pages of at most ``largest`` bytes.

    ``firsts`` and ``stops`` are where each chunk's pages start and end. A
    request takes the next chunk while it starts within or right after
    the request's last page: chunks packed back to back share pages, and
    a chunk named twice (equal bytes, written once) is read once.
    """
    requests: list[Request] = []
    last = Request("", -1)
    end = -1  # where the last request's pages end
    for chunk in order:
        first_page, stop = firsts[chunk], stops[chunk]
        if first_page > end or files[chunk] != last.file or max(end, stop) - last.offset > largest:
            last = Request(files[chunk], first_page)
            requests.append(last)
            end = first_page
        last.chunks.append(chunk)
        if stop > end:
            end = stop
            last.size = end - last.offset
    # A short first request gets the workers going sooner; a short last one leaves
    # them less to do once the disk has finished.
    if requests and len(requests[0].chunks) > 1:
        requests[0:1] = _split(requests[0], 1, firsts, stops)
    if requests and len(requests[-1].chunks) > 1:
        requests[-1:] = _split(requests[-1], len(requests[-1].chunks) - 1, firsts, stops)
    return requests


class ReadPlan(NamedTuple):
    """A wake's requests, in file order, and the staging they take."""

    requests: list[Request]
    staging_bytes: int  # all staging buffers together
    request_bytes: int  # one request and one staging buffer


def plan_reads(
    chunks: ChunkColumns, buffer_bytes: int, holders: int = 2, wanted: Sequence[bool] | None = None
) -> ReadPlan:
    """Every chunk (or those ``wanted`` marks, by index) in requests of whole pages, read in file
    order within ``buffer_bytes`` of staging (or two of the largest chunks, if more), and no more
    staging than the snapshot needs; ``holders``: the buffers that must fit at once (see
    read_request_bytes)."""
    # Where each chunk's pages start and end (align_up written out: once per chunk), worked
    # out once for planning; reading one chunk alone takes the difference.
    firsts = [offset - offset % ALIGNMENT for offset in chunks.offsets]
    stops = [
        (offset + length + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT
        for offset, length in zip(chunks.offsets, chunks.lengths, strict=True)
    ]
    pages = list(map(operator.sub, stops, firsts))
    order = file_order(chunks)
    if wanted is not None:
        order = [chunk for chunk in order if wanted[chunk]]
        pages = [pages[chunk] for chunk in order]
    largest = max(pages, default=ALIGNMENT)
    arena = arena_bytes_for(buffer_bytes, sum(pages), largest)
    size = read_request_bytes(arena, largest, holders)
    requests = requests_in_order(chunks.files, order, firsts, stops, size)
    return ReadPlan(requests, ARENAS * arena, size)
