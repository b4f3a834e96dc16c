"""The transaction matrix: transactional mode on every driver, isolation level and state of
the app's connection, for each thing a guarded block may do to the transaction it runs in.

    drivers      psycopg, psycopg async, sqlite3, PyMySQL, aiomysql, SQLAlchemy Session on
                 PostgreSQL, AsyncSession on PostgreSQL, Connection on SQLite, AsyncConnection
                 on SQLite (aiosqlite)
    levels       read committed, repeatable read, serializable (SQLite: always serializable)
    connection   autocommit on, autocommit off, a transaction already open (SQLAlchemy: none
                 begun yet, or one open)
    the block    writes; fails deterministically; uses a savepoint of its own (part of its
                 work rolled back); commits the guard's transaction and raises; commits and
                 returns; rolls the guard's transaction back

For each case: the isolation level inside the block is the connection's own; the work's
effect is there exactly once (or not at all, where nothing committed) however often the key
is retried; the caller gets the right error (its own, ReplayedFailureError, or
TransactionOwnershipError); nothing is left IN_PROGRESS; the connection is left as it was
found (its autocommit setting, no transaction of the guard's open).

One database of each kind serves the whole module (fresh keys per case), so the whole matrix
runs in seconds.
"""

from __future__ import annotations

import secrets
import sqlite3
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, closing, suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import aiomysql
import psycopg
import pymysql
import pytest
from psycopg import IsolationLevel
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from conftest import MYSQL_URL, POSTGRES_URL
from helpers import new_key
from idempo import (
    AsyncIdempotency,
    Idempotency,
    Policy,
    ReplayedFailureError,
    Status,
    TransactionOwnershipError,
)
from idempo.stores.mysql import AsyncMySQLStore, MySQLStore, connect_options
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore

OPERATION = "matrix"
LEVELS = ["read committed", "repeatable read", "serializable"]
ACTIONS = ["write", "fails", "savepoint", "commit-raises", "commit-returns", "rollback"]


class Refused(Exception):
    """The work's deterministic failure (``fail_on``)."""


class AppError(Exception):
    """The work's own error after it committed the guard's transaction."""


# -- one database of each kind for the module ----------------------------------------------


@dataclass
class Db:
    """One database: where it is, its tables, and a plain way for the test to read it."""

    kind: str  # postgres, mysql, sqlite
    location: str  # URL, or the SQLite file
    prefix: str  # schema or database qualifier of the tables ("" on SQLite)

    @property
    def records(self) -> str:
        return f"{self.prefix}idempo_records"

    @property
    def business(self) -> str:
        return f"{self.prefix}business"

    reader: Any = None  # the test's own autocommit connection: what is committed

    def select(self, sql: str) -> list[tuple[Any, ...]]:
        if self.kind == "sqlite":
            with closing(sqlite3.connect(self.location)) as conn:
                return [tuple(row) for row in conn.execute(sql)]
        if self.kind == "mysql":
            with self.reader.cursor() as cursor:
                cursor.execute(sql)
                return [tuple(row) for row in cursor.fetchall()]
        return [tuple(row) for row in self.reader.execute(sql)]

    def rows(self, key: str) -> list[str]:
        found = self.select(f"SELECT note FROM {self.business} WHERE idem_key = '{key}'")
        return sorted(str(note) for (note,) in found)

    def state(self, key: str) -> str | None:
        found = self.select(f"SELECT state FROM {self.records} WHERE idem_key = '{key}'")
        return str(found[0][0]) if found else None


def _business_ddl(table: str) -> str:
    return f"CREATE TABLE {table} (idem_key VARCHAR(255) NOT NULL, note VARCHAR(255) NOT NULL)"


