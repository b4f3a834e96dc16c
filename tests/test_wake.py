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
import functools
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Any, TypeVar

import psycopg
import pytest

from idempo import AsyncIdempotency, Idempotency, Policy, RequestInProgressError
from idempo._core.keys import Scope
from idempo._core.ops import Reserve, Settle
from idempo._core.record import Acquired, Status
from idempo.stores._sql.dialect import pyformat
from idempo.stores._sql.postgres import WAKE_CLASS
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.redis import AsyncRedisStore, RedisStore

T = TypeVar("T", bound=PostgresStore)

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
        with migrated(CountingPostgresStore, request) as store:
            yield store
        return
    where = "redis_cluster" if request.param == "redis-cluster" else "redis"
    url = request.getfixturevalue(f"{where}_url")
    prefix = request.getfixturevalue(f"{where}_prefix")
    store = CountingRedisStore(url, prefix=prefix)
    try:
        yield store
    finally:
        store.close()


@contextmanager
def migrated(kind: type[T], request: pytest.FixtureRequest, **options: Any) -> Iterator[T]:
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


def first_and_waiter(
    store: Any,
    counted: Any,
    *,
    settle: str,
    first_conn: Any = None,
    duplicate_conn: Any = None,
    lock_timeout: timedelta = timedelta(seconds=5),
) -> tuple[Any, int]:
    """A first attempt holds the key for `HOLD` s (then completes, fails or releases) while
    a duplicate waits; returns what the duplicate got and the reservations it made. Each
    runs on the store's own connections, or on the app's connection given (``conn=``)."""
    policy = Policy(
        wait=timedelta(seconds=DEADLINE), fail_on=(LookupError,), lock_timeout=lock_timeout
    )
    idem = Idempotency(store, policy)
    entered, go = threading.Event(), threading.Event()

    def first() -> None:
        try:
            with idem.once("k-1", operation="charge", conn=first_conn) as attempt:
                entered.set()
                go.wait(DEADLINE)
                time.sleep(HOLD)
                if settle == "fail":
                    raise LookupError("declined")
                if settle == "end-lease":  # a step committed: the lease ends instead
                    attempt.checkpoint("authorized")
                if settle in ("release", "end-lease"):
                    raise ConnectionError("the card network timed out")
                attempt.result = "charged"
        except (LookupError, ConnectionError):
            pass

    def duplicate() -> Any:
        entered.wait(DEADLINE)
        before = counted.reservations
        go.set()
        try:
            with idem.once("k-1", operation="charge", conn=duplicate_conn) as attempt:
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


@pytest.mark.parametrize("settle", ["complete", "fail", "release", "end-lease"])
def test_a_waiting_duplicate_is_woken_when_the_first_attempt_ends(
    counted: Any, settle: str
) -> None:
    got, reservations = first_and_waiter(counted, counted, settle=settle)
    expected = {"complete": "charged", "fail": "ReplayedFailureError", "release": "ran again"}
    expected["end-lease"] = "ran again"  # taken over at once, resuming after the step
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


def hold_then_complete(idem: Idempotency, entered: threading.Event, go: threading.Event) -> None:
    """A first attempt on a thread: it holds "k-1", says so on ``entered``, waits for ``go``
    and a little more, then completes."""
    with idem.once("k-1", operation="charge") as attempt:
        entered.set()
        go.wait(DEADLINE)
        time.sleep(HOLD)
        attempt.result = "charged"


async def async_waiter_is_woken(sync_store: Any, async_store: Any, counted: Any) -> None:
    """A thread's sync guard on ``sync_store`` holds a key, then completes it; an async
    duplicate on ``async_store`` waits, and replays after two reservations (``counted``'s)."""
    sync = Idempotency(sync_store)
    waiter = AsyncIdempotency(async_store, Policy(wait=timedelta(seconds=DEADLINE)))
    entered, go = threading.Event(), threading.Event()

    first = functools.partial(hold_then_complete, sync, entered, go)

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


# -- PostgreSQL: the mark, the race between a settle and a waiter's arrival -------------------


@pytest.fixture
def pg(request: pytest.FixtureRequest) -> Iterator[PostgresStore]:
    with migrated(PostgresStore, request) as store:
        yield store


def held(store: PostgresStore, key: str) -> tuple[Scope, int]:
    """A record of ``key`` in progress (a minute's lease), reserved on ``store``; its scope
    and token."""
    scope = Scope("", "charge", key)
    reservation = store.reserve(
        scope, "fp", now=None, lease=timedelta(minutes=1), ttl=timedelta(hours=1)
    )
    assert isinstance(reservation, Acquired)
    return scope, reservation.token


