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
from contextlib import ExitStack, contextmanager, suppress
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


def _begin_statements(conn: Any, lock_timeout: timedelta) -> list[tuple[str, Any]]:
    statements: list[tuple[str, Any]] = []
    if conn.info.transaction_status == TransactionStatus.IDLE:
        statements.append(("BEGIN", None))
    ms = max(1, int(lock_timeout.total_seconds() * 1000))
    statements.append(("SELECT set_config('lock_timeout', %s, true)", (f"{ms}ms",)))
    return statements


class _PsycopgTx:
    """Runs transaction operations on one sync psycopg connection."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        lock_timeout: timedelta,
        on_store: Any = None,
    ) -> None:
        self._conn = conn
        self._lock_timeout = lock_timeout
        self._on_store = on_store
        self._pipeline: ExitStack | None = None
        self._restore: bool | None = None

    def _idle(self) -> bool:
        return self._conn.info.transaction_status == TransactionStatus.IDLE

    def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            try:
                return drive(gen, self._do)
            finally:
                self._send()

    def _queue(self, sql: str, params: Any) -> psycopg.Cursor[Any]:
        if self._pipeline is None:
            self._pipeline = ExitStack()
            self._pipeline.enter_context(self._conn.pipeline())
        return self._conn.execute(sql, params, prepare=params is not None)

    def _send(self) -> None:
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            with mapped_errors():
                pipeline.close()

    def _ended(self) -> None:
        # The app gets its connection back with the autocommit setting it had.
        restore, self._restore = self._restore, None
        if restore is not None:
            self._conn.autocommit = restore

    def _do(self, op: Any) -> Any:
        with mapped_errors():
            match op:
                case Statement(sql, params, fetch):
                    cursor = self._queue(_pyformat(sql), params)
                    if fetch:
                        self._send()
                        return cursor.fetchall()
                    return None
                case Begin(lazy=True):
                    # psycopg's implicit BEGIN will travel with the app's first statement.
                    if self._idle() and self._conn.autocommit:
                        self._conn.autocommit = False
                        self._restore = True
                    return None
                case Begin():
                    # An explicit BEGIN rides in the same batch as the reservation, where
                    # psycopg's implicit one would cost a round trip of its own.
                    if self._idle() and not self._conn.autocommit:
                        self._conn.autocommit = True
                        self._restore = False
                    for sql, params in _begin_statements(self._conn, self._lock_timeout):
                        self._queue(sql, params)
                    return None
                case Commit():
                    self._queue("COMMIT", None)
                    self._send()
                    self._ended()
                    return None
                case Rollback():
                    self._send_quietly()
                    if self._conn.info.transaction_status != TransactionStatus.IDLE:
                        self._conn.execute("ROLLBACK")
                    self._ended()
                    return None
                case OnStore(gen):
                    return self._on_store(gen)
        raise AssertionError(f"unknown operation {op!r}")

    def _send_quietly(self) -> None:
        # Rolling back after a failed batch: the batch's error was already raised.
        with suppress(IdempotencyError, LockTimeoutError):
            self._send()


class _AsyncPsycopgTx:
    """The asynchronous twin of `_PsycopgTx`."""

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        lock_timeout: timedelta,
        on_store: Any = None,
    ) -> None:
        self._conn = conn
        self._lock_timeout = lock_timeout
        self._on_store = on_store
        self._pipeline: Any = None
        self._restore: bool | None = None

    def _idle(self) -> bool:
        return self._conn.info.transaction_status == TransactionStatus.IDLE

    async def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            try:
                return await adrive(gen, self._do)
            finally:
                await self._send()

    async def _queue(self, sql: str, params: Any) -> psycopg.AsyncCursor[Any]:
        if self._pipeline is None:
            self._pipeline = self._conn.pipeline()
            await self._pipeline.__aenter__()
        return await self._conn.execute(sql, params, prepare=params is not None)

    async def _send(self) -> None:
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            with mapped_errors():
                await pipeline.__aexit__(None, None, None)

    async def _ended(self) -> None:
        restore, self._restore = self._restore, None
        if restore is not None:
            await self._conn.set_autocommit(restore)

    async def _do(self, op: Any) -> Any:
        with mapped_errors():
            match op:
                case Statement(sql, params, fetch):
                    cursor = await self._queue(_pyformat(sql), params)
                    if fetch:
                        await self._send()
                        return await cursor.fetchall()
                    return None
                case Begin(lazy=True):
                    if self._idle() and self._conn.autocommit:
                        await self._conn.set_autocommit(False)
                        self._restore = True
                    return None
                case Begin():
                    if self._idle() and not self._conn.autocommit:
                        await self._conn.set_autocommit(True)
                        self._restore = False
                    for sql, params in _begin_statements(self._conn, self._lock_timeout):
                        await self._queue(sql, params)
                    return None
                case Commit():
                    await self._queue("COMMIT", None)
                    await self._send()
                    await self._ended()
                    return None
                case Rollback():
                    with suppress(IdempotencyError, LockTimeoutError):
                        await self._send()
                    if self._conn.info.transaction_status != TransactionStatus.IDLE:
                        await self._conn.execute("ROLLBACK")
                    await self._ended()
                    return None
                case OnStore(gen):
                    return await self._on_store(gen)
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
