"""The on-disk snapshot format, version 1: a JSON manifest plus raw data files.

The manifest is the only structured thing read back, and it is plain JSON:
nothing in a snapshot is ever executed. Every field that steers a read (file,
offset, length) is validated before use, so an edited or hostile manifest is
refused with a message naming the problem instead of reading outside the
snapshot. docs/format.md is the reference; keep the two in step.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from hibernate.errors import SnapshotInvalidError

FORMAT_NAME = "hibernate-snapshot"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
CHECKSUM_ALGORITHM = "xxh3-64"
ALIGNMENT = 4096  # data offsets and write sizes, for O_DIRECT on every common block size
MANIFEST_NAME = "manifest.json"
MANIFEST_LIMIT_BYTES = 256 << 20
MAX_CHUNK_BYTES = 1 << 30  # a reader stages one chunk at a time: this bounds its memory
MAX_FILE_OFFSET = 1 << 60  # far beyond any real data file, far below what off_t can hold
MAX_KEY_LENGTH = 1024
MAX_META_DEPTH = 8

SNAPSHOT_NAME_RE = re.compile(r"^snap-(\d{6,12})$")
_PATH_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_CHECKSUM_RE = re.compile(r"^[0-9a-f]{16}$")


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
class ChunkRef:
    """Where one piece of a record lies: ``length`` bytes at ``offset`` of ``file``.

    ``file`` is relative to the spill root (the per-process directory), so a
    new snapshot can refer to an unchanged chunk written by an older one.
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


@dataclass(frozen=True)
class Record:
    """One contiguous region of memory (a tensor storage, an allocator block)."""

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


@dataclass(frozen=True)
class Manifest:
    """A whole snapshot: what was written, by whom, and where every byte lies."""

    snapshot: str
    producer: Mapping[str, Any]
    chunk_bytes: int
    records: tuple[Record, ...]
    created_unix: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(r.nbytes for r in self.records)

    def files(self) -> set[str]:
        return {c.file for r in self.records for c in r.chunks}

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
            "records": [r.to_json() for r in self.records],
        }

    def encode(self) -> bytes:
        body = self.body()
        body["manifest_checksum"] = _body_checksum(body)
        return json.dumps(body, indent=1, sort_keys=True).encode("utf-8") + b"\n"


def _body_checksum(body: Mapping[str, Any]) -> str:
    canonical = json.dumps(
        {k: v for k, v in body.items() if k != "manifest_checksum"},
        sort_keys=True,
        separators=(",", ":"),
        allow_nan=False,
    )
    return checksum(canonical.encode("utf-8"))


def _refuse_constant(name: str) -> Any:
    """JSON has no NaN or Infinity; Python's parser accepts them unless told otherwise."""
    raise ValueError(f"{name} is not a JSON number")


def validate_relative_file(path: object, where: str) -> str:
    """A data file path: ``snap-NNNNNN/<name>``, relative, no ``..``, no odd characters."""
    if not isinstance(path, str):
        raise SnapshotInvalidError(f"{where}: file must be a string, got {type(path).__name__}")
    if path.startswith("/"):
        raise SnapshotInvalidError(f"{where}: file {path!r} is an absolute path; refusing it")
    parts = path.split("/")
    if ".." in parts or "." in parts:
        raise SnapshotInvalidError(f"{where}: file {path!r} contains '..' or '.'; refusing it")
    if len(parts) != 2 or not SNAPSHOT_NAME_RE.match(parts[0]):
        raise SnapshotInvalidError(
            f"{where}: file {path!r} is not of the form snap-NNNNNN/<name>; refusing it"
        )
    if not _PATH_COMPONENT_RE.match(parts[1]):
        raise SnapshotInvalidError(f"{where}: file name {parts[1]!r} has characters not allowed")
    return path


def _validate_key(key: object, where: str) -> str:
    if not isinstance(key, str) or not key:
        raise SnapshotInvalidError(f"{where}: key must be a non-empty string")
    if len(key) > MAX_KEY_LENGTH:
        raise SnapshotInvalidError(f"{where}: key is longer than {MAX_KEY_LENGTH} characters")
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in key):
        raise SnapshotInvalidError(f"{where}: key {key!r} contains control characters")
    if key.startswith("/") or ".." in key.split("/"):
        raise SnapshotInvalidError(f"{where}: key {key!r} contains '..' or is absolute")
    return key


def _validate_meta(value: object, where: str, depth: int = 0) -> Any:
    """Meta is free-form but plain: JSON scalars, lists and string-keyed objects, bounded depth."""
    if depth > MAX_META_DEPTH:
        raise SnapshotInvalidError(f"{where}: meta is nested too deeply")
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SnapshotInvalidError(f"{where}: meta holds a non-finite number")
        return value
    if isinstance(value, list):
        return [_validate_meta(v, where, depth + 1) for v in value]
    if isinstance(value, dict):
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
    if offset % ALIGNMENT:
        raise SnapshotInvalidError(f"{where}: offset {offset} is not {ALIGNMENT}-byte aligned")
    length = _int_field(raw, "length", where, minimum=1)
    if offset + length > MAX_FILE_OFFSET:
        raise SnapshotInvalidError(f"{where}: offset {offset} + length {length} lies beyond any data file")
    digest = raw.get("checksum")
    if not isinstance(digest, str) or not _CHECKSUM_RE.match(digest):
        raise SnapshotInvalidError(f"{where}: checksum {digest!r} is not 16 hex digits")
    return ChunkRef(validate_relative_file(raw.get("file"), where), offset, length, digest)


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


def parse_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and validate a manifest; every refusal names ``where`` and the problem."""
    try:
        body = json.loads(data.decode("utf-8"), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, huge numbers, deep nesting
        raise SnapshotInvalidError(f"{where}: not valid JSON ({exc}); truncated or corrupted") from exc
    if not isinstance(body, dict):
        raise SnapshotInvalidError(f"{where}: top level must be a JSON object")
    if body.get("format") != FORMAT_NAME:
        raise SnapshotInvalidError(f"{where}: not a hibernate snapshot (format {body.get('format')!r})")
    version = body.get("version")
    major_text, _, minor_text = str(version).partition(".")
    if not (isinstance(version, str) and major_text.isdigit() and minor_text.isdigit()):
        raise SnapshotInvalidError(f"{where}: version {version!r} is not of the form MAJOR.MINOR")
    if int(major_text) != FORMAT_MAJOR:
        raise SnapshotInvalidError(
            f"{where}: format version {version} is not supported (this hibernate reads {FORMAT_MAJOR}.x)",
            hint="wake it with the hibernate version that wrote it",
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
    records_raw = body.get("records")
    if not isinstance(records_raw, list):
        raise SnapshotInvalidError(f"{where}: records must be a list")
    records = tuple(_parse_record(r, f"{where}: record {i}", chunk_bytes) for i, r in enumerate(records_raw))
    keys = [r.key for r in records]
    if len(set(keys)) != len(keys):
        raise SnapshotInvalidError(f"{where}: two records share a key")
    created = body.get("created_unix", 0.0)
    manifest = Manifest(
        snapshot=name,
        producer=_validate_meta(producer, where),
        chunk_bytes=chunk_bytes,
        records=records,
        created_unix=float(created) if isinstance(created, (int, float)) else 0.0,
    )
    expected = body.get("manifest_checksum")
    if expected != _body_checksum(body):
        raise SnapshotInvalidError(
            f"{where}: manifest checksum does not match its contents; it was edited or corrupted"
        )
    return manifest
