"""Reuse of the previous snapshot: its unchanged files linked in, its chunks indexed, the links trimmed.

A sleep refers to a chunk of the previous snapshot instead of writing it
again when the process still holds the same bytes. Candidates are the
previous snapshot's files whose identity (device, inode, size, mtime, ctime)
is still the one recorded when they were verified; they are hard-linked into
the new snapshot's own directory before anything is streamed
(link_reusable), so the new snapshot is self-contained, and once the stream
is done each link keeps only the pages the new snapshot uses (trim_to_used).
Identity cannot see bytes that changed below the file system: reusecheck.py
reads every reused chunk back before anything is released.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hibernate.store.layout import SpillRoot, punch_unused
from hibernate.store.manifest import ALIGNMENT, ChunkColumns, ChunkRef, FileIdentity, Manifest
from hibernate.store.reusecheck import CheckFindings
from hibernate.units import human_bytes

REUSED_PREFIX = "reused-"


@dataclass(frozen=True)
class ReuseSource:
    """What a sleep needs of the previous snapshot to reuse its bytes: its name, files and chunks.

    Not the whole manifest: an agent keeps this between a wake and the next
    sleep (see write_snapshot's ``known``), and the keys and meta of 100,000
    records held 128 MiB where their chunks hold 15-25 (measured by RSS and tracemalloc).
    """

    snapshot: str
    files: Mapping[str, FileIdentity]
    chunks: ChunkColumns

    @classmethod
    def of(cls, manifest: Manifest) -> ReuseSource:
        return cls(manifest.snapshot, dict(manifest.files), manifest.columns.chunks)


def _unchanged(root: SpillRoot, previous: ReuseSource, name: str) -> bool:
    """The previous snapshot's file ``name`` is the very file that was verified when it was written."""
    try:
        info = os.stat(f"{previous.snapshot}/{name}", dir_fd=root.fd, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and FileIdentity.of(info) == previous.files.get(name)


@dataclass
class Linked:
    """What :func:`link_reusable` made of the previous snapshot."""

    index: dict[tuple[str, int], ChunkRef]  # its chunks by (checksum, length), naming the links
    links: list[str]  # the links made, in the new snapshot's directory
    origins: dict[str, str]  # each link's file in the previous snapshot (for messages)
    warnings: list[str]  # files that could not be linked: their bytes are written again


def link_reusable(root: SpillRoot, previous: ReuseSource | None, tmp_fd: int) -> Linked:
    """Hard-link the previous snapshot's unchanged files into the new one; index their chunks.

    A file that cannot be linked (a file system without hard links) is not
    reused: its bytes are written again, and a warning says so.
    """
    index: dict[tuple[str, int], ChunkRef] = {}
    links: list[str] = []
    warnings: list[str] = []
    renamed: dict[str, str] = {}
    if previous is None:
        return Linked(index, links, {}, warnings)
    for name in sorted(previous.files):
        if not _unchanged(root, previous, name):
            continue
        link = f"{REUSED_PREFIX}{len(links):03d}.bin"
        try:
            os.link(
                f"{previous.snapshot}/{name}",
                link,
                src_dir_fd=root.fd,
                dst_dir_fd=tmp_fd,
                follow_symlinks=False,
            )
        except OSError as exc:
            warnings.append(
                f"{root.path / previous.snapshot / name} could not be linked into the new snapshot "
                f"({exc.strerror or exc}); its bytes were written again"
            )
            continue
        renamed[name] = link
        links.append(link)
    # Built with map and one dict rather than a statement per chunk (an unchanged re-sleep reuses
    # every chunk); in reverse, so that of chunks with equal bytes the first is the one kept.
    chunks = previous.chunks
    digests, lengths = chunks.digests(), chunks.lengths
    linked_as = [renamed.get(file, "") for file in chunks.files]  # "": a file not linked
    refs = list(map(ChunkRef, linked_as, chunks.offsets, lengths, digests))
    if len(renamed) < len(previous.files):  # the chunks of a file not linked are not offered
        refs = [ref for ref in refs if ref.file]
        digests, lengths = [ref.checksum for ref in refs], [ref.length for ref in refs]
    keys = zip(reversed(digests), reversed(lengths), strict=True)
    index.update(zip(keys, reversed(refs), strict=True))
    return Linked(index, links, {link: name for name, link in renamed.items()}, warnings)


def _uses_every_chunk(
    chunks: list[ChunkRef],
    reusable: Mapping[tuple[str, int], ChunkRef],
    previous: ReuseSource | None,
) -> bool:
    """Whether the new snapshot refers to every chunk of the previous one, each through its link.

    A previous snapshot's data file holds its chunks' pages and holes punched
    before, nothing else; so if every one of its chunks was linked and indexed
    (none in a file left unlinked, no two with the same bytes) and every one is
    used now, its link has nothing to trim. That is an unchanged re-sleep, for
    which walking the chunks to find the pages in use took 10-18 ms at 20,000
    tensors.
    """
    if previous is None or len(reusable) != len(previous.chunks.files):
        return False
    return set(map(id, chunks)).issuperset(map(id, reusable.values()))


def _used_ranges(chunks: Sequence[ChunkRef], links: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Per linked data file the chunks use, the sorted and merged pages they use, padding included.

    Only a link can hold bytes the new snapshot does not use (a file this
    sleep wrote holds only what it wrote), so only links are walked chunk by
    chunk; at 100,000 tensors that walk took 0.1 s of a first sleep.
    """
    linked = set(links)
    spans: dict[str, list[tuple[int, int]]] = {}
    if linked:
        for file, offset, length, _ in chunks:
            if file in linked:  # the pages it lies in (align_up written out: once per chunk)
                spans.setdefault(file, []).append(
                    (
                        offset - offset % ALIGNMENT,
                        (offset + length + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT,
                    )
                )
    merged: dict[str, list[tuple[int, int]]] = {}
    for file, ranges in spans.items():
        out: list[tuple[int, int]] = []
        for start, end in sorted(ranges):
            if out and start <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], end))
            else:
                out.append((start, end))
        merged[file] = out
    return merged


def _trim_links(tmp_fd: int, links: list[str], used: dict[str, list[tuple[int, int]]]) -> None:
    """Links the new snapshot does not use go; in those it partly uses, the rest is punched out.

    The punch changes the shared file under the previous snapshot too: that one is
    deleted next, before this one is published, and a crash in between leaves it
    with a changed identity, so no later sleep reuses it.
    """
    for link in links:
        if link not in used:
            os.unlink(link, dir_fd=tmp_fd)
        else:
            punch_unused(tmp_fd, link, used[link])


def trim_to_used(
    tmp_fd: int,
    links: list[str],
    chunks: list[ChunkRef],
    reusable: Mapping[tuple[str, int], ChunkRef],
    previous: ReuseSource | None,
) -> set[str]:
    """Trim the links to what ``chunks`` use (see _trim_links); the links the new snapshot keeps."""
    if _uses_every_chunk(chunks, reusable, previous):
        return set(links)  # each link holds only chunks this snapshot uses: nothing to trim
    used = _used_ranges(chunks, links)
    _trim_links(tmp_fd, links, used)
    return set(used)


def previous_snapshot(root: SpillRoot, known: ReuseSource | None) -> ReuseSource | None:
    """The newest snapshot, to reuse from: ``known`` if it is that one, else as read from disk."""
    published = root.published()
    if known is not None and published and published[-1] == known.snapshot:
        return known
    latest = root.latest_manifest()
    return ReuseSource.of(latest) if latest is not None else None


def rewritten_warnings(outcome: CheckFindings, origins: Mapping[str, str], previous: Path) -> list[str]:
    """One warning per file of the previous snapshot whose reused chunks the disk no longer held."""
    lost: dict[str, list[int]] = {}
    for ref in outcome.failed:
        lost.setdefault(ref.file, []).append(ref.length)
    return [
        f"{previous / origins.get(link, link)}: {len(lengths)} chunk(s) to reuse, "
        f"{human_bytes(sum(lengths))}, no longer read back as written "
        f"({outcome.problems.get(link, 'unreadable')}); written again from memory. "
        "Check the disk (dmesg, smartctl)"
        for link, lengths in sorted(lost.items())
    ]


def unread_warning(unread: int, previous: Path) -> str:
    return (
        f"{human_bytes(unread)} reused from {previous} without reading them back (the reuse check "
        "was skipped): a change on the disk goes unnoticed until a wake reads them from the disk"
    )
