"""How a guarded call runs on the app's own connection, written once for every driver.

The logic here yields transaction operations (`Begin`, SQL `Statement`s, `Commit`,
`Rollback`, `OnStore`) and receives their results; an executor per kind of connection
(psycopg, sqlite3, SQLAlchemy; sync or async) carries them out. `SyncUnit` and `AsyncUnit`
are the only sync/async twins, and they only forward.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, Protocol, TypeVar

from .._core.keys import Scope
from .._core.ops import Release, Renew, Reserve, Settle
from .._core.record import Acquired, InProgress, Record, Replay, Reservation, Status
from ..errors import TransactionOwnershipError
from ._sql import SqlDialect, SqlGen, Statement
from .base import Mode

T = TypeVar("T")


class LockTimeoutError(Exception):
    """Internal: a duplicate waited on the first attempt's row lock longer than allowed."""


class TransactionConflict(Exception):
    """Internal: the database gave up on the app's transaction (a serialization failure, a
    deadlock). ``error`` is the driver's own exception: the caller gets that one, as it would
    from its own statements, so its usual retry logic applies."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class TransactionEnded(Exception):
    """Internal: the transaction the guard reserved in is over: the app committed or rolled
    it back inside the block (its savepoint is gone)."""


@dataclass(frozen=True, slots=True)
class Begin:
    """Start a transaction on the app's connection unless one is open; the result is True
    when this began one (a conflict may then be retried in a fresh one).

    ``lazy``: the app's first statement may start it (no lock timeout needed, and a driver
    that would spend a round trip on BEGIN alone leaves it to ride with that statement).
    ``lock_timeout``: how long the reservation that follows may wait on a row lock (None:
    the executor's own); the app's statements after it keep the connection's setting.
    """

    lazy: bool = False
    lock_timeout: timedelta | None = None


@dataclass(frozen=True, slots=True)
class Commit:
    pass


@dataclass(frozen=True, slots=True)
class Rollback:
    pass


@dataclass(frozen=True, slots=True)
class Mark:
    """Take the savepoint the work's writes can be rolled back to. It follows the whole
    reservation, so rolling back to it keeps the reservation and its row lock."""


@dataclass(frozen=True, slots=True)
class Undo:
    """Roll back to the mark: the work's writes go, the reservation and its lock stay.
    Raises `TransactionEnded` if the mark is gone."""


@dataclass(frozen=True, slots=True)
class Check:
    """Make sure the marked transaction is still the one open (the app neither committed
    nor rolled it back). Raises `TransactionEnded` now, or from the statements it is sent
    with: a pipelining executor sends it with the completion."""


@dataclass(frozen=True, slots=True)
class OnStore:
    """Run a statement generator on the store's own connection, committed at once."""

    gen: SqlGen[Any]


TxOp = Statement | Begin | Commit | Rollback | Mark | Undo | Check | OnStore
TxGen = Generator[TxOp, Any, T]

SAVEPOINT = "idempo_work"
"""The savepoint transactional mode takes after the reservation; executors name it so."""

# PostgreSQL's lock timeout for the reservation's statements only, shared by the psycopg and
# SQLAlchemy executors: the app's statements after it wait as the connection says. The app's
# setting is kept meanwhile in a variable of the transaction (the subquery runs first).
PG_SET_LOCK_TIMEOUT = (
    "SELECT set_config('lock_timeout', :ms, true) FROM (SELECT set_config("
    "'idempo.lock_timeout', current_setting('lock_timeout'), true)) AS saved"
)
PG_AGAIN_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', :ms, true)"
PG_RESTORE_LOCK_TIMEOUT = (
    "SELECT set_config('lock_timeout', current_setting('idempo.lock_timeout'), true)"
)


def pg_ms(timeout: timedelta) -> str:
    """A lock timeout as PostgreSQL's setting (0 would mean no limit: 1 ms at least)."""
    return f"{max(1, int(timeout.total_seconds() * 1000))}ms"


class UnitLogic(Protocol):
    """The verbs of a `Unit` as generators of transaction operations."""

    def reserve(self, op: Reserve) -> TxGen[Reservation]: ...

    def settle(self, op: Settle) -> TxGen[None]: ...

    def release(self, op: Release) -> TxGen[None]: ...

    def renew(self, op: Renew) -> TxGen[None]: ...

    def discard(self) -> TxGen[bool]: ...


# A reservation that meets a serialization failure or a deadlock in a transaction the guard
# began is tried again in a fresh one (with a fresh snapshot, that sees what the other
# transaction committed); at most this many times in all.
_CONFLICT_TRIES = 3


class _State(Enum):
    IDLE = "idle"  # no transaction of the guard's open
    HELD = "held"  # reserved, the work's writes since the mark
    UNDONE = "undone"  # the work's writes rolled back to the mark; the lock still held
    REPLAYED = "replayed"  # a replay read the record; its transaction still open
    ENDED = "ended"  # the app committed the guard's transaction, reservation and all
    GONE = "gone"  # the guard's transaction rolled back (the app's doing): nothing is left


class TransactionLogic:
    """Transactional mode: reservation, the work's writes and the outcome commit together.

    A duplicate waits on the first attempt's row lock, bounded by the lock timeout; the row
    lock is the lease, so ``renew`` has nothing to do. A savepoint right after the
    reservation lets a failure throw the work's writes away while the reservation and its
    lock stay: a deterministic failure is recorded before any duplicate can take the key
    (SPEC §2 rule 10), and the savepoint's absence at the end shows that the app ended the
    guard's transaction itself.
    """

    def __init__(
        self,
        dialect: SqlDialect,
        lock_timeout: timedelta,
        waiting: Callable[[timedelta], SqlDialect] | None = None,
    ) -> None:
        self._dialect = dialect
        self._lock_timeout = lock_timeout
        # The statements for a reservation bounded by another lock wait, where the wait is
        # part of the statement itself (MariaDB's SET STATEMENT).
        self._waiting = waiting
        self._state = _State.IDLE
        self._reserved: Reserve | None = None
        self._token = 0

    def reserve(self, op: Reserve) -> TxGen[Reservation]:
        self._reserved = op
        dialect = self._dialect
        if op.lock_timeout is not None and self._waiting is not None:
            dialect = self._waiting(op.lock_timeout)
        for tries_left in reversed(range(_CONFLICT_TRIES)):
            began = False
            try:
                # SQLite waits for the lock here, in BEGIN IMMEDIATE.
                began = yield Begin(lock_timeout=op.lock_timeout)
                reservation = yield from dialect.reserve(op)
                if isinstance(reservation, Acquired):
                    yield Mark()
            except LockTimeoutError:
                yield Rollback()
                self._state = _State.IDLE
                return InProgress(retry_after=self._lock_timeout.total_seconds())
            except TransactionConflict:
                yield Rollback()
                self._state = _State.IDLE
                if began and tries_left:
                    continue
                raise
            except BaseException:
                yield Rollback()
                self._state = _State.IDLE
                raise
            if isinstance(reservation, Acquired):
                self._state, self._token = _State.HELD, reservation.token
            elif isinstance(reservation, Replay):
                self._state = _State.REPLAYED
            return reservation
        raise AssertionError("unreachable: the last try raises")

    def settle(self, op: Settle) -> TxGen[None]:
        if self._state is _State.ENDED:
            # The app's commit took the reservation with it: the record is settled on the
            # store's own connection, fenced on the token.
            yield OnStore(self._dialect.settle(op))
            return
        if self._state is _State.GONE:
            return  # no reservation left to settle
        try:
            if self._state is _State.HELD:
                yield Check()
            yield from self._dialect.settle(op)
            yield Commit()
        except TransactionEnded:
            error = yield from self._ended()
            raise error from None
        except BaseException:
            yield Rollback()
            self._state = _State.IDLE
            raise
        self._state = _State.IDLE

    def release(self, op: Release) -> TxGen[None]:
        if self._state in (_State.ENDED, _State.GONE):
            return  # committed by the app (the flow records it), or nothing left
        yield Rollback()
        self._state = _State.IDLE

    def renew(self, op: Renew) -> TxGen[None]:
        return
        yield  # a generator that does nothing

    def discard(self) -> TxGen[bool]:
        """End the transaction after a reservation that will write nothing, or throw the
        work's writes away (keeping the reservation). True when nothing the work wrote can
        commit any more."""
        state = self._state
        if state is _State.HELD:
            try:
                yield Undo()
            except TransactionEnded:
                error = yield from self._ended()
                if self._state is _State.ENDED:
                    raise error from None
                # Rolled back whole (by the app, or by the server, as InnoDB does a deadlock
                # victim's): nothing of the work or of the reservation is left.
                return True
            except BaseException:
                # Then nothing can be recorded: the whole transaction goes, reservation too.
                yield Rollback()
                self._state = _State.IDLE
                raise
            self._state = _State.UNDONE
            return True
        if state in (_State.UNDONE, _State.GONE):
            return True
        if state is _State.REPLAYED:
            # A replay is a success that only read: it commits, which ends it as a rollback
            # would, without making drivers such as psycopg forget their prepared statements
            # (they do on every ROLLBACK).
            yield Commit()
        elif state is not _State.ENDED:
            yield Rollback()
        self._state = _State.IDLE
        return False

    def _ended(self) -> TxGen[TransactionOwnershipError]:
        """The guard's savepoint is gone: the app ended the transaction inside the block.
        Roll back what it began since, and ask the store whether its commit took the
        reservation with it (then the work's committed part must never run again)."""
        yield Rollback()
        assert self._reserved is not None, "no reservation to have ended"
        record = yield OnStore(self._dialect.get(self._reserved.scope))
        committed = (
            record is not None
            and record.token == self._token
            and record.status is Status.IN_PROGRESS
        )
        self._state = _State.ENDED if committed else _State.GONE
        return _ownership()


def _ownership() -> TransactionOwnershipError:
    return TransactionOwnershipError(
        "the guarded block committed or rolled back the transaction the guard owns on this "
        "connection. What it committed stays committed and the key is recorded as failed, so "
        "no retry runs the work again. In transactional mode leave COMMIT and ROLLBACK to the "
        "guard (use a savepoint, a nested transaction, to undo part of the work), or use "
        "mode='leased'."
    )


class LeasedLogic:
    """Leased mode on the app's connection: the reservation commits at once on the store's
    own connection; the work's writes and the fenced outcome commit together on the app's.

    A holder that lost its lease has its outcome refused inside its own transaction, so its
    business writes roll back with it: fencing reaches the business write.
    """

    def __init__(self, dialect: SqlDialect) -> None:
        self._dialect = dialect
        self._began = False
        self._discarded = False

    def reserve(self, op: Reserve) -> TxGen[Reservation]:
        self._discarded = False
        reservation: Reservation = yield OnStore(self._dialect.reserve(op))
        self._began = isinstance(reservation, Acquired)
        if self._began:
            # The work's writes must wait for the fenced outcome, even on a connection the
            # app left in autocommit mode.
            yield Begin(lazy=True)
        return reservation

    def settle(self, op: Settle) -> TxGen[None]:
        if self._discarded:
            yield OnStore(self._dialect.settle(op))
            return
        try:
            yield from self._dialect.settle(op)
            yield Commit()
        except BaseException:
            yield Rollback()
            raise

    def release(self, op: Release) -> TxGen[None]:
        yield from self.discard()
        yield OnStore(self._dialect.release(op))

    def renew(self, op: Renew) -> TxGen[None]:
        yield OnStore(self._dialect.renew(op))

    def discard(self) -> TxGen[bool]:
        # Only the transaction this call began is thrown away; after a replay or a refusal
        # the app's connection is left as it was. False: the reservation committed apart,
        # so the work may have taken effect where no rollback reaches.
        if self._began:
            yield Rollback()
        self._began = False
        self._discarded = True
        return False


class StoreLogic:
    """Leased mode on the store's own connection: every verb commits by itself."""

    def __init__(self, dialect: SqlDialect) -> None:
        self._dialect = dialect

    def reserve(self, op: Reserve) -> TxGen[Reservation]:
        return (yield from self._dialect.reserve(op))

    def settle(self, op: Settle) -> TxGen[None]:
        yield from self._dialect.settle(op)

    def release(self, op: Release) -> TxGen[None]:
        yield from self._dialect.release(op)

    def renew(self, op: Renew) -> TxGen[None]:
        yield from self._dialect.renew(op)

    def discard(self) -> TxGen[bool]:
        return False
        yield  # nothing of the work's runs on the store's connection


class SyncUnit:
    """A `Unit` whose verbs run a `UnitLogic` through a synchronous executor."""

    def __init__(self, logic: UnitLogic, run: Callable[[TxGen[Any]], Any]) -> None:
        self._logic = logic
        self._run = run

    def _perform(self, gen: TxGen[T]) -> T:
        try:
            result: T = self._run(gen)
        except TransactionConflict as conflict:
            raise conflict.error from None
        return result

    def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
        lock_timeout: timedelta | None = None,
    ) -> Reservation:
        """``lock_timeout``: how long this reservation may wait on another attempt's row
        lock, if less than the unit's own (a caller with a deadline)."""
        return self._perform(
            self._logic.reserve(Reserve(scope, fingerprint, now, lease, ttl, lock_timeout))
        )

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._perform(
            self._logic.settle(Settle(scope, token, Status.COMPLETED, response, now, ttl))
        )

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        self._perform(self._logic.settle(Settle(scope, token, Status.FAILED, response, now, ttl)))

    def release(self, scope: Scope, token: int) -> None:
        self._perform(self._logic.release(Release(scope, token)))

    def renew(self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta) -> None:
        self._perform(self._logic.renew(Renew(scope, token, now, lease)))

    def discard(self) -> bool:
        """Throw the work's writes away; True when none of them can commit any more (every
        effect of the work was in this transaction, as far as idempo can know)."""
        return self._perform(self._logic.discard())


