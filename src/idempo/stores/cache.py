"""A local cache tier: settled records kept in this process's memory, in front of any store.

    store = CachedStore(RedisStore("redis://cache:6379/0"), max_entries=10_000)
    idem = Idempotency(store)        # a hot replay answers from memory: no round trip
    open_store("redis://cache:6379/0?cache=10000")                 # the same, from a URL

**What is cached.** COMPLETED and FAILED records only, each for at most its own retention:
a cached record is never served at or after its ``expires_at``, compared with the ``now``
the verb carries, or with the host's clock when it carries None (the store's own clock is
out of reach without a round trip; docs/stores.md says what that means). Records are learned
from the store's answers only (a replay, or a mismatch against a settled record), so each is
exactly what the store keeps; this process's own completion is learned at the first retry
that asks the store. An in-progress record is never cached, so a duplicate of running work
always asks the store. A reservation whose scope is cached answers from memory with what
`judge` says: the same fingerprint replays, another one is a mismatch.

**Why that is safe.** A settled record cannot change in the store before its retention ends:
every write after settling is fenced, so the answer from memory is the one the store would
give. The exceptions (a record deleted early behind the cache's back, clocks that disagree
across processes) are in docs/stores.md.

**On the app's connection** (``bind``), a cached answer touches neither the store nor the
connection: no transaction is begun and none is ended.

`evict` forgets the scope here too, and a store answer read before the eviction is not
learned after it.

The least recently used record goes first when ``max_entries`` (or ``max_bytes`` of stored
responses) is reached. One lock guards the records; it is never held across store I/O.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Generator
from datetime import datetime
from typing import Any, TypeVar, cast

from .._core.flow import performer
from .._core.keys import Scope
from .._core.ops import Checkpoint, Discard, Release, Renew, Reserve, Settle, StoreOp
from .._core.record import InProgress, Mismatch, Record, Replay, Reservation, Status, judge
from ..errors import ConfigurationError
from . import _clock
from ._sql.transaction import AsyncUnit, SyncUnit, UnitLogic, adrive, drive
from .base import AsyncStore, AsyncTransactionalStore, Store, TransactionalStore

__all__ = ["AsyncCachedStore", "CachedStore", "LocalCache"]

T = TypeVar("T")

DEFAULT_MAX_ENTRIES = 10_000


OpGen = Generator[StoreOp, Any, T]


class LocalCache:
    """The records themselves: a thread-safe LRU that never does I/O.

    Attributes:
        hits: reservations answered from memory.
        misses: reservations that went to the store.
    """

    def __init__(
        self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int | None = None
    ) -> None:
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries < 1:
            raise ConfigurationError(f"max_entries must be a positive integer, not {max_entries!r}")
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 1):
            raise ConfigurationError(f"max_bytes must be a positive integer, not {max_bytes!r}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.hits = 0
        self.misses = 0
        self._records: OrderedDict[Scope, Record] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        # Forgetting (evict, clear) counts up; an answer the store gave before a scope was
        # forgotten is not learned after it (see `mark`).
        self._generation = 0
        self._cleared = 0
        self._forgotten: OrderedDict[Scope, int] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    @property
    def nbytes(self) -> int:
        """The stored responses' bytes now held."""
        with self._lock:
            return self._bytes

    def scopes(self) -> list[Scope]:
        """The cached scopes, least recently used first."""
        with self._lock:
            return list(self._records)

    def answer(
        self, scope: Scope, fingerprint: str, now: datetime | None
    ) -> Replay | Mismatch | None:
        """What the cached record says to a reservation, or None: ask the store. Without an
        injected time the cache judges on the host's clock (it has no other)."""
        now = now or _clock.host_now()
        with self._lock:
            record = self._records.get(scope)
            verdict = judge(record, fingerprint, now) if record is not None else None
            if verdict is None:
                if record is not None:  # its retention is over: the store decides what is next
                    self._drop(scope)
                self.misses += 1
                return None
            self._records.move_to_end(scope)
            self.hits += 1
        assert not isinstance(verdict, InProgress), "an in-progress record was cached"
        return verdict

    def mark(self) -> int:
        """Taken before asking the store; `learn` given it ignores the answer if the scope
        was forgotten since (an eviction racing a reservation that read the old record)."""
        return self._generation

    def learn(self, record: Record, since: int | None = None) -> None:
        """Keep a settled record the store handed back (an in-progress one is ignored),
        evicting the least recently used records beyond the bounds."""
        if record.status is Status.IN_PROGRESS:
            return
        size = len(record.response or b"")
        if self.max_bytes is not None and size > self.max_bytes:
            return
        with self._lock:
            if (
                since is not None
                and max(self._cleared, self._forgotten.get(record.scope, 0)) > since
            ):
                return  # read before an eviction or a clear that came since
            current = self._records.get(record.scope)
            if current is not None and current.updated_at > record.updated_at:
                return  # a slower caller brought back an older answer than the one we have
            if current is not None:
                self._drop(record.scope)
            self._records[record.scope] = record
            self._bytes += size
            while len(self._records) > self.max_entries or (
                self.max_bytes is not None and self._bytes > self.max_bytes
            ):
                self._drop(next(iter(self._records)))

    def forget_expired(self, before: datetime) -> None:
        """Drop every record whose retention ended by ``before`` (the store purged them)."""
        with self._lock:
            for scope in [s for s, r in self._records.items() if r.expires_at <= before]:
                self._drop(scope)

    def forget(self, scope: Scope) -> None:
        """Drop one scope's cached record (it was evicted from the store)."""
        with self._lock:
            self._generation += 1
            self._forgotten[scope] = self._generation
            self._forgotten.move_to_end(scope)
            while len(self._forgotten) > self.max_entries:
                self._forgotten.popitem(last=False)
            if scope in self._records:
                self._drop(scope)

    def clear(self) -> None:
        """Forget everything (say, after deleting records from the store by hand)."""
        with self._lock:
            self._generation += 1
            self._cleared = self._generation
            self._forgotten.clear()
            self._records.clear()
            self._bytes = 0

    def _drop(self, scope: Scope) -> None:
        record = self._records.pop(scope)
        self._bytes -= len(record.response or b"")


