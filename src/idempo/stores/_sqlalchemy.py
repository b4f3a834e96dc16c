"""Transactional mode through SQLAlchemy 2: a ``Session`` or ``Connection``, sync or async.

The guard's statements run on the app's own session, so they share its transaction; the
guard commits or rolls back that transaction when the guarded block ends. The savepoint after
the reservation is SQLAlchemy's own nested transaction (``begin_nested``), so the session
knows of it; that the app committed or rolled back inside the block shows, with no round
trip, as the session's transaction being another one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from functools import lru_cache
from typing import Any, TypeVar

try:
    from sqlalchemy import TextClause, text
    from sqlalchemy.exc import DBAPIError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from ..errors import ConfigurationError

    raise ConfigurationError(
        "binding a SQLAlchemy session needs SQLAlchemy: pip install 'idempo[sqlalchemy]'"
    ) from exc

from ._sql import SqlDialect, Statement, adrive, drive
from ._units import (
    PG_RESTORE_LOCK_TIMEOUT,
    PG_SET_LOCK_TIMEOUT,
    Begin,
    Check,
    Commit,
    Mark,
    OnStore,
    Rollback,
    TransactionConflict,
    TransactionEnded,
    TxGen,
    Undo,
    pg_ms,
)

T = TypeVar("T")


@lru_cache(maxsize=256)
def _text(sql: str) -> TextClause:
    return text(sql)


def _never(exc: BaseException) -> bool:
    return False


class _Savepoint:
    """The guard's nested transaction, and whether the transaction around it is still the
    one the guard reserved in."""

    def __init__(self, nested: Any, conn: Any) -> None:
        self.nested = nested  # what begin_nested returned: its rollback is awaited if async
        self._conn = getattr(conn, "sync_session", None) or getattr(conn, "sync_connection", conn)
        self._root = self._conn.get_transaction()
        self._inner = self._conn.get_nested_transaction()

    def intact(self) -> bool:
        inner = self._inner
        return inner is not None and inner.is_active and self._conn.get_transaction() is self._root


class _Shared:
    """What the sync and async executors share: their setup and the decisions they make."""

    def __init__(
        self,
        conn: Any,
        dialect: SqlDialect,
        lock_timeout: timedelta,
        map_error: Callable[[BaseException], BaseException],
        conflict: Callable[[BaseException], bool],
    ) -> None:
        self._conn = conn
        # SQLite waits as long as the connection's own busy timeout says, and MariaDB's
        # reservation carries its lock wait in the statement: only PostgreSQL sets one.
        self._postgres = dialect.name == "postgresql"
        self._wait = pg_ms(lock_timeout)
        self._map_error = map_error
        self._conflict = conflict
        self._mark: _Savepoint | None = None

    def lock_timeout(self, op: Begin) -> dict[str, str] | None:
        """The parameters of the reservation's own lock timeout, if one is set."""
        if op.lazy or not self._postgres:
            return None
        return {"ms": self._wait if op.lock_timeout is None else pg_ms(op.lock_timeout)}

    def intact(self) -> None:
        if self._mark is not None and not self._mark.intact():
            raise TransactionEnded("the session's transaction is not the guard's any more")

    def undo(self) -> Any:
        mark = self._mark
        if mark is None or not mark.intact():
            raise TransactionEnded("the session's transaction is not the guard's any more")
        return mark.nested

    def error(self, exc: DBAPIError) -> BaseException:
        """A driver error as what it means: the app's own conflict, or the store's error."""
        orig = exc.orig or exc
        if self._conflict(orig):
            return TransactionConflict(exc)
        return self._map_error(orig)


class SqlAlchemyTx(_Shared):
    """Runs transaction operations on a sync ``Session`` or ``Connection``.

    ``conflict`` tells a serialization failure or a deadlock, which the caller gets as
    SQLAlchemy raised it, from the errors that are the store's.
    """

    def __init__(
        self,
        conn: Any,
        dialect: SqlDialect,
        lock_timeout: timedelta,
        on_store: Callable[[Any], Any],
        map_error: Callable[[BaseException], BaseException],
        *,
        conflict: Callable[[BaseException], bool] = _never,
    ) -> None:
        super().__init__(conn, dialect, lock_timeout, map_error, conflict)
        self._on_store = on_store

    def run(self, gen: TxGen[T]) -> T:
        return drive(gen, self._do)

    def _do(self, op: Any) -> Any:
        conn = self._conn
        try:
            match op:
                case Statement(sql, params, fetch):
                    result = conn.execute(_text(sql), params)
                    return [tuple(row) for row in result] if fetch else None
                case Begin():
                    began = not conn.in_transaction()
                    # Else SQLAlchemy begins on its own with the first statement.
                    if (timeout := self.lock_timeout(op)) is not None:
                        conn.execute(_text(PG_SET_LOCK_TIMEOUT), timeout)
                    return began
                case Mark():
                    if self._postgres:
                        conn.execute(_text(PG_RESTORE_LOCK_TIMEOUT))
                    self._mark = _Savepoint(conn.begin_nested(), conn)
                    return None
                case Check():
                    return self.intact()
                case Undo():
                    return self.undo().rollback()
                case Commit():
                    self._mark = None
                    return conn.commit()
                case Rollback():
                    self._mark = None
                    return conn.rollback()
                case OnStore(gen):
                    return self._on_store(gen)
        except DBAPIError as exc:
            raise self.error(exc) from exc
        raise AssertionError(f"unknown operation {op!r}")


class AsyncSqlAlchemyTx(_Shared):
    """The asynchronous twin of `SqlAlchemyTx`, for ``AsyncSession`` and ``AsyncConnection``."""

    def __init__(
        self,
        conn: Any,
        dialect: SqlDialect,
        lock_timeout: timedelta,
        on_store: Callable[[Any], Awaitable[Any]],
        map_error: Callable[[BaseException], BaseException],
        *,
        conflict: Callable[[BaseException], bool] = _never,
    ) -> None:
        super().__init__(conn, dialect, lock_timeout, map_error, conflict)
        self._on_store = on_store

    async def run(self, gen: TxGen[T]) -> T:
        return await adrive(gen, self._do)

    async def _do(self, op: Any) -> Any:
        conn = self._conn
        try:
            match op:
                case Statement(sql, params, fetch):
                    result = await conn.execute(_text(sql), params)
                    return [tuple(row) for row in result] if fetch else None
                case Begin():
                    began = not conn.in_transaction()
                    if (timeout := self.lock_timeout(op)) is not None:
                        await conn.execute(_text(PG_SET_LOCK_TIMEOUT), timeout)
                    return began
                case Mark():
                    if self._postgres:
                        await conn.execute(_text(PG_RESTORE_LOCK_TIMEOUT))
                    self._mark = _Savepoint(await conn.begin_nested(), conn)
                    return None
                case Check():
                    return self.intact()
                case Undo():
                    return await self.undo().rollback()
                case Commit():
                    self._mark = None
                    return await conn.commit()
                case Rollback():
                    self._mark = None
                    return await conn.rollback()
                case OnStore(gen):
                    return await self._on_store(gen)
        except DBAPIError as exc:
            raise self.error(exc) from exc
        raise AssertionError(f"unknown operation {op!r}")
