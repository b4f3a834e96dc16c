"""RabbitMQ through aio-pika, against the real broker and a real PostgreSQL.

Every test declares its own uniquely named queues (each with a dead-letter queue) and deletes
them afterwards. The handler's business effect is a row in a PostgreSQL table with no unique
key, written on the message's connection in the same transaction as the record: a second
execution would show as a second row. Consumers run in this process, and in spawned
processes where a consumer must really race another or really die (SIGKILL) mid-handler.
Nothing sleeps and hopes: the tests wait on messages from the children and poll conditions
to a deadline.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import aio_pika
import aiormq
import pytest
from aio_pika.abc import AbstractIncomingMessage, AbstractQueue
from psycopg_pool import AsyncConnectionPool

from children import Children
from helpers import Database
from idempo import AsyncIdempotency, ConfigurationError, InvalidKeyError, Policy, Scope
from idempo.consumer import AsyncConsumer, Delivery, Outcome, Reason
from idempo.contrib import aio_pika as contrib
from idempo.contrib.aio_pika import consume, publish
from idempo.policy import utcnow
from idempo.stores.postgres import AsyncPostgresStore
from idempo.testing import FakeClock

AMQP_URL = os.environ.get("IDEMPO_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REQUIRE_ALL = os.environ.get("IDEMPO_TEST_REQUIRE_ALL") == "1"
NAME = "billing.charge"
TTL = timedelta(days=7)
DEADLINE = 60.0  # seconds any one wait may take before the test fails
BUSINESS = "event_id TEXT NOT NULL, body TEXT NOT NULL, token INTEGER, worker TEXT"

pytestmark = [pytest.mark.anyio, pytest.mark.rabbitmq, pytest.mark.postgres]


async def _reachable() -> str | None:
    try:
        connection = await aio_pika.connect(AMQP_URL, timeout=5)
    except (TimeoutError, OSError, aio_pika.exceptions.AMQPError) as exc:
        return repr(exc)
    await connection.close()
    return None


@pytest.fixture(scope="session")
def amqp_url() -> str:
    """The broker's URL, after checking it answers (fail in CI, skip locally)."""
    problem = asyncio.run(_reachable())
    if problem:
        message = f"RabbitMQ at {AMQP_URL} is unreachable: {problem}"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    return AMQP_URL


async def wait_for(condition: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``condition`` until it holds, failing after DEADLINE seconds."""
    deadline = time.monotonic() + DEADLINE
    while not await condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@dataclass
class Rabbit:
    """One test's connection to the broker and the queues it declared."""

    connection: aio_pika.abc.AbstractConnection
    channel: aio_pika.abc.AbstractChannel
    prefix: str
    declared: list[str] = field(default_factory=list)

    async def queue(self, name: str = "events") -> AbstractQueue:
        """A durable queue whose refused messages go to ``<queue>.dlq``."""
        full = f"{self.prefix}.{name}"
        await self.channel.declare_queue(f"{full}.dlq", durable=True)
        self.declared.append(f"{full}.dlq")
        arguments = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": f"{full}.dlq"}
        declared = await self.channel.declare_queue(full, durable=True, arguments=arguments)
        self.declared.append(full)
        return declared

    async def ready(self, name: str) -> int:
        """How many messages wait in the queue (delivered but unacked ones not counted)."""
        found = await self.channel.declare_queue(name, passive=True)
        count = found.declaration_result.message_count
        assert count is not None
        return count

    async def publish(self, queue: str, body: bytes, message_id: str, **options: Any) -> None:
        await publish(
            self.channel.default_exchange,
            body,
            routing_key=queue,
            message_id=message_id,
            **options,
        )

    async def drain(self, name: str) -> list[AbstractIncomingMessage]:
        """Take (and ack) every message waiting in a queue."""
        found = await self.channel.declare_queue(name, passive=True)
        taken = []
        while (message := await found.get(fail=False)) is not None:
            await message.ack()
            taken.append(message)
        return taken


@pytest.fixture
async def rabbit(amqp_url: str) -> AsyncIterator[Rabbit]:
    """A connection and channel (prefetch 10); the test's queues are deleted afterwards."""
    # Not a robust connection: its channel answers a passive declare from a cache, and the
    # tests read queue depths that way.
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=10)
    broker = Rabbit(connection, channel, f"idempo-test-{secrets.token_hex(6)}")
    try:
        yield broker
    finally:
        cleanup = await connection.channel()
        for name in broker.declared:
            await cleanup.queue_delete(name)
        await connection.close()


