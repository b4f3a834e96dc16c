"""What the optional ``scan`` verb of a store is asked for: a bounded, filtered listing.

Operators find stuck keys with it (`idempo.admin`, ``idempo list``); the hot paths never call
it. Every store that has the verb takes the same keyword arguments and builds one of these,
so the checks and the matching are written once.

    >>> where = ScanFilter(status=Status.IN_PROGRESS, limit=10)
    >>> where.status.value, where.limit
    ('in_progress', 10)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from .._core.record import Record, Status
from ..errors import ConfigurationError

__all__ = ["MAX_SCAN", "ScanFilter"]

MAX_SCAN = 10_000
"""The most records one scan returns: a listing is for people and tools, not a dump."""


@dataclass(frozen=True, slots=True)
class ScanFilter:
    """Which records a scan returns: all of the filters given hold, at most ``limit`` of them.

    Args:
        status: only records in this state.
        operation: only records of this operation (exactly).
        principal: only records of this principal (exactly; ``""`` is anonymous).
        created_before: only records created at or before this instant (aware), so
            ``created_before=now - 5 min`` with ``status=IN_PROGRESS`` finds keys in
            progress for more than five minutes.
        limit: at most this many records, 1 to `MAX_SCAN`.
    """

    status: Status | None = None
    operation: str | None = None
    principal: str | None = None
    created_before: datetime | None = None
    limit: int = 100

    def __post_init__(self) -> None:
        if isinstance(self.limit, bool) or not isinstance(self.limit, int):
            raise ConfigurationError(f"a scan's limit is a number of records, not {self.limit!r}")
        if not 1 <= self.limit <= MAX_SCAN:
            raise ConfigurationError(f"a scan's limit must be 1 to {MAX_SCAN}, got {self.limit}")
        if self.status is not None and not isinstance(self.status, Status):
            raise ConfigurationError(f"a scan's status is a Status, not {self.status!r}")
        when = self.created_before
        if when is not None and (not isinstance(when, datetime) or when.tzinfo is None):
            raise ConfigurationError("a scan's created_before must be an aware datetime")

    def matches(self, record: Record) -> bool:
        """Whether ``record`` passes every filter (the stores that filter in Python)."""
        scope = record.scope
        return (
            (self.status is None or record.status is self.status)
            and (self.operation is None or scope.operation == self.operation)
            and (self.principal is None or scope.principal == self.principal)
            and (self.created_before is None or record.created_at <= self.created_before)
        )


def oldest(records: list[Record], limit: int) -> list[Record]:
    """The ``limit`` oldest of ``records``, oldest first (ties by scope, so it is stable)."""
    records.sort(key=lambda r: (r.created_at, r.scope.principal, r.scope.operation, r.scope.key))
    return records[:limit]
