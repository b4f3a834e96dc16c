"""The stored response's shortcuts give what the general path gives, for any response.

A stored line as `encode_response` writes it for plain ASCII headers is read without parsing
JSON (`decode_response`), and a replay's headers are checked for fields to drop in one pass
(`_kept`). A replay must stay byte-identical, headers included (SPEC §4), and an unreadable
record must stay a `CorruptRecordError`.
"""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempo._http.response import (
    _NOT_REPLAYED,
    _NOT_SHAREABLE,
    REPLAYED_HEADER,
    HttpResponse,
    _kept,
    _parsed,
    decode_response,
    decoded,
    encode_response,
)
from idempo.errors import CorruptRecordError

bounded = settings(max_examples=300, deadline=None)

# Header bytes of every kind: the plain ASCII the shortcut takes, and what it leaves to the
# parser (quotes, backslashes, controls, Latin-1).
plain_bytes = st.binary(max_size=12).map(lambda b: bytes(0x20 + x % 0x5F for x in b))
header_bytes = plain_bytes | st.binary(max_size=12) | st.sampled_from([b'"', b"\\", b'a"b\\'])
names = header_bytes | st.sampled_from(
    [b"content-type", b"Set-Cookie", b"connection", b"Connection", b"x-a", REPLAYED_HEADER]
)
responses = st.builds(
    HttpResponse,
    st.integers(100, 999),
    st.lists(st.tuples(names, header_bytes), max_size=5).map(tuple),
    st.binary(max_size=20) | st.just(b"\n{}\n"),
)


def outcome(read: object, data: bytes) -> object:
    try:
        return read(data)  # type: ignore[operator]
    except CorruptRecordError:
        return CorruptRecordError


def parsed(data: bytes) -> HttpResponse:
    head_line, newline, body = data.partition(b"\n")
    return _parsed(head_line, newline, body)


@bounded
@given(responses)
def test_every_stored_response_reads_back_byte_for_byte(response: HttpResponse) -> None:
    data = encode_response(response)
    assert decode_response(data) == response
    assert parsed(data) == response


@bounded
@given(responses)
def test_every_stored_line_is_the_documented_json(response: HttpResponse) -> None:
    """The line `encode_response` writes, by its shortcut for plain header bytes or not, is
    the compact JSON document with ASCII escapes that docs/http.md describes."""
    document = {
        "v": 1,
        "status": response.status,
        "headers": [[n.decode("latin-1"), v.decode("latin-1")] for n, v in response.headers],
    }
    line = json.dumps(document, separators=(",", ":")).encode()
    assert encode_response(response) == line + b"\n" + response.body


def spellings(response: HttpResponse, rnd: random.Random) -> bytes:
    """A stored line the way `encode_response` writes it, or the same document written some
    other way (spaces, escapes, member order, another status form, a missing newline)."""
    data = encode_response(response)
    head, _, body = data.partition(b"\n")
    document = json.loads(head)
    choice = rnd.randrange(8)
    if choice == 0:
        head = json.dumps(document).encode()  # spaces after separators
    elif choice == 1:
        head = json.dumps(document, ensure_ascii=False).encode("utf-8", "surrogatepass")
    elif choice == 2:
        head = json.dumps(dict(reversed(document.items())), separators=(",", ":")).encode()
    elif choice == 3:
        head = head.replace(b'"status":', b'"status":' + rnd.choice([b"0", b"-", b'"', b" "]))
    elif choice == 4:
        document["v"] = rnd.choice([0, 2, "1", 1.0, True])
        head = json.dumps(document, separators=(",", ":")).encode()
    elif choice == 5:
        return head  # no newline, no body
    elif choice == 6:
        cut = rnd.randrange(len(head) + 1)
        head = head[:cut] + rnd.choice([b"", b"x", b"]", b'"', b"\\", b"\x00"]) + head[cut:]
    return head + b"\n" + body


@bounded
@given(responses, st.randoms(use_true_random=False))
def test_any_stored_line_reads_as_the_parser_reads_it(
    response: HttpResponse, rnd: random.Random
) -> None:
    data = spellings(response, rnd)
    assert outcome(decode_response, data) == outcome(parsed, data)


