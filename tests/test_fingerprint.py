"""Fingerprints and keys: canonical JSON per RFC 8785, raw bytes, and the key alphabet."""

from __future__ import annotations

import hashlib
import json
import random
import unicodedata
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempo import InvalidKeyError, InvalidPayloadError, Scope, fingerprint, validate_key
from idempo._core.fingerprint import canonical_bytes

bounded = settings(max_examples=200, deadline=None)

# RFC 8785 numbers are IEEE doubles: integers beyond 2**53 - 1 are not exact, so refused.
SAFE_INT = 2**53 - 1
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-SAFE_INT, SAFE_INT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=25,
)


def reordered(value: Any, rnd: random.Random) -> Any:
    """The same JSON value with every object's keys inserted in a shuffled order."""
    if isinstance(value, dict):
        items = [(key, reordered(item, rnd)) for key, item in value.items()]
        rnd.shuffle(items)
        return dict(items)
    if isinstance(value, list):
        return [reordered(item, rnd) for item in value]
    return value


def meaning(value: Any) -> Any:
    """What a JSON value means, as a hashable: numbers by value (1 == 1.0), bools apart."""
    if value is None or isinstance(value, bool):
        return ("literal", value)
    if isinstance(value, int | float):
        return ("number", float(value))
    if isinstance(value, str):
        return ("string", value)
    if isinstance(value, list):
        return ("array", tuple(meaning(item) for item in value))
    return ("object", frozenset((key, meaning(item)) for key, item in value.items()))


# -- canonical JSON ------------------------------------------------------------------------


@bounded
@given(value=json_values, rnd=st.randoms(use_true_random=False))
def test_key_order_does_not_matter(value: Any, rnd: random.Random) -> None:
    """Objects with the same members in another insertion order have the same fingerprint."""
    assert fingerprint(reordered(value, rnd)) == fingerprint(value)


@bounded
@given(a=json_values, b=json_values)
def test_fingerprints_differ_exactly_when_meanings_differ(a: Any, b: Any) -> None:
    """Two JSON values share a fingerprint if and only if they mean the same thing."""
    assert (fingerprint(a) == fingerprint(b)) == (meaning(a) == meaning(b))


@bounded
@given(value=json_values)
def test_canonical_form_is_stable_json(value: Any) -> None:
    """The canonical bytes are UTF-8 JSON that parses back to the same meaning, and
    canonicalising them again changes nothing."""
    data = canonical_bytes(value)
    # Every JSON number is a double; read them as such (2**53 as an int would be refused).
    parsed = json.loads(data.decode("utf-8"), parse_int=float)
    assert meaning(parsed) == meaning(value)
    assert canonical_bytes(parsed) == data


@bounded
@given(text=st.text(st.characters(codec="utf-8"), min_size=1))
def test_unicode_strings_are_fingerprinted_by_their_code_points(text: str) -> None:
    """Any Unicode string is accepted; the same string under another key order or built
    from its escaped JSON form gives the same fingerprint."""
    escaped = json.loads(json.dumps(text, ensure_ascii=True))
    assert fingerprint({"s": escaped, "t": 1}) == fingerprint({"t": 1, "s": text})
    assert fingerprint(text) != fingerprint(text + "\x00")


def test_unicode_is_not_normalised() -> None:
    """RFC 8785 compares code points: composed and decomposed forms are different payloads."""
    composed = "caf\u00e9"
    decomposed = unicodedata.normalize("NFD", composed)
    assert composed != decomposed
    assert fingerprint({"name": composed}) != fingerprint({"name": decomposed})
    assert canonical_bytes({"name": composed}) == '{"name":"café"}'.encode()


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, 1.0),
        (100, 1e2),
        (0, -0.0),
        (-5, -5.0),
        (SAFE_INT, float(SAFE_INT)),
        (1.5e300, 15e299),
        ({"amount": 10}, {"amount": 10.0}),
        ([1, {"b": 2.0, "a": 1}], [1.0, {"a": 1.0, "b": 2}]),
    ],
)
def test_number_forms_with_one_value_agree(a: Any, b: Any) -> None:
    """Numbers are compared by value: 1 and 1.0, 100 and 1e2, 0 and -0.0 are one number."""
    assert fingerprint(a) == fingerprint(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, True),
        (0, False),
        (None, False),
        (0, "0"),
        ([], {}),
        ("", None),
        ([1, 2], [2, 1]),
        ({"a": {"b": 1}}, {"a": {"b": [1]}}),
        (0.1 + 0.2, 0.3),
    ],
)
def test_distinct_values_have_distinct_fingerprints(a: Any, b: Any) -> None:
    """Values that look alike but mean different JSON never share a fingerprint."""
    assert fingerprint(a) != fingerprint(b)


