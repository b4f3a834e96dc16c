"""The record a store keeps per scope, and what an attempt to reserve it can find."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from .keys import Scope

__all__ = [
    "Acquired",
    "InProgress",
    "Mismatch",
    "Record",
    "Replay",
    "Reservation",
    "Status",
    "judge",
]


class Status(StrEnum):
    """The three states of a record; a released record simply no longer exists."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"


# Records and verdicts are made on every guarded call (a SQL or Redis store makes a Record
# of each row it reads): their __init__s set the fields through the slots, since a frozen
# dataclass's generated one goes through object.__setattr__ for each, about twice the cost.


@dataclass(frozen=True, slots=True, init=False)
class Record:
    """Everything a store keeps about one scope."""

    scope: Scope
    fingerprint: str
    status: Status
    token: int
    lease_expires_at: datetime | None
    response: bytes | None
    created_at: datetime
    updated_at: datetime
    expires_at: datetime
    recovery_point: str | None = None

    def __init__(
        self,
        scope: Scope,
        fingerprint: str,
        status: Status,
        token: int,
        lease_expires_at: datetime | None,
        response: bytes | None,
        created_at: datetime,
        updated_at: datetime,
        expires_at: datetime,
        recovery_point: str | None = None,
    ) -> None:
        _scope(self, scope)
        _fp(self, fingerprint)
        _status(self, status)
        _token(self, token)
        _lease(self, lease_expires_at)
        _response(self, response)
        _created(self, created_at)
        _updated(self, updated_at)
        _expires(self, expires_at)
        _point(self, recovery_point)


# The fields' slots, which Record's __init__ fills. (Unpacking fails at import if a field is
# added or removed without this line.)
_scope, _fp, _status, _token, _lease, _response, _created, _updated, _expires, _point = (
    Record.__dict__[name].__set__ for name in Record.__slots__
)


@dataclass(frozen=True, slots=True, init=False)
class Acquired:
    """The caller holds the key: execute, then complete, fail or release with ``token``.

    ``taken_over``: the reservation took over an attempt whose lease had ended (it crashed
    or outlived its lease), for observers (`idempo.events.Kind.TAKEN_OVER`); a store that
    cannot tell leaves it False (a takeover with a recovery point is known all the same).
    """

    token: int
    recovery_point: str | None = None
    taken_over: bool = False

    def __init__(
        self, token: int, recovery_point: str | None = None, taken_over: bool = False
    ) -> None:
        _set_token(self, token)
        _set_point(self, recovery_point)
        _set_taken_over(self, taken_over)


_set_token, _set_point, _set_taken_over = (
    Acquired.__dict__[name].__set__ for name in Acquired.__slots__
)


@dataclass(frozen=True, slots=True, init=False)
class Replay:
    """A completed or failed record with the same fingerprint: answer with its response."""

    record: Record

    def __init__(self, record: Record) -> None:
        _set_replayed(self, record)


_set_replayed = Replay.__dict__["record"].__set__


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The key is taken by a request with another fingerprint."""

    record: Record


@dataclass(frozen=True, slots=True)
class InProgress:
    """Another attempt holds a live lease; its lease ends in ``retry_after`` seconds."""

    retry_after: float


Reservation = Acquired | Replay | Mismatch | InProgress


def judge(record: Record, fingerprint: str, now: datetime) -> Replay | Mismatch | InProgress | None:
    """What an existing record means for a new attempt, or None if the attempt may take it over.

    Stores call this on the record their atomic reservation found; a None from a store that
    already tried to take over means it lost that race and should try again.
    """
    if record.expires_at <= now:
        return None
    if record.fingerprint != fingerprint:
        return Mismatch(record)
    if record.status is not Status.IN_PROGRESS:
        return Replay(record)
    lease_end = record.lease_expires_at
    if lease_end is None or lease_end <= now:
        return None
    return InProgress(retry_after=math.ceil((lease_end - now).total_seconds() * 1000) / 1000)
