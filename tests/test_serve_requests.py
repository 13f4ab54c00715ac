"""What `hibernate serve` does with a request's body before a backend sees it: a compressed body is
decoded on arrival (one that does not decode is a 400 in OpenAI's shape, logged in one line) and
forwarded decoded, without the Content-Encoding it no longer has."""

from __future__ import annotations

import asyncio
import gzip
import json
import logging
import zlib
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from multidict import CIMultiDict

from hibernate.serve.backends import Fleet
from hibernate.serve.bodies import decode_body
from hibernate.serve.config import build_config
from hibernate.serve.decisions import STATES
from hibernate.serve.httplog import HTTP_LOG, LINES, WINDOW, LineBudget
from hibernate.serve.metrics import Recorder
from hibernate.serve.proxy import Proxy, forwarded_headers
from hibernate.serve.routing import ApiError


def proxy_of(**document: Any) -> Proxy:
    """The proxy's request handling with no backend behind it (none is reached by these requests)."""
    settings = build_config(
        listen=None, to=Path("/snap"), backend_flags=["q=http://127.0.0.1:9"], idle=None, wake_timeout=None,
        gpu_budget=None, document=document,
    )  # fmt: skip
    recorder = Recorder(STATES)
    fleet = Fleet(settings.backends, None, recorder, idle_limit=None, wake_timeout=5.0, budget=None)  # type: ignore[arg-type]
    proxy = Proxy(settings, fleet, recorder, None)  # type: ignore[arg-type]
    proxy.ready.set()
    return proxy


async def post_all(proxy: Proxy, requests: list[tuple[bytes, dict[str, str]]]) -> list[tuple[int, Any]]:
    """Each (body, headers) POSTed to /v1/completions over a real connection: (status, JSON answer). The
    server reads bodies as serve's does (hibernate.serve.server: aiohttp decodes none)."""
    answers = []
    server = TestServer(proxy.app())
    await server.start_server(auto_decompress=False)
    async with TestClient(server) as client:
        for body, headers in requests:
            async with client.post("/v1/completions", data=body, headers=headers) as answer:
                assert answer.content_type == "application/json", await answer.text()
                answers.append((answer.status, await answer.json()))
    return answers


BODY = json.dumps({"model": "q", "prompt": "hello " * 100}).encode()


def test_a_body_is_decoded_from_each_coding_its_content_encoding_lists_last_applied_first() -> None:
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    raw_deflate = raw.compress(BODY) + raw.flush()
    halves = gzip.compress(BODY[:100]) + gzip.compress(BODY[100:])  # two gzip members are one body
    for header, sent in (
        ("gzip", gzip.compress(BODY)),
        ("x-gzip", gzip.compress(BODY)),
        ("GZIP", halves),
        ("deflate", zlib.compress(BODY)),
        ("deflate", raw_deflate),
        ("gzip, deflate", zlib.compress(gzip.compress(BODY))),
        ("identity, gzip", gzip.compress(BODY)),
        ("identity", BODY),
        (None, BODY),
    ):
        assert decode_body(sent, header, len(BODY)) == BODY, header
    assert decode_body(b"", "gzip", 10) == b""  # nothing to decode (a GET, say)


def test_a_body_that_is_not_what_its_content_encoding_says_or_decodes_past_the_limit_is_refused() -> None:
    def refused(body: bytes, header: str, limit: int = 1 << 20) -> tuple[int, str]:
        with pytest.raises(ApiError) as error:
            decode_body(body, header, limit)
        return error.value.status, error.value.message

    invalid = "the request body is not valid {} data, as its Content-Encoding says it is"
    whole = gzip.compress(BODY)
    assert refused(b"not gzip at all", "gzip") == (400, invalid.format("gzip"))
    assert refused(b"not gzip at all", "x-gzip") == (400, invalid.format("gzip"))
    assert refused(whole[: len(whole) // 2], "gzip") == (400, invalid.format("gzip"))  # cut short
    assert refused(b"garbage", "deflate") == (400, invalid.format("deflate"))
    assert refused(zlib.compress(BODY) + b"more", "deflate") == (400, invalid.format("deflate"))
    assert refused(whole + b"\0\0\0", "gzip") == (400, invalid.format("gzip"))
    bomb = zlib.compress(b"\0" * (8 << 20), 1)  # 8 MiB of zeros in some 35 KiB
    assert len(bomb) < 1 << 16
    assert refused(bomb, "deflate", 1 << 20) == (
        413,
        f"the request body is more than the limit of {1 << 20} bytes once decoded (deflate)",
    )
    status, message = refused(b"anything", "br")
    assert status == 415 and message.startswith("Content-Encoding br is not supported")
    assert refused(b"anything", "gzip, zstd")[0] == 415


def test_a_body_that_does_not_decode_is_a_400_in_openai_style_and_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(HTTP_LOG.filters[0], "budget", LineBudget(LINES, WINDOW))  # this test's lines alone
    whole = gzip.compress(BODY)
    bad = [
        (b"this is not gzip", {"Content-Encoding": "gzip"}),
        (b"nor is this deflate", {"Content-Encoding": "deflate"}),
        (whole[: len(whole) // 2], {"Content-Encoding": "GZIP"}),  # cut short
    ]
    with caplog.at_level(logging.WARNING, logger=HTTP_LOG.name):
        answers = asyncio.run(post_all(proxy_of(), bad))
    for (status, document), (_, headers) in zip(answers, bad, strict=True):
        coding = headers["Content-Encoding"].lower()
        assert status == 400, document
        assert document == {
            "error": {
                "message": f"the request body is not valid {coding} data, as its Content-Encoding says it is",
                "type": "invalid_request_error",
                "param": None,
                "code": 400,
            }
        }
    records = [r for r in caplog.records if r.name == HTTP_LOG.name]
    assert [r.getMessage().split(": ", 2)[:2] for r in records] == [
        ["bad request body from 127.0.0.1", "POST /v1/completions"]
    ] * len(bad)
    assert all(r.exc_info is None and "\n" not in r.getMessage() for r in records)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no aiohttp "Unhandled exception"


def test_a_body_that_decodes_is_read_decoded() -> None:
    """Routed by the model its decoded JSON names: here one no backend serves, so the proxy's own 404
    answers, which it could only give having read the model from the decoded body."""
    body = json.dumps({"model": "nobody", "prompt": "hello"}).encode()
    requests = [
        (gzip.compress(body), {"Content-Encoding": "gzip"}),
        (zlib.compress(body), {"Content-Encoding": "deflate"}),
    ]
    for status, document in asyncio.run(post_all(proxy_of(), requests)):
        assert status == 404 and "The model `nobody` does not exist" in document["error"]["message"]


def test_a_decoded_body_is_forwarded_without_the_content_encoding_it_no_longer_has() -> None:
    for coding in ("gzip", "deflate", "GZip", "gzip, deflate", "identity, gzip"):
        headers = CIMultiDict({"Content-Type": "application/json", "Content-Encoding": coding})
        assert forwarded_headers(headers, request=True) == [("Content-Type", "application/json")]
    headers = CIMultiDict({"Content-Encoding": "identity"})  # nothing was decoded: passed on as it came
    assert forwarded_headers(headers, request=True) == [("Content-Encoding", "identity")]
    answer = CIMultiDict({"Content-Encoding": "gzip", "Content-Length": "9"})  # an answer is passed whole
    assert forwarded_headers(answer, request=False) == [("Content-Encoding", "gzip"), ("Content-Length", "9")]
