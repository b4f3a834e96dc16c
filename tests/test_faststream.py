"""The FastStream middleware on RabbitMQ, NATS JetStream, Kafka and Redis Streams.

RabbitMQ, NATS JetStream and Redis are the real servers on this machine; every test makes its
own uniquely named queue, stream or topic and removes it afterwards. There is no Kafka broker
on these machines: Kafka runs on FastStream's own in-memory TestKafkaBroker, which checks
that the middleware commits or seeks back as it should, not what Kafka then does.

The handler's business effect is a row in PostgreSQL (no unique key) written on the
delivery's connection, in the transaction that records the message; consumers run in this
process, and in spawned processes where one must really race another or really die
(SIGKILL) mid-handler. The tests poll conditions to a deadline; the only fixed waits are
NATS's 100 ms duplicate window, which copies published on purpose must outlive.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import pytest
from faststream import AckPolicy
from faststream.kafka import KafkaBroker, KafkaRouter, TestKafkaBroker
from faststream.kafka.annotations import KafkaMessage
from faststream.kafka.message import FAKE_CONSUMER
from faststream.nats.annotations import NatsMessage
from faststream.nats.message import NatsMessage as FastStreamNatsMessage

from children import Children, spawned
from faststream_brokers import (
    BUSINESS,
    HARNESSES,
    NAME,
    TTL,
    ChildSpec,
    Harness,
    Inbox,
    Kafka,
    Rabbit,
    body_of,
    child_main,
    events,
    failing_writer,
    open_inbox,
    reachable,
    row_writer,
    settled,
    unavailable,
    wait_for,
    write_row,
)
from helpers import Database
from idempo import ConfigurationError, InvalidKeyError, derive_key
from idempo.consumer import AsyncConsumer, Outcome, Reason, current_delivery
from idempo.contrib.faststream import IdempotencyMiddleware, jetstream_horizon, publish
from idempo.policy import utcnow
from idempo.testing import FakeClock

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

# The real servers each test needs, as markers (`-m 'not nats'` and so on).
MARKS = {"rabbit": pytest.mark.rabbitmq, "nats": pytest.mark.nats, "redis": pytest.mark.redis}


def brokers(*kinds: str) -> list[Any]:
    return [pytest.param(kind, marks=MARKS.get(kind, ()), id=kind) for kind in kinds]


@asynccontextmanager
async def opened(kind: str, **options: Any) -> AsyncIterator[Any]:
    """A fresh destination on the ``kind`` broker (skipped, or failed in CI, if it is down)."""
    problem = await reachable(kind)
    if problem:
        unavailable(f"the {kind} server is unreachable: {problem}")
    harness = HARNESSES[kind](**options)
    await harness.open()
    try:
        yield harness
    finally:
        await harness.close()


@pytest.fixture
def kafka_calls(monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], list[Any]]:
    """The commits and seeks the middleware makes on FastStream's fake Kafka consumer."""
    commits: list[Any] = []
    seeks: list[Any] = []

    async def commit() -> None:
        commits.append(True)

    def seek(partition: Any, offset: int) -> None:
        seeks.append((partition.topic, offset))

    monkeypatch.setattr(FAKE_CONSUMER, "commit", commit)
    monkeypatch.setattr(FAKE_CONSUMER, "seek", seek)
    return commits, seeks


@pytest.fixture(params=brokers(*HARNESSES))
async def harness(
    request: pytest.FixtureRequest, kafka_calls: tuple[list[Any], list[Any]]
) -> AsyncIterator[Harness]:
    """Each broker in turn."""
    async with opened(request.param) as opened_harness:
        if isinstance(opened_harness, Kafka):
            opened_harness.commits, opened_harness.seeks = kafka_calls
        yield opened_harness


@pytest.fixture
async def inbox(postgres_database: Database) -> AsyncIterator[Inbox]:
    postgres_database.create_business_table(BUSINESS)
    async with open_inbox(postgres_database) as opened_inbox:
        yield opened_inbox


