"""The operations on a record, as values: what the flow asks for and the stores carry out.

Passing one value instead of five arguments keeps every layer's signatures short and alike.
They are made and read on every guarded call and never changed, so they are plain slotted
dataclasses: a frozen one spends about a microsecond more per instance on its setattr guard.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from ._keys import Scope
from ._record import Status


@dataclass(slots=True)
class Reserve:
    """Take the key, or learn what holds it."""

    scope: Scope
    fingerprint: str
    now: datetime
    lease: timedelta
    ttl: timedelta


@dataclass(slots=True)
class Settle:
    """Store the outcome: COMPLETED or FAILED, fenced on ``token``."""

    scope: Scope
    token: int
    status: Status
    response: bytes
    now: datetime
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
    now: datetime
    lease: timedelta