@dataclass
class Inbox:
    """The test's PostgreSQL schema: records, the business table, and a connection pool for
    the handlers' transactions."""

    db: Database
    store: AsyncPostgresStore
    pool: AsyncConnectionPool[Any]

    def consumer(
        self, *, clock: FakeClock | None = None, lease: float = 30, **options: Any
    ) -> AsyncConsumer:
        policy = Policy(ttl=TTL, lease=timedelta(seconds=lease), clock=clock or utcnow)
        options.setdefault("horizon", TTL)
        options.setdefault("retry_delay", 0.05)
        return AsyncConsumer(
            AsyncIdempotency(self.store, policy),
            name=NAME,
            connection=self.pool.connection,
            **options,
        )

    async def write(self, delivery: Delivery[AbstractIncomingMessage]) -> str:
        """The business effect: one row, on the message's connection (no unique key)."""
        await delivery.conn.execute(
            f"INSERT INTO {self.db.business_table} VALUES (%s, %s, %s, %s)",
            (delivery.key, delivery.envelope.body.decode(), delivery.attempt.token, "parent"),
        )
        return delivery.key

    def rows(self) -> Counter[str]:
        """How many business rows each event id has."""
        found = self.db.select(f"SELECT event_id FROM {self.db.business_table}")
        return Counter(row[0] for row in found)

    def states(self) -> dict[str, str]:
        found = self.db.select(f"SELECT idem_key, state FROM {self.db.records_table}")
        return dict(found)


@pytest.fixture
async def inbox(postgres_database: Database) -> AsyncIterator[Inbox]:
    db = postgres_database
    db.create_business_table(BUSINESS)
    store = AsyncPostgresStore(db.location, table=db.records_table, max_size=4)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        db.location, min_size=1, max_size=12, open=False
    )
    await pool.open()
    try:
        yield Inbox(db, store, pool)
    finally:
        await pool.close()
        await store.aclose()


def events(count: int) -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"evt-{run}-{index:03d}" for index in range(count)]


def body_of(event: str) -> bytes:
    return f'{{"event": "{event}", "amount": 5}}'.encode()


@asynccontextmanager
async def running(
    queue: AbstractQueue,
    handler: Callable[[Delivery[AbstractIncomingMessage]], Awaitable[Any]],
    consumer: AsyncConsumer,
) -> AsyncIterator[None]:
    async with consume(queue, handler, consumer):
        yield


def settled(consumer: AsyncConsumer) -> int:
    """Deliveries this consumer acked or dead-lettered (requeues come back)."""
    requeued = (Reason.IN_PROGRESS, Reason.TRANSIENT, Reason.UNAVAILABLE, Reason.FENCED)
    return sum(n for reason, n in consumer.counts.items() if reason not in requeued)


# -- in one process ------------------------------------------------------------------------


async def test_each_event_published_several_times_has_one_effect(
    rabbit: Rabbit, inbox: Inbox
) -> None:
    """Thirty events, each published three times (copies side by side, so they are handled
    concurrently), give exactly one row each; every copy is acked, none is left over."""
    queue = await rabbit.queue()
    consumer = inbox.consumer()
    ids = events(30)
    for event in ids:
        for _ in range(3):
            await rabbit.publish(queue.name, body_of(event), event)
    async with running(queue, inbox.write, consumer):

        async def all_settled() -> bool:
            return settled(consumer) == 90

        await wait_for(all_settled, "90 settled deliveries")
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))
    assert consumer.counts[Reason.EXECUTED] == 30
    assert consumer.counts[Reason.DUPLICATE] == 60
    assert set(inbox.states().values()) == {"completed"}
    assert await rabbit.ready(queue.name) == 0
    assert await rabbit.ready(f"{queue.name}.dlq") == 0


