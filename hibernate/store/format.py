"""The on-disk snapshot format, version 4: a JSON manifest plus raw data files.

The manifest is the only structured thing read back, and it is plain JSON:
nothing in a snapshot is ever executed. Every field that steers a read (file,
offset, length) is validated before use, so an edited or hostile manifest is
refused with a message naming the problem instead of reading outside the
snapshot. docs/format.md is the reference; keep the two in step.

Version 2 makes a snapshot self-contained and owned: every chunk lies in a
file of the snapshot's own directory (reused bytes are hard links, so
deleting an older snapshot never breaks a newer one), the manifest names the
process it belongs to (:class:`~hibernate.store.owner.Owner`), and it records
each data file's identity as verified when it was written, so a later sleep
reuses only files that nobody has touched since.

Version 3 stores the records and their chunks as columns (one list per
field): a model of many tensors pays per record for every JSON object, and
lists of numbers and strings are encoded and parsed at C speed.

Version 4 packs small chunks back to back (see writer._Packer) and keeps the
records' meta as one JSON text, which a wake compares with the process's
own as text (see :class:`Columns`). Version 3 snapshots are still read.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import json
import math
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, cast

import orjson
import xxhash

from hibernate.errors import SnapshotInvalidError
from hibernate.store.owner import Owner, parse_owner

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
DATA_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_CHECKSUM_RE = re.compile(r"^[0-9a-f]{16}$")
_CHECKSUMS_RE = re.compile(r"(?:[0-9a-f]{16})*")  # many checksums joined: one match checks them all
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BYTES = bytes(range(0x20)) + b"\x7f"
_CHECKSUM_SUFFIX_RE = re.compile(rb',"manifest_checksum":"([0-9a-f]{16})"\}\n?$')


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector while many small containers are built.

    Parsing or building a manifest of N records makes ~15 N dicts, lists and
    tuples, none of them in a reference cycle, and every 700 new containers the
    collector walks the young ones and, ever more often, the whole heap: at
    100,000 records ``json.loads`` took 1.3 s with it and 0.4 s without. The
    collector is only deferred (and re-enabled as it was), never skipped:
    nothing made here needs it.

    On the way out, what was allocated meanwhile is moved to the oldest
    generation (``gc.freeze`` then ``gc.unfreeze``, which also zeroes the
    young generation's count) instead of being left young: otherwise the
    first allocation after re-enabling walks it all, then promotes it, and
    soon a full collection walks the whole heap again (0.7 s at 100,000
    tensors). The objects made here live until the wake anyway; any garbage
    cycle among them (or the program's) is still found, by the next full
    collection.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.freeze()
            gc.unfreeze()
            gc.enable()


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


def check_region(key: object, tag: object, meta: object, where: str) -> None:
    """What a reader demands of a record's key, tag and meta; a writer checks it before writing."""
    _validate_key(key, where)
    if not isinstance(tag, str) or not tag:
        raise SnapshotInvalidError(f"{where}: tag must be a non-empty string")
    check_meta(meta, where)


_PLAIN_SCALARS = frozenset({str, int, bool, type(None)})


def _is_plain(value: object, depth: int = 0) -> bool:
    """True if ``value`` is certainly what :func:`_validate_meta` accepts; False means "check it".

    Exact types only, and a list of scalars is checked by the set of its item
    types (one C call): a tensor's meta is checked in about 2 us, where the
    general check took 20. Floats send it to the full check (for NaN), and so
    does anything unusual, which then refuses with its own message.
    """
    if depth > MAX_META_DEPTH:
        return False
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if kind is dict:
        if depth + 1 > MAX_META_DEPTH and value:
            return False
        for key, item in value.items():  # type: ignore[attr-defined]
            if type(key) is not str:
                return False
            kind = type(item)
            if kind in _PLAIN_SCALARS:
                continue
            # A list of scalars (a shape, strides) without a call, if it may nest one more level.
            if kind is list and depth + 2 <= MAX_META_DEPTH and set(map(type, item)) <= _PLAIN_SCALARS:
                continue
            if not _is_plain(item, depth + 1):
                return False
        return True
    if kind is list or kind is tuple:
        if depth + 1 > MAX_META_DEPTH and value:
            return False
        if set(map(type, value)) <= _PLAIN_SCALARS:  # type: ignore[call-overload]
            return True
        return all(_is_plain(item, depth + 1) for item in value)  # type: ignore[attr-defined]
    return False


