"""Validate and parse a manifest: every field that steers a read is checked before use.

An edited or hostile manifest is refused with a message naming the problem
instead of reading outside the snapshot; the types it is parsed into and
their canonical encoding are in manifest.py. A writer applies the same rules
to its regions before it writes anything (check_region, regions_plain), so
that it never publishes a manifest no wake would accept.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import orjson
import xxhash

from hibernate.errors import SnapshotInvalidError
from hibernate.gcpause import gc_paused
from hibernate.store.manifest import (
    ALIGNMENT,
    CHECKSUM_ALGORITHM,
    FORMAT_NAME,
    MANIFEST_NAME,
    MAX_CHUNK_BYTES,
    MAX_FILE_OFFSET,
    MAX_KEY_LENGTH,
    MAX_META_DEPTH,
    READABLE_MAJORS,
    SNAPSHOT_NAME_RE,
    ChunkColumns,
    ChunkRef,
    Columns,
    FileIdentity,
    Manifest,
    PlainMeta,
    Record,
    body_checksum,
    check_manifest_size,
)
from hibernate.store.owner import parse_owner

DATA_FILE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_CHECKSUM_RE = re.compile(r"^[0-9a-f]{16}$")
_CHECKSUMS_RE = re.compile(r"(?:[0-9a-f]{16})*")  # many checksums joined: one match checks them all
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_CONTROL_BYTES = bytes(range(0x20)) + b"\x7f"
_CHECKSUM_SUFFIX_RE = re.compile(rb',"manifest_checksum":"([0-9a-f]{16})"\}\n?$')


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
        verified = body.get("manifest_checksum") == body_checksum(body)
    if not verified:
        raise SnapshotInvalidError(
            f"{where}: manifest checksum does not match its contents; it was edited or corrupted"
        )
    return manifest
