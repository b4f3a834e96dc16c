"""PostgreSQL store (psycopg 3), sync and async, leased and transactional.

Leased mode runs each verb on a pooled autocommit connection: one round trip per verb.
Transactional mode runs on the app's own connection. Statements are queued in psycopg's
pipeline and sent when a result is needed, so the reservation travels with BEGIN and the
completion with COMMIT: a guarded business transaction costs the same three round trips as
the bare one (BEGIN + reserve, the app's write, complete + COMMIT), and a replay two (one with
``one_trip_replays``).

    store = PostgresStore("postgresql://app@db/app")
    store.migrate()
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from datetime import timedelta
from functools import lru_cache, partial
from time import monotonic, sleep
from typing import Any, Self, TypeVar

from .._core.keys import Scope
from .._optional import optional_import

with optional_import("the PostgreSQL store needs psycopg", extra="postgres"):
    import psycopg
    from psycopg import IsolationLevel
    from psycopg import errors as pg_errors
    from psycopg.conninfo import conninfo_to_dict
    from psycopg.pq import ExecStatus, TransactionStatus
    from psycopg_pool import AsyncConnectionPool, ConnectionPool, PoolClosed, PoolTimeout

from ..errors import (
    ConfigurationError,
    FencedError,
    StoreError,
    StoreUnavailableError,
)
from . import DEFAULT_CONNECT_TIMEOUT, cannot_connect, schema_missing, seconds
from ._kept import KEEP_SECONDS, KeptConnections
from ._pgwire import exchange
from ._sql.binding import sqlalchemy_connection
from ._sql.dialect import FENCED_MARKER, Statement, pyformat
from ._sql.postgres import UNHELD_MARKER, PostgresDialect, Watch, pg_ms
from ._sql.transaction import (
    SAVEPOINT,
    AsyncSqlStore,
    AsyncUnit,
    Begin,
    Bound,
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
    UnitLogic,
    adrive,
    aexecute,
    drive,
    execute,
    mapped,
    unit_logic,
)
from ._watchdog import Watchdog
from .base import Mode

__all__ = ["AsyncPostgresStore", "PostgresStore"]

T = TypeVar("T")
C = TypeVar("C")


@lru_cache(maxsize=256)
def _pyformat(sql: str) -> str | bytes:
    """``sql`` as psycopg takes it, made once: encoded when it is ASCII (the same bytes in
    every client encoding), because psycopg encodes a str again on every call and hashes the
    new bytes to find its parse of it, several kB for a reservation, on every statement."""
    query = pyformat(sql)
    return query.encode() if query.isascii() else query


# Few distinct lock timeouts are ever asked for; a cached one costs no Python call.
_pg_ms = lru_cache(maxsize=64)(pg_ms)


def map_error(exc: BaseException) -> BaseException:
    """A psycopg error as the idempo error it means; anything else unchanged."""
    if isinstance(exc, pg_errors.InvalidTextRepresentation) and FENCED_MARKER in str(exc):
        stale = str(exc).split(FENCED_MARKER, 1)[1].lstrip(": ").split('"')[0]
        return FencedError(f"cannot settle: {stale}")
    if isinstance(exc, pg_errors.LockNotAvailable):
        return LockTimeoutError(str(exc))
    if isinstance(exc, pg_errors.UndefinedFunction) and "_reserve(" in str(exc):
        # The reservation function, dropped since the store found it (the dialect then
        # asks again on its next reservation).
        text = exc.diag.message_primary or str(exc)
        return schema_missing("PostgreSQL", text.removesuffix(" does not exist"))
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


def error(exc: BaseException) -> BaseException:
    """What a failure means to the logic: the driver's errors as idempo's (the cause kept),
    idempo's own unchanged. Applied once, where a failure leaves the executor."""
    if isinstance(exc, psycopg.Error):
        return mapped(exc, map_error(exc))
    return exc


Queued = tuple[str | bytes, Any]

# Statements of no parameters go as bytes (libpq's calls take nothing else).
_SAVEPOINT: Queued = (f"SAVEPOINT {SAVEPOINT}".encode(), None)
_RELEASE: Queued = (f"RELEASE SAVEPOINT {SAVEPOINT}".encode(), None)
_UNDO: Queued = (f"ROLLBACK TO SAVEPOINT {SAVEPOINT}".encode(), None)
_BEGIN: Queued = (b"BEGIN", None)
_COMMIT_SQL: Queued = (b"COMMIT", None)
_UNHELD: Queued = (PostgresDialect.UNHELD_SQL.encode(), None)
_SET_SESSION_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %(ms)s, false)"
# The lock timeout the store set on one of its own connections (an attribute of it).
_LOCK_TIMEOUT_SET = "_idempo_lock_timeout"


