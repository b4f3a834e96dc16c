"""A user's FastAPI, Flask and Django app passes ``mypy --strict`` (tests/typed_app/).

The app checks what a user's type checker must keep seeing: a decorated function's
parameters and return type (``assert_type``, and ``type: ignore`` comments that strict mode's
``warn_unused_ignores`` turns into failures once a check is lost), typed attempts and
handles, ``open_store``'s store and the middlewares' options. Remove the ``ParamSpec``
overloads of ``idempotent`` and this test fails with "Untyped decorator makes function
untyped" and ``assert_type`` errors.
"""

from __future__ import annotations

from pathlib import Path

from mypy import api

APP = Path(__file__).parent / "typed_app"
# Its own cache: the options differ from `make types`', and sharing one would thrash it.
CACHE = Path(__file__).parents[1] / ".mypy_cache" / "typed_app"


def test_the_typed_app_passes_mypy_strict() -> None:
    out, err, status = api.run(
        ["--config-file", str(APP / "mypy.ini"), "--cache-dir", str(CACHE), str(APP)]
    )
    assert status == 0, out + err
    assert "no issues found" in out
