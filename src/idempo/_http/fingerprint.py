"""The request fingerprint (SPEC §1): canonical bytes of method, path, query, body (JSON
per RFC 8785) and any headers the app names."""

from __future__ import annotations

import hashlib
import json
import json.encoder
import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._core.fingerprint import canonical_bytes, plain_canonical_text
from .._core.jsondecode import loads as json_loads
from ..errors import InvalidPayloadError
from .keys import Header, header_values

# A string as a JSON literal with ASCII escapes: what json.dumps writes with ensure_ascii.
_ascii_string: Callable[[str], str] = json.encoder.encode_basestring_ascii

FingerprintField = Literal["method", "path", "query", "body"]
DEFAULT_FINGERPRINT_FIELDS: tuple[FingerprintField, ...] = ("method", "path", "query", "body")


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """What a fingerprint can be made of, whatever the framework."""

    method: str
    path: str
    query: bytes
    headers: Sequence[Header]
    body: bytes


# The JSON strings of the methods idempo guards by default, as `_ascii_string` writes them.
_METHODS = {method: f'"{method}"' for method in ("POST", "PATCH", "PUT", "DELETE")}


def _is_json(content_type: bytes) -> bool:
    media = content_type.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


def _is_form(content_type: bytes) -> bool:
    return content_type.split(b";", 1)[0].strip().lower() == b"application/x-www-form-urlencoded"


def canonical_pairs(data: bytes) -> bytes:
    """``name=value&...`` (a query string, a form-urlencoded body) with its pairs in order of
    name, so ``b=2&a=1`` and ``a=1&b=2`` are one request; pairs of one name keep their order
    (``tag=x&tag=y`` is a list, and not ``tag=y&tag=x``). The pairs' bytes are kept as sent:
    already in order, nothing changes (so a fingerprint stored before is still the same).

    >>> canonical_pairs(b"b=2&tag=y&a=1&tag=x")
    b'a=1&b=2&tag=y&tag=x'
    """
    if b"&" not in data:
        return data
    pairs = data.split(b"&")
    ordered = sorted(pairs, key=_pair_name)
    return data if ordered == pairs else b"&".join(ordered)


def _pair_name(pair: bytes) -> bytes:
    return pair.partition(b"=")[0]


def _canonical_body(body: bytes, content_type: bytes) -> bytes:
    """RFC 8785 bytes for a JSON body, so ``{"a": 1}`` and ``{ "a":1 }`` are one request;
    other bodies as sent, and so is JSON that does not parse or has no RFC 8785 form (invalid
    UTF-8, a lone surrogate, ``1e400``, an integer over 4,300 digits, nesting deeper than
    Python's parser goes): the app refuses or reads those itself, and raw bytes only ever
    make two requests differ, never alike. A form-urlencoded body has its pairs ordered by
    name (`canonical_pairs`).

    A parsed document is canonicalised at any depth (`canonical_bytes` does not recurse).
    """
    if not body:
        return body
    # The type nearly every JSON client sends is told apart without a call.
    if content_type != b"application/json" and not _is_json(content_type):
        return canonical_pairs(body) if _is_form(content_type) else body
    plain = _plain_json(body)
    if plain is not None:
        return plain
    try:
        return canonical_bytes(json_loads(body))
    except (ValueError, InvalidPayloadError, RecursionError):
        return body


def _plain_json(body: bytes) -> bytes | None:
    """RFC 8785 bytes of a JSON body written by the C encoder alone, without a walk of the
    parsed document (`_is_plain`); None when the body may need the walk.

    It takes UTF-8 (what json.loads reads a body that starts so as) with no integer past
    2**53 - 1; its parser refuses floats, NaN and infinities, and the text written is checked
    for characters beyond the Basic Multilingual Plane (and, by encoding it, for lone
    surrogates). What is left is a document the C encoder writes as RFC 8785 does.
    """
    if body[:1] not in _OPENERS or body[1:2] == b"\x00" or _big_integer(body) is not None:
        return None
    try:
        text = body.decode()  # strict: a lone surrogate's bytes are left to the walk
        # The decoder's C scanner, without the Python frame of `raw_decode` around it.
        value, end = _plain_scan(text, 0)
        if end != len(text):
            return None
        canonical = plain_canonical_text(value)
        if canonical.isascii() or _astral(canonical) is None:
            return canonical.encode()  # an escaped lone surrogate raises here
    except (_NotPlain, ValueError, RecursionError, StopIteration):  # StopIteration: no value
        pass
    return None


class _NotPlain(Exception):
    """A float, NaN or an infinity in a body: RFC 8785 writes numbers as ECMAScript does."""


def _not_plain(text: str) -> Any:
    raise _NotPlain(text)


