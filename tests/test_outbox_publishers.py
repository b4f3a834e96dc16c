"""The outbox's publishers against the real brokers: RabbitMQ, NATS JetStream, Redis Streams.

Each publisher publishes and the message arrives with its id, body and headers where idempo's
consumers read them; a broker that is down (a closed port) or that refuses the message is a
`PublishError`; and idempo's own consumer for that broker, given two publications of one
message (a relay that died between the broker's confirm and marking it sent), applies it
once. Every test makes its own queue, stream or subject and removes it afterwards.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import aio_pika
import pytest
from faststream.nats import NatsBroker
from faststream.rabbit import RabbitBroker

from faststream_brokers import HARNESSES, Harness, reachable, unavailable
from idempo import AsyncIdempotency, ConfigurationError, Policy
from idempo.consumer import AsyncConsumer, Delivery, Reason, current_delivery
from idempo.contrib.aio_pika import consume
from idempo.contrib.faststream import IdempotencyMiddleware
from idempo.outbox import OutboxMessage, Publisher
from idempo.outbox.publishers import (
    FastStreamPublisher,
    MemoryPublisher,
    NatsPublisher,
    PublishError,
    RabbitMQPublisher,
    RedisStreamsPublisher,
    open_publisher,
)
from idempo.stores.memory import AsyncMemoryStore

pytestmark = pytest.mark.anyio

DEADLINE = 10.0


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def message(destination: str, n: int = 0, **headers: str) -> OutboxMessage:
    ident = f"msg-{secrets.token_hex(4)}-{n}"
    body = json.dumps({"event": "payment.captured", "n": n}).encode()
    return OutboxMessage(ident, destination, body, {"tenant": "acme", **headers}, 0)


async def wait_for(condition: Any, what: str) -> None:
    ends = time.monotonic() + DEADLINE
    while not condition():
        assert time.monotonic() < ends, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def opened(kind: str, **options: Any) -> AsyncIterator[Any]:
    """A fresh destination on the ``kind`` broker (skipped, or failed in CI, if it is down)."""
    problem = await reachable(kind)
    if problem:
        unavailable(f"the {kind} server is unreachable: {problem}")
    harness: Harness = HARNESSES[kind](**options)
    await harness.open()
    try:
        yield harness
    finally:
        await harness.close()


def counting_consumer() -> tuple[AsyncConsumer, Counter[str]]:
    """An idempo consumer on an in-process store, and how often it applied each id."""
    applied: Counter[str] = Counter()
    consumer = AsyncConsumer(
        AsyncIdempotency(AsyncMemoryStore(), Policy(ttl=timedelta(days=7))),
        name="payments.captured",
        horizon=timedelta(days=1),
        retry_delay=0.05,
    )
    return consumer, applied


# -- open_publisher and the in-process publisher ---------------------------------------------


def test_open_publisher_picks_the_publisher_by_scheme() -> None:
    assert isinstance(open_publisher("amqp://guest:guest@127.0.0.1:5672/"), RabbitMQPublisher)
    assert isinstance(open_publisher("amqps://guest:guest@mq.example/"), RabbitMQPublisher)
    nats_publisher = open_publisher("nats://127.0.0.1:4222", stream="payments")
    assert isinstance(nats_publisher, NatsPublisher)
    assert nats_publisher.stream == "payments"
    assert isinstance(open_publisher("redis://127.0.0.1:6379/0"), RedisStreamsPublisher)
    assert isinstance(open_publisher("rediss://cache.example:6380/0"), RedisStreamsPublisher)
    for publisher in (nats_publisher, MemoryPublisher()):
        assert isinstance(publisher, Publisher)


@pytest.mark.parametrize("url", ["kafka://127.0.0.1:9092", "http://x", "no-scheme", ""])
def test_open_publisher_refuses_other_schemes_and_names_the_known_ones(url: str) -> None:
    with pytest.raises(ConfigurationError, match=r"amqp://.*nats://.*redis://.*FastStream"):
        open_publisher(url)


def test_a_natsbroker_without_a_stream_is_refused() -> None:
    """Core NATS confirms nothing: a FastStreamPublisher on NATS must name its stream."""
    with pytest.raises(ConfigurationError, match="needs stream="):
        FastStreamPublisher(NatsBroker("nats://127.0.0.1:4222"))


async def test_memory_publisher_keeps_and_delivers_in_order() -> None:
    seen: list[str] = []

    async def deliver(sent: OutboxMessage) -> None:
        seen.append(sent.id)

    publisher = MemoryPublisher(deliver)
    first, second = message("payments", 0), message("payments", 1)
    await publisher.publish(first)
    await publisher.publish(second)
    await publisher.aclose()
    assert publisher.published == [first, second]
    assert seen == [first.id, second.id]
    assert publisher.closed


# -- RabbitMQ --------------------------------------------------------------------------------


@pytest.mark.rabbitmq
async def test_rabbitmq_message_arrives_with_its_id_body_and_headers() -> None:
    async with opened("rabbit") as rabbit:
        publisher = open_publisher(rabbit.url)
        sent = message(rabbit.queue)
        try:
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        [got] = await rabbit.drain(rabbit.queue)
    assert got.message_id == sent.id
    assert got.body == sent.body
    assert got.headers == {"tenant": "acme"}
    assert got.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert got.timestamp is not None


@pytest.mark.rabbitmq
async def test_rabbitmq_named_exchange_routes_by_destination() -> None:
    async with opened("rabbit") as rabbit:
        exchange = await rabbit.channel.declare_exchange(
            f"{rabbit.queue}.x", aio_pika.ExchangeType.DIRECT, auto_delete=True
        )
        queue = await rabbit.channel.get_queue(rabbit.queue)
        await queue.bind(exchange, routing_key="payment.captured")
        publisher = RabbitMQPublisher(rabbit.url, exchange=exchange.name)
        sent = message("payment.captured")
        try:
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        [got] = await rabbit.drain(rabbit.queue)
    assert got.message_id == sent.id


@pytest.mark.rabbitmq
async def test_rabbitmq_unroutable_and_missing_exchange_raise_and_the_next_publish_works() -> None:
    """A message no queue would receive comes back (mandatory): a PublishError, not a silent
    drop. A missing exchange closes the channel: an error too. Then the publisher carries on
    on a fresh channel."""
    async with opened("rabbit") as rabbit:
        publisher = RabbitMQPublisher(rabbit.url)
        try:
            with pytest.raises(PublishError, match="unroutable"):
                await publisher.publish(message(f"{rabbit.queue}.nobody"))
            sent = message(rabbit.queue)
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        missing = RabbitMQPublisher(rabbit.url, exchange=f"{rabbit.queue}.no-such-exchange")
        try:
            with pytest.raises(PublishError, match="did not confirm"):
                await missing.publish(message(rabbit.queue))
        finally:
            await missing.aclose()
        [got] = await rabbit.drain(rabbit.queue)
    assert got.message_id == sent.id


async def test_rabbitmq_down_is_a_publish_error_naming_the_broker() -> None:
    publisher = RabbitMQPublisher(f"amqp://guest:secret@127.0.0.1:{closed_port()}/", timeout=3)
    started = time.monotonic()
    with pytest.raises(PublishError, match=r"RabbitMQ at amqp://guest:\*\*\*@127\.0\.0\.1") as err:
        await publisher.publish(message("payments"))
    assert time.monotonic() - started < 5
    assert "secret" not in str(err.value)
    assert err.value.__cause__ is not None
    await publisher.aclose()


@pytest.mark.rabbitmq
async def test_rabbitmq_two_publications_are_applied_once_by_idempos_consumer() -> None:
    """The relay published, the broker confirmed, the relay died before marking it sent, and
    a relay published it again: idempo's aio-pika consumer applies it once."""
    consumer, applied = counting_consumer()

    async def apply(delivery: Delivery[Any]) -> None:
        applied[delivery.key] += 1

    async with opened("rabbit") as rabbit:
        publisher = open_publisher(rabbit.url)
        sent = message(rabbit.queue)
        try:
            await publisher.publish(sent)
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        queue = await rabbit.channel.get_queue(rabbit.queue)
        async with consume(queue, apply, consumer):
            await wait_for(lambda: sum(consumer.counts.values()) == 2, "both copies")
    assert applied == Counter({sent.id: 1})
    assert consumer.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 1})


