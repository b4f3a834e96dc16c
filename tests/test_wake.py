"""A duplicate told to wait (``Policy.wait``) is woken when the first attempt ends, on a store
that can say so (``wait_settled``: the memory store, Redis by pub/sub, PostgreSQL by
LISTEN/NOTIFY), instead of polling every 50 ms.

Shown by counting reservations: a waiter that was woken asks the store twice (once to find
the key in progress, once to replay), however long the first attempt ran; one that polls
asks about every 50 ms. Also: a holder that dies (its lease runs out) is taken over; a
waiter cancelled, or given up, leaves nothing behind in the store.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest

from idempo import AsyncIdempotency, Idempotency, Policy, RequestInProgressError
from idempo._core.ops import Reserve
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.redis import AsyncRedisStore, RedisStore

DEADLINE = 20.0  # seconds any wait for another thread may take before the test fails
HOLD = 0.4  # seconds the first attempt runs: eight polls' worth


class Counting:
    """Counts a store's reservations."""

    reservations = 0

    def reserve(self, *args: Any, **kwargs: Any) -> Any:
        self.reservations += 1
        return super().reserve(*args, **kwargs)  # type: ignore[misc]


class CountingStore(Counting, MemoryStore):
    """A memory store that counts reservations."""


class CountingRedisStore(Counting, RedisStore):
    """A Redis store that counts reservations."""


class CountingOps:
    """Counts the reservations of a store that takes operations as values (the flow calls
    its ``perform``, sync or async, not its verbs)."""

    reservations = 0

    def perform(self, op: Any) -> Any:
        if isinstance(op, Reserve):
            self.reservations += 1
        return super().perform(op)  # type: ignore[misc]


class CountingPostgresStore(CountingOps, PostgresStore):
    """A PostgreSQL store that counts reservations."""


class AsyncCounting:
    """Counts an async store's reservations."""

    reservations = 0

    async def reserve(self, *args: Any, **kwargs: Any) -> Any:
        self.reservations += 1
        return await super().reserve(*args, **kwargs)  # type: ignore[misc]


class CountingAsyncRedisStore(AsyncCounting, AsyncRedisStore):
    """An async Redis store that counts reservations."""


class CountingAsyncPostgresStore(CountingOps, AsyncPostgresStore):
    """An async PostgreSQL store that counts reservations."""


