"""The broker-neutral consumer core: outcomes, the horizon guard, the inbox, saga steps.

Most tests are written once as async tests against `Harness`, which puts the sync consumer
(`Consumer`) and the async one (`AsyncConsumer`) behind the same awaited call; the
``store_face`` fixture runs them on every store in both faces. Handlers are async bodies
that never suspend, so the sync consumer can run them too. Time is the test's FakeClock.
The real broker is in test_aio_pika.py.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from helpers import Database, new_key
from idempo import (
    AsyncIdempotency,
    ConfigurationError,
    FingerprintMismatchError,
    Idempotency,
    Policy,
    ReplayedFailureError,
    Scope,
    Status,
    UnserializableResultError,
    step_key,
)
from idempo.consumer import (
    Action,
    AsyncConsumer,
    Consumer,
    Delivery,
    Envelope,
    Outcome,
    Reason,
    body_key,
    current_delivery,
)
from idempo.policy import utcnow
from idempo.saga import AsyncSaga, Saga
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.testing import FakeClock

NAME = "billing.charge"
HORIZON = timedelta(days=7)
TTL = timedelta(days=7)
Handler = Callable[[Delivery[Any]], Awaitable[Any]]


class InvalidOrderError(Exception):
    """A deterministic failure: the same message will never succeed."""


@dataclass(frozen=True)
class Reservation:
    """A saga step's typed result."""

    id: str
    at: datetime


def _run_sync(handler: Handler) -> Callable[[Delivery[Any]], Any]:
    """A sync handler for an async body that never suspends."""

    def run(delivery: Delivery[Any]) -> Any:
        coroutine = handler(delivery)
        assert inspect.iscoroutine(coroutine)
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
        coroutine.close()
        raise AssertionError("the handler suspended; a sync consumer cannot run it")

    return run


@dataclass
class Harness:
    """A sync or async consumer behind one awaited ``process``, with its store and clock."""

    store: Any
    is_async: bool
    clock: FakeClock
    consumer: Any = None
    calls: list[str] = field(default_factory=list)

    def make(self, policy: Policy | None = None, **options: Any) -> Harness:
        """(Re)build the consumer; ``policy`` defaults to the test clock and a 7-day ttl."""
        policy = policy or Policy(clock=self.clock, sleep=self.clock.sleep, ttl=TTL)
        options.setdefault("horizon", HORIZON)
        options.setdefault("name", NAME)
        if self.is_async:
            self.consumer = AsyncConsumer(AsyncIdempotency(self.store, policy), **options)
        else:
            self.consumer = Consumer(Idempotency(self.store, policy), **options)
        return self

    async def process(self, envelope: Envelope, handler: Handler | None = None) -> Outcome:
        handler = handler or self.record_call
        if self.is_async:
            outcome: Outcome = await self.consumer.process("raw", envelope, handler)
            return outcome
        result: Outcome = self.consumer.process("raw", envelope, _run_sync(handler))
        return result

    async def record_call(self, delivery: Delivery[Any]) -> dict[str, str]:
        self.calls.append(delivery.key)
        return {"handled": delivery.key}

    async def record(self, key: str, *, principal: str = "") -> Any:
        found = self.store.get(Scope.of(key, operation=NAME, principal=principal))
        return await found if inspect.isawaitable(found) else found


@pytest.fixture
def harness(store_face: tuple[Any, bool], clock: FakeClock) -> Harness:
    """A consumer on every store, sync and async."""
    store, is_async = store_face
    return Harness(store, is_async, clock).make()


@pytest.fixture(params=["sync", "async"])
def memory_harness(request: pytest.FixtureRequest, clock: FakeClock) -> Harness:
    """A consumer on the memory store, sync and async: for refusals made before any I/O."""
    is_async = request.param == "async"
    return Harness(AsyncMemoryStore() if is_async else MemoryStore(), is_async, clock).make()


