"""Transactional mode through SQLAlchemy 2 (Session, Connection, and their async twins) and
through psycopg's AsyncConnection, on PostgreSQL and on SQLite.

The business table has no unique constraint on the key, so a second execution would show as a
second row. What is committed is always read through a separate, plain driver connection.
"""

from __future__ import annotations

import sqlite3
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import anyio
import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from idempo import AsyncIdempotency, Idempotency, Policy
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore

OPERATION = "pay"
DUPLICATES = 4
# Duplicates wait on the first attempt's lock; long enough that none is turned away.
POLICY = Policy(lock_timeout=timedelta(seconds=20))


@dataclass(frozen=True)
class Database:
    """A database with a records table and a business table, and the ways to reach it."""

    kind: Literal["sqlite", "postgres"]
    location: str  # the SQLite file, or the libpq URL
    schema: str = ""

    @property
    def records(self) -> str:
        return f"{self.schema}.idempo_records" if self.schema else "idempo_records"

    @property
    def business(self) -> str:
        return f"{self.schema}.payments" if self.schema else "payments"

    @property
    def insert(self) -> str:
        return f"INSERT INTO {self.business} (idem_key, worker) VALUES (:key, :worker)"

    def url(self, *, asynchronous: bool) -> str:
        if self.kind == "sqlite":
            return (
                f"sqlite+aiosqlite:///{self.location}"
                if asynchronous
                else f"sqlite:///{self.location}"
            )
        return self.location.replace("postgresql://", "postgresql+psycopg://", 1)

    def store(self) -> Any:
        if self.kind == "sqlite":
            return SQLiteStore(self.location)
        return PostgresStore(self.location, table=self.records, max_size=4)

    def async_store(self) -> Any:
        if self.kind == "sqlite":
            return AsyncSQLiteStore(self.location)
        return AsyncPostgresStore(self.location, table=self.records, max_size=4)

    def select(self, sql: str) -> list[tuple[Any, ...]]:
        """Committed rows, read through a plain driver connection of their own."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.location)
            try:
                return [tuple(row) for row in conn.execute(sql).fetchall()]
            finally:
                conn.close()
        with psycopg.connect(self.location) as pg:
            return [tuple(row) for row in pg.execute(sql).fetchall()]

    def rows(self) -> list[tuple[Any, ...]]:
        """The business rows as (key, worker)."""
        return self.select(f"SELECT idem_key, worker FROM {self.business} ORDER BY worker")

    def records_seen(self) -> list[tuple[Any, ...]]:
        """The records as (key, state, token)."""
        return self.select(f"SELECT idem_key, state, token FROM {self.records}")

    def lock_waiters(self) -> int:
        """PostgreSQL: how many backends wait on a lock in a statement on our records table."""
        found = self.select(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            f" AND query LIKE '%{self.records}%'"
        )
        return int(found[0][0])


def _prepare(database: Database) -> Database:
    store = database.store()
    try:
        store.migrate()
    finally:
        store.close()
    ddl = f"CREATE TABLE {database.business} (idem_key TEXT NOT NULL, worker TEXT NOT NULL)"
    if database.kind == "sqlite":
        conn = sqlite3.connect(database.location)
        try:
            conn.execute(ddl)
        finally:
            conn.close()
    else:
        with psycopg.connect(database.location, autocommit=True) as pg:
            pg.execute(ddl)
    return database


@pytest.fixture
def sqlite_database(tmp_path: Path) -> Database:
    """A SQLite file with a migrated records table and an empty business table."""
    return _prepare(Database("sqlite", str(tmp_path / "app.db")))


@pytest.fixture
def postgres_database(postgres_url: str, pg_schema: str) -> Database:
    """The test's own PostgreSQL schema with a records table and an empty business table."""
    return _prepare(Database("postgres", postgres_url, pg_schema))


def new_key() -> str:
    return f"k-{uuid.uuid4().hex}"


