"""The manifest's bytes are json.dumps's canonical form (format.md section 4), however they are built.

The writer encodes the record and chunk columns with orjson where that
gives the same bytes; these tests pin "the same" on every kind of value a
column may hold, including those where orjson would differ (non-ASCII, DEL,
floats, ints past 64 bits), which must be left to json.dumps.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from hibernate.store.manifest import PlainMeta, _canonical, _fast_canonical, meta_text

texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6)
plain_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), texts),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)
any_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**70), 2**70),
        texts,
        st.floats(allow_nan=False, allow_infinity=False),
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
    max_leaves=8,
)


def reference(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


@st.composite
def bodies(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(0, 4))
    vouched = draw(st.booleans())
    metas = [
        draw(st.dictionaries(texts, plain_values if vouched else any_values, max_size=3))
        for _ in range(count)
    ]
    ints = st.integers(0, 2**66)
    return {
        "format": "hibernate-snapshot",
        "created_unix": draw(st.floats(0, 2e9)),
        "producer": draw(st.dictionaries(texts, any_values, max_size=2)),
        "records": {
            "chunks": [draw(st.integers(0, 3)) for _ in range(count)],
            "key": [draw(texts) for _ in range(count)],
            # Format 4's meta is one text (meta_text); format 3's, read and encoded again, values.
            "meta": meta_text([PlainMeta(meta) for meta in metas]) if vouched else metas,
            "nbytes": [draw(ints) for _ in range(count)],
            "tag": [draw(texts) for _ in range(count)],
        },
        "chunks": {
            "checksum": draw(st.text("0123456789abcdef", max_size=32)),
            "file": [draw(texts) for _ in range(count)],
            "length": [draw(ints) for _ in range(count)],
            "offset": [draw(ints) for _ in range(count)],
        },
    }


@settings(max_examples=300, deadline=None)
@given(bodies())
def test_the_manifest_text_is_json_dumps_canonical_form(body: dict[str, Any]) -> None:
    assert _canonical(body) == reference(body)


def test_the_characters_json_dumps_escapes_and_orjson_does_not_are_written_as_json_dumps_does() -> None:
    every_ascii = "".join(map(chr, range(128)))
    for key in (every_ascii, "caf\u00e9", "\U0001f600", "plain"):
        body = {
            "records": {
                "chunks": [1],
                "key": [key],
                "meta": meta_text([PlainMeta(views=[{"name": key, "shape": [2**63 - 1]}])]),
                "nbytes": [4096],
                "tag": ["weights"],
            },
            "chunks": {"checksum": "0" * 16, "file": ["data-000.bin"], "length": [4096], "offset": [0]},
        }
        assert _canonical(body) == reference(body), repr(key)
        if key == "plain":
            assert _fast_canonical("records", body["records"]) is not None, "a tensor's records take orjson"
            assert _fast_canonical("chunks", body["chunks"]) is not None