async def test_transient_failure_is_redelivered_and_executed_once(
    rabbit: Rabbit, inbox: Inbox
) -> None:
    """A handler that fails after writing its row, on the first delivery of each event, has
    that write rolled back; RabbitMQ redelivers the nacked message and it runs once."""
    queue = await rabbit.queue()
    consumer = inbox.consumer()
    ids = events(10)
    deliveries: Counter[str] = Counter()
    redelivered: list[bool] = []

    async def flaky(delivery: Delivery[AbstractIncomingMessage]) -> str:
        await inbox.write(delivery)
        deliveries[delivery.key] += 1
        redelivered.append(delivery.message.redelivered or False)
        if deliveries[delivery.key] == 1:
            raise ConnectionError("the PSP timed out")
        return "ok"

    for event in ids:
        await rabbit.publish(queue.name, body_of(event), event)
    async with running(queue, flaky, consumer):

        async def all_executed() -> bool:
            return consumer.counts[Reason.EXECUTED] == 10

        await wait_for(all_executed, "every event executed")
    assert consumer.counts[Reason.TRANSIENT] == 10
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))
    assert redelivered.count(True) == 10
    assert await rabbit.ready(queue.name) == 0


async def test_deterministic_failure_is_recorded_acked_and_replayed_as_a_skip(
    rabbit: Rabbit, inbox: Inbox
) -> None:
    """A deterministic failure is recorded FAILED and acked (not redelivered, not
    dead-lettered); a later copy is acked as a duplicate without running the handler. With
    on_failure="dead_letter" it goes to the dead-letter queue instead."""
    queue = await rabbit.queue()
    runs: list[str] = []

    async def reject(delivery: Delivery[AbstractIncomingMessage]) -> None:
        await inbox.write(delivery)
        runs.append(delivery.key)
        raise ValueError("unknown currency")

    acking = inbox.consumer(fail_on=(ValueError,))
    [acked, dead] = events(2)
    async with running(queue, reject, acking):
        await rabbit.publish(queue.name, body_of(acked), acked)

        async def failed() -> bool:
            return acking.counts[Reason.FAILED] == 1

        await wait_for(failed, "the failure")
        await rabbit.publish(queue.name, body_of(acked), acked)

        async def skipped() -> bool:
            return acking.counts[Reason.DUPLICATE] == 1

        await wait_for(skipped, "the duplicate")
    assert runs == [acked]
    assert inbox.states() == {acked: "failed"}
    assert inbox.rows() == Counter()
    assert await rabbit.ready(f"{queue.name}.dlq") == 0

    dead_lettering = inbox.consumer(fail_on=(ValueError,), on_failure="dead_letter")
    async with running(queue, reject, dead_lettering):
        await rabbit.publish(queue.name, body_of(dead), dead)

        async def in_dlq() -> bool:
            return await rabbit.ready(f"{queue.name}.dlq") == 1

        await wait_for(in_dlq, "the dead-lettered failure")
    [quarantined] = await rabbit.drain(f"{queue.name}.dlq")
    assert quarantined.message_id == dead
    assert inbox.states()[dead] == "failed"


