"""SQLite store: an embedded file, WAL mode, safe across threads and processes.

Every verb runs in a ``BEGIN IMMEDIATE`` transaction, so reservation is atomic across
processes sharing the file. Transactional mode runs on the app's own ``sqlite3.Connection``
(or a SQLAlchemy session on SQLite).

    store = SQLiteStore("app.db")
    store.migrate()
"""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from ..errors import IdempotencyError, StoreError, StoreUnavailableError
from ._sql import SQLiteDialect, Statement, drive
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

__all__ = ["AsyncSQLiteStore", "SQLiteStore"]

T = TypeVar("T")

DEFAULT_TABLE = "idempo_records"
DEFAULT_BUSY_TIMEOUT = timedelta(seconds=10)


def map_error(exc: BaseException) -> BaseException:
    """A sqlite3 error as the idempo error it means; anything else unchanged."""
    if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
        return LockTimeoutError(str(exc))
    if isinstance(exc, sqlite3.OperationalError):
        return StoreUnavailableError(f"SQLite failed: {exc}")
    if isinstance(exc, sqlite3.Error):
        return StoreError(f"SQLite failed: {exc}")
    return exc


class _Sqlite3Tx:
    """Runs transaction operations on one ``sqlite3.Connection``."""

    def __init__(self, conn: sqlite3.Connection, on_store: Callable[[Any], Any]) -> None:
        self._conn = conn
        self._on_store = on_store

    def run(self, gen: TxGen[T]) -> T:
        return drive(gen, self._do)

    def _do(self, op: Any) -> Any:
        try:
            match op:
                case Statement(sql, params, _):
                    return self._conn.execute(sql, params).fetchall()
                case Begin(lazy=True):
                    # Deferred: the work's first write takes the write lock. Taking it now
                    # would stall every other writer, takeovers included, while the work runs.
                    if not self._conn.in_transaction:
                        self._conn.execute("BEGIN")
                    return None
                case Begin():
                    if not self._conn.in_transaction:
                        # IMMEDIATE takes the write lock now: a duplicate waits here, not in
                        # a lock upgrade that SQLite would have to fail.
                        self._conn.execute("BEGIN IMMEDIATE")
                    return None
                case Commit():
                    return self._conn.commit()
                case Rollback():
                    return self._conn.rollback()
                case OnStore(gen):
                    return self._on_store(gen)
        except (IdempotencyError, LockTimeoutError):
            raise
        except sqlite3.Error as exc:
            raise map_error(exc) from exc
        raise AssertionError(f"unknown operation {op!r}")


class SQLiteStore(SqlStore):
    """A store in a SQLite file. Each thread gets its own connection; processes share the file.

    Args:
        path: the database file (created if missing), or ``":memory:"`` for one connection's
            private database (tests only: threads then do not share it).
        table: the records table; create it with `migrate`.
        busy_timeout: how long a writer waits for another writer's lock.

    >>> store = SQLiteStore("/tmp/idempo-doc.db"); store.migrate(); store.close()
    """

    def __init__(
        self,
        path: str,
        *,
        table: str = DEFAULT_TABLE,
        busy_timeout: timedelta = DEFAULT_BUSY_TIMEOUT,
    ) -> None:
        super().__init__(SQLiteDialect(table))
        self.path = path
        self._busy_timeout = busy_timeout
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        # This process's writers queue here, not in SQLite's busy handler: that one sleeps
        # 1, 2, 5, 10... ms between tries, which under concurrent requests is most of a
        # write's time. Other processes' writers are still waited for by busy_timeout.
        self._writer = threading.RLock()

    def connect(self) -> sqlite3.Connection:
        """A new connection to the store's file, set up as idempo expects (WAL, busy timeout)."""
        conn = sqlite3.connect(
            self.path,
            timeout=self._busy_timeout.total_seconds(),
            isolation_level=None,
            check_same_thread=False,
        )
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def _connection(self) -> sqlite3.Connection:
        conn: sqlite3.Connection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = self.connect()
            with self._lock:
                self._connections.append(conn)
        return conn

    def run(self, gen: TxGen[T]) -> T:
        if not self._writer.acquire(timeout=self._busy_timeout.total_seconds()):
            raise StoreUnavailableError("SQLite stayed locked by this process's other writers")
        try:
            return self._transaction(gen, "BEGIN IMMEDIATE")
        finally:
            self._writer.release()

    def read(self, gen: TxGen[T]) -> T:
        # A deferred transaction only reads a snapshot: it never waits behind a writer.
        return self._transaction(gen, "BEGIN")

    def _transaction(self, gen: TxGen[T], begin: str) -> T:
        conn = self._connection()
        try:
            conn.execute(begin)
            result = _Sqlite3Tx(conn, self.run).run(gen)
            conn.execute("COMMIT")
        except BaseException as exc:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            # Map first: a lock error from our own BEGIN IMMEDIATE arrives as sqlite3's.
            mapped = map_error(exc) if isinstance(exc, sqlite3.Error) else exc
            if isinstance(mapped, LockTimeoutError):
                raise StoreUnavailableError(f"SQLite stayed locked: {mapped}") from exc
            if mapped is not exc:
                raise mapped from exc
            raise
        return result

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> SyncUnit:
        """A unit that runs a guarded call on the app's ``sqlite3.Connection`` or SQLAlchemy
        session. The connection's own busy timeout bounds how long a duplicate waits."""
        logic = unit_logic(self.dialect, mode, lock_timeout or self._busy_timeout)
        if isinstance(conn, sqlite3.Connection):
            return SyncUnit(logic, _Sqlite3Tx(conn, self.run).run)
        from ._sqlalchemy import SqlAlchemyTx  # noqa: PLC0415 - optional dependency

        timeout = lock_timeout or self._busy_timeout
        return SyncUnit(logic, SqlAlchemyTx(conn, self.dialect, timeout, self.run, map_error).run)

    def close(self) -> None:
        with self._lock:
            connections, self._connections = self._connections, []
        for conn in connections:
            conn.close()
        self._local = threading.local()


class AsyncSQLiteStore(AsyncSqlStore):
    """The asynchronous twin of `SQLiteStore`: the same work in a worker thread."""

    def __init__(
        self,
        path: str,
        *,
        table: str = DEFAULT_TABLE,
        busy_timeout: timedelta = DEFAULT_BUSY_TIMEOUT,
    ) -> None:
        self._sync = SQLiteStore(path, table=table, busy_timeout=busy_timeout)
        super().__init__(self._sync.dialect)

    async def run(self, gen: TxGen[T]) -> T:
        return await asyncio.to_thread(self._sync.run, gen)

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> AsyncUnit:
        """A unit on the app's SQLAlchemy ``AsyncSession`` / ``AsyncConnection`` (aiosqlite)."""
        from ._sqlalchemy import AsyncSqlAlchemyTx  # noqa: PLC0415 - optional dependency

        timeout = lock_timeout or DEFAULT_BUSY_TIMEOUT
        logic = unit_logic(self.dialect, mode, timeout)
        return AsyncUnit(
            logic, AsyncSqlAlchemyTx(conn, self.dialect, timeout, self.run, map_error).run
        )

    async def aclose(self) -> None:
        self._sync.close()