# -- sync: Session and Connection ----------------------------------------------------------

SYNC_CASES = [
    pytest.param(("sqlite", "session"), id="sqlite-session"),
    pytest.param(("sqlite", "connection"), id="sqlite-connection"),
    pytest.param(("postgres", "session"), marks=pytest.mark.postgres, id="postgres-session"),
    pytest.param(("postgres", "connection"), marks=pytest.mark.postgres, id="postgres-connection"),
]


@dataclass
class SyncApp:
    """An app that reaches its database through SQLAlchemy and guards its work with idempo."""

    database: Database
    engine: Engine
    face: str
    idem: Idempotency
    executions: int = 0

    @contextmanager
    def connection(self) -> Iterator[Any]:
        """A Session or a Connection, as the case says."""
        if self.face == "session":
            with Session(self.engine) as session:
                yield session
        else:
            with self.engine.connect() as conn:
                yield conn

    def pay(
        self,
        key: str,
        worker: str = "w",
        *,
        conn: Any = None,
        during: Callable[[], None] = lambda: None,
    ) -> tuple[bool, Any]:
        """(replayed, result) of one guarded payment, on ``conn`` or a connection of its own."""
        if conn is None:
            with self.connection() as own:
                return self.pay(key, worker, conn=own, during=during)
        with self.idem.once(key, operation=OPERATION, payload={"amount": 5}, conn=conn) as a:
            if a.replayed:
                return True, a.result
            self.executions += 1
            conn.execute(text(self.database.insert), {"key": key, "worker": worker})
            during()
            a.result = {"paid": key, "by": worker}
        return False, a.result


@pytest.fixture(params=SYNC_CASES)
def sync_app(request: pytest.FixtureRequest) -> Iterator[SyncApp]:
    """An app on a SQLAlchemy Session or Connection over SQLite or PostgreSQL."""
    kind, face = request.param
    database: Database = request.getfixturevalue(f"{kind}_database")
    engine = create_engine(database.url(asynchronous=False))
    store = database.store()
    try:
        yield SyncApp(database, engine, face, Idempotency(store, POLICY))
    finally:
        store.close()
        engine.dispose()


def test_sync_business_write_commits_with_the_record(sync_app: SyncApp) -> None:
    """The business row and the completed record become visible together, when the guarded
    block ends, and not before."""
    key = new_key()
    database = sync_app.database

    def nothing_visible_yet() -> None:
        assert database.rows() == []
        assert database.records_seen() == []

    assert sync_app.pay(key, during=nothing_visible_yet) == (False, {"paid": key, "by": "w"})
    assert database.rows() == [(key, "w")]
    assert database.records_seen() == [(key, "completed", 1)]


def test_sync_exception_rolls_back_write_and_record(sync_app: SyncApp) -> None:
    """A block that raises leaves neither its business row nor a record, and the same
    connection then serves a retry that executes."""
    key = new_key()
    database = sync_app.database

    def fail() -> None:
        raise RuntimeError("the work broke")

    with sync_app.connection() as conn:
        with pytest.raises(RuntimeError, match="the work broke"):
            sync_app.pay(key, conn=conn, during=fail)
        assert database.rows() == []
        assert database.records_seen() == []
        assert sync_app.pay(key, "retry", conn=conn) == (False, {"paid": key, "by": "retry"})
    assert database.rows() == [(key, "retry")]
    assert database.records_seen() == [(key, "completed", 1)]


def test_sync_replay_does_not_run_the_body(sync_app: SyncApp) -> None:
    """A retry of a completed payment replays its result without running the block again."""
    key = new_key()
    first = sync_app.pay(key, "first")
    assert first == (False, {"paid": key, "by": "first"})
    with sync_app.connection() as conn:
        assert sync_app.pay(key, "second", conn=conn) == (True, first[1])
        assert sync_app.pay(key, "third", conn=conn) == (True, first[1])
    assert sync_app.executions == 1
    assert sync_app.database.rows() == [(key, "first")]


