"""Transactional mode through SQLAlchemy 2: a ``Session`` or ``Connection``, sync or async.

The guard's statements run on the app's own session, so they share its transaction; the
guard commits or rolls back that transaction when the guarded block ends. The savepoint after
the reservation is SQLAlchemy's own nested transaction (``begin_nested``), so the session
knows of it; that the app committed or rolled back inside the block shows, with no round
trip, as the session's transaction being another one.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from functools import lru_cache
from typing import Any, TypeVar

from ..._optional import optional_import

with optional_import("binding a SQLAlchemy session needs SQLAlchemy", extra="sqlalchemy"):
    from sqlalchemy import TextClause, text
    from sqlalchemy.exc import DBAPIError

from .dialect import SqlDialect, Statement
from .transaction import (
    Begin,
    Call,
    Check,
    Commit,
    Mark,
    OnStore,
    Rollback,
    TransactionConflict,
    TransactionEnded,
    TxGen,
    Undo,
    acall,
    adrive,
    aexecute,
    call,
    drive,
    execute,
    mapped,
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
        on_store: Callable[[Any], Any],
        map_error: Callable[[BaseException], BaseException],
        *,
        conflict: Callable[[BaseException], bool] = _never,
    ) -> None:
        """``on_store``: runs statements on the store's own connection (awaitable on the
        async face); ``conflict`` tells a serialization failure or a deadlock, which the
        caller gets as SQLAlchemy raised it, from the errors that are the store's."""
        self._conn = conn
        self._on_store = on_store
        # PostgreSQL's and MariaDB's reservations carry their lock wait in the statement;
        # SQLite lowers its busy timeout for a caller's bound.
        self._sqlite = dialect.name == "sqlite"
        self._busy: int | None = None  # SQLite: the busy timeout to restore, once lowered
        self._map_error = map_error
        self._conflict = conflict
        self._mark: _Savepoint | None = None

    def lower_busy_timeout(self, op: Begin) -> Generator[Call, Any, None]:
        """On SQLite, bound the reservation's wait for another writer's lock by the caller's
        ``op.lock_timeout`` (Policy.wait, a deadline) when that is shorter than the
        connection's own busy timeout; `restore_busy_timeout` puts it back."""
        if not self._sqlite or not op.reserves or op.lock_timeout is None:
            return
        bound = max(0, int(op.lock_timeout.total_seconds() * 1000))
        own = (yield self._conn.execute, (_text("PRAGMA busy_timeout"),)).scalar()
        if isinstance(own, int) and bound < own:
            yield self._conn.execute, (_text(f"PRAGMA busy_timeout = {bound}"),)
            self._busy = own

    def restore_busy_timeout(self) -> Generator[Call, Any, None]:
        # The reservation's first statement took the write lock (or gave up): the app's own
        # statements wait as long as the connection says again.
        own, self._busy = self._busy, None
        yield self._conn.execute, (_text(f"PRAGMA busy_timeout = {own}"),)

    def intact(self) -> None:
        if self._mark is not None and not self._mark.intact():
            raise TransactionEnded("the session's transaction is not the guard's any more")

    def undo(self) -> Any:
        mark = self._mark
        if mark is None or not mark.intact():
            raise TransactionEnded("the session's transaction is not the guard's any more")
        return mark.nested

    def error(self, exc: BaseException) -> BaseException:
        """A driver error as what it means: the app's own conflict, or the store's error;
        anything else as it is. Applied once, where a failure leaves the executor."""
        if not isinstance(exc, DBAPIError):
            return exc
        orig = exc.orig or exc
        if self._conflict(orig):
            return mapped(exc, TransactionConflict(exc))
        return mapped(exc, self._map_error(orig))

    def steps(self, op: Any) -> Generator[Call, Any, Any]:
        """The calls on the session or connection that carry out ``op``, sans I/O: each is
        yielded, made by the face (awaited by the async one), and its result sent back."""
        conn = self._conn
        if isinstance(op, Statement):
            if self._busy is None:
                result = yield conn.execute, (_text(op.sql), op.params)
            else:
                try:
                    result = yield conn.execute, (_text(op.sql), op.params)
                except Exception:
                    yield from self.restore_busy_timeout()
                    raise
                yield from self.restore_busy_timeout()
            return [tuple(row) for row in result] if op.fetch else None
        if isinstance(op, Begin):
            began = not conn.in_transaction()
            # Else SQLAlchemy begins on its own with the first statement.
            yield from self.lower_busy_timeout(op)
            return began
        if isinstance(op, Mark):
            self._mark = _Savepoint((yield conn.begin_nested, ()), conn)
            return None
        if isinstance(op, Check):
            return self.intact()
        if isinstance(op, Undo):
            return (yield self.undo().rollback, ())
        if isinstance(op, Commit | Rollback):
            self._mark = None
            return (yield conn.commit if isinstance(op, Commit) else conn.rollback, ())
        if isinstance(op, OnStore):
            return (yield self._on_store, (op.gen,))
        raise AssertionError(f"unknown operation {op!r}")

    pending: list[Any] = []  # noqa: RUF012 - statements go at once: never any queued

    def flush(self) -> None:
        return None


class SqlAlchemyTx(_Shared):
    """Runs transaction operations on a sync ``Session`` or ``Connection``."""

    def run(self, gen: TxGen[T]) -> T:
        return execute(self, gen)

    def do(self, op: Any) -> Any:
        return drive(self.steps(op), call)


class AsyncSqlAlchemyTx(_Shared):
    """The asynchronous face of `SqlAlchemyTx`, for ``AsyncSession`` and ``AsyncConnection``:
    the same calls, awaited."""

    async def run(self, gen: TxGen[T]) -> T:
        return await aexecute(self, gen)

    async def do(self, op: Any) -> Any:
        return await adrive(self.steps(op), acall)
