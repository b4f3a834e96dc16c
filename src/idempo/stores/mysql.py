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
import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from functools import lru_cache
from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlsplit

try:
    import aiomysql
    import pymysql
    from pymysql.constants import CLIENT, SERVER_STATUS
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from ..errors import ConfigurationError

    raise ConfigurationError(
        "the MariaDB/MySQL store needs PyMySQL and aiomysql: pip install 'idempo[mysql]'"
    ) from exc

from ..errors import ConfigurationError, IdempotencyError, StoreError, StoreUnavailableError
from . import DEFAULT_CONNECT_TIMEOUT, cannot_connect, schema_missing, seconds
from ._mysql import ROW_COUNT, MySQLDialect, lock_wait_seconds
from ._sql import Statement, adrive, drive, pyformat
from ._units import (
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
    UnitLogic,
    unit_logic,
)
from .base import Mode

__all__ = ["AsyncMySQLStore", "MySQLStore", "connect_options"]

T = TypeVar("T")

DEFAULT_TABLE = "idempo_records"
DEFAULT_LOCK_TIMEOUT = timedelta(seconds=5)
# A pooled connection idle this long is pinged before use: the server may have dropped it.
IDLE_CHECK_SECONDS = 30.0
POOL_TIMEOUT_SECONDS = 30.0

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
    query may also set ``connect_timeout`` (seconds).

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
        elif name == "connect_timeout":
            options["connect_timeout"] = seconds(value)
        else:
            raise ConfigurationError(f"unknown MySQL URL option {name!r}")
    return options


def _options(
    url: str, connect_args: Mapping[str, Any] | None, connect_timeout: timedelta | float | None
) -> dict[str, Any]:
    """How the store's own connections are set up: autocommit (each verb commits by itself),
    matched-row counts (a renewal that changes nothing is not "stale"), the lock wait, the
    connect timeout (the argument, else the URL's, else 5 s)."""
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
    return options


def _where(options: Mapping[str, Any]) -> str:
    """Where the options connect, for messages."""
    database = options.get("database") or options.get("db") or ""
    if options.get("unix_socket"):
        return f"{options['unix_socket']}/{database}"
    return f"{options.get('host', 'localhost')}:{options.get('port', 3306)}/{database}"


def _connect(options: Mapping[str, Any]) -> pymysql.connections.Connection[Any]:
    """A PyMySQL connection, the whole login bounded by the connect timeout: PyMySQL's own
    bounds only the TCP connect, so a server that accepts and then says nothing would hold
    the call for ever."""
    timeout = options["connect_timeout"]
    read_timeout = options.get("read_timeout")
    try:
        conn: pymysql.connections.Connection[Any] = pymysql.connect(
            **{**options, "read_timeout": read_timeout or timeout}
        )
    except (pymysql.err.Error, OSError) as exc:
        raise cannot_connect("MariaDB", _where(options), _reason(exc, timeout)) from exc
    if read_timeout is None:
        # Logged in: statements may take as long as they need again (a lock wait may).
        # PyMySQL has no public setter; it applies this before its next read.
        conn._read_timeout = None  # type: ignore[attr-defined]
    return conn


def _in_transaction(conn: Any) -> bool:
    return bool(conn.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS)


# The app's transaction is over, as a serialization failure ends one on PostgreSQL: chosen
# as a deadlock victim (1213: InnoDB rolled it all back), or its snapshot overtaken by a
# concurrent commit (1020, MariaDB's innodb_snapshot_isolation).
_CONFLICTS = frozenset({1213, 1020})
_NO_SUCH_SAVEPOINT = 1305
_SAVEPOINT_SQL = f"SAVEPOINT {SAVEPOINT}"


@contextmanager
def _translated(app: bool) -> Iterator[None]:
    """What the driver's errors mean to the transaction's logic (inside `mapped_errors`)."""
    try:
        yield
    except pymysql.err.Error as exc:
        code = _code(exc)
        if code == _NO_SUCH_SAVEPOINT:
            raise TransactionEnded(str(exc)) from exc
        if app and code in _CONFLICTS:
            raise TransactionConflict(exc) from exc
        raise


