"""The request headers the lifecycle reads, found in one pass in C for the usual request:
the same values, in order, as the general pass finds, whatever the request sends."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from idempo._http.keys import headers_named
from idempo._http.lifecycle import READ_HEADERS


def reference(headers: Any, names: frozenset[bytes]) -> dict[bytes, list[bytes]]:
    found: dict[bytes, list[bytes]] = {}
    for name, value in headers:
        if name.lower() in names:
            found.setdefault(name.lower(), []).append(value)
    return found


names = st.sampled_from(
    [*READ_HEADERS, b"Content-Type", b"COOKIE", b"host", b"x-1", b"123", b"\xc9t\xe9"]
)
values = st.binary(max_size=6)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(names, values), max_size=8),
    st.sampled_from(["list", "tuple", "lists"]),
)
def test_the_headers_read_are_those_the_general_pass_finds(
    headers: list[tuple[bytes, bytes]], shape: str
) -> None:
    given_headers: Any = headers
    if shape == "tuple":
        given_headers = tuple(headers)
    elif shape == "lists":
        given_headers = [[name, value] for name, value in headers]  # ASGI allows either
    assert headers_named(given_headers, READ_HEADERS) == reference(headers, READ_HEADERS)


def test_a_key_sent_twice_is_seen_twice() -> None:
    headers = [(b"idempotency-key", b"a"), (b"host", b"x"), (b"idempotency-key", b"b")]
    assert headers_named(headers, READ_HEADERS) == {b"idempotency-key": [b"a", b"b"]}
    mixed = [(b"idempotency-key", b"a"), (b"Idempotency-Key", b"b")]
    assert headers_named(mixed, READ_HEADERS) == {b"idempotency-key": [b"a", b"b"]}