def test_sync_concurrent_duplicates_execute_once(sync_app: SyncApp) -> None:
    """Duplicates released together from several threads, each on its own Session or
    Connection, execute once; the others wait on the lock and replay that result."""
    key = new_key()
    barrier = threading.Barrier(DUPLICATES)
    results: list[tuple[bool, Any]] = []
    lock = threading.Lock()

    def duplicate(index: int) -> None:
        with sync_app.connection() as conn:
            barrier.wait(timeout=30)
            outcome = sync_app.pay(
                key, f"thread-{index}", conn=conn, during=others_wait_on_the_lock
            )
        with lock:
            results.append(outcome)

    def others_wait_on_the_lock() -> None:
        # PostgreSQL shows them waiting: proof that they raced this attempt, not followed it.
        if sync_app.database.kind == "postgres":
            deadline = time.monotonic() + 10
            while sync_app.database.lock_waiters() < DUPLICATES - 1:
                assert time.monotonic() < deadline, "the duplicates never waited on the lock"
                time.sleep(0.01)

    threads = [threading.Thread(target=duplicate, args=(i,)) for i in range(DUPLICATES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(results) == DUPLICATES
    executed = [result for replayed, result in results if not replayed]
    assert len(executed) == 1
    assert all(result == executed[0] for _, result in results)
    assert sync_app.executions == 1
    assert sync_app.database.rows() == [(key, executed[0]["by"])]


# -- async: AsyncSession, AsyncConnection, psycopg AsyncConnection -------------------------

ASYNC_CASES = [
    pytest.param(("sqlite", "session"), id="sqlite-asyncsession"),
    pytest.param(("sqlite", "connection"), id="sqlite-asyncconnection"),
    pytest.param(("postgres", "session"), marks=pytest.mark.postgres, id="postgres-asyncsession"),
    pytest.param(
        ("postgres", "connection"), marks=pytest.mark.postgres, id="postgres-asyncconnection"
    ),
    pytest.param(
        ("postgres", "psycopg"), marks=pytest.mark.postgres, id="postgres-psycopg-asyncconnection"
    ),
]


@dataclass
class AsyncApp:
    """The asynchronous twin of `SyncApp`; ``psycopg`` uses psycopg's AsyncConnection."""

    database: Database
    engine: AsyncEngine
    face: str
    idem: AsyncIdempotency
    executions: int = 0

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        if self.face == "psycopg":
            async with await psycopg.AsyncConnection.connect(self.database.location) as conn:
                yield conn
        elif self.face == "session":
            async with AsyncSession(self.engine) as session:
                yield session
        else:
            async with self.engine.connect() as conn:
                yield conn

    async def insert(self, conn: Any, key: str, worker: str) -> None:
        params = {"key": key, "worker": worker}
        if self.face == "psycopg":
            await conn.execute(
                self.database.insert.replace(":key", "%(key)s").replace(":worker", "%(worker)s"),
                params,
            )
        else:
            await conn.execute(text(self.database.insert), params)

    async def pay(
        self,
        key: str,
        worker: str = "w",
        *,
        conn: Any = None,
        during: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[bool, Any]:
        """(replayed, result) of one guarded payment, on ``conn`` or a connection of its own."""
        if conn is None:
            async with self.connection() as own:
                return await self.pay(key, worker, conn=own, during=during)
        async with self.idem.once(key, operation=OPERATION, payload={"amount": 5}, conn=conn) as a:
            if a.replayed:
                return True, a.result
            self.executions += 1
            await self.insert(conn, key, worker)
            if during is not None:
                await during()
            a.result = {"paid": key, "by": worker}
        return False, a.result


@pytest.fixture(params=ASYNC_CASES)
async def async_app(request: pytest.FixtureRequest, anyio_backend: str) -> AsyncIterator[AsyncApp]:
    """An async app on an AsyncSession, an AsyncConnection or psycopg's AsyncConnection."""
    kind, face = request.param
    database: Database = request.getfixturevalue(f"{kind}_database")
    engine = create_async_engine(database.url(asynchronous=True))
    store = database.async_store()
    try:
        yield AsyncApp(database, engine, face, AsyncIdempotency(store, POLICY))
    finally:
        await store.aclose()
        await engine.dispose()


@pytest.mark.anyio
async def test_async_business_write_commits_with_the_record(async_app: AsyncApp) -> None:
    """The business row and the completed record become visible together, when the guarded
    block ends, and not before."""
    key = new_key()
    database = async_app.database

    async def nothing_visible_yet() -> None:
        assert await anyio.to_thread.run_sync(database.rows) == []
        assert await anyio.to_thread.run_sync(database.records_seen) == []

    outcome = await async_app.pay(key, during=nothing_visible_yet)
    assert outcome == (False, {"paid": key, "by": "w"})
    assert database.rows() == [(key, "w")]
    assert database.records_seen() == [(key, "completed", 1)]


@pytest.mark.anyio
async def test_async_exception_rolls_back_write_and_record(async_app: AsyncApp) -> None:
    """A block that raises leaves neither its business row nor a record, and the same
    connection then serves a retry that executes."""
    key = new_key()
    database = async_app.database

    async def fail() -> None:
        raise RuntimeError("the work broke")

    async with async_app.connection() as conn:
        with pytest.raises(RuntimeError, match="the work broke"):
            await async_app.pay(key, conn=conn, during=fail)
        assert database.rows() == []
        assert database.records_seen() == []
        outcome = await async_app.pay(key, "retry", conn=conn)
        assert outcome == (False, {"paid": key, "by": "retry"})
    assert database.rows() == [(key, "retry")]
    assert database.records_seen() == [(key, "completed", 1)]


@pytest.mark.anyio
async def test_async_replay_does_not_run_the_body(async_app: AsyncApp) -> None:
    """A retry of a completed payment replays its result without running the block again."""
    key = new_key()
    first = await async_app.pay(key, "first")
    assert first == (False, {"paid": key, "by": "first"})
    async with async_app.connection() as conn:
        assert await async_app.pay(key, "second", conn=conn) == (True, first[1])
        assert await async_app.pay(key, "third", conn=conn) == (True, first[1])
    assert async_app.executions == 1
    assert async_app.database.rows() == [(key, "first")]


@pytest.mark.anyio
async def test_async_concurrent_duplicates_execute_once(async_app: AsyncApp) -> None:
    """Duplicates released together from several tasks, each on its own connection, execute
    once; the others wait on the lock and replay that result."""
    key = new_key()
    go = anyio.Event()
    ready = 0
    results: list[tuple[bool, Any]] = []

    async def others_wait_on_the_lock() -> None:
        # PostgreSQL shows them waiting: proof that they raced this attempt, not followed it.
        if async_app.database.kind == "postgres":
            for _ in range(1000):  # 10 s at most
                if await anyio.to_thread.run_sync(async_app.database.lock_waiters) >= (
                    DUPLICATES - 1
                ):
                    return
                await anyio.sleep(0.01)
            pytest.fail("the duplicates never waited on the lock")

    async def duplicate(index: int) -> None:
        nonlocal ready
        async with async_app.connection() as conn:
            ready += 1
            if ready == DUPLICATES:
                go.set()
            await go.wait()
            outcome = await async_app.pay(
                key, f"task-{index}", conn=conn, during=others_wait_on_the_lock
            )
            results.append(outcome)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as group:
            for index in range(DUPLICATES):
                group.start_soon(duplicate, index)
    assert len(results) == DUPLICATES
    executed = [result for replayed, result in results if not replayed]
    assert len(executed) == 1
    assert all(result == executed[0] for _, result in results)
    assert async_app.executions == 1
    assert async_app.database.rows() == [(key, executed[0]["by"])]