def _to_mark(conn: Any, verb: str) -> str:
    """The statement that releases the savepoint or rolls back to it. No open transaction
    (the app's COMMIT said so in its reply) means the app ended the guard's."""
    if not _in_transaction(conn):
        raise TransactionEnded("the connection has no open transaction")
    return f"{verb} SAVEPOINT {SAVEPOINT}"


class _PyMySQLTx:
    """Runs transaction operations on one PyMySQL connection. ``app``: the app's connection
    (a guarded call), whose serialization failures and deadlocks its caller gets raw."""

    def __init__(
        self, conn: pymysql.connections.Connection[Any], on_store: Any, *, app: bool = False
    ) -> None:
        self._conn = conn
        self._on_store = on_store
        self._app = app
        self._count = 0
        self._marked = False

    def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            return drive(gen, self._do)

    def _execute(self, sql: str, params: Any = None, *, fetch: bool = False) -> Any:
        with self._conn.cursor() as cursor:
            self._count = cursor.execute(sql, params)
            return list(cursor.fetchall()) if fetch else None

    def _do(self, op: Any) -> Any:
        conn = self._conn
        with mapped_errors(), _translated(self._app):
            match op:
                case Statement(sql, params, fetch):
                    if sql == ROW_COUNT:
                        # The driver read it from the last statement's OK packet.
                        return [(self._count,)]
                    return self._execute(_pyformat(sql), params, fetch=fetch)
                case Begin():
                    began = not _in_transaction(conn)
                    if began and conn.get_autocommit():
                        conn.begin()
                    return began
                case Mark():
                    self._marked = True
                    return self._execute(_SAVEPOINT_SQL)
                case Check() if self._marked:
                    self._marked = False
                    return self._execute(_to_mark(conn, "RELEASE"))
                case Check():
                    return None
                case Undo():
                    return self._execute(_to_mark(conn, "ROLLBACK TO"))
                case Commit():
                    self._marked = False
                    return conn.commit()
                case Rollback():
                    self._marked = False
                    return conn.rollback()
                case OnStore(gen):
                    return self._on_store(gen)
        raise AssertionError(f"unknown operation {op!r}")


class _Cursor(aiomysql.Cursor):  # type: ignore[misc]
    """aiomysql's cursor with two changes.

    Bytes are escaped here, as PyMySQL does (``_binary X'...'``): aiomysql 0.3 calls a
    PyMySQL helper that PyMySQL 1.2.3 replaced with a string (aio-libs/aiomysql#1080). And no
    SHOW WARNINGS round trip after a statement with notes (``CREATE TABLE IF NOT EXISTS`` on
    an existing table): idempo reads no warnings.
    """

    def _escape_args(self, args: Any, conn: Any) -> Any:
        if isinstance(args, dict):
            return {
                name: f"_binary X'{value.hex()}'"
                if isinstance(value, bytes)
                else conn.escape(value)
                for name, value in args.items()
            }
        return super()._escape_args(args, conn)

    async def _show_warnings(self, conn: Any) -> None:
        return None