async def test_message_without_id_is_dead_lettered(
    rabbit: Rabbit, inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A message published with no message_id (as other AMQP clients do by default) goes to
    the dead-letter queue untouched, and nothing runs or is stored."""
    queue = await rabbit.queue()
    consumer = inbox.consumer()
    # aiormq gives every message it publishes a random id; other clients send none.
    monkeypatch.setattr(aiormq.channel, "UUID", lambda **_: SimpleNamespace(hex=None))
    await rabbit.channel.default_exchange.publish(
        aio_pika.Message(b'{"amount": 5}'), routing_key=queue.name
    )
    monkeypatch.undo()
    async with running(queue, inbox.write, consumer):

        async def in_dlq() -> bool:
            return await rabbit.ready(f"{queue.name}.dlq") == 1

        await wait_for(in_dlq, "the unkeyed message in the dead-letter queue")
    assert consumer.counts == Counter({Reason.NO_KEY: 1})
    [refused] = await rabbit.drain(f"{queue.name}.dlq")
    assert (refused.message_id, refused.body) == (None, b'{"amount": 5}')
    assert inbox.rows() == Counter()
    assert inbox.states() == {}


async def test_reused_id_with_another_body_is_dead_lettered_not_executed(
    rabbit: Rabbit, inbox: Inbox
) -> None:
    """A second message with a handled id but another body is dead-lettered; its body never
    reaches the handler and the first body's row is the only one."""
    queue = await rabbit.queue()
    consumer = inbox.consumer()
    [event] = events(1)
    async with running(queue, inbox.write, consumer):
        await rabbit.publish(queue.name, b"first", event)

        async def done() -> bool:
            return consumer.counts[Reason.EXECUTED] == 1

        await wait_for(done, "the first message")
        await rabbit.publish(queue.name, b"second", event)

        async def refused() -> bool:
            return await rabbit.ready(f"{queue.name}.dlq") == 1

        await wait_for(refused, "the mismatched message in the dead-letter queue")
    assert consumer.counts[Reason.MISMATCH] == 1
    assert inbox.db.select(f"SELECT body FROM {inbox.db.business_table}") == [("first",)]
    [mismatched] = await rabbit.drain(f"{queue.name}.dlq")
    assert (mismatched.message_id, mismatched.body) == (event, b"second")


# -- dead-letter redrive and the horizon guard ----------------------------------------------


async def redrive(rabbit: Rabbit, dlq: str, target: str) -> int:
    """Move every message of a dead-letter queue back to its queue, as an operator's redrive
    does: same id, timestamp and body."""
    moved = 0
    for message in await rabbit.drain(dlq):
        assert message.message_id is not None
        await rabbit.publish(target, message.body, message.message_id, timestamp=message.timestamp)
        moved += 1
    return moved


async def test_dead_letter_redrive_days_later_gives_no_second_effect(
    rabbit: Rabbit, inbox: Inbox, clock: FakeClock
) -> None:
    """Copies of handled events that were dead-lettered (they expired in the queue), and
    events that never ran, are redriven three days later: the handled ones are acked as
    duplicates, the others run once; every event has exactly one row."""
    queue = await rabbit.queue()
    dlq = f"{queue.name}.dlq"
    consumer = inbox.consumer(clock=clock)
    handled, never_ran = events(12), events(4)
    for event in handled:
        await rabbit.publish(queue.name, body_of(event), event, timestamp=clock())
    async with running(queue, inbox.write, consumer):

        async def first_pass() -> bool:
            return consumer.counts[Reason.EXECUTED] == 12

        await wait_for(first_pass, "the first pass")
    # Copies (a producer's retries) and unhandled events die in the queue while no consumer
    # runs: per-message TTL, so RabbitMQ dead-letters them itself.
    for event in handled + never_ran:
        await rabbit.publish(
            queue.name,
            body_of(event),
            event,
            timestamp=clock(),
            expiration=timedelta(milliseconds=1),
        )

    async def dead_lettered() -> bool:
        return await rabbit.ready(dlq) == 16

    await wait_for(dead_lettered, "16 dead-lettered messages")

    clock.advance(timedelta(days=3))
    assert await redrive(rabbit, dlq, queue.name) == 16
    async with running(queue, inbox.write, consumer):

        async def second_pass() -> bool:
            return settled(consumer) == 12 + 16

        await wait_for(second_pass, "the redrive")
    assert consumer.counts[Reason.DUPLICATE] == 12
    assert consumer.counts[Reason.EXECUTED] == 16
    assert inbox.rows() == Counter(dict.fromkeys(handled + never_ran, 1))
    assert await rabbit.ready(queue.name) == 0
    assert await rabbit.ready(dlq) == 0


async def test_horizon_guard_quarantines_old_messages_and_refuses_short_retention(
    rabbit: Rabbit, inbox: Inbox, clock: FakeClock
) -> None:
    """A retention shorter than the horizon refuses to start. A message older than the
    retention is dead-lettered, not executed: even a redrive of a handled event whose record
    has expired, which would otherwise run a second time."""
    with pytest.raises(ConfigurationError, match="redelivery horizon"):
        inbox.consumer(horizon=timedelta(days=30))
    queue = await rabbit.queue()
    dlq = f"{queue.name}.dlq"
    consumer = inbox.consumer(clock=clock)
    handled, stale = events(3), events(2)
    published = clock()
    for event in handled:
        await rabbit.publish(queue.name, body_of(event), event, timestamp=published)
    async with running(queue, inbox.write, consumer):

        async def handled_once() -> bool:
            return consumer.counts[Reason.EXECUTED] == 3

        await wait_for(handled_once, "the first pass")
        clock.advance(timedelta(days=10))  # past the ttl: those records have expired
        for event in handled:  # an operator redrives ten-day-old copies
            await rabbit.publish(queue.name, body_of(event), event, timestamp=published)
        for event in stale:  # and two events published long ago reach us only now
            await rabbit.publish(
                queue.name, body_of(event), event, timestamp=clock() - timedelta(days=8)
            )

        async def quarantined() -> bool:
            return await rabbit.ready(dlq) == 5

        await wait_for(quarantined, "five quarantined messages")
    assert consumer.counts[Reason.EXPIRED] == 5
    assert consumer.counts[Reason.EXECUTED] == 3
    assert inbox.rows() == Counter(dict.fromkeys(handled, 1))
    assert sorted(m.message_id or "" for m in await rabbit.drain(dlq)) == sorted(handled + stale)
    record = await inbox.store.get(Scope.of(handled[0], operation=NAME))
    assert record is not None
    assert record.expires_at < clock()  # the record alone could no longer have told


async def test_publish_sets_the_event_id_and_timestamp(rabbit: Rabbit) -> None:
    """The publish helper sends the given id and an aware timestamp, persistently, and
    refuses an id that could not be a key before anything is sent."""
    queue = await rabbit.queue()
    before = utcnow().replace(microsecond=0)
    await rabbit.publish(queue.name, b"x", "evt-1", headers={"tenant": "a"})
    with pytest.raises(InvalidKeyError):
        await rabbit.publish(queue.name, b"y", "not a key")
    [message] = await rabbit.drain(queue.name)
    assert message.message_id == "evt-1"
    assert message.timestamp is not None
    assert message.timestamp >= before
    assert message.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert message.headers == {"tenant": "a"}


# -- consumers in other processes ----------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    """What a spawned consumer process needs, as plain data."""

    worker: str
    amqp_url: str
    queue: str
    database: Database
    mode: str = "transactional"
    lease: float = 30.0
    prefetch: int = 8
    crash_key: str | None = None
    crash_at: str = "handler"  # "handler": mid-handler; "ack": committed, not yet acked


def child_main(spec: ChildSpec, said: Any, stop: Any) -> None:
    """A consumer process: consume until ``stop`` is set, reporting every settled outcome."""
    asyncio.run(_child(spec, said, stop))


async def _child(spec: ChildSpec, said: Any, stop: Any) -> None:
    db = spec.database
    connection = await aio_pika.connect(spec.amqp_url)
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=spec.prefetch)
    queue = await channel.declare_queue(spec.queue, passive=True)
    store = AsyncPostgresStore(db.location, table=db.records_table, max_size=2)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        db.location, min_size=1, max_size=spec.prefetch, open=False
    )
    await pool.open()
    policy = Policy(ttl=TTL, lease=timedelta(seconds=spec.lease))
    consumer = AsyncConsumer(
        AsyncIdempotency(store, policy),
        name=NAME,
        horizon=TTL,
        connection=pool.connection,
        mode=spec.mode,  # type: ignore[arg-type]
        retry_delay=0.05,
    )
    forever = asyncio.Event()

    async def handle(delivery: Delivery[AbstractIncomingMessage]) -> None:
        await delivery.conn.execute(
            f"INSERT INTO {db.business_table} VALUES (%s, %s, %s, %s)",
            (delivery.key, delivery.envelope.body.decode(), delivery.attempt.token, spec.worker),
        )
        if delivery.key == spec.crash_key and spec.crash_at == "handler":
            said.put({"worker": spec.worker, "state": "mid-work", "key": delivery.key})
            await forever.wait()  # SIGKILLed here, the row written but not committed

    settle = contrib.settle

    async def reporting(message: AbstractIncomingMessage, outcome: Outcome) -> None:
        if outcome.key == spec.crash_key and spec.crash_at == "ack":
            said.put({"worker": spec.worker, "state": "mid-work", "key": outcome.key})
            await forever.wait()  # SIGKILLed here: committed, never acked
        await settle(message, outcome)
        said.put({"worker": spec.worker, "reason": outcome.reason.value, "key": outcome.key})

    contrib.settle = reporting  # type: ignore[assignment] # the child's own copy of the module
    async with consume(queue, handle, consumer):
        said.put({"worker": spec.worker, "state": "ready"})
        await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    await pool.close()
    await store.aclose()
    await connection.close()


