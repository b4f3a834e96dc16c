"""SPEC §2 as a reference model: what every store must answer, given an explicit clock.

The model keeps one record per scope and, per scope, the largest token ever handed out, which
survives the record's deletion (rule 8). It predicts every answer exactly except the value of
a fresh token: stores draw tokens from a counter of their own (a sequence, a counter table,
Redis's TIME), so the model only demands that each one is larger than every token the scope
had before, and then adopts it.

Times follow the conformance suite: a reservation keeps the record until ``now + lease +
ttl``; a settle keeps it at least ``ttl`` after settling; a renewal extends the retention to
cover the new lease. A lease or retention that ends at ``now`` is over (``<=``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from idempo import Scope, Status
from idempo._core.record import Record


@dataclass(frozen=True)
class Acquire:
    """The model expects the store to hand the key over (with a token it cannot predict)."""


@dataclass(frozen=True)
class Refuse:
    """The model expects a replay, a mismatch or an in-progress answer."""

    kind: str  # "replay", "mismatch" or "in_progress"
    record: Record | None = None  # what a replay or mismatch carries
    retry_after: float | None = None  # an in-progress answer's


Expected = Acquire | Refuse


class TokenReused(AssertionError):
    """A store handed out a token not larger than one the scope already had (SPEC §2 rule 8)."""


class ReferenceStore:
    """One scope's records as SPEC §2 defines them; each verb applies what the spec says."""

    def __init__(self) -> None:
        self.records: dict[Scope, Record] = {}
        self.highest: dict[Scope, int] = {}  # the largest token each scope ever had

    # -- reservation ---------------------------------------------------------------------
    def expect_reserve(self, scope: Scope, fingerprint: str, now: datetime) -> Expected:
        """What a reservation at ``now`` must answer."""
        record = self.records.get(scope)
        if record is None or record.expires_at <= now:
            return Acquire()  # no record, or its retention is over: free for any payload
        if record.fingerprint != fingerprint:
            return Refuse("mismatch", record)
        if record.status is not Status.IN_PROGRESS:
            return Refuse("replay", record)
        assert record.lease_expires_at is not None
        if record.lease_expires_at > now:
            left = (record.lease_expires_at - now).total_seconds()
            return Refuse("in_progress", retry_after=math.ceil(left * 1000) / 1000)
        return Acquire()  # the same request after the lease ended: a takeover

    def acquired(
        self,
        scope: Scope,
        fingerprint: str,
        token: int,
        *,
        now: datetime,
        lease: timedelta,
        ttl: timedelta,
    ) -> None:
        """Adopt the token a store handed out for an expected `Acquire`, after checking it is
        larger than every token the scope had, deleted records' included."""
        before = self.highest.get(scope)
        if before is not None and token <= before:
            raise TokenReused(f"{scope}: token {token} after token {before} (rule 8)")
        self.highest[scope] = token
        old = self.records.get(scope)
        same_intent = old is not None and old.expires_at > now  # a takeover keeps the history
        self.records[scope] = Record(
            scope=scope,
            fingerprint=fingerprint,
            status=Status.IN_PROGRESS,
            token=token,
            lease_expires_at=now + lease,
            response=None,
            created_at=old.created_at if old is not None and same_intent else now,
            updated_at=now,
            expires_at=now + lease + ttl,
            recovery_point=old.recovery_point if old is not None and same_intent else None,
        )

    # -- fenced writes ---------------------------------------------------------------------
    def _holds(self, scope: Scope, token: int) -> Record | None:
        record = self.records.get(scope)
        if record is None or record.token != token or record.status is not Status.IN_PROGRESS:
            return None
        return record

    def settle(
        self,
        scope: Scope,
        token: int,
        status: Status,
        response: bytes,
        *,
        now: datetime,
        ttl: timedelta,
    ) -> bool:
        """Complete or fail: True if the store must accept it (and the model applies it).

        Accepted when ``token`` holds the IN_PROGRESS record, or when it is the same settle
        again (same token, status and response): that repeat changes nothing (decision 3).
        """
        record = self.records.get(scope)
        if record is not None and record.token == token and record.status is status:
            return record.response == response
        held = self._holds(scope, token)
        if held is None:
            return False
        self.records[scope] = replace(
            held,
            status=status,
            response=response,
            lease_expires_at=None,
            updated_at=now,
            expires_at=max(held.expires_at, now + ttl),
        )
        return True

    def renew(self, scope: Scope, token: int, *, now: datetime, lease: timedelta) -> bool:
        """True if the store must accept the renewal (and the model applies it)."""
        held = self._holds(scope, token)
        if held is None:
            return False
        until = now + lease
        self.records[scope] = replace(
            held, lease_expires_at=until, updated_at=now, expires_at=max(held.expires_at, until)
        )
        return True

    def release(self, scope: Scope, token: int) -> None:
        """Delete the reservation ``token`` holds; any other token is a no-op."""
        if self._holds(scope, token) is not None:
            del self.records[scope]

    # -- deletion --------------------------------------------------------------------------
    def delete(self, scope: Scope) -> bool:
        """The record is gone (evict, Redis expiry, an operator): True if there was one.
        The scope's highest token stays: the next one must still be larger."""
        return self.records.pop(scope, None) is not None

    def purgeable(self, before: datetime) -> set[Scope]:
        """The records purge may delete: retention over and no live lease by ``before``."""
        return {
            scope
            for scope, record in self.records.items()
            if record.expires_at <= before
            and (
                record.status is not Status.IN_PROGRESS
                or record.lease_expires_at is None
                or record.lease_expires_at <= before
            )
        }

    def stats(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for record in self.records.values():
            counts[record.status.value] = counts.get(record.status.value, 0) + 1
        return counts

    def deadlines(self, now: datetime) -> list[datetime]:
        """Every future instant at which some lease or retention ends, soonest first."""
        moments = {
            moment
            for record in self.records.values()
            for moment in (record.lease_expires_at, record.expires_at)
            if moment is not None and moment > now
        }
        return sorted(moments)
