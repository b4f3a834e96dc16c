"""Transactional mode against the real databases: the defects of issue 10 (#2, #5, #6, #8,
#12) and the function codec's undecodable records, each on real, separate connections.

* #2: the guarded transaction keeps the connection's isolation level; a serialization failure
  inside it is transient (released, the driver's error raised), never a second execution.
* #5: a deterministic failure is recorded while the reservation's row lock is still held, so
  a duplicate waiting on that lock replays the failure instead of running the work.
* #6: a result that cannot be stored releases the key in transactional mode (the writes
  rolled back, so nothing may say otherwise) and raises a typed error.
* #8: an app that commits inside the block gets `TransactionOwnershipError`, and what it
  committed is recorded FAILED, never left IN_PROGRESS to run again after the lease.
* #12: ``Policy.wait`` bounds the whole wait, row-lock waits included.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from datetime import timedelta
from typing import Any

import psycopg
import pymysql
import pytest
from psycopg import IsolationLevel
from psycopg import errors as pg_errors

from helpers import Database, new_key
from idempo import (
    AsyncIdempotency,
    ConfigurationError,
    CorruptRecordError,
    Idempotency,
    Policy,
    ReplayedFailureError,
    RequestInProgressError,
    ResponseTooLargeError,
    Status,
    TransactionOwnershipError,
    UnserializableResultError,
)
from idempo._core.fingerprint import fingerprint
from idempo._core.keys import Scope
from idempo.consumer import Consumer, Envelope, Reason
from idempo.events import key_digest
from idempo.testing import FakeClock

OPERATION = "tx.defects"
WAIT_TIMEOUT = 20.0  # seconds any test waits for another connection, at most


class Refused(Exception):
    """A deterministic failure of the work (named in ``fail_on``)."""


def scope_of(key: str, operation: str = OPERATION) -> Scope:
    return Scope.of(key, operation=operation)


def business_rows(database: Database) -> list[tuple[Any, ...]]:
    return database.select(f"SELECT idem_key, note FROM {database.business_table} ORDER BY note")


def insert_row(database: Database, conn: Any, key: str, note: str) -> None:
    conn.execute(
        database.sql(f"INSERT INTO {database.business_table} (idem_key, note) VALUES (?, ?)"),
        (key, note),
    )


def run_once(idem: Idempotency, key: str, body: Callable[[], Any], **options: Any) -> Any:
    """One guarded call whose block returns ``body()`` unless the key replays; its result."""
    with idem.once(key, operation=OPERATION, **options) as attempt:
        if not attempt.replayed:
            attempt.result = body()
    return attempt.result


def never() -> None:
    raise AssertionError("the work ran")


@pytest.fixture
def business(database: Database) -> Database:
    """Every real database with an empty business table (no unique key: a second execution
    shows as a second row)."""
    database.create_business_table("idem_key VARCHAR(255), note VARCHAR(255)")
    return database


# -- waiting for another connection to block on a lock -----------------------------------


def until(condition: Callable[[], bool], what: str) -> None:
    """Poll the server until ``condition`` holds: synchronisation on real server state."""
    deadline = time.monotonic() + WAIT_TIMEOUT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.005)


class LockWaiter:
    """Knows when a given app connection is blocked on a lock, for each kind of database."""

    def __init__(self, database: Database, conn: Any) -> None:
        self.database = database
        self.conn = conn
        self.started = threading.Event()
        if database.kind == "sqlite":
            # SQLite cannot be asked who waits: the trace callback fires as the guard's
            # BEGIN IMMEDIATE starts, which then waits in the busy handler for the holder.
            def trace(sql: str) -> None:
                if sql.startswith("BEGIN IMMEDIATE"):
                    self.started.set()

            conn.set_trace_callback(trace)
        elif database.kind == "postgres":
            self.pid = conn.info.backend_pid
        else:
            self.thread = conn.thread_id()

    def blocked(self) -> bool:
        kind = self.database.kind
        if kind == "sqlite":
            return self.started.is_set()
        if kind == "postgres":
            rows = self.database.select(
                "SELECT 1 FROM pg_stat_activity"
                f" WHERE pid = {self.pid} AND wait_event_type = 'Lock'"
            )
            return bool(rows)
        rows = self.database.select(
            "SELECT 1 FROM information_schema.innodb_trx"
            f" WHERE trx_mysql_thread_id = {self.thread} AND trx_state = 'LOCK WAIT'"
        )
        return bool(rows)

    def wait(self) -> None:
        until(self.blocked, "the duplicate waits on the reservation's lock")


# -- #2: isolation levels ------------------------------------------------------------------


def _accounts(database: Database) -> str:
    table = database.table("accounts")
    database.execute(f"CREATE TABLE {table} (id integer PRIMARY KEY, balance integer NOT NULL)")
    database.execute(f"INSERT INTO {table} VALUES (1, 100)")
    return table


LEVELS = [IsolationLevel.REPEATABLE_READ, IsolationLevel.SERIALIZABLE]


@pytest.mark.postgres
@pytest.mark.parametrize("autocommit", [False, True], ids=["tx", "autocommit"])
@pytest.mark.parametrize("level", LEVELS, ids=lambda level: level.name.lower())
def test_concurrent_withdrawals_keep_the_isolation_level(
    postgres_database: Database, level: IsolationLevel, autocommit: bool
) -> None:
    """Two withdrawals on SERIALIZABLE (or REPEATABLE READ) connections each read 100 and
    write 90 under the guard, both reading before either writes: exactly one commits, the
    other gets psycopg's serialization error with its key released, and its retry with the
    same key then executes once (90 -> 80)."""
    db = postgres_database
    accounts = _accounts(db)
    store = db.store()
    idem = Idempotency(store)
    both_read = threading.Barrier(2, timeout=WAIT_TIMEOUT)

    def withdraw(key: str, barrier: threading.Barrier | None) -> Any:
        with closing(psycopg.connect(db.location, autocommit=autocommit)) as conn:
            conn.isolation_level = level
            try:
                with idem.once(key, operation=OPERATION, conn=conn) as attempt:
                    if not attempt.replayed:
                        row = conn.execute(f"SELECT balance FROM {accounts} WHERE id = 1")
                        (balance,) = row.fetchone() or (0,)
                        if barrier is not None:
                            barrier.wait()
                        conn.execute(
                            f"UPDATE {accounts} SET balance = %s WHERE id = 1", (balance - 10,)
                        )
                        attempt.result = balance - 10
            except psycopg.Error as exc:
                return exc
            return attempt.result

    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(withdraw, ["w-a", "w-b"], [both_read, both_read]))
        failed = [i for i, result in enumerate(results) if isinstance(result, Exception)]
        assert len(failed) == 1, results
        assert isinstance(results[failed[0]], pg_errors.SerializationFailure)
        assert results[1 - failed[0]] == 90
        loser = ["w-a", "w-b"][failed[0]]
        assert store.get(scope_of(loser)) is None  # released: nothing of it committed
        assert withdraw(loser, None) == 80
        assert db.select(f"SELECT balance FROM {accounts}") == [(80,)]
        assert withdraw(loser, None) == 80  # and now it replays
    finally:
        store.close()


@pytest.mark.postgres
@pytest.mark.anyio
@pytest.mark.parametrize("autocommit", [False, True], ids=["tx", "autocommit"])
async def test_concurrent_async_withdrawals_keep_serializable(
    postgres_database: Database, autocommit: bool
) -> None:
    """The asynchronous twin on psycopg's AsyncConnection: one withdrawal commits, the other
    gets the serialization error and its key is released."""
    db = postgres_database
    accounts = _accounts(db)
    store = db.async_store()
    idem = AsyncIdempotency(store)
    both_read = asyncio.Barrier(2)

    async def withdraw(key: str, wait: bool) -> Any:
        conn = await psycopg.AsyncConnection.connect(db.location, autocommit=autocommit)
        await conn.set_isolation_level(IsolationLevel.SERIALIZABLE)
        try:
            async with idem.once(key, operation=OPERATION, conn=conn) as attempt:
                if not attempt.replayed:
                    row = await conn.execute(f"SELECT balance FROM {accounts} WHERE id = 1")
                    (balance,) = await row.fetchone() or (0,)
                    if wait:
                        await asyncio.wait_for(both_read.wait(), WAIT_TIMEOUT)
                    await conn.execute(
                        f"UPDATE {accounts} SET balance = %s WHERE id = 1", (balance - 10,)
                    )
                    attempt.result = balance - 10
        except psycopg.Error as exc:
            return exc
        else:
            return attempt.result
        finally:
            await conn.close()

    try:
        results = await asyncio.gather(withdraw("w-a", True), withdraw("w-b", True))
        failed = [i for i, result in enumerate(results) if isinstance(result, Exception)]
        assert len(failed) == 1, results
        assert isinstance(results[failed[0]], pg_errors.SerializationFailure)
        loser = ["w-a", "w-b"][failed[0]]
        assert await store.get(scope_of(loser)) is None
        assert await withdraw(loser, False) == 80
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mysql", marks=pytest.mark.mysql),
    ],
)
def test_deadlock_inside_the_block_is_transient(kind: str, request: pytest.FixtureRequest) -> None:
    """Two guarded blocks lock two rows in opposite orders (each holds its first before either
    asks for its second): the server picks a deadlock victim, which gets the driver's own
    error with nothing committed and its key released; the other commits, and the victim's
    retry runs once."""
    db: Database = request.getfixturevalue(f"{kind}_database")
    table = db.table("pair")
    db.execute(f"CREATE TABLE {table} (id integer PRIMARY KEY, n integer NOT NULL)")
    db.execute(f"INSERT INTO {table} VALUES (1, 0), (2, 0)")
    store = db.store()
    idem = Idempotency(store)
    both_hold = threading.Barrier(2, timeout=WAIT_TIMEOUT)
    update = db.sql(f"UPDATE {table} SET n = n + 1 WHERE id = ?")

    def lock_both(key: str, order: tuple[int, int], barrier: threading.Barrier | None) -> Any:
        conn = db.connect(store)
        try:
            with idem.once(key, operation=OPERATION, conn=conn) as attempt:
                if not attempt.replayed:
                    conn.execute(update, (order[0],))
                    if barrier is not None:
                        barrier.wait()
                    conn.execute(update, (order[1],))
                    attempt.result = key
        except (psycopg.Error, pymysql.err.Error) as exc:
            return exc
        finally:
            conn.close()
        return attempt.result

    try:
        with ThreadPoolExecutor(2) as pool:
            results = list(
                pool.map(lock_both, ["d-a", "d-b"], [(1, 2), (2, 1)], [both_hold, both_hold])
            )
        failed = [i for i, result in enumerate(results) if isinstance(result, Exception)]
        assert len(failed) == 1, results
        victim = results[failed[0]]
        if kind == "postgres":
            assert isinstance(victim, pg_errors.DeadlockDetected)
        else:
            assert victim.args[0] == 1213
        loser = ["d-a", "d-b"][failed[0]]
        assert store.get(scope_of(loser)) is None
        assert lock_both(loser, (1, 2), None) == loser
        assert db.select(f"SELECT n FROM {table} ORDER BY id") == [(2,), (2,)]
    finally:
        store.close()


@pytest.mark.postgres
def test_read_only_connection_is_refused_not_turned_read_write(
    postgres_database: Database,
) -> None:
    """A read-only connection cannot hold transactional mode's record: the guard says so with
    a ConfigurationError before any statement, instead of opening a read-write transaction."""
    db = postgres_database
    store = db.store()
    try:
        with closing(psycopg.connect(db.location)) as conn:
            conn.read_only = True
            once = Idempotency(store).once(new_key(), operation=OPERATION, conn=conn)
            with pytest.raises(ConfigurationError, match="read-only"):
                once.__enter__()
            assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert store.stats() == {}
    finally:
        store.close()


# -- #5: a deterministic failure while a duplicate waits on the lock ------------------------


def test_deterministic_failure_is_recorded_while_the_duplicate_waits(business: Database) -> None:
    """The first attempt fails deterministically while a duplicate is blocked on its
    reservation's lock: the first caller gets its own exception, the failure is recorded
    before the lock is let go, and the duplicate replays it instead of running the work."""
    db = business
    store = db.store()
    idem = Idempotency(store, Policy(fail_on=(Refused,), lock_timeout=timedelta(seconds=15)))
    key = new_key()
    runs: list[str] = []
    first_conn, second_conn = db.connect(store), db.connect(store)
    waiter = LockWaiter(db, second_conn)
    holding = threading.Event()

    def first() -> BaseException | None:
        try:
            with idem.once(key, operation=OPERATION, conn=first_conn):
                runs.append("first")
                insert_row(db, first_conn, key, "first")
                holding.set()
                waiter.wait()
                raise Refused("declined")
        except BaseException as exc:  # the test looks at what came out
            return exc
        return None

    def second() -> BaseException | None:
        holding.wait(WAIT_TIMEOUT)
        try:
            with idem.once(key, operation=OPERATION, conn=second_conn) as attempt:
                if not attempt.replayed:
                    runs.append("second")
                    insert_row(db, second_conn, key, "second")
                    attempt.result = "second"
        except BaseException as exc:
            return exc
        return None

    try:
        with ThreadPoolExecutor(2) as pool:
            first_error, second_error = (
                f.result() for f in [pool.submit(first), pool.submit(second)]
            )
        assert isinstance(first_error, Refused), first_error
        assert isinstance(second_error, ReplayedFailureError), second_error
        assert runs == ["first"]
        assert business_rows(db) == []
        record = store.get(scope_of(key))
        assert record is not None
        assert record.status is Status.FAILED
    finally:
        first_conn.close()
        second_conn.close()
        store.close()


def test_consumer_deterministic_failure_with_a_waiting_duplicate_is_an_outcome(
    business: Database,
) -> None:
    """The transactional consumer path: a handler failing deterministically while a
    redelivery waits on its lock gives a FAILED outcome (not an internal error), and the
    redelivery is acknowledged as a duplicate without running."""
    db = business
    store = db.store()
    idem = Idempotency(store, Policy(lock_timeout=timedelta(seconds=15)))
    connections = [db.connect(store), db.connect(store)]
    waiter = LockWaiter(db, connections[1])
    handed = iter(connections)

    @contextmanager
    def connection() -> Iterator[Any]:
        yield next(handed)

    consumer = Consumer(
        idem, name="tx.consumer", horizon=timedelta(0), connection=connection, fail_on=(Refused,)
    )
    runs: list[str] = []
    holding = threading.Event()

    def handler(delivery: Any) -> None:
        runs.append("ran")
        insert_row(db, delivery.conn, delivery.key, "handled")
        holding.set()
        waiter.wait()
        raise Refused("bad order")

    def duplicate(delivery: Any) -> None:
        runs.append("duplicate ran")

    message = Envelope(new_key(), b"{}")
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(consumer.process, None, message, handler)
            holding.wait(WAIT_TIMEOUT)
            again = pool.submit(consumer.process, None, message, duplicate)
            outcomes = first.result(), again.result()
        assert [outcome.reason for outcome in outcomes] == [Reason.FAILED, Reason.DUPLICATE]
        assert isinstance(outcomes[0].error, Refused)
        assert runs == ["ran"]
        assert business_rows(db) == []
    finally:
        for conn in connections:
            conn.close()
        store.close()


# -- #6: a result that cannot be stored ------------------------------------------------------


@pytest.mark.parametrize("result", ["oversized", "unserializable"])
def test_unstorable_result_in_transactional_mode_releases_the_key(
    business: Database, result: str
) -> None:
    """A result over max_response_bytes, or one the serializer refuses, rolls the work's
    writes back and releases the key (what is recorded is what committed), raising a typed
    error; the retry runs the work again and completes."""
    db = business
    store = db.store()
    idem = Idempotency(store, Policy(max_response_bytes=50))
    key = new_key()
    conn = db.connect(store)
    values: list[Any] = ["x" * 100 if result == "oversized" else object(), "small"]
    try:
        expected = ResponseTooLargeError if result == "oversized" else UnserializableResultError

        def work(note: str, value: Any) -> Callable[[], Any]:
            def body() -> Any:
                insert_row(db, conn, key, note)
                return value

            return body

        with pytest.raises(expected) as raised:
            run_once(idem, key, work("first", values[0]), conn=conn)
        if result == "unserializable":
            assert isinstance(raised.value.__cause__, TypeError)
        assert store.get(scope_of(key)) is None
        assert business_rows(db) == []
        assert run_once(idem, key, work("retry", values[1]), conn=conn) == "small"
        assert business_rows(db) == [(key, "retry")]
        record = store.get(scope_of(key))
        assert record is not None
        assert record.status is Status.COMPLETED
    finally:
        conn.close()
        store.close()


# -- #8: the app commits inside the block ------------------------------------------------------


@pytest.mark.parametrize("then", ["raises", "returns"])
def test_commit_inside_the_block_is_refused_and_never_runs_again(
    business: Database, clock: FakeClock, then: str
) -> None:
    """The block commits the guard's transaction itself (then raises, or returns): the caller
    gets TransactionOwnershipError, the committed work is recorded FAILED instead of staying
    IN_PROGRESS, and a retry after the lease replays the failure instead of running again."""
    db = business
    store = db.store()
    policy = Policy(clock=clock, lease=timedelta(seconds=30))
    idem = Idempotency(store, policy)
    key = new_key()
    conn = db.connect(store)
    runs: list[str] = []

    def commits() -> str:
        runs.append("ran")
        insert_row(db, conn, key, "committed")
        conn.commit()
        if then == "raises":
            raise ValueError("after the commit")
        return "done"

    try:
        with pytest.raises(TransactionOwnershipError) as raised:
            run_once(idem, key, commits, conn=conn)
        if then == "raises":
            assert isinstance(raised.value.__cause__, ValueError)
        record = store.get(scope_of(key))
        assert record is not None
        assert record.status is Status.FAILED
        clock.advance(seconds=60)  # long past the lease
        with pytest.raises(ReplayedFailureError, match="TransactionOwnershipError"):
            run_once(idem, key, commits, conn=conn)
        assert runs == ["ran"]
        assert business_rows(db) == [(key, "committed")]
    finally:
        conn.close()
        store.close()


# -- #12: Policy.wait bounds the whole wait -----------------------------------------------------


def test_wait_bounds_the_whole_wait_on_a_row_lock(database: Database) -> None:
    """With Policy(wait=1 s) and a 2 s lock timeout, a duplicate blocked on a live holder's
    row lock (SQLite: its write lock) gives up after about one second, not after two lock
    timeouts."""
    db = database
    store = db.store()
    key = new_key()
    holder = Idempotency(store)
    duplicate = Idempotency(
        store, Policy(wait=timedelta(seconds=1), lock_timeout=timedelta(seconds=2))
    )
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with (
            closing(db.connect(store)) as conn,
            holder.once(key, operation=OPERATION, conn=conn) as attempt,
        ):
            holding.set()
            done.wait(WAIT_TIMEOUT)
            attempt.result = "held"

    try:
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(hold)
            assert holding.wait(WAIT_TIMEOUT)
            with closing(db.connect(store)) as conn:
                started = time.monotonic()
                with pytest.raises(RequestInProgressError):
                    run_once(duplicate, key, never, conn=conn)
                elapsed = time.monotonic() - started
            done.set()
            held.result()
        assert 0.9 <= elapsed < 1.6, elapsed
    finally:
        done.set()
        store.close()


# -- the function codec: a stored response that cannot be decoded -------------------------------


@pytest.mark.parametrize("status", [Status.COMPLETED, Status.FAILED])
def test_undecodable_stored_result_is_a_corrupt_record(sqlite_store: Any, status: Status) -> None:
    """A stored result the serializer cannot read back raises CorruptRecordError, which says
    how to evict the record, instead of a raw JSON error; nothing runs."""
    key = new_key()
    scope = scope_of(key)
    hour = timedelta(hours=1)
    clock = FakeClock()
    token = sqlite_store.reserve(scope, fingerprint(b"x"), now=clock(), lease=hour, ttl=hour).token
    verb = sqlite_store.complete if status is Status.COMPLETED else sqlite_store.fail
    verb(scope, token, b"\xff not json", now=clock(), ttl=hour)
    idem = Idempotency(sqlite_store, Policy(clock=clock))
    with pytest.raises(CorruptRecordError, match="evict") as raised:
        run_once(idem, key, never, payload=b"x")
    # The key as its digest, never raw (idempo.events.key_digest), and where to evict it.
    assert key_digest(key) in str(raised.value)
    assert key not in str(raised.value)


def test_consumer_handler_that_commits_is_failed_for_good(business: Database) -> None:
    """A consumer's handler that commits the guard's transaction gets a FAILED outcome whose
    error is TransactionOwnershipError; its redelivery is a duplicate and does not run."""
    db = business
    store = db.store()
    conn = db.connect(store)

    @contextmanager
    def connection() -> Iterator[Any]:
        yield conn

    consumer = Consumer(
        Idempotency(store), name="tx.commits", horizon=timedelta(0), connection=connection
    )
    runs: list[str] = []

    def handler(delivery: Any) -> None:
        runs.append("ran")
        insert_row(db, delivery.conn, delivery.key, "committed")
        delivery.conn.commit()
        raise ValueError("after the commit")

    message = Envelope(new_key(), b"{}")
    try:
        first = consumer.process(None, message, handler)
        again = consumer.process(None, message, handler)
        assert (first.reason, again.reason) == (Reason.FAILED, Reason.DUPLICATE)
        assert isinstance(first.error, TransactionOwnershipError)
        assert runs == ["ran"]
        assert business_rows(db) == [(message.id, "committed")]
    finally:
        conn.close()
        store.close()
