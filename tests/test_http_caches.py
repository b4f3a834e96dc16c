"""The HTTP path's caches give exactly what computing afresh gives: the fingerprint's canonical
bytes by a request's parts, and a stored response's decoding by its stored bytes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempo import CorruptRecordError
from idempo._http import HttpResponse, canonical_parts, decode_response, encode_response
from idempo._http.fingerprint import CanonicalParts
from idempo.asgi import IdempotencyMiddleware
from idempo.stores.memory import AsyncMemoryStore

bounded = settings(max_examples=150, deadline=None)

JSON, FORM = b"application/json", b"application/x-www-form-urlencoded"
bodies = st.sampled_from(
    [b"", b'{"a":1}', b'{ "a": 1 }', b'{"a":2}', b"[1,2]", b"a=1&b=2", b"b=2&a=1", b"\xff"]
)
content_types = st.lists(st.sampled_from([JSON, FORM, b"text/plain", b"application/x+json"]))
requests = st.tuples(
    st.sampled_from(["POST", "PATCH"]),
    st.sampled_from(["/a", "/b"]),
    st.sampled_from([b"", b"x=1", b"y=2&x=1"]),
    content_types,
    bodies,
)


@bounded
@given(st.lists(requests, max_size=12), st.booleans())
def test_remembered_canonical_bytes_are_the_computed_ones(
    sequence: list[Any], found_already: bool
) -> None:
    """A tiny cache (cleared when full) and its hits agree with `canonical_parts` on every
    request, whether the caller found the Content-Type values or not."""
    cache = CanonicalParts(size=3)
    for method, path, query, types, body in sequence * 2:  # the second round hits
        headers = [(b"host", b"h"), *((b"content-type", t) for t in types)]
        given_types = types if found_already and types else None
        got = cache(method, path, query, headers, body, given_types)
        assert got == canonical_parts(method, path, query, headers, body)
    assert len(cache._known) <= 3


def test_named_headers_and_large_bodies_are_computed_each_time() -> None:
    headers = [(b"content-type", JSON), (b"x-tenant", b"t1")]
    named = CanonicalParts(headers=("x-tenant",))
    fresh = canonical_parts("POST", "/a", b"", headers, b"{}", headers=("x-tenant",))
    assert named("POST", "/a", b"", headers, b"{}") == fresh
    other = [(b"content-type", JSON), (b"x-tenant", b"t2")]
    assert named("POST", "/a", b"", other, b"{}") != fresh
    assert not named._known
    big = b'{"a":"' + b"x" * 5000 + b'"}'
    small = CanonicalParts()
    assert small("POST", "/a", b"", headers, big) == canonical_parts(
        "POST", "/a", b"", headers, big
    )
    assert not small._known


def test_a_decoded_response_is_remembered_and_a_corrupt_one_never() -> None:
    stored = encode_response(HttpResponse(201, ((b"content-type", b"application/json"),), b"{}"))
    first = decode_response(stored)
    assert decode_response(bytes(stored)) is first  # another copy of the same bytes
    assert first == HttpResponse(201, ((b"content-type", b"application/json"),), b"{}")
    for _ in range(2):
        with pytest.raises(CorruptRecordError):
            decode_response(b'{"v":1,"status":"x","headers":[]}\n')
    large = encode_response(HttpResponse(200, (), b"x" * 5000))
    assert decode_response(large) == decode_response(large) == HttpResponse(200, (), b"x" * 5000)


def test_a_replay_with_another_payload_is_still_refused() -> None:
    """The cache by raw parts never lets one body stand for another: the same key with a
    respelled body replays, with another body it is a mismatch, and the body that was
    cached first still replays afterwards."""
    runs = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        runs.append(body)
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"made:" + body})

    guarded = IdempotencyMiddleware(app, store=AsyncMemoryStore())

    async def post(body: bytes) -> tuple[int, bytes]:
        sent: list[Any] = []
        messages = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive() -> Any:
            return next(messages, {"type": "http.disconnect"})

        async def send(message: Any) -> None:
            sent.append(message)

        headers = [(b"content-type", JSON), (b"idempotency-key", b"k-1")]
        scope = {"type": "http", "method": "POST", "path": "/pay", "headers": headers}
        await guarded(scope, receive, send)
        return sent[0]["status"], sent[1]["body"]

    async def scenario() -> list[tuple[int, bytes]]:
        return [
            await post(body)
            for body in (b'{"a":1}', b'{ "a" : 1 }', b'{"a":2}', b'{"a":1}', b'{"a":2}')
        ]

    answers = asyncio.run(scenario())
    assert [status for status, _ in answers] == [201, 201, 422, 201, 422]
    assert answers[0] == answers[1] == answers[3] == (201, b'made:{"a":1}')
    assert runs == [b'{"a":1}']
