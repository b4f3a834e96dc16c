"""When a client sends a guarded request again: the retry rules, written once, without I/O.

The flow yields what to do next (`Send` an attempt, `Wait`) and receives each attempt's
outcome; the sync and async httpx transports in `idempo.client` only carry it out.

    Send ─► Answer(status) ── retryable status? ─ no ──► stop: the answer stands
      ▲        Error ──────── transient? ─────── no ──► stop: the error stands
      │                            │ yes
      └── Wait ◄── Retry-After, else full-jitter backoff; stop instead when the attempts are
                   used up or the wait would pass the deadline
"""

from __future__ import annotations

import dataclasses
import math
import random as _random
import time
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Any

from .._wire import KEY_HEADER, PROBLEM_TYPE_BASE
from ..errors import ConfigurationError
from ..policy import utcnow

__all__ = ["RetryPolicy"]

# Statuses no policy may retry: with the same key the server can only answer them again.
NEVER_RETRIED = frozenset({400, 422})

# The problem types (RFC 9457) that say what an answer means whatever its status, for servers
# on either convention of SPEC §4: "in progress" as 409 or 202, "same key, another request"
# as 422 or 409.
IN_PROGRESS_PROBLEM = PROBLEM_TYPE_BASE + "request-in-progress"
MISMATCH_PROBLEM = PROBLEM_TYPE_BASE + "fingerprint-mismatch"


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    """How an idempotent client retries a guarded request. Immutable.

    Args:
        max_attempts: attempts per logical request, the first included.
        deadline: seconds from the first attempt after which no attempt starts, no wait runs
            past, and each attempt's timeouts are cut to the time left. None: no deadline.
        backoff_base: the first retry waits up to this many seconds; each one after up to
            twice as long (full jitter: uniformly random between 0 and that bound).
        backoff_max: the bound stops growing here.
        retry_statuses: statuses answered by sending again. 400 and 422 are refused here:
            the same key can only get the same answer.
        retry_after_required: statuses retried only when they carry ``Retry-After``: a 409
            with one is idempo's "in progress"; without one it is the app's own conflict.
            Whatever the statuses, an idempo ``request-in-progress`` problem (409, or 202
            from a server that answers "in progress" with 202 Accepted) is retried, and a
            ``fingerprint-mismatch`` one (422, or 409) never is.
        max_retry_after: a longer ``Retry-After`` ends the retries; the answer is returned.
        retry_errors: exception types that are transient. None: the transport's own set
            (for httpx: timeouts, network errors, a connection closed without an answer).
        methods: methods that are keyed and retried; any other request passes through.
        header: the request header that carries the key.
        max_body_bytes: a streamed request body is read into memory once, up to this size,
            so every attempt sends the same bytes; a larger one is refused.
        sleep: how to wait; None is ``time.sleep``, or ``anyio.sleep`` in async code, where an
            injected one may return an awaitable.
        clock: monotonic seconds, for the deadline.
        wall_clock: the current time, for a ``Retry-After`` date on an answer without ``Date``.
        random: uniform floats in [0, 1), for the jitter.

    >>> RetryPolicy(max_attempts=3).replace(deadline=None).deadline is None
    True

    .. versionadded:: 0.1
    """

    max_attempts: int = 5
    deadline: float | None = 30.0
    backoff_base: float = 0.1
    backoff_max: float = 5.0
    retry_statuses: Collection[int] = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
    retry_after_required: Collection[int] = frozenset({409})
    max_retry_after: float = 60.0
    retry_errors: tuple[type[BaseException], ...] | None = None
    methods: Collection[str] = frozenset({"POST", "PATCH"})
    header: str = KEY_HEADER
    max_body_bytes: int = 10 * 1024 * 1024
    sleep: Callable[[float], object] | None = None
    clock: Callable[[], float] = time.monotonic
    wall_clock: Callable[[], datetime] = utcnow
    random: Callable[[], float] = _random.random

    def __post_init__(self) -> None:
        # Normalised so that membership tests are cheap and case-insensitive for methods.
        object.__setattr__(self, "retry_statuses", frozenset(self.retry_statuses))
        object.__setattr__(self, "retry_after_required", frozenset(self.retry_after_required))
        object.__setattr__(self, "methods", frozenset(m.upper() for m in self.methods))
        if self.max_attempts < 1:
            raise ConfigurationError("max_attempts must be at least 1")
        if self.deadline is not None and self.deadline <= 0:
            raise ConfigurationError("deadline must be positive, or None for no deadline")
        if self.backoff_base < 0 or self.backoff_max < 0 or self.max_retry_after < 0:
            raise ConfigurationError("backoff and max_retry_after cannot be negative")
        if self.max_body_bytes < 0:
            raise ConfigurationError("max_body_bytes cannot be negative")
        if refused := sorted(NEVER_RETRIED & frozenset(self.retry_statuses)):
            raise ConfigurationError(
                f"status {refused[0]} is never retried: the same key gets the same answer"
            )

    def replace(self, **changes: Any) -> RetryPolicy:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True, slots=True)
