"""`idempo._core.jsondecode.loads` answers exactly what ``json.loads`` does, for any bytes.

It reads a stored result on every replay and the stored response's line when the fast match
fails, so a difference would change what a retry gets back.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from idempo._core.jsondecode import loads
from idempo.serializers import JsonSerializer

bounded = settings(max_examples=400, deadline=None)

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(st.characters(exclude_categories=()), max_size=8)
)
values = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=4), children)
    ),
    max_leaves=12,
)
ENCODINGS = ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"]


def outcome(read: Any, data: bytes) -> tuple[str, Any]:
    """The value read (NaN made comparable), or the type of the error raised."""
    try:
        value = read(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError
        return ("error", type(exc))
    return ("value", json.dumps(value, sort_keys=True) if _has_nan(value) else value)


def _has_nan(value: Any) -> bool:
    if isinstance(value, float):
        return math.isnan(value)
    if isinstance(value, list):
        return any(map(_has_nan, value))
    if isinstance(value, dict):
        return any(map(_has_nan, value.values()))
    return False


@bounded
@given(values, st.sampled_from(ENCODINGS), st.sampled_from(["", " ", "\n", "\t "]), st.booleans())
def test_documents_in_any_encoding_and_spacing(
    value: Any, encoding: str, space: str, ascii_only: bool
) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only)
    for document in (text, space + text, text + space):
        try:
            data = document.encode(encoding)
        except UnicodeEncodeError:  # a lone surrogate has no strict UTF form
            data = document.encode(encoding, "surrogatepass")
        assert outcome(loads, data) == outcome(json.loads, data)


@bounded
@given(st.binary(max_size=24))
@example(b"")
@example(b"1\x00")
@example(b"{\x00}\x00")
@example(b'"\xed\xa0\x80"')  # a lone surrogate's UTF-8 bytes: json.loads passes them
@example(b'{"a":1} x')
@example(b"[1,2")
@example(b"nul")
def test_any_bytes(data: bytes) -> None:
    assert outcome(loads, data) == outcome(json.loads, data)


@pytest.mark.parametrize(
    "value", [{"id": "o-1", "n": 2}, [1, "x"], "ok", 0, None, "\u00e9\U0001f600"]
)
def test_the_serializer_round_trips_through_it(value: Any) -> None:
    serializer = JsonSerializer()
    assert serializer.loads(serializer.dumps(value)) == value


def test_deep_nesting_fails_as_json_loads_does() -> None:
    data = b"[" * 100_000 + b"]" * 100_000
    assert outcome(loads, data) == outcome(json.loads, data)
