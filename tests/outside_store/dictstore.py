"""A store written outside idempo, on the public SPI only: records in a dict, for one process.

docs/extending.md shows this file as its worked example (a test keeps the two the same);
test_dictstore.py runs idempo's store contract on it, and ``dict://`` opens it once it is
registered (``register("dict", KIND)``, or the entry point ``dict = "dictstore:KIND"``).
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

from idempo.stores.spi import (
    Acquired,
    ConfigurationError,
    FencedError,
    Record,
    Reservation,
    Scope,
    Status,
    StoreKind,
    judge,
)


class DictStore:
    """Records in a dict behind one lock: every verb is atomic, so is the reservation."""

    def __init__(self) -> None:
        self._records: dict[Scope, Record] = {}
        self._lock = threading.Lock()
        self._tokens = itertools.count(1)  # one counter for every scope: tokens never repeat

    @classmethod
    def from_url(cls, url: str, **options: Any) -> DictStore:
        """``dict://``: a new, empty store (there is nothing else to say in the URL)."""
        if url != "dict://" or options:
            raise ConfigurationError(f"dict:// takes no host, path or options, got {url!r}")
        return cls()

    def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation:
        now = now or datetime.now(UTC)  # no clock of its own: the host's
        with self._lock:
            found = self._records.get(scope)
            if found is not None and (answer := judge(found, fingerprint, now)) is not None:
                return answer
            token = next(self._tokens)
            if found is not None and found.expires_at > now:  # an expired lease: take over
                record = replace(
                    found,
                    token=token,
                    lease_expires_at=now + lease,
                    updated_at=now,
                    expires_at=max(found.expires_at, now + lease),
                )
            else:  # a new intent (or one past its retention)
                record = Record(
                    scope=scope,
                    fingerprint=fingerprint,
                    status=Status.IN_PROGRESS,
                    token=token,
                    lease_expires_at=now + lease,
                    response=None,
                    created_at=now,
                    updated_at=now,
                    expires_at=now + lease + ttl,
                )
            self._records[scope] = record
            return Acquired(token, record.recovery_point)

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._settle(scope, token, Status.COMPLETED, response, now, ttl)

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._settle(scope, token, Status.FAILED, response, now, ttl)

    def _settle(
        self,
        scope: Scope,
        token: int,
        status: Status,
        response: bytes,
        now: datetime | None,
        ttl: timedelta,
    ) -> None:
        now = now or datetime.now(UTC)
        with self._lock:
            record = self._records.get(scope)
            if record is not None and record.token == token:
                if record.status is Status.IN_PROGRESS:
                    self._records[scope] = replace(
                        record,
                        status=status,
                        response=response,
                        lease_expires_at=None,
                        updated_at=now,
                        expires_at=max(record.expires_at, now + ttl),
                    )
                    return
                if (record.status, record.response) == (status, response):
                    return  # the same settle again (a retry whose reply was lost): no change
            raise FencedError(f"{scope}: token {token} does not hold the lease")

    def release(self, scope: Scope, token: int) -> None:
        with self._lock:
            record = self._records.get(scope)
            if record is not None and record.token == token and record.status is Status.IN_PROGRESS:
                del self._records[scope]

    def renew(self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta) -> None:
        now = now or datetime.now(UTC)
        with self._lock:
            record = self._records.get(scope)
            if record is None or record.token != token or record.status is not Status.IN_PROGRESS:
                raise FencedError(f"{scope}: token {token} does not hold the lease")
            self._records[scope] = replace(
                record,
                lease_expires_at=now + lease,
                updated_at=now,
                expires_at=max(record.expires_at, now + lease),  # retention outlives the lease
            )

    def get(self, scope: Scope) -> Record | None:
        with self._lock:
            return self._records.get(scope)

    def evict(self, scope: Scope) -> bool:
        with self._lock:
            return self._records.pop(scope, None) is not None

    def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        before = before or datetime.now(UTC)
        with self._lock:
            doomed = [
                scope
                for scope, record in self._records.items()
                if record.expires_at <= before
                and (record.lease_expires_at is None or record.lease_expires_at <= before)
            ][:limit]
            for scope in doomed:
                del self._records[scope]
            return len(doomed)

    def stats(self) -> dict[str, int]:
        with self._lock:
            states = [record.status.value for record in self._records.values()]
        return {status.value: states.count(status.value) for status in Status}

    def close(self) -> None:
        pass


class AsyncDictStore:
    """The same records behind awaited verbs: a dict never blocks the event loop."""

    def __init__(self, store: DictStore | None = None) -> None:
        self.sync = store or DictStore()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> AsyncDictStore:
        return cls(DictStore.from_url(url, **options))

    async def reserve(self, scope: Scope, fingerprint: str, **when: Any) -> Reservation:
        return self.sync.reserve(scope, fingerprint, **when)

    async def complete(self, scope: Scope, token: int, response: bytes, **when: Any) -> None:
        self.sync.complete(scope, token, response, **when)

    async def fail(self, scope: Scope, token: int, response: bytes, **when: Any) -> None:
        self.sync.fail(scope, token, response, **when)

    async def release(self, scope: Scope, token: int) -> None:
        self.sync.release(scope, token)

    async def renew(self, scope: Scope, token: int, **when: Any) -> None:
        self.sync.renew(scope, token, **when)

    async def get(self, scope: Scope) -> Record | None:
        return self.sync.get(scope)

    async def evict(self, scope: Scope) -> bool:
        return self.sync.evict(scope)

    async def purge(self, **which: Any) -> int:
        return self.sync.purge(**which)

    async def stats(self) -> dict[str, int]:
        return self.sync.stats()

    async def aclose(self) -> None:
        self.sync.close()


KIND = StoreKind(open=DictStore.from_url, open_async=AsyncDictStore.from_url)
"""What ``dict://`` opens: ``register("dict", KIND)`` or an ``idempo.stores`` entry point."""