# -- NATS JetStream --------------------------------------------------------------------------


async def _fetch(nats_harness: Any, count: int) -> list[Any]:
    sub = await nats_harness.js.pull_subscribe_bind(nats_harness.durable, nats_harness.stream)
    got = await sub.fetch(count, timeout=DEADLINE)
    for each in got:
        await each.ack()
    return list(got)


@pytest.mark.nats
async def test_nats_message_is_stored_with_nats_msg_id_and_its_headers() -> None:
    async with opened("nats", duplicate_window=60.0) as harness:
        publisher = open_publisher(harness.url, stream=harness.stream)
        sent = message(harness.subject)
        try:
            await publisher.publish(sent)
            await publisher.publish(sent)  # inside the window: JetStream drops it, acks it
        finally:
            await publisher.aclose()
        info = await harness.js.stream_info(harness.stream)
        [got] = await _fetch(harness, 1)
    assert info.state.messages == 1
    assert got.headers["Nats-Msg-Id"] == sent.id
    assert got.headers["tenant"] == "acme"
    assert got.data == sent.body
    assert got.subject == harness.subject


@pytest.mark.nats
async def test_nats_subject_no_stream_captures_is_a_publish_error() -> None:
    """Core NATS would drop it without a word; the publisher wants JetStream's PubAck."""
    async with opened("nats") as harness:
        publisher = NatsPublisher(harness.url, timeout=2)
        try:
            with pytest.raises(PublishError, match="no stream captures"):
                await publisher.publish(message(f"nowhere-{secrets.token_hex(4)}.events"))
            await publisher.publish(message(harness.subject))  # the connection is kept
        finally:
            await publisher.aclose()


