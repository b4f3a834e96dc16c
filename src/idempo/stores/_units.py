"""How a guarded call runs on the app's own connection, written once for every driver.

The logic here yields transaction operations (`Begin`, SQL `Statement`s, `Commit`,
`Rollback`, `OnStore`) and receives their results; an executor per kind of connection
(psycopg, sqlite3, SQLAlchemy; sync or async) carries them out. `SyncUnit` and `AsyncUnit`
are the only sync/async twins, and they only forward.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Protocol, TypeVar

from .._keys import Scope
from .._ops import Release, Renew, Reserve, Settle
from .._record import Acquired, InProgress, Record, Replay, Reservation, Status
from ._sql import SqlDialect, SqlGen, Statement
from .base import Mode

T = TypeVar("T")


class LockTimeoutError(Exception):
    """Internal: a duplicate waited on the first attempt's row lock longer than allowed."""


@dataclass(frozen=True, slots=True)
class Begin:
    """Start a transaction on the app's connection unless one is open.

    ``lazy``: the app's first statement may start it (no lock timeout needed, and a driver
    that would spend a round trip on BEGIN alone leaves it to ride with that statement).
    """

    lazy: bool = False


@dataclass(frozen=True, slots=True)
class Commit:
    pass


@dataclass(frozen=True, slots=True)
class Rollback:
    pass


@dataclass(frozen=True, slots=True)
class OnStore:
    """Run a statement generator on the store's own connection, committed at once."""

    gen: SqlGen[Any]


TxOp = Statement | Begin | Commit | Rollback | OnStore
TxGen = Generator[TxOp, Any, T]


class UnitLogic(Protocol):
    """The verbs of a `Unit` as generators of transaction operations."""

    def reserve(self, op: Reserve) -> TxGen[Reservation]: ...

    def settle(self, op: Settle) -> TxGen[None]: ...

    def release(self, op: Release) -> TxGen[None]: ...

    def renew(self, op: Renew) -> TxGen[None]: ...

    def discard(self) -> TxGen[None]: ...


class TransactionLogic:
    """Transactional mode: reservation, the work's writes and the outcome commit together.

    A duplicate waits on the first attempt's row lock, bounded by the lock timeout; the row
    lock is the lease, so ``renew`` has nothing to do. After ``discard`` (the work raised) the
    reservation is gone with the rollback, so a deterministic failure is recorded in a
    transaction of its own.
    """

    def __init__(self, dialect: SqlDialect, lock_timeout: timedelta) -> None:
        self._dialect = dialect
        self._lock_timeout = lock_timeout
        self._reserved: Reserve | None = None
        self._replayed = False
        self._discarded = False

    def reserve(self, op: Reserve) -> TxGen[Reservation]:
        self._reserved = op
        self._replayed = self._discarded = False
        try:
            yield Begin()
            reservation = yield from self._dialect.reserve(op)
        except LockTimeoutError:
            yield Rollback()
            return InProgress(retry_after=self._lock_timeout.total_seconds())
        except BaseException:
            yield Rollback()
            raise
        self._replayed = isinstance(reservation, Replay)
        return reservation

    def settle(self, op: Settle) -> TxGen[None]:
        try:
            if self._discarded:
                # The rollback took the reservation with it: take the key again, in a
                # transaction of its own, to record the outcome.
                assert self._reserved is not None, "settle before reserve"
                yield Begin()
                again = yield from self._dialect.reserve(replace(self._reserved, now=op.now))
                if not isinstance(again, Acquired):
                    yield Rollback()
                    return
                op = replace(op, token=again.token)
            yield from self._dialect.settle(op)
            yield Commit()
        except BaseException:
            yield Rollback()
            raise

    def release(self, op: Release) -> TxGen[None]:
        yield from self.discard()

    def renew(self, op: Renew) -> TxGen[None]:
        return
        yield  # a generator that does nothing

    def discard(self) -> TxGen[None]:
        # A replay is a success that only read: it commits, which ends it as a rollback
        # would, without making drivers such as psycopg forget their prepared statements (they
        # do on every ROLLBACK). Errors and refusals roll back.
        yield Commit() if self._replayed else Rollback()
        self._discarded = True


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

    def discard(self) -> TxGen[None]:
        # Only the transaction this call began is thrown away; after a replay or a refusal
        # the app's connection is left as it was.
        if self._began:
            yield Rollback()
        self._began = False
        self._discarded = True


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

    def discard(self) -> TxGen[None]:
        return
        yield  # nothing of the work's runs on the store's connection


class SyncUnit:
    """A `Unit` whose verbs run a `UnitLogic` through a synchronous executor."""

    def __init__(self, logic: UnitLogic, run: Callable[[TxGen[Any]], Any]) -> None:
        self._logic = logic
        self._run = run

    def reserve(
        self, scope: Scope, fingerprint: str, *, now: datetime, lease: timedelta, ttl: timedelta
    ) -> Reservation:
        result: Reservation = self._run(
            self._logic.reserve(Reserve(scope, fingerprint, now, lease, ttl))
        )
        return result

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        self._run(self._logic.settle(Settle(scope, token, Status.COMPLETED, response, now, ttl)))

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        self._run(self._logic.settle(Settle(scope, token, Status.FAILED, response, now, ttl)))

    def release(self, scope: Scope, token: int) -> None:
        self._run(self._logic.release(Release(scope, token)))

    def renew(self, scope: Scope, token: int, *, now: datetime, lease: timedelta) -> None:
        self._run(self._logic.renew(Renew(scope, token, now, lease)))

    def discard(self) -> None:
        self._run(self._logic.discard())


class AsyncUnit:
    """The asynchronous twin of `SyncUnit`."""

    def __init__(self, logic: UnitLogic, run: Callable[[TxGen[Any]], Awaitable[Any]]) -> None:
        self._logic = logic
        self._run = run

    async def reserve(
        self, scope: Scope, fingerprint: str, *, now: datetime, lease: timedelta, ttl: timedelta
    ) -> Reservation:
        result: Reservation = await self._run(
            self._logic.reserve(Reserve(scope, fingerprint, now, lease, ttl))
        )
        return result

    async def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        await self._run(
            self._logic.settle(Settle(scope, token, Status.COMPLETED, response, now, ttl))
        )

    async def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime, ttl: timedelta
    ) -> None:
        await self._run(self._logic.settle(Settle(scope, token, Status.FAILED, response, now, ttl)))

    async def release(self, scope: Scope, token: int) -> None:
        await self._run(self._logic.release(Release(scope, token)))

    async def renew(self, scope: Scope, token: int, *, now: datetime, lease: timedelta) -> None:
        await self._run(self._logic.renew(Renew(scope, token, now, lease)))

    async def discard(self) -> None:
        await self._run(self._logic.discard())


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

    def purge(self, *, before: datetime, limit: int = 1000) -> int:
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

    async def purge(self, *, before: datetime, limit: int = 1000) -> int:
        return await self.run(self.dialect.purge(before, limit))

    async def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        return await self.run(self.dialect.stats())


def unit_logic(dialect: SqlDialect, mode: Mode, lock_timeout: timedelta) -> UnitLogic:
    """The logic of a guarded call on the app's connection, in the given mode."""
    if mode == "transactional":
        return TransactionLogic(dialect, lock_timeout)
    return LeasedLogic(dialect)
