"""The brokers behind the FastStream tests, and the consumer process they spawn.

A plain module, not a conftest: spawned consumer processes import it by name (pytest puts
tests/ on sys.path, and spawn hands sys.path on). Each harness makes its own uniquely named
queue, stream or topic and removes it afterwards:

* RabbitMQ (127.0.0.1:5672) and NATS JetStream (127.0.0.1:4222) and Redis (127.0.0.1:6379):
  the real servers.
* Kafka: FastStream's TestKafkaBroker, in memory. There is no Kafka broker on these machines,
  so what Kafka itself does with a commit or a seek is not exercised; the tests check that the
  middleware asks for the right one.

The business effect is a row in a PostgreSQL table with no unique key, written on the
delivery's connection in the transaction that records the message: a second execution would
show as a second row.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any
from unittest import mock

import aio_pika
import aiormq
import nats
import pytest
import redis.asyncio as aredis
from faststream import AckPolicy
from faststream.kafka import KafkaBroker, KafkaRouter, TestKafkaBroker
from faststream.nats import JStream, NatsBroker, NatsRouter, PullSub
from faststream.rabbit import RabbitBroker, RabbitQueue, RabbitRouter
from faststream.redis import RedisBroker, RedisRouter, StreamSub
from nats.js.api import AckPolicy as JsAckPolicy
from nats.js.api import ConsumerConfig, StreamConfig
from psycopg_pool import AsyncConnectionPool

from helpers import Database
from idempo import AsyncIdempotency, Policy
from idempo.consumer import AsyncConsumer, Reason, current_delivery
from idempo.contrib.faststream import IdempotencyMiddleware, publish
from idempo.policy import utcnow
from idempo.stores.postgres import AsyncPostgresStore
from idempo.testing import FakeClock

AMQP_URL = os.environ.get("IDEMPO_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
NATS_URL = os.environ.get("IDEMPO_TEST_NATS_URL", "nats://127.0.0.1:4222")
REDIS_URL = os.environ.get("IDEMPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/1")
REQUIRE_ALL = os.environ.get("IDEMPO_TEST_REQUIRE_ALL") == "1"
NAME = "billing.charge"
TTL = timedelta(days=7)
DEADLINE = 8.0  # seconds any one wait may take before the test fails
BUSINESS = "event_id TEXT NOT NULL, body TEXT NOT NULL, worker TEXT NOT NULL"
REQUEUED = (Reason.IN_PROGRESS, Reason.TRANSIENT, Reason.UNAVAILABLE, Reason.FENCED)

Handler = Callable[..., Awaitable[Any]]


def unavailable(message: str) -> None:
    """Fail in CI (IDEMPO_TEST_REQUIRE_ALL=1), skip locally."""
    if REQUIRE_ALL:
        pytest.fail(message)
    pytest.skip(message)


async def wait_for(condition: Callable[[], Any], what: str, deadline: float = DEADLINE) -> None:
    """Poll ``condition`` (sync or async) until it holds, failing after ``deadline`` seconds."""
    ends = time.monotonic() + deadline
    while True:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return
        assert time.monotonic() < ends, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def events(count: int) -> list[str]:
    run = uuid.uuid4().hex[:8]
    return [f"evt-{run}-{index:03d}" for index in range(count)]


def body_of(event: str) -> bytes:
    return f'{{"event": "{event}", "amount": 5}}'.encode()


def settled(consumer: AsyncConsumer) -> int:
    """Deliveries the consumer acked or dead-lettered (requeued ones come back)."""
    return sum(n for reason, n in consumer.counts.items() if reason not in REQUEUED)


# -- the app's database -------------------------------------------------------------------


@dataclass
class Inbox:
    """The test's PostgreSQL schema: the records, the business table, and a connection pool
    for the handlers' transactions."""

    db: Database
    store: AsyncPostgresStore
    pool: AsyncConnectionPool[Any]

    def consumer(
        self,
        *,
        clock: FakeClock | None = None,
        lease: float = 30,
        lock_timeout: float = 5,
        **options: Any,
    ) -> AsyncConsumer:
        policy = Policy(
            ttl=TTL,
            lease=timedelta(seconds=lease),
            lock_timeout=timedelta(seconds=lock_timeout),
            clock=clock or utcnow,
        )
        options.setdefault("horizon", TTL)
        options.setdefault("retry_delay", 0.05)
        options.setdefault("name", NAME)
        return AsyncConsumer(
            AsyncIdempotency(self.store, policy), connection=self.pool.connection, **options
        )

    def rows(self) -> Counter[str]:
        """How many business rows each event id has."""
        found = self.db.select(f"SELECT event_id FROM {self.db.business_table}")
        return Counter(row[0] for row in found)

    def workers(self) -> Counter[str]:
        """How many rows each worker wrote."""
        found = self.db.select(f"SELECT worker FROM {self.db.business_table}")
        return Counter(row[0] for row in found)

    def states(self) -> dict[str, str]:
        found = self.db.select(f"SELECT idem_key, state FROM {self.db.records_table}")
        return dict(found)