_OPENERS = (b"{", b"[")
_PLAIN_DECODER = json.JSONDecoder(parse_float=_not_plain, parse_constant=_not_plain)
_plain_scan: Callable[[str, int], tuple[Any, int]] = _PLAIN_DECODER.scan_once  # type: ignore[attr-defined]
# An integer past 2**53 - 1 has 16 digits or more (and has an exact form of its own). A run of
# digits inside a string is harmless: that body takes the walk, which decides exactly.
_big_integer = re.compile(rb"[0-9]{16}").search
# Keys beyond the Basic Multilingual Plane sort otherwise in UTF-16, as RFC 8785 sorts them.
_astral = re.compile("[\U00010000-\U0010ffff]").search


def canonical_request(
    request: HttpRequest,
    *,
    fields: Collection[FingerprintField] = DEFAULT_FINGERPRINT_FIELDS,
    headers: Collection[str] = (),
) -> bytes:
    """The canonical bytes of a request: what its fingerprint is the SHA-256 of.

    A JSON document naming each part (sorted keys, ASCII escapes: one spelling per request),
    so no two requests' parts can run together. Only the body needs RFC 8785, which the
    document holds as the SHA-256 of the body's canonical form; the envelope is plain strings
    (json.dumps's bytes). ``headers`` names the request headers that count too
    (case-insensitive; all their values, in order).

    >>> json_type = [(b"content-type", b"application/json")]
    >>> a = HttpRequest("POST", "/pay", b"", json_type, b'{"a":1}')
    >>> b = HttpRequest("POST", "/pay", b"", json_type, b'{ "a": 1 }')
    >>> canonical_request(a) == canonical_request(b)
    True
    """
    return canonical_parts(
        request.method, request.path, request.query, request.headers, request.body, fields, headers
    )


def canonical_parts(
    method: str,
    path: str,
    query: bytes,
    request_headers: Sequence[Header],
    request_body: bytes,
    fields: Collection[FingerprintField] = DEFAULT_FINGERPRINT_FIELDS,
    headers: Collection[str] = (),
    *,
    content_type: Sequence[bytes] | None = None,
) -> bytes:
    """`canonical_request` of a request given in parts, for adapters that would otherwise
    build an `HttpRequest` on every request only to take it apart here. ``content_type``:
    the request's ``Content-Type`` values, where the adapter found them already (else they
    are looked up in ``request_headers``)."""
    if content_type is None and "body" in fields:
        content_type = header_values(request_headers, b"content-type")
    if fields is DEFAULT_FINGERPRINT_FIELDS and not headers:
        # The usual fingerprint, written at once: the same bytes as the document below (a
        # hex digest needs no escaping), as the fingerprint tests check.
        body = _canonical_body(request_body, b", ".join(content_type or ()))
        # The usual method and an empty query are written without a call; a query of one
        # pair is in order as it is, with no call to sort it.
        if query:
            pairs = canonical_pairs(query) if b"&" in query else query
            query_text = _ascii_string(pairs.decode("latin-1"))
        else:
            query_text = '""'
        return (
            f'{{"body":"{hashlib.sha256(body).hexdigest()}"'
            f',"method":{_METHODS.get(method) or _ascii_string(method.upper())}'
            f',"path":{_ascii_string(path)},"query":{query_text},"v":1}}'
        ).encode()
    parts: dict[str, Any] = {}
    # Filled in sort_keys order: body, headers, method, path, query, v.
    if "body" in fields:
        body = _canonical_body(request_body, b", ".join(content_type or ()))
        parts["body"] = hashlib.sha256(body).hexdigest()
    if headers:
        parts["headers"] = {
            name.lower(): [
                value.decode("latin-1")
                for value in header_values(request_headers, name.lower().encode("latin-1"))
            ]
            for name in headers
        }
    if "method" in fields:
        parts["method"] = method.upper()
    if "path" in fields:
        parts["path"] = path
    if "query" in fields:
        parts["query"] = canonical_pairs(query).decode("latin-1")
    if headers:
        parts["v"] = 1
        return json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    # Only strings and the version: the document json.dumps would write (keys in sorted
    # order, each string escaped by the same function), without building an encoder.
    members = [f'"{name}":{_ascii_string(value)}' for name, value in parts.items()]
    members.append('"v":1')
    return ("{" + ",".join(members) + "}").encode()


def request_fingerprint(
    request: HttpRequest,
    *,
    fields: Collection[FingerprintField] = DEFAULT_FINGERPRINT_FIELDS,
    headers: Collection[str] = (),
) -> str:
    """Hex SHA-256 of `canonical_request`: the fingerprint a record keeps for this request."""
    return hashlib.sha256(canonical_request(request, fields=fields, headers=headers)).hexdigest()