class Quarantine:
    """A quarantine hook that keeps what it is given."""

    def __init__(self) -> None:
        self.kept: list[tuple[Reason, bytes]] = []

    async def __call__(self, message: Any, outcome: Outcome) -> None:
        self.kept.append((outcome.reason, message.body))


# -- every broker ---------------------------------------------------------------------------


async def test_each_event_published_several_times_has_one_effect(
    harness: Harness, inbox: Inbox
) -> None:
    """Twenty events, each published three times, give exactly one row each on every
    broker; every copy is acknowledged and nothing is left on the broker."""
    consumer = inbox.consumer()
    ids = events(20)
    async with harness.running(IdempotencyMiddleware(consumer), row_writer(inbox.db)):
        for copy in range(3):
            if copy:
                await harness.between_copies()
            for event in ids:
                await harness.publish(body_of(event), event)
        await wait_for(lambda: settled(consumer) == 60, "60 settled deliveries")
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))
    assert consumer.counts[Reason.EXECUTED] == 20
    assert consumer.counts[Reason.DUPLICATE] == 40
    assert set(inbox.states().values()) == {"completed"}
    assert await harness.leftover() == 0
    if isinstance(harness, Kafka):
        assert len(harness.commits) == 60  # each copy committed after its handling


async def test_refused_messages_are_quarantined_never_executed(
    harness: Harness, inbox: Inbox
) -> None:
    """A message with no event id, and one whose id was first used with another body, reach
    the quarantine hook and the broker's own dead-letter action; the handler never sees
    them, nothing of theirs is stored, and the broker does not hand them back."""
    consumer = inbox.consumer()
    quarantine = Quarantine()
    [event] = events(1)
    middleware = IdempotencyMiddleware(consumer, quarantine=quarantine)
    async with harness.running(middleware, row_writer(inbox.db)):
        await harness.publish(b"first", event)
        await wait_for(lambda: consumer.counts[Reason.EXECUTED] == 1, "the first message")
        await harness.between_copies()
        await harness.publish(b"second", event)
        await harness.publish_without_id(b'{"amount": 5}')
        await wait_for(lambda: len(quarantine.kept) == 2, "two quarantined messages")
    assert sorted(quarantine.kept) == sorted(
        [(Reason.MISMATCH, b"second"), (Reason.NO_KEY, b'{"amount": 5}')]
    )
    assert inbox.db.select(f"SELECT body FROM {inbox.db.business_table}") == [("first",)]
    assert inbox.states() == {event: "completed"}
    assert await harness.leftover() == 0
    if isinstance(harness, Rabbit):  # refused by RabbitMQ into the dead-letter exchange
        dead = await harness.drain(harness.dlq)
        assert sorted(m.body for m in dead) == [b"second", b'{"amount": 5}']


async def test_horizon_guard_refuses_short_retention_and_quarantines_old_messages(
    harness: Harness, inbox: Inbox
) -> None:
    """A retention shorter than the broker's horizon fails at start-up. Once the clock is
    past the retention, a message published before it (even a copy of a handled event,
    whose record could be gone) is quarantined, not executed."""
    with pytest.raises(ConfigurationError, match="redelivery horizon"):
        IdempotencyMiddleware(inbox.consumer(horizon=timedelta(days=30)))
    clock = FakeClock(utcnow())
    consumer = inbox.consumer(clock=clock)
    quarantine = Quarantine()
    [handled] = events(1)
    middleware = IdempotencyMiddleware(consumer, quarantine=quarantine)
    async with harness.running(middleware, row_writer(inbox.db)):
        await harness.publish(body_of(handled), handled)
        await wait_for(lambda: consumer.counts[Reason.EXECUTED] == 1, "the fresh message")
        await harness.between_copies()
        published = clock()
        clock.advance(TTL + timedelta(days=1))  # the consumer now runs eight days later
        # A redrive of the handled event, stamped with its first publication (brokers that
        # stamp their own time ignore the stamp: the clock is past it all the same).
        await harness.publish(body_of(handled), handled, timestamp=published)
        await wait_for(lambda: len(quarantine.kept) == 1, "the old message quarantined")
    assert quarantine.kept == [(Reason.EXPIRED, body_of(handled))]
    assert consumer.counts[Reason.EXPIRED] == 1
    assert inbox.rows() == Counter({handled: 1})
    assert await harness.leftover() == 0