def envelope(key: str | None, body: bytes = b'{"amount": 5}', **extra: Any) -> Envelope:
    return Envelope(id=key, body=body, **extra)


# -- outcomes ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_first_delivery_executes_and_duplicates_are_acked_unhandled(
    harness: Harness,
) -> None:
    """The first delivery runs the handler and is acked; every copy after it is acked as a
    duplicate with the stored result, and the handler never runs again."""
    key = new_key()
    first = await harness.process(envelope(key))
    assert (first.reason, first.action, first.key) == (Reason.EXECUTED, Action.ACK, key)
    assert first.result == {"handled": key}
    for _ in range(3):
        again = await harness.process(envelope(key))
        assert (again.reason, again.action) == (Reason.DUPLICATE, Action.ACK)
        assert again.result == {"handled": key}
    assert harness.calls == [key]
    record = await harness.record(key)
    assert record.status is Status.COMPLETED
    assert harness.consumer.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 3})


@pytest.mark.anyio
@pytest.mark.parametrize("missing", [None, ""])
async def test_message_without_id_is_dead_lettered_loudly(
    memory_harness: Harness, missing: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    """A message with no id is refused to the dead-letter queue with an ERROR log line, and
    neither runs nor stores anything."""
    harness = memory_harness
    with caplog.at_level(logging.ERROR, logger="idempo.consumer"):
        outcome = await harness.process(envelope(missing))
    assert (outcome.reason, outcome.action, outcome.key) == (
        Reason.NO_KEY,
        Action.DEAD_LETTER,
        None,
    )
    assert harness.calls == []
    [line] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "no id" in line.getMessage()
    assert NAME in line.getMessage()
    assert harness.consumer.counts[Reason.NO_KEY] == 1
    assert await harness.record(body_key(b'{"amount": 5}')) is None


@pytest.mark.anyio
async def test_key_from_body_runs_unkeyed_messages_and_identical_bodies_collide(
    harness: Harness,
) -> None:
    """With key_from_body, a message without id runs under the body's hash; a second,
    distinct event with the same body is then taken for a duplicate (the documented cost)."""
    harness.make(key_from_body=True)
    first = await harness.process(envelope(None, b"same"))
    assert first.reason is Reason.EXECUTED
    assert first.key == body_key(b"same")
    assert (await harness.process(envelope(None, b"same"))).reason is Reason.DUPLICATE
    assert (await harness.process(envelope(None, b"other"))).reason is Reason.EXECUTED
    assert len(harness.calls) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("bad", ["has space", "x" * 256, "caf\u00e9"])
async def test_malformed_id_is_dead_lettered(memory_harness: Harness, bad: str) -> None:
    """An id that is not a valid key is refused, not run under some mangled key."""
    harness = memory_harness
    outcome = await harness.process(envelope(bad))
    assert (outcome.reason, outcome.action) == (Reason.INVALID_KEY, Action.DEAD_LETTER)
    assert harness.calls == []


@pytest.mark.anyio
async def test_reused_id_with_another_body_is_dead_lettered_not_executed(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """An id first seen with one body and then with another is a producer bug: the second
    is dead-lettered with an ERROR line, never executed, and the record is untouched."""
    key = new_key()
    assert (await harness.process(envelope(key, b"one"))).reason is Reason.EXECUTED
    before = await harness.record(key)
    with caplog.at_level(logging.ERROR, logger="idempo.consumer"):
        outcome = await harness.process(envelope(key, b"two"))
    assert (outcome.reason, outcome.action) == (Reason.MISMATCH, Action.DEAD_LETTER)
    assert isinstance(outcome.error, FingerprintMismatchError)
    assert harness.calls == [key]
    assert await harness.record(key) == before
    assert any("another body" in r.getMessage() for r in caplog.records)


@pytest.mark.anyio
async def test_transient_failure_requeues_and_the_redelivery_executes_once(
    harness: Harness,
) -> None:
    """An exception not named deterministic releases the key and asks for a requeue after
    retry_delay; the redelivery executes, and copies after that are duplicates."""
    harness.make(retry_delay=timedelta(seconds=2))
    key = new_key()
    attempts: list[int] = []

    async def flaky(delivery: Delivery[Any]) -> str:
        attempts.append(delivery.attempt.token or 0)
        if len(attempts) == 1:
            raise ConnectionError("the PSP timed out")
        return "charged"

    failed = await harness.process(envelope(key), flaky)
    assert (failed.reason, failed.action, failed.delay) == (Reason.TRANSIENT, Action.REQUEUE, 2.0)
    assert isinstance(failed.error, ConnectionError)
    assert await harness.record(key) is None
    done = await harness.process(envelope(key), flaky)
    assert (done.reason, done.result) == (Reason.EXECUTED, "charged")
    assert (await harness.process(envelope(key), flaky)).reason is Reason.DUPLICATE
    assert len(attempts) == 2


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("on_failure", "action"), [("ack", Action.ACK), ("dead_letter", Action.DEAD_LETTER)]
)
async def test_deterministic_failure_is_recorded_and_replayed_as_a_skip(
    harness: Harness, on_failure: str, action: Action
) -> None:
    """A fail_on exception is recorded FAILED and acked or dead-lettered as configured;
    every redelivery is acked as a duplicate without running the handler."""
    harness.make(fail_on=(InvalidOrderError,), on_failure=on_failure)
    key = new_key()
    runs: list[str] = []

    async def reject(delivery: Delivery[Any]) -> None:
        runs.append(delivery.key)
        raise InvalidOrderError("unknown currency")

    outcome = await harness.process(envelope(key), reject)
    assert (outcome.reason, outcome.action) == (Reason.FAILED, action)
    assert isinstance(outcome.error, InvalidOrderError)
    assert (await harness.record(key)).status is Status.FAILED
    again = await harness.process(envelope(key), reject)
    assert (again.reason, again.action) == (Reason.DUPLICATE, Action.ACK)
    assert isinstance(again.error, ReplayedFailureError)
    assert runs == [key]


@pytest.mark.anyio
async def test_result_that_cannot_be_stored_fails_the_message_for_good(harness: Harness) -> None:
    """A handler whose result the serializer refuses has run; its message is recorded FAILED
    (handled per on_failure) so that a redelivery does not run it again."""
    key = new_key()
    runs: list[str] = []

    async def unserializable(delivery: Delivery[Any]) -> object:
        runs.append(delivery.key)
        return object()

    outcome = await harness.process(envelope(key), unserializable)
    assert (outcome.reason, outcome.action) == (Reason.FAILED, Action.ACK)
    assert isinstance(outcome.error, UnserializableResultError)
    assert isinstance(outcome.error.__cause__, TypeError)
    assert (await harness.record(key)).status is Status.FAILED
    assert (await harness.process(envelope(key), unserializable)).reason is Reason.DUPLICATE
    assert runs == [key]


@pytest.mark.anyio
async def test_principal_scopes_the_event_id(harness: Harness) -> None:
    """The same event id from two tenants is two messages, not a duplicate."""
    harness.make(principal=lambda env: env.body.decode())
    key = new_key()
    assert (await harness.process(envelope(key, b"tenant-a"))).reason is Reason.EXECUTED
    assert (await harness.process(envelope(key, b"tenant-b"))).reason is Reason.EXECUTED
    assert (await harness.record(key, principal="tenant-a")).status is Status.COMPLETED
    assert harness.calls == [key, key]


@pytest.mark.anyio
async def test_current_delivery_is_the_running_handlers(memory_harness: Harness) -> None:
    """Inside a handler current_delivery() is its delivery; outside it is None."""
    harness = memory_harness
    seen: list[Delivery[Any] | None] = []

    async def peek(delivery: Delivery[Any]) -> None:
        seen.append(current_delivery())
        assert delivery.message == "raw"

    await harness.process(envelope(new_key()), peek)
    assert seen[0] is not None
    assert seen[0].envelope.body == b'{"amount": 5}'
    assert current_delivery() is None


# -- the horizon guard ---------------------------------------------------------------------


def test_retention_shorter_than_the_horizon_is_a_startup_error() -> None:
    """A ttl that does not cover the broker's redelivery horizon refuses to start, for both
    twins; a ttl equal to it is fine."""
    for face, guard in (
        (Consumer, Idempotency(MemoryStore(), Policy(ttl=timedelta(days=3)))),
        (AsyncConsumer, AsyncIdempotency(AsyncMemoryStore(), Policy(ttl=timedelta(days=3)))),
    ):
        with pytest.raises(ConfigurationError, match="shorter than the broker's redelivery"):
            face(guard, name=NAME, horizon=timedelta(days=14))  # type: ignore[arg-type]
        face(guard, name=NAME, horizon=timedelta(days=3))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {"name": ""},
        {"horizon": timedelta(seconds=-1)},
        {"on_failure": "drop"},
        {"on_expired": "execute"},
        {"mode": "eventually"},
        {"retry_delay": -1},
        {"connection": contextmanager(lambda: iter([None]))},  # the memory store cannot join
    ],
)
def test_bad_options_are_configuration_errors(options: dict[str, Any]) -> None:
    """Options that cannot work are refused when the consumer is made."""
    options = {"name": NAME, "horizon": HORIZON, **options}
    with pytest.raises(ConfigurationError):
        Consumer(Idempotency(MemoryStore(), Policy(ttl=TTL)), **options)