@bounded
@given(value=json_values)
def test_nested_structures_built_from_tuples_agree_with_lists(value: Any) -> None:
    """A tuple is a JSON array: the same nesting built from tuples fingerprints alike."""

    def tupled(item: Any) -> Any:
        if isinstance(item, list):
            return tuple(tupled(child) for child in item)
        if isinstance(item, dict):
            return {key: tupled(child) for key, child in item.items()}
        return item

    assert fingerprint(tupled(value)) == fingerprint(value)


@pytest.mark.parametrize(
    "payload",
    [
        {1, 2},
        object(),
        float("nan"),
        float("inf"),
        {1: "int key"},
        {"nested": b"bytes inside JSON"},
        "\ud800",
    ],
    ids=["set", "object", "nan", "inf", "int-key", "nested-bytes", "surrogate"],
)
def test_unrepresentable_payloads_are_refused(payload: Any) -> None:
    """What RFC 8785 cannot represent exactly raises InvalidPayloadError, not a driver error."""
    with pytest.raises(InvalidPayloadError):
        fingerprint(payload)


@pytest.mark.parametrize("big", [2**53, -(2**63), 2**64 + 1, 10**30])
def test_integers_beyond_double_precision_are_fingerprinted_exactly(big: int) -> None:
    """An integer too large for an IEEE double (a 64-bit id) still fingerprints, and its
    neighbour, which a double could not tell apart, fingerprints differently."""
    assert fingerprint({"id": big}) == fingerprint({"id": big})
    assert fingerprint({"id": big}) != fingerprint({"id": big + 1})
    assert fingerprint({"id": big}) != fingerprint({"id": float(big)})
    assert fingerprint({"id": big}) != fingerprint({"id": str(big)})


# -- raw bytes -----------------------------------------------------------------------------


@bounded
@given(data=st.binary(max_size=2048))
def test_bytes_are_hashed_raw(data: bytes) -> None:
    """bytes, bytearray and memoryview are hashed as given: SHA-256 of the very bytes."""
    expected = hashlib.sha256(data).hexdigest()
    assert fingerprint(data) == expected
    assert fingerprint(bytearray(data)) == expected
    assert fingerprint(memoryview(data)) == expected


def test_bytes_are_not_parsed_as_json() -> None:
    """A JSON body given as bytes is not canonicalised: reordered bytes are another payload."""
    assert fingerprint(b'{"b":1,"a":2}') != fingerprint(b'{"a":2,"b":1}')
    assert fingerprint(b'{"a":2,"b":1}') == hashlib.sha256(b'{"a":2,"b":1}').hexdigest()
    assert fingerprint(b"") == hashlib.sha256(b"").hexdigest()


def test_fingerprint_is_hex_sha256() -> None:
    """A fingerprint is 64 lowercase hex digits."""
    value = fingerprint({"a": 1})
    assert len(value) == 64
    assert set(value) <= set("0123456789abcdef")


# -- keys ----------------------------------------------------------------------------------

PRINTABLE = "".join(chr(code) for code in range(0x21, 0x7F))


@pytest.mark.parametrize(
    "key",
    [
        "a",
        "order-42",
        "3f1b2c9e-6d1f-4c1e-9a7e-2b8d1c0e4f5a",
        "saga:7:step-2",
        '"quoted"',
        "x" * 255,
        PRINTABLE,
    ],
    ids=["one-char", "plain", "uuid", "saga-step", "quotes", "255-chars", "every-printable"],
)
def test_valid_keys_are_accepted_unchanged(key: str) -> None:
    """1-255 printable ASCII characters (0x21-0x7E) make a key, returned as given."""
    assert validate_key(key) == key
    scope = Scope.of(key, operation="charge", principal="alice")
    assert (scope.key, scope.operation, scope.principal) == (key, "charge", "alice")