def keys_plain(keys: list[str]) -> bool:
    """True if every key certainly passes :func:`_validate_key` and no two are equal; checked in bulk.

    Joined with ``/``, a key that is empty or absolute shows as ``//``, a
    ``..`` component as ``/../``; a false alarm (a key with ``//`` inside)
    only sends the caller to the per-key checks, which decide.
    """
    if not keys:
        return True
    if set(map(type, keys)) != {str}:
        return False
    joined = "/" + "/".join(keys) + "/"
    try:
        encoded = joined.encode()
    except UnicodeEncodeError:  # a lone surrogate: the per-key checks refuse it
        return False
    return not (
        not min(map(len, keys))
        or max(map(len, keys)) > MAX_KEY_LENGTH
        # No control character, looked for in the UTF-8 bytes, where each is its own byte and
        # no other character's: 2 ms for 100,000 keys where a regular expression took 14.
        or len(encoded.translate(None, _CONTROL_BYTES)) != len(encoded)
        or "//" in joined
        or "/../" in joined
        or len(set(keys)) != len(keys)
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


def tags_plain(tags: Sequence[object]) -> bool:
    """True if every tag is a non-empty string, checked in bulk."""
    return not tags or (set(map(type, tags)) == {str} and "" not in set(tags))


def regions_plain(keys: list[str], tags: Sequence[object], metas: Sequence[object]) -> bool:
    """True if every region certainly passes :func:`check_region` and the keys are unique."""
    return (
        keys_plain(keys)
        and tags_plain(tags)
        and all(type(meta) is PlainMeta or (type(meta) is dict and _is_plain(meta)) for meta in metas)
    )


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


def _body_checksum(body: Mapping[str, Any]) -> str:
    return checksum(_canonical(body))


def validate_data_file(name: object, where: str) -> str:
    """A data file's name: one plain component of the snapshot's own directory, nothing else."""
    if not isinstance(name, str):
        raise SnapshotInvalidError(f"{where}: file must be a string, got {type(name).__name__}")
    if "/" in name or name in (".", ".."):
        raise SnapshotInvalidError(
            f"{where}: file {name!r} is not a file of the snapshot's own directory; refusing it"
        )
    if not DATA_FILE_RE.match(name):
        raise SnapshotInvalidError(f"{where}: file name {name!r} has characters not allowed")
    return name


def check_meta(meta: object, where: str) -> None:
    """Refuse meta that breaks the rules of plain JSON (section 3 of format.md): its depth, its values."""
    if not isinstance(meta, Mapping):
        raise SnapshotInvalidError(f"{where}: meta must be an object")
    _validate_meta(meta, where)


def _validate_key(key: object, where: str) -> str:
    if not isinstance(key, str) or not key:
        raise SnapshotInvalidError(f"{where}: key must be a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise SnapshotInvalidError(f"{where}: key is longer than {MAX_KEY_LENGTH} characters")
    if _CONTROL_RE.search(key):
        raise SnapshotInvalidError(f"{where}: key {key!r} contains control characters")
    if key.startswith("/") or ".." in key.split("/"):
        raise SnapshotInvalidError(f"{where}: key {key!r} contains '..' or is absolute")
    return key


def _validate_meta(value: object, where: str, depth: int = 0) -> Any:
    """Meta is free-form but plain: JSON scalars, lists and string-keyed objects, bounded depth.

    A live region's meta (tuples, any mapping) is checked as the JSON it will become.
    """
    if depth > MAX_META_DEPTH:
        raise SnapshotInvalidError(f"{where}: meta is nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SnapshotInvalidError(f"{where}: meta holds a non-finite number")
        return value
    if isinstance(value, (list, tuple)):
        return [_validate_meta(v, where, depth + 1) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _validate_meta(v, where, depth + 1) for k, v in value.items()}
    raise SnapshotInvalidError(f"{where}: meta holds a value of type {type(value).__name__}")


def _int_field(obj: Mapping[str, Any], name: str, where: str, minimum: int = 0) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise SnapshotInvalidError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _parse_chunk(raw: object, where: str) -> ChunkRef:
    if not isinstance(raw, dict):
        raise SnapshotInvalidError(f"{where}: chunk must be an object")
    offset = _int_field(raw, "offset", where)
    length = _int_field(raw, "length", where, minimum=1)
    if offset + length > MAX_FILE_OFFSET:
        raise SnapshotInvalidError(f"{where}: offset {offset} + length {length} lies beyond any data file")
    digest = raw.get("checksum")
    if not isinstance(digest, str) or not _CHECKSUM_RE.match(digest):
        raise SnapshotInvalidError(f"{where}: checksum {digest!r} is not 16 hex digits")
    return ChunkRef(validate_data_file(raw.get("file"), where), offset, length, digest)


def _parse_files(raw: object, where: str) -> dict[str, FileIdentity]:
    if not isinstance(raw, dict):
        raise SnapshotInvalidError(f"{where}: files must be an object")
    files = {}
    for name, identity in raw.items():
        validate_data_file(name, f"{where}: files")
        if not isinstance(identity, dict):
            raise SnapshotInvalidError(f"{where}: files[{name!r}] must be an object")
        fields = [
            _int_field(identity, f, f"{where}: files[{name!r}]")
            for f in ("size", "device", "inode", "mtime_ns", "ctime_ns")
        ]
        files[name] = FileIdentity(*fields)
    return files


def _parse_record(raw: object, where: str, chunk_bytes: int) -> Record:
    if not isinstance(raw, dict):
        raise SnapshotInvalidError(f"{where}: record must be an object")
    key = _validate_key(raw.get("key"), where)
    where = f"{where} ({key!r})"
    tag = raw.get("tag")
    if not isinstance(tag, str) or not tag:
        raise SnapshotInvalidError(f"{where}: tag must be a non-empty string")
    nbytes = _int_field(raw, "nbytes", where)
    meta = raw.get("meta", {})
    if not isinstance(meta, dict):
        raise SnapshotInvalidError(f"{where}: meta must be an object")
    chunks_raw = raw.get("chunks")
    if not isinstance(chunks_raw, list):
        raise SnapshotInvalidError(f"{where}: chunks must be a list")
    chunks = tuple(_parse_chunk(c, f"{where} chunk {i}") for i, c in enumerate(chunks_raw))
    for i, chunk in enumerate(chunks):
        if chunk.length > chunk_bytes:
            raise SnapshotInvalidError(
                f"{where} chunk {i}: length {chunk.length} is more than "
                f"the snapshot's chunk size {chunk_bytes}"
            )
    covered = sum(c.length for c in chunks)
    if covered != nbytes:
        raise SnapshotInvalidError(
            f"{where}: chunk lengths add up to {covered} bytes but the record has {nbytes}"
        )
    return Record(key, tag, nbytes, _validate_meta(meta, where), chunks)


def _verified_fast(data: bytes) -> bool | None:
    """The checksum checked on the bytes as written, without serialising the manifest again.

    A writer writes the canonical body with the checksum appended as its last
    field, so for a manifest in that form the canonical bytes are the file's
    own, and the check costs one hash (30 MB: 20 ms) instead of a second
    serialisation (0.5 s). Returns None for a manifest in any other form
    (edited, re-indented): the caller re-serialises it, as section 4 defines.
    """
    match = _CHECKSUM_SUFFIX_RE.search(data, max(0, len(data) - 64))
    if match is None:
        return None
    # Hashed in place, then the closing brace: copying 25 MB to build the canonical bytes
    # cost 25 ms where the hash takes 1.
    canonical = xxhash.xxh3_64(memoryview(data)[: match.start()])
    canonical.update(b"}")
    return f"{canonical.intdigest():016x}" == match.group(1).decode()


RECORD_COLUMNS = ("key", "tag", "nbytes", "chunks")  # and meta (see _parse_columns)
CHUNK_COLUMNS = ("file", "offset", "length", "checksum")


def _parse_columns(
    body: Mapping[str, Any], where: str, chunk_bytes: int, files: Mapping[str, FileIdentity], major: int
) -> Columns:
    """The manifest's columns, checked: every check of a record and chunk but meta's, most in bulk.

    All but meta, which a reader checks where it uses it: a wake compares it
    with the live process's (equal, it is the process's own), and checks
    one that differs before saying how (see :func:`check_meta`). Format 4
    stores it as text, parsed only then (see :class:`Columns`); format 3 as
    values, each of which must be an object.

    Bulk first: types by the set of a column's item types, ranges by min and
    max, all checksums by one regular expression,
    keys joined and searched once (see :func:`keys_plain`). If anything is
    off, the columns are turned back into one object per record and each is
    checked on its own (:func:`_parse_record`), so a refusal names the
    record, the chunk and the problem, whichever check first saw it.
    """
    records_raw, chunks_raw = body.get("records"), body.get("chunks")
    if not isinstance(records_raw, dict) or not isinstance(chunks_raw, dict):
        raise SnapshotInvalidError(f"{where}: records and chunks must be objects (of columns)")
    record_columns = [records_raw.get(name) for name in RECORD_COLUMNS]
    if not all(isinstance(column, list) for column in record_columns):
        raise SnapshotInvalidError(f"{where}: records must hold lists {', '.join(RECORD_COLUMNS)}")
    keys, tags, sizes, counts = cast("list[list[Any]]", record_columns)
    if not len(keys) == len(tags) == len(sizes) == len(counts):
        raise SnapshotInvalidError(f"{where}: the records' columns differ in length")
    meta_raw = records_raw.get("meta")
    text: str | None = None
    metas: list[Any] | None = None
    if major >= 4:
        if not isinstance(meta_raw, str):
            raise SnapshotInvalidError(f"{where}: records.meta must be a string (the JSON text of an array)")
        text = meta_raw
    else:
        if not isinstance(meta_raw, list) or len(meta_raw) != len(keys):
            raise SnapshotInvalidError(f"{where}: records.meta must be a list, one object per record")
        metas = meta_raw
    file_col, offset_col, length_col, digests = (chunks_raw.get(name) for name in CHUNK_COLUMNS)
    if not (isinstance(file_col, list) and isinstance(offset_col, list) and isinstance(length_col, list)):
        raise SnapshotInvalidError(f"{where}: chunks must hold lists file, offset and length")
    if not isinstance(digests, str) or len(digests) != 16 * len(file_col):
        raise SnapshotInvalidError(f"{where}: chunks.checksum must hold 16 hex digits for each chunk")
    if not len(file_col) == len(offset_col) == len(length_col):
        raise SnapshotInvalidError(f"{where}: the chunks' columns differ in length")
    if set(map(type, counts)) - {int} or (counts and min(counts) < 0) or sum(counts) != len(file_col):
        raise SnapshotInvalidError(
            f"{where}: records.chunks must count each record's chunks, {len(file_col)} in all"
        )
    chunks = ChunkColumns(file_col, offset_col, length_col, digests)
    columns = Columns(keys, tags, sizes, counts, chunks, metas=metas, stored_meta_text=text, where=where)
    bounds = columns.first_chunks()
    if (metas is None or set(map(type, metas)) <= {dict}) and _columns_plain(
        keys, tags, sizes, file_col, offset_col, length_col, digests, chunk_bytes, files
    ):
        covered = [0, *itertools.accumulate(length_col)]
        if [covered[b] - covered[a] for a, b in itertools.pairwise(bounds)] == sizes:
            return columns
    # Something is off: look at each record on its own, to say which and what.
    refs = columns.chunks.refs()
    per_record = [tuple(refs[a:b]) for a, b in itertools.pairwise(bounds)]
    raw = [
        {
            "key": key,
            "tag": tag,
            "nbytes": nbytes,
            "meta": meta,
            "chunks": [chunk.to_json() for chunk in chunks],
        }
        for key, tag, nbytes, meta, chunks in zip(keys, tags, sizes, columns.metas, per_record, strict=True)
    ]
    records = tuple(_parse_record(r, f"{where}: record {i}", chunk_bytes) for i, r in enumerate(raw))
    keys_seen = [r.key for r in records]
    if len(set(keys_seen)) != len(keys_seen):
        raise SnapshotInvalidError(f"{where}: two records share a key")
    for record in records:
        for chunk in record.chunks:
            if chunk.file not in files:
                raise SnapshotInvalidError(
                    f"{where}: record {record.key!r} uses {chunk.file!r}, which is not among the "
                    "snapshot's files"
                )
    # Every record passed on its own: the bulk checks' alarm was a false one (a key with
    # "//" inside, meta of a kind they do not vouch for), and the records are as parsed.
    return Columns.of(records)


def _columns_plain(
    keys: list[Any],
    tags: list[Any],
    sizes: list[Any],
    file_col: list[Any],
    offset_col: list[Any],
    length_col: list[Any],
    digests: str,
    chunk_bytes: int,
    files: Mapping[str, FileIdentity],
) -> bool:
    """True if every record and chunk certainly passes the per-record checks (all but the sums)."""
    if not keys:
        return not file_col
    if not (
        set(map(type, sizes)) == {int}
        and min(sizes) >= 0
        and keys_plain(keys)
        and tags_plain(tags)
        and _CHECKSUMS_RE.fullmatch(digests)
    ):
        return False
    if not file_col:
        return True
    return bool(
        set(map(type, file_col)) == {str}
        and set(file_col) <= files.keys()
        and set(map(type, offset_col)) == {int}
        and set(map(type, length_col)) == {int}
        and min(offset_col) >= 0
        and min(length_col) >= 1
        and max(length_col) <= chunk_bytes
        and max(offset_col) + max(length_col) <= MAX_FILE_OFFSET
    )


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate a manifest; every refusal names ``where`` and the problem."""
    with gc_paused():
        return _parse_manifest(data, where)


def _parse_manifest(data: bytes, where: str) -> Manifest:
    try:
        # Strict JSON: no NaN or Infinity, no number too large for a double (an integer past
        # 64 bits reads as a float, which no integer field takes), UTF-8 only; 1.5 times
        # json.loads's speed on a manifest of many records.
        body = orjson.loads(data)
    except orjson.JSONDecodeError as exc:  # also deep nesting and bad UTF-8
        raise SnapshotInvalidError(f"{where}: not valid JSON ({exc}); truncated or corrupted") from exc
    if not isinstance(body, dict):
        raise SnapshotInvalidError(f"{where}: top level must be a JSON object")
    if body.get("format") != FORMAT_NAME:
        raise SnapshotInvalidError(f"{where}: not a hibernate snapshot (format {body.get('format')!r})")
    version = body.get("version")
    major_text, _, minor_text = str(version).partition(".")
    if not (isinstance(version, str) and major_text.isdigit() and minor_text.isdigit()):
        raise SnapshotInvalidError(f"{where}: version {version!r} is not of the form MAJOR.MINOR")
    if int(major_text) not in READABLE_MAJORS:
        raise SnapshotInvalidError(
            f"{where}: format version {version} is not supported "
            f"(this hibernate reads {' and '.join(f'{major}.x' for major in READABLE_MAJORS)})",
            hint="a snapshot is woken by the hibernate that put its process to sleep: "
            "wake it with the version that wrote it",
        )
    if body.get("checksum_algorithm") != CHECKSUM_ALGORITHM:
        raise SnapshotInvalidError(f"{where}: unknown checksum algorithm {body.get('checksum_algorithm')!r}")
    if body.get("alignment") != ALIGNMENT:
        raise SnapshotInvalidError(f"{where}: alignment {body.get('alignment')!r}, expected {ALIGNMENT}")
    name = body.get("snapshot")
    if not isinstance(name, str) or not SNAPSHOT_NAME_RE.match(name):
        raise SnapshotInvalidError(f"{where}: snapshot name {name!r} is not snap-NNNNNN")
    producer = body.get("producer", {})
    if not isinstance(producer, dict):
        raise SnapshotInvalidError(f"{where}: producer must be an object")
    chunk_bytes = _int_field(body, "chunk_bytes", where, minimum=ALIGNMENT)
    if chunk_bytes % ALIGNMENT or chunk_bytes > MAX_CHUNK_BYTES:
        raise SnapshotInvalidError(
            f"{where}: chunk_bytes {chunk_bytes} is not a multiple of {ALIGNMENT} "
            f"of at most {MAX_CHUNK_BYTES}"
        )
    owner = parse_owner(body.get("owner"))
    if owner is None:
        raise SnapshotInvalidError(f"{where}: owner is missing or malformed")
    files = _parse_files(body.get("files"), where)
    keys = body.get("records", {}).get("key") if isinstance(body.get("records"), dict) else None
    check_manifest_size(len(data), len(keys) if isinstance(keys, list) else 0, where)
    columns = _parse_columns(body, where, chunk_bytes, files, int(major_text))
    created = body.get("created_unix", 0.0)
    manifest = Manifest(
        snapshot=name,
        producer=_validate_meta(producer, where),
        chunk_bytes=chunk_bytes,
        columns=columns,
        owner=owner,
        files=files,
        created_unix=float(created) if isinstance(created, (int, float)) else 0.0,
    )
    verified = _verified_fast(data)
    if verified is None:
        verified = body.get("manifest_checksum") == _body_checksum(body)
    if not verified:
        raise SnapshotInvalidError(
            f"{where}: manifest checksum does not match its contents; it was edited or corrupted"
        )
    return manifest
