"""Downstream and saga step keys: deterministic, distinct, always valid keys."""

from __future__ import annotations

import re
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempo import InvalidKeyError, derive_key, step_key, validate_key
from idempo._core.keys import DERIVE_NAMESPACE, STEP_NAMESPACE, Scope

PRINTABLE = st.characters(min_codepoint=0x21, max_codepoint=0x7E)
keys = st.text(PRINTABLE, min_size=1, max_size=255)
labels = st.text(min_size=1, max_size=80)
steps = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"),
    min_size=1,
    max_size=40,
)

PROPERTY = settings(max_examples=200, deadline=None)


@PROPERTY
@given(keys, labels)
def test_derive_key_is_deterministic_and_a_valid_uuid5_key(parent: str, label: str) -> None:
    """The same parent and label give the same key every time, a valid key and a UUIDv5."""
    key = derive_key(parent, label)
    assert key == derive_key(parent, label)
    assert validate_key(key) == key
    assert uuid.UUID(key).version == 5


@PROPERTY
@given(keys, labels, labels)
def test_distinct_labels_give_distinct_keys(parent: str, first: str, second: str) -> None:
    """Two downstream calls of one intent never share a key."""
    if first != second:
        assert derive_key(parent, first) != derive_key(parent, second)


@PROPERTY
@given(keys, keys, labels)
def test_distinct_parents_give_distinct_keys(first: str, second: str, label: str) -> None:
    """The same downstream call made for two intents never shares a key."""
    if first != second:
        assert derive_key(first, label) != derive_key(second, label)


@PROPERTY
@given(st.text(PRINTABLE, min_size=1, max_size=40), st.text(PRINTABLE, min_size=1, max_size=40))
def test_moving_the_boundary_between_parent_and_label_changes_the_key(
    left: str, right: str
) -> None:
    """("a:b", "c") and ("a", "b:c") are different pairs and get different keys."""
    assert derive_key(left + ":" + right, "x") != derive_key(left, ":" + right + "x")
    assert derive_key(left + right[0], right[1:] or "y") != derive_key(left, right + "y")


def test_derived_keys_never_change_between_versions() -> None:
    """Known inputs keep their keys, so a deploy never gives an intent in flight a new one."""
    assert str(DERIVE_NAMESPACE) == "01ea8efc-2f92-5b98-9291-8509c8ea3fb4"
    assert str(STEP_NAMESPACE) == "71195008-5794-52e8-91b0-75ffb5a392d8"
    assert derive_key("order-42", "psp.charge") == "34980a23-113f-5584-a264-b86070b79a74"
    assert step_key("s" * 251, "step") == "5f4e5fa4-dacd-5f7c-b93d-5492f09a0a5e"


@pytest.mark.parametrize(
    ("parent", "label"),
    [("", "psp"), ("has space", "psp"), ("x" * 256, "psp"), ("order-42", ""), (42, "psp")],
)
def test_derive_key_refuses_what_is_not_a_key_or_label(parent: object, label: str) -> None:
    """An invalid parent key or an empty label raises InvalidKeyError."""
    with pytest.raises(InvalidKeyError):
        derive_key(parent, label)  # type: ignore[arg-type]


@PROPERTY
@given(keys, steps)
def test_step_key_is_readable_when_it_fits_and_always_valid(saga: str, step: str) -> None:
    """``saga_id:step`` when it fits in 255 characters, else a UUIDv5; valid and stable."""
    key = step_key(saga, step)
    assert validate_key(key) == key == step_key(saga, step)
    if len(saga) + 1 + len(step) <= 255:
        assert key == f"{saga}:{step}"
        assert key.rsplit(":", 1) == [saga, step]
    else:
        assert uuid.UUID(key).version == 5


@PROPERTY
@given(keys, steps, keys, steps)
def test_distinct_saga_steps_get_distinct_keys(s1: str, p1: str, s2: str, p2: str) -> None:
    """Two different (saga, step) pairs never share a key, readable or not."""
    if (s1, p1) != (s2, p2):
        assert step_key(s1, p1) != step_key(s2, p2)


@pytest.mark.parametrize(
    ("saga", "step"),
    [("saga-1", "a:b"), ("saga-1", ""), ("saga-1", "two words"), ("", "reserve")],
)
def test_step_key_refuses_bad_parts(saga: str, step: str) -> None:
    """A step with ':' or spaces, an empty step or an invalid saga id raises InvalidKeyError."""
    with pytest.raises(InvalidKeyError):
        step_key(saga, step)


@given(
    st.one_of(st.from_regex(r"[!-~]{1,255}", fullmatch=True), st.text(), st.integers(), st.none()),
    st.text(),
    st.text(),
)
def test_scope_of_validates_and_makes_a_frozen_dataclass(
    key: object, operation: str, principal: str
) -> None:
    """`Scope.of` raises `validate_key`'s error for a key it refuses, else makes, through
    Scope's own __init__ (it fills the slots, for speed), what the dataclass's would: the
    fields, equal and hashed as their tuple, the dataclass's repr, frozen."""
    import dataclasses

    try:
        checked = validate_key(key)  # type: ignore[arg-type]
    except InvalidKeyError as refused:
        with pytest.raises(InvalidKeyError, match=re.escape(str(refused))):
            Scope.of(key, operation=operation, principal=principal)  # type: ignore[arg-type]
        return
    made = Scope.of(key, operation=operation, principal=principal)  # type: ignore[arg-type]
    fields = (principal, operation, checked)
    assert (made.principal, made.operation, made.key) == fields
    assert made == Scope(*fields)
    assert hash(made) == hash(fields)
    assert repr(made) == f"Scope(principal={principal!r}, operation={operation!r}, key={checked!r})"
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.key = "other"  # type: ignore[misc]