def settle_statement(store: PostgresStore, scope: Scope, token: int) -> tuple[str, Any]:
    """The store's own settle statement for ``scope``, as psycopg takes it."""
    op = Settle(scope, token, Status.COMPLETED, b"done", None, timedelta(hours=1))
    statement = next(store.dialect.settle(op))
    return pyformat(statement.sql), statement.params


def marks(url: str, store: PostgresStore, scope: Scope, *, granted: bool) -> int:
    """How many sessions hold (or, not ``granted``, wait for) the mark of ``scope``."""
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s"
            " AND objid = %s AND objsubid = 2 AND granted = %s",
            (WAKE_CLASS, store.dialect.wake_key(scope), granted),
        ).fetchone()
    assert row is not None
    return int(row[0])


def meet(
    pool: ThreadPoolExecutor,
    rng: random.Random,
    settle: Callable[[], object],
    wait: Callable[[], object],
) -> None:
    """A settle and a waiter on two threads, released together, each after a random moment
    of up to 2 ms, so that over many rounds they meet in every order: both must end within
    the test's deadline (a missed wake-up runs into the wait, which is longer)."""
    go = threading.Barrier(2)

    def after_a_moment(act: Callable[[], object]) -> None:
        go.wait(DEADLINE)
        time.sleep(rng.random() * 0.002)
        act()

    settled, waited = pool.submit(after_a_moment, settle), pool.submit(after_a_moment, wait)
    settled.result(DEADLINE)
    waited.result(DEADLINE)


@pytest.mark.postgres
@pytest.mark.parametrize("pause", ["none", "before-commit"])
def test_a_settle_racing_a_waiters_arrival_never_leaves_it_waiting(
    postgres_url: str, pg: PostgresStore, pause: str
) -> None:
    """Many rounds: a settle on a connection of its own (its transaction open for a moment
    before the commit, or not) and a waiter on another store arrive in a random order; the
    waiter always returns, settled, long before its wait (a lost wake-up would run into it)."""
    waiter = PostgresStore(postgres_url, table=pg.dialect.table)
    rng = random.Random(15)
    try:
        with psycopg.connect(postgres_url) as settling, ThreadPoolExecutor(2) as pool:
            for n in range(150):
                scope, token = held(pg, f"race-{n}")
                sql, params = settle_statement(pg, scope, token)

                def settle(sql: str = sql, params: Any = params) -> None:
                    with settling.transaction():
                        settling.execute(sql, params)
                        if pause == "before-commit":
                            time.sleep(rng.random() * 0.002)

                meet(pool, rng, settle, functools.partial(waiter.wait_settled, scope, 2 * DEADLINE))
                record = pg.get(scope)
                assert record is not None
                assert record.status is Status.COMPLETED
    finally:
        waiter.close()


@pytest.mark.postgres
def test_a_waiter_arriving_between_a_settle_and_its_commit_waits_for_the_commit(
    postgres_url: str, pg: PostgresStore
) -> None:
    """The settle took the mark (nobody waited), so it sends nothing: the waiter that comes
    before its commit waits on the mark, then reads the settled record."""
    scope, token = held(pg, "k-1")
    sql, params = settle_statement(pg, scope, token)
    with psycopg.connect(postgres_url) as settling, ThreadPoolExecutor(1) as pool:
        with settling.transaction():
            settling.execute(sql, params)
            waited = pool.submit(pg.wait_settled, scope, 10 * DEADLINE)
            until(lambda: marks(postgres_url, pg, scope, granted=False) == 1, "it waits")
            assert not waited.done()
        waited.result(DEADLINE)
    assert marks(postgres_url, pg, scope, granted=True) == 0


