"""The operations on a record, as values: what the flow asks for and the stores carry out.

Passing one value instead of five arguments keeps every layer's signatures short and alike.
``now`` None means the store's clock (SPEC §2 rule 9); a datetime is a clock the app injected.
They are made and read on every guarded call and never changed, so they are plain slotted
dataclasses: a frozen one spends about a microsecond more per instance on its setattr guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from .keys import Scope
from .record import Status


@dataclass(slots=True)
class Reserve:
    """Take the key, or learn what holds it. ``lock_timeout``: at most this long waiting on
    another attempt's row lock (a caller with a deadline); None: the unit's own bound."""

    scope: Scope
    fingerprint: str
    now: datetime | None
    lease: timedelta
    ttl: timedelta
    lock_timeout: timedelta | None = None


@dataclass(slots=True)
class Settle:
    """Store the outcome: COMPLETED or FAILED, fenced on ``token``."""

    scope: Scope
    token: int
    status: Status
    response: bytes
    now: datetime | None
    ttl: timedelta


@dataclass(slots=True)
class Release:
    """Give the key up so a retry executes again; fenced on ``token``."""

    scope: Scope
    token: int


@dataclass(slots=True)
class Renew:
    """Extend the lease to ``now + lease``; fenced on ``token``."""

    scope: Scope
    token: int
    now: datetime | None
    lease: timedelta


@dataclass(slots=True)
class Checkpoint:
    """Record ``point`` (the steps the work committed, and their state) as the record's
    recovery point and extend the lease to ``now + lease``; fenced on ``token``. A point of
    None keeps the one stored; a lease of zero ends the lease at once: a retry takes over and
    resumes there."""

    scope: Scope
    token: int
    point: str | None
    now: datetime | None
    lease: timedelta


@dataclass(slots=True)
class Discard:
    """Throw the work's writes away (a rollback to the unit's savepoint); the result is True
    when none of them can commit any more. A store used directly has nothing to discard."""


StoreOp = Reserve | Settle | Release | Renew | Checkpoint | Discard
