"""PostgreSQL store (psycopg 3), sync and async, leased and transactional.

Leased mode runs each verb on a pooled autocommit connection: one round trip per verb.
Transactional mode runs on the app's own connection. Statements are queued in psycopg's
pipeline and sent when a result is needed, so the reservation travels with BEGIN and the
completion with COMMIT: a guarded business transaction costs the same three round trips as
the bare one (BEGIN + reserve, the app's write, complete + COMMIT).

    store = PostgresStore("postgresql://app@db/app")
    store.migrate()
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from functools import lru_cache
from typing import Any, TypeVar

try:
    import psycopg
    from psycopg import errors as pg_errors
    from psycopg.pq import TransactionStatus
    from psycopg_pool import AsyncConnectionPool, ConnectionPool
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from ..errors import ConfigurationError

    raise ConfigurationError(
        "the PostgreSQL store needs psycopg: pip install 'idempo[postgres]'"
    ) from exc

from ..errors import FencedError, IdempotencyError, StoreError, StoreUnavailableError
from ._sql import FENCED_MARKER, PostgresDialect, Statement, adrive, drive, pyformat
from ._units import (
    AsyncSqlStore,
    AsyncUnit,
    Begin,
    Commit,
    LockTimeoutError,
    OnStore,
    Rollback,
    SqlStore,
    SyncUnit,
    TxGen,
    unit_logic,
)
from .base import Mode

__all__ = ["AsyncPostgresStore", "PostgresStore"]

T = TypeVar("T")

_pyformat = lru_cache(maxsize=256)(pyformat)


def map_error(exc: BaseException) -> BaseException:
    """A psycopg error as the idempo error it means; anything else unchanged."""
    if isinstance(exc, pg_errors.InvalidTextRepresentation) and FENCED_MARKER in str(exc):
        return FencedError(str(exc).split(FENCED_MARKER, 1)[1].lstrip(": ").split('"')[0])
    if isinstance(exc, pg_errors.LockNotAvailable):
        return LockTimeoutError(str(exc))
    if isinstance(exc, psycopg.OperationalError):
        return StoreUnavailableError(f"PostgreSQL is unreachable: {exc}")
    if isinstance(exc, psycopg.Error):
        return StoreError(f"PostgreSQL failed: {exc}")
    return exc


@contextmanager
def mapped_errors() -> Iterator[None]:
    try:
        yield
    except (IdempotencyError, LockTimeoutError):
        raise
    except psycopg.Error as exc:
        raise map_error(exc) from exc


Queued = tuple[str, Any]


class _Batch:
    """What the sync and async executors share: statements wait in a Python list and leave
    together when a result is needed, one statement as a plain execute, several in a psycopg
    pipeline (a pipeline costs an extra Sync, worth it only to save a round trip)."""

    def __init__(self, conn: Any, lock_timeout: timedelta, on_store: Any) -> None:
        self.conn = conn
        self.on_store = on_store
        self.pending: list[Queued] = []
        self.restore_autocommit: bool | None = None
        ms = max(1, int(lock_timeout.total_seconds() * 1000))
        self.lock_timeout: Queued = ("SELECT set_config('lock_timeout', %s, true)", (f"{ms}ms",))

    def idle(self) -> bool:
        return bool(self.conn.info.transaction_status == TransactionStatus.IDLE)

    def begin(self, op: Begin) -> bool | None:
        """Queue what starts the transaction; the autocommit setting to switch to, if any."""
        if op.lazy:
            # psycopg's implicit BEGIN will travel with the app's first statement.
            return False if self.idle() and self.conn.autocommit else None
        switch = None
        if self.idle():
            # An explicit BEGIN rides in the batch with the reservation, where psycopg's
            # implicit one would cost a round trip of its own.
            switch = True if not self.conn.autocommit else None
            self.pending.append(("BEGIN", None))
        self.pending.append(self.lock_timeout)
        return switch

    def switched(self, autocommit: bool | None) -> None:
        if autocommit is not None:
            self.restore_autocommit = not autocommit

    def take(self) -> list[Queued]:
        pending, self.pending = self.pending, []
        return pending

    def ended(self) -> bool | None:
        """The autocommit setting to give back to the app now its transaction is over."""
        restore, self.restore_autocommit = self.restore_autocommit, None
        return restore


class _PsycopgTx:
    """Runs transaction operations on one sync psycopg connection."""

    def __init__(
        self, conn: psycopg.Connection[Any], lock_timeout: timedelta, on_store: Any = None
    ) -> None:
        self._conn = conn
        self._batch = _Batch(conn, lock_timeout, on_store)

    def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            try:
                return drive(gen, self._do)
            finally:
                self._send()

    def _send(self) -> psycopg.Cursor[Any] | None:
        pending = self._batch.take()
        if not pending:
            return None
        with mapped_errors():
            if len(pending) == 1:
                sql, params = pending[0]
                return self._conn.execute(sql, params, prepare=params is not None)
            with self._conn.pipeline():
                cursors = [
                    self._conn.execute(sql, params, prepare=params is not None)
                    for sql, params in pending
                ]
            return cursors[-1]

    def _end(self) -> None:
        restore = self._batch.ended()
        if restore is not None:
            self._conn.autocommit = restore

    def _do(self, op: Any) -> Any:
        batch = self._batch
        with mapped_errors():
            match op:
                case Statement(sql, params, fetch):
                    batch.pending.append((_pyformat(sql), params))
                    cursor = self._send() if fetch else None
                    return cursor.fetchall() if cursor is not None else None
                case Begin():
                    switch = batch.begin(op)
                    if switch is not None:
                        self._conn.autocommit = switch
                        batch.switched(switch)
                    return None
                case Commit():
                    batch.pending.append(("COMMIT", None))
                    self._send()
                    self._end()
                    return None
                case Rollback():
                    batch.take()  # what was never sent needs no undoing
                    if not batch.idle():
                        self._conn.execute("ROLLBACK")
                    self._end()
                    return None
                case OnStore(gen):
                    return batch.on_store(gen)
        raise AssertionError(f"unknown operation {op!r}")


class _AsyncPsycopgTx:
    """The asynchronous twin of `_PsycopgTx`."""

    def __init__(
        self, conn: psycopg.AsyncConnection[Any], lock_timeout: timedelta, on_store: Any = None
    ) -> None:
        self._conn = conn
        self._batch = _Batch(conn, lock_timeout, on_store)

    async def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            try:
                return await adrive(gen, self._do)
            finally:
                await self._send()

    async def _send(self) -> psycopg.AsyncCursor[Any] | None:
        pending = self._batch.take()
        if not pending:
            return None
        with mapped_errors():
            if len(pending) == 1:
                sql, params = pending[0]
                return await self._conn.execute(sql, params, prepare=params is not None)
            async with self._conn.pipeline():
                cursors = [
                    await self._conn.execute(sql, params, prepare=params is not None)
                    for sql, params in pending
                ]
            return cursors[-1]

    async def _end(self) -> None:
        restore = self._batch.ended()
        if restore is not None:
            await self._conn.set_autocommit(restore)

    async def _do(self, op: Any) -> Any:
        batch = self._batch
        with mapped_errors():
            match op:
                case Statement(sql, params, fetch):
                    batch.pending.append((_pyformat(sql), params))
                    cursor = await self._send() if fetch else None
                    return await cursor.fetchall() if cursor is not None else None
                case Begin():
                    switch = batch.begin(op)
                    if switch is not None:
                        await self._conn.set_autocommit(switch)
                        batch.switched(switch)
                    return None
                case Commit():
                    batch.pending.append(("COMMIT", None))
                    await self._send()
                    await self._end()
                    return None
                case Rollback():
                    batch.take()
                    if not batch.idle():
                        await self._conn.execute("ROLLBACK")
                    await self._end()
                    return None
                case OnStore(gen):
                    return await batch.on_store(gen)
        raise AssertionError(f"unknown operation {op!r}")


DEFAULT_TABLE = "idempo_records"
DEFAULT_LOCK_TIMEOUT = timedelta(seconds=5)


class PostgresStore(SqlStore):
    """A PostgreSQL store. Safe to share between threads; each verb borrows a pooled connection.

    Args:
        conninfo: a libpq URL or DSN, or an open ``psycopg_pool.ConnectionPool`` whose
            connections are in autocommit mode.
        table: the records table (``schema.table`` allowed); create it with `migrate`.
        max_size: pool size when idempo makes the pool.

    >>> store = PostgresStore("postgresql://postgres@127.0.0.1/test")  # doctest: +SKIP
    """

    def __init__(
        self, conninfo: str | ConnectionPool[Any], *, table: str = DEFAULT_TABLE, max_size: int = 10
    ) -> None:
        super().__init__(PostgresDialect(table))
        self._owns_pool = not isinstance(conninfo, ConnectionPool)
        self._pool = (
            ConnectionPool(
                conninfo, kwargs={"autocommit": True}, min_size=1, max_size=max_size, open=True
            )
            if isinstance(conninfo, str)
            else conninfo
        )

    def run(self, gen: TxGen[T]) -> T:
        with mapped_errors(), self._pool.connection() as conn:
            return _PsycopgTx(conn, DEFAULT_LOCK_TIMEOUT).run(gen)

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> SyncUnit:
        """A unit that runs a guarded call on the app's connection (psycopg or SQLAlchemy)."""
        timeout = lock_timeout or DEFAULT_LOCK_TIMEOUT
        logic = unit_logic(self.dialect, mode, timeout)
        if isinstance(conn, psycopg.Connection):
            return SyncUnit(logic, _PsycopgTx(conn, timeout, self.run).run)
        from ._sqlalchemy import SqlAlchemyTx  # noqa: PLC0415 - optional dependency

        return SyncUnit(logic, SqlAlchemyTx(conn, self.dialect, timeout, self.run, map_error).run)

    def close(self) -> None:
        if self._owns_pool:
            self._pool.close()