class AsyncUnit:
    """The asynchronous twin of `SyncUnit`."""

    def __init__(self, logic: UnitLogic, run: Callable[[TxGen[Any]], Awaitable[Any]]) -> None:
        self._logic = logic
        self._run = run

    async def _perform(self, gen: TxGen[T]) -> T:
        try:
            result: T = await self._run(gen)
        except TransactionConflict as conflict:
            raise conflict.error from None
        return result

    async def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
        lock_timeout: timedelta | None = None,
    ) -> Reservation:
        return await self._perform(
            self._logic.reserve(Reserve(scope, fingerprint, now, lease, ttl, lock_timeout))
        )

    async def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        await self._perform(
            self._logic.settle(Settle(scope, token, Status.COMPLETED, response, now, ttl))
        )

    async def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> None:
        await self._perform(
            self._logic.settle(Settle(scope, token, Status.FAILED, response, now, ttl))
        )

    async def release(self, scope: Scope, token: int) -> None:
        await self._perform(self._logic.release(Release(scope, token)))

    async def renew(
        self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta
    ) -> None:
        await self._perform(self._logic.renew(Renew(scope, token, now, lease)))

    async def discard(self) -> bool:
        return await self._perform(self._logic.discard())


def _ddl(sql: str) -> SqlGen[None]:
    yield Statement(sql, {}, fetch=False)


