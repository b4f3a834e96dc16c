"""Ready-made ``redact=`` hooks: what of a response is stored, and so replayed.

The first caller gets the response its endpoint made; the store keeps, and every replay
gets, what the hook returns. For endpoints that mint a secret (an API key, a one-time
token) which must reach the caller once and never rest in the store::

    IdempotencyMiddleware(app, store=store, redact=redact_json("api_key", "secret"))
    IdempotencyMiddleware(app, store=store, redact=redact_headers("x-api-key"))

Hooks compose as functions do: ``redact=lambda r: redact_json("token")(redact_headers(
"x-token")(r))``.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from .response import HttpResponse

__all__ = ["REDACTED", "redact_headers", "redact_json", "with_length"]

REDACTED = "[redacted]"
"""What `redact_json` puts in place of a field's value, unless told otherwise."""

_IDENTITY = frozenset({b"", b"identity"})


def redact_headers(*names: str) -> Callable[[HttpResponse], HttpResponse]:
    """A hook that drops the headers ``names`` (any case) from what is stored.

    >>> stored = redact_headers("X-Api-Key")(HttpResponse(201, ((b"x-api-key", b"sk_1"),)))
    >>> stored.headers
    ()
    """
    dropped = frozenset(name.lower().encode("latin-1") for name in names)

    def redact(response: HttpResponse) -> HttpResponse:
        kept = tuple(item for item in response.headers if item[0].lower() not in dropped)
        if len(kept) == len(response.headers):
            return response
        return HttpResponse(response.status, kept, response.body)

    return redact


def redact_json(
    *fields: str, placeholder: object = REDACTED
) -> Callable[[HttpResponse], HttpResponse]:
    """A hook that replaces the values of the top-level ``fields`` of a JSON object body
    with ``placeholder`` in what is stored.

    A body without those fields is stored as it is, byte for byte, and so is one that is not
    a JSON object (an empty body, text, a list). A body in a ``Content-Encoding`` (gzip...)
    cannot be looked into: the hook raises, so the guard stores no response (it records the
    ``response-not-stored`` failure: the secret is never kept, and a retry does not run the
    endpoint again). Let idempo's middleware run inside any compression middleware.

    >>> response = HttpResponse(201, (), b'{"id": 7, "api_key": "sk_live_1"}')
    >>> redact_json("api_key")(response).body
    b'{"id":7,"api_key":"[redacted]"}'
    """
    named = frozenset(fields)

    def redact(response: HttpResponse) -> HttpResponse:
        encoded = [v for name, v in response.headers if name.lower() == b"content-encoding"]
        if any(value.strip().lower() not in _IDENTITY for value in encoded):
            raise ValueError("a response with a Content-Encoding cannot be redacted")
        try:
            data = json.loads(response.body)
        except (ValueError, RecursionError):
            return response
        if not isinstance(data, dict) or named.isdisjoint(data):
            return response
        for name in named & data.keys():
            data[name] = placeholder
        body = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
        return HttpResponse(response.status, response.headers, body)

    return redact


def with_length(response: HttpResponse) -> HttpResponse:
    """``response`` with its ``Content-Length`` (if it has one) saying its body's length.

    >>> with_length(HttpResponse(200, ((b"content-length", b"99"),), b"ok")).headers
    ((b'content-length', b'2'),)
    """
    size = str(len(response.body)).encode()
    headers = response.headers
    if all(name.lower() != b"content-length" or value == size for name, value in headers):
        return response
    fixed = tuple(
        (name, size) if name.lower() == b"content-length" else (name, value)
        for name, value in headers
    )
    return HttpResponse(response.status, fixed, response.body)
