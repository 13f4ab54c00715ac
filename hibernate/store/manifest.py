"""The on-disk snapshot format, version 4: a JSON manifest plus raw data files.

The manifest is the only structured thing read back, and it is plain JSON:
nothing in a snapshot is ever executed. Every field that steers a read (file,
offset, length) is validated before use, so an edited or hostile manifest is
refused with a message naming the problem instead of reading outside the
snapshot (see parse.py). docs/format.md is the reference; keep the two in step.

Version 2 makes a snapshot self-contained and owned: every chunk lies in a
file of the snapshot's own directory (reused bytes are hard links, so
deleting an older snapshot never breaks a newer one), the manifest names the
process it belongs to (:class:`~hibernate.store.owner.Owner`), and it records
each data file's identity as verified when it was written, so a later sleep
reuses only files that nobody has touched since.

Version 3 stores the records and their chunks as columns (one list per
field): a model of many tensors pays per record for every JSON object, and
lists of numbers and strings are encoded and parsed at C speed.

Version 4 packs small chunks back to back (see arena.Packer) and keeps the
records' meta as one JSON text, which a wake compares with the process's
own as text (see :class:`Columns`). Version 3 snapshots are still read.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import orjson
import xxhash

from hibernate.errors import SnapshotInvalidError
from hibernate.gcpause import gc_paused
from hibernate.store.owner import Owner

FORMAT_NAME = "hibernate-snapshot"
FORMAT_MAJOR = 4
FORMAT_MINOR = 0
READABLE_MAJORS = (3, 4)  # 3.x holds each record's meta as an object, 4.x as one text (see Columns)
CHECKSUM_ALGORITHM = "xxh3-64"
ALIGNMENT = 4096  # where writes and reads start and what they cover, for O_DIRECT on every common block size
MANIFEST_NAME = "manifest.json"
# What a reader accepts, and so what a writer refuses to publish: a manifest over these
# limits would leave its process asleep for good. 1,000,000 one-view tensor records take
# about 280 MiB with 64-character names and 650 MiB with 256-character ones (measured, format 3).
MANIFEST_LIMIT_BYTES = 1 << 30
MAX_RECORDS = 2_000_000
MAX_CHUNK_BYTES = 1 << 30  # a reader stages one chunk at a time: this bounds its memory
MAX_FILE_OFFSET = 1 << 60  # far beyond any real data file, far below what off_t can hold
MAX_KEY_LENGTH = 1024
MAX_META_DEPTH = 8

SNAPSHOT_NAME_RE = re.compile(r"^snap-(\d{6,12})$")


def checksum(data: bytes | memoryview) -> str:
    """The chunk checksum: xxh3-64 as 16 lower-case hex digits."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    """``n`` rounded up to a multiple of ``alignment``: where the next chunk may start."""
    return (n + alignment - 1) // alignment * alignment


def snapshot_name(sequence: int) -> str:
    """The directory name of snapshot number ``sequence`` (``snap-000007``)."""
    return f"snap-{sequence:06d}"


def snapshot_sequence(name: str) -> int | None:
    """The number of a snapshot directory name, or None for any other name."""
    match = SNAPSHOT_NAME_RE.match(name)
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class FileIdentity:
    """A data file as it was when its snapshot was published.

    Writing, truncating, punching, linking, renaming over or changing the mode
    of a file all change its change time (``ctime``), which nobody but the
    kernel can set: a file whose identity is unchanged still holds the bytes
    that were verified when it was written, and may be reused.
    """

    size: int
    device: int
    inode: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> FileIdentity:
        return cls(info.st_size, info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns)

    def to_json(self) -> dict[str, int]:
        return {
            "size": self.size,
            "device": self.device,
            "inode": self.inode,
            "mtime_ns": self.mtime_ns,
            "ctime_ns": self.ctime_ns,
        }


class ChunkRef(NamedTuple):
    """Where one piece of a record lies: ``length`` bytes at ``offset`` of ``file``.

    ``file`` is a data file in the snapshot's own directory. A named tuple
    rather than a frozen dataclass: a snapshot of a million tensors makes a
    million of them, and a tuple is built in a tenth of the time.
    """

    file: str
    offset: int
    length: int
    checksum: str

    def to_json(self) -> dict[str, Any]:
        return {
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "checksum": self.checksum,
        }


class Record(NamedTuple):
    """One contiguous region of memory (a tensor storage, an allocator block); a tuple, as ChunkRef."""

    key: str
    tag: str
    nbytes: int
    meta: Mapping[str, Any]
    chunks: tuple[ChunkRef, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "tag": self.tag,
            "nbytes": self.nbytes,
            "meta": dict(self.meta),
            "chunks": [c.to_json() for c in self.chunks],
        }


class ChunkColumns(NamedTuple):
    """Every chunk of a snapshot in record order, one list per field, as the manifest stores them.

    A wake plans its reads and a sleep finds reusable bytes from these lists
    directly: at 100,000 tensors, a ChunkRef and a Record per tensor cost
    more than the rest of parsing them (see docs/performance.md).
    """

    files: list[str]
    offsets: list[int]
    lengths: list[int]
    checksums: str  # 16 hex digits per chunk, back to back

    @classmethod
    def of(cls, chunks: Sequence[ChunkRef]) -> ChunkColumns:
        if not chunks:
            return cls([], [], [], "")
        files, offsets, lengths, checksums = zip(*chunks, strict=True)  # one pass in C
        return cls(list(files), list(offsets), list(lengths), "".join(checksums))

    def checksum(self, index: int) -> str:
        return self.checksums[16 * index : 16 * index + 16]

    def digests(self) -> list[str]:
        """Every chunk's checksum, in order."""
        checksums = self.checksums
        return [checksums[at : at + 16] for at in range(0, len(checksums), 16)]

    def refs(self) -> list[ChunkRef]:
        return list(map(ChunkRef, self.files, self.offsets, self.lengths, self.digests()))