@pytest.fixture(scope="module")
def matrix_postgres() -> Iterator[Db]:
    schema = f"m_{secrets.token_hex(6)}"
    try:
        with psycopg.connect(POSTGRES_URL, autocommit=True, connect_timeout=3) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
            conn.execute(_business_ddl(f"{schema}.business"))
    except psycopg.Error as exc:
        pytest.skip(f"PostgreSQL unreachable: {exc}")
    db = Db("postgres", POSTGRES_URL, f"{schema}.")
    store = PostgresStore(POSTGRES_URL, table=db.records, max_size=2)
    store.migrate()
    store.close()
    with psycopg.connect(POSTGRES_URL, autocommit=True) as db.reader:
        yield db
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture(scope="module")
def matrix_mysql() -> Iterator[Db]:
    name = f"idempo_m_{secrets.token_hex(6)}"
    try:
        with pymysql.connect(**connect_options(MYSQL_URL), autocommit=True) as conn:
            conn.cursor().execute(f"CREATE DATABASE {name}")
            conn.cursor().execute(_business_ddl(f"{name}.business"))
    except pymysql.err.Error as exc:
        pytest.skip(f"MariaDB unreachable: {exc}")
    db = Db("mysql", f"{MYSQL_URL.rsplit('/', 1)[0]}/{name}", f"{name}.")
    store = MySQLStore(db.location, table=db.records, max_size=2)
    store.migrate()
    store.close()
    with pymysql.connect(**connect_options(db.location), autocommit=True) as db.reader:
        yield db
    with pymysql.connect(**connect_options(MYSQL_URL), autocommit=True) as conn:
        conn.cursor().execute(f"DROP DATABASE {name}")


@pytest.fixture(scope="module")
def matrix_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Db:
    path = str(tmp_path_factory.mktemp("matrix") / "app.db")
    store = SQLiteStore(path)
    store.migrate()
    store.close()
    with sqlite3.connect(path) as conn:
        conn.execute(_business_ddl("business"))
    return Db("sqlite", path, "")


# -- the drivers -------------------------------------------------------------------------------


class App:
    """One driver's view of the app's connection, behind awaited calls so that one test body
    serves sync and async drivers alike (a sync driver never suspends)."""

    is_async = False
    db: Db
    conn: Any
    autocommit: Any = None

    async def execute(self, sql: str) -> list[tuple[Any, ...]]:
        raise NotImplementedError

    async def commit(self) -> None:
        raise NotImplementedError

    async def rollback(self) -> None:
        raise NotImplementedError

    async def isolation(self) -> str:
        """The isolation level of the transaction the block runs in, as the server says."""
        if self.db.kind == "sqlite":
            return "serializable"  # SQLite's only one
        if self.db.kind == "mysql":
            (level,) = (await self.execute("SELECT @@tx_isolation"))[0]
            return str(level).replace("-", " ").lower()
        (level,) = (await self.execute("SHOW transaction_isolation"))[0]
        return str(level)

    async def savepoint(self, key: str) -> None:
        """Part of the work in a savepoint the app rolls back, part in one it keeps."""
        for name, keep in (("app_kept", True), ("app_dropped", False)):
            await self.execute(f"SAVEPOINT {name}")
            await self.insert(key, name)
            end = "RELEASE SAVEPOINT" if keep else "ROLLBACK TO SAVEPOINT"
            await self.execute(f"{end} {name}")

    async def insert(self, key: str, note: str) -> None:
        await self.execute(f"INSERT INTO {self.db.business} VALUES ('{key}', '{note}')")

    def idle(self) -> bool:
        raise NotImplementedError

    def settings(self) -> Any:
        """What the guard must leave as it found it (autocommit)."""
        return None


class Psycopg(App):
    def __init__(self, db: Db, conn: Any) -> None:
        self.db, self.conn = db, conn

    async def execute(self, sql: str) -> list[tuple[Any, ...]]:
        cursor = self.conn.execute(sql)
        return list(cursor.fetchall()) if cursor.description else []

    async def commit(self) -> None:
        self.conn.commit()

    async def rollback(self) -> None:
        self.conn.rollback()

    async def savepoint(self, key: str) -> None:
        # psycopg's own nested transactions: savepoints inside the guard's transaction.
        with self.conn.transaction():
            await self.insert(key, "app_kept")
        with suppress(Refused), self.conn.transaction():
            await self.insert(key, "app_dropped")
            raise Refused("undo this part")

    def idle(self) -> bool:
        return bool(self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE)

    def settings(self) -> Any:
        return (self.conn.autocommit, self.conn.isolation_level)


class AsyncPsycopg(Psycopg):
    is_async = True

    async def execute(self, sql: str) -> list[tuple[Any, ...]]:
        cursor = await self.conn.execute(sql)
        return list(await cursor.fetchall()) if cursor.description else []

    async def commit(self) -> None:
        await self.conn.commit()

    async def rollback(self) -> None:
        await self.conn.rollback()

    async def savepoint(self, key: str) -> None:
        async with self.conn.transaction():
            await self.insert(key, "app_kept")
        with suppress(Refused):
            async with self.conn.transaction():
                await self.insert(key, "app_dropped")
                raise Refused("undo this part")


