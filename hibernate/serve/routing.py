"""Which backend a request goes to, decided from its path and body alone (pure functions).

A path under a backend's prefix goes to it (the prefix stripped). Otherwise an
OpenAI-style request names its model in the JSON body's ``model`` field. Every
refusal is an :class:`ApiError`: the HTTP status and the OpenAI-style body the
client gets, before any backend is touched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hibernate.serve.config import BackendSpec

MODELS_PATH = "/v1/models"


class ApiError(Exception):
    """A request refused with ``status`` and an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, retry_after: int | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.retry_after = retry_after  # seconds, for a 503's Retry-After (default 1)

    def body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}
        }


@dataclass(frozen=True)
class Route:
    backend: str
    path: str  # the path (and query) to ask the backend for
    prefixed: bool = False  # routed by its path's prefix (else by its body's model)


def by_prefix(path: str, backends: Sequence[BackendSpec]) -> Route | None:
    """The backend whose prefix is the longest one ``path`` lies under, if any."""
    best: BackendSpec | None = None
    for spec in backends:
        prefix = spec.prefix
        under = prefix and (path == prefix or path.startswith((prefix + "/", prefix + "?")))
        if under and (best is None or len(prefix or "") > len(best.prefix or "")):
            best = spec
    if best is None or best.prefix is None:
        return None
    rest = path[len(best.prefix) :]
    return Route(best.name, rest if rest.startswith("/") else "/" + rest, prefixed=True)


def model_of(body: bytes) -> str:
    """The ``model`` field of a JSON request body; anything else is a 400 that says what is wrong."""
    if not body:
        raise ApiError(
            400, "the request has no body; send a JSON object with a 'model' field", "invalid_request_error"
        )
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the request body is not valid JSON ({exc})", "invalid_request_error") from None
    except RecursionError:  # Python's parser recurses once per level of nesting
        raise ApiError(
            400, "the request body is JSON nested too deeply to be read", "invalid_request_error"
        ) from None
    if not isinstance(document, dict):
        raise ApiError(400, "the request body must be a JSON object", "invalid_request_error")
    model = document.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(
            400,
            "the request names no model: its 'model' field must be a string",
            "invalid_request_error",
            "model",
        )
    return model


KEEP_ALIVE_FIELD = b'"keep_alive"'


def without_keep_alive(body: bytes) -> tuple[bytes, object]:
    """A JSON body's ``keep_alive`` field (Ollama's), taken out: the body to forward, and the field's
    value (None when it has none: the body is then forwarded byte for byte as it came).

    Only a body with the field is written again, compactly and with its text as it was (not escaped);
    one that cannot be written back as valid JSON (a number too large for a float, ``NaN``) is a 400
    rather than a body the backend would read differently. Of a key given twice, the last is kept."""
    if KEEP_ALIVE_FIELD not in body:
        return body, None
    try:
        document = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return body, None
    if not isinstance(document, dict) or "keep_alive" not in document:
        return body, None
    value = document.pop("keep_alive")
    try:
        text = json.dumps(document, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except ValueError as exc:
        raise ApiError(
            400,
            f"the request body cannot be forwarded without its keep_alive field: {exc}",
            "invalid_request_error",
        ) from None
    return text, value


def by_model(model: str, backends: Sequence[BackendSpec]) -> str:
    for spec in backends:
        if model in spec.model_names:
            return spec.name
    known = ", ".join(m for s in backends for m in s.model_names)
    raise ApiError(
        404, f"The model `{model}` does not exist (this proxy serves: {known})", "NotFoundError", "model"
    )


def route(method: str, path_qs: str, body: bytes, backends: Sequence[BackendSpec]) -> Route:
    """Where a request that is not the proxy's own goes; the body is read only without a prefix."""
    prefixed = by_prefix(path_qs, backends)
    if prefixed is not None:
        return prefixed
    if method != "POST" or not path_qs.startswith("/v1/"):
        raise ApiError(
            404,
            f"{method} {path_qs.split('?')[0]} is not routed: OpenAI requests are POST /v1/... with a "
            "'model' field, other paths need a backend's prefix",
            "NotFoundError",
        )
    return Route(by_model(model_of(body), backends), path_qs)


def models_list(backends: Sequence[BackendSpec], states: dict[str, str]) -> dict[str, Any]:
    """``GET /v1/models``: every model of every backend, asleep or awake, from configuration alone."""
    data = [
        {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "hibernate",
            "backend": spec.name,
            "state": states.get(spec.name, "unknown"),
        }
        for spec in backends
        for model in spec.model_names
    ]
    return {"object": "list", "data": data}