@lru_cache(maxsize=64)
def _begin(isolation: int | None, read_only: bool | None, deferrable: bool | None) -> bytes:
    """BEGIN with the connection's own transaction settings, as psycopg's implicit BEGIN
    would carry them."""
    parts = ["BEGIN"]
    if isolation is not None:
        parts.append("ISOLATION LEVEL " + IsolationLevel(isolation).name.replace("_", " "))
    if read_only is not None:
        parts.append("READ ONLY" if read_only else "READ WRITE")
    if deferrable is not None:
        parts.append("DEFERRABLE" if deferrable else "NOT DEFERRABLE")
    return " ".join(parts).encode()


class _Batch:
    """What the sync and async executors share: statements wait in a Python list and leave
    together when a result is needed, one statement as a plain execute, several in a psycopg
    pipeline (a pipeline costs an extra Sync, worth it only to save a round trip).

    In transactional mode the reservation leaves in one pipeline with all that surrounds it:
    BEGIN with the connection's own isolation level, read-only and deferrable settings, and
    the savepoint the work's writes can be rolled back to (the reservation's statement sets
    its own lock timeout and puts the app's back). The savepoint is taken at once, before the
    answer is known: a reservation that does not need it ends its transaction with it.

    When the guard begins the transaction and the connection leaves every transaction
    setting to the server (isolation level, read-only, deferrable: None), the reservation
    goes first and BEGIN behind it: ``reservation, unheld check, BEGIN, SAVEPOINT``.
    PostgreSQL runs the statements before BEGIN in the implicit transaction of the pipeline,
    which BEGIN turns into the explicit one, reservation included, with the session's default
    isolation level (taken when the reservation started it). A reservation that took no key
    (a replay, a mismatch, a duplicate in progress, a lost race) fails the check: the server
    skips the rest and rolls that transaction back at the Sync, so a replay costs one round
    trip and leaves the connection idle, as it found it. The price: the check's error is in
    the server's log, once per replay. With settings of its own, BEGIN carries them and goes
    first (they cannot be set once a statement ran), and a replay ends its transaction with
    a COMMIT a round trip later.
    """

    def __init__(
        self, conn: Any, on_store: Any, *, app: bool = False, one_trip: bool = False
    ) -> None:
        self.conn = conn
        # Whether a replay may end its transaction by the unheld check's error (see above).
        self.one_trip = one_trip
        self.on_store = on_store
        # On the app's connection a serialization failure or deadlock is the app's to see.
        self.app = app
        self.pending: list[Queued] = []
        self.result_at = -1  # which pending statement's rows the caller waits for
        self.reserving = False  # the reservation's statements follow, in the transaction
        self.implicit = False  # ... and BEGIN goes behind them (see above)
        self.marked = False  # the savepoint follows the reservation's last statement
        self.flip = False  # send with autocommit on, then give the app back its "off"
        self.answer: Any = None  # what `need` answered, when nothing was left to do

    def idle(self) -> bool:
        return bool(self.conn.pgconn.transaction_status == TransactionStatus.IDLE)

    def begin(self, op: Begin) -> bool:
        """Queue what starts the transaction: whether this begins one."""
        conn = self.conn
        if op.reserves and conn.read_only:
            raise ConfigurationError(
                "the connection is read-only (conn.read_only): transactional mode writes its"
                " record in the connection's transaction; use mode='leased' or no conn"
            )
        began = self.idle()
        self.reserving = op.reserves
        self.implicit = (
            self.one_trip and began and op.reserves and not self.pending and _no_settings(conn)
        )
        if began and not self.implicit:
            begin = _begin(conn.isolation_level, conn.read_only, conn.deferrable)
            self.pending.append((begin, None))
            # With autocommit off psycopg would send a BEGIN of its own first, a round trip
            # apart; it is off again as soon as ours is sent.
            self.flip = not conn.autocommit
        return began

    def statement(self, sql: str | bytes, params: Any) -> None:
        pending = self.pending
        if not self.reserving:
            pending.append((sql, params))
            self.result_at = len(pending) - 1
            return
        if self.implicit and self.idle():
            # First, or again after a try that took nothing ended its transaction.
            pending += [(sql, params), _UNHELD, _BEGIN, _SAVEPOINT]
            self.result_at = len(pending) - 4
            self.flip = not self.conn.autocommit
        else:
            if self.marked:
                # The reservation asks again: the savepoint moves behind its new statement.
                pending.append(_RELEASE)
            pending += [(sql, params), _SAVEPOINT]
            self.result_at = len(pending) - 2
        self.marked = True

    def mark(self) -> None:
        if not self.marked:
            self.pending.append(_SAVEPOINT)
            self.marked = True
        self.reserving = self.implicit = False

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

    def bound(self, op: Bound) -> Queued | None:
        """The statement that sets the store's own connection's lock timeout to ``op``'s,
        None when it is set already. Session-wide and sent alone (a setting made in a
        transaction that fails is undone), so it is sent once per connection and value."""
        wait = _pg_ms(op.lock_timeout)
        if getattr(self.conn, _LOCK_TIMEOUT_SET, None) == wait:
            return None
        return (_SET_SESSION_LOCK_TIMEOUT, {"ms": wait})

    def bound_set(self, params: Any) -> None:
        setattr(self.conn, _LOCK_TIMEOUT_SET, params["ms"])

    def take(self) -> tuple[list[Queued], int]:
        pending = self.pending[:]
        self.pending.clear()  # the same list: the executor's ``pending`` is this one
        at, self.result_at = self.result_at, -1
        return pending, at

    def ended(self) -> None:
        """The transaction is over."""
        self.reserving = self.implicit = self.marked = self.flip = False

    def outcome(self, answers: list[Any], at: int) -> Any:
        """The rows of the awaited statement of a batch (`_pgwire.exchange`'s answers);
        raises what failed, unless only the unheld check did: then the reservation's rows
        came back, and the transaction it ran in is over (it held nothing, so nothing is
        lost)."""
        failed = next((a for a in answers if isinstance(a, BaseException)), None)
        if failed is None:
            return None if at < 0 else answers[at]
        if isinstance(failed, pg_errors.InvalidTextRepresentation) and UNHELD_MARKER in str(failed):
            self.marked = False
            return answers[at]
        raise failed

    def translate(self, exc: BaseException) -> BaseException:
        """What a failure of sent statements means to the transaction's logic."""
        if isinstance(
            exc, pg_errors.InvalidSavepointSpecification | pg_errors.NoActiveSqlTransaction
        ):
            # Only the guard's savepoint statements can fail so: the app ended it.
            return mapped(exc, TransactionEnded(str(exc)))
        if self.app and is_conflict(exc):
            return mapped(exc, TransactionConflict(exc))
        return error(exc)

    def need(self, op: Any) -> int:
        """Take ``op`` into the batch: what is left for the face to do (`_DONE`: nothing,
        the answer is ``self.answer``)."""
        self.answer = None
        if isinstance(op, Statement):
            self.statement(op.sql, op.params)
            return _FETCH if op.fetch else _DONE
        if isinstance(op, Begin):
            self.answer = self.begin(op)
            return _DONE
        if isinstance(op, Mark):
            self.mark()
            return _DONE
        if isinstance(op, Check):
            self.check()
            return _DONE
        if isinstance(op, Undo):
            self.undo()
            return _SEND
        if isinstance(op, Commit):
            if not self.pending and self.idle():
                # The reservation's transaction ended with it (it took no key): nothing to
                # commit, and a COMMIT would only draw a warning.
                self.ended()
                return _DONE
            self.pending.append(_COMMIT_SQL)
            return _COMMIT
        if isinstance(op, Rollback):
            self.take()  # what was never sent needs no undoing
            return _ROLLBACK
        if isinstance(op, OnStore):
            return _ON_STORE
        if isinstance(op, Bound):
            self.answer = self.bound(op)
            return _DONE if self.answer is None else _BOUND
        raise AssertionError(f"unknown operation {op!r}")