class Columns:
    """A snapshot's records as the manifest stores them: one list per field, and their chunks.

    ``counts`` says how many of the chunks (in order) each record has.
    :meth:`records` turns them into one Record per region for those who want
    that; a wake does not.

    Since format 4 the records' meta is stored as one JSON text (see
    :func:`meta_text`) and parsed only when asked for: a wake compares that
    text with the process's own, and at 100,000 tensors parsing and
    comparing 100,000 meta objects cost three times as much as encoding the
    process's. A format-3 manifest gives its meta as parsed values instead.
    """

    def __init__(
        self,
        keys: list[str],
        tags: list[str],
        sizes: list[int],
        counts: list[int],
        chunks: ChunkColumns,
        *,
        metas: list[Mapping[str, Any]] | None = None,
        stored_meta_text: str | None = None,
        where: str = MANIFEST_NAME,
    ) -> None:
        if metas is None and stored_meta_text is None:
            raise ValueError("the records' meta must be given, as values or as text")
        self.keys, self.tags, self.sizes, self.counts, self.chunks = keys, tags, sizes, counts, chunks
        self._metas = metas
        self.stored_meta_text = stored_meta_text  # None where the manifest held values (format 3)
        self._where = where

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Columns):
            return NotImplemented
        return (self.keys, self.tags, self.sizes, self.counts, self.chunks, self.metas) == (
            other.keys,
            other.tags,
            other.sizes,
            other.counts,
            other.chunks,
            other.metas,
        )

    __hash__ = None  # type: ignore[assignment]  # mutable lists inside

    @property
    def metas(self) -> list[Mapping[str, Any]]:
        """Each record's meta, parsed from the stored text the first time it is asked for."""
        if self._metas is None:
            assert self.stored_meta_text is not None
            self._metas = parse_meta_text(self.stored_meta_text, len(self.keys), self._where)
        return self._metas

    @classmethod
    def of(cls, records: Sequence[Record]) -> Columns:
        return cls.build(
            [record.key for record in records],
            [record.tag for record in records],
            [record.nbytes for record in records],
            [record.meta for record in records],
            [len(record.chunks) for record in records],
            [chunk for record in records for chunk in record.chunks],
        )

    @classmethod
    def build(
        cls,
        keys: list[str],
        tags: list[str],
        sizes: list[int],
        metas: list[Mapping[str, Any]],
        counts: list[int],
        chunks: Sequence[ChunkRef],
        *,
        text: str | None = None,
    ) -> Columns:
        """Columns from each record's fields and all chunks in order (``counts`` of them per record),
        without a Record per region. ``text``: the metas' :func:`meta_text` if the caller has it."""
        if text is None:
            text = _required_meta_text(metas, MANIFEST_NAME)
        return cls(keys, tags, sizes, counts, ChunkColumns.of(chunks), metas=metas, stored_meta_text=text)

    def first_chunks(self) -> list[int]:
        """The index of each record's first chunk, and after them the number of chunks."""
        return [0, *itertools.accumulate(self.counts)]

    def records(self) -> tuple[Record, ...]:
        refs = self.chunks.refs()
        per_record = [tuple(refs[a:b]) for a, b in itertools.pairwise(self.first_chunks())]
        return tuple(map(Record, self.keys, self.tags, self.sizes, self.metas, per_record))

    def to_json(self) -> dict[str, dict[str, Any]]:
        """The manifest's ``records`` and ``chunks`` objects.

        One list per field instead of one object per record and per chunk:
        JSON encodes and parses a list of numbers or strings at C speed, while
        each object costs a dict and its keys. At 100,000 one-chunk records
        the manifest shrank by a quarter and encoded twice as fast.
        """
        text = self.stored_meta_text
        if text is None:
            text = _required_meta_text(self.metas, self._where)
        chunks = self.chunks
        return {
            "records": {
                "chunks": self.counts,
                "key": self.keys,
                "meta": text,
                "nbytes": self.sizes,
                "tag": self.tags,
            },
            "chunks": {
                "checksum": chunks.checksums,
                "file": chunks.files,
                "length": chunks.lengths,
                "offset": chunks.offsets,
            },
        }


