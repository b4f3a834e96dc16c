"""In-process store: a dict behind a lock. For tests, demos and single-process apps.

Safe under threads and asyncio tasks; nothing survives the process.
"""

from __future__ import annotations

import dataclasses
import threading
from datetime import datetime, timedelta

from .._keys import Scope
from .._record import Acquired, Record, Reservation, Status, judge
from ..errors import FencedError

__all__ = ["AsyncMemoryStore", "MemoryStore"]


class MemoryStore:
    """A `Store` kept in this process's memory.

    >>> from datetime import UTC, datetime, timedelta
    >>> store = MemoryStore()
    >>> scope = Scope("", "charge", "k1")
    >>> now = datetime.now(UTC)
    >>> store.reserve(scope, "fp", now=now, lease=timedelta(seconds=5), ttl=timedelta(hours=1))
    Acquired(token=1, recovery_point=None)
    """

    def __init__(self) -> None:
        self._records: dict[Scope, Record] = {}
        self._lock = threading.Lock()

    def reserve(
        self, scope: Scope, fingerprint: str, *, now: datetime, lease: timedelta, ttl: timedelta
    ) -> Reservation:
        with self._lock:
            current = self._records.get(scope)
            if current is not None:
                verdict = judge(current, fingerprint, now)
                if verdict is not None:
                    return verdict
            token = 1 if current is None else current.token + 1
            keeps_history = current is not None and current.expires_at > now
            self._records[scope] = Record(
                scope=scope,
                fingerprint=fingerprint,
                status=Status.IN_PROGRESS,
                token=token,
                lease_expires_at=now + lease,
                response=None,
                created_at=current.created_at if current and keeps_history else now,
                updated_at=now,
                expires_at=now + lease + ttl,
                recovery_point=current.recovery_point if current and keeps_history else None,
            )
            return Acquired(token=token, recovery_point=self._records[scope].recovery_point)

    def _held(self, scope: Scope, token: int) -> Record:
        record = self._records.get(scope)
        if record is None or record.token != token or record.status is not Status.IN_PROGRESS:
            raise FencedError(f"key {scope.key!r}: token {token} is stale")
        return record

    def _settle(
        self,
        scope: Scope,
        token: int,
        status: Status,
        response: bytes,
        now: datetime,
        ttl: timedelta,
    ) -> None:
        with self._lock:
            record = self._held(scope, token)
            self._records[scope] = dataclasses.replace(
                record,
                status=status,
                response=bytes(response),
                lease_expires_at=None,
                updated_at=now,
                expires_at=max(record.expires_at, now + ttl),
            )

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        self._settle(scope, token, Status.COMPLETED, response, now, ttl)

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        self._settle(scope, token, Status.FAILED, response, now, ttl)

    def release(self, scope: Scope, token: int) -> None:
        with self._lock:
            record = self._records.get(scope)
            if record and record.token == token and record.status is Status.IN_PROGRESS:
                del self._records[scope]

    def renew(self, scope: Scope, token: int, *, now: datetime, lease: timedelta) -> None:
        with self._lock:
            record = self._held(scope, token)
            until = now + lease
            self._records[scope] = dataclasses.replace(
                record,
                lease_expires_at=until,
                updated_at=now,
                expires_at=max(record.expires_at, until),
            )

    def get(self, scope: Scope) -> Record | None:
        with self._lock:
            return self._records.get(scope)

    def purge(self, *, before: datetime, limit: int = 1000) -> int:
        with self._lock:
            doomed = [
                scope
                for scope, record in self._records.items()
                if record.expires_at <= before
                and (record.status is not Status.IN_PROGRESS or _lease_over(record, before))
            ][:limit]
            for scope in doomed:
                del self._records[scope]
            return len(doomed)

    def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        with self._lock:
            counts: dict[str, int] = {}
            for record in self._records.values():
                counts[record.status.value] = counts.get(record.status.value, 0) + 1
            return counts

    def close(self) -> None:
        pass


def _lease_over(record: Record, before: datetime) -> bool:
    return record.lease_expires_at is None or record.lease_expires_at <= before


class AsyncMemoryStore:
    """The asynchronous face of `MemoryStore`. Its verbs never block, so they run inline."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.sync = store or MemoryStore()

    async def reserve(
        self, scope: Scope, fingerprint: str, *, now: datetime, lease: timedelta, ttl: timedelta
    ) -> Reservation:
        return self.sync.reserve(scope, fingerprint, now=now, lease=lease, ttl=ttl)

    async def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        self.sync.complete(scope, token, response, now=now, ttl=ttl)

    async def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        self.sync.fail(scope, token, response, now=now, ttl=ttl)

    async def release(self, scope: Scope, token: int) -> None:
        self.sync.release(scope, token)

    async def renew(self, scope: Scope, token: int, *, now: datetime, lease: timedelta) -> None:
        self.sync.renew(scope, token, now=now, lease=lease)

    async def get(self, scope: Scope) -> Record | None:
        return self.sync.get(scope)

    async def purge(self, *, before: datetime, limit: int = 1000) -> int:
        return self.sync.purge(before=before, limit=limit)

    async def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        return self.sync.stats()

    async def aclose(self) -> None:
        pass
