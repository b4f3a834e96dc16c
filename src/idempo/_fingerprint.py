"""Fingerprints: a SHA-256 of the canonical form of what was asked."""

from __future__ import annotations

import hashlib
from typing import Any

import rfc8785

from .errors import InvalidPayloadError


def canonical_bytes(payload: Any) -> bytes:
    """The canonical bytes of a payload: raw bytes as given, anything else as RFC 8785 JSON.

    RFC 8785 fixes key order, number forms and string escaping, so two payloads that mean the
    same JSON give the same bytes however they were built.
    """
    if isinstance(payload, bytes | bytearray | memoryview):
        return bytes(payload)
    try:
        return rfc8785.dumps(payload)
    except (rfc8785.CanonicalizationError, TypeError) as exc:
        raise InvalidPayloadError(
            f"cannot fingerprint a {type(payload).__name__}: give JSON-compatible data or bytes"
        ) from exc


def fingerprint(payload: Any) -> str:
    """Hex SHA-256 of the payload's canonical bytes.

    >>> fingerprint({"b": 1, "a": [1.0, "x"]}) == fingerprint({"a": [1, "x"], "b": 1})
    True
    """
    return hashlib.sha256(canonical_bytes(payload)).hexdigest()