class Send:
    """Make attempt ``number``; ``time_left`` is what remains of the deadline, if any."""

    number: int
    time_left: float | None


@dataclass(frozen=True, slots=True)
class Wait:
    seconds: float


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    retry_after: float | None = None
    problem: str | None = None  # the ``type`` of an application/problem+json answer


@dataclass(frozen=True, slots=True)
class Error:
    transient: bool


RetryFlow = Generator[Send | Wait, Answer | Error | None, int]


def retry_flow(policy: RetryPolicy) -> RetryFlow:
    """Attempts and waits for one logical request; returns the number of attempts made."""
    ends = None if policy.deadline is None else policy.clock() + policy.deadline
    number, time_left = 1, policy.deadline
    while True:
        outcome = yield Send(number, time_left)
        delay = next_delay(policy, outcome, number)
        if delay is None or number >= policy.max_attempts:
            return number
        if ends is not None and policy.clock() + delay >= ends:
            return number  # the wait would end past the deadline: the last outcome stands
        yield Wait(delay)
        if ends is not None:
            time_left = ends - policy.clock()
            if time_left <= 0:  # the sleep overran
                return number
        number += 1


def next_delay(policy: RetryPolicy, outcome: Answer | Error | None, retries: int) -> float | None:
    """Seconds to wait before sending again after ``outcome``, or None to stop."""
    match outcome:
        case Error(transient=True):
            return backoff(policy, retries)
        case Answer(problem=problem) if problem == MISMATCH_PROBLEM:
            return None
        case Answer(status=202, retry_after=retry_after, problem=problem) if (
            problem == IN_PROGRESS_PROBLEM
        ):
            if retry_after is None:
                return backoff(policy, retries)
            return retry_after if retry_after <= policy.max_retry_after else None
        case Answer(status, retry_after) if status in policy.retry_statuses:
            if retry_after is not None:
                return retry_after if retry_after <= policy.max_retry_after else None
            if status in policy.retry_after_required:
                return None
            return backoff(policy, retries)
    return None


def backoff(policy: RetryPolicy, retries: int) -> float:
    """Full jitter: uniform in [0, min(max, base * 2**(retries - 1)))."""
    bound = min(policy.backoff_max, policy.backoff_base * 2.0 ** min(retries - 1, 64))
    return policy.random() * bound


def parse_retry_after(
    value: str | None, *, date: str | None = None, now: Callable[[], datetime] = utcnow
) -> float | None:
    """Seconds a ``Retry-After`` value asks for, or None if absent or unreadable.

    An HTTP date is read against the answer's own ``Date`` (no clock skew) when it has one.

    >>> parse_retry_after("120")
    120.0
    >>> parse_retry_after("Wed, 21 Oct 2026 07:28:05 GMT", date="Wed, 21 Oct 2026 07:28:00 GMT")
    5.0
    """
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        return seconds if math.isfinite(seconds) and seconds >= 0 else None
    when = _http_date(value)
    if when is None:
        return None
    return max(0.0, (when - (_http_date(date) or now())).total_seconds())


def _http_date(value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when if when.tzinfo else when.replace(tzinfo=UTC)
