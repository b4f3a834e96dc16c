"""Policy: how long leases and records live, how results are stored, what counts as failure."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from .errors import ConfigurationError
from .serializers import JsonSerializer, Serializer

__all__ = ["Policy", "utcnow"]


def utcnow() -> datetime:
    """The current time as an aware UTC datetime: a clock to inject (the default is None,
    the store's own clock)."""
    return datetime.now(UTC)


@dataclass(frozen=True, kw_only=True, slots=True)
class Policy:
    """Configuration shared by every call through one `Idempotency` guard. Immutable.

    Args:
        lease: how long an attempt holds a key before a duplicate may take it over.
            Long work renews it (``attempt.renew()``).
        ttl: retention; a record may be purged this long after it was completed.
        lock_timeout: transactional mode: how long a duplicate waits on the first attempt's
            row lock before it is told the key is in progress.
        wait: if set, a call that finds the key in progress waits up to this long for the
            first attempt to finish and replays its result, instead of raising at once. A
            store that can tell when a record settles (memory, Redis, PostgreSQL) wakes the
            caller then; with the others it asks again every 50 ms.
        fail_on: exception types that are deterministic failures: stored and replayed (as
            `ReplayedFailureError`). Any other exception releases the key so a retry runs again.
        max_response_bytes: a larger result is refused with `ResponseTooLargeError`.
        serializer: turns results into stored bytes and back.
        clock: the current time (aware UTC), injected (tests, simulations): it then decides
            leases and retention on every store. None (the default): the store's own clock
            decides where it has one (PostgreSQL, MariaDB, Redis), else the host's.
        sleep: how to wait between polls (``wait``); None means the driver's own sleep
            (``time.sleep``, or ``asyncio.sleep`` in async code). Inject a fake clock's
            ``sleep`` in tests; in async code it may return an awaitable.

    >>> Policy(lease=timedelta(seconds=5)).replace(ttl=timedelta(hours=1)).ttl
    datetime.timedelta(seconds=3600)
    """

    lease: timedelta = timedelta(seconds=30)
    ttl: timedelta = timedelta(hours=24)
    lock_timeout: timedelta = timedelta(seconds=5)
    wait: timedelta | None = None
    fail_on: tuple[type[BaseException], ...] = ()
    max_response_bytes: int = 1024 * 1024
    serializer: Serializer = field(default_factory=JsonSerializer)
    clock: Callable[[], datetime] | None = None
    sleep: Callable[[float], object] | None = None

    def __post_init__(self) -> None:
        if self.lease <= timedelta(0) or self.ttl <= timedelta(0):
            raise ConfigurationError("lease and ttl must be positive")
        if self.max_response_bytes < 0:
            raise ConfigurationError("max_response_bytes cannot be negative")

    def now(self) -> datetime | None:
        """The injected clock's time, or None: the store's clock decides (SPEC §2 rule 9)."""
        clock = self.clock
        return None if clock is None else clock()

    def replace(self, **changes: Any) -> Policy:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)
