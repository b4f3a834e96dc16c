"""MariaDB store (PyMySQL, aiomysql), sync and async, leased and transactional.

Leased mode runs each verb on a pooled autocommit connection of the store's own: one round
trip per verb, a reservation included (one ``INSERT ... ON DUPLICATE KEY UPDATE ... RETURNING``
creates, takes over or reads the record). Transactional mode runs on the app's own PyMySQL or
aiomysql connection (or a SQLAlchemy session on one): the reservation starts the transaction,
a duplicate waits on the row lock for ``Policy.lock_timeout`` (rounded up to whole seconds,
InnoDB's unit), and the fenced completion commits with the app's writes.

Needs MariaDB 10.5 or later; MySQL 8 lacks ``INSERT ... RETURNING`` and is refused with a
`ConfigurationError` (see docs/decisions.md).

    store = MySQLStore("mysql://app:secret@db:3306/app")
    store.migrate()
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from functools import lru_cache
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

from .._optional import optional_import

with optional_import("the MariaDB/MySQL store needs PyMySQL and aiomysql", extra="mysql"):
    import aiomysql
    import pymysql
    from pymysql.constants import CLIENT, SERVER_STATUS

from ..errors import ConfigurationError, IdempotencyError, StoreError, StoreUnavailableError
from . import DEFAULT_CONNECT_TIMEOUT, cannot_connect, schema_missing, seconds
from ._sql.binding import sqlalchemy_connection
from ._sql.dialect import Statement, pyformat
from ._sql.mysql import ROW_COUNT, MySQLDialect, lock_wait_seconds
from ._sql.transaction import (
    SAVEPOINT,
    AsyncSqlStore,
    AsyncUnit,
    Begin,
    Bound,
    Call,
    Check,
    Commit,
    LockTimeoutError,
    Mark,
    OnStore,
    Rollback,
    SqlStore,
    StoreLogic,
    SyncUnit,
    TransactionConflict,
    TransactionEnded,
    TxGen,
    Undo,
    UnitLogic,
    acall,
    adrive,
    aexecute,
    call,
    drive,
    execute,
    mapped,
    unit_logic,
)
from ._watchdog import Watchdog
from .base import Mode

__all__ = ["AsyncMySQLStore", "MySQLStore", "connect_options"]


def _escape_bytes(value: bytes) -> str:
    return f"_binary X'{value.hex()}'"


# aiomysql 0.3 escapes bytes with a PyMySQL helper that PyMySQL 1.2.3 replaced with a string
# (aio-libs/aiomysql#1080), so every bytes parameter fails with "'str' object is not
# callable": in idempo's own statements and in an app's SQLAlchemy async session on aiomysql
# alike. Only that broken pairing is mended, with the escape PyMySQL itself uses.
if not callable(getattr(aiomysql.connection, "escape_bytes_prefixed", _escape_bytes)):
    aiomysql.connection.escape_bytes_prefixed = _escape_bytes

T = TypeVar("T")

DEFAULT_TABLE = "idempo_records"
DEFAULT_LOCK_TIMEOUT = timedelta(seconds=5)
# A pooled connection idle this long is pinged before use: the server may have dropped it.
IDLE_CHECK_SECONDS = 30.0
POOL_TIMEOUT_SECONDS = 30.0
# The lock wait of the store's own sessions (innodb_lock_wait_timeout), seconds.
_SESSION_WAIT = lock_wait_seconds(DEFAULT_LOCK_TIMEOUT)
# Attributes the store sets on its own connections: the read timeout past the lock wait,
# and the lock wait its statements now carry (SET STATEMENT), seconds.
_READ_TIMEOUT = "_idempo_read_timeout"
LOCK_WAIT_SET = "_idempo_lock_wait"

_pyformat = lru_cache(maxsize=256)(pyformat)

# Server errors that mean "waited for a lock and gave up" (1205) or "chosen as a deadlock
# victim" (1213, the transaction is gone); either way the duplicate may ask again later.
_LOCK_ERRORS = frozenset({1205, 1213})
# Too many connections, shutting down, connection killed; 2xxx are the client's own.
_UNREACHABLE = frozenset({1040, 1053, 1927})
# Refused at login: no such database (1049), access denied to it (1044), no such user or
# wrong password (1045, 1698).
_UNKNOWN_DATABASE = 1049
_ACCESS_DENIED = frozenset({1044, 1045, 1698})
_NO_SUCH_TABLE = 1146  # a missing sequence says the same


def _code(exc: BaseException) -> int:
    args = exc.args
    return args[0] if args and isinstance(args[0], int) else 0


def _message(exc: BaseException) -> str:
    return str(exc.args[1]) if len(exc.args) > 1 else str(exc)


def _reason(exc: BaseException, timeout: float) -> str:
    """What a failed connection attempt means, in a few words (the driver's text is the
    error's cause). aiomysql keeps the socket's error only as the cause."""
    code, message = _code(exc), _message(exc)
    text = f"{message} {exc.__cause__ or ''}"
    if code == _UNKNOWN_DATABASE:
        return f"database {message.removeprefix('Unknown database ')} does not exist"
    if code in _ACCESS_DENIED:
        return f"a{message[1:]}: no such user or wrong password"
    if isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError):
        return f"no answer within {timeout:g} s"
    if "timed out" in text:
        return f"no answer within {timeout:g} s"
    if "Connection refused" in text or isinstance(exc.__cause__, ConnectionRefusedError):
        return "connection refused"
    if "Name or service not known" in text or "name resolution" in text:
        host = re.search(r"server on '([^']*)'", message)
        return f"unknown host {host[1]!r}" if host else "unknown host"
    return message


def map_error(exc: BaseException) -> BaseException:
    """A PyMySQL/aiomysql error as the idempo error it means; anything else unchanged."""
    if isinstance(exc, pymysql.err.Error):
        code = _code(exc)
        if code in _LOCK_ERRORS:
            return LockTimeoutError(str(exc))
        if code == _NO_SUCH_TABLE:
            table = re.search(r"Table '([^']*)'", _message(exc))
            return schema_missing("MariaDB", f"table {table[1]!r}" if table else _message(exc))
        if code == _UNKNOWN_DATABASE or code in _ACCESS_DENIED:
            return StoreUnavailableError(f"MariaDB refused the login: {_reason(exc, 0)}")
        if (
            isinstance(exc, pymysql.err.InterfaceError)
            or code in _UNREACHABLE
            or 2000 <= code < 3000
        ):
            return StoreUnavailableError(f"MariaDB is unreachable: {exc}")
        return StoreError(f"MariaDB failed: {exc}")
    if isinstance(exc, OSError):
        return StoreUnavailableError(f"MariaDB is unreachable: {exc}")
    return exc


@contextmanager
def mapped_errors() -> Iterator[None]:
    try:
        yield
    except (IdempotencyError, LockTimeoutError):
        raise
    except (pymysql.err.Error, OSError) as exc:
        raise map_error(exc) from exc


_MARIADB_VERSION = re.compile(r"(?:5\.5\.5-)?(\d+)\.(\d+)[^-]*-MariaDB")


@lru_cache(maxsize=8)
def check_server(version: str) -> None:
    """Refuse a server without ``INSERT ... RETURNING`` (MySQL, MariaDB before 10.5)."""
    found = _MARIADB_VERSION.match(version)
    if found is None or (int(found[1]), int(found[2])) < (10, 5):
        raise ConfigurationError(
            f"the server is {version!r}; idempo's MySQL store needs MariaDB 10.5 or later"
            " (its reservation is one INSERT ... RETURNING, which MySQL lacks)"
        )


def _server_version(conn: Any) -> str:
    return str(conn.get_server_info())  # from the handshake: no round trip


def connect_options(url: str) -> dict[str, Any]:
    """PyMySQL/aiomysql ``connect`` arguments for a ``mysql://`` or ``mariadb://`` URL.

    ``mysql://user:password@host:port/database?unix_socket=/run/mysqld/mysqld.sock``; the
    query may also set ``connect_timeout`` and ``read_timeout`` (seconds).

    >>> connect_options("mariadb://app:s%40cret@db:3307/shop")["password"]
    's@cret'
    """
    parts = urlsplit(url)
    if parts.scheme.split("+", 1)[0] not in ("mysql", "mariadb"):
        raise ConfigurationError(f"not a mysql:// or mariadb:// URL: {parts.scheme!r}")
    try:
        port = parts.port or 3306
    except ValueError as exc:
        raise ConfigurationError(f"bad port in MySQL URL: {exc}") from exc
    options: dict[str, Any] = {"host": parts.hostname or "localhost", "port": port}
    if parts.username:
        options["user"] = unquote(parts.username)
    if parts.password:
        options["password"] = unquote(parts.password)
    database = unquote(parts.path.lstrip("/"))
    if database:
        options["database"] = database
    for name, value in parse_qsl(parts.query):
        if name == "unix_socket":
            options["unix_socket"] = value
        elif name in ("connect_timeout", "read_timeout"):
            options[name] = seconds(value)
        else:
            raise ConfigurationError(f"unknown MySQL URL option {name!r}")
    return options


def _options(
    url: str,
    connect_args: Mapping[str, Any] | None,
    connect_timeout: timedelta | float | None,
    read_timeout: timedelta | float | None = None,
) -> dict[str, Any]:
    """How the store's own connections are set up: autocommit (each verb commits by itself),
    matched-row counts (a renewal that changes nothing is not "stale"), the lock wait, the
    connect timeout (the argument, else the URL's, else 5 s) and the read timeout, how long
    the server may take to answer beyond a statement's lock wait (the argument, else the
    URL's or ``connect_args``'s, else the connect timeout)."""
    wait = lock_wait_seconds(DEFAULT_LOCK_TIMEOUT)
    options = {
        **connect_options(url),
        "autocommit": True,
        "client_flag": CLIENT.FOUND_ROWS,
        "init_command": f"SET SESSION innodb_lock_wait_timeout = {wait}",
        "charset": "utf8mb4",
        **(connect_args or {}),
    }
    if connect_timeout is not None:
        options["connect_timeout"] = seconds(connect_timeout)
    options.setdefault("connect_timeout", DEFAULT_CONNECT_TIMEOUT.total_seconds())
    if read_timeout is not None:
        options["read_timeout"] = seconds(read_timeout)
    options.setdefault("read_timeout", options["connect_timeout"])
    return options


def _lock_wait(conn: Any) -> float:
    """How long a statement on one of the store's connections may wait on a row lock:
    what the store set for its reservation on it, else the session's, seconds."""
    return float(getattr(conn, LOCK_WAIT_SET, _SESSION_WAIT))


def _read_timeout(options: Mapping[str, Any]) -> timedelta | None:
    """The read timeout in force (None: the app's ``connect_args`` turned it off)."""
    value = options["read_timeout"]
    return None if value is None else timedelta(seconds=value)


def bound_reads(conn: Any, lock_wait: int) -> None:
    """Give a PyMySQL connection's reads the read timeout past ``lock_wait`` seconds, the
    lock wait of the statements it now sends (the store's own connections only)."""
    read_timeout = getattr(conn, _READ_TIMEOUT, None)
    if read_timeout is not None:
        # PyMySQL has no public setter; it applies these before its next read and write
        # (the same value for both, so it never switches the socket's timeout between them).
        conn._read_timeout = conn._write_timeout = read_timeout + lock_wait
    setattr(conn, LOCK_WAIT_SET, lock_wait)


def _aiomysql_socket(conn: Any) -> int:
    return int(conn._writer.transport.get_extra_info("socket").fileno())


def _where(options: Mapping[str, Any]) -> str:
    """Where the options connect, for messages."""
    database = options.get("database") or options.get("db") or ""
    if options.get("unix_socket"):
        return f"{options['unix_socket']}/{database}"
    return f"{options.get('host', 'localhost')}:{options.get('port', 3306)}/{database}"


def _connect(options: Mapping[str, Any]) -> pymysql.connections.Connection[Any]:
    """A PyMySQL connection, the whole login bounded by the connect timeout (PyMySQL's own
    bounds only the TCP connect, so a server that accepts and then says nothing would hold
    the call for ever), then every read by the read timeout: a server that stops answering
    (frozen, partitioned away) fails the call, and PyMySQL closes the connection."""
    timeout = options["connect_timeout"]
    try:
        conn: pymysql.connections.Connection[Any] = pymysql.connect(
            **{**options, "read_timeout": timeout, "write_timeout": timeout}
        )
    except (pymysql.err.Error, OSError) as exc:
        raise cannot_connect("MariaDB", _where(options), _reason(exc, timeout)) from exc
    setattr(conn, _READ_TIMEOUT, options["read_timeout"])
    bound_reads(conn, _SESSION_WAIT)
    return conn


def _in_transaction(conn: Any) -> bool:
    return bool(conn.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS)


# The app's transaction is over, as a serialization failure ends one on PostgreSQL: chosen
# as a deadlock victim (1213: InnoDB rolled it all back), or its snapshot overtaken by a
# concurrent commit (1020, MariaDB's innodb_snapshot_isolation).
_CONFLICTS = frozenset({1213, 1020})
_NO_SUCH_SAVEPOINT = 1305
_SAVEPOINT_SQL = f"SAVEPOINT {SAVEPOINT}"


def _error(exc: BaseException, app: bool) -> BaseException:
    """What a failure means to the transaction's logic: the app's conflict, the end of the
    guard's transaction, or the store's error (the driver's error its cause); idempo's own
    as it is. Applied once, where a failure leaves the executor."""
    if isinstance(exc, pymysql.err.Error):
        code = _code(exc)
        if code == _NO_SUCH_SAVEPOINT:
            return mapped(exc, TransactionEnded(str(exc)))
        if app and code in _CONFLICTS:
            return mapped(exc, TransactionConflict(exc))
    if isinstance(exc, pymysql.err.Error | OSError):
        return mapped(exc, map_error(exc))
    return exc


def _to_mark(conn: Any, verb: str) -> str:
    """The statement that releases the savepoint or rolls back to it. No open transaction
    (the app's COMMIT said so in its reply) means the app ended the guard's."""
    if not _in_transaction(conn):
        raise TransactionEnded("the connection has no open transaction")
    return f"{verb} SAVEPOINT {SAVEPOINT}"


class _MySQLTx:
    """What the PyMySQL and aiomysql executors share: the calls that carry out each
    operation, sans I/O (`steps`), and what a failure means. ``app``: the app's connection
    (a guarded call), whose serialization failures and deadlocks its caller gets raw."""

    pending: list[Any] = []  # noqa: RUF012 - statements go at once: never any queued

    def __init__(self, conn: Any, on_store: Any, *, app: bool = False) -> None:
        self._conn = conn
        self._on_store = on_store
        self._app = app
        self._count = 0
        self._marked = False

    def error(self, exc: BaseException) -> BaseException:
        return _error(exc, self._app)

    def flush(self) -> None:
        return None

    def _execute(self, sql: str, params: Any = None, fetch: bool = False) -> Any:
        raise NotImplementedError

    def steps(self, op: Any) -> Generator[Call, Any, Any]:
        """The driver calls that carry out ``op``: each yielded, made by the face (awaited
        by the async one), and its result sent back."""
        conn = self._conn
        if isinstance(op, Statement):
            if op.sql == ROW_COUNT:
                # The driver read it from the last statement's OK packet.
                return [(self._count,)]
            return (yield self._execute, (_pyformat(op.sql), op.params, op.fetch))
        if isinstance(op, Begin):
            began = not _in_transaction(conn)
            # With autocommit off a reservation's statement starts the transaction; without
            # one (leased mode) the savepoint would not: MariaDB ignores it outside one.
            if began and (conn.get_autocommit() or not op.reserves):
                yield conn.begin, ()
            return began
        if isinstance(op, Mark):
            self._marked = True
            return (yield self._execute, (_SAVEPOINT_SQL,))
        if isinstance(op, Check):
            if not self._marked:
                return None
            self._marked = False
            return (yield self._execute, (_to_mark(conn, "RELEASE"),))
        if isinstance(op, Undo):
            return (yield self._execute, (_to_mark(conn, "ROLLBACK TO"),))
        if isinstance(op, Commit | Rollback):
            self._marked = False
            return (yield conn.commit if isinstance(op, Commit) else conn.rollback, ())
        if isinstance(op, OnStore):
            return (yield self._on_store, (op.gen,))
        if isinstance(op, Bound):
            # The reservation's statement carries its lock wait (`_own_logic`); the store's
            # bound on the server's silence grows by as much.
            bound_reads(conn, lock_wait_seconds(op.lock_timeout))
            return None
        raise AssertionError(f"unknown operation {op!r}")


class _PyMySQLTx(_MySQLTx):
    """Runs transaction operations on one PyMySQL connection."""

    def run(self, gen: TxGen[T]) -> T:
        return execute(self, gen)

    def do(self, op: Any) -> Any:
        return drive(self.steps(op), call)

    def _execute(self, sql: str, params: Any = None, fetch: bool = False) -> Any:
        with self._conn.cursor() as cursor:
            self._count = cursor.execute(sql, params)
            return list(cursor.fetchall()) if fetch else None


class _Cursor(aiomysql.Cursor):  # type: ignore[misc]
    """aiomysql's cursor without the SHOW WARNINGS round trip after a statement with notes
    (``CREATE TABLE IF NOT EXISTS`` on an existing table): idempo reads no warnings."""

    async def _show_warnings(self, conn: Any) -> None:
        return None


class _AioMySQLTx(_MySQLTx):
    """The asynchronous face of `_PyMySQLTx`, on one aiomysql connection: the same calls,
    awaited."""

    async def run(self, gen: TxGen[T]) -> T:
        return await aexecute(self, gen)

    async def do(self, op: Any) -> Any:
        return await adrive(self.steps(op), acall)

    async def _execute(self, sql: str, params: Any = None, fetch: bool = False) -> Any:
        async with self._conn.cursor(_Cursor) as cursor:
            self._count = await cursor.execute(sql, params)
            return list(await cursor.fetchall()) if fetch else None


class _Pool:
    """A small thread-safe pool of PyMySQL connections, opened on demand, at most ``size``."""

    def __init__(self, options: Mapping[str, Any], size: int) -> None:
        self._options = dict(options)
        self._slots = threading.BoundedSemaphore(size)
        self._lock = threading.Lock()
        self._idle: list[tuple[pymysql.connections.Connection[Any], float]] = []

    def _open(self) -> pymysql.connections.Connection[Any]:
        conn = _connect(self._options)
        try:
            check_server(_server_version(conn))
        except ConfigurationError:
            conn.close()
            raise
        return conn

    def _take(self) -> pymysql.connections.Connection[Any]:
        with self._lock:
            conn, since = self._idle.pop() if self._idle else (None, 0.0)
        if conn is not None and time.monotonic() - since > IDLE_CHECK_SECONDS:
            try:
                conn.ping(reconnect=False)
            except pymysql.err.Error:
                conn.close()
                conn = None
        return conn if conn is not None else self._open()

    @contextmanager
    def connection(self) -> Iterator[pymysql.connections.Connection[Any]]:
        if not self._slots.acquire(timeout=POOL_TIMEOUT_SECONDS):
            raise StoreUnavailableError(f"no free MariaDB connection in {POOL_TIMEOUT_SECONDS}s")
        try:
            conn = self._take()
            try:
                yield conn
            finally:
                # Back to the pool only open and outside a transaction (a verb that failed
                # half-way may leave one open); otherwise it is closed.
                if conn.open and not _in_transaction(conn):
                    with self._lock:
                        self._idle.append((conn, time.monotonic()))
                elif conn.open:
                    conn.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn, _ in idle:
            if conn.open:
                conn.close()


def _binding(
    dialect: MySQLDialect, mode: Mode, lock_timeout: timedelta | None
) -> tuple[MySQLDialect, UnitLogic]:
    """What a unit on the app's connection needs: the statements with its lock wait, and
    the logic of the mode."""
    timeout = DEFAULT_LOCK_TIMEOUT if lock_timeout is None else lock_timeout
    waiting = dialect.waiting(lock_wait_seconds(timeout))

    def bounded(wait: timedelta) -> MySQLDialect:
        return dialect.waiting(lock_wait_seconds(wait))

    return waiting, unit_logic(waiting, mode, timeout, bounded)


def _own_logic(dialect: MySQLDialect) -> StoreLogic:
    """The logic of the store's own connections: a reservation bounded by a lock wait other
    than the session's (`_options`) says so in its statement."""
    session = lock_wait_seconds(DEFAULT_LOCK_TIMEOUT)

    def bounded(wait: timedelta) -> MySQLDialect:
        seconds = lock_wait_seconds(wait)
        return dialect if seconds == session else dialect.waiting(seconds)

    return StoreLogic(dialect, bounded)


def is_conflict(exc: BaseException) -> bool:
    """Whether a driver error ended the app's transaction as a conflict (see `_CONFLICTS`)."""
    return isinstance(exc, pymysql.err.Error) and _code(exc) in _CONFLICTS


class MySQLStore(SqlStore):
    """A MariaDB store. Safe to share between threads; each verb borrows a pooled connection.

    Args:
        url: ``mysql://user:password@host:port/database`` (or ``mariadb://``).
        table: the records table (``database.table`` allowed); create it with `migrate`.
        max_size: at most this many connections of the store's own.
        connect_args: more keyword arguments for ``pymysql.connect`` (``ssl=...``).
        connect_timeout: how long connecting and logging in may take (seconds or a
            timedelta); default: the URL's ``connect_timeout``, else 5 s. A server that is
            down, refuses or does not answer fails a call within it, with
            `StoreUnavailableError` saying why.
        read_timeout: how long a call on one of the store's connections may wait for the
            server's answer beyond its lock wait (seconds or a timedelta); default: the
            URL's ``read_timeout``, else the connect timeout, so 5 s + 5 s by default. A
            server that stops answering after the store connected (frozen, partitioned
            away) fails the call with `StoreUnavailableError` then, and the connection is
            closed.

    >>> store = MySQLStore("mysql://root@127.0.0.1:3306/test")  # doctest: +SKIP
    """

    # `idempo purge`'s time budget per batch, seconds (idempo._purge): on a table that fits
    # the buffer pool, 10 ms batches kept live calls' p99 during a purge at that of its
    # pauses, where fixed batches of 1000 (and 50 ms or 200 ms ones) raised it 1.1-1.7x,
    # for about 0.7x the records/s (benchmarks.md).
    purge_batch_time = 0.01

    def __init__(
        self,
        url: str,
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 10,
        connect_args: Mapping[str, Any] | None = None,
        connect_timeout: timedelta | float | None = None,
        read_timeout: timedelta | float | None = None,
    ) -> None:
        self._mysql = MySQLDialect(table)
        super().__init__(self._mysql)
        self._logic = _own_logic(self._mysql)
        options = _options(url, connect_args, connect_timeout, read_timeout)
        self.connect_timeout = timedelta(seconds=options["connect_timeout"])
        self.read_timeout = _read_timeout(options)
        self._pool = _Pool(options, max_size)

    def run(self, gen: TxGen[T]) -> T:
        with mapped_errors(), self._pool.connection() as conn:
            return _PyMySQLTx(conn, self.run).run(gen)

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> SyncUnit:
        """A unit that runs a guarded call on the app's PyMySQL connection or SQLAlchemy
        session."""
        dialect, logic = _binding(self._mysql, mode, lock_timeout)
        if isinstance(conn, pymysql.connections.Connection):
            check_server(_server_version(conn))
            return SyncUnit(logic, _PyMySQLTx(conn, self.run, app=True).run)
        conn = sqlalchemy_connection(
            conn,
            asynchronous=False,
            store="MySQLStore",
            driver="a pymysql.connections.Connection",
        )
        from ._sql.sqlalchemy import SqlAlchemyTx  # noqa: PLC0415 - optional dependency

        executor = SqlAlchemyTx(conn, dialect, self.run, map_error, conflict=is_conflict)
        return SyncUnit(logic, executor.run)

    def close(self) -> None:
        self._pool.close()


class AsyncMySQLStore(AsyncSqlStore):
    """The asynchronous twin of `MySQLStore`, on aiomysql. The pool opens on first use,
    inside the running event loop."""

    def __init__(
        self,
        url: str,
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 10,
        connect_args: Mapping[str, Any] | None = None,
        connect_timeout: timedelta | float | None = None,
        read_timeout: timedelta | float | None = None,
    ) -> None:
        self._mysql = MySQLDialect(table)
        super().__init__(self._mysql)
        self._logic = _own_logic(self._mysql)
        options = _options(url, connect_args, connect_timeout, read_timeout)
        self.connect_timeout = timedelta(seconds=options["connect_timeout"])
        self.read_timeout = _read_timeout(options)
        # aiomysql has no read timeout: a watchdog cuts off a connection that waits longer.
        bound = options.pop("read_timeout")
        self._watchdog = Watchdog(
            math.inf if bound is None else bound, _aiomysql_socket, _lock_wait, server="MariaDB"
        )
        if "database" in options:  # aiomysql's name for it
            options["db"] = options.pop("database")
        self._options = options
        self._max_size = max_size
        self._pool: aiomysql.Pool | None = None
        self._opening: asyncio.Lock | None = None

    async def _open_pool(self) -> aiomysql.Pool:
        if self._opening is None:
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._pool is None:
                timeout = self._options["connect_timeout"]
                try:
                    # aiomysql's connect_timeout, like PyMySQL's, bounds only the TCP connect.
                    async with asyncio.timeout(timeout):
                        self._pool = await aiomysql.create_pool(
                            minsize=1,
                            maxsize=self._max_size,
                            **self._options,
                        )
                except (pymysql.err.Error, OSError) as exc:
                    where = _where(self._options)
                    raise cannot_connect("MariaDB", where, _reason(exc, timeout)) from exc
        return self._pool

    async def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            pool = self._pool or await self._open_pool()
            async with pool.acquire() as conn:
                check_server(_server_version(conn))
                watchdog = self._watchdog
                watchdog.watch(conn)
                try:
                    return await _AioMySQLTx(conn, self.run).run(gen)
                except Exception as exc:  # noqa: BLE001 - raised again, or as the cause
                    raise watchdog.failure(conn, exc)  # noqa: B904
                finally:
                    watchdog.done(conn)

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> AsyncUnit:
        """A unit that runs a guarded call on the app's aiomysql connection or SQLAlchemy
        ``AsyncSession``."""
        dialect, logic = _binding(self._mysql, mode, lock_timeout)
        if isinstance(conn, aiomysql.Connection):
            check_server(_server_version(conn))
            return AsyncUnit(logic, _AioMySQLTx(conn, self.run, app=True).run)
        conn = sqlalchemy_connection(
            conn, asynchronous=True, store="AsyncMySQLStore", driver="an aiomysql.Connection"
        )
        from ._sql.sqlalchemy import AsyncSqlAlchemyTx  # noqa: PLC0415 - optional dependency

        executor = AsyncSqlAlchemyTx(conn, dialect, self.run, map_error, conflict=is_conflict)
        return AsyncUnit(logic, executor.run)

    async def aclose(self) -> None:
        self._watchdog.close()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()
            await pool.wait_closed()