class Sqlite3(App):
    def __init__(self, db: Db, conn: sqlite3.Connection) -> None:
        self.db, self.conn = db, conn

    async def execute(self, sql: str) -> list[tuple[Any, ...]]:
        return [tuple(row) for row in self.conn.execute(sql).fetchall()]

    async def commit(self) -> None:
        self.conn.commit()

    async def rollback(self) -> None:
        self.conn.rollback()

    def idle(self) -> bool:
        return not self.conn.in_transaction

    def settings(self) -> Any:
        return self.conn.isolation_level


class PyMySQL(App):
    def __init__(self, db: Db, conn: Any) -> None:
        self.db, self.conn = db, conn

    async def execute(self, sql: str) -> list[tuple[Any, ...]]:
        with self.conn.cursor() as cursor:
            cursor.execute(sql)
            return [tuple(row) for row in cursor.fetchall()]

    async def commit(self) -> None:
        self.conn.commit()

    async def rollback(self) -> None:
        self.conn.rollback()

    def idle(self) -> bool:
        return not self.conn.server_status & pymysql.constants.SERVER_STATUS.SERVER_STATUS_IN_TRANS

    def settings(self) -> Any:
        return self.conn.get_autocommit()


class AioMySQL(PyMySQL):
    is_async = True

    async def execute(self, sql: str) -> list[tuple[Any, ...]]:
        async with self.conn.cursor() as cursor:
            await cursor.execute(sql)
            return [tuple(row) for row in await cursor.fetchall()]

    async def commit(self) -> None:
        await self.conn.commit()

    async def rollback(self) -> None:
        await self.conn.rollback()


class SqlAlchemy(App):
    """A Session or Connection (``is_async``: their async twins)."""

    def __init__(self, db: Db, conn: Any, *, is_async: bool) -> None:
        self.db, self.conn, self.is_async = db, conn, is_async

    async def execute(self, sql: str) -> list[tuple[Any, ...]]:
        result = self.conn.execute(text(sql))
        if self.is_async:
            result = await result
        return [tuple(row) for row in result] if result.returns_rows else []

    async def _call(self, verb: str) -> None:
        done = getattr(self.conn, verb)()
        if self.is_async:
            await done

    async def commit(self) -> None:
        await self._call("commit")

    async def rollback(self) -> None:
        await self._call("rollback")

    async def savepoint(self, key: str) -> None:
        # SQLAlchemy's own nested transactions.
        if self.is_async:
            async with self.conn.begin_nested():
                await self.insert(key, "app_kept")
            with suppress(Refused):
                async with self.conn.begin_nested():
                    await self.insert(key, "app_dropped")
                    raise Refused("undo this part")
            return
        with self.conn.begin_nested():
            await self.insert(key, "app_kept")
        with suppress(Refused), self.conn.begin_nested():
            await self.insert(key, "app_dropped")
            raise Refused("undo this part")

    def idle(self) -> bool:
        return not self.conn.in_transaction()


# -- the cases ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    driver: str
    level: str
    state: str
    action: str


_DRIVERS = {
    # driver: (database, states, levels)
    "psycopg": ("postgres", ["autocommit", "tx", "open"], LEVELS),
    "psycopg-async": ("postgres", ["autocommit", "tx", "open"], LEVELS),
    "sqlite3": ("sqlite", ["autocommit", "tx", "open"], ["serializable"]),
    "pymysql": ("mysql", ["autocommit", "tx", "open"], LEVELS),
    "aiomysql": ("mysql", ["autocommit", "tx", "open"], LEVELS),
    "sqlalchemy-pg-session": ("postgres", ["tx", "open"], LEVELS),
    "sqlalchemy-pg-async-session": ("postgres", ["tx", "open"], LEVELS),
    "sqlalchemy-sqlite-connection": ("sqlite", ["tx", "open"], ["serializable"]),
    "sqlalchemy-sqlite-async-connection": ("sqlite", ["tx", "open"], ["serializable"]),
}
_ASYNC = {"psycopg-async", "aiomysql", "sqlalchemy-pg-async-session"}
_ASYNC |= {"sqlalchemy-sqlite-async-connection"}
_MARKS = {"postgres": [pytest.mark.postgres], "mysql": [pytest.mark.mysql], "sqlite": []}

CASES = [
    pytest.param(
        Case(driver, level, state, action),
        marks=_MARKS[kind],
        id=f"{driver}-{level.replace(' ', '_')}-{state}-{action}",
    )
    for driver, (kind, states, levels) in _DRIVERS.items()
    for level in levels
    for state in states
    for action in ACTIONS
]