@pytest.mark.postgres
@pytest.mark.parametrize("watched", [True, False])
def test_a_settle_notifies_only_when_someone_holds_the_mark(
    postgres_url: str, pg: PostgresStore, watched: bool
) -> None:
    """A listener sees the settle's notification when it holds the mark, none when it does
    not: the marker sent after the settle comes first then (notifications arrive in commit
    order)."""
    scope, token = held(pg, "k-1")
    key = pg.dialect.wake_key(scope)
    with (
        psycopg.connect(postgres_url, autocommit=True) as listener,
        psycopg.connect(postgres_url, autocommit=True) as other,
    ):
        listener.execute(f"LISTEN idempo_wake_{key}")
        if watched:
            listener.execute("SELECT pg_advisory_lock_shared(%s, %s)", (WAKE_CLASS, key))
        pg.complete(scope, token, b"done", now=None, ttl=timedelta(hours=1))
        other.execute(f"NOTIFY idempo_wake_{key}, 'marker'")
        got = []
        for notify in listener.notifies(timeout=DEADLINE):
            got.append(notify.payload)
            if notify.payload == "marker":
                break
    assert got == (["", "marker"] if watched else ["marker"])


def pooled_sessions_are_clean(store: PostgresStore) -> None:
    """Every connection the store's pool has: no LISTEN, no advisory lock left (the ones
    the store keeps between calls go back to the pool first)."""
    assert store._kept is not None
    for kept in store._kept.drain():
        store._pool.putconn(kept)
    conns = [store._pool.getconn(timeout=DEADLINE) for _ in range(store._pool.max_size)]
    try:
        for conn in conns:
            assert conn.execute("SELECT pg_listening_channels()").fetchall() == []
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid()"
                " AND locktype = 'advisory'"
            ).fetchone()
            assert row == (0,)
    finally:
        for conn in conns:
            store._pool.putconn(conn)


@pytest.mark.postgres
def test_the_waiters_connection_goes_back_to_the_pool_clean(
    postgres_url: str, pg: PostgresStore
) -> None:
    waiter = PostgresStore(postgres_url, table=pg.dialect.table, max_size=2)  # one seat
    try:
        scope, token = held(pg, "k-1")
        waiter.wait_settled(scope, seconds=0.2)  # nobody settles: the wait ends
        with ThreadPoolExecutor(1) as pool:
            waited = pool.submit(waiter.wait_settled, scope, 10 * DEADLINE)
            until(lambda: marks(postgres_url, pg, scope, granted=True) == 1, "it waits")
            pg.complete(scope, token, b"done", now=None, ttl=timedelta(hours=1))
            waited.result(DEADLINE)  # woken
        assert marks(postgres_url, pg, scope, granted=True) == 0
        pooled_sessions_are_clean(waiter)
    finally:
        waiter.close()


@pytest.mark.postgres
def test_a_waiter_beyond_half_the_pool_polls(request: pytest.FixtureRequest) -> None:
    """A pool of one leaves no seat for a waiter: it polls, and the attempt it waits for
    keeps the connection it needs to settle."""
    with migrated(CountingPostgresStore, request, max_size=1) as store:
        got, reservations = first_and_waiter(store, store, settle="complete")
    assert got == "charged"
    assert reservations > 4


@pytest.mark.postgres
@pytest.mark.anyio
async def test_an_async_postgres_waiter_is_woken_by_a_settle_from_another_store(
    postgres_url: str, pg: PostgresStore
) -> None:
    waiting = CountingAsyncPostgresStore(postgres_url, table=pg.dialect.table)
    try:
        await async_waiter_is_woken(pg, waiting, waiting)
    finally:
        await waiting.aclose()


@pytest.mark.postgres
@pytest.mark.anyio
async def test_a_cancelled_async_postgres_waiter_leaves_nothing_behind(
    postgres_url: str, pg: PostgresStore
) -> None:
    store = AsyncPostgresStore(postgres_url, table=pg.dialect.table)
    idem = AsyncIdempotency(store, Policy(wait=timedelta(seconds=10 * DEADLINE)))
    scope = Scope("", "charge", "k-1")
    try:
        async with idem.once("k-1", operation="charge") as first:

            async def duplicate() -> None:
                async with idem.once("k-1", operation="charge"):
                    pass

            task = asyncio.ensure_future(duplicate())
            holds = functools.partial(marks, postgres_url, pg, scope, granted=True)
            await asyncio.to_thread(until, lambda: holds() == 1, "the duplicate waits")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Its connection was closed: the server ends the session, and its lock, soon.
            await asyncio.to_thread(until, lambda: holds() == 0, "the mark is let go")
            first.result = "charged"
        async with idem.once("k-1", operation="charge") as replay:
            assert replay.result == "charged"
    finally:
        await store.aclose()


# -- PostgreSQL: a duplicate on the app's connection (conn=, transactional mode) -------------


