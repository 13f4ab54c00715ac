"""A request body as the proxy reads it (decoded from its Content-Encoding, within the body limit) and
as it forwards it (naming the model its backend serves).

The proxy must read a body to route it (its ``model``), so it decodes a
compressed one itself, as the bytes it was sent, rather than leave that to its
HTTP server: a body that does not decode is then the client's error, a 400 in
OpenAI's shape with one log line, not a failure in the server's own reading
(a 500 page, and a traceback when it drains the rest). What it decoded it
forwards decoded, without the Content-Encoding header: model servers such as
vLLM do not decode request bodies themselves. Decoding is bounded: a small
body that inflates beyond ``max_body_bytes`` is refused as a large one is.
Pure functions over bytes.
"""

from __future__ import annotations

import json
import zlib

from hibernate.serve.routing import ApiError

CONTENT_ENCODING = "Content-Encoding"
# The codings the proxy decodes (RFC 9110 section 8.4.1; x-gzip is gzip's old name), and their zlib window.
GZIP_WBITS = zlib.MAX_WBITS | 16  # a gzip header and trailer
ZLIB_WBITS = zlib.MAX_WBITS  # HTTP's "deflate": the zlib format
RAW_WBITS = -zlib.MAX_WBITS  # what some clients send as "deflate" all the same: no header
DECODED = ("gzip", "x-gzip", "deflate")
IDENTITY = "identity"


def codings(header: str | None) -> list[str]:
    """The codings a Content-Encoding header lists, in the order they were applied, in lower case,
    ``identity`` left out (it changes nothing)."""
    if not header:
        return []
    named = (part.strip().lower() for part in header.split(","))
    return [coding for coding in named if coding and coding != IDENTITY]


def decode_body(body: bytes, header: str | None, limit: int) -> bytes:
    """``body`` with the codings of its Content-Encoding ``header`` undone (the last applied first), at
    most ``limit`` bytes once decoded; refused with the ApiError a client gets: 400 for a body that is
    not what its header says, 413 for one that decodes beyond ``limit``, 415 for a coding the proxy
    does not decode (it could not read the body's model)."""
    listed = codings(header)
    if not body or not listed:
        return body
    unknown = [coding for coding in listed if coding not in DECODED]
    if unknown:
        raise ApiError(
            415,
            f"Content-Encoding {unknown[0]} is not supported: send the body uncompressed, as gzip or as "
            "deflate",
            "invalid_request_error",
        )
    for coding in reversed(listed):
        body = _inflate(body, coding, limit)
    return body


def _inflate(data: bytes, coding: str, limit: int) -> bytes:
    """One coding undone: gzip (several members are one body, as gzip itself reads them) or deflate (the
    zlib format HTTP names so, else raw deflate data, as some clients send it all the same)."""
    if coding != "deflate":
        return _inflate_as(data, GZIP_WBITS, coding, limit)
    try:
        return _inflate_as(data, ZLIB_WBITS, coding, limit)
    except ApiError as error:
        if error.status != 400:
            raise
        return _inflate_as(data, RAW_WBITS, coding, limit)


def _inflate_as(data: bytes, wbits: int, coding: str, limit: int) -> bytes:
    out = bytearray()
    rest = data
    while True:
        inflater = zlib.decompressobj(wbits)
        try:
            out += inflater.decompress(rest, limit + 1 - len(out))
        except zlib.error:
            raise not_valid(coding) from None
        if len(out) > limit or inflater.unconsumed_tail:
            raise ApiError(
                413,
                f"the request body is more than the limit of {limit} bytes once decoded ({coding})",
                "invalid_request_error",
            )
        if not inflater.eof:
            raise not_valid(coding)  # cut short
        rest = inflater.unused_data
        if not rest:
            return bytes(out)
        if wbits != GZIP_WBITS:
            raise not_valid(coding)  # something after the end of the data


def not_valid(coding: str) -> ApiError:
    shown = "gzip" if coding == "x-gzip" else coding
    return ApiError(
        400,
        f"the request body is not valid {shown} data, as its Content-Encoding says it is",
        "invalid_request_error",
    )


def with_model(body: bytes, model: str) -> bytes:
    """A JSON body routed by its ``model`` (read already: a JSON object that names one), forwarded with
    ``model`` in its place: a backend's ``served_model`` for the alias a client asked for. A body that
    names it already is forwarded byte for byte; another is written again compactly, its text as it
    was (not escaped), or refused (400) where it cannot be written back as valid JSON."""
    document = json.loads(body)
    if document.get("model") == model:
        return body
    document["model"] = model
    try:
        return json.dumps(document, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except ValueError as exc:
        raise ApiError(
            400,
            f"the request body cannot be forwarded with the model its backend serves: {exc}",
            "invalid_request_error",
        ) from None