@pytest.mark.anyio
async def test_message_older_than_the_retention_is_quarantined_not_executed(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A message published longer ago than the ttl is dead-lettered (counted, logged), even
    a redrive of one that ran, whose record has expired: without the guard it would run a
    second time. Inside the ttl the duplicate is still recognised."""
    key = new_key()
    published = harness.clock()
    assert (await harness.process(envelope(key, timestamp=published))).reason is Reason.EXECUTED
    harness.clock.advance(TTL - timedelta(seconds=1))
    redrive = await harness.process(envelope(key, timestamp=published))
    assert redrive.reason is Reason.DUPLICATE
    harness.clock.advance(timedelta(seconds=2) + harness.consumer.idempotency.policy.lease)
    with caplog.at_level(logging.ERROR, logger="idempo.consumer"):
        late = await harness.process(envelope(key, timestamp=published))
    assert (late.reason, late.action) == (Reason.EXPIRED, Action.DEAD_LETTER)
    assert harness.calls == [key]
    assert harness.consumer.counts[Reason.EXPIRED] == 1
    assert any("horizon guard" in r.getMessage() for r in caplog.records)
    # An old message never seen before is not run either; a naive timestamp counts as UTC.
    naive = (harness.clock() - TTL - timedelta(hours=1)).replace(tzinfo=None)
    fresh = await harness.process(envelope(new_key(), timestamp=naive))
    assert fresh.reason is Reason.EXPIRED
    assert harness.calls == [key]


@pytest.mark.anyio
async def test_expired_messages_can_be_dropped_instead(memory_harness: Harness) -> None:
    """on_expired="ack" drops an old message (still counted and not executed)."""
    harness = memory_harness
    harness.make(on_expired="ack")
    old = harness.clock() - TTL - timedelta(minutes=1)
    outcome = await harness.process(envelope(new_key(), timestamp=old))
    assert (outcome.reason, outcome.action) == (Reason.EXPIRED, Action.ACK)
    assert harness.calls == []


# -- in progress, renewal, fencing (async) -------------------------------------------------


@pytest.mark.anyio
async def test_redelivery_while_in_progress_is_requeued_with_delay(async_store: Any) -> None:
    """A copy that arrives while the first is being handled is never run alongside it: it is
    requeued, after at most retry_delay; once the first is done, a copy is a duplicate."""
    consumer = AsyncConsumer(
        AsyncIdempotency(async_store, Policy(ttl=TTL, lease=timedelta(seconds=30))),
        name=NAME,
        horizon=HORIZON,
        retry_delay=timedelta(seconds=5),
    )
    key = new_key()
    entered, release = asyncio.Event(), asyncio.Event()
    runs: list[str] = []

    async def slow(delivery: Delivery[Any]) -> str:
        runs.append(delivery.key)
        entered.set()
        await release.wait()
        return "done"

    first = asyncio.create_task(consumer.process(None, envelope(key), slow))
    await entered.wait()
    copies = await asyncio.gather(*(consumer.process(None, envelope(key), slow) for _ in range(5)))
    for copy in copies:
        assert (copy.reason, copy.action) == (Reason.IN_PROGRESS, Action.REQUEUE)
        assert 0 < copy.delay <= 5
    release.set()
    assert (await first).reason is Reason.EXECUTED
    assert (await consumer.process(None, envelope(key), slow)).reason is Reason.DUPLICATE
    assert runs == [key]


@pytest.mark.anyio
async def test_lease_is_renewed_while_a_slow_handler_runs(async_store: Any) -> None:
    """A handler that runs for several of its 0.6 s leases keeps the key: copies that arrive
    all along are requeued, none takes over. (Real time: the lease must really pass.)"""
    lease = timedelta(seconds=0.6)
    consumer = AsyncConsumer(
        AsyncIdempotency(async_store, Policy(ttl=TTL, lease=lease)),
        name=NAME,
        horizon=HORIZON,
    )
    key = new_key()
    copies: list[Outcome] = []

    async def harmless(delivery: Delivery[Any]) -> None:
        pass

    async def slow(delivery: Delivery[Any]) -> None:
        until = utcnow() + 3 * lease
        while utcnow() < until:
            copies.append(await consumer.process(None, envelope(key), harmless))
            await asyncio.sleep(0.05)

    first = await consumer.process(None, envelope(key), slow)
    assert first.reason is Reason.EXECUTED
    assert len(copies) > 10
    assert {copy.reason for copy in copies} == {Reason.IN_PROGRESS}


@pytest.mark.parametrize("kind", ["memory", pytest.param("pg_store", marks=pytest.mark.postgres)])
def test_sync_consumer_renews_the_lease_from_a_thread(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """The sync twin renews too: a handler running for several 0.6 s leases keeps the key
    against copies arriving all along (real time)."""
    store = MemoryStore() if kind == "memory" else request.getfixturevalue(kind)
    lease = timedelta(seconds=0.6)
    consumer = Consumer(
        Idempotency(store, Policy(ttl=TTL, lease=lease)), name=NAME, horizon=HORIZON
    )
    key = new_key()
    copies: list[Outcome] = []

    def slow(delivery: Delivery[Any]) -> None:
        until = utcnow() + 3 * lease
        while utcnow() < until:
            copies.append(consumer.process(None, envelope(key), lambda copy: None))
            time.sleep(0.05)

    assert consumer.process(None, envelope(key), slow).reason is Reason.EXECUTED
    assert len(copies) > 10
    assert {copy.reason for copy in copies} == {Reason.IN_PROGRESS}


@pytest.mark.anyio
@pytest.mark.postgres
async def test_handler_that_lost_its_lease_is_requeued_and_its_writes_roll_back(
    postgres_database: Database, clock: FakeClock
) -> None:
    """In leased mode on the app's connection, a handler whose lease expired and was taken
    over meanwhile gets FENCED (requeue): its business row rolls back, the taker's stays."""
    db = postgres_database
    db.create_business_table("event_id TEXT NOT NULL, token INTEGER")
    store = db.async_store()
    try:
        consumer = AsyncConsumer(
            AsyncIdempotency(store, Policy(ttl=TTL, lease=timedelta(seconds=30), clock=clock)),
            name=NAME,
            horizon=HORIZON,
            connection=pg_connection(db.location),
            mode="leased",
        )
        key = new_key()
        inner: list[Outcome] = []

        async def write(delivery: Delivery[Any]) -> None:
            await delivery.conn.execute(
                f"INSERT INTO {db.business_table} VALUES (%s, %s)",
                (delivery.key, delivery.attempt.token),
            )

        async def stalls(delivery: Delivery[Any]) -> None:
            await write(delivery)
            clock.advance(seconds=31)  # this holder stalls past its lease...
            inner.append(await consumer.process(None, envelope(key), write))  # ...taken over

        outcome = await consumer.process(None, envelope(key), stalls)
        assert (outcome.reason, outcome.action) == (Reason.FENCED, Action.REQUEUE)
        assert [o.reason for o in inner] == [Reason.EXECUTED]
        assert db.select(f"SELECT event_id, token FROM {db.business_table}") == [(key, 2)]
        assert (await consumer.process(None, envelope(key), write)).reason is Reason.DUPLICATE
    finally:
        await store.aclose()


@pytest.mark.anyio
async def test_unreachable_database_requeues_without_running(
    async_sqlite_store: Any, clock: FakeClock
) -> None:
    """When the app's connection cannot be opened nothing runs and the message is requeued."""

    @asynccontextmanager
    async def down() -> AsyncIterator[Any]:
        raise OSError("connection refused")
        yield  # pragma: no cover

    consumer = AsyncConsumer(
        AsyncIdempotency(async_sqlite_store, Policy(ttl=TTL, clock=clock)),
        name=NAME,
        horizon=HORIZON,
        connection=down,
    )
    runs: list[str] = []

    async def handle(delivery: Delivery[Any]) -> None:
        runs.append(delivery.key)

    outcome = await consumer.process(None, envelope(new_key()), handle)
    assert (outcome.reason, outcome.action, outcome.delay) == (
        Reason.UNAVAILABLE,
        Action.REQUEUE,
        1.0,
    )
    assert runs == []


# -- the transactional inbox on a real database --------------------------------------------


def pg_connection(url: str) -> Callable[[], Any]:
    """A factory of async connections, one per message."""

    @asynccontextmanager
    async def connect() -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        conn = await psycopg.AsyncConnection.connect(url)
        try:
            yield conn
        finally:
            await conn.close()

    return connect


@pytest.fixture
def inbox(database: Database) -> Database:
    """A database (SQLite, PostgreSQL) with a business table with no unique key."""
    database.create_business_table("event_id TEXT NOT NULL, amount INTEGER")
    return database


@contextmanager
def sync_inbox_consumer(db: Database, clock: FakeClock, **options: Any) -> Iterator[Consumer]:
    store = db.store()

    @contextmanager
    def connect() -> Iterator[Any]:
        conn = db.connect(store)
        try:
            yield conn
        finally:
            conn.close()

    policy = Policy(ttl=TTL, clock=clock, fail_on=(InvalidOrderError,))
    try:
        yield Consumer(
            Idempotency(store, policy), name=NAME, horizon=HORIZON, connection=connect, **options
        )
    finally:
        store.close()


def test_inbox_commits_the_effect_with_the_record_or_not_at_all(
    inbox: Database, clock: FakeClock
) -> None:
    """In transactional mode the handler's row commits with the record: a transient failure
    after the write leaves neither; the redelivery writes it once; a deterministic failure
    rolls its write back and records FAILED."""
    db = inbox
    insert = db.sql(f"INSERT INTO {db.business_table} VALUES (?, ?)")
    failures = iter([ConnectionError("broker hiccup"), None])

    def handle(delivery: Delivery[Any]) -> int:
        delivery.conn.execute(insert, (delivery.key, 5))
        failure = next(failures)
        if failure is not None:
            raise failure
        return 5

    def invalid(delivery: Delivery[Any]) -> None:
        delivery.conn.execute(insert, (delivery.key, -1))
        raise InvalidOrderError("negative amount")

    key, bad = new_key(), new_key()
    rows = f"SELECT event_id, amount FROM {db.business_table} ORDER BY amount"
    with sync_inbox_consumer(db, clock) as consumer:
        assert consumer.process(None, envelope(key), handle).reason is Reason.TRANSIENT
        assert db.select(rows) == []
        assert db.select(f"SELECT * FROM {db.records_table}") == []
        assert consumer.process(None, envelope(key), handle).reason is Reason.EXECUTED
        assert consumer.process(None, envelope(key), handle).reason is Reason.DUPLICATE
        failed = consumer.process(None, envelope(bad), invalid)
        assert (failed.reason, failed.action) == (Reason.FAILED, Action.ACK)
    assert db.select(rows) == [(key, 5)]
    states = db.select(f"SELECT idem_key, state FROM {db.records_table} ORDER BY state")
    assert states == [(key, "completed"), (bad, "failed")]


@pytest.mark.postgres
def test_sync_consumers_racing_in_threads_have_one_effect(
    postgres_database: Database, clock: FakeClock
) -> None:
    """Sixteen threads handle copies of each of 20 messages at once, on their own
    connections: each message's row is written exactly once; every other copy is a
    duplicate or requeued as in progress, never an error."""
    db = postgres_database
    db.create_business_table("event_id TEXT NOT NULL, amount INTEGER")
    insert = db.sql(f"INSERT INTO {db.business_table} VALUES (?, ?)")
    keys = [new_key() for _ in range(20)]
    threads = 16
    barrier = threading.Barrier(threads, timeout=60)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def handle(delivery: Delivery[Any]) -> None:
        delivery.conn.execute(insert, (delivery.key, 1))

    with sync_inbox_consumer(db, clock) as consumer:

        def worker() -> None:
            mine = []
            for key in keys:
                barrier.wait()
                mine.append(consumer.process(None, envelope(key), handle))
            with lock:
                outcomes.extend(mine)

        pool = [threading.Thread(target=worker) for _ in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join(timeout=120)
    assert len(outcomes) == threads * len(keys)
    assert Counter(o.reason for o in outcomes)[Reason.EXECUTED] == len(keys)
    assert {o.reason for o in outcomes} <= {Reason.EXECUTED, Reason.DUPLICATE, Reason.IN_PROGRESS}
    rows = db.select(f"SELECT event_id FROM {db.business_table}")
    assert sorted(row[0] for row in rows) == sorted(keys)


@pytest.mark.anyio
@pytest.mark.postgres
async def test_async_consumers_racing_in_tasks_have_one_effect(
    postgres_database: Database, clock: FakeClock
) -> None:
    """Twelve tasks handle copies of one message at once in transactional mode, each on its
    own connection: one row, one EXECUTED, the rest duplicates or in progress."""
    db = postgres_database
    db.create_business_table("event_id TEXT NOT NULL, amount INTEGER")
    store = db.async_store(pool_size=12)
    try:
        consumer = AsyncConsumer(
            AsyncIdempotency(store, Policy(ttl=TTL, clock=clock)),
            name=NAME,
            horizon=HORIZON,
            connection=pg_connection(db.location),
        )
        key = new_key()
        start = asyncio.Event()

        async def handle(delivery: Delivery[Any]) -> None:
            await delivery.conn.execute(
                f"INSERT INTO {db.business_table} VALUES (%s, %s)", (delivery.key, 1)
            )

        async def copy() -> Outcome:
            await start.wait()
            return await consumer.process(None, envelope(key), handle)

        tasks = [asyncio.create_task(copy()) for _ in range(12)]
        await asyncio.sleep(0)
        start.set()
        outcomes = await asyncio.gather(*tasks)
    finally:
        await store.aclose()
    reasons = Counter(o.reason for o in outcomes)
    assert reasons[Reason.EXECUTED] == 1
    assert set(reasons) <= {Reason.EXECUTED, Reason.DUPLICATE, Reason.IN_PROGRESS}
    assert db.select(f"SELECT event_id FROM {db.business_table}") == [(key,)]


# -- saga steps ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_saga_steps_run_once_across_redeliveries(async_store: Any, clock: FakeClock) -> None:
    """A saga handler whose second step fails transiently is redelivered: the first step
    replays its stored result, the second runs again and completes, and a later copy of the
    message runs nothing. Step records are keyed saga_id:step."""
    idem = AsyncIdempotency(async_store, Policy(ttl=TTL, clock=clock))
    consumer = AsyncConsumer(idem, name="orders.placed", horizon=HORIZON)
    calls: list[str] = []
    charge_failures = [ConnectionError("PSP down")]

    async def reserve(order: dict[str, Any]) -> dict[str, str]:
        calls.append("reserve")
        return {"reservation": f"r-{order['id']}"}

    async def charge(order: dict[str, Any]) -> str:
        calls.append("charge")
        if charge_failures:
            raise charge_failures.pop()
        return f"c-{order['id']}"

    async def fulfil(delivery: Delivery[Any]) -> list[Any]:
        order = {"id": delivery.key}
        saga = AsyncSaga(idem, delivery.key, name="fulfilment")
        reserved = await saga.step("reserve-stock", reserve, order)
        charged = await saga.step("charge", charge, order)
        return [reserved, charged]

    key = new_key()
    assert (await consumer.process(None, envelope(key), fulfil)).reason is Reason.TRANSIENT
    done = await consumer.process(None, envelope(key), fulfil)
    assert done.reason is Reason.EXECUTED
    assert done.result == [{"reservation": f"r-{key}"}, f"c-{key}"]
    assert (await consumer.process(None, envelope(key), fulfil)).reason is Reason.DUPLICATE
    assert calls == ["reserve", "charge", "charge"]
    step = await async_store.get(Scope.of(step_key(key, "reserve-stock"), operation="fulfilment"))
    assert step.status is Status.COMPLETED


def test_saga_step_called_with_other_data_fails_the_message_deterministically(
    clock: FakeClock,
) -> None:
    """A saga step replayed with different data is a bug, not bad luck: the handler's
    FingerprintMismatchError is recorded as a deterministic failure instead of looping."""
    idem = Idempotency(MemoryStore(), Policy(ttl=TTL, clock=clock))
    consumer = Consumer(idem, name="orders.placed", horizon=HORIZON, on_failure="dead_letter")
    saga = Saga(idem, "saga-1", name="fulfilment")
    saga.step("reserve-stock", lambda order: "r-1", {"qty": 1})

    def handle(delivery: Delivery[Any]) -> Any:
        return saga.step("reserve-stock", lambda order: "r-2", {"qty": 2})

    outcome = consumer.process(None, envelope(new_key()), handle)
    assert (outcome.reason, outcome.action) == (Reason.FAILED, Action.DEAD_LETTER)
    assert isinstance(outcome.error, FingerprintMismatchError)


def test_saga_results_replay_as_the_steps_return_type(clock: FakeClock) -> None:
    """A step annotated to return a dataclass replays a dataclass, not a dict."""
    saga = Saga(Idempotency(MemoryStore(), Policy(clock=clock)), "saga-2")
    made = Reservation("r-9", datetime(2026, 1, 1, tzinfo=UTC))

    def reserve(order: dict[str, int]) -> Reservation:
        return made

    assert saga.step("reserve", reserve, {"qty": 1}) == made
    replayed = saga.step("reserve", reserve, {"qty": 1})
    assert replayed == made
    assert isinstance(replayed, Reservation)