async def test_nats_down_is_a_publish_error_with_the_cause() -> None:
    publisher = NatsPublisher(f"nats://127.0.0.1:{closed_port()}", timeout=2)
    started = time.monotonic()
    with pytest.raises(PublishError, match=r"NATS JetStream at nats://127\.0\.0\.1") as err:
        await publisher.publish(message("payments.captured"))
    assert time.monotonic() - started < 5
    assert "Connect call failed" in str(err.value) or "refused" in str(err.value).lower()
    await publisher.aclose()


@pytest.mark.nats
async def test_nats_copy_after_the_window_is_applied_once_by_idempos_consumer() -> None:
    """A republish after JetStream's duplicate window is stored again; idempo's FastStream
    middleware reads the key from Nats-Msg-Id and acks the copy as a duplicate."""
    consumer, applied = counting_consumer()

    async def apply(body: Any) -> None:
        delivery = current_delivery()
        assert delivery is not None
        applied[delivery.key] += 1

    async with opened("nats") as harness:  # a 100 ms duplicate window
        publisher = open_publisher(harness.url, stream=harness.stream)
        sent = message(harness.subject)
        try:
            await publisher.publish(sent)
            await harness.between_copies()
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        assert (await harness.js.stream_info(harness.stream)).state.messages == 2
        async with harness.running(IdempotencyMiddleware(consumer), apply):
            await wait_for(lambda: sum(consumer.counts.values()) == 2, "both copies")
    assert applied == Counter({sent.id: 1})
    assert consumer.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 1})


# -- Redis Streams ---------------------------------------------------------------------------


@pytest.mark.redis
async def test_redis_entry_carries_the_id_body_and_headers_as_fields() -> None:
    async with opened("redis") as harness:
        publisher = open_publisher(harness.url)
        sent = message(harness.stream)
        try:
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        [(_, fields)] = await harness.client.xrange(harness.stream)
    assert fields == {
        b"message-id": sent.id.encode(),
        b"body": sent.body,
        b"headers": b'{"tenant": "acme"}',
    }