@asynccontextmanager
async def open_inbox(db: Database, *, pool_size: int = 12) -> AsyncIterator[Inbox]:
    store = AsyncPostgresStore(db.location, table=db.records_table, max_size=2)
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        db.location, min_size=1, max_size=pool_size, open=False
    )
    await pool.open()
    try:
        yield Inbox(db, store, pool)
    finally:
        await pool.close()
        await store.aclose()


async def write_row(db: Database, worker: str) -> str:
    """The business effect: one row, on the delivery's connection (no unique key)."""
    delivery = current_delivery()
    assert delivery is not None, "the handler runs inside the middleware"
    await delivery.conn.execute(
        f"INSERT INTO {db.business_table} VALUES (%s, %s, %s)",
        (delivery.key, delivery.envelope.body.decode(), worker),
    )
    return delivery.key


def row_writer(db: Database, worker: str = "parent") -> Handler:
    """A FastStream handler whose effect is `write_row`."""

    async def handle(body: Any) -> None:
        await write_row(db, worker)

    return handle


def failing_writer(db: Database, fails: Callable[[str], bool]) -> Handler:
    """A handler that writes its row, then fails (transiently) where ``fails(key)`` says."""

    async def handle(body: Any) -> None:
        key = await write_row(db, "parent")
        if fails(key):
            raise ConnectionError("the PSP timed out")

    return handle


# -- the brokers --------------------------------------------------------------------------


class Harness:
    """One broker's destination for one test: publish to it, consume it through the
    middleware, and ask what is left on it."""

    kind = ""

    def __getstate__(self) -> dict[str, Any]:
        # A spawned child gets the names only; it opens connections of its own.
        live = ("connection", "channel", "client", "js", "producer", "broker_")
        return {name: value for name, value in vars(self).items() if name not in live}

    producer: Any = None

    def new_broker(self) -> Any:
        """A FastStream broker on this server (the harness publishes through one)."""
        return None

    async def open(self) -> None:
        """Start the producer, then make the destination."""
        self.producer = self.new_broker()
        if self.producer is not None:
            await self.producer.start()
        await self.declare()

    async def close(self) -> None:
        """Remove the destination, then stop the producer."""
        await self.remove()
        if self.producer is not None:
            await self.producer.stop()

    async def declare(self) -> None: ...

    async def remove(self) -> None: ...

    def running(
        self, middleware: IdempotencyMiddleware, handler: Handler, **options: Any
    ) -> AbstractAsyncContextManager[Any]:
        """Consume through ``middleware`` into ``handler`` while the block runs."""
        raise NotImplementedError

    async def publish(self, body: bytes, event_id: str, **options: Any) -> Any:
        """Publish with the idempo helper (the event id where this broker carries it)."""
        raise NotImplementedError

    async def publish_without_id(self, body: bytes) -> None:
        """Publish the way a producer that sets no event id does."""
        raise NotImplementedError

    async def between_copies(self) -> None:
        """Wait, if the broker would drop a same-id copy published right away."""

    async def leftover(self) -> int:
        """Messages neither acknowledged nor refused (the consumers must have stopped)."""
        return 0


