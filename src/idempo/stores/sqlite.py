"""SQLite store: an embedded file, WAL mode, safe across threads and processes.

A verb that writes runs in a ``BEGIN IMMEDIATE`` transaction, or as one autocommit
statement, so reservation is atomic across processes sharing the file. A reservation first
reads the record, without a transaction or the writer lock: a settled record is replayed (and
a mismatch refused) from that one read; a fresh key is reserved by one ``INSERT``, and a
settle within the retention is one ``UPDATE`` (`SQLiteStore.reserve_alone`,
`SQLiteStore.settle_alone`); anything else goes on to the transaction. Transactional mode
runs on the app's own ``sqlite3.Connection`` (or a SQLAlchemy session on SQLite).

    store = SQLiteStore("app.db")
    store.migrate()
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import threading
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

from .._core.ops import Reserve, Settle, StoreOp
from .._core.record import Acquired, Mismatch, Replay
from ..errors import StoreError, StoreUnavailableError
from . import _clock, schema_missing
from ._sql.binding import sqlalchemy_connection
from ._sql.dialect import Statement
from ._sql.sqlite import SQLiteDialect
from ._sql.transaction import (
    NOT_NOW,
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
    TransactionEnded,
    TxGen,
    Undo,
    bound,
    done_at_once,
    execute,
    mapped,
    unit_logic,
)
from .base import Mode

__all__ = ["AsyncSQLiteStore", "SQLiteStore"]

T = TypeVar("T")

DEFAULT_TABLE = "idempo_records"
DEFAULT_BUSY_TIMEOUT = timedelta(seconds=10)
# What BEGIN IMMEDIATE answers at once, on a connection that does not wait, when another
# connection holds the write lock.
_BUSY = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})
# One write in this many that could run at once goes to a worker thread all the same: the
# connections that run at once never checkpoint the write-ahead log (a checkpoint syncs the
# file, milliseconds), so the threads' connections, which do, keep it short.
_CHECKPOINT_EVERY = 64


def map_error(exc: BaseException) -> BaseException:
    """A sqlite3 error as the idempo error it means; anything else unchanged."""
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc)
        if "locked" in text:
            return LockTimeoutError(text)
        if text.startswith("no such table: "):
            return schema_missing("SQLite", f"table {text.removeprefix('no such table: ')}")
        if "readonly database" in text:
            return StoreUnavailableError(f"the SQLite file is read-only: {text}")
        return StoreUnavailableError(f"SQLite failed: {text}")
    if isinstance(exc, sqlite3.Error):
        return StoreError(f"SQLite failed: {exc}")
    return exc


def _busy(exc: sqlite3.Error) -> bool:
    """Whether ``exc`` says another connection holds a lock."""
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF in _BUSY


def _open_failure(path: str, exc: sqlite3.Error, *, must_exist: bool) -> StoreUnavailableError:
    """Why ``path`` cannot be opened, in words: SQLite itself only says "unable to open
    database file", whatever the reason."""
    return StoreUnavailableError(f"cannot open {path}: {_why(path, exc, must_exist=must_exist)}")


def _why(path: str, exc: sqlite3.Error, *, must_exist: bool) -> str:
    if path == ":memory:":
        return str(exc)
    target = Path(path).absolute()
    if target.is_dir():
        return "it is a directory, not a database file"
    existing = next(p for p in target.parents if p.exists())  # "/" at worst
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if existing != target.parent:
        return f"directory {target.parent} does not exist"
    if must_exist and not target.exists():
        return "the file does not exist (idempo migrate creates it)"
    if _read_only_volume(existing):
        return "read-only file system"
    if not os.access(target if target.exists() else existing, os.R_OK | os.W_OK):
        return f"permission denied ({exc})"
    return str(exc)


