"""Fingerprints: a SHA-256 of the canonical form of what was asked."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import json.encoder
from collections.abc import Callable
from typing import Any

import rfc8785

from ..errors import InvalidPayloadError

_SAFE_INTEGER = 2**53 - 1
# RFC 8785 numbers are IEEE doubles, so a larger integer would lose digits (two ids could
# collide). It is hashed as an object under a key no JSON document contains in practice.
_BIG_INTEGER_KEY = "\u0000idempo:integer"


def _sorted_compact_encoder() -> Callable[[Any], str]:
    """``json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``,
    made once: json.dumps builds a JSONEncoder, and that its C encoder, on every call.

    Without circular-reference markers: the values given are walked by `_is_plain` first,
    which a cycle would already have stopped.
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
    """True if the C JSON encoder writes exactly RFC 8785's bytes for ``value``: exact JSON
    types, safe integers, no floats (where the two differ), and string keys within the Basic
    Multilingual Plane (beyond it, sorting by code point and by UTF-16 code unit differ).
    Parsed JSON usually is. Recursive: a deep value raises RecursionError."""
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
            member = type(item)
            if member in _PLAIN_SCALARS:
                continue
            if member is int:
                if not -_SAFE_INTEGER <= item <= _SAFE_INTEGER:
                    return False
            elif not _is_plain(item):
                return False
        return True
    if kind is list:
        return all(map(_is_plain, value))
    return False


_PLAIN_SCALARS = frozenset({str, bool, type(None)})
# A tuple, not a union: isinstance checks a tuple several times faster.
_BINARY = (bytes, bytearray, memoryview)
_SCALARS = frozenset({str, int, float, bool, type(None)})
# RFC 8785's string form: json.dumps's with ensure_ascii off escapes exactly the same
# characters (quote, backslash, controls; \u00XX in lower case), and nothing else.
_encode_string: Callable[[str], str] = json.encoder.encode_basestring


class _Text(str):
    """Output already written out (a bracket, a comma, a key): not a value to encode."""

    __slots__ = ()


_COMMA, _COLON = _Text(","), _Text(":")


class _Close(_Text):
    """The end of a container, which leaves the path of containers being written."""

    __slots__ = ("container",)
    container: int


def _close(text: str, container: int) -> _Close:
    mark = _Close(text)
    mark.container = container
    return mark


def _members(value: Any) -> dict[Any, Any] | list[Any] | None:
    """The members of a JSON object or array ``value`` stands for, or None for a scalar.

    Dataclasses count as their fields, one level at a time (``dataclasses.asdict`` would
    recurse), and pydantic models as their JSON-mode dump.
    """
    if isinstance(value, dict):
        return value
    if isinstance(value, list | tuple):
        return list(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
    dump = getattr(value, "model_dump", None)
    if callable(dump):
        dumped = dump(mode="json")
        return _members(dumped) if isinstance(dumped, dict | list) else [dumped]
    return None


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, int):
        value = int(value)  # an IntEnum is its number
        if -_SAFE_INTEGER <= value <= _SAFE_INTEGER:
            return str(value)
        # str() refuses past 4,300 digits (ValueError): such a payload cannot be fingerprinted.
        return "{" + _encode_string(_BIG_INTEGER_KEY) + ":" + _encode_string(str(value)) + "}"
    if isinstance(value, float):
        # ECMAScript's number form, as RFC 8785 asks; NaN and infinities are refused.
        return rfc8785.dumps(float(value)).decode()
    if isinstance(value, str):
        return _encode_string(value)
    raise TypeError(f"unsupported type {type(value).__name__}")


def _utf16(item: tuple[Any, Any]) -> bytes:
    key = item[0]
    if not isinstance(key, str):
        raise TypeError("object keys must be strings")
    return key.encode("utf-16-be")  # refuses a lone surrogate (UnicodeEncodeError)