class RememberedManifest(NamedTuple):
    """A manifest this process wrote, and the digest of the bytes it published (manifest_digest).

    The process that wrote a snapshot wakes from it: where the file still holds
    exactly those bytes, what parsing them would give is this very manifest,
    already checked when it was encoded, so the wake skips a parse that took
    3 s at a million tensors (0.3 s at 100,000). Any other bytes are parsed
    and checked as every reader does.
    """

    digest: str
    manifest: Manifest


def manifest_digest(data: bytes) -> str:
    """The digest a process keeps of the manifest bytes it published (see RememberedManifest)."""
    return xxhash.xxh3_128_hexdigest(data)


class WrittenRecords(NamedTuple):
    """The records a sleep wrote, as a wake compares them: keys, tags, sizes and the meta text.

    A process that wrote a snapshot holds the very regions it described (same
    objects, whose key, tag, size and meta do not change), so its wake can
    compare the snapshot with what it wrote rather than with each region: four
    list comparisons, where building and comparing a tuple per region and
    encoding every region's meta again took 0.15 s at 100,000 tensors (see
    SnapshotReader.check_matches). The key and tag lists are the regions' own
    strings; the meta text is the one copy held beyond them.
    """

    keys: list[str]
    tags: list[str]
    sizes: list[int]
    meta_text: str

    @classmethod
    def of(cls, columns: Columns) -> WrittenRecords:
        """What a manifest being written says of its records (a format-4 Columns holds its meta text)."""
        assert columns.stored_meta_text is not None, "a manifest being written has its meta text"
        return cls(columns.keys, columns.tags, columns.sizes, columns.stored_meta_text)


def meta_text(metas: Sequence[Mapping[str, Any]]) -> str | None:
    """The records' meta as format 4 stores it: the compact JSON text of an array, one object each.

    The same values in the same order give the same text, which is what a
    wake relies on to compare a snapshot's meta with the process's without
    parsing it (any other difference, such as keys in another order, only
    sends it to comparing the values). orjson encodes a PlainMeta, which is
    plain by construction, 6-8 times faster than json.dumps; any other
    meta goes through json.dumps, which refuses what is not strict JSON.
    None if some meta is not (a NaN, an object that is not JSON, a nesting too deep to encode).
    """
    if all(type(meta) is PlainMeta for meta in metas):
        try:
            return orjson.dumps(metas).decode()
        except TypeError:  # an int past 64 bits, or nested deeper than orjson goes
            pass
    try:
        return json.dumps(
            [plain_meta(meta) for meta in metas], separators=(",", ":"), allow_nan=False, ensure_ascii=False
        )
    except (TypeError, ValueError, RecursionError):  # RecursionError: a meta nested hundreds deep
        return None


def _required_meta_text(metas: Sequence[Mapping[str, Any]], where: str) -> str:
    """meta_text for a manifest being written; the writer checked meta first (check_region), so a
    refusal here is a maker's broken promise (a PlainMeta holding something that is not JSON)."""
    text = meta_text(metas)
    if text is None:
        raise SnapshotInvalidError(f"{where}: meta holds a value that is not plain JSON")
    return text


def parse_meta_text(text: str, records: int, where: str) -> list[Mapping[str, Any]]:
    """The records' meta from its stored text: an array of ``records`` objects (depth is checked on use)."""
    try:
        metas = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise SnapshotInvalidError(f"{where}: records.meta is not valid JSON ({exc})") from exc
    if not isinstance(metas, list) or len(metas) != records or set(map(type, metas)) - {dict}:
        raise SnapshotInvalidError(
            f"{where}: records.meta must hold one object for each of the {records} records"
        )
    return metas