def _no_settings(conn: Any) -> bool:
    """Whether the connection leaves every transaction setting to the server."""
    return conn.isolation_level is None and conn.read_only is None and conn.deferrable is None


_SAVEPOINT_GONE = (pg_errors.InvalidSavepointSpecification, pg_errors.NoActiveSqlTransaction)

# What is left for an executor's face to do after `_Batch.need`: sans-I/O above, the
# driver's calls below.
_DONE, _FETCH, _SEND, _COMMIT, _ROLLBACK, _ON_STORE, _BOUND = range(7)


def is_conflict(exc: BaseException) -> bool:
    """Whether a driver error ended the app's transaction: a serialization failure or a
    deadlock, which the app's own retry logic is there for."""
    # SQLSTATE class 40, "transaction rollback": psycopg does not make its serialization
    # failure (40001) or deadlock (40P01) subclasses of its TransactionRollback.
    return isinstance(exc, psycopg.Error) and (exc.sqlstate or "").startswith("40")


def _in_transaction(conn: Any) -> bool:
    """Whether a store's call left ``conn`` inside a transaction (to roll back before the
    next call, as the pool would, with a warning in its log)."""
    status = conn.pgconn.transaction_status
    return status in (TransactionStatus.INTRANS, TransactionStatus.INERROR)


