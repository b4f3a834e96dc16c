"""In-process store: a dict behind a lock. For tests, demos and single-process apps.

Safe under threads and asyncio tasks; nothing survives the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
from collections.abc import Callable
from datetime import datetime, timedelta

from .._core.digest import key_ref
from .._core.keys import Scope
from .._core.record import Acquired, Record, Reservation, Status, judge
from ..errors import FencedError
from . import _clock
from ._scan import ScanFilter, oldest

_NO_TIME = timedelta(0)

__all__ = ["AsyncMemoryStore", "MemoryStore"]


class _Entry:
    """A record as the store keeps it: changed in place under the store's lock.

    The frozen `Record` handed out (to a replay, `get`) is made only when asked for and kept
    until the next change: building a frozen record costs more than the rest of a verb, and
    most records are never read back.
    """

    __slots__ = (
        "_record",
        "created_at",
        "expires_at",
        "fingerprint",
        "lease_expires_at",
        "recovery_point",
        "response",
        "scope",
        "status",
        "token",
        "updated_at",
    )

    def __init__(
        self,
        scope: Scope,
        fingerprint: str,
        token: int,
        lease_expires_at: datetime,
        created_at: datetime,
        now: datetime,
        expires_at: datetime,
        recovery_point: str | None,
    ) -> None:
        self.scope = scope
        self.fingerprint = fingerprint
        self.status = Status.IN_PROGRESS
        self.token = token
        self.lease_expires_at: datetime | None = lease_expires_at
        self.response: bytes | None = None
        self.created_at = created_at
        self.updated_at = now
        self.expires_at = expires_at
        self.recovery_point = recovery_point
        self._record: Record | None = None

    def record(self) -> Record:
        if self._record is None:
            self._record = Record(
                self.scope,
                self.fingerprint,
                self.status,
                self.token,
                self.lease_expires_at,
                self.response,
                self.created_at,
                self.updated_at,
                self.expires_at,
                self.recovery_point,
            )
        return self._record

    def lease_over(self, before: datetime) -> bool:
        return self.lease_expires_at is None or self.lease_expires_at <= before


class MemoryStore:
    """A `Store` kept in this process's memory.

    ``now=None`` (and ``purge(before=None)``) means the host's clock: the store has no other.
    Tokens come from one counter for the whole store, so a scope's tokens keep growing when
    its record is deleted and made again.

    >>> from datetime import UTC, datetime, timedelta
    >>> store = MemoryStore()
    >>> scope = Scope("", "charge", "k1")
    >>> now = datetime.now(UTC)
    >>> store.reserve(scope, "fp", now=now, lease=timedelta(seconds=5), ttl=timedelta(hours=1))
    Acquired(token=1, recovery_point=None, taken_over=False)
    """

    def __init__(self) -> None:
        self._entries: dict[Scope, _Entry] = {}
        self._lock = threading.Lock()
        # Every token this store ever handed out is below the next one, whatever was deleted
        # since: a holder stalled past its record's deletion never matches a later holder.
        self._issued = 0
        # Callers waiting for a record in progress to settle (`wait_settled`), by scope.
        self._waiting: dict[Scope, list[Callable[[], object]]] = {}

    def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation:
        now = now or _clock.host_now()
        with self._lock:
            current = self._entries.get(scope)
            if current is not None:
                verdict = judge(current.record(), fingerprint, now)
                if verdict is not None:
                    return verdict
            token = self._issued = max(self._issued, current.token if current else 0) + 1
            keeps_history = current is not None and current.expires_at > now
            recovery_point = current.recovery_point if current and keeps_history else None
            until = now + lease
            self._entries[scope] = _Entry(
                scope,
                fingerprint,
                token,
                until,
                current.created_at if current and keeps_history else now,
                now,
                until + ttl,
                recovery_point,
            )
            # A live record judged free is one whose lease ended: this takes it over.
            return Acquired(token, recovery_point, taken_over=keeps_history)

    def _held(self, scope: Scope, token: int) -> _Entry:
        entry = self._entries.get(scope)
        if entry is None or entry.token != token or entry.status is not Status.IN_PROGRESS:
            raise FencedError(f"{key_ref(scope.key)}: token {token} is stale")
        return entry

    def _settle(
        self,
        scope: Scope,
        token: int,
        status: Status,
        response: bytes,
        now: datetime | None,
        ttl: timedelta,
    ) -> None:
        now = now or _clock.host_now()
        with self._lock:
            entry = self._entries.get(scope)
            if entry is not None and entry.token == token:
                if entry.status is Status.IN_PROGRESS:
                    entry.status = status
                    entry.response = bytes(response)
                    entry.lease_expires_at = None
                    entry.updated_at = now
                    entry.expires_at = max(entry.expires_at, now + ttl)
                    entry._record = None
                    if self._waiting:
                        self._wake(scope)
                    return
                if entry.status is status and entry.response == bytes(response):
                    return  # the same settle again (a retried call whose answer was lost)
            raise FencedError(f"{key_ref(scope.key)}: token {token} is stale")

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._settle(scope, token, Status.COMPLETED, response, now, ttl)

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._settle(scope, token, Status.FAILED, response, now, ttl)

    def release(self, scope: Scope, token: int) -> None:
        with self._lock:
            entry = self._entries.get(scope)
            if (
                entry
                and entry.token == token
                and entry.status is Status.IN_PROGRESS
                # Committed steps are never forgotten: the lease ends on its own instead.
                and entry.recovery_point is None
            ):
                del self._entries[scope]
                if self._waiting:
                    self._wake(scope)

    def renew(self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta) -> None:
        self._extend(scope, token, now, lease, None)

    def checkpoint(
        self, scope: Scope, token: int, point: str | None, *, now: datetime | None, lease: timedelta
    ) -> None:
        """Record ``point`` (None: keep the stored one) and extend the lease to ``now +
        lease``; fenced on ``token``."""
        self._extend(scope, token, now, lease, point)

    def _extend(
        self, scope: Scope, token: int, now: datetime | None, lease: timedelta, point: str | None
    ) -> None:
        now = now or _clock.host_now()
        with self._lock:
            entry = self._held(scope, token)
            until = now + lease
            entry.lease_expires_at = until
            entry.updated_at = now
            entry.expires_at = max(entry.expires_at, until)
            if point is not None:
                entry.recovery_point = point
            entry._record = None
            if self._waiting and lease <= _NO_TIME:  # the lease ended: a waiter may take over
                self._wake(scope)

    def get(self, scope: Scope) -> Record | None:
        with self._lock:
            entry = self._entries.get(scope)
            return None if entry is None else entry.record()

    def evict(self, scope: Scope) -> bool:
        """Delete the record whatever its state; True if there was one."""
        with self._lock:
            if self._waiting:
                self._wake(scope)
            return self._entries.pop(scope, None) is not None

    def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        before = before or _clock.host_now()
        with self._lock:
            doomed = [
                scope
                for scope, entry in self._entries.items()
                if entry.expires_at <= before
                and (entry.status is not Status.IN_PROGRESS or entry.lease_over(before))
            ][:limit]
            for scope in doomed:
                del self._entries[scope]
                if self._waiting:
                    self._wake(scope)
            return len(doomed)

    def wait_settled(self, scope: Scope, seconds: float) -> None:
        """Return once the record of ``scope`` is no longer in progress (settled, released,
        deleted, its lease ended by its holder), or ``seconds`` later: a caller told to
        wait (``Policy.wait``) learns of the first attempt's end at once instead of polling.

        >>> import threading
        >>> from datetime import UTC, datetime, timedelta
        >>> store, scope = MemoryStore(), Scope("", "charge", "k1")
        >>> now = datetime.now(UTC)
        >>> held = store.reserve(scope, "fp", now=now, lease=timedelta(1), ttl=timedelta(1))
        >>> threading.Timer(0.05, store.release, (scope, held.token)).start()
        >>> store.wait_settled(scope, seconds=30)  # returns after about 0.05 s, not 30
        """
        woken = threading.Event()
        if not self._watch(scope, woken.set):
            return
        try:
            woken.wait(seconds)
        finally:
            self._unwatch(scope, woken.set)

    def _watch(self, scope: Scope, wake: Callable[[], object]) -> bool:
        """Call ``wake`` once the record of ``scope`` changes; False (and no call) if it is
        not in progress now. Checked under the lock that every change takes: no change can
        slip in between the check and the watch."""
        with self._lock:
            entry = self._entries.get(scope)
            if entry is None or entry.status is not Status.IN_PROGRESS:
                return False
            self._waiting.setdefault(scope, []).append(wake)
            return True

    def _unwatch(self, scope: Scope, wake: Callable[[], object]) -> None:
        with self._lock:
            waiting = self._waiting.get(scope)
            if waiting and wake in waiting:
                waiting.remove(wake)
                if not waiting:
                    del self._waiting[scope]

    def _wake(self, scope: Scope) -> None:
        # Under the lock; each waker only sets an event or schedules a callback.
        for wake in self._waiting.pop(scope, ()):
            wake()

    def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        with self._lock:
            counts: dict[str, int] = {}
            for entry in self._entries.values():
                counts[entry.status.value] = counts.get(entry.status.value, 0) + 1
            return counts

    def scan(
        self,
        *,
        status: Status | None = None,
        operation: str | None = None,
        principal: str | None = None,
        created_before: datetime | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """Up to ``limit`` records passing every filter given, oldest first, without their
        responses (`get` reads one whole)."""
        where = ScanFilter(status, operation, principal, created_before, limit)
        with self._lock:
            found = [entry.record() for entry in self._entries.values()]
        listed = [dataclasses.replace(r, response=None) for r in found if where.matches(r)]
        return oldest(listed, limit)

    def close(self) -> None:
        pass


class AsyncMemoryStore:
    """The asynchronous face of `MemoryStore`. Its verbs never block, so they run inline."""

    def __init__(self, store: MemoryStore | None = None) -> None:
        self.sync = store or MemoryStore()

    async def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation:
        return self.sync.reserve(scope, fingerprint, now=now, lease=lease, ttl=ttl)

    async def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self.sync.complete(scope, token, response, now=now, ttl=ttl)

    async def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self.sync.fail(scope, token, response, now=now, ttl=ttl)

    async def release(self, scope: Scope, token: int) -> None:
        self.sync.release(scope, token)

    async def renew(
        self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta
    ) -> None:
        self.sync.renew(scope, token, now=now, lease=lease)

    async def checkpoint(
        self, scope: Scope, token: int, point: str | None, *, now: datetime | None, lease: timedelta
    ) -> None:
        self.sync.checkpoint(scope, token, point, now=now, lease=lease)

    async def get(self, scope: Scope) -> Record | None:
        return self.sync.get(scope)

    async def evict(self, scope: Scope) -> bool:
        return self.sync.evict(scope)

    async def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        return self.sync.purge(before=before, limit=limit)

    async def wait_settled(self, scope: Scope, seconds: float) -> None:
        """`MemoryStore.wait_settled`, without blocking the event loop: the record may be
        settled from another thread (a sync guard on the same store) or this loop."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left waiting
                loop.call_soon_threadsafe(_resolve, woken)

        if not self.sync._watch(scope, wake):
            return
        try:
            await asyncio.wait((woken,), timeout=seconds)
        finally:
            self.sync._unwatch(scope, wake)
            woken.cancel()

    async def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        return self.sync.stats()

    async def scan(
        self,
        *,
        status: Status | None = None,
        operation: str | None = None,
        principal: str | None = None,
        created_before: datetime | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """The asynchronous face of `MemoryStore.scan`."""
        return self.sync.scan(
            status=status,
            operation=operation,
            principal=principal,
            created_before=created_before,
            limit=limit,
        )

    async def aclose(self) -> None:
        pass


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