class _AioMySQLTx:
    """The asynchronous twin of `_PyMySQLTx`, on one aiomysql connection."""

    def __init__(self, conn: aiomysql.Connection, on_store: Any, *, app: bool = False) -> None:
        self._conn = conn
        self._on_store = on_store
        self._app = app
        self._count = 0
        self._marked = False

    async def run(self, gen: TxGen[T]) -> T:
        with mapped_errors():
            return await adrive(gen, self._do)

    async def _execute(self, sql: str, params: Any = None, *, fetch: bool = False) -> Any:
        async with self._conn.cursor(_Cursor) as cursor:
            self._count = await cursor.execute(sql, params)
            return list(await cursor.fetchall()) if fetch else None

    async def _do(self, op: Any) -> Any:
        conn = self._conn
        with mapped_errors(), _translated(self._app):
            match op:
                case Statement(sql, params, fetch):
                    if sql == ROW_COUNT:
                        return [(self._count,)]
                    return await self._execute(_pyformat(sql), params, fetch=fetch)
                case Begin():
                    began = not _in_transaction(conn)
                    if began and conn.get_autocommit():
                        await conn.begin()
                    return began
                case Mark():
                    self._marked = True
                    return await self._execute(_SAVEPOINT_SQL)
                case Check() if self._marked:
                    self._marked = False
                    return await self._execute(_to_mark(conn, "RELEASE"))
                case Check():
                    return None
                case Undo():
                    return await self._execute(_to_mark(conn, "ROLLBACK TO"))
                case Commit():
                    self._marked = False
                    return await conn.commit()
                case Rollback():
                    self._marked = False
                    return await conn.rollback()
                case OnStore(gen):
                    return await self._on_store(gen)
        raise AssertionError(f"unknown operation {op!r}")


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
) -> tuple[MySQLDialect, timedelta, UnitLogic]:
    """What a unit on the app's connection needs: the statements with its lock wait, the
    timeout itself, and the logic of the mode."""
    timeout = DEFAULT_LOCK_TIMEOUT if lock_timeout is None else lock_timeout
    waiting = dialect.waiting(lock_wait_seconds(timeout))

    def bounded(wait: timedelta) -> MySQLDialect:
        return dialect.waiting(lock_wait_seconds(wait))

    return waiting, timeout, unit_logic(waiting, mode, timeout, bounded)


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

    >>> store = MySQLStore("mysql://root@127.0.0.1:3306/test")  # doctest: +SKIP
    """

    def __init__(
        self,
        url: str,
        *,
        table: str = DEFAULT_TABLE,
        max_size: int = 10,
        connect_args: Mapping[str, Any] | None = None,
        connect_timeout: timedelta | float | None = None,
    ) -> None:
        self._mysql = MySQLDialect(table)
        super().__init__(self._mysql)
        options = _options(url, connect_args, connect_timeout)
        self.connect_timeout = timedelta(seconds=options["connect_timeout"])
        self._pool = _Pool(options, max_size)

    def run(self, gen: TxGen[T]) -> T:
        with mapped_errors(), self._pool.connection() as conn:
            return _PyMySQLTx(conn, self.run).run(gen)

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> SyncUnit:
        """A unit that runs a guarded call on the app's PyMySQL connection or SQLAlchemy
        session."""
        dialect, timeout, logic = _binding(self._mysql, mode, lock_timeout)
        if isinstance(conn, pymysql.connections.Connection):
            check_server(_server_version(conn))
            return SyncUnit(logic, _PyMySQLTx(conn, self.run, app=True).run)
        from ._sqlalchemy import SqlAlchemyTx  # noqa: PLC0415 - optional dependency

        executor = SqlAlchemyTx(conn, dialect, timeout, self.run, map_error, conflict=is_conflict)
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
    ) -> None:
        self._mysql = MySQLDialect(table)
        super().__init__(self._mysql)
        options = _options(url, connect_args, connect_timeout)
        self.connect_timeout = timedelta(seconds=options["connect_timeout"])
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
                return await _AioMySQLTx(conn, self.run).run(gen)

    def bind(
        self, conn: Any, *, mode: Mode = "transactional", lock_timeout: timedelta | None = None
    ) -> AsyncUnit:
        """A unit that runs a guarded call on the app's aiomysql connection or SQLAlchemy
        ``AsyncSession``."""
        dialect, timeout, logic = _binding(self._mysql, mode, lock_timeout)
        if isinstance(conn, aiomysql.Connection):
            check_server(_server_version(conn))
            return AsyncUnit(logic, _AioMySQLTx(conn, self.run, app=True).run)
        from ._sqlalchemy import AsyncSqlAlchemyTx  # noqa: PLC0415 - optional dependency

        executor = AsyncSqlAlchemyTx(
            conn, dialect, timeout, self.run, map_error, conflict=is_conflict
        )
        return AsyncUnit(logic, executor.run)

    async def aclose(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()
            await pool.wait_closed()
