"""Transactional mode through SQLAlchemy 2 (Session, Connection, and their async twins) and
through psycopg's AsyncConnection, on PostgreSQL and on SQLite.

The business table has no unique constraint on the key, so a second execution would show as a
second row. What is committed is always read through a separate, plain driver connection.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

import anyio
import psycopg
import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from helpers import Database, new_key
from idempo import AsyncIdempotency, Idempotency, Policy

OPERATION = "pay"
DUPLICATES = 4
# Duplicates wait on the first attempt's lock; long enough that none is turned away.
POLICY = Policy(lock_timeout=timedelta(seconds=20))


class AppDatabase(Database):
    """A database whose business table holds payments, reached through SQLAlchemy by the app
    and through a plain driver connection by the test."""

    @property
    def insert(self) -> str:
        return f"INSERT INTO {self.business_table} (idem_key, worker) VALUES (:key, :worker)"

    def url(self, *, asynchronous: bool) -> str:
        if self.kind == "sqlite":
            return (
                f"sqlite+aiosqlite:///{self.location}"
                if asynchronous
                else f"sqlite:///{self.location}"
            )
        if self.kind == "mysql":
            driver = "aiomysql" if asynchronous else "pymysql"
            return self.location.replace("mysql://", f"mysql+{driver}://", 1)
        return self.location.replace("postgresql://", "postgresql+psycopg://", 1)

    def rows(self) -> list[tuple[Any, ...]]:
        """The business rows as (key, worker)."""
        return self.select(f"SELECT idem_key, worker FROM {self.business_table} ORDER BY worker")

    def records_seen(self) -> list[tuple[Any, ...]]:
        """The records as (key, state, token)."""
        return self.select(f"SELECT idem_key, state, token FROM {self.records_table}")

    def wait_for_lock_waiters(self, count: int) -> None:
        """PostgreSQL: wait (10 s at most) until ``count`` backends wait on a lock in a statement
        on our records table."""
        deadline = time.monotonic() + 10
        while self._lock_waiters() < count:
            assert time.monotonic() < deadline, "the duplicates never waited on the lock"
            time.sleep(0.01)

    def _lock_waiters(self) -> int:
        found = self.select(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            f" AND query LIKE '%{self.records_table}%'"
        )
        return int(found[0][0])


def app_database(request: pytest.FixtureRequest) -> tuple[AppDatabase, str]:
    """The case's database, with an empty payments table, and the face the app reaches it by."""
    kind, face = request.param
    database = AppDatabase(**asdict(request.getfixturevalue(f"{kind}_database")))
    database.create_business_table("idem_key TEXT NOT NULL, worker TEXT NOT NULL")
    return database, face


def check_executed_once(app: SyncApp | AsyncApp, key: str, results: list[tuple[bool, Any]]) -> None:
    """Every duplicate got the one execution's result, and only it left a business row."""
    assert len(results) == DUPLICATES
    executed = [result for replayed, result in results if not replayed]
    assert len(executed) == 1
    assert all(result == executed[0] for _, result in results)
    assert app.executions == 1
    assert app.database.rows() == [(key, executed[0]["by"])]


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

    database: AppDatabase
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
    database, face = app_database(request)
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
    assert [(k, state) for k, state, _ in database.records_seen()] == [(key, "completed")]


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
    assert [(k, state) for k, state, _ in database.records_seen()] == [(key, "completed")]


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
            sync_app.database.wait_for_lock_waiters(DUPLICATES - 1)

    threads = [threading.Thread(target=duplicate, args=(i,)) for i in range(DUPLICATES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    check_executed_once(sync_app, key, results)


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

    database: AppDatabase
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
    database, face = app_database(request)
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
    assert [(k, state) for k, state, _ in database.records_seen()] == [(key, "completed")]


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
    assert [(k, state) for k, state, _ in database.records_seen()] == [(key, "completed")]


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
            await anyio.to_thread.run_sync(async_app.database.wait_for_lock_waiters, DUPLICATES - 1)

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
    check_executed_once(async_app, key, results)