@asynccontextmanager
async def app_for(case: Case, db: Db) -> AsyncIterator[App]:
    """The app's connection for the case, set up as the case says."""
    level, state = case.level, case.state
    autocommit = state == "autocommit"
    app: App
    if case.driver == "psycopg":
        conn = psycopg.connect(db.location, autocommit=autocommit)
        conn.isolation_level = IsolationLevel[level.upper().replace(" ", "_")]
        app = Psycopg(db, conn)
    elif case.driver == "psycopg-async":
        conn = await psycopg.AsyncConnection.connect(db.location, autocommit=autocommit)
        await conn.set_isolation_level(IsolationLevel[level.upper().replace(" ", "_")])
        app = AsyncPsycopg(db, conn)
    elif case.driver == "sqlite3":
        conn = sqlite3.connect(db.location, timeout=10, isolation_level=None)
        if state != "autocommit":
            conn.isolation_level = ""  # the module's implicit transactions (DEFERRED)
        app = Sqlite3(db, conn)
    elif case.driver == "pymysql":
        conn = pymysql.connect(**connect_options(db.location), autocommit=autocommit)
        app = PyMySQL(db, conn)
        await app.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {level.upper()}")
    elif case.driver == "aiomysql":
        options = connect_options(db.location)
        options["db"] = options.pop("database")
        conn = await aiomysql.connect(**options, autocommit=autocommit)
        app = AioMySQL(db, conn)
        await app.execute(f"SET SESSION TRANSACTION ISOLATION LEVEL {level.upper()}")
    else:
        app = await _sqlalchemy(case, db)
    settings = app.settings()
    try:
        if state == "open":
            if db.kind != "postgres":
                # MariaDB flags a transaction as open only once it writes or asks for one.
                await app.execute("BEGIN")
            else:
                await app.execute(f"SELECT count(*) FROM {db.business}")
            assert not app.idle()
        yield app
        assert app.settings() == settings, "the guard changed the connection's settings"
    finally:
        await _close(app)


_engines: dict[str, Any] = {}


@pytest.fixture(scope="module", autouse=True)
def _dispose_engines() -> Iterator[None]:
    yield
    for engine in _engines.values():
        engine.dispose()
    _engines.clear()


async def _sqlalchemy(case: Case, db: Db) -> App:
    level = case.level.upper()
    is_async = "async" in case.driver
    if db.kind == "postgres":
        url = db.location.replace("postgresql://", "postgresql+psycopg://", 1)
    else:
        url = f"sqlite+aiosqlite:///{db.location}" if is_async else f"sqlite:///{db.location}"
    if is_async:  # an async engine's connections belong to the test's event loop
        engine = create_async_engine(url, isolation_level=level)
        if "session" in case.driver:
            return SqlAlchemy(db, AsyncSession(engine), is_async=True)
        return SqlAlchemy(db, await engine.connect(), is_async=True)
    engine = _engines.get(url + level)
    if engine is None:
        engine = _engines[url + level] = create_engine(url, isolation_level=level)
    if "session" in case.driver:
        return SqlAlchemy(db, Session(engine), is_async=False)
    return SqlAlchemy(db, engine.connect(), is_async=False)


async def _close(app: App) -> None:
    conn = app.conn
    if isinstance(app, SqlAlchemy):
        if app.is_async:
            engine = conn.bind if isinstance(conn, AsyncSession) else conn.engine
            await conn.close()
            await engine.dispose()
        else:
            conn.close()
        return
    closed = conn.close()  # aiomysql's is synchronous, psycopg's async one is not
    if closed is not None:
        await closed


@pytest.fixture(scope="module")
def sync_stores(
    matrix_postgres: Db, matrix_mysql: Db, matrix_sqlite: Db
) -> Iterator[dict[str, Any]]:
    stores = {
        "postgres": PostgresStore(
            matrix_postgres.location, table=matrix_postgres.records, max_size=4
        ),
        "mysql": MySQLStore(matrix_mysql.location, table=matrix_mysql.records, max_size=4),
        "sqlite": SQLiteStore(matrix_sqlite.location),
    }
    yield stores
    for store in stores.values():
        store.close()