@pytest.fixture(
    params=[
        "memory",
        "redis",
        "redis-cluster",
        pytest.param("postgres", marks=pytest.mark.postgres),
    ]
)
def counted(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A store that counts its reservations: the memory store, Redis (a server or the
    private cluster, a prefix of the test's own), or PostgreSQL (a schema of the test's own)."""
    if request.param == "memory":
        yield CountingStore()
        return
    if request.param == "postgres":
        yield from migrated(CountingPostgresStore, request)
        return
    where = "redis_cluster" if request.param == "redis-cluster" else "redis"
    url = request.getfixturevalue(f"{where}_url")
    prefix = request.getfixturevalue(f"{where}_prefix")
    store = CountingRedisStore(url, prefix=prefix)
    try:
        yield store
    finally:
        store.close()


def migrated(kind: type[PostgresStore], request: pytest.FixtureRequest, **options: Any) -> Any:
    """A migrated PostgreSQL store of ``kind`` on the test's schema, closed afterwards."""
    url, schema = request.getfixturevalue("postgres_url"), request.getfixturevalue("pg_schema")
    store = kind(url, table=f"{schema}.idempo_records", **options)
    store.migrate()
    try:
        yield store
    finally:
        store.close()


class Polling:
    """The same store, seen without ``wait_settled``: the waiter polls."""

    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    def __getattr__(self, name: str) -> Any:
        if name == "wait_settled":
            raise AttributeError(name)
        return getattr(self._store, name)


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def first_and_waiter(store: Any, counted: Counting, *, settle: str) -> tuple[Any, int]:
    """A first attempt holds the key for `HOLD` s (then completes, fails or releases) while
    a duplicate waits; returns what the duplicate got and the reservations it made."""
    idem = Idempotency(store, Policy(wait=timedelta(seconds=DEADLINE), fail_on=(LookupError,)))
    entered, go = threading.Event(), threading.Event()

    def first() -> None:
        try:
            with idem.once("k-1", operation="charge") as attempt:
                entered.set()
                go.wait(DEADLINE)
                time.sleep(HOLD)
                if settle == "fail":
                    raise LookupError("declined")
                if settle == "release":
                    raise ConnectionError("the card network timed out")
                attempt.result = "charged"
        except (LookupError, ConnectionError):
            pass

    def duplicate() -> Any:
        entered.wait(DEADLINE)
        before = counted.reservations
        go.set()
        try:
            with idem.once("k-1", operation="charge") as attempt:
                if not attempt.replayed:
                    attempt.result = "ran again"
                return attempt.result, counted.reservations - before
        except Exception as exc:  # the test looks at what came out
            return type(exc).__name__, counted.reservations - before

    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(first)
        got, reservations = pool.submit(duplicate).result(DEADLINE)
        running.result(DEADLINE)
    return got, reservations


@pytest.mark.parametrize("settle", ["complete", "fail", "release"])
def test_a_waiting_duplicate_is_woken_when_the_first_attempt_ends(
    counted: Any, settle: str
) -> None:
    got, reservations = first_and_waiter(counted, counted, settle=settle)
    expected = {"complete": "charged", "fail": "ReplayedFailureError", "release": "ran again"}
    assert got == expected[settle]
    assert reservations == 2  # in progress, then the outcome: no polls in between
    assert getattr(counted, "_waiting", {}) == {}


def test_a_store_that_cannot_wake_is_polled(counted: Any) -> None:
    """The control: the same run through a store without ``wait_settled`` polls."""
    store = counted
    got, reservations = first_and_waiter(Polling(store), store, settle="complete")
    assert got == "charged"
    assert reservations > 4  # HOLD is eight 50 ms polls; a loaded machine makes fewer


def test_a_holder_that_died_is_taken_over_when_its_lease_ends() -> None:
    """No one settles: the waiter's wait ends with the lease, and it takes the key over."""
    store = CountingStore()
    lease = timedelta(seconds=0.3)
    idem = Idempotency(store, Policy(wait=timedelta(seconds=DEADLINE), lease=lease))
    stale = idem.once("k-1", operation="charge")
    stale.__enter__()  # the holder that dies: it never exits
    before = store.reservations
    with idem.once("k-1", operation="charge") as attempt:
        assert not attempt.replayed
        attempt.result = "taken over"
    assert store.reservations - before <= 3  # in progress (perhaps twice), then taken over
    with idem.once("k-1", operation="charge") as replay:
        assert replay.result == "taken over"


def test_a_waiter_that_gives_up_leaves_no_watch_behind() -> None:
    store = MemoryStore()
    idem = Idempotency(store, Policy(wait=timedelta(seconds=0.2), lease=timedelta(seconds=30)))
    with idem.once("k-1", operation="charge") as first:
        with pytest.raises(RequestInProgressError), idem.once("k-1", operation="charge"):
            pass
        assert store._waiting == {}
        first.result = "charged"


def test_wait_settled_returns_at_once_for_a_record_not_in_progress() -> None:
    store = MemoryStore()
    idem = Idempotency(store)
    with idem.once("k-1", operation="charge") as attempt:
        attempt.result = "charged"
    scope = next(iter(store._entries))
    started = time.monotonic()
    store.wait_settled(scope, seconds=DEADLINE)  # completed: nothing to wait for
    store.wait_settled(dataclasses.replace(scope, key="never-used"), seconds=DEADLINE)  # no record
    assert time.monotonic() - started < DEADLINE
    assert store._waiting == {}


async def async_waiter_is_woken(sync_store: Any, async_store: Any, counted: Any) -> None:
    """A thread's sync guard on ``sync_store`` holds a key, then completes it; an async
    duplicate on ``async_store`` waits, and replays after two reservations (``counted``'s)."""
    sync = Idempotency(sync_store)
    waiter = AsyncIdempotency(async_store, Policy(wait=timedelta(seconds=DEADLINE)))
    entered, go = threading.Event(), threading.Event()

    def first() -> None:
        with sync.once("k-1", operation="charge") as attempt:
            entered.set()
            go.wait(DEADLINE)
            time.sleep(HOLD)
            attempt.result = "charged"

    thread = threading.Thread(target=first)
    thread.start()
    try:
        await asyncio.to_thread(entered.wait, DEADLINE)
        before = counted.reservations
        go.set()
        async with waiter.once("k-1", operation="charge") as attempt:
            assert attempt.replayed
            assert attempt.result == "charged"
        assert counted.reservations - before == 2  # in progress, then the replay: no polls
    finally:
        go.set()
        thread.join(DEADLINE)


@pytest.mark.anyio
async def test_an_async_waiter_is_woken_by_a_sync_guard_in_another_thread() -> None:
    """One memory store, two faces: a thread's sync guard settles, the loop's waiter wakes."""
    counted = CountingStore()
    await async_waiter_is_woken(counted, AsyncMemoryStore(counted), counted)
    assert counted._waiting == {}


@pytest.mark.anyio
async def test_an_async_redis_waiter_is_woken_by_a_settle_from_another_store(
    redis_url: str, redis_prefix: str
) -> None:
    """Two stores on one Redis (two processes, as far as Redis can tell): the first settles
    on its own connection, and the waiter, subscribed on another, replays at once."""
    settling = RedisStore(redis_url, prefix=redis_prefix)
    waiting = CountingAsyncRedisStore(redis_url, prefix=redis_prefix)
    try:
        await async_waiter_is_woken(settling, waiting, waiting)
    finally:
        settling.close()
        await waiting.aclose()


@pytest.mark.anyio
async def test_a_cancelled_async_waiter_leaves_no_watch_behind() -> None:
    store = AsyncMemoryStore()
    idem = AsyncIdempotency(store, Policy(wait=timedelta(seconds=DEADLINE)))
    async with idem.once("k-1", operation="charge") as first:

        async def duplicate() -> None:
            async with idem.once("k-1", operation="charge"):
                pass

        task = asyncio.ensure_future(duplicate())
        await asyncio.to_thread(until, lambda: bool(store.sync._waiting), "the duplicate waits")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert store.sync._waiting == {}
        first.result = "charged"
    async with idem.once("k-1", operation="charge") as replay:
        assert replay.result == "charged"
