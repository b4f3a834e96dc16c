"""`_Decorated.arguments` matches a call's arguments without ``Signature.bind`` where it can:
for generated signatures and calls, it gives what ``bind`` + ``apply_defaults`` give, or
raises the TypeError ``bind`` raises."""

from __future__ import annotations

import inspect
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from idempo.guard import _Decorated

KINDS = [
    inspect.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.KEYWORD_ONLY,
    inspect.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.VAR_POSITIONAL,
    inspect.Parameter.VAR_KEYWORD,
]
NAMES = ["a", "b", "c", "d", "e"]


@st.composite
def signatures(draw: Any) -> inspect.Signature:
    count = draw(st.integers(1, len(NAMES)))
    kinds = sorted(draw(st.lists(st.sampled_from(KINDS), min_size=count, max_size=count)))
    params, defaulted = [], False
    for name, kind in zip(NAMES, kinds, strict=False):
        if kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if any(p.kind is kind for p in params):
                continue
            params.append(inspect.Parameter(name, kind))
            continue
        # A default, once given, for every later positional parameter (Python's rule).
        positional = kind is not inspect.Parameter.KEYWORD_ONLY
        defaulted = draw(st.booleans()) or (defaulted and positional)
        default = draw(st.integers(0, 9)) if defaulted else inspect.Parameter.empty
        params.append(inspect.Parameter(name, kind, default=default))
    return inspect.Signature(params)


def decorated(signature: inspect.Signature) -> _Decorated:
    def fn(*args: Any, **kwargs: Any) -> None: ...

    fn.__signature__ = signature  # type: ignore[attr-defined]
    return _Decorated(
        fn,
        key=lambda *a, **k: "k",
        operation="op",
        payload=None,
        principal="",
        conn=None,
        serializer=None,
        renew_every=None,
    )


@settings(max_examples=400, deadline=None)
@given(
    signatures(),
    st.lists(st.integers(10, 99), max_size=6),
    st.dictionaries(st.sampled_from([*NAMES, "z"]), st.integers(10, 99), max_size=5),
)
def test_arguments_are_what_bind_gives(
    signature: inspect.Signature, args: list[int], kwargs: dict[str, int]
) -> None:
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError:
        expected: Any = TypeError
    else:
        bound.apply_defaults()
        expected = list(bound.arguments.items())
    try:
        got: Any = list(decorated(signature).arguments(tuple(args), kwargs).items())
    except TypeError:
        got = TypeError
    assert got == expected