class AsyncPostgresStore(AsyncSqlStore):
    """The asynchronous twin of `PostgresStore`, on ``psycopg.AsyncConnection``s.

    The pool opens on first use, inside the running event loop.
    """

    def __init__(
        self,
        conninfo: str | AsyncConnectionPool[Any],
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 10,
    ) -> None:
        super().__init__(PostgresDialect(table))
        self._owns_pool = not isinstance(conninfo, AsyncConnectionPool)
        self._pool = (
            AsyncConnectionPool(
                conninfo, kwargs={"autocommit": True}, min_size=1, max_size=max_size, open=False
            )
            if isinstance(conninfo, str)
            else conninfo
        )
        self._opened = not self._owns_pool

    async def run(self, gen: TxGen[T]) -> T:
        if not self._opened:
            await self._pool.open()
            self._opened = True
        with mapped_errors():
            async with self._pool.connection() as conn:
                return await _AsyncPsycopgTx(conn, DEFAULT_LOCK_TIMEOUT).run(gen)

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> AsyncUnit:
        """A unit that runs a guarded call on the app's async connection or session."""
        timeout = lock_timeout or DEFAULT_LOCK_TIMEOUT
        logic = unit_logic(self.dialect, mode, timeout)
        if isinstance(conn, psycopg.AsyncConnection):
            return AsyncUnit(logic, _AsyncPsycopgTx(conn, timeout, self.run).run)
        from ._sqlalchemy import AsyncSqlAlchemyTx  # noqa: PLC0415 - optional dependency

        return AsyncUnit(
            logic, AsyncSqlAlchemyTx(conn, self.dialect, timeout, self.run, map_error).run
        )

    async def aclose(self) -> None:
        if self._owns_pool:
            await self._pool.close()