def _rows(cursor: Any) -> Any:
    """What a statement psycopg sent answered: its rows, or None when it returns none (or
    did not run: the pipeline's error is the answer then)."""
    return cursor.fetchall() if _has_rows(cursor) else None


async def _arows(cursor: Any) -> Any:
    return await cursor.fetchall() if _has_rows(cursor) else None


def _has_rows(cursor: Any) -> bool:
    result = cursor.pgresult
    return result is not None and result.status == ExecStatus.TUPLES_OK


def _autocommit_off(conn: Any) -> None:
    # psycopg refuses to change autocommit inside a transaction, though nothing but its own
    # choice of an implicit BEGIN depends on it: the app's connection goes on as it was set
    # (autocommit off), so a commit inside the block starts a new transaction, as it would.
    conn._autocommit = False


class _PsycopgTx:
    """Runs transaction operations on one sync psycopg connection: the `_Batch` decides,
    this face only makes psycopg's calls. ``on_store`` is given for the app's connection (a
    guarded call), None for the store's own."""

    def __init__(
        self, conn: psycopg.Connection[Any], on_store: Any = None, *, one_trip: bool = False
    ) -> None:
        self._conn = conn
        self.batch = _Batch(conn, on_store, app=on_store is not None, one_trip=one_trip)
        self.pending = self.batch.pending
        self.error = error

    def do(self, op: Any) -> Any:
        batch = self.batch
        need = batch.need(op)
        if need == _DONE:
            return batch.answer
        if need == _FETCH:
            return self.flush()
        if need == _ON_STORE:
            return batch.on_store(op.gen)
        if need == _BOUND:
            sql, params = batch.answer
            try:
                self._conn.execute(sql, params)
            except psycopg.Error as exc:
                raise batch.translate(exc)  # noqa: B904 - the cause is set
            batch.bound_set(params)
            return None
        if need != _ROLLBACK:
            self.flush()
        elif not batch.idle():
            self._conn.execute("ROLLBACK")
        if need != _SEND:
            batch.ended()
        return None

    def flush(self) -> Any:
        """Send what is queued; the rows of the statement whose rows are awaited."""
        batch = self.batch
        pending, at = batch.take()
        if not pending:
            return None
        flip, batch.flip = batch.flip, False
        conn = self._conn
        try:
            if conn.pgconn.pipeline_status:  # the app's own pipeline: psycopg's to send
                return self._through_psycopg(pending, at, flip)
            with conn.lock:
                answers = drive(exchange(conn, pending), conn.wait)
            return batch.outcome(answers, at)
        except psycopg.Error as exc:
            raise batch.translate(exc)  # noqa: B904 - the cause is set

    def _through_psycopg(self, pending: list[Queued], at: int, flip: bool) -> Any:
        """Send what is queued with psycopg's own calls, in the pipeline the app has open."""
        conn = self._conn
        if flip:
            conn.autocommit = True
        try:
            cursors: list[psycopg.Cursor[Any]] = []
            failed: psycopg.Error | None = None
            try:
                with conn.pipeline():
                    try:  # caught inside, so that psycopg logs no error of its own
                        for q, p in pending:
                            query = q if p is None else _pyformat(q)
                            cursors.append(conn.execute(query, p, prepare=p is not None))
                    except psycopg.Error as exc:  # the server skips the rest
                        failed = exc
            except psycopg.Error as exc:  # from the Sync
                failed = failed or exc
            answers: list[Any] = [_rows(cursor) for cursor in cursors]
            return self.batch.outcome([*answers, *([failed] if failed else [])], at)
        finally:
            if flip:
                _autocommit_off(conn)


