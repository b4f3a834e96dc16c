"""Transactional mode through SQLAlchemy 2: a ``Session`` or ``Connection``, sync or async.

The guard's statements run on the app's own session, so they share its transaction; the
guard commits or rolls back that transaction when the guarded block ends.
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
from ._units import Begin, Commit, OnStore, Rollback, TxGen

T = TypeVar("T")


@lru_cache(maxsize=256)
def _text(sql: str) -> TextClause:
    return text(sql)


def _lock_timeout_statement(dialect: SqlDialect, lock_timeout: timedelta) -> Statement | None:
    if dialect.name != "postgresql":
        return None  # SQLite waits as long as the connection's own busy timeout says
    ms = max(1, int(lock_timeout.total_seconds() * 1000))
    return Statement("SELECT set_config('lock_timeout', :ms, true)", {"ms": f"{ms}ms"})


class SqlAlchemyTx:
    """Runs transaction operations on a sync ``Session`` or ``Connection``."""

    def __init__(
        self,
        conn: Any,
        dialect: SqlDialect,
        lock_timeout: timedelta,
        on_store: Callable[[Any], Any],
        map_error: Callable[[BaseException], BaseException],
    ) -> None:
        self._conn = conn
        self._begin = _lock_timeout_statement(dialect, lock_timeout)
        self._on_store = on_store
        self._map_error = map_error

    def run(self, gen: TxGen[T]) -> T:
        return drive(gen, self._do)

    def _do(self, op: Any) -> Any:
        try:
            match op:
                case Statement(sql, params, fetch):
                    result = self._conn.execute(_text(sql), params)
                    return [tuple(row) for row in result] if fetch else None
                case Begin(lazy=False) if self._begin is not None:
                    self._conn.execute(_text(self._begin.sql), self._begin.params)
                    return None
                case Begin():
                    return None  # SQLAlchemy begins on its own with the first statement
                case Commit():
                    return self._conn.commit()
                case Rollback():
                    return self._conn.rollback()
                case OnStore(gen):
                    return self._on_store(gen)
        except DBAPIError as exc:
            raise self._map_error(exc.orig or exc) from exc
        raise AssertionError(f"unknown operation {op!r}")


class AsyncSqlAlchemyTx:
    """The asynchronous twin of `SqlAlchemyTx`, for ``AsyncSession`` and ``AsyncConnection``."""

    def __init__(
        self,
        conn: Any,
        dialect: SqlDialect,
        lock_timeout: timedelta,
        on_store: Callable[[Any], Awaitable[Any]],
        map_error: Callable[[BaseException], BaseException],
    ) -> None:
        self._conn = conn
        self._begin = _lock_timeout_statement(dialect, lock_timeout)
        self._on_store = on_store
        self._map_error = map_error

    async def run(self, gen: TxGen[T]) -> T:
        return await adrive(gen, self._do)

    async def _do(self, op: Any) -> Any:
        try:
            match op:
                case Statement(sql, params, fetch):
                    result = await self._conn.execute(_text(sql), params)
                    return [tuple(row) for row in result] if fetch else None
                case Begin(lazy=False) if self._begin is not None:
                    await self._conn.execute(_text(self._begin.sql), self._begin.params)
                    return None
                case Begin():
                    return None  # SQLAlchemy begins on its own with the first statement
                case Commit():
                    return await self._conn.commit()
                case Rollback():
                    return await self._conn.rollback()
                case OnStore(gen):
                    return await self._on_store(gen)
        except DBAPIError as exc:
            raise self._map_error(exc.orig or exc) from exc
        raise AssertionError(f"unknown operation {op!r}")