class CountingBoundPostgresStore(PostgresStore):
    """A PostgreSQL store that counts the reservations of the units it binds to the app's
    connections (a guarded call with ``conn=``)."""

    reservations = 0

    def bind(self, conn: Any, **options: Any) -> Any:
        unit = super().bind(conn, **options)
        perform = unit.perform

        def counted(op: Any) -> Any:
            if isinstance(op, Reserve):
                self.reservations += 1
            return perform(op)

        unit.perform = counted  # type: ignore[method-assign]
        return unit


class PollingBoundPostgresStore(CountingBoundPostgresStore):
    """The control: without ``wait_settled``, a duplicate on the app's connection polls."""

    wait_settled = None  # type: ignore[assignment]


@pytest.fixture
def bound(request: pytest.FixtureRequest) -> Iterator[CountingBoundPostgresStore]:
    with migrated(CountingBoundPostgresStore, request) as store:
        yield store


@pytest.mark.postgres
@pytest.mark.parametrize("settle", ["complete", "fail", "release", "end-lease"])
def test_a_duplicate_on_the_apps_connection_is_woken_when_a_leased_first_ends(
    postgres_url: str, bound: CountingBoundPostgresStore, settle: str
) -> None:
    """The first attempt's record is committed in progress (leased mode, the store's own
    connection); the duplicate waits in transactional mode on a connection of the app's,
    and is woken on one of the store's: two reservations, however long the first ran."""
    with psycopg.connect(postgres_url) as app:
        got, reservations = first_and_waiter(bound, bound, settle=settle, duplicate_conn=app)
    expected = {"complete": "charged", "fail": "ReplayedFailureError", "release": "ran again"}
    expected["end-lease"] = "ran again"
    assert got == expected[settle]
    assert reservations == 2  # in progress, then the outcome: no polls in between
    pooled_sessions_are_clean(bound)


@pytest.mark.postgres
def test_a_duplicate_on_the_apps_connection_polls_without_wait_settled(
    request: pytest.FixtureRequest, postgres_url: str
) -> None:
    """The control for the test above: the same run, with a store that cannot wake."""
    with (
        migrated(PollingBoundPostgresStore, request) as store,
        psycopg.connect(postgres_url) as app,
    ):
        got, reservations = first_and_waiter(store, store, settle="complete", duplicate_conn=app)
    assert got == "charged"
    assert reservations > 4


@pytest.mark.postgres
@pytest.mark.parametrize("settle", ["complete", "release"])
def test_transactional_duplicates_racing_a_transactional_first_always_end(
    postgres_url: str, bound: CountingBoundPostgresStore, settle: str
) -> None:
    """Many rounds, two connections of the app's: the first holds its uncommitted record past
    the duplicate's lock timeout and ends at a random moment, in its row-lock wait or in the
    wait on the store's connection that follows it; the duplicate always gets the outcome
    (a wake-up lost in between would run into the test's deadline)."""
    rng = random.Random(15)
    policy = Policy(wait=timedelta(seconds=DEADLINE), lock_timeout=timedelta(milliseconds=20))
    idem = Idempotency(bound, policy)
    with (
        psycopg.connect(postgres_url) as first_conn,
        psycopg.connect(postgres_url) as duplicate_conn,
        ThreadPoolExecutor(2) as pool,
    ):
        for n in range(40):
            key = f"race-{n}"
            entered = threading.Event()

            def first(key: str = key, entered: threading.Event = entered) -> None:
                with (
                    suppress(ConnectionError),
                    idem.once(key, operation="charge", conn=first_conn) as attempt,
                ):
                    entered.set()
                    time.sleep(0.02 + rng.random() * 0.06)
                    if settle == "release":
                        raise ConnectionError("the card network timed out")
                    attempt.result = "charged"

            def duplicate(key: str = key, entered: threading.Event = entered) -> Any:
                entered.wait(DEADLINE)
                with idem.once(key, operation="charge", conn=duplicate_conn) as attempt:
                    if not attempt.replayed:
                        attempt.result = "ran again"
                    return attempt.result

            running = pool.submit(first)
            got = pool.submit(duplicate).result(DEADLINE)
            running.result(DEADLINE)
            assert got == ("charged" if settle == "complete" else "ran again")
    pooled_sessions_are_clean(bound)


