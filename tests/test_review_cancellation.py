"""Internal review: cancellation of guarded calls on the app's own async connection,
against the real PostgreSQL server, through the public API only.

Each defect the review found was first a test marked ``xfail(strict=True)``; the mark came
off with its fix (docs/testing.md). The other tests are checks that held.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta

import anyio
import psycopg
import pytest
from psycopg.pq import TransactionStatus

from helpers import Database, new_key
from idempo import AsyncIdempotency, Idempotency, Policy, Scope
from idempo.stores.memory import AsyncMemoryStore

OPERATION = "review.cancel"
WAIT_TIMEOUT = 20.0

pytestmark = [pytest.mark.postgres, pytest.mark.anyio]


@asynccontextmanager
async def held_key(db: Database, key: str, hold_for: float) -> AsyncIterator[None]:
    """Another attempt holds ``key`` in transactional mode, on a connection of its own, for
    ``hold_for`` seconds at most (or until the block ends)."""
    store = db.store()
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with (
            psycopg.connect(db.location) as conn,
            Idempotency(store).once(key, operation=OPERATION, conn=conn) as attempt,
        ):
            holding.set()
            done.wait(hold_for)
            attempt.result = "held"

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert await asyncio.to_thread(holding.wait, WAIT_TIMEOUT)
        yield
    finally:
        done.set()
        await asyncio.to_thread(thread.join, WAIT_TIMEOUT)
        store.close()


async def test_cancelled_waiter_leaves_the_app_connection_usable(
    postgres_database: Database,
) -> None:
    """A duplicate waiting on the holder's row lock (Policy.lock_timeout 20 s) is cancelled
    by ``asyncio.timeout``. The guard bounds its cleanup (5 s) and the cancellation reaches
    the caller (that held); the app's connection must then be free of idempo's statements.
    Today it is ACTIVE, and using it raises AttributeError ("'NoneType' object has no
    attribute '_fetch_gen'"), "another command is already in progress" or, after the
    holder is done, "connection not in pipeline mode", depending on timing."""
    db = postgres_database
    store = db.async_store()
    idem = AsyncIdempotency(store, Policy(lock_timeout=timedelta(seconds=20)))
    key = new_key()
    conn = await psycopg.AsyncConnection.connect(db.location)
    try:
        async with held_key(db, key, hold_for=8.0):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.5), idem.once(key, operation=OPERATION, conn=conn):
                    raise AssertionError("the work ran")
            assert time.monotonic() - started < 7.0
            status = conn.info.transaction_status
            # The guard's statement was cancelled on the server and its transaction rolled
            # back: the connection is idle and works, while the holder still holds the key.
            assert status is TransactionStatus.IDLE, status
            assert await (await conn.execute("SELECT 1")).fetchall() == [(1,)]
        assert status is not TransactionStatus.ACTIVE, "idempo's statement still runs on it"
        async with idem.once(key, operation=OPERATION, conn=conn) as attempt:
            assert attempt.replayed  # the holder's result, on the same connection
    finally:
        await conn.close()
        await store.aclose()


@pytest.mark.parametrize("how", ["asyncio-timeout", "anyio-move-on", "task-cancel"])
async def test_cancelled_work_on_the_app_connection_releases_the_key(
    postgres_database: Database, how: str
) -> None:
    """A check that held: work cancelled while its own statement runs on the app's async
    connection (transactional mode) leaves no record and no business row, the connection
    usable, and a retry on it runs the work once."""
    db = postgres_database
    db.create_business_table("idem_key VARCHAR(255), note VARCHAR(255)")
    store = db.async_store()
    idem = AsyncIdempotency(store)
    key = new_key()
    insert = f"INSERT INTO {db.business_table} (idem_key, note) VALUES (%s, %s)"
    conn = await psycopg.AsyncConnection.connect(db.location)

    async def work(note: str, conn: psycopg.AsyncConnection[object]) -> None:
        async with idem.once(key, operation=OPERATION, conn=conn) as attempt:
            if not attempt.replayed:
                await conn.execute(insert, (key, note))
                if note == "first":
                    await conn.execute("SELECT pg_sleep(3)")
                attempt.result = note

    try:
        if how == "asyncio-timeout":
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.3):
                    await work("first", conn)
        elif how == "anyio-move-on":
            with anyio.move_on_after(0.3):
                await work("first", conn)
        else:
            task = asyncio.create_task(work("first", conn))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert await store.get(Scope.of(key, operation=OPERATION)) is None
        assert db.select(f"SELECT note FROM {db.business_table}") == []
        # anyio's scope also interrupts psycopg's own query cancel, which then closes the
        # app's connection: the retry takes a fresh one.
        async with await psycopg.AsyncConnection.connect(db.location) as fresh:
            await work("retry", fresh)
        assert db.select(f"SELECT note FROM {db.business_table}") == [("retry",)]
    finally:
        await conn.close()
        await store.aclose()


class StubbornRelease(AsyncMemoryStore):
    """A store whose release never answers; cancelled, it takes a moment to wind down
    (``patience`` cancellations are ignored first), and says what it saw."""

    def __init__(self, patience: int) -> None:
        super().__init__()
        self.patience = patience
        self.seen: list[str] = []

    async def release(self, scope: Scope, token: int) -> None:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.seen.append("cancelled")
                if len(self.seen) > self.patience:
                    await asyncio.sleep(0.05)  # a driver cancelling its statement
                    self.seen.append("wound down")
                    raise


@pytest.mark.parametrize(("patience", "expected"), [(0, 1), (1, 2)])
async def test_a_given_up_operation_is_let_wind_down(
    monkeypatch: pytest.MonkeyPatch, patience: int, expected: int
) -> None:
    """The fix's own check (no server): past the cleanup bound the guard cancels the hung
    operation and waits (bounded) for it to end, so a driver can leave the app's connection
    usable; an operation that ignores that cancellation is cancelled once more, which a
    driver answers by dropping a connection it cannot vouch for."""
    from idempo._core import flow

    monkeypatch.setattr(flow, "CLEANUP_TIMEOUT", 0.1)
    monkeypatch.setattr(flow, "WIND_DOWN_TIMEOUTS", (0.3, 0.3))
    store = StubbornRelease(patience)
    idem = AsyncIdempotency(store)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05), idem.once(new_key(), operation=OPERATION):
            await asyncio.Event().wait()
    elapsed = time.monotonic() - started
    # Ended before the caller got its cancellation, and within the bounds.
    assert store.seen == ["cancelled"] * expected + ["wound down"], store.seen
    assert elapsed < 0.05 + 0.1 + 0.3 * expected + 0.2, elapsed
