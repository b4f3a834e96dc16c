"""The HTTP fingerprint's shortcuts give the bytes of the general path, for any body.

A JSON body proved plain from its raw bytes skips the walk of the parsed document
(`idempo._core.fingerprint._is_plain`), and the default fingerprint's document is written at
once instead of member by member. Both must give exactly what the general path gives, or a
fingerprint stored before would stop matching its retries.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempo._core.fingerprint import _is_plain, canonical_bytes
from idempo._http.fingerprint import (
    DEFAULT_FINGERPRINT_FIELDS,
    _canonical_body,
    _plain_json,
    canonical_pairs,
    canonical_parts,
)
from idempo.errors import InvalidPayloadError

bounded = settings(max_examples=300, deadline=None)
JSON_TYPE = b"application/json"


def reference_body(body: bytes) -> bytes:
    """What a JSON body canonicalised to before the shortcut: the parsed document's
    `canonical_bytes`, or the body itself when it does not parse or has no RFC 8785 form."""
    try:
        return canonical_bytes(json.loads(body))
    except (ValueError, InvalidPayloadError, RecursionError):
        return body


# Every character, lone surrogates and astral ones included.
any_char = st.characters(exclude_categories=())
scalars = (
    st.none()
    | st.booleans()
    | st.integers()  # big ones too: past 2**53 they take the exact form
    | st.integers(-(2**53) - 2, 2**53 + 2)
    | st.floats()  # NaN and infinities too: json.dumps writes them, json.loads reads them
    | st.text(any_char, max_size=8)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(any_char, max_size=4), children)
    ),
    max_leaves=15,
)


def render(value: Any, rnd: random.Random) -> str:
    """``value`` as JSON text, spelled one of the many ways a client may: whitespace around
    anything, characters escaped or raw, numbers as written by json.dumps or with a fraction,
    and objects with an earlier duplicate of some key (the parser keeps the last)."""
    space = rnd.choice(["", "", " ", "\n\t "])
    if isinstance(value, dict):
        members = []
        for key, item in value.items():
            if rnd.random() < 0.2:
                members.append(f"{render(key, rnd)}{space}:{space}{render(['dup'], rnd)}")
            members.append(f"{render(key, rnd)}{space}:{space}{render(item, rnd)}")
        return "{" + space + ("," + space).join(members) + space + "}"
    if isinstance(value, list):
        return "[" + space + ("," + space).join(render(item, rnd) for item in value) + "]"
    if isinstance(value, str):
        if rnd.random() < 0.5:
            return json.dumps(value, ensure_ascii=rnd.random() < 0.5)
        # Each character its own way: \uXXXX, or as it is (escaping only what must be).
        out = []
        for char in value:
            if ord(char) < 0x20 or char in '"\\' or (ord(char) < 0x10000 and rnd.random() < 0.3):
                out.append(f"\\u{ord(char):04{rnd.choice('xX')}}")
            else:
                out.append(char)
        return '"' + "".join(out) + '"'
    if type(value) is int and rnd.random() < 0.2:
        return rnd.choice([f"{value}.0", f"{value}e0", f"{value}E+00"])
    return json.dumps(value)


def encoded(text: str, rnd: random.Random) -> bytes:
    """The text as a client sends it: UTF-8 (lone surrogates as their raw bytes) mostly,
    sometimes with a BOM or trailing whitespace, sometimes UTF-16."""
    choice = rnd.random()
    if choice < 0.1:
        return text.encode("utf-16-le", "surrogatepass")
    if choice < 0.15:
        return b"\xef\xbb\xbf" + text.encode("utf-8", "surrogatepass")
    body = text.encode("utf-8", "surrogatepass")
    return body + b" \n" if choice < 0.2 else body


@bounded
@given(value=values, rnd=st.randoms(use_true_random=False))
def test_the_shortcut_takes_only_plain_documents(value: Any, rnd: random.Random) -> None:
    """The shortcut's premise: a body it writes parses to a document the C encoder writes as
    RFC 8785 does (`_is_plain`), and it writes the very bytes `canonical_bytes` does."""
    body = encoded(render(value, rnd), rnd)
    written = _plain_json(body)
    if written is None:
        return
    parsed = json.loads(body)
    assert _is_plain(parsed), body
    assert written == canonical_bytes(parsed)


def test_the_shortcut_takes_the_usual_bodies() -> None:
    """Not a shortcut that never runs: plain documents, escapes and BMP text included."""
    for body in (b'{"name":"widget","qty":1}', b'[1,"\\u00e9",{"b":null,"a":true}]'):
        assert _plain_json(body) == canonical_bytes(json.loads(body))
    for body in (b"[1.5]", b"[NaN]", b"[9007199254740992]", '{"\U0001f600":1}'.encode()):
        assert _plain_json(body) is None


@bounded
@given(value=values, rnd=st.randoms(use_true_random=False))
def test_a_json_body_canonicalises_as_it_did_before_the_shortcut(
    value: Any, rnd: random.Random
) -> None:
    body = encoded(render(value, rnd), rnd)
    assert _canonical_body(body, JSON_TYPE) == reference_body(body)


@pytest.mark.parametrize(
    "body",
    [
        b'{"a":1,"a":2}',
        b'{"b":1,"a":{"d":[1,2],"c":null}}',
        b'{ "a" : [ true , false , null ] }',
        b'{"n":9007199254740991}',
        b'{"n":9007199254740992}',
        b'{"n":-9007199254740993}',
        b'{"n":123456789012345678901234567890}',
        b"[" + b"9" * 5000 + b"]",  # over Python's 4,300-digit limit: kept raw
        b'{"f":1.0}',
        b'{"f":1e400}',
        b'{"f":-0.0,"g":-0}',
        b'{"f":1E2}',
        b"[NaN]",
        b"[ NaN ]",  # no RFC 8785 form: kept raw, spaces and all
        b'{"b":1,"a":-Infinity}',
        b'{"b":1, "a":Infinity}',
        b'{"\\ud83d\\ude00":1,"\\uffff":2}',
        '{"😀":1,"\uffff":2}'.encode(),
        b'{"k":"\\u00e9\\u00E9"}',
        b'{"k":"\\udc00"}',  # a lone surrogate, escaped
        b'{"k":"\xed\xb0\x80"}',  # a lone surrogate, as raw bytes
        b'{"k":"\xff"}',  # not UTF-8
        b'\xef\xbb\xbf{"a":1}',
        b'{"a":1} ',
        b'{"a":1} x',
        b" [1]",
        b'"just a string"',
        b"1",
        b"{}",
        b"[]",
        b"{",
        '{"a":1}'.encode("utf-16-le"),
        '{"a":1}'.encode("utf-32"),
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 2_000 + b"1" + b"}" * 2_000,
    ],
)
def test_edge_case_bodies_canonicalise_as_they_did_before_the_shortcut(body: bytes) -> None:
    assert _canonical_body(body, JSON_TYPE) == reference_body(body)


@pytest.mark.parametrize(
    "content_type", [b"", b"text/plain", b"application/jsonx", b"application/json-seq"]
)
def test_a_body_not_declared_json_counts_as_sent(content_type: bytes) -> None:
    body = b'{"b": 1, "a": 2}'
    assert _canonical_body(body, content_type) == body


def test_a_form_body_has_its_pairs_ordered() -> None:
    assert _canonical_body(b"b=2&a=1", b"application/x-www-form-urlencoded") == b"a=1&b=2"


def reference_parts(method: str, path: str, query: bytes, body: bytes) -> bytes:
    """The default fingerprint's document as json.dumps writes it."""
    import hashlib

    parts = {
        "body": hashlib.sha256(reference_body(body)).hexdigest(),
        "method": method.upper(),
        "path": path,
        "query": canonical_pairs(query).decode("latin-1"),
        "v": 1,
    }
    return json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()


@bounded
@given(
    method=st.text(any_char, max_size=8),
    path=st.text(any_char, max_size=20),
    query=st.binary(max_size=20),
    value=values,
    rnd=st.randoms(use_true_random=False),
)
def test_the_default_document_is_the_one_json_dumps_writes(
    method: str, path: str, query: bytes, value: Any, rnd: random.Random
) -> None:
    body = encoded(render(value, rnd), rnd)
    headers = [(b"content-type", JSON_TYPE)]
    expected = reference_parts(method, path, query, body)
    assert canonical_parts(method, path, query, headers, body) == expected
    assert canonical_parts(method, path, query, headers, body, content_type=[JSON_TYPE]) == expected
    # The same fields named by the app (not the default tuple): the general path.
    fields = list(DEFAULT_FINGERPRINT_FIELDS)
    assert canonical_parts(method, path, query, headers, body, fields) == expected