@asynccontextmanager
async def guard_for(
    case: Case, db: Db, sync_stores: dict[str, Any]
) -> AsyncIterator[Idempotency | AsyncIdempotency]:
    policy = Policy(fail_on=(Refused,), lock_timeout=timedelta(seconds=10))
    if case.driver not in _ASYNC:
        yield Idempotency(sync_stores[db.kind], policy)
        return
    store: Any
    if db.kind == "postgres":
        store = AsyncPostgresStore(db.location, table=db.records, max_size=2)
    elif db.kind == "mysql":
        store = AsyncMySQLStore(db.location, table=db.records, max_size=2)
    else:
        store = AsyncSQLiteStore(db.location)
    try:
        yield AsyncIdempotency(store, policy)
    finally:
        await store.aclose()


class Guarded:
    """``once`` on either kind of guard, entered the same way from the test."""

    def __init__(self, guard: Idempotency | AsyncIdempotency, app: App, level: str) -> None:
        self.guard, self.app, self.level = guard, app, level

    @asynccontextmanager
    async def once(self, key: str) -> AsyncIterator[Any]:
        once = self.guard.once(key, operation=OPERATION, conn=self.app.conn)
        if isinstance(self.guard, AsyncIdempotency):
            async with once as attempt:
                yield attempt
        else:
            with once as attempt:
                yield attempt


async def block(guarded: Guarded, key: str, action: str, runs: list[str]) -> Any:
    """One guarded call doing what the case's block does; returns its result."""
    app = guarded.app
    async with guarded.once(key) as attempt:
        if attempt.replayed:
            return attempt.result
        runs.append(action)
        assert await app.isolation() == guarded.level, "the guard changed the isolation level"
        if action == "savepoint":
            await app.savepoint(key)
        else:
            await app.insert(key, "work")
        if action == "fails":
            raise Refused("declined")
        if action.startswith("commit"):
            await app.commit()
            if action == "commit-raises":
                raise AppError("after committing")
        if action == "rollback":
            await app.rollback()
        attempt.result = {"done": key}
    return attempt.result


@pytest.mark.anyio
@pytest.mark.parametrize("case", CASES)
async def test_transaction_matrix(
    case: Case, request: pytest.FixtureRequest, sync_stores: dict[str, Any]
) -> None:
    """The block's effect, the caller's error and the record agree, whatever the driver, the
    isolation level, the connection's state and what the block does to the transaction."""
    db: Db = request.getfixturevalue(f"matrix_{_DRIVERS[case.driver][0]}")
    key = new_key()
    runs: list[str] = []
    async with guard_for(case, db, sync_stores) as guard, app_for(case, db) as app:
        guarded = Guarded(guard, app, case.level)
        action = case.action

        if action in ("write", "savepoint"):
            assert await block(guarded, key, action, runs) == {"done": key}
            assert app.idle()
            assert await block(guarded, key, action, runs) == {"done": key}  # replayed
            assert db.state(key) == Status.COMPLETED.value
            assert db.rows(key) == (["app_kept"] if action == "savepoint" else ["work"])
        elif action == "fails":
            with pytest.raises(Refused):
                await block(guarded, key, action, runs)
            assert app.idle()
            with pytest.raises(ReplayedFailureError):
                await block(guarded, key, action, runs)
            assert db.state(key) == Status.FAILED.value
            assert db.rows(key) == []
        elif action.startswith("commit"):
            with pytest.raises(TransactionOwnershipError) as raised:
                await block(guarded, key, action, runs)
            if action == "commit-raises":
                assert isinstance(raised.value.__cause__, AppError)
            assert app.idle()
            with pytest.raises(ReplayedFailureError, match="TransactionOwnershipError"):
                await block(guarded, key, action, runs)
            assert db.state(key) == Status.FAILED.value
            assert db.rows(key) == ["work"]  # what the block committed, once
        else:  # rollback
            with pytest.raises(TransactionOwnershipError):
                await block(guarded, key, action, runs)
            assert app.idle()
            assert db.state(key) is None  # its rollback took the reservation with it
            assert db.rows(key) == []
            # Nothing committed, so the retry runs, here as a plain write.
            assert await block(guarded, key, "write", runs) == {"done": key}
            assert db.rows(key) == ["work"]
        assert runs == [action] if action != "rollback" else ["rollback", "write"]
        assert db.state(key) != Status.IN_PROGRESS.value


def test_matrix_covers_every_driver() -> None:
    """Every driver the brief names is in the matrix, with every action."""
    cases = [param.values[0] for param in CASES]
    assert {case.driver for case in cases} == set(_DRIVERS)
    assert {case.action for case in cases} == set(ACTIONS)