@dataclass(frozen=True)
class Manifest:
    """A whole snapshot: what was written, by whom, and where every byte lies."""

    snapshot: str
    producer: Mapping[str, Any]
    chunk_bytes: int
    columns: Columns
    owner: Owner
    files: Mapping[str, FileIdentity] = field(default_factory=dict)
    created_unix: float = 0.0

    @functools.cached_property
    def records(self) -> tuple[Record, ...]:
        """One Record per region, built the first time they are asked for (a wake does not)."""
        return self.columns.records()

    @property
    def total_bytes(self) -> int:
        return sum(self.columns.sizes)

    def body(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "version": f"{FORMAT_MAJOR}.{FORMAT_MINOR}",
            "snapshot": self.snapshot,
            "created_unix": self.created_unix,
            "producer": dict(self.producer),
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "alignment": ALIGNMENT,
            "chunk_bytes": self.chunk_bytes,
            "owner": self.owner.to_json(),
            "files": {name: identity.to_json() for name, identity in sorted(self.files.items())},
            **self.columns.to_json(),
        }

    def encode(self) -> bytes:
        """The manifest's bytes; refuses (before anything is published) what a reader would refuse.

        The body is serialised once, in its canonical form, and the checksum of
        those very bytes is appended as the last field: with a million records,
        serialising twice (once to checksum, once to write) was half the cost.
        """
        with gc_paused():
            canonical = _canonical(self.body())
        # Joined once: a chain of + copied the 25 MB of a manifest of 100,000 tensors four times.
        suffix = b',"manifest_checksum":"' + checksum(canonical).encode() + b'"}\n'
        data = b"".join((memoryview(canonical)[:-1], suffix))
        check_manifest_size(len(data), len(self.columns.keys))
        return data


def check_manifest_size(nbytes: int, records: int, where: str = MANIFEST_NAME) -> None:
    """The one rule for a manifest's size, applied by the writer before publishing and the reader."""
    if records > MAX_RECORDS:
        raise SnapshotInvalidError(
            f"{where}: {records} records, more than the {MAX_RECORDS} a snapshot may hold",
            hint="track fewer, larger tensors (e.g. a flat buffer per layer)",
        )
    if nbytes > MANIFEST_LIMIT_BYTES:
        raise SnapshotInvalidError(
            f"{where} is {nbytes} bytes, more than the {MANIFEST_LIMIT_BYTES} allowed",
            hint="track fewer tensors or give them shorter names",
        )


class PlainMeta(dict[str, Any]):
    """A meta its maker built from plain values only; the writer takes its word for it.

    For makers that build meta themselves from values that are plain by
    construction (a tensor's dtype name, shape, strides and offset: strings
    and ints), nesting it no deeper than :data:`MAX_META_DEPTH`. Checking
    each meta before a spill cost 3-4 us a record on this machine, a third
    of the per-tensor budget at 100,000 tensors; any other meta is checked.
    Being a ``dict``, it compares, encodes and parses like any other.
    """


def plain_meta(value: Any) -> Any:
    """Live meta as the manifest holds it: tuples become lists, keys strings."""
    if isinstance(value, Mapping):
        return {str(k): plain_meta(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_meta(v) for v in value]
    return value


def _canonical(body: Mapping[str, Any]) -> bytes:
    """The manifest without its checksum, serialised as the checksum covers it (section 4 of format.md).

    That is ``json.dumps(body, sort_keys=True, separators=(",", ":"),
    allow_nan=False)``, built field by field in key order as json.dumps joins
    them. The two large fields, the record and chunk columns, are encoded by
    orjson (six to eight times faster: 0.06 s against 0.4 s at 100,000
    tensors) wherever it writes the very same bytes, which
    :func:`_fast_canonical` makes sure of; anywhere else json.dumps is used.
    """
    pieces = [b"{"]
    for name in sorted(name for name in body if name != "manifest_checksum"):
        value = body[name]
        encoded = _fast_canonical(name, value)
        if encoded is None:
            encoded = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        pieces += [b"," if len(pieces) > 1 else b"", json.dumps(name).encode(), b":", encoded]
    pieces.append(b"}")
    return b"".join(pieces)  # one copy of the large fields, not one per concatenation


def _fast_canonical(name: str, value: Any) -> bytes | None:
    """A column field encoded by orjson, or None where its bytes could differ from json.dumps's.

    They are the same for strings, exact ints of 64 bits, lists and
    string-keyed dicts, provided the text is ASCII without DEL (json.dumps
    escapes both, orjson does not): so floats (formatted differently, and
    NaN written as null) must be absent, which the columns' int types and
    the meta column being one string guarantee; an int past 64 bits makes
    orjson refuse.
    """
    if not isinstance(value, dict):
        return None
    if name == "chunks":
        numbers = [value.get("length"), value.get("offset")]
    elif name == "records":
        if not isinstance(value.get("meta"), str):  # format 3's values may hold floats
            return None
        numbers = [value.get("nbytes"), value.get("chunks")]
    else:
        return None
    if not all(isinstance(column, list) and set(map(type, column)) <= {int} for column in numbers):
        return None
    try:
        encoded = orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an int past 64 bits, or a type orjson does not take
        return None
    return encoded if encoded.isascii() and b"\x7f" not in encoded else None


def body_checksum(body: Mapping[str, Any]) -> str:
    """The checksum of a manifest's body, as its ``manifest_checksum`` holds it (section 4 of format.md)."""
    return checksum(_canonical(body))