class _Logic:
    """The verbs in front of a store's own connections, as generators of the store calls
    they need; the sync and async faces only drive them."""

    def __init__(self, cache: LocalCache) -> None:
        self.cache = cache

    def reserve(self, op: Reserve) -> OpGen[Reservation]:
        cached = self.cache.answer(op.scope, op.fingerprint, op.now)
        if cached is not None:
            self.answered()
            return cached
        mark = self.cache.mark()
        reservation: Reservation = yield op
        if isinstance(reservation, Replay | Mismatch):
            self.cache.learn(reservation.record, mark)
        return reservation

    def answered(self) -> None:
        """A reservation was answered from memory (a bound unit takes note)."""

    # The other verbs only pass through. This process's own completion is not learned: the
    # store's tokens and clock decide the record's fields (a takeover keeps an earlier
    # attempt's created_at, the store's clock sets the times), which only its answer tells.
    def settle(self, op: Settle) -> OpGen[None]:
        yield op

    def release(self, op: Release) -> OpGen[None]:
        yield op

    def renew(self, op: Renew) -> OpGen[None]:
        yield op

    def checkpoint(self, op: Checkpoint) -> OpGen[None]:
        yield op

    def discard(self, op: Discard) -> OpGen[None]:
        return
        yield  # nothing of the work runs on the store's own connections


class _BoundLogic(_Logic):
    """One guarded call on the app's connection: a cached answer touches nothing (no
    transaction to end afterwards)."""

    def __init__(self, cache: LocalCache) -> None:
        super().__init__(cache)
        self._answered = False

    def reserve(self, op: Reserve) -> OpGen[Reservation]:
        self._answered = False
        return (yield from super().reserve(op))

    def answered(self) -> None:
        self._answered = True

    def discard(self, op: Discard) -> OpGen[None]:
        if not self._answered:  # after a cached answer there is no transaction to end
            yield op


def _runner(target: Any) -> Callable[[Generator[Any, Any, Any]], Any]:
    perform = performer(target).perform
    return lambda gen: drive(gen, perform)


def _async_runner(target: Any) -> Callable[[Generator[Any, Any, Any]], Awaitable[Any]]:
    perform = performer(target).perform
    return lambda gen: adrive(gen, perform)


def _logic(logic: _Logic) -> UnitLogic:
    # The unit faces only forward: the operations the logic yields are carried out by this
    # module's own runners, not by a transaction executor.
    return cast(UnitLogic, logic)


class _Wrapper:
    """What both faces share: the wrapped store, its cache, and everything else it offers
    (``migrate``, ``connect``, its client) passed through unchanged."""

    store: Any
    cache: LocalCache

    def __getattr__(self, name: str) -> Any:
        try:
            store = self.__dict__["store"]
        except KeyError:  # not built yet (copying, unpickling): no store to ask
            raise AttributeError(name) from None
        return getattr(store, name)


