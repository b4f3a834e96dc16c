"""Fingerprints: a SHA-256 of the canonical form of what was asked."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import json.encoder
from collections.abc import Callable
from typing import Any

import rfc8785

from .errors import InvalidPayloadError

_SAFE_INTEGER = 2**53 - 1
# RFC 8785 numbers are IEEE doubles, so a larger integer would lose digits (two ids could
# collide). It is hashed as an object under a key no JSON document contains in practice.
_BIG_INTEGER_KEY = "\u0000idempo:integer"


def _plain(value: Any) -> Any:
    """JSON-ready data: dataclasses and pydantic models as their fields, big integers exact."""
    if isinstance(value, bool) or value is None or isinstance(value, str | float):
        return value
    if isinstance(value, int):
        return value if -_SAFE_INTEGER <= value <= _SAFE_INTEGER else {_BIG_INTEGER_KEY: str(value)}
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        return _plain(dump(mode="json"))
    return value


def _without_floats(value: Any) -> bool:
    """True if the C JSON encoder writes exactly RFC 8785's bytes for ``value``.

    It does for strings, integers (within the safe range, which `_plain` ensures), booleans
    and null, and it sorts keys as RFC 8785 does (by UTF-16 code unit) unless a key holds a
    character beyond the Basic Multilingual Plane. Floats are where the two differ.
    """
    if isinstance(value, dict):
        return all(
            isinstance(key, str) and max(key, default="\0") < "\U00010000" and _without_floats(item)
            for key, item in value.items()
        )
    if isinstance(value, list):
        return all(_without_floats(item) for item in value)
    return value is None or isinstance(value, str | int)


def _sorted_compact_encoder() -> Callable[[Any], str]:
    """``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``,
    made once: json.dumps builds a JSONEncoder, and that its C encoder, on every call.

    Without circular-reference markers: the values given are walked by `_is_plain` or
    `_plain` first, which a cycle would already have stopped.
    """
    encoder = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    try:
        make = getattr(json.encoder, "c_make_encoder", None)
        if make is None:
            return encoder.encode
        # The arguments JSONEncoder.iterencode passes it (CPython's C accelerator).
        iterencode = make(
            None, encoder.default, json.encoder.encode_basestring, None, ":", ",", True, False, True
        )
    except (AttributeError, TypeError):  # pragma: no cover - another Python's json module
        return encoder.encode

    def encode(value: Any) -> str:
        return "".join(iterencode(value, 0))

    return encode


_encode_sorted = _sorted_compact_encoder()


def _is_plain(value: Any) -> bool:
    """True if ``value`` is already what `_plain` would make of it and `_without_floats`
    holds: exact JSON types, safe integers, BMP-only string keys, no floats. Parsed JSON
    usually is, and then needs neither walk."""
    kind = type(value)
    if kind in _PLAIN_SCALARS:
        return True
    if kind is int:
        safe: bool = -_SAFE_INTEGER <= value <= _SAFE_INTEGER
        return safe
    if kind is dict:
        for key, item in value.items():
            if type(key) is not str or not (key.isascii() or max(key) < "\U00010000"):
                return False
            # Scalars are checked here, not in a call each: most members of a body are.
            if type(item) not in _PLAIN_SCALARS and not _is_plain(item):
                return False
        return True
    if kind is list:
        return all(map(_is_plain, value))
    return False


_PLAIN_SCALARS = frozenset({str, bool, type(None)})
# A tuple, not a union: isinstance checks a tuple several times faster.
_BINARY = (bytes, bytearray, memoryview)


def _rfc8785(value: Any) -> bytes:
    if _without_floats(value):
        # The pure-Python canonicaliser costs tens of microseconds per request; this path
        # gives the same bytes (tests/test_fingerprint.py checks it against rfc8785).
        try:
            return _encode_sorted(value).encode()
        except UnicodeEncodeError:
            pass  # a lone surrogate: let rfc8785 refuse it with its own error
    return rfc8785.dumps(value)


def canonical_bytes(payload: Any) -> bytes:
    """The canonical bytes of a payload: raw bytes as given, anything else as RFC 8785 JSON.

    RFC 8785 fixes key order, number forms and string escaping, so two payloads that mean the
    same JSON give the same bytes however they were built. Dataclasses and pydantic models
    count as their fields.
    """
    if isinstance(payload, _BINARY):
        return bytes(payload)
    if _is_plain(payload):
        try:
            return _encode_sorted(payload).encode()
        except UnicodeEncodeError:
            pass  # a lone surrogate: the general path refuses it
    try:
        return _rfc8785(_plain(payload))
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise InvalidPayloadError(
            f"cannot fingerprint a {type(payload).__name__}: give JSON-compatible data or bytes"
        ) from exc


def fingerprint(payload: Any) -> str:
    """Hex SHA-256 of the payload's canonical bytes.

    >>> fingerprint({"b": 1, "a": [1.0, "x"]}) == fingerprint({"a": [1, "x"], "b": 1})
    True
    """
    return hashlib.sha256(canonical_bytes(payload)).hexdigest()
