"""AsyncSQLiteStore runs the guard's operations at once, on the caller's thread, when the file
is free, and in a worker thread that waits for it when it is not: the same records either
way, and an event loop never stalls behind another writer."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from idempo import Scope
from idempo._core.record import Acquired, Replay
from idempo.stores._sql.transaction import NOT_NOW
from idempo.stores.sqlite import AsyncSQLiteStore

LEASE, TTL = timedelta(seconds=30), timedelta(hours=1)
STEP = 10.0  # the most a step of these tests waits


def _reserve(store: AsyncSQLiteStore, scope: Scope) -> Any:
    return store.reserve(scope, "fp", now=datetime.now(UTC), lease=LEASE, ttl=TTL)


def _at_once(awaitable: Any) -> Any:
    """The result of an awaitable that must not suspend (no thread, no task)."""
    with pytest.raises(StopIteration) as done:
        awaitable.send(None)
    return done.value.value


def test_a_free_file_is_written_without_suspending(tmp_path: Path) -> None:
    store = AsyncSQLiteStore(str(tmp_path / "idempo.db"))
    asyncio.run(store.migrate())
    try:
        scope = Scope.of("k-1", operation="pay")
        acquired = _at_once(_reserve(store, scope))
        assert isinstance(acquired, Acquired)
        now = datetime.now(UTC)
        _at_once(store.complete(scope, acquired.token, b"done", now=now, ttl=TTL))
        assert isinstance(_at_once(_reserve(store, scope)), Replay)
        # The sync store sees what was written at once: one file, one record.
        record = store._sync.get(scope)
        assert record is not None
        assert record.response == b"done"
    finally:
        asyncio.run(store.aclose())


def test_a_locked_file_is_waited_for_in_a_thread_while_the_loop_runs(tmp_path: Path) -> None:
    """Another connection holds the write lock: the reservation is not refused and does not
    stall the loop; it waits in a worker thread and lands once the lock is gone."""
    store = AsyncSQLiteStore(str(tmp_path / "idempo.db"))

    async def scenario() -> Any:
        await store.migrate()
        blocker = store._sync.connect()
        blocker.execute("BEGIN IMMEDIATE")
        try:
            assert store._sync.run_now(iter(())) is NOT_NOW  # never started on a locked file
            reserving = asyncio.ensure_future(_reserve(store, Scope.of("k-2", operation="pay")))
            ticks = 0
            while not _held(store._sync._writer):  # the worker thread waits for the file
                ticks += 1
                await asyncio.sleep(0.001)
                assert ticks < STEP * 1000, "the reservation never reached its thread"
            assert not reserving.done()
        finally:
            blocker.rollback()
            blocker.close()
        return await asyncio.wait_for(reserving, STEP)

    try:
        assert isinstance(asyncio.run(scenario()), Acquired)
    finally:
        asyncio.run(store.aclose())


def _held(lock: Any) -> bool:
    """Whether another thread holds ``lock`` now."""
    if lock.acquire(blocking=False):
        lock.release()
        return False
    return True


def test_writers_in_threads_and_at_once_share_one_file(tmp_path: Path) -> None:
    """Loops in several threads reserve distinct keys concurrently, at once or in a worker
    thread whenever another holds the lock: every reservation is taken."""
    store = AsyncSQLiteStore(str(tmp_path / "idempo.db"))
    asyncio.run(store.migrate())
    tokens: list[int] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        async def reserve_all() -> None:
            for i in range(20):
                got = await _reserve(store, Scope.of(f"k-{n}-{i}", operation="pay"))
                assert isinstance(got, Acquired)
                with lock:
                    tokens.append(got.token)

        asyncio.run(reserve_all())

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(STEP)
    try:
        assert len(tokens) == 80
    finally:
        asyncio.run(store.aclose())