@pytest.mark.parametrize(
    "head",
    [
        b'{"v":1,"status":201,"headers":[]}',
        b'{"v":1,"status":201,"headers":[["a","b"],["c",""]]}',
        b'{"v":1,"status":999,"headers":[["","x"]]}',
        b'{"v":1,"status":099,"headers":[]}',
        b'{"v":1,"status":1000,"headers":[]}',
        b'{"v":1,"status":20,"headers":[]}',
        b'{"v":1,"status":201,"headers":[["a","b"],]}',
        b'{"v":1,"status":201,"headers":[["a","b"]["c","d"]]}',
        b'{"v":1,"status":201,"headers":[["a","b","c"]]}',
        b'{"v":1,"status":201,"headers":[["a"]]}',
        b'{"v":1,"status":201,"headers":[["a\\u0062","b"]]}',
        b'{"v":1,"status":201,"headers":[["a","\t"]]}',
        b'{"v":1,"status":201,"headers":[["\xe9","x"]]}',
        b'{"v":1,"status":201,"headers":[]} ',
        b'{"v":1,"status":201,"headers":[]}x',
        b'{"v":1, "status":201,"headers":[]}',
    ],
)
def test_edge_case_lines_read_as_the_parser_reads_them(head: bytes) -> None:
    for data in (head + b"\nbody", head):
        assert outcome(decode_response, data) == outcome(parsed, data)


def replayed(data: bytes, status_200: bool) -> HttpResponse:
    """A replay as the general path makes it: the stored response, parsed, then replayed."""
    return parsed(data).replay(status_200=status_200)


# Up to ten headers, so lines past the one-match shortcut's eight are made too.
replayable = st.builds(
    HttpResponse,
    st.integers(100, 999),
    st.lists(st.tuples(names, header_bytes), max_size=10).map(tuple),
    st.binary(max_size=20),
)


@bounded
@given(replayable, st.randoms(use_true_random=False), st.booleans())
def test_a_replay_decoded_at_once_is_the_stored_response_replayed(
    response: HttpResponse, rnd: random.Random, status_200: bool
) -> None:
    """The replaying decode (one match for a usual line, `_replayable_head`) gives what
    parsing the line and replaying it give, for every spelling of every line."""
    for data in (encode_response(response), spellings(response, rnd)):
        expected = outcome(lambda d: replayed(d, status_200), data)
        assert outcome(lambda d: decoded(d, status_200), data) == expected


def kept_reference(headers: tuple[tuple[bytes, bytes], ...], dropped: frozenset[bytes]) -> tuple:
    """What is kept of ``headers``: every field but those in ``dropped`` or named by a
    Connection field (RFC 9110 §7.6.1), names compared without case."""
    extra = {
        token.strip().lower()
        for name, value in headers
        if name.lower() == b"connection"
        for token in value.split(b",")
    }
    return tuple(item for item in headers if item[0].lower() not in dropped | extra)


field_names = st.sampled_from(
    [
        *(b"content-type", b"Content-Type", b"x-a", b"X-A", b"set-cookie", b"Set-Cookie"),
        *(b"TE", b"connection", b"Connection", b"keep-alive", b"Transfer-Encoding"),
        *(REPLAYED_HEADER, REPLAYED_HEADER.upper()),
    ]
)
field_values = st.sampled_from([b"", b"1", b"x-a", b"close, X-A", b"keep-alive,content-type"])


@bounded
@given(
    st.lists(st.tuples(field_names, field_values), max_size=6).map(tuple),
    st.sampled_from([_NOT_SHAREABLE, _NOT_REPLAYED]),
)
def test_the_fields_a_replay_drops_are_those_the_rule_drops(
    headers: tuple[tuple[bytes, bytes], ...], dropped: frozenset[bytes]
) -> None:
    kept = _kept(headers, dropped)
    assert kept == kept_reference(headers, dropped)
    if kept == headers:
        assert kept is headers  # nothing dropped: nothing copied


def test_a_replay_is_the_stored_response_with_its_mark() -> None:
    stored = HttpResponse(201, ((b"content-type", b"application/json"), (b"x-a", b"1")), b"{}")
    replay = decode_response(encode_response(stored)).replay()
    assert replay == HttpResponse(201, (*stored.headers, (REPLAYED_HEADER, b"true")), b"{}")