class SqlStore(SyncUnit):
    """The `Store` verbs of any SQL store; subclasses say how `run` reaches the database."""

    dialect: SqlDialect

    def __init__(self, dialect: SqlDialect) -> None:
        self.dialect = dialect
        super().__init__(StoreLogic(dialect), self.run)

    def run(self, gen: TxGen[T]) -> T:
        """Run statements on the store's own connection, committed at once."""
        raise NotImplementedError

    def read(self, gen: TxGen[T]) -> T:
        """Run statements that only read; stores that lock for writes may lock less."""
        return self.run(gen)

    def migrate(self) -> None:
        """Create the records table and its index if they do not exist."""
        for sql in self.dialect.ddl():
            self.run(_ddl(sql))

    def get(self, scope: Scope) -> Record | None:
        return self.read(self.dialect.get(scope))

    def evict(self, scope: Scope) -> bool:
        """Delete the record whatever its state; True if there was one."""
        return self.run(self.dialect.evict(scope))

    def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        return self.run(self.dialect.purge(before, limit))

    def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        return self.read(self.dialect.stats())


class AsyncSqlStore(AsyncUnit):
    """The asynchronous twin of `SqlStore`."""

    dialect: SqlDialect

    def __init__(self, dialect: SqlDialect) -> None:
        self.dialect = dialect
        super().__init__(StoreLogic(dialect), self.run)

    async def run(self, gen: TxGen[T]) -> T:
        """Run statements on the store's own connection, committed at once."""
        raise NotImplementedError

    async def migrate(self) -> None:
        """Create the records table and its index if they do not exist."""
        for sql in self.dialect.ddl():
            await self.run(_ddl(sql))

    async def get(self, scope: Scope) -> Record | None:
        return await self.run(self.dialect.get(scope))

    async def evict(self, scope: Scope) -> bool:
        """Delete the record whatever its state; True if there was one."""
        return await self.run(self.dialect.evict(scope))

    async def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        return await self.run(self.dialect.purge(before, limit))

    async def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        return await self.run(self.dialect.stats())


def unit_logic(
    dialect: SqlDialect,
    mode: Mode,
    lock_timeout: timedelta,
    waiting: Callable[[timedelta], SqlDialect] | None = None,
) -> UnitLogic:
    """The logic of a guarded call on the app's connection, in the given mode. ``waiting``:
    the dialect for a reservation bounded by another lock wait, where the statement carries
    its own (see `TransactionLogic`)."""
    if mode == "transactional":
        return TransactionLogic(dialect, lock_timeout, waiting)
    return LeasedLogic(dialect)