@pytest.mark.parametrize(
    "key",
    [
        "",
        "x" * 256,
        " ",
        "a b",
        " leading",
        "trailing ",
        "tab\t",
        "new\nline",
        "cr\r",
        "nul\x00",
        "del\x7f",
        "esc\x1b",
        "caf\u00e9",
        "nbsp\u00a0",
        "\u043a\u043b\u044e\u0447",
        "emoji\U0001f600",
        "fullwidth\uff41",
        42,
        None,
        b"bytes",
        ["list"],
    ],
    ids=lambda key: repr(key)[:20],
)
def test_invalid_keys_are_refused(key: Any) -> None:
    """Empty, too long, spaces, control characters, non-ASCII and non-strings are refused."""
    with pytest.raises(InvalidKeyError) as info:
        validate_key(key)
    assert info.value.status_code == 400
    with pytest.raises(InvalidKeyError):
        Scope.of(key, operation="charge")


@bounded
@given(key=st.text(st.sampled_from(PRINTABLE), min_size=1, max_size=255))
def test_every_printable_ascii_key_is_valid(key: str) -> None:
    """Any string of 1-255 characters from 0x21-0x7E is a valid key."""
    assert validate_key(key) == key


@bounded
@given(
    prefix=st.text(st.sampled_from(PRINTABLE), max_size=20),
    bad=st.characters().filter(lambda char: not 0x21 <= ord(char) <= 0x7E),
    suffix=st.text(st.sampled_from(PRINTABLE), max_size=20),
)
def test_any_character_outside_printable_ascii_is_refused(
    prefix: str, bad: str, suffix: str
) -> None:
    """One character outside 0x21-0x7E anywhere in a key makes it invalid."""
    with pytest.raises(InvalidKeyError):
        validate_key(prefix + bad + suffix)


# -- the fast path agrees with the reference canonicaliser ---------------------------------

float_free_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-SAFE_INT, max_value=SAFE_INT)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=12),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(alphabet=st.characters(codec="utf-8"), max_size=6), children, max_size=4
        )
    ),
    max_leaves=20,
)


@bounded
@given(float_free_json)
def test_fast_canonical_form_is_byte_identical_to_rfc8785(value: Any) -> None:
    """JSON without floats, encoded by the C encoder, is exactly what RFC 8785 writes: control
    characters, astral keys and key order included."""
    import rfc8785

    assert canonical_bytes(value) == rfc8785.dumps(value)


# -- the general path (any depth) agrees with the reference canonicaliser -------------------

general_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-SAFE_INT, max_value=SAFE_INT)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(codec="utf-8"), max_size=12),
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children, children)
        | st.dictionaries(
            st.text(alphabet=st.characters(codec="utf-8"), max_size=6), children, max_size=4
        )
    ),
    max_leaves=20,
)


@bounded
@given(general_json)
def test_general_canonical_form_is_byte_identical_to_rfc8785(value: Any) -> None:
    """The walker that serves floats and deep documents writes exactly what the recursive
    reference canonicaliser does (floats, astral keys, tuples as arrays), and so does
    canonical_bytes on whatever path it takes."""
    import rfc8785

    from idempo._core.fingerprint import _canonical

    assert _canonical(value) == rfc8785.dumps(value)
    assert canonical_bytes(value) == rfc8785.dumps(value)


@pytest.mark.parametrize("depth", [10, 500, 5_000, 50_000])
def test_any_depth_is_canonicalised(depth: int) -> None:
    """Nesting far deeper than Python's recursion limit is canonicalised, not refused with a
    RecursionError (defect #9), to the bytes the recursive reference writes where it can."""
    value: Any = 1.5
    opening: list[bytes] = []
    for level in range(depth):
        value = {"a": value} if level % 2 else [value]
        opening.append(b'{"a":' if level % 2 else b"[")
    closing = [b"}" if level % 2 else b"]" for level in range(depth)]
    expected = b"".join(reversed(opening)) + b"1.5" + b"".join(closing)
    assert canonical_bytes(value) == expected
    if depth <= 300:  # the recursive reference's own reach
        import rfc8785

        assert expected == rfc8785.dumps(value)


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param("cycle", id="a list that contains itself"),
        pytest.param({1: "x"}, id="a non-string key"),
        pytest.param({"\ud800": 1}, id="a lone surrogate key"),
        pytest.param(["\udc00"], id="a lone surrogate string"),
        pytest.param(float("inf"), id="infinity"),
        pytest.param({"n": 10**5000}, id="an integer over 4300 digits"),
        pytest.param([object()], id="an object"),
    ],
)
def test_payloads_without_a_json_form_are_invalid_payload_errors(payload: Any) -> None:
    """Each is InvalidPayloadError, never RecursionError, TypeError or UnicodeEncodeError."""
    if payload == "cycle":
        payload = []
        payload.append({"again": payload})
    with pytest.raises(InvalidPayloadError):
        canonical_bytes(payload)