def _read_only_volume(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


class _Sqlite3Tx:
    """Runs transaction operations on one ``sqlite3.Connection``."""

    def __init__(self, conn: sqlite3.Connection, on_store: Callable[[Any], Any]) -> None:
        self._conn = conn
        self._on_store = on_store
        self._marked = False

    pending: list[Any] = []  # noqa: RUF012 - statements go at once: never any queued

    def run(self, gen: TxGen[T]) -> T:
        return execute(self, gen)

    def flush(self) -> None:
        return None

    def error(self, exc: BaseException) -> BaseException:
        """A sqlite3 error as idempo's (its cause kept); anything else as it is. Applied
        once, where a failure leaves the executor."""
        if isinstance(exc, sqlite3.Error):
            return mapped(exc, map_error(exc))
        return exc

    def do(self, op: Any) -> Any:
        conn = self._conn
        match op:
            case Statement(sql, params, _):
                return conn.execute(sql, params).fetchall()
            case Begin():
                return self._begin(op)
            case Mark():
                conn.execute(f"SAVEPOINT {SAVEPOINT}")
                self._marked = True
                return None
            case Check() if self._marked:
                self._marked = False
                return self._to_mark(f"RELEASE {SAVEPOINT}")
            case Check():
                return None
            case Undo():
                return self._to_mark(f"ROLLBACK TO {SAVEPOINT}")
            case Commit():
                self._marked = False
                return conn.commit()
            case Rollback():
                self._marked = False
                return conn.rollback()
            case OnStore(gen):
                return self._on_store(gen)
            case Bound():
                return None  # the store's BEGIN IMMEDIATE has waited already
        raise AssertionError(f"unknown operation {op!r}")

    def _begin(self, op: Begin) -> bool:
        conn = self._conn
        if conn.in_transaction:
            return False
        if not op.reserves:
            # Deferred: the work's first write takes the write lock. Taking it now would
            # stall every other writer, takeovers included, while the work runs.
            conn.execute("BEGIN")
        else:
            # IMMEDIATE takes the write lock now: a duplicate waits here, not in a lock
            # upgrade that SQLite would have to fail (EXCLUSIVE if the app set its
            # connection to that).
            exclusive = conn.isolation_level == "EXCLUSIVE"
            begin = "BEGIN EXCLUSIVE" if exclusive else "BEGIN IMMEDIATE"
            _begin_within(conn, begin, op.lock_timeout)
        return True

    def _to_mark(self, sql: str) -> None:
        """Release the savepoint or roll back to it; it is gone if the app ended the guard's
        transaction (committed or rolled back) inside the block."""
        if not self._conn.in_transaction:
            raise TransactionEnded("the connection has no open transaction")
        try:
            self._conn.execute(sql)
        except sqlite3.OperationalError as exc:
            if "no such savepoint" not in str(exc):
                raise
            raise TransactionEnded(str(exc)) from exc


def _begin_within(conn: sqlite3.Connection, begin: str, lock_timeout: timedelta | None) -> None:
    """``begin``, waiting for another writer's lock at most ``lock_timeout`` (a caller with a
    deadline) if that is less than the connection's own busy timeout."""
    if lock_timeout is None:
        conn.execute(begin)
        return
    (own,) = conn.execute("PRAGMA busy_timeout").fetchone()
    bound = max(0, int(lock_timeout.total_seconds() * 1000))
    if bound >= own:
        conn.execute(begin)
        return
    conn.execute(f"PRAGMA busy_timeout = {bound}")
    try:
        conn.execute(begin)
    finally:
        conn.execute(f"PRAGMA busy_timeout = {int(own)}")


class SQLiteStore(SqlStore):
    """A store in a SQLite file. Each thread gets its own connection; processes share the file.

    Args:
        path: the database file (created if missing), or ``":memory:"`` for one connection's
            private database (tests only: threads then do not share it).
        table: the records table; create it with `migrate`.
        busy_timeout: how long a writer waits for another writer's lock.
        read_only: open the file for reading only (``get``, ``stats``); it is never
            created, and on a read-only volume it is still read.
        create: create the file if it is missing (the default); False: it must exist.

    A file that cannot be opened raises `StoreUnavailableError` saying why (missing
    directory, a directory, read-only volume, not a database); a missing table raises
    `SchemaMissingError`.

    >>> store = SQLiteStore("/tmp/idempo-doc.db"); store.migrate(); store.close()
    """

    bounds_lock_waits = False  # its BEGIN IMMEDIATE waits, bounded by the busy timeout

    def __init__(
        self,
        path: str,
        *,
        table: str = DEFAULT_TABLE,
        busy_timeout: timedelta = DEFAULT_BUSY_TIMEOUT,
        read_only: bool = False,
        create: bool = True,
    ) -> None:
        self.dialect: SQLiteDialect = SQLiteDialect(table)
        super().__init__(self.dialect)
        self.path = path
        self._busy_timeout = busy_timeout
        self.read_only = read_only
        self._create = create and not read_only
        self._local = threading.local()
        self._at_once = threading.local()  # `run_now`'s connections, which never wait
        self._writes_at_once = 0
        # Whether writes may run on the connections that never wait (`_alone`).
        self._writes_alone = not read_only and path != ":memory:"
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        # This process's writers queue here, not in SQLite's busy handler: that one sleeps
        # 1, 2, 5, 10... ms between tries, which under concurrent requests is most of a
        # write's time. Other processes' writers are still waited for by busy_timeout.
        self._writer = threading.RLock()

    def connect(self) -> sqlite3.Connection:
        """A new connection to the store's file, set up as idempo expects (WAL, busy timeout).

        Raises `StoreUnavailableError` saying why the file cannot be opened.
        """
        try:
            return self._open(immutable=False)
        except sqlite3.Error as exc:
            if not (self.read_only and _read_only_volume(Path(self.path).absolute().parent)):
                raise _open_failure(self.path, exc, must_exist=not self._create) from exc
            # A WAL file on a read-only volume cannot be opened even read-only (SQLite needs
            # to create its -shm file). Nothing on this host can write it there, so reading
            # it as immutable is what read-only means.
            try:
                return self._open(immutable=True)
            except sqlite3.Error as again:
                raise _open_failure(self.path, again, must_exist=True) from again

    def _open(self, *, immutable: bool, waits: bool = True) -> sqlite3.Connection:
        target, uri = self.path, False
        if not self._create and self.path != ":memory:":
            mode = "ro" if self.read_only else "rw"
            target = f"file:{quote(os.path.abspath(self.path))}?mode={mode}"
            target += "&immutable=1" if immutable else ""
            uri = True
        conn = sqlite3.connect(
            target,
            timeout=self._busy_timeout.total_seconds() if waits else 0,
            isolation_level=None,
            check_same_thread=False,
            uri=uri,
        )
        try:
            if self.read_only:
                conn.execute("PRAGMA schema_version")  # reads the header: "not a database"
            else:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
                if not waits:
                    conn.execute("PRAGMA wal_autocheckpoint=0")
        except BaseException:
            conn.close()
            raise
        return conn

    def _connection(self, local: threading.local | None = None) -> sqlite3.Connection:
        local = local or self._local
        conn: sqlite3.Connection | None = getattr(local, "conn", None)
        if conn is None:
            if local is self._local:
                conn = self.connect()
            else:
                conn = self._open(immutable=False, waits=False)
            local.conn = conn
            # Kept with it: `Connection.execute` makes (and frees) a cursor each time.
            local.cursor = conn.cursor()
            with self._lock:
                self._connections.append(conn)
        return conn

    def _cursor(self, local: threading.local) -> sqlite3.Cursor:
        """The kept cursor of ``local``'s connection (opened if need be)."""
        cursor: sqlite3.Cursor | None = getattr(local, "cursor", None)
        if cursor is None:
            self._connection(local)
            cursor = local.cursor
        return cursor

    def perform(self, op: StoreOp) -> Any:
        if type(op) is Reserve:
            answer = self.answered(op, alone=True)
            if answer is not None and answer is not NOT_NOW:
                return answer
        elif type(op) is Settle and self.settle_alone(op) is True:
            return None
        return super().perform(op)

    def answered(
        self, op: Reserve, *, at_once: bool = False, alone: bool = False
    ) -> Replay | Mismatch | Acquired | None:
        """The reservation ``op``'s answer if one read of its record gives it: a settled
        record's replay, or a mismatch (`SQLiteDialect.answered`). The read takes neither a
        write transaction nor this process's writer lock, and in WAL mode it never waits for
        another writer. None: the reservation must write (no record, one in progress or
        expired) or the read failed (the reservation then says why), and it decides again,
        atomically, on its own clock reading. ``at_once``: read on the connection that never
        waits (`run_now`'s), as the event loop's thread does. ``alone``: where the read
        finds no record, reserve the key with the one statement of `reserve_alone` (whose
        `NOT_NOW` is passed on)."""
        if at_once and self.path == ":memory:":
            return None  # that connection would be a private, empty database
        dialect, scope = self.dialect, op.scope
        # Read where the reservation's statement will write: a connection that reads after
        # another of this process wrote reads its pages again (its cache is stale).
        alone = alone and self._writes_alone
        try:
            cursor = self._cursor(self._at_once if at_once or alone else self._local)
            # fetchall: the statement runs to its end, so no read snapshot stays open.
            rows = cursor.execute(
                dialect.first_sql, (scope.principal, scope.operation, scope.key)
            ).fetchall()
        except (sqlite3.Error, StoreError):
            return None
        if not rows:
            # A fresh key: the clock is read by the reservation, under its lock.
            return self.reserve_alone(op, waits=not at_once) if alone else None
        # Judged on the same clock rule as the reservation (an injected time, else the
        # host's), read after the record was.
        return dialect.answered(rows, op, op.now or _clock.host_now())

    def reserve_alone(self, op: Reserve, *, waits: bool) -> Acquired | None:
        """A fresh key's reservation as one autocommit statement
        (`SQLiteDialect.alone_insert_sql`), without a transaction: `Acquired`, or None
        where it changed nothing (a record exists, the clock is not past the token counter,
        the file predates the counter's triggers) and the transaction must decide; `NOT_NOW`
        where it could not run without waiting for the write lock (see `_alone`)."""
        dialect = self.dialect
        made = self._written(op, dialect.alone_insert_sql, dialect.alone_reserve_params, waits)
        return made if made is None or made is NOT_NOW else Acquired(made)

    def settle_alone(self, op: Settle, *, waits: bool = True) -> bool | None:
        """A settle within the reservation's retention as one autocommit UPDATE
        (`SQLiteDialect.alone_settle_sql`): True if it settled; None where it changed
        nothing (fenced, settled already, or its expiry must move) and the transaction
        must decide; `NOT_NOW` where it could not run without waiting (see `_alone`)."""
        dialect = self.dialect
        done = self._written(op, dialect.alone_settle_sql, dialect.alone_settle_params, waits)
        return done if done is None or done is NOT_NOW else True

    def _written(
        self, op: Any, sql: str, params: Callable[[Any, int], tuple[Any, ...]], waits: bool
    ) -> Any:
        """Run ``sql`` alone, on ``params(op, now)``: ``now`` (a database time) if it
        changed a row, None if not (or if it failed: the transaction says why), `NOT_NOW`
        if it could not run without waiting. A reservation needs the counter's triggers."""
        cursor = self._alone(waits)
        if cursor is None:
            return NOT_NOW
        try:
            if type(op) is Reserve and not self._has_triggers(cursor):
                return None
            # Read under this process's writer lock, and the statement does not wait for
            # another's: a lease starts when its record is made.
            now = self.dialect.db_time(op.now or _clock.host_now())
            cursor.execute(sql, params(op, now))
        except sqlite3.Error as exc:
            return NOT_NOW if _busy(exc) else None
        finally:
            self._writer.release()
        return now if cursor.rowcount else None

    def _alone(self, waits: bool) -> sqlite3.Cursor | None:
        """The cursor of this thread's connection that never waits for another process's
        lock (`run_now`'s), with this process's writer lock taken (the caller releases
        it), for a write; ``waits``: for that writer lock, up to the busy timeout. None
        where the write cannot be there now: the turn of a write that checkpoints
        (`_CHECKPOINT_EVERY`: that connection never does), the writer lock taken, a store
        that never writes there, a file that cannot be opened (the transaction says
        why)."""
        self._writes_at_once += 1  # not exact under threads: it only spreads checkpoints
        if self._writes_at_once % _CHECKPOINT_EVERY == 0 or not self._writes_alone:
            return None
        writer = self._writer
        if not (
            writer.acquire(timeout=self._busy_timeout.total_seconds())
            if waits
            else writer.acquire(blocking=False)
        ):
            return None
        try:
            return self._cursor(self._at_once)
        except sqlite3.Error:
            writer.release()
            return None

    def _has_triggers(self, cursor: sqlite3.Cursor) -> bool:
        """Whether the file has the triggers that keep the token counter (`migrate` makes
        them); asked once per store (its dialect, which the async store shares, keeps the
        answer), and again after its `migrate`. Without them, fresh reservations keep their
        transaction, which moves the counter itself."""
        dialect = self.dialect
        triggers = dialect.has_triggers
        if triggers is None:
            ((count,),) = cursor.execute(dialect.triggers_sql, dialect.triggers_params).fetchall()
            triggers = dialect.has_triggers = count == len(dialect.triggers)
        return triggers

    def run(self, gen: TxGen[T]) -> T:
        if not self._writer.acquire(timeout=self._busy_timeout.total_seconds()):
            raise StoreUnavailableError("SQLite stayed locked by this process's other writers")
        try:
            done: T = self._transaction(gen, "BEGIN IMMEDIATE")
            return done
        finally:
            self._writer.release()

    def run_now(self, gen: TxGen[T]) -> Any:
        """`run`, if it need not wait: when this process's other writers and other
        processes leave the file free at this moment; else `NOT_NOW`, with ``gen``
        untouched. `AsyncSQLiteStore` runs its writes so on the event loop's thread: a
        small local transaction costs less than handing it to a worker thread. It never
        waits for a lock (its connection's busy timeout is zero) and never checkpoints the
        write-ahead log; one write in `_CHECKPOINT_EVERY` goes to `run` instead, whose
        connections do (docs/decisions.md)."""
        cursor = self._alone(waits=False)
        if cursor is None:
            return NOT_NOW
        try:
            return self._transaction(gen, "BEGIN IMMEDIATE", cursor.connection)
        finally:
            self._writer.release()

    def read(self, gen: TxGen[T]) -> T:
        # A deferred transaction only reads a snapshot: it never waits behind a writer.
        done: T = self._transaction(gen, "BEGIN")
        return done

    def _transaction(
        self, gen: TxGen[T], begin: str, at_once: sqlite3.Connection | None = None
    ) -> Any:
        """``gen`` in one transaction; with ``at_once`` (a connection that never waits),
        `NOT_NOW` if another process holds the write lock."""
        conn = at_once or self._connection()
        try:
            try:
                conn.execute(begin)
            except sqlite3.OperationalError as exc:
                if at_once is not None and _busy(exc):
                    return NOT_NOW
                raise
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
        timeout = lock_timeout or self._busy_timeout
        if isinstance(conn, sqlite3.Connection):
            return bound(self.dialect, mode, timeout, _Sqlite3Tx(conn, self.run))
        conn = sqlalchemy_connection(
            conn, asynchronous=False, store="SQLiteStore", driver="a sqlite3.Connection"
        )
        from ._sql.sqlalchemy import SqlAlchemyTx  # noqa: PLC0415 - optional dependency

        executor = SqlAlchemyTx(conn, self.dialect, self.run, map_error)
        return bound(self.dialect, mode, timeout, executor)

    def close(self) -> None:
        # A write still running in another thread (an async caller cancelled while its worker
        # thread goes on) must end before its connection closes: sqlite3 closing a connection
        # under a running statement crashes the process. Bounded by the busy timeout.
        waited = self._writer.acquire(timeout=self._busy_timeout.total_seconds())
        try:
            with self._lock:
                connections, self._connections = self._connections, []
            for conn in connections:
                conn.close()
            self._local = threading.local()
            self._at_once = threading.local()
        finally:
            if waited:
                self._writer.release()


class _Abandoned(Exception):
    """The caller of a transaction running in a worker thread was cancelled."""


def _unless(abandoned: threading.Event, gen: TxGen[T]) -> TxGen[T]:
    """``gen``, ending in an error (so its transaction rolls back) once ``abandoned`` is set."""
    result = yield from gen
    if abandoned.is_set():
        raise _Abandoned
    return result


class AsyncSQLiteStore(AsyncSqlStore):
    """The asynchronous twin of `SQLiteStore`: the same work in a worker thread."""

    bounds_lock_waits = False  # its BEGIN IMMEDIATE waits, bounded by the busy timeout

    def __init__(
        self,
        path: str,
        *,
        table: str = DEFAULT_TABLE,
        busy_timeout: timedelta = DEFAULT_BUSY_TIMEOUT,
        read_only: bool = False,
        create: bool = True,
    ) -> None:
        self._sync = SQLiteStore(
            path, table=table, busy_timeout=busy_timeout, read_only=read_only, create=create
        )
        # Each operation of the guard's runs at once when the file is free (`run_now`),
        # else in a worker thread that waits for it.
        super().__init__(self._sync.dialect, now=self._sync.run_now)

    def perform(self, op: StoreOp) -> Awaitable[Any]:
        answer: Any
        if type(op) is Reserve:
            # A settled record is answered from one read on the loop's thread, and a fresh
            # key reserved by one statement there.
            answer = self._sync.answered(op, at_once=True, alone=True)
        elif type(op) is Settle:
            answer = self._sync.settle_alone(op, waits=False)
        else:
            return super().perform(op)
        if answer is None:
            return super().perform(op)  # the transaction decides
        if answer is NOT_NOW:
            # The write lock is taken, or it is a checkpoint's turn: a worker thread's
            # transaction waits for it (and its connection checkpoints).
            return self.in_thread(op)
        return done_at_once(None if answer is True else answer)

    async def run(self, gen: TxGen[T]) -> T:
        # A worker thread cannot be stopped: a caller cancelled meanwhile would never learn
        # what it committed (a reservation nobody holds the token of). The thread rolls back
        # instead, unless the cancellation came after its last statement.
        abandoned = threading.Event()
        try:
            return await asyncio.to_thread(self._sync.run, _unless(abandoned, gen))
        except asyncio.CancelledError:
            abandoned.set()
            raise

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> AsyncUnit:
        """A unit on the app's SQLAlchemy ``AsyncSession`` / ``AsyncConnection`` (aiosqlite)."""
        conn = sqlalchemy_connection(conn, asynchronous=True, store="AsyncSQLiteStore", driver=None)
        from ._sql.sqlalchemy import AsyncSqlAlchemyTx  # noqa: PLC0415 - optional dependency

        timeout = lock_timeout or DEFAULT_BUSY_TIMEOUT
        logic = unit_logic(self.dialect, mode, timeout)
        return AsyncUnit(logic, AsyncSqlAlchemyTx(conn, self.dialect, self.run, map_error).run)

    async def aclose(self) -> None:
        self._sync.close()
