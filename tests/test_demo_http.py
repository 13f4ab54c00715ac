"""The demo's OpenAI-style HTTP API as the official ``openai`` SDK reads it, streamed or not.

Every event a stream sends must be a chunk the SDK can read (``choices`` with an
index, the text or the delta, ``finish_reason`` null until the last), then
``data: [DONE]``; the digest that tells a bit-exact answer rides in an extra
field of the last chunk. The demo is the real one, with its HTTP API, from
tests/test_serve.py's fixture.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from tests.test_serve import HttpDemo, completion, fetch, start_http_demo

__all__ = ["start_http_demo"]  # a fixture, used by name

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


def events(body: bytes) -> list[bytes]:
    """The data of each server-sent event of a stream, in order."""
    assert body.endswith(b"\n\n"), body[-80:]
    frames = body[:-2].split(b"\n\n")
    assert all(frame.startswith(b"data: ") for frame in frames), frames
    return [frame[len(b"data: ") :] for frame in frames]


def check_shape(body: bytes, kind: str) -> list[dict[str, Any]]:
    """Every event of a stream is an OpenAI chunk of ``kind``, then [DONE]: the chunks, parsed."""
    data = events(body)
    assert data[-1] == b"[DONE]" and b"[DONE]" not in data[:-1]
    chunks = [json.loads(d) for d in data[:-1]]
    for chunk in chunks:
        assert chunk["object"] == kind and chunk["id"] and chunk["model"] == "demo", chunk
        [choice] = chunk["choices"]
        assert choice["index"] == 0 and ("delta" if kind.startswith("chat") else "text") in choice, chunk
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks]
    assert finishes[:-1] == [None] * (len(chunks) - 1) and finishes[-1] in ("stop", "length"), finishes
    return chunks


def test_a_streamed_completion_is_openai_chunks_the_sdk_joins_into_the_whole_answer_and_its_digest(
    start_http_demo: Callable[..., HttpDemo],
) -> None:
    demo = start_http_demo()
    status, body = fetch("POST", demo.url + "/v1/completions", completion("demo"))
    assert status == 200
    whole = json.loads(body)
    text, digest = whole["choices"][0]["text"], whole["digest"]
    assert text and len(digest) == 64

    status, streamed = fetch("POST", demo.url + "/v1/completions", completion("demo", stream=True))
    assert status == 200
    chunks = check_shape(streamed, "text_completion")
    assert "".join(chunk["choices"][0]["text"] for chunk in chunks) == text
    assert chunks[-1]["digest"] == digest and all("digest" not in chunk for chunk in chunks[:-1])

    client = OpenAI(base_url=demo.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    pieces = list(client.completions.create(model="demo", prompt="hello", stream=True))
    assert "".join(c.choices[0].text for c in pieces) == text
    assert pieces[-1].choices[0].finish_reason == "length"
    assert [c.choices[0].finish_reason for c in pieces[:-1]] == [None] * (len(pieces) - 1)
    assert (pieces[-1].model_extra or {}).get("digest") == digest  # the extra field, as the SDK keeps it


def test_a_streamed_chat_is_openai_chunks_the_sdk_joins_into_the_message_and_its_digest(
    start_http_demo: Callable[..., HttpDemo],
) -> None:
    demo = start_http_demo()
    body = {"model": "demo", "messages": MESSAGES}
    status, answer = fetch("POST", demo.url + "/v1/chat/completions", body)
    assert status == 200
    whole = json.loads(answer)
    content, digest = whole["choices"][0]["message"]["content"], whole["digest"]

    status, streamed = fetch("POST", demo.url + "/v1/chat/completions", {**body, "stream": True})
    assert status == 200
    chunks = check_shape(streamed, "chat.completion.chunk")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == content
    assert chunks[-1]["digest"] == digest

    client = OpenAI(base_url=demo.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    pieces = list(client.chat.completions.create(model="demo", messages=MESSAGES, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == content
    assert pieces[-1].choices[0].finish_reason == "length"
    assert (pieces[-1].model_extra or {}).get("digest") == digest