@pytest.mark.redis
async def test_redis_key_that_is_not_a_stream_is_a_publish_error() -> None:
    async with opened("redis") as harness:
        key = f"{harness.stream}.plain"
        await harness.client.set(key, "x")
        publisher = RedisStreamsPublisher(harness.url)
        try:
            with pytest.raises(PublishError, match=r"WRONGTYPE|ResponseError"):
                await publisher.publish(message(key))
            await publisher.publish(message(harness.stream))  # the connection is kept
        finally:
            await publisher.aclose()
            await harness.client.delete(key)


async def test_redis_down_is_a_publish_error() -> None:
    publisher = RedisStreamsPublisher(f"redis://127.0.0.1:{closed_port()}/0", timeout=2)
    with pytest.raises(PublishError, match=r"Redis at redis://127\.0\.0\.1") as err:
        await publisher.publish(message("payments"))
    assert "ConnectionError" in str(err.value)
    await publisher.aclose()


@pytest.mark.redis
async def test_redis_two_publications_are_applied_once_by_idempos_consumer() -> None:
    """Redis keeps no publish-side window: both entries are stored, and idempo's FastStream
    middleware finds the id in the ``message-id`` field and skips the second."""
    consumer, applied = counting_consumer()

    async def apply(body: Any) -> None:
        delivery = current_delivery()
        assert delivery is not None
        applied[delivery.key] += 1

    async with opened("redis") as harness:
        publisher = open_publisher(harness.url)
        sent = message(harness.stream)
        try:
            await publisher.publish(sent)
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        async with harness.running(IdempotencyMiddleware(consumer), apply):
            await wait_for(lambda: sum(consumer.counts.values()) == 2, "both copies")
    assert applied == Counter({sent.id: 1})
    assert consumer.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 1})


# -- FastStream ------------------------------------------------------------------------------


@pytest.mark.rabbitmq
async def test_faststream_publisher_on_rabbitmq_sets_the_amqp_message_id() -> None:
    async with opened("rabbit") as rabbit:
        publisher = FastStreamPublisher(RabbitBroker(rabbit.url, logger=None))
        sent = message(rabbit.queue)
        try:
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        [got] = await rabbit.drain(rabbit.queue)
    assert got.message_id == sent.id
    assert got.body == sent.body
    assert got.headers["tenant"] == "acme"


@pytest.mark.nats
async def test_faststream_publisher_on_nats_gets_the_pub_ack_and_sets_nats_msg_id() -> None:
    async with opened("nats", duplicate_window=60.0) as harness:
        publisher = FastStreamPublisher(NatsBroker(harness.url, logger=None), stream=harness.stream)
        sent = message(harness.subject)
        try:
            await publisher.publish(sent)
            await publisher.publish(sent)
        finally:
            await publisher.aclose()
        info = await harness.js.stream_info(harness.stream)
        [got] = await _fetch(harness, 1)
    assert info.state.messages == 1  # JetStream dropped the copy on the id
    assert got.headers["Nats-Msg-Id"] == sent.id
    assert got.data == sent.body


async def test_faststream_publisher_down_is_a_publish_error() -> None:
    broker = RabbitBroker(f"amqp://guest:guest@127.0.0.1:{closed_port()}/", logger=None)
    publisher = FastStreamPublisher(broker)
    with pytest.raises(PublishError, match="RabbitBroker did not confirm"):
        await publisher.publish(message("payments"))
    await publisher.aclose()


@pytest.mark.redis
async def test_redis_prefix_in_the_url_namespaces_the_streams() -> None:
    """``?prefix=`` (as on idempo's Redis store URLs) is not handed to redis-py: the streams
    go under ``<prefix>:``."""
    async with opened("redis") as harness:
        prefix = f"idempo-test-{secrets.token_hex(4)}"
        publisher = open_publisher(f"{harness.url}?prefix={prefix}")
        sent = message("payments")
        try:
            await publisher.publish(sent)
            [(_, fields)] = await harness.client.xrange(f"{prefix}:payments")
        finally:
            await publisher.aclose()
            await harness.client.delete(f"{prefix}:payments")
    assert fields[b"message-id"] == sent.id.encode()
