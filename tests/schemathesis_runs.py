"""One bounded schemathesis exploration of an API operation, shared by the tests that run
one (the example API over real HTTP, FastAPI apps in process): no 5xx, and every answer
conforms to the operation's OpenAPI document.

Driven by hand rather than by schemathesis' pytest plugin, which does not run on pytest 9
(it reads a private attribute pytest dropped).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from schemathesis.checks import positive_data_acceptance


def explore(operation: Any, examples: int, *, without_headers: Sequence[str] = ()) -> None:
    """Send ``examples`` generated requests to ``operation``, each checked by schemathesis.

    ``without_headers`` are never sent (an API's own knobs, not inputs to explore).
    """

    @given(case=operation.as_strategy())
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def conforms(case: Any) -> None:
        for name in without_headers:
            if case.headers:
                case.headers.pop(name, None)
        # Not "positive data is accepted": a schema-valid request may rightly be refused (a
        # declined card's 402, or 422 for a key hypothesis already used with another body).
        case.call_and_validate(excluded_checks=[positive_data_acceptance])

    conforms()