class _AsyncPsycopgTx:
    """The asynchronous face of `_PsycopgTx`: the same calls, awaited."""

    def __init__(
        self, conn: psycopg.AsyncConnection[Any], on_store: Any = None, *, one_trip: bool = False
    ) -> None:
        self._conn = conn
        self.batch = _Batch(conn, on_store, app=on_store is not None, one_trip=one_trip)
        self.pending = self.batch.pending
        self.error = error

    async def do(self, op: Any) -> Any:
        batch = self.batch
        need = batch.need(op)
        if need == _DONE:
            return batch.answer
        if need == _FETCH:
            return await self.flush()
        if need == _ON_STORE:
            return await batch.on_store(op.gen)
        if need == _BOUND:
            sql, params = batch.answer
            try:
                await self._conn.execute(sql, params)
            except psycopg.Error as exc:
                raise batch.translate(exc)  # noqa: B904 - the cause is set
            batch.bound_set(params)
            return None
        if need != _ROLLBACK:
            await self.flush()
        elif not batch.idle():
            await self._conn.execute("ROLLBACK")
        if need != _SEND:
            batch.ended()
        return None

    async def flush(self) -> Any:
        batch = self.batch
        pending, at = batch.take()
        if not pending:
            return None
        flip, batch.flip = batch.flip, False
        conn = self._conn
        try:
            if conn.pgconn.pipeline_status:
                return await self._through_psycopg(pending, at, flip)
            async with conn.lock:
                answers = await adrive(exchange(conn, pending), conn.wait)
            return batch.outcome(answers, at)
        except psycopg.Error as exc:
            raise batch.translate(exc)  # noqa: B904 - the cause is set

    async def _through_psycopg(self, pending: list[Queued], at: int, flip: bool) -> Any:
        conn = self._conn
        if flip:
            await conn.set_autocommit(True)
        try:
            cursors: list[psycopg.AsyncCursor[Any]] = []
            failed: psycopg.Error | None = None
            try:
                async with conn.pipeline():
                    try:  # caught inside, so that psycopg logs no error of its own
                        for q, p in pending:
                            query = q if p is None else _pyformat(q)
                            cursors.append(await conn.execute(query, p, prepare=p is not None))
                    except psycopg.Error as exc:  # the server skips the rest
                        failed = exc
            except psycopg.Error as exc:  # from the Sync
                failed = failed or exc
            answers: list[Any] = [await _arows(cursor) for cursor in cursors]
            return self.batch.outcome([*answers, *([failed] if failed else [])], at)
        finally:
            if flip:
                _autocommit_off(conn)


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


def _connector(
    conninfo: Any, connect_timeout: timedelta | float | None, max_size: int
) -> _Connector | None:
    """How the store's own pool connects; None when the app gave its pool."""
    if not isinstance(conninfo, str):
        return None
    return _Connector(conninfo, connect_timeout, max_size)


def _pool(conninfo: Any, connector: _Connector | None, kind: Any, watched: Any) -> Any:
    """The app's pool as given, or the store's own (``kind``: the sync or async pool
    class; the async one opens on first use, inside the running event loop)."""
    if connector is None:
        return conninfo
    return kind(
        connector.conninfo,
        kwargs=connector.kwargs,
        connection_class=watched(connector),
        min_size=1,
        max_size=connector.max_size,
        open=kind is ConnectionPool,
    )


def _timeout(connector: _Connector | None) -> timedelta | None:
    """The connect timeout in force; None on the app's own pool, which has its own."""
    return None if connector is None else timedelta(seconds=connector.timeout)


# A waiting duplicate that finds every seat taken polls, as the flow does with a store that
# cannot wake it. Seconds.
_NO_SEAT_POLL_SECONDS = 0.05