@pytest.fixture
def children() -> Iterator[Children]:
    spawned = Children(child_main)
    try:
        yield spawned
    finally:
        spawned.close()


@pytest.mark.slow
async def test_two_consumer_processes_on_one_queue_have_one_effect_per_event(
    rabbit: Rabbit, inbox: Inbox, children: Children
) -> None:
    """Two consumer processes share a queue that holds each of 40 events three times, copies
    side by side, so RabbitMQ's round robin hands copies of one event to both at once: every
    event has exactly one row, and every copy is acked."""
    queue = await rabbit.queue()
    for worker in ("a", "b"):
        children.start(worker, ChildSpec(worker, AMQP_URL, queue.name, inbox.db))
    for _ in range(2):
        await children.until("ready")
    ids = events(40)
    for event in ids:
        for _ in range(3):
            await rabbit.publish(queue.name, body_of(event), event)
    outcomes: list[dict[str, Any]] = []
    acked = 0
    while acked < 120:
        message = await asyncio.to_thread(children.message)
        outcomes.append(message)
        acked += message["reason"] in ("executed", "duplicate")
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))
    executed = Counter(o["worker"] for o in outcomes if o["reason"] == "executed")
    assert sum(executed.values()) == 40
    assert {o["worker"] for o in outcomes} == {"a", "b"}  # both really consumed
    assert {o["reason"] for o in outcomes} <= {"executed", "duplicate", "in_progress"}
    assert await rabbit.ready(queue.name) == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "crash_at"),
    [
        pytest.param("transactional", "handler", id="transactional-mid-handler"),
        pytest.param("leased", "handler", id="leased-mid-handler"),
        pytest.param("transactional", "ack", id="committed-not-acked"),
    ],
)
async def test_consumer_killed_mid_message_loses_nothing_and_does_nothing_twice(
    rabbit: Rabbit, inbox: Inbox, children: Children, mode: str, crash_at: str
) -> None:
    """A consumer process SIGKILLed in the middle of a message (inside its handler, or after
    its commit but before its ack) has its unacked messages redelivered by RabbitMQ; a fresh
    consumer finishes them: every event has exactly one row, nothing is left in the queue."""
    queue = await rabbit.queue()
    ids = events(20)
    victim = ids[5]
    children.start(
        "doomed",
        ChildSpec(
            "doomed",
            AMQP_URL,
            queue.name,
            inbox.db,
            mode=mode,
            lease=1.0,
            prefetch=4,
            crash_key=victim,
            crash_at=crash_at,
        ),
    )
    await children.until("ready")
    for event in ids:
        await rabbit.publish(queue.name, body_of(event), event)
    assert (await children.until("mid-work"))["key"] == victim
    children.kill("doomed")
    committed = crash_at == "ack"
    # Mid-handler the victim's row died with its transaction; after the commit it stays.
    await wait_for(
        lambda: _true(inbox.rows()[victim] == (1 if committed else 0)), "the dead backend"
    )

    consumer = inbox.consumer(mode=mode, lease=1.0)
    async with running(queue, inbox.write, consumer):

        async def finished() -> bool:
            return set(inbox.rows()) == set(ids) and await rabbit.ready(queue.name) == 0

        await wait_for(finished, "every event handled")
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))
    assert set(inbox.states().values()) == {"completed"}
    assert await rabbit.ready(queue.name) == 0
    assert await rabbit.ready(f"{queue.name}.dlq") == 0
    if committed:
        assert consumer.counts[Reason.DUPLICATE] >= 1  # the victim's redelivery
    if mode == "leased":
        # The dead holder's lease had to run out before the victim could be taken over.
        token = inbox.db.select(
            f"SELECT token FROM {inbox.db.business_table} WHERE event_id = ?", (victim,)
        )
        # Tokens only grow: the taker's is above any the dead holder can have had, which
        # was the queue's first reservation of the victim (tokens of a fresh record start
        # at the store's counter or clock, so only "larger than a first one" is certain).
        assert token
        assert token[0][0] > 1


async def _true(value: bool) -> bool:
    return value