@pytest.mark.postgres
@pytest.mark.parametrize("conn", [False, True])
def test_a_settle_that_sends_no_notification_still_ends_the_wait(
    postgres_url: str, bound: CountingBoundPostgresStore, conn: bool
) -> None:
    """A record settled without a notification (an older idempo's settle, as a plain UPDATE)
    while a duplicate waits, on the store's connection or on the app's: its lease and its
    wait are far longer than the test's deadline, yet it replays, by asking again."""
    long = timedelta(seconds=3 * DEADLINE)  # what a lost wake-up would wait
    idem = Idempotency(bound, Policy(wait=long, lease=long))
    holder = idem.once("k-1", operation="charge")
    holder.__enter__()  # in progress; it never exits, the UPDATE below settles it
    scope = Scope("", "charge", "k-1")
    table = bound.dialect.table
    with (
        psycopg.connect(postgres_url) as app,
        psycopg.connect(postgres_url, autocommit=True) as other,
        ThreadPoolExecutor(1) as pool,
    ):

        def duplicate() -> Any:
            with idem.once("k-1", operation="charge", conn=app if conn else None) as attempt:
                return attempt.replayed, attempt.result

        waited = pool.submit(duplicate)
        until(lambda: marks(postgres_url, bound, scope, granted=True) == 1, "it waits")
        other.execute(
            f"UPDATE {table} SET state = 'completed', response = %s, lease_expires_at = NULL"
            " WHERE idem_key = 'k-1'",
            (b'"charged"',),
        )
        assert waited.result(DEADLINE) == (True, "charged")


@pytest.mark.postgres
def test_a_waiter_that_sees_no_record_waits_no_longer_than_a_poll(
    postgres_url: str, pg: PostgresStore
) -> None:
    """The record is an open transaction's (transactional mode): no one else can see it, and
    a rollback would send nothing. So the waiter waits about as long as a poll, then the
    reservation meets the row lock; it never waits out the time it was given."""
    idem = Idempotency(pg)
    scope = Scope("", "charge", "k-1")
    with (
        psycopg.connect(postgres_url) as app,
        idem.once("k-1", operation="charge", conn=app) as attempt,
        ThreadPoolExecutor(1) as pool,
    ):
        pool.submit(pg.wait_settled, scope, 3 * DEADLINE).result(DEADLINE)
        attempt.result = "charged"
    pooled_sessions_are_clean(pg)


@pytest.mark.postgres
def test_a_waiter_whose_lock_times_out_keeps_its_connection(
    postgres_url: str, pg: PostgresStore
) -> None:
    """A settle holds the mark in an open transaction past the wait's end: the waiter's lock
    times out, and its connection goes back to the pool clean rather than being closed."""
    scope, token = held(pg, "k-1")
    sql, params = settle_statement(pg, scope, token)
    with psycopg.connect(postgres_url) as settling:
        with settling.transaction():
            settling.execute(sql, params)
            pg.wait_settled(scope, seconds=0.2)
        assert pg._pool.get_stats().get("returns_bad", 0) == 0
    pooled_sessions_are_clean(pg)


@pytest.mark.postgres
@pytest.mark.anyio
async def test_an_async_duplicate_on_the_apps_connection_is_woken(
    postgres_url: str, pg: PostgresStore
) -> None:
    """A thread's guard holds a key on the store's own connection, then completes it; an
    async duplicate on an async connection of the app's waits, and replays at once."""
    waiting = AsyncPostgresStore(postgres_url, table=pg.dialect.table)
    sync = Idempotency(pg)
    waiter = AsyncIdempotency(waiting, Policy(wait=timedelta(seconds=DEADLINE)))
    entered, go = threading.Event(), threading.Event()
    reservations = 0

    first = functools.partial(hold_then_complete, sync, entered, go)

    bind = waiting.bind

    def counting_bind(conn: Any, **options: Any) -> Any:
        unit = bind(conn, **options)
        perform = unit.perform

        def counted(op: Any) -> Any:
            nonlocal reservations
            reservations += isinstance(op, Reserve)
            return perform(op)

        unit.perform = counted  # type: ignore[method-assign]
        return unit

    waiting.bind = counting_bind  # type: ignore[method-assign]
    thread = threading.Thread(target=first)
    thread.start()
    try:
        async with await psycopg.AsyncConnection.connect(postgres_url) as app:
            await asyncio.to_thread(entered.wait, DEADLINE)
            go.set()
            async with waiter.once("k-1", operation="charge", conn=app) as attempt:
                assert attempt.replayed
                assert attempt.result == "charged"
        assert reservations == 2  # in progress, then the replay: no polls
    finally:
        go.set()
        thread.join(DEADLINE)
        await waiting.aclose()