class CachedStore(_Wrapper, SyncUnit):
    """A `Store` that answers hot replays from this process's memory, in front of ``store``.

    ``CachedStore(store)`` can join the app's transaction exactly when ``store`` can.

    Args:
        store: any synchronous store.
        max_entries: how many settled records to keep at most.
        max_bytes: if set, how many bytes of stored responses to keep at most; a larger
            response is never cached.

    >>> from datetime import UTC, datetime, timedelta
    >>> from idempo.stores.memory import MemoryStore
    >>> store = CachedStore(MemoryStore(), max_entries=1000)
    >>> scope, now, hour = Scope("", "charge", "k1"), datetime.now(UTC), timedelta(hours=1)
    >>> token = store.reserve(scope, "fp", now=now, lease=hour, ttl=hour).token
    >>> store.complete(scope, token, b"42", now=now, ttl=hour)
    >>> first = store.reserve(scope, "fp", now=now, lease=hour, ttl=hour)  # learned from the store
    >>> store.reserve(scope, "fp", now=now, lease=hour, ttl=hour).record.response, store.cache.hits
    (b'42', 1)

    .. versionadded:: 0.1
    """

    discards = False  # used directly: the work runs on none of the store's connections

    def __new__(cls, store: Store, **options: Any) -> CachedStore:
        # Only a store that can join the app's transaction gets a bind, so capability checks
        # (isinstance against TransactionalStore) see through the cache.
        binds = cls is CachedStore and isinstance(store, TransactionalStore)
        return super().__new__(_CachedTransactionalStore if binds else cls)

    def __init__(
        self,
        store: Store,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int | None = None,
    ) -> None:
        self.store = store
        self.cache = LocalCache(max_entries, max_bytes)
        super().__init__(_logic(_Logic(self.cache)), _runner(store))

    def get(self, scope: Scope) -> Record | None:
        """The record as stored (never from the cache)."""
        record: Record | None = self.store.get(scope)
        return record

    def evict(self, scope: Scope) -> bool:
        """Delete the record in the store and forget the cached copy."""
        try:
            evicted: bool = self.store.evict(scope)
        finally:
            self.cache.forget(scope)
        return evicted

    def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        purged: int = self.store.purge(before=before, limit=limit)
        # The cache keeps settled records by retention on the host's clock.
        self.cache.forget_expired(before or _clock.host_now())
        return purged

    def stats(self) -> dict[str, int]:
        """The store's counts (the cache holds copies, not records of its own)."""
        stats: dict[str, int] = self.store.stats()
        return stats

    def close(self) -> None:
        self.cache.clear()
        self.store.close()


class _CachedTransactionalStore(CachedStore):
    """A `CachedStore` in front of a store that can join the app's transaction."""

    def bind(self, conn: Any, *, mode: Any = "transactional", **options: Any) -> SyncUnit:
        """The wrapped store's unit on ``conn``, with cached answers first (see the module)."""
        unit = self.store.bind(conn, mode=mode, **options)
        return SyncUnit(_logic(_BoundLogic(self.cache)), _runner(unit))


class AsyncCachedStore(_Wrapper, AsyncUnit):
    """The asynchronous twin of `CachedStore`, in front of an `AsyncStore`.

    .. versionadded:: 0.1
    """

    discards = False

    def __new__(cls, store: AsyncStore, **options: Any) -> AsyncCachedStore:
        binds = cls is AsyncCachedStore and isinstance(store, AsyncTransactionalStore)
        return super().__new__(_AsyncCachedTransactionalStore if binds else cls)

    def __init__(
        self,
        store: AsyncStore,
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int | None = None,
    ) -> None:
        self.store = store
        self.cache = LocalCache(max_entries, max_bytes)
        super().__init__(_logic(_Logic(self.cache)), _async_runner(store))

    async def get(self, scope: Scope) -> Record | None:
        """The record as stored (never from the cache)."""
        record: Record | None = await self.store.get(scope)
        return record

    async def evict(self, scope: Scope) -> bool:
        """Delete the record in the store and forget the cached copy."""
        try:
            evicted: bool = await self.store.evict(scope)
        finally:
            self.cache.forget(scope)
        return evicted

    async def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        purged: int = await self.store.purge(before=before, limit=limit)
        self.cache.forget_expired(before or _clock.host_now())
        return purged

    async def stats(self) -> dict[str, int]:
        """The store's counts (the cache holds copies, not records of its own)."""
        stats: dict[str, int] = await self.store.stats()
        return stats

    async def aclose(self) -> None:
        self.cache.clear()
        await self.store.aclose()


class _AsyncCachedTransactionalStore(AsyncCachedStore):
    """An `AsyncCachedStore` in front of a store that can join the app's transaction."""

    def bind(self, conn: Any, *, mode: Any = "transactional", **options: Any) -> AsyncUnit:
        """The wrapped store's unit on ``conn``, with cached answers first (see the module)."""
        unit = self.store.bind(conn, mode=mode, **options)
        return AsyncUnit(_logic(_BoundLogic(self.cache)), _async_runner(unit))