@pytest.mark.parametrize("kind", brokers("rabbit", "nats"))
async def test_transient_failure_is_redelivered_by_the_broker_and_runs_once(
    kind: str, inbox: Inbox
) -> None:
    """A handler that fails after writing its row, on each event's first delivery, has the
    write rolled back; the broker redelivers (RabbitMQ after a nack, JetStream after a
    delayed nak) and the event runs once."""
    deliveries: Counter[str] = Counter()

    def first_delivery(key: str) -> bool:
        deliveries[key] += 1
        return deliveries[key] == 1

    flaky = failing_writer(inbox.db, first_delivery)
    consumer = inbox.consumer()
    ids = events(8)
    async with opened(kind) as harness:
        async with harness.running(IdempotencyMiddleware(consumer), flaky):
            for event in ids:
                await harness.publish(body_of(event), event)
            await wait_for(lambda: consumer.counts[Reason.EXECUTED] == 8, "every event run")
        assert await harness.leftover() == 0
    assert consumer.counts[Reason.TRANSIENT] == 8
    assert deliveries == Counter(dict.fromkeys(ids, 2))
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))


@pytest.mark.nats
async def test_handler_reads_its_delivery_and_connection_from_the_context(
    inbox: Inbox,
) -> None:
    """Inside a FastStream handler, current_delivery() gives the message's key, envelope
    (the raw body and JetStream's stored time) and the connection of its transaction."""
    seen: list[Any] = []

    async def handle(body: Any, message: NatsMessage) -> None:
        delivery = current_delivery()
        assert delivery is not None
        seen.append((delivery.key, delivery.envelope, delivery.message is message, body))
        await write_row(inbox.db, "parent")

    [event] = events(1)
    consumer = inbox.consumer()
    async with opened("nats") as harness:
        before = utcnow()
        async with harness.running(IdempotencyMiddleware(consumer), handle):
            await harness.publish(b'{"amount": 5}', event)
            await wait_for(lambda: seen, "the handler")
    [(key, envelope, same_message, body)] = seen
    assert (key, envelope.id, envelope.body, same_message) == (event, event, b'{"amount": 5}', True)
    assert body == {"amount": 5}  # FastStream decoded the body for the handler as usual
    assert envelope.timestamp is not None
    assert before - timedelta(seconds=5) < envelope.timestamp < utcnow()
    assert inbox.rows() == Counter({event: 1})


# -- NATS JetStream -------------------------------------------------------------------------


@pytest.mark.nats
async def test_jetstream_drops_copies_in_its_window_and_idempo_catches_the_redrive(
    inbox: Inbox,
) -> None:
    """Within the stream's duplicate window JetStream itself drops a same-id publish (its
    PubAck says duplicate) and only one message is stored; a copy published after the
    window (a producer's late retry, a redrive) is stored again, and idempo acks it as a
    duplicate: one row."""
    consumer = inbox.consumer()
    [event] = events(1)
    async with opened("nats", duplicate_window=1.0) as harness:
        first = await harness.publish(body_of(event), event)
        acks = [await harness.publish(body_of(event), event, dedupe_ok=True) for _ in range(3)]
        assert [ack.duplicate for ack in acks] == [True, True, True]
        assert {ack.seq for ack in acks} == {first.seq}

        async def redriven() -> bool:
            # Keep retrying the publish until one lands after the window.
            ack = await harness.publish(body_of(event), event, dedupe_ok=True)
            return not ack.duplicate

        await wait_for(redriven, "a copy after the duplicate window", deadline=5)
        info = await harness.js.stream_info(harness.stream)
        assert info.state.messages == 2  # the first and the redrive: the rest never stored
        async with harness.running(IdempotencyMiddleware(consumer), row_writer(inbox.db)):
            await wait_for(lambda: settled(consumer) == 2, "both stored messages")
        assert await harness.leftover() == 0
    assert consumer.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 1})
    assert inbox.rows() == Counter({event: 1})