@asynccontextmanager
async def _started(broker: Any) -> AsyncIterator[Any]:
    await broker.start()
    try:
        yield broker
    finally:
        await broker.stop()


@dataclass
class Rabbit(Harness):
    """A durable queue on the real RabbitMQ whose refused messages go to ``<queue>.dlq``."""

    kind = "rabbit"
    url: str = AMQP_URL
    queue: str = field(default_factory=lambda: f"idempo-test-{secrets.token_hex(6)}")
    connection: Any = None
    channel: Any = None

    @property
    def dlq(self) -> str:
        return f"{self.queue}.dlq"

    def new_broker(self) -> RabbitBroker:
        return RabbitBroker(self.url, logger=None)

    async def declare(self) -> None:
        self.connection = await aio_pika.connect(self.url)
        self.channel = await self.connection.channel()
        await self.channel.declare_queue(self.dlq, durable=True)
        arguments = {"x-dead-letter-exchange": "", "x-dead-letter-routing-key": self.dlq}
        await self.channel.declare_queue(self.queue, durable=True, arguments=arguments)

    async def remove(self) -> None:
        for name in (self.queue, self.dlq):
            await self.channel.queue_delete(name)
        await self.connection.close()

    def broker(self, middleware: IdempotencyMiddleware, handler: Handler) -> RabbitBroker:
        broker = self.new_broker()
        router = RabbitRouter(middlewares=[middleware])
        router.subscriber(RabbitQueue(self.queue, declare=False))(handler)
        broker.include_router(router)
        return broker

    def running(
        self, middleware: IdempotencyMiddleware, handler: Handler, **options: Any
    ) -> AbstractAsyncContextManager[Any]:
        return _started(self.broker(middleware, handler))

    async def publish(self, body: bytes, event_id: str, **options: Any) -> Any:
        return await publish(self.producer, body, self.queue, event_id=event_id, **options)

    async def publish_without_id(self, body: bytes) -> None:
        # aiormq (under aio-pika, under FastStream) invents an id for a message that has
        # none; other AMQP clients send none, so publish as they do.
        no_id = SimpleNamespace(hex=None)
        with mock.patch.object(aiormq.channel, "UUID", return_value=no_id):
            await self.channel.default_exchange.publish(
                aio_pika.Message(body), routing_key=self.queue
            )

    async def ready(self, name: str) -> int:
        found = await self.channel.declare_queue(name, passive=True)
        count: int = found.declaration_result.message_count
        return count

    async def leftover(self) -> int:
        return await self.ready(self.queue)

    async def drain(self, name: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
        """Take (and ack) every message waiting in a queue."""
        found = await self.channel.declare_queue(name, passive=True)
        taken = []
        while (message := await found.get(fail=False)) is not None:
            await message.ack()
            taken.append(message)
        return taken


@dataclass
class Nats(Harness):
    """A JetStream stream on the real NATS server with one durable pull consumer.

    The stream's publish-deduplication window is its shortest (100 ms) unless asked
    otherwise: the tests that publish copies on purpose must get them past JetStream's own
    first line to reach idempo's.
    """

    kind = "nats"
    url: str = NATS_URL
    stream: str = field(default_factory=lambda: f"idempo-test-{secrets.token_hex(6)}")
    durable: str = "billing"
    ack_wait: float = 1.0
    duplicate_window: float = 0.1
    max_age: timedelta = timedelta(days=1)
    client: Any = None
    js: Any = None

    @property
    def subject(self) -> str:
        return f"{self.stream}.events"

    def new_broker(self) -> NatsBroker:
        return NatsBroker(self.url, logger=None)

    async def declare(self) -> None:
        self.client = await nats.connect(self.url)
        self.js = self.client.jetstream()
        await self.js.add_stream(
            StreamConfig(
                name=self.stream,
                subjects=[f"{self.stream}.>"],
                duplicate_window=self.duplicate_window,
                max_age=self.max_age.total_seconds(),
            )
        )
        await self.js.add_consumer(
            self.stream,
            ConsumerConfig(
                durable_name=self.durable,
                ack_policy=JsAckPolicy.EXPLICIT,
                ack_wait=self.ack_wait,
                filter_subject=self.subject,
            ),
        )

    async def remove(self) -> None:
        await self.js.delete_stream(self.stream)
        await self.client.close()

    def broker(self, middleware: IdempotencyMiddleware, handler: Handler) -> NatsBroker:
        broker = self.new_broker()
        router = NatsRouter(middlewares=[middleware])
        router.subscriber(
            self.subject,
            stream=JStream(self.stream, declare=False),
            durable=self.durable,
            pull_sub=PullSub(batch_size=10, timeout=0.5),
        )(handler)
        broker.include_router(router)
        return broker

    def running(
        self, middleware: IdempotencyMiddleware, handler: Handler, **options: Any
    ) -> AbstractAsyncContextManager[Any]:
        return _started(self.broker(middleware, handler))

    async def publish(self, body: bytes, event_id: str, **options: Any) -> Any:
        """Publish, and (unless ``dedupe_ok``) check JetStream stored it, not dropped it."""
        dedupe_ok = options.pop("dedupe_ok", False)
        ack = await publish(
            self.producer, body, self.subject, event_id=event_id, stream=self.stream, **options
        )
        assert dedupe_ok or not ack.duplicate, "JetStream dropped a copy inside its window"
        return ack

    async def publish_without_id(self, body: bytes) -> None:
        await self.js.publish(self.subject, body, stream=self.stream)

    async def between_copies(self) -> None:
        # JetStream drops a same-id publish inside its window (its first line of defence):
        # publish the next copies after it, so that they reach the consumer.
        await asyncio.sleep(self.duplicate_window * 2)

    async def leftover(self) -> int:
        info = await self.js.consumer_info(self.stream, self.durable)
        left: int = info.num_pending + info.num_ack_pending
        return left


@dataclass
class Kafka(Harness):
    """A topic on FastStream's in-memory TestKafkaBroker (no Kafka broker on this machine).

    The subscriber commits manually (``AckPolicy.ACK``); the middleware's commits and seeks
    are recorded from FastStream's fake consumer (see `record_kafka_consumer`).
    """

    kind = "kafka"
    topic: str = field(default_factory=lambda: f"idempo-test-{secrets.token_hex(6)}")
    broker_: KafkaBroker | None = None
    commits: list[Any] = field(default_factory=list)
    seeks: list[Any] = field(default_factory=list)

    @asynccontextmanager
    async def _test_broker(
        self, middleware: IdempotencyMiddleware, handler: Handler, options: dict[str, Any]
    ) -> AsyncIterator[KafkaBroker]:
        broker = KafkaBroker(logger=None)
        router = KafkaRouter(middlewares=[middleware])
        options.setdefault("ack_policy", AckPolicy.ACK)
        router.subscriber(self.topic, **options)(handler)
        broker.include_router(router)
        async with TestKafkaBroker(broker) as tested:
            self.broker_ = tested
            try:
                yield tested
            finally:
                self.broker_ = None

    def running(
        self, middleware: IdempotencyMiddleware, handler: Handler, **options: Any
    ) -> AbstractAsyncContextManager[Any]:
        return self._test_broker(middleware, handler, options)

    async def publish(self, body: bytes, event_id: str, **options: Any) -> Any:
        assert self.broker_ is not None, "the test broker delivers while it runs"
        return await publish(self.broker_, body, self.topic, event_id=event_id, **options)

    async def publish_without_id(self, body: bytes) -> None:
        assert self.broker_ is not None
        await self.broker_.publish(body, self.topic)

    async def leftover(self) -> int:
        return len(self.seeks)  # a seek means Kafka would hand the record back


@dataclass
class Redis(Harness):
    """A stream on the real Redis read by one consumer group."""

    kind = "redis"
    url: str = REDIS_URL
    stream: str = field(default_factory=lambda: f"idempo-test-{secrets.token_hex(6)}")
    group: str = "billing"
    client: Any = None

    def new_broker(self) -> RedisBroker:
        return RedisBroker(self.url, logger=None)

    async def declare(self) -> None:
        self.client = aredis.Redis.from_url(self.url)
        await self.client.xgroup_create(self.stream, self.group, id="0", mkstream=True)

    async def remove(self) -> None:
        await self.client.delete(self.stream)
        await self.client.aclose()

    def broker(
        self, middleware: IdempotencyMiddleware, handler: Handler, **options: Any
    ) -> RedisBroker:
        broker = self.new_broker()
        router = RedisRouter(middlewares=[middleware])
        options.setdefault("consumer", "parent")
        options.setdefault("polling_interval", 50)
        sub = StreamSub(self.stream, group=self.group, **options)
        router.subscriber(stream=sub)(handler)
        broker.include_router(router)
        return broker

    def running(
        self, middleware: IdempotencyMiddleware, handler: Handler, **options: Any
    ) -> AbstractAsyncContextManager[Any]:
        return _started(self.broker(middleware, handler, **options))

    async def publish(self, body: bytes, event_id: str, **options: Any) -> Any:
        return await publish(self.producer, body, self.stream, event_id=event_id, **options)

    async def publish_without_id(self, body: bytes) -> None:
        await self.producer.publish(body, stream=self.stream)

    async def pending(self) -> int:
        summary = await self.client.xpending(self.stream, self.group)
        count: int = summary["pending"]
        return count

    async def leftover(self) -> int:
        [group] = await self.client.xinfo_groups(self.stream)
        lag: int = group["lag"] or 0
        return await self.pending() + lag


HARNESSES: dict[str, type[Harness]] = {
    "rabbit": Rabbit,
    "nats": Nats,
    "kafka": Kafka,
    "redis": Redis,
}


async def reachable(kind: str) -> str | None:
    """Why the server behind ``kind`` cannot be used, or None."""
    try:
        if kind == "rabbit":
            connection = await aio_pika.connect(AMQP_URL, timeout=5)
            await connection.close()
        elif kind == "nats":
            client = await nats.connect(NATS_URL, connect_timeout=5, max_reconnect_attempts=0)
            await client.jetstream().account_info()
            await client.close()
        elif kind == "redis":
            client = aredis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
            await client.ping()
            await client.aclose()
    except Exception as exc:
        return repr(exc)
    return None


# -- a consumer in another process -------------------------------------------------------


@dataclass(frozen=True)
class ChildSpec:
    """What a spawned consumer process needs, as plain data."""

    worker: str
    harness: Harness
    database: Database
    crash_key: str | None = None  # SIGKILLed inside this event's handler, row written
    slow: float = 0.0  # every handler takes this long (longer than NATS ack_wait: redelivery)


def child_main(spec: ChildSpec, said: Any, stop: Any) -> None:
    """A consumer process: consume until ``stop`` is set, reporting what it does."""
    asyncio.run(_child(spec, said, stop))


async def _child(spec: ChildSpec, said: Any, stop: Any) -> None:
    db = spec.database
    forever = asyncio.Event()
    async with open_inbox(db, pool_size=10) as inbox:
        consumer = inbox.consumer()

        async def handle(body: Any) -> None:
            key = await write_row(db, spec.worker)
            if key == spec.crash_key:
                said.put({"worker": spec.worker, "state": "mid-work", "key": key})
                await forever.wait()  # SIGKILLed here: the row written, not committed
            if spec.slow:
                await asyncio.sleep(spec.slow)

        async with spec.harness.running(IdempotencyMiddleware(consumer), handle):
            said.put({"worker": spec.worker, "state": "ready"})
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)
        said.put({"worker": spec.worker, "state": "stopped", "counts": dict(consumer.counts)})