def _seats(pool_size: int) -> threading.Semaphore:
    """How many waiting duplicates may hold one of the pool's connections at once: half of
    them, so that waiters never take the connections the attempts they wait for need to
    settle (a waiter that finds no seat polls). A semaphore taken without blocking: a store
    is shared by threads, and an async waiter must not block its loop."""
    return threading.Semaphore(pool_size // 2)


@contextmanager
def _closed_unless_done(conn: Any) -> Iterator[None]:
    """Close ``conn`` if the block does not end (a failure, a cancellation): what it left on
    the session (a LISTEN, an advisory lock) ends with it, and its pool drops it. Closing
    never waits, so a cancelled task closes it too."""
    try:
        yield
    except BaseException:
        conn.pgconn.finish()
        raise


def _socket_of(conn: Any) -> int:
    return int(conn.pgconn.socket)


def _lock_wait(conn: Any) -> float:
    """How long a statement on one of the store's connections may wait on a row lock: the
    lock timeout the store set on it, seconds."""
    ms = getattr(conn, _LOCK_TIMEOUT_SET, None)
    if ms is None:
        return DEFAULT_LOCK_TIMEOUT.total_seconds()
    return int(str(ms).removesuffix("ms")) / 1000


def _watchdog(connector: _Connector | None, read_timeout: timedelta | float | None) -> Watchdog:
    """The bound on a call's wait for the server's answer beyond its lock wait:
    ``read_timeout``, else the connect timeout (a server given that long to accept a
    connection is given as long to answer a statement)."""
    if read_timeout is not None:
        bound = seconds(read_timeout)
    elif connector is None:
        bound = DEFAULT_CONNECT_TIMEOUT.total_seconds()
    else:
        bound = connector.timeout
    if bound <= 0:
        raise ConfigurationError(f"read_timeout must be positive, not {read_timeout!r}")
    return Watchdog(bound, _socket_of, _lock_wait, server="PostgreSQL")


def _logic(dialect: PostgresDialect, mode: Mode, lock_timeout: timedelta | None) -> UnitLogic:
    """The logic of a guarded call on the app's connection. In transactional mode the
    reservation's statement sets its lock timeout itself (the policy's, or a caller's
    shorter bound); leased mode reserves on the store's own connection."""
    timeout = lock_timeout or DEFAULT_LOCK_TIMEOUT
    if mode == "transactional":
        return unit_logic(dialect.waiting(timeout), mode, timeout, dialect.waiting)
    return unit_logic(dialect, mode, timeout)


class _Woken(SyncUnit):
    """The unit of a guarded call on the app's connection, whose duplicate told to wait
    waits as the store's own do (``wait_settled``, on one of the store's connections): the
    app's connection cannot listen inside the app's transaction, notifications arriving
    only between transactions. The reservation that follows still runs on the app's."""

    def __init__(self, logic: UnitLogic, run: Any, wait_settled: Any) -> None:
        super().__init__(logic, run)
        self.wait_settled = wait_settled


class _AsyncWoken(AsyncUnit):
    """The asynchronous face of `_Woken`."""

    def __init__(self, logic: UnitLogic, run: Any, wait_settled: Any) -> None:
        super().__init__(logic, run)
        self.wait_settled = wait_settled


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
        read_timeout: how long a call on one of the store's connections may wait for the
            server's answer beyond its lock timeout (seconds or a timedelta); default: the
            connect timeout, so 5 s + 5 s by default. A server that stops answering after
            the store connected (frozen, partitioned away) fails the call with
            `StoreUnavailableError` then, and the connection is closed.
        one_trip_replays: on the app's connection (``conn=``), a replay costs one round
            trip instead of two where the guard begins the transaction and the connection
            sets no isolation level, read-only or deferrable of its own. The price: each
            such replay ends its transaction by a deliberate error, which PostgreSQL writes
            to its log (``invalid input syntax for type integer: "idempo-unheld: ..."``) and
            counts as a rollback. Off by default (docs/transactions.md).

    >>> store = PostgresStore("postgresql://postgres@127.0.0.1/test")  # doctest: +SKIP
    """

    dialect: PostgresDialect
    # `idempo purge`'s time budget per batch, seconds (idempo._purge): a batch of 1 ms (a
    # few hundred records) holds its row locks and a core that long at a time, and kept the
    # purge above 100,000 records/s with a rest as long after each; live calls on the table
    # being purged waited less than behind batches of 1000 (benchmarks.md).
    purge_batch_time = 0.001

    def __init__(
        self,
        conninfo: str | ConnectionPool[Any],
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 10,
        connect_timeout: timedelta | float | None = None,
        read_timeout: timedelta | float | None = None,
        one_trip_replays: bool = False,
    ) -> None:
        super().__init__(PostgresDialect(table))
        self.one_trip_replays = one_trip_replays
        self._owns_pool = not isinstance(conninfo, ConnectionPool)
        self._connector = _connector(conninfo, connect_timeout, max_size)
        self._watchdog = _watchdog(self._connector, read_timeout)
        self._pool: ConnectionPool[Any] = _pool(conninfo, self._connector, ConnectionPool, _watched)
        self._seats = _seats(self._pool.max_size)
        self.connect_timeout = _timeout(self._connector)
        self.read_timeout = timedelta(seconds=self._watchdog.bound)
        self._kept = KeptConnections() if self._owns_pool else None

    @contextmanager
    def _connection(self, wait: float | None = None) -> Iterator[psycopg.Connection[Any]]:
        """A connection the store keeps, else one of the pool's, or when the pool cannot
        connect, one made here; ``wait``: how long to wait for one at most (seconds;
        default: `_checkout`'s)."""
        conn, until = self._take(wait)
        watchdog = self._watchdog
        watchdog.watch(conn)
        try:
            yield conn
        except Exception as exc:  # noqa: BLE001 - raised again, or as the cause
            raise watchdog.failure(conn, exc)  # noqa: B904
        finally:
            watchdog.done(conn)
            self._give(conn, until)

    def _take(self, wait: float | None) -> tuple[psycopg.Connection[Any], float | None]:
        """A connection, and when it goes back to the pool (None: made here, for one call)."""
        kept = self._kept
        if kept is not None and (found := kept.take()) is not None:
            return found
        try:
            conn, pooled = self._checkout(wait)
        finally:
            if kept is not None:
                kept.waited()
        return conn, monotonic() + KEEP_SECONDS if pooled else None

    def _give(self, conn: psycopg.Connection[Any], until: float | None) -> None:
        if until is None:
            conn.close()
            return
        if _in_transaction(conn):
            with suppress(psycopg.Error):  # a broken connection: the pool replaces it
                conn.rollback()
        back = conn if self._kept is None else self._kept.give(conn, until)
        if back is not None:
            self._pool.putconn(back)

    def _checkout(self, wait: float | None = None) -> tuple[psycopg.Connection[Any], bool]:
        connector = self._connector
        if connector is None:  # the app's pool, with its own timeout unless told
            return self._pool.getconn(timeout=wait), True
        deadline = monotonic() + (POOL_TIMEOUT_SECONDS if wait is None else wait)
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
        try:
            with self._connection() as conn:
                return execute(_PsycopgTx(conn), gen)
        except psycopg.Error as exc:  # the pool's, the connection's: not the statements'
            raise error(exc) from exc

    def wait_settled(self, scope: Scope, seconds: float) -> None:
        """Return once the record of ``scope`` is no longer in progress, or ``seconds``
        later: a duplicate told to wait (``Policy.wait``) reserves again as soon as the first
        attempt settles or releases, instead of polling. It waits on a pooled connection of
        its own (`LISTEN`, and a shared advisory lock that a settle looks for: a settle
        notifies only when someone waits), which goes back to the pool as it came, or is
        closed. Any failure only ends the wait: the reservation that follows meets it.

        >>> store.wait_settled(scope, seconds=30)  # doctest: +SKIP
        """
        watch = self.dialect.watch(scope, seconds)
        if not self._seats.acquire(blocking=False):
            sleep(min(seconds, _NO_SEAT_POLL_SECONDS))
            return
        try:
            self._wait(watch)
        finally:
            self._seats.release()

    def _wait(self, watch: Watch) -> None:
        with suppress(Exception), self._connection(watch.left()) as conn, _closed_unless_done(conn):
            watchdog = self._watchdog
            watchdog.watch(conn, allowance=watch.left())  # the lock waits for a settle's commit
            conn.execute(watch.listen)
            try:
                conn.execute(watch.lock())
            except pg_errors.LockNotAvailable:
                # A settle holds the mark past the wait's end: the reservation meets it.
                conn.execute(watch.abandon)
            else:
                read = conn.execute(_pyformat(watch.check), watch.params)
                patience = watch.patience(read.fetchone())
                if patience > 0:
                    watchdog.done(conn)  # no answer is awaited: silence is no failure here
                    for _ in conn.notifies(timeout=patience, stop_after=1):
                        pass
                    watchdog.watch(conn)
                conn.execute(watch.unwatch)
            for _ in conn.notifies(timeout=0):  # what came before UNLISTEN took effect
                pass

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> SyncUnit:
        """A unit that runs a guarded call on the app's connection (psycopg or SQLAlchemy)."""
        logic = _logic(self.dialect, mode, lock_timeout)
        if isinstance(conn, psycopg.Connection):
            tx = _PsycopgTx(conn, self.run, one_trip=self.one_trip_replays)
            return _Woken(logic, partial(execute, tx), self.wait_settled)
        conn = sqlalchemy_connection(
            conn, asynchronous=False, store="PostgresStore", driver="a psycopg.Connection"
        )
        from ._sql.sqlalchemy import SqlAlchemyTx  # noqa: PLC0415 - optional dependency

        executor = SqlAlchemyTx(conn, self.dialect, self.run, map_error, conflict=is_conflict)
        return _Woken(logic, executor.run, self.wait_settled)

    def close(self) -> None:
        self._watchdog.close()
        if self._kept is not None:
            for conn in self._kept.close():
                self._pool.putconn(conn)
        if self._owns_pool:
            self._pool.close()


class AsyncPostgresStore(AsyncSqlStore):
    """The asynchronous twin of `PostgresStore`, on ``psycopg.AsyncConnection``s.

    The pool opens on first use, inside the running event loop.
    """

    dialect: PostgresDialect

    def __init__(
        self,
        conninfo: str | AsyncConnectionPool[Any],
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 10,
        connect_timeout: timedelta | float | None = None,
        read_timeout: timedelta | float | None = None,
        one_trip_replays: bool = False,
    ) -> None:
        super().__init__(PostgresDialect(table))
        self.one_trip_replays = one_trip_replays
        self._owns_pool = not isinstance(conninfo, AsyncConnectionPool)
        self._connector = _connector(conninfo, connect_timeout, max_size)
        self._watchdog = _watchdog(self._connector, read_timeout)
        self.read_timeout = timedelta(seconds=self._watchdog.bound)
        self._pool: AsyncConnectionPool[Any] = _pool(
            conninfo, self._connector, AsyncConnectionPool, _awatched
        )
        self._seats = _seats(self._pool.max_size)
        self._opened = not self._owns_pool
        self.connect_timeout = _timeout(self._connector)
        self._kept = KeptConnections() if self._owns_pool else None

    @asynccontextmanager
    async def _connection(
        self, wait: float | None = None
    ) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The asynchronous twin of `PostgresStore._connection`."""
        conn, until = await self._take(wait)
        watchdog = self._watchdog
        watchdog.watch(conn)
        try:
            yield conn
        except Exception as exc:  # noqa: BLE001 - raised again, or as the cause
            raise watchdog.failure(conn, exc)  # noqa: B904
        finally:
            watchdog.done(conn)
            await self._give(conn, until)

    async def _take(self, wait: float | None) -> tuple[psycopg.AsyncConnection[Any], float | None]:
        """`PostgresStore._take`, awaited; the pool opens on first use."""
        kept = self._kept
        if kept is not None and (found := kept.take()) is not None:
            return found
        try:
            conn, pooled = await self._checkout(wait)
        finally:
            if kept is not None:
                kept.waited()
        return conn, monotonic() + KEEP_SECONDS if pooled else None

    async def _give(self, conn: psycopg.AsyncConnection[Any], until: float | None) -> None:
        if until is None:
            await conn.close()
            return
        if _in_transaction(conn):
            with suppress(psycopg.Error):
                await conn.rollback()
        back = conn if self._kept is None else self._kept.give(conn, until)
        if back is not None:
            await self._pool.putconn(back)

    async def _checkout(
        self, wait: float | None = None
    ) -> tuple[psycopg.AsyncConnection[Any], bool]:
        if not self._opened:
            await self._pool.open()
            self._opened = True
        connector = self._connector
        if connector is None:
            return await self._pool.getconn(timeout=wait), True
        deadline = monotonic() + (POOL_TIMEOUT_SECONDS if wait is None else wait)
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
        try:
            async with self._connection() as conn:
                return await aexecute(_AsyncPsycopgTx(conn), gen)
        except psycopg.Error as exc:
            raise error(exc) from exc

    async def wait_settled(self, scope: Scope, seconds: float) -> None:
        """`PostgresStore.wait_settled`, on this store's event loop; a cancelled wait closes
        its connection (the pool replaces it)."""
        watch = self.dialect.watch(scope, seconds)
        if not self._seats.acquire(blocking=False):
            await asyncio.sleep(min(seconds, _NO_SEAT_POLL_SECONDS))
            return
        try:
            await self._wait(watch)
        finally:
            self._seats.release()

    async def _wait(self, watch: Watch) -> None:
        with suppress(Exception):
            async with self._connection(watch.left()) as conn:
                with _closed_unless_done(conn):
                    watchdog = self._watchdog
                    watchdog.watch(conn, allowance=watch.left())
                    await conn.execute(watch.listen)
                    try:
                        await conn.execute(watch.lock())
                    except pg_errors.LockNotAvailable:
                        await conn.execute(watch.abandon)
                    else:
                        read = await conn.execute(_pyformat(watch.check), watch.params)
                        patience = watch.patience(await read.fetchone())
                        if patience > 0:
                            watchdog.done(conn)
                            async for _ in conn.notifies(timeout=patience, stop_after=1):
                                pass
                            watchdog.watch(conn)
                        await conn.execute(watch.unwatch)
                    async for _ in conn.notifies(timeout=0):
                        pass

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> AsyncUnit:
        """A unit that runs a guarded call on the app's async connection or session."""
        logic = _logic(self.dialect, mode, lock_timeout)
        if isinstance(conn, psycopg.AsyncConnection):
            tx = _AsyncPsycopgTx(conn, self.run, one_trip=self.one_trip_replays)
            return _AsyncWoken(logic, partial(aexecute, tx), self.wait_settled)
        conn = sqlalchemy_connection(
            conn,
            asynchronous=True,
            store="AsyncPostgresStore",
            driver="a psycopg.AsyncConnection",
        )
        from ._sql.sqlalchemy import AsyncSqlAlchemyTx  # noqa: PLC0415 - optional dependency

        executor = AsyncSqlAlchemyTx(conn, self.dialect, self.run, map_error, conflict=is_conflict)
        return _AsyncWoken(logic, executor.run, self.wait_settled)

    async def aclose(self) -> None:
        self._watchdog.close()
        if self._kept is not None:
            for conn in self._kept.close():
                await self._pool.putconn(conn)
        if self._owns_pool:
            await self._pool.close()
