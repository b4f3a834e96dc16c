"""What a store is: a few domain verbs, no policy.

Every verb that changes a record after reservation is fenced on the token the reservation
returned: a holder whose lease was taken over cannot complete, fail, renew or release.

``now`` is the time a decision is made at. None (the default policy) means the store's own
clock where it has one (PostgreSQL, MariaDB, Redis), else the host's: a caller whose clock is
wrong cannot take over a live lease. A datetime is a clock the app injected (tests,
simulations) and overrides the store's.

Tokens only grow per scope, even across the deletion of the record (purge, expiry, eviction,
`evict`): a fresh record never gets a token an earlier holder of the same scope had.

Settling twice with the same token, status and response succeeds without a change (a retried
command whose reply was lost); any other settle by a token that no longer holds the lease
raises `FencedError`.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any, Literal, Protocol, runtime_checkable

from .._core.keys import Scope
from .._core.record import Record, Reservation

__all__ = [
    "AsyncStore",
    "AsyncTransactionalStore",
    "AsyncUnit",
    "Mode",
    "Store",
    "TransactionalStore",
    "Unit",
]

Mode = Literal["transactional", "leased"]
"""How a guard on the app's connection commits.

``transactional``: reservation, business writes and completion commit in one transaction.
``leased``: the reservation commits at once (a duplicate sees it immediately); the business
writes and the fenced completion commit together at the end.
"""


class _Verbs(Protocol):
    """The verbs a store and a unit share: what a guarded call does to its record."""

    def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation:
        """Atomically create the record, take over an expired lease, or report what is there."""
        ...

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        """Store the response as COMPLETED. Raises `FencedError` if ``token`` is stale."""
        ...

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        """Store the response as FAILED (replayed). Raises `FencedError` if ``token`` is stale."""
        ...

    def release(self, scope: Scope, token: int) -> None:
        """Delete the reservation so a retry executes again. A stale token is a no-op."""
        ...

    def renew(self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta) -> None:
        """Extend the lease to ``now + lease``. Raises `FencedError` if ``token`` is stale."""
        ...


@runtime_checkable
class Store(_Verbs, Protocol):
    """**Protocol:** a synchronous store of idempotency records."""

    def get(self, scope: Scope) -> Record | None:
        """The record as stored, expired or not."""
        ...

    def evict(self, scope: Scope) -> bool:
        """Delete the record whatever its state (operators, corrupt records). True if it was
        there. Later tokens still grow past the evicted record's."""
        ...

    def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        """Delete up to ``limit`` records whose retention ended by ``before`` (None: the
        store's clock). Never a record inside its retention or under a live lease, however
        it races with takeovers and completions."""
        ...

    def stats(self) -> dict[str, int]:
        """How many records are in each state (``in_progress``, ``completed``, ``failed``)."""
        ...

    def close(self) -> None:
        """Release connections."""
        ...


class _AsyncVerbs(Protocol):
    """The asynchronous face of `_Verbs`."""

    async def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
    ) -> Reservation: ...

    async def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None: ...

    async def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None: ...

    async def release(self, scope: Scope, token: int) -> None: ...

    async def renew(
        self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta
    ) -> None: ...


@runtime_checkable
class AsyncStore(_AsyncVerbs, Protocol):
    """**Protocol:** the asynchronous twin of `Store`: same verbs, awaited, plus ``aclose``."""

    async def get(self, scope: Scope) -> Record | None: ...

    async def evict(self, scope: Scope) -> bool: ...

    async def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int: ...

    async def stats(self) -> dict[str, int]: ...

    async def aclose(self) -> None: ...


class Unit(_Verbs, Protocol):
    """**Protocol:** one guarded call's view of a store, possibly inside the app's transaction.

    The verbs are the store's; ``discard`` throws away the work's own writes (a rollback to
    the savepoint after the reservation, in transactional mode) before the outcome is
    recorded, and says whether there were writes to throw away: False where the work's
    effects are its own (leased mode), so an unstorable result is recorded FAILED rather
    than released.
    """

    def discard(self) -> bool: ...


class AsyncUnit(_AsyncVerbs, Protocol):
    """**Protocol:** the asynchronous twin of `Unit`."""

    async def discard(self) -> bool: ...


@runtime_checkable
class TransactionalStore(Protocol):
    """**Protocol:** a store that can run a guarded call on the app's own connection."""

    def bind(self, conn: Any, *, mode: Mode = "transactional") -> Unit: ...


@runtime_checkable
class AsyncTransactionalStore(Protocol):
    """**Protocol:** the asynchronous twin of `TransactionalStore`."""

    def bind(self, conn: Any, *, mode: Mode = "transactional") -> AsyncUnit: ...
