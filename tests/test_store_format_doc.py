"""docs/format.md and the code say the same thing: fields, constants, and a manifest that parses."""

from __future__ import annotations

import json
import re

from hibernate.store import arena, directio, manifest, options, writer
from hibernate.store.layout import MARKER_FORMAT, MARKER_NAME
from hibernate.store.manifest import ChunkRef, Columns, FileIdentity, Manifest, Record
from hibernate.store.owner import Owner
from hibernate.store.parse import parse_manifest
from tests.conftest import REPO

DOC = (REPO / "docs" / "format.md").read_text()


def documented_fields(anchor: str) -> set[str]:
    """The first column of the first field table after ``anchor``."""
    lines = DOC[DOC.index(anchor) :].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| field |"))
    table = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        table.append(line)
    return {m.group(1) for line in table if (m := re.match(r"\| `(\w+)` \|", line))}


def test_every_field_written_is_documented_and_nothing_else() -> None:
    chunk = ChunkRef("data-000.bin", 0, 1, "0" * 16)
    record = Record("w/x", "w", 1, {}, (chunk,))
    owner = Owner("boot", 1, 2, 3, "host", 4)
    written = Manifest(
        "snap-000001", {}, 4096, Columns.of([record]), owner, {"data-000.bin": FileIdentity(1, 2, 3, 4, 5)}
    )
    body = {**written.body(), "manifest_checksum": ""}
    assert documented_fields("## 3. The manifest") == set(body)
    assert documented_fields("A **record** describes") == set(record.to_json())
    assert documented_fields("A **chunk** is a piece") == set(chunk.to_json())


def test_the_documented_constants_are_the_code_s() -> None:
    assert manifest.FORMAT_NAME == "hibernate-snapshot" and f'`"{manifest.FORMAT_NAME}"`' in DOC
    assert (manifest.FORMAT_MAJOR, manifest.FORMAT_MINOR) == (4, 0) and "this document is `4.0`" in DOC
    assert manifest.READABLE_MAJORS == (3, 4) and "this hibernate reads 3.x and 4.x" in DOC
    assert manifest.CHECKSUM_ALGORITHM == "xxh3-64" and f'`"{manifest.CHECKSUM_ALGORITHM}"`' in DOC
    assert manifest.ALIGNMENT == 4096 and "multiple of **4096**" in DOC
    assert manifest.MAX_CHUNK_BYTES == 1 << 30 and "at most 1 GiB" in DOC
    assert manifest.MANIFEST_LIMIT_BYTES == 1 << 30 and "A\nmanifest is at most 1 GiB" in DOC
    assert manifest.MAX_RECORDS == 2_000_000 and "holds at most 2,000,000 records" in DOC
    assert (MARKER_NAME, MARKER_FORMAT) == (".hibernate-root", "hibernate-spill-root")
    assert f"`{MARKER_NAME}`" in DOC and f'"{MARKER_FORMAT}"' in DOC
    assert manifest.MAX_KEY_LENGTH == 1024 and "at most 1024 characters" in DOC
    assert manifest.MAX_META_DEPTH == 8 and "nested at\nmost 8 deep" in DOC
    assert options.WriteOptions().segment_bytes == 1 << 30 and "(1 GiB by default)" in DOC
    assert options.WriteOptions().buffer_bytes == 256 << 20 and "(256 MiB by\ndefault" in DOC
    assert arena.MAX_REQUEST_BYTES == 128 << 20 and "requests of up to 128 MiB" in DOC
    assert writer.FREE_SPACE_MARGIN == 1 << 20 and "plus 1 MiB" in DOC
    assert directio._EVICT_EVERY_BYTES == 64 << 20 and "`fdatasync` every 64 MiB" in DOC


def test_the_example_manifest_is_valid() -> None:
    example = re.search(r"```json\n(.*?)```", DOC, flags=re.DOTALL)
    assert example is not None
    parsed = parse_manifest(example.group(1).encode(), "docs/format.md example")
    assert parsed.snapshot == "snap-000001"
    assert json.loads(example.group(1))["version"] == "4.0"
    assert [r.nbytes for r in parsed.records] == [8388608, 8192]
