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

import math
import re
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import timedelta
from functools import lru_cache
from time import monotonic
from typing import Any, Self, TypeVar

try:
    import psycopg
    from psycopg import IsolationLevel
    from psycopg import errors as pg_errors
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.pq import TransactionStatus
    from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from ..errors import ConfigurationError

    raise ConfigurationError(
        "the PostgreSQL store needs psycopg: pip install 'idempo[postgres]'"
    ) from exc

from ..errors import (
    ConfigurationError,
    FencedError,
    IdempotencyError,
    StoreError,
    StoreUnavailableError,
)
from . import DEFAULT_CONNECT_TIMEOUT, cannot_connect, schema_missing, seconds
from ._sql import FENCED_MARKER, PostgresDialect, Statement, adrive, drive, pyformat
from ._units import (
    PG_AGAIN_LOCK_TIMEOUT,
    PG_RESTORE_LOCK_TIMEOUT,
    PG_SET_LOCK_TIMEOUT,
    SAVEPOINT,
    AsyncSqlStore,
    AsyncUnit,
    Begin,
    Check,
    Commit,
    LockTimeoutError,
    Mark,
    OnStore,
    Rollback,
    SqlStore,
    SyncUnit,
    TransactionConflict,
    TransactionEnded,
    TxGen,
    Undo,
    pg_ms,
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
    if isinstance(exc, pg_errors.UndefinedTable):
        # Also what nextval() raises for a missing sequence: 'relation "..." does not exist'.
        text = exc.diag.message_primary or str(exc)
        return schema_missing("PostgreSQL", text.removesuffix(" does not exist"))
    if isinstance(exc, PoolClosed):
        return StoreUnavailableError(f"the PostgreSQL store is closed: {exc}")
    if isinstance(exc, PoolTimeout):
        return StoreUnavailableError(f"no connection from the app's PostgreSQL pool: {exc}")
    if isinstance(exc, psycopg.OperationalError):
        return StoreUnavailableError(f"PostgreSQL connection failed: {exc}")
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

_SAVEPOINT: Queued = (f"SAVEPOINT {SAVEPOINT}", None)
_RELEASE: Queued = (f"RELEASE SAVEPOINT {SAVEPOINT}", None)
_UNDO: Queued = (f"ROLLBACK TO SAVEPOINT {SAVEPOINT}", None)
_SET_LOCK_TIMEOUT = pyformat(PG_SET_LOCK_TIMEOUT)
_AGAIN_LOCK_TIMEOUT = pyformat(PG_AGAIN_LOCK_TIMEOUT)
_RESTORE_LOCK_TIMEOUT: Queued = (PG_RESTORE_LOCK_TIMEOUT, None)


@lru_cache(maxsize=64)
def _begin(isolation: int | None, read_only: bool | None, deferrable: bool | None) -> str:
    """BEGIN with the connection's own transaction settings, as psycopg's implicit BEGIN
    would carry them."""
    parts = ["BEGIN"]
    if isolation is not None:
        parts.append("ISOLATION LEVEL " + IsolationLevel(isolation).name.replace("_", " "))
    if read_only is not None:
        parts.append("READ ONLY" if read_only else "READ WRITE")
    if deferrable is not None:
        parts.append("DEFERRABLE" if deferrable else "NOT DEFERRABLE")
    return " ".join(parts)


class _Batch:
    """What the sync and async executors share: statements wait in a Python list and leave
    together when a result is needed, one statement as a plain execute, several in a psycopg
    pipeline (a pipeline costs an extra Sync, worth it only to save a round trip).

    In transactional mode the reservation leaves in one pipeline with all that surrounds it:
    BEGIN with the connection's own isolation level, read-only and deferrable settings, the
    reservation's lock timeout (the app's restored right after it), and the savepoint the
    work's writes can be rolled back to. The savepoint is taken at once, before the answer is
    known: a reservation that does not need it ends its transaction with it.
    """

    def __init__(
        self, conn: Any, lock_timeout: timedelta, on_store: Any, *, app: bool = False
    ) -> None:
        self.conn = conn
        self.on_store = on_store
        # On the app's connection a serialization failure or deadlock is the app's to see.
        self.app = app
        self.pending: list[Queued] = []
        self.result_at = -1  # which pending statement's rows the caller waits for
        self.default_wait = pg_ms(lock_timeout)
        self.reserving: str | None = None  # the reservation's lock timeout, while it runs
        self.marked = False  # the savepoint follows the reservation's last statement
        self.flip = False  # send with autocommit on, then give the app back its "off"
        self.restore_autocommit: bool | None = None

    def idle(self) -> bool:
        return bool(self.conn.info.transaction_status == TransactionStatus.IDLE)

    def begin(self, op: Begin) -> tuple[bool, bool | None]:
        """Queue what starts the transaction: whether this begins one, and the autocommit
        setting to switch to now (None: none)."""
        conn = self.conn
        if op.lazy:
            # psycopg's implicit BEGIN (with the connection's settings) will travel with the
            # app's first statement.
            if self.idle() and conn.autocommit:
                self.restore_autocommit = True
                return True, False
            return False, None
        if conn.read_only:
            raise ConfigurationError(
                "the connection is read-only (conn.read_only): transactional mode writes its"
                " record in the connection's transaction; use mode='leased' or no conn"
            )
        began = self.idle()
        if began:
            begin = _begin(conn.isolation_level, conn.read_only, conn.deferrable)
            self.pending.append((begin, None))
            # With autocommit off psycopg would send a BEGIN of its own first, a round trip
            # apart; it is off again as soon as ours is sent.
            self.flip = not conn.autocommit
        wait = self.default_wait if op.lock_timeout is None else pg_ms(op.lock_timeout)
        self.pending.append((_SET_LOCK_TIMEOUT, {"ms": wait}))
        self.reserving = wait
        return began, None

    def statement(self, sql: str, params: Any) -> None:
        pending = self.pending
        if self.reserving is None:
            pending.append((sql, params))
            self.result_at = len(pending) - 1
            return
        if self.marked:
            # The reservation asks again: the savepoint moves behind its new statement.
            pending += [_RELEASE, (_AGAIN_LOCK_TIMEOUT, {"ms": self.reserving})]
        pending.append((sql, params))
        self.result_at = len(pending) - 1
        pending += [_RESTORE_LOCK_TIMEOUT, _SAVEPOINT]
        self.marked = True

    def mark(self) -> None:
        self.reserving = None
        if not self.marked:
            self.pending += [_RESTORE_LOCK_TIMEOUT, _SAVEPOINT]
            self.marked = True

    def check(self) -> None:
        """The savepoint's release goes with the completion; it fails if the app ended the
        transaction (an idle connection says so without asking)."""
        if not self.marked:
            return
        if self.idle():
            raise TransactionEnded("the connection has no open transaction")
        self.pending.append(_RELEASE)
        self.marked = False

    def undo(self) -> None:
        if not self.marked or self.idle():
            raise TransactionEnded("the connection has no open transaction")
        self.pending.append(_UNDO)

    def take(self) -> tuple[list[Queued], int]:
        pending, self.pending = self.pending, []
        at, self.result_at = self.result_at, -1
        return pending, at

    def ended(self) -> bool | None:
        """The autocommit setting to give back to the app now its transaction is over."""
        self.reserving, self.marked, self.flip = None, False, False
        restore, self.restore_autocommit = self.restore_autocommit, None
        return restore

    @contextmanager
    def translated(self) -> Iterator[None]:
        """What the driver's errors mean to the transaction's logic."""
        try:
            yield
        except (pg_errors.InvalidSavepointSpecification, pg_errors.NoActiveSqlTransaction) as exc:
            # Only the guard's savepoint statements can fail so: the app ended it.
            raise TransactionEnded(str(exc)) from exc
        except pg_errors.TransactionRollback as exc:  # see is_conflict
            if self.app:
                raise TransactionConflict(exc) from exc
            raise


def is_conflict(exc: BaseException) -> bool:
    """Whether a driver error ended the app's transaction: a serialization failure or a
    deadlock, which the app's own retry logic is there for."""
    return isinstance(exc, pg_errors.TransactionRollback)


def _autocommit_off(conn: Any) -> None:
    # psycopg refuses to change autocommit inside a transaction, though nothing but its own
    # choice of an implicit BEGIN depends on it: the app's connection goes on as it was set
    # (autocommit off), so a commit inside the block starts a new transaction, as it would.
    conn._autocommit = False


class _PsycopgTx:
    """Runs transaction operations on one sync psycopg connection. ``on_store`` is given for
    the app's connection (a guarded call), None for the store's own."""

    def __init__(
        self, conn: psycopg.Connection[Any], lock_timeout: timedelta, on_store: Any = None
    ) -> None:
        self._conn = conn
        self._batch = _Batch(conn, lock_timeout, on_store, app=on_store is not None)

    def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            try:
                return drive(gen, self._do)
            finally:
                self._send()

    def _send(self) -> psycopg.Cursor[Any] | None:
        batch = self._batch
        pending, at = batch.take()
        if not pending:
            return None
        flip, batch.flip = batch.flip, False
        with mapped_errors(), batch.translated():
            if flip:
                self._conn.autocommit = True
            try:
                if len(pending) == 1:
                    sql, params = pending[0]
                    return self._conn.execute(sql, params, prepare=params is not None)
                with self._conn.pipeline():
                    cursors = [
                        self._conn.execute(sql, params, prepare=params is not None)
                        for sql, params in pending
                    ]
                return cursors[at]
            finally:
                if flip:
                    _autocommit_off(self._conn)

    def _end(self) -> None:
        restore = self._batch.ended()
        if restore is not None:
            self._conn.autocommit = restore

    def _do(self, op: Any) -> Any:
        batch = self._batch
        with mapped_errors():
            match op:
                case Statement(sql, params, fetch):
                    batch.statement(_pyformat(sql), params)
                    cursor = self._send() if fetch else None
                    return cursor.fetchall() if cursor is not None else None
                case Begin():
                    began, switch = batch.begin(op)
                    if switch is not None:
                        self._conn.autocommit = switch
                    return began
                case Mark():
                    return batch.mark()
                case Check():
                    return batch.check()
                case Undo():
                    batch.undo()
                    self._send()
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
        self._batch = _Batch(conn, lock_timeout, on_store, app=on_store is not None)

    async def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            try:
                return await adrive(gen, self._do)
            finally:
                await self._send()

    async def _send(self) -> psycopg.AsyncCursor[Any] | None:
        batch = self._batch
        pending, at = batch.take()
        if not pending:
            return None
        flip, batch.flip = batch.flip, False
        with mapped_errors(), batch.translated():
            if flip:
                await self._conn.set_autocommit(True)
            try:
                if len(pending) == 1:
                    sql, params = pending[0]
                    return await self._conn.execute(sql, params, prepare=params is not None)
                async with self._conn.pipeline():
                    cursors = [
                        await self._conn.execute(sql, params, prepare=params is not None)
                        for sql, params in pending
                    ]
                return cursors[at]
            finally:
                if flip:
                    _autocommit_off(self._conn)

    async def _end(self) -> None:
        restore = self._batch.ended()
        if restore is not None:
            await self._conn.set_autocommit(restore)

    async def _do(self, op: Any) -> Any:
        batch = self._batch
        with mapped_errors():
            match op:
                case Statement(sql, params, fetch):
                    batch.statement(_pyformat(sql), params)
                    cursor = await self._send() if fetch else None
                    return await cursor.fetchall() if cursor is not None else None
                case Begin():
                    began, switch = batch.begin(op)
                    if switch is not None:
                        await self._conn.set_autocommit(switch)
                    return began
                case Mark():
                    return batch.mark()
                case Check():
                    return batch.check()
                case Undo():
                    batch.undo()
                    await self._send()
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
# How long a call waits for a connection when all of a healthy pool's are in use.
POOL_TIMEOUT_SECONDS = 30.0
# While the pool cannot connect, how often a waiting call looks at why; a failure younger
# than _FRESH is the server's state now, an older one is checked again by connecting.
_POLL_SECONDS = 0.1
_FRESH_SECONDS = 1.0

_RESOLVE = re.compile(
    r"failed to resolve host '([^']*)'" r'|could not translate host name "([^"]*)"'
)
_MISSING = re.compile(r'(?:database|role) "[^"]*" does not exist')
_PASSWORD = re.compile(r'password authentication failed for user "[^"]*"')


def _reason(exc: BaseException, timeout: int) -> str:
    """What a failed connection attempt means, in a few words (the driver's text is the
    error's cause)."""
    text = str(exc)
    if isinstance(exc, pg_errors.ConnectionTimeout) or "timeout expired" in text:
        return f"no answer within {timeout} s"
    if "Connection refused" in text:
        return "connection refused"
    if found := _MISSING.search(text):
        return found[0]
    if found := _PASSWORD.search(text):
        return f"bad credentials: {found[0]}"
    if "no password supplied" in text:
        return "bad credentials: the server wants a password and none was given"
    if found := _RESOLVE.search(text):
        return f"unknown host {found[1] or found[2]!r}"
    return text.removeprefix("connection failed: ").split("\n", 1)[0]


class _Connector:
    """How the store's own pool connects, and what it found when it last tried.

    psycopg_pool connects in the background and retries with a growing backoff; a call
    waiting on it learns nothing but "no connection after N seconds". The pool's
    connections are made by a class that records each attempt's outcome here, so a waiting
    call fails as soon as the pool cannot connect, with the server's own reason.
    """

    def __init__(
        self, conninfo: str, connect_timeout: timedelta | float | None, max_size: int
    ) -> None:
        try:
            params = conninfo_to_dict(conninfo)
        except psycopg.Error as exc:
            raise ConfigurationError(f"bad PostgreSQL URL: {exc}") from exc
        port = str(params.get("port") or "5432")
        if not all(part.isdigit() for part in port.split(",")):
            raise ConfigurationError(f"bad port in PostgreSQL URL: {port!r}")
        given = connect_timeout if connect_timeout is not None else params.get("connect_timeout")
        # libpq counts whole seconds, and at least 2.
        self.timeout = max(2, math.ceil(seconds(given or DEFAULT_CONNECT_TIMEOUT)))
        host = str(params.get("host") or params.get("hostaddr") or "localhost")
        self.where = f"{host}:{port}/{params.get('dbname') or params.get('user') or ''}"
        self.conninfo = conninfo
        self.kwargs: dict[str, Any] = {"autocommit": True, "connect_timeout": self.timeout}
        self.max_size = max_size
        self.failure: psycopg.Error | None = None
        self.failed_at = 0.0
        self.connected = False

    def failed(self, exc: psycopg.Error) -> None:
        self.failure, self.failed_at = exc, monotonic()

    def succeeded(self) -> None:
        self.failure, self.connected = None, True

    def wait(self, deadline: float) -> float:
        """How long the next wait for a pooled connection may last."""
        left = max(deadline - monotonic(), 0.001)
        # A healthy pool hands its connections out in turn: wait once, keep the place.
        return left if self.connected and self.failure is None else min(_POLL_SECONDS, left)

    def gave_up(self, deadline: float, timed_out: PoolTimeout) -> bool:
        """After a wait timed out: True to connect directly (the pool's last attempt failed
        a while ago, the server may be back); raises when the server is known to be down
        or the deadline passed; False to wait again."""
        failure = self.failure
        if failure is not None:
            if monotonic() - self.failed_at < _FRESH_SECONDS:
                raise self.error(failure) from failure
            return True
        if monotonic() >= deadline:
            raise StoreUnavailableError(
                f"no free PostgreSQL connection within {POOL_TIMEOUT_SECONDS:g} s:"
                f" all {self.max_size} are in use"
            ) from timed_out
        return False

    def error(self, exc: BaseException) -> StoreUnavailableError:
        return cannot_connect("PostgreSQL", self.where, _reason(exc, self.timeout))


def _watched(connector: _Connector) -> type[psycopg.Connection[Any]]:
    class Watched(psycopg.Connection[Any]):
        @classmethod
        def connect(cls, *args: Any, **kwargs: Any) -> Self:
            try:
                conn = super().connect(*args, **kwargs)
            except psycopg.Error as exc:
                connector.failed(exc)
                raise
            connector.succeeded()
            return conn

    return Watched


def _awatched(connector: _Connector) -> type[psycopg.AsyncConnection[Any]]:
    class Watched(psycopg.AsyncConnection[Any]):
        @classmethod
        async def connect(cls, *args: Any, **kwargs: Any) -> Self:
            try:
                conn = await super().connect(*args, **kwargs)
            except psycopg.Error as exc:
                connector.failed(exc)
                raise
            connector.succeeded()
            return conn

    return Watched


def _timeout(connector: _Connector | None) -> timedelta | None:
    """The connect timeout in force; None on the app's own pool, which has its own."""
    return None if connector is None else timedelta(seconds=connector.timeout)


class PostgresStore(SqlStore):
    """A PostgreSQL store. Safe to share between threads; each verb borrows a pooled connection.

    Args:
        conninfo: a libpq URL or DSN, or an open ``psycopg_pool.ConnectionPool`` whose
            connections are in autocommit mode.
        table: the records table (``schema.table`` allowed); create it with `migrate`.
        max_size: pool size when idempo makes the pool.
        connect_timeout: how long connecting may take (seconds or a timedelta; libpq counts
            whole seconds, at least 2); default: the URL's ``connect_timeout``, else 5 s.
            A call on a server that is down, refuses or does not answer fails within it,
            with `StoreUnavailableError` saying why (connection refused, unknown database or
            role, bad credentials, unknown host, no answer).

    >>> store = PostgresStore("postgresql://postgres@127.0.0.1/test")  # doctest: +SKIP
    """

    def __init__(
        self,
        conninfo: str | ConnectionPool[Any],
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 10,
        connect_timeout: timedelta | float | None = None,
    ) -> None:
        super().__init__(PostgresDialect(table))
        self._owns_pool = not isinstance(conninfo, ConnectionPool)
        self._connector: _Connector | None = None
        if isinstance(conninfo, str):
            self._connector = connector = _Connector(conninfo, connect_timeout, max_size)
            conninfo = ConnectionPool(
                conninfo,
                kwargs=connector.kwargs,
                connection_class=_watched(connector),
                min_size=1,
                max_size=max_size,
                open=True,
            )
        self._pool: ConnectionPool[Any] = conninfo
        self.connect_timeout = _timeout(self._connector)

    @contextmanager
    def _connection(self) -> Iterator[psycopg.Connection[Any]]:
        """One of the pool's connections, or when the pool cannot connect, one made here."""
        conn, pooled = self._checkout()
        try:
            with conn:
                yield conn
        finally:
            if pooled:
                self._pool.putconn(conn)

    def _checkout(self) -> tuple[psycopg.Connection[Any], bool]:
        connector = self._connector
        if connector is None:
            return self._pool.getconn(), True  # the app's pool, with its own timeout
        deadline = monotonic() + POOL_TIMEOUT_SECONDS
        while True:
            try:
                return self._pool.getconn(timeout=connector.wait(deadline)), True
            except PoolTimeout as exc:
                if connector.gave_up(deadline, exc):
                    break
        try:
            conn = self._pool.connection_class.connect(connector.conninfo, **connector.kwargs)
        except psycopg.Error as exc:
            raise connector.error(exc) from exc
        return conn, False

    def run(self, gen: TxGen[T]) -> T:
        with mapped_errors(), self._connection() as conn:
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

        executor = SqlAlchemyTx(
            conn, self.dialect, timeout, self.run, map_error, conflict=is_conflict
        )
        return SyncUnit(logic, executor.run)

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
        connect_timeout: timedelta | float | None = None,
    ) -> None:
        super().__init__(PostgresDialect(table))
        self._owns_pool = not isinstance(conninfo, AsyncConnectionPool)
        self._connector: _Connector | None = None
        if isinstance(conninfo, str):
            self._connector = connector = _Connector(conninfo, connect_timeout, max_size)
            conninfo = AsyncConnectionPool(
                conninfo,
                kwargs=connector.kwargs,
                connection_class=_awatched(connector),
                min_size=1,
                max_size=max_size,
                open=False,
            )
        self._pool: AsyncConnectionPool[Any] = conninfo
        self._opened = not self._owns_pool
        self.connect_timeout = _timeout(self._connector)

    @asynccontextmanager
    async def _connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The asynchronous twin of `PostgresStore._connection`."""
        if not self._opened:
            await self._pool.open()
            self._opened = True
        conn, pooled = await self._checkout()
        try:
            async with conn:
                yield conn
        finally:
            if pooled:
                await self._pool.putconn(conn)

    async def _checkout(self) -> tuple[psycopg.AsyncConnection[Any], bool]:
        connector = self._connector
        if connector is None:
            return await self._pool.getconn(), True
        deadline = monotonic() + POOL_TIMEOUT_SECONDS
        while True:
            try:
                return await self._pool.getconn(timeout=connector.wait(deadline)), True
            except PoolTimeout as exc:
                if connector.gave_up(deadline, exc):
                    break
        try:
            connect = self._pool.connection_class.connect
            conn = await connect(connector.conninfo, **connector.kwargs)
        except psycopg.Error as exc:
            raise connector.error(exc) from exc
        return conn, False

    async def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            async with self._connection() as conn:
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

        executor = AsyncSqlAlchemyTx(
            conn, self.dialect, timeout, self.run, map_error, conflict=is_conflict
        )
        return AsyncUnit(logic, executor.run)

    async def aclose(self) -> None:
        if self._owns_pool:
            await self._pool.close()