def _canonical(payload: Any) -> bytes:
    """RFC 8785 bytes of ``payload``, written without recursion: a document nested deeper
    than Python's stack (JSON that ``json.loads`` accepts can be) is canonicalised too.

    Big integers are exact (see `_BIG_INTEGER_KEY`). A container that contains itself is
    refused (ValueError) rather than written for ever.

    Raises:
        TypeError: a value JSON has no form for.
        ValueError: a cycle, NaN or an infinity, a lone surrogate, an integer too long.
    """
    out: list[str] = []
    # Values still to write, last first. A container writes its opening bracket and pushes
    # its members, separators and closing bracket.
    todo: list[Any] = [payload]
    open_containers: set[int] = set()  # on the path from the root: meeting one is a cycle
    while todo:
        item = todo.pop()
        if type(item) is _Text:
            out.append(item)
            continue
        if type(item) is _Close:
            open_containers.discard(item.container)
            out.append(item)
            continue
        members = None if type(item) in _SCALARS else _members(item)
        if members is None:
            out.append(_scalar(item))
            continue
        if id(item) in open_containers:
            raise ValueError("the payload contains itself")
        if not members:
            out.append("{}" if isinstance(members, dict) else "[]")
            continue
        open_containers.add(id(item))
        if isinstance(members, dict):
            out.append("{")
            todo.append(_close("}", id(item)))
            items = sorted(members.items(), key=_utf16)
            for index in range(len(items) - 1, -1, -1):
                key, member = items[index]
                todo.append(member)
                todo.append(_Text(_encode_string(key) + ":"))
                if index:
                    todo.append(_COMMA)
        else:
            out.append("[")
            todo.append(_close("]", id(item)))
            for index in range(len(members) - 1, -1, -1):
                todo.append(members[index])
                if index:
                    todo.append(_COMMA)
    return "".join(out).encode()  # a lone surrogate in a string: UnicodeEncodeError


plain_canonical_text: Callable[[Any], str] = _encode_sorted
"""RFC 8785 text of a value the caller has proved plain (exact JSON types, no floats, safe
integers, no key beyond the Basic Multilingual Plane: what `_is_plain` checks), by the C
encoder alone: the HTTP surface proves it while parsing the body and from the text written,
which is cheaper than walking the parsed document. The encoder itself, not a function around
it: a frame less on every request. Raises RecursionError deeper than the C encoder goes."""


def canonical_bytes(payload: Any) -> bytes:
    """The canonical bytes of a payload: raw bytes as given, anything else as RFC 8785 JSON.

    RFC 8785 fixes key order, number forms and string escaping, so two payloads that mean the
    same JSON give the same bytes however they were built. Dataclasses and pydantic models
    count as their fields. Any depth of nesting is fine.

    Raises:
        InvalidPayloadError: the payload has no JSON form (an object, NaN, a lone surrogate,
            non-string keys, a container that contains itself, an integer over 4,300 digits).
    """
    if isinstance(payload, _BINARY):
        return bytes(payload)
    try:
        if _is_plain(payload):
            return _encode_sorted(payload).encode()
    except (UnicodeEncodeError, RecursionError):
        pass  # a lone surrogate (refused below), or deeper than the fast path's recursion
    try:
        return _canonical(payload)
    except (rfc8785.CanonicalizationError, TypeError, ValueError) as exc:
        raise InvalidPayloadError(
            f"cannot fingerprint a {type(payload).__name__}: give JSON-compatible data or "
            f"bytes ({exc})"
        ) from exc


def fingerprint(payload: Any) -> str:
    """Hex SHA-256 of the payload's canonical bytes.

    >>> fingerprint({"b": 1, "a": [1.0, "x"]}) == fingerprint({"a": [1, "x"], "b": 1})
    True
    """
    if type(payload) is bytes:  # what the HTTP surfaces give: no canonical form to find
        return hashlib.sha256(payload).hexdigest()
    return hashlib.sha256(canonical_bytes(payload)).hexdigest()