@pytest.mark.nats
async def test_jetstream_horizon_is_the_streams_max_age(inbox: Inbox) -> None:
    """jetstream_horizon reads the stream's retention: a stream that keeps messages longer
    than the records live fails the consumer at start-up; one that keeps them forever is
    refused outright; a shorter one is fine."""
    async with opened("nats", max_age=timedelta(days=30)) as long_lived:
        horizon = await jetstream_horizon(long_lived.js, long_lived.stream)
        assert horizon == timedelta(days=30)
        with pytest.raises(ConfigurationError, match="shorter than the broker's redelivery"):
            inbox.consumer(horizon=horizon)
    async with opened("nats", max_age=timedelta(0)) as forever:
        with pytest.raises(ConfigurationError, match="keeps messages forever"):
            await jetstream_horizon(forever.js, forever.stream)
    async with opened("nats", max_age=timedelta(days=1)) as day:
        nats_broker = day.broker(IdempotencyMiddleware(inbox.consumer()), row_writer(inbox.db))
        await nats_broker.connect()
        try:
            horizon = await jetstream_horizon(nats_broker, day.stream)
        finally:
            await nats_broker.stop()
        assert inbox.consumer(horizon=horizon).horizon == timedelta(days=1)


@pytest.mark.nats
async def test_jetstream_redelivery_while_the_first_runs_is_naked_with_a_delay(
    inbox: Inbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler that outlives JetStream's ack wait gets its message redelivered, to the
    other consumer on the durable, while it still runs: the copy waits on the first's row
    lock, is told it is in progress and is naked with a delay, again and again, until the
    first commits and acks (JetStream then drops the pending redelivery, or it comes back
    and is acked as a duplicate). One row."""
    started = asyncio.Event()
    finish = asyncio.Event()
    runs: list[str] = []

    async def slow(body: Any) -> None:
        runs.append(await write_row(inbox.db, "parent"))
        started.set()
        await finish.wait()

    naks: list[float | None] = []
    nack = FastStreamNatsMessage.nack

    async def recorded(message: FastStreamNatsMessage, delay: float | None = None) -> None:
        naks.append(delay)
        await nack(message, delay=delay)

    monkeypatch.setattr(FastStreamNatsMessage, "nack", recorded)
    consumer = inbox.consumer(retry_delay=0.2, lock_timeout=0.1)
    middleware = IdempotencyMiddleware(consumer)
    [event] = events(1)
    async with (
        opened("nats", ack_wait=0.5) as harness,
        harness.running(middleware, slow),
        harness.running(middleware, slow),
    ):
        await harness.publish(body_of(event), event)
        await started.wait()
        await wait_for(lambda: consumer.counts[Reason.IN_PROGRESS] >= 2, "two requeues")
        finish.set()
        await wait_for(lambda: consumer.counts[Reason.EXECUTED] == 1, "the first's commit")

        async def nothing_left() -> bool:
            return await harness.leftover() == 0

        await wait_for(nothing_left, "nothing pending")
    assert runs == [event]
    assert set(consumer.counts) <= {Reason.EXECUTED, Reason.IN_PROGRESS, Reason.DUPLICATE}
    assert len(naks) == consumer.counts[Reason.IN_PROGRESS]
    assert all(delay is not None and 0 < delay <= 0.2 for delay in naks)  # JetStream waits
    assert inbox.rows() == Counter({event: 1})


# -- Kafka (FastStream's TestKafkaBroker: no Kafka broker on this machine) -------------------


async def test_kafka_commits_after_handling_and_seeks_back_on_transient_failure(
    inbox: Inbox, kafka_calls: tuple[list[Any], list[Any]]
) -> None:
    """With manual commits, a handled message is committed; a transient failure seeks the
    partition back to the failed record (after the retry delay) instead, so Kafka reads it
    again, and nothing of it is stored."""
    commits, seeks = kafka_calls
    fail = True
    flaky = failing_writer(inbox.db, lambda key: fail)

    consumer = inbox.consumer()
    [event] = events(1)
    kafka = Kafka()
    async with kafka.running(IdempotencyMiddleware(consumer), flaky):
        await kafka.publish(body_of(event), event)
        assert (commits, seeks) == ([], [(kafka.topic, 0)])
        assert inbox.rows() == Counter()
        fail = False
        await kafka.publish(body_of(event), event)  # what Kafka would read again
    assert consumer.counts == Counter({Reason.TRANSIENT: 1, Reason.EXECUTED: 1})
    assert (len(commits), len(seeks)) == (1, 1)
    assert inbox.rows() == Counter({event: 1})


async def test_kafka_auto_commit_cannot_retry_and_says_so(
    inbox: Inbox, caplog: pytest.LogCaptureFixture
) -> None:
    """Under FastStream's Kafka default (AckPolicy.ACK_FIRST: auto-commit) a message is
    committed before its handler runs, so a transient failure cannot bring it back: the
    middleware logs that at ERROR instead of pretending to requeue it."""

    async def failing(body: Any) -> None:
        raise ConnectionError("the PSP timed out")

    consumer = inbox.consumer()
    [event] = events(1)
    kafka = Kafka()
    with caplog.at_level(logging.ERROR, logger="idempo.consumer"):
        async with kafka.running(
            IdempotencyMiddleware(consumer), failing, ack_policy=AckPolicy.ACK_FIRST
        ):
            await kafka.publish(body_of(event), event)
    assert consumer.counts == Counter({Reason.TRANSIENT: 1})
    [lost] = [r for r in caplog.records if "will not come back" in r.getMessage()]
    assert event in lost.getMessage()
    assert "ACK_FIRST" in lost.getMessage()


def charging(
    inbox: Inbox, charges: AsyncConsumer, topic: str, runs: list[str]
) -> tuple[KafkaBroker, KafkaRouter]:
    """A Kafka app whose handler writes its row and returns a receipt, which FastStream
    publishes to ``<topic>.receipts``; include the router once the test has added to it."""
    broker = KafkaBroker(logger=None)
    router = KafkaRouter(middlewares=[IdempotencyMiddleware(charges)])

    @router.subscriber(topic, ack_policy=AckPolicy.ACK)
    @router.publisher(f"{topic}.receipts")
    async def charge(body: dict[str, Any]) -> dict[str, Any]:
        runs.append(await write_row(inbox.db, "parent"))
        return {"charged": body["event"]}

    return broker, router


async def test_result_is_republished_for_each_copy_under_one_derived_id(inbox: Inbox) -> None:
    """A handler's return value is stored with its record: FastStream publishes it after the
    first execution and again for each duplicate (so the output of a run that died before
    publishing is not lost), every time under one id derived from the event's, and an idempo
    consumer one hop down runs it once."""
    received: list[tuple[Any, str]] = []
    runs: list[str] = []
    charges = inbox.consumer()
    receipts = inbox.consumer(name="billing.receipt")
    [event] = events(1)
    topic = f"idempo-test-{event}"
    broker, upstream = charging(inbox, charges, topic, runs)
    downstream = KafkaRouter(middlewares=[IdempotencyMiddleware(receipts)])

    @downstream.subscriber(f"{topic}.receipts", ack_policy=AckPolicy.ACK)
    async def receipt(body: dict[str, Any], message: KafkaMessage) -> None:
        received.append((body, message.headers["message-id"]))

    broker.include_router(upstream)
    broker.include_router(downstream)
    async with TestKafkaBroker(broker) as tested:
        for _ in range(3):
            await publish(tested, body_of(event), topic, event_id=event)
    assert runs == [event]
    assert charges.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 2})
    derived = derive_key(event, f"{NAME}->{topic}.receipts")
    assert received == [({"charged": event}, derived)]  # the receipt handler ran once
    assert receipts.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 2})


async def test_result_that_could_not_be_published_is_requeued_and_published_again(
    inbox: Inbox, kafka_calls: tuple[list[Any], list[Any]]
) -> None:
    """If publishing a handler's result fails after its effect committed, the message is not
    acked but sought back; its redelivery is a duplicate, which publishes the stored result
    (under the same derived id) without running the handler again."""
    commits, seeks = kafka_calls
    received: list[str] = []
    runs: list[str] = []
    charges = inbox.consumer()
    [event] = events(1)
    topic = f"idempo-test-{event}"
    broker, router = charging(inbox, charges, topic, runs)

    @broker.subscriber(f"{topic}.receipts")
    async def receipt(body: dict[str, Any], message: KafkaMessage) -> None:
        if not received:
            received.append("refused")
            raise ConnectionError("the receipts topic is unavailable")
        received.append(message.headers["message-id"])

    broker.include_router(router)
    async with TestKafkaBroker(broker) as tested:
        with pytest.raises(ConnectionError):
            await publish(tested, body_of(event), topic, event_id=event)
        assert (len(commits), seeks) == (0, [(topic, 0)])  # Kafka will read it again
        await publish(tested, body_of(event), topic, event_id=event)  # the re-read
    assert runs == [event]
    assert inbox.rows() == Counter({event: 1})
    assert charges.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 1})
    assert received == ["refused", derive_key(event, f"{NAME}->{topic}.receipts")]
    assert len(commits) == 1


async def test_kafka_batch_subscriber_is_refused(inbox: Inbox) -> None:
    """A batch subscriber has no single event id: the middleware raises ConfigurationError
    and the handler never runs."""
    runs: list[Any] = []
    kafka = Kafka()

    async def batch(body: list[Any]) -> None:
        runs.append(body)

    async with kafka.running(IdempotencyMiddleware(inbox.consumer()), batch, batch=True):
        with pytest.raises(ConfigurationError, match="batch"):
            await kafka.publish(b"{}", "evt-1")
    assert runs == []


async def test_key_and_id_header_options_choose_where_the_event_id_is(inbox: Inbox) -> None:
    """``id_header`` moves the event id to another Kafka header (the publish helper and the
    middleware agree on it); ``key=`` replaces the extraction altogether."""
    consumer = inbox.consumer()
    kafka = Kafka()
    [event, other] = events(2)
    middleware = IdempotencyMiddleware(consumer, id_header="x-event-id")
    async with kafka.running(middleware, row_writer(inbox.db)):
        for _ in range(2):
            await kafka.publish(body_of(event), event, id_header="x-event-id")
        await kafka.publish(body_of(other), other)  # under the default header: no id here
    assert consumer.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 1, Reason.NO_KEY: 1})

    by_body = IdempotencyMiddleware(
        inbox.consumer(name="by-body"), key=lambda message: message.headers.get("order")
    )
    keyed = Kafka()
    async with keyed.running(by_body, row_writer(inbox.db)):
        for _ in range(2):
            await keyed.publish(body_of(other), "ignored", headers={"order": f"{other}-o"})
    assert by_body.consumer.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 1})
    assert inbox.rows()[f"{other}-o"] == 1


# -- Redis Streams ----------------------------------------------------------------------------


@pytest.mark.redis
async def test_redis_entry_written_by_plain_xadd_is_keyed_by_its_field(inbox: Inbox) -> None:
    """An entry a non-FastStream producer adds with XADD carries the event id as a field:
    the middleware finds it there (the body is the entry's fields, as FastStream hands
    them over); its copies are acked as duplicates."""
    consumer = inbox.consumer()
    [event] = events(1)
    async with opened("redis") as redis:
        async with redis.running(IdempotencyMiddleware(consumer), row_writer(inbox.db)):
            for _ in range(3):
                await redis.client.xadd(redis.stream, {"message-id": event, "amount": "5"})
            await wait_for(lambda: settled(consumer) == 3, "three entries")
        assert await redis.leftover() == 0
    assert consumer.counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 2})
    assert inbox.rows() == Counter({event: 1})


@pytest.mark.redis
async def test_redis_transient_failure_stays_pending_until_claimed(inbox: Inbox) -> None:
    """Redis has no nack: a message whose handler failed stays in the group's pending list.
    A subscriber that claims idle entries (min_idle_time) hands it back, and it runs once."""
    fail = True
    flaky = failing_writer(inbox.db, lambda key: fail)
    consumer = inbox.consumer()
    ids = events(3)
    async with opened("redis") as redis:
        async with redis.running(IdempotencyMiddleware(consumer), flaky):
            for event in ids:
                await redis.publish(body_of(event), event)
            await wait_for(lambda: consumer.counts[Reason.TRANSIENT] == 3, "three failures")
        assert await redis.pending() == 3
        assert inbox.rows() == Counter()
        fail = False
        claiming = IdempotencyMiddleware(consumer)
        async with redis.running(claiming, flaky, consumer="claimer", min_idle_time=100):
            await wait_for(lambda: consumer.counts[Reason.EXECUTED] == 3, "the claimed three")

            async def drained() -> bool:
                return await redis.pending() == 0

            await wait_for(drained, "an empty pending list")
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))


@pytest.mark.redis
async def test_redis_two_consumers_of_one_group_have_one_effect_per_event(
    inbox: Inbox,
) -> None:
    """Two subscribers in one consumer group (separate connections, one database) share a
    stream holding each of 20 events three times, copies side by side: one row per event,
    both consumers worked, nothing left pending."""
    consumers = [inbox.consumer(), inbox.consumer()]
    ids = events(20)
    async with opened("redis") as redis:
        async with (
            redis.running(
                IdempotencyMiddleware(consumers[0]), row_writer(inbox.db, "a"), consumer="a"
            ),
            redis.running(
                IdempotencyMiddleware(consumers[1]), row_writer(inbox.db, "b"), consumer="b"
            ),
        ):
            for event in ids:
                for _ in range(3):
                    await redis.publish(body_of(event), event)
            await wait_for(lambda: sum(map(settled, consumers)) == 60, "60 settled copies")
        assert await redis.leftover() == 0
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))
    assert all(c.counts[Reason.EXECUTED] + c.counts[Reason.DUPLICATE] for c in consumers)


# -- the producer helper ------------------------------------------------------------------


@pytest.mark.rabbitmq
async def test_publish_puts_the_event_id_where_each_broker_carries_it() -> None:
    """RabbitMQ gets the AMQP message_id, a timestamp and persistence; a bad id or an
    unknown broker is refused before anything is sent."""
    async with opened("rabbit") as rabbit:
        before = utcnow().replace(microsecond=0)
        await rabbit.publish(b"x", "evt-1", headers={"tenant": "a"})
        with pytest.raises(InvalidKeyError):
            await rabbit.publish(b"y", "not a key")
        [message] = await rabbit.drain(rabbit.queue)
    assert message.message_id == "evt-1"
    assert message.timestamp is not None
    assert message.timestamp >= before
    assert message.delivery_mode == 2  # persistent
    assert message.headers["tenant"] == "a"
    with pytest.raises(ConfigurationError, match="knows FastStream"):
        await publish(object(), b"x", "q", event_id="evt-1")


# -- consumers in other processes (NATS JetStream and RabbitMQ) -------------------------------


@pytest.fixture
def children() -> Iterator[Children]:
    with spawned(child_main) as spawned_children:
        yield spawned_children


@pytest.mark.slow
@pytest.mark.parametrize("kind", brokers("nats", "rabbit"))
async def test_consumer_killed_mid_handler_loses_nothing_and_does_nothing_twice(
    kind: str, inbox: Inbox, children: Children
) -> None:
    """A consumer process SIGKILLed inside a handler (its row written, not committed) has
    its unacknowledged messages redelivered (RabbitMQ when the connection drops, JetStream
    after the 1 s ack wait); a fresh consumer finishes them: one row per event, nothing
    left on the broker."""
    ids = events(20)
    victim = ids[5]
    async with opened(kind) as harness:
        children.start("doomed", ChildSpec("doomed", harness, inbox.db, crash_key=victim))
        await children.until("ready")
        for event in ids:
            await harness.publish(body_of(event), event)
        assert (await children.until("mid-work"))["key"] == victim
        children.kill("doomed")
        assert inbox.rows()[victim] == 0  # it died with its transaction

        consumer = inbox.consumer()
        async with harness.running(IdempotencyMiddleware(consumer), row_writer(inbox.db)):

            async def finished() -> bool:
                return set(inbox.rows()) == set(ids) and await harness.leftover() == 0

            await wait_for(finished, "every event handled", deadline=20)
        assert await harness.leftover() == 0
        if isinstance(harness, Rabbit):
            assert await harness.ready(harness.dlq) == 0
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))
    assert set(inbox.states().values()) == {"completed"}
    victims_row = f"SELECT worker FROM {inbox.db.business_table} WHERE event_id = ?"
    assert inbox.db.select(victims_row, (victim,)) == [("parent",)]  # redelivered here


@pytest.mark.slow
@pytest.mark.parametrize("kind", brokers("nats", "rabbit"))
async def test_two_consumer_processes_share_the_work_and_run_each_event_once(
    kind: str, inbox: Inbox, children: Children
) -> None:
    """Two consumer processes on one queue (RabbitMQ) or one durable consumer (JetStream)
    get 30 events three times each, copies close enough that one process handles a copy
    while the other still runs the first: one row per event, both processes worked, every
    copy acknowledged."""
    ids = events(30)
    slow = 0.5 if kind == "nats" else 0.02  # longer than NATS's copies are apart
    async with opened(kind) as harness:
        for worker in ("a", "b"):
            children.start(worker, ChildSpec(worker, harness, inbox.db, slow=slow))
        for _ in range(2):
            await children.until("ready")
        for copy in range(3):
            if copy:
                await harness.between_copies()
            for event in ids:
                await harness.publish(body_of(event), event)

        async def finished() -> bool:
            return set(inbox.rows()) == set(ids) and await harness.leftover() == 0

        await wait_for(finished, "every event handled", deadline=30)
        counts: Counter[str] = Counter()
        for worker in ("a", "b"):
            children.stop(worker)
        for _ in range(2):
            counts.update((await children.until("stopped"))["counts"])
        assert await harness.leftover() == 0
    assert inbox.rows() == Counter(dict.fromkeys(ids, 1))
    assert set(inbox.workers()) == {"a", "b"}  # both really executed events
    assert counts[Reason.EXECUTED] == 30
    assert counts[Reason.EXECUTED] + counts[Reason.DUPLICATE] >= 90  # every copy acked
    assert set(counts) <= {Reason.EXECUTED, Reason.DUPLICATE, Reason.IN_PROGRESS}


async def test_middleware_refuses_a_bad_configuration(inbox: Inbox) -> None:
    """The middleware wants an AsyncConsumer (FastStream handlers are async) and a header
    name; anything else is a ConfigurationError when it is made."""
    with pytest.raises(ConfigurationError, match="AsyncConsumer"):
        IdempotencyMiddleware(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="id_header"):
        IdempotencyMiddleware(inbox.consumer(), id_header="")
