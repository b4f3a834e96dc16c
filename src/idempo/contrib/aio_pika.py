"""RabbitMQ through aio-pika: handle each message id once, and publish with one.

    import aio_pika
    from idempo.consumer import AsyncConsumer, Delivery
    from idempo.contrib.aio_pika import consume, publish

    consumer = AsyncConsumer(idem, name="billing.charge", horizon=timedelta(days=7),
                             connection=pool.connection)

    async def charge(delivery: Delivery[aio_pika.abc.AbstractIncomingMessage]) -> None:
        await delivery.conn.execute("INSERT INTO payments ...")   # commits with the record

    await channel.set_qos(prefetch_count=16)    # at most 16 handlers at once
    async with consume(queue, charge, consumer):
        await stopping.wait()

    await publish(channel.default_exchange, body, message_id=event_id, routing_key="billing")

The key is the message's ``message_id`` (``key=`` picks another, e.g. a header). Outcomes
become: ACK → ``message.ack()``; REQUEUE → wait ``outcome.delay`` seconds, then
``message.nack(requeue=True)``; DEAD_LETTER → ``message.reject(requeue=False)``, which
RabbitMQ routes to the queue's dead-letter exchange: declare one (``x-dead-letter-exchange``
or a policy), or RabbitMQ drops what is refused. docs/consumers.md has the whole story.

Needs ``pip install 'idempo[rabbitmq]'``.

.. versionadded:: 0.1
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from datetime import datetime
from typing import Any

from .._optional import optional_import

with optional_import("idempo.contrib.aio_pika needs aio-pika", extra="rabbitmq"):
    import aio_pika
    from aio_pika.abc import AbstractExchange, AbstractIncomingMessage, AbstractQueue

from .. import validate_key
from ..consumer import Action, AsyncConsumer, Delivery, Envelope, Outcome
from ..policy import utcnow

__all__ = ["consume", "envelope", "message_id", "process", "publish", "settle"]

logger = logging.getLogger("idempo.consumer")

Handler = Callable[[Delivery[AbstractIncomingMessage]], Awaitable[Any]]
KeyOf = Callable[[AbstractIncomingMessage], str | None]


def message_id(message: AbstractIncomingMessage) -> str | None:
    """The default key: the AMQP ``message_id`` property."""
    return message.message_id


def envelope(message: AbstractIncomingMessage, key: KeyOf = message_id) -> Envelope:
    """The core's view of an aio-pika message: its id (``key``), body and timestamp."""
    return Envelope(id=key(message), body=message.body, timestamp=message.timestamp)


async def settle(message: AbstractIncomingMessage, outcome: Outcome) -> None:
    """Tell RabbitMQ what the outcome says.

    A requeue waits ``outcome.delay`` seconds before the nack, holding the message (and a
    prefetch slot) meanwhile: RabbitMQ has no delayed requeue, and a nack at once would hand
    an in-progress message straight back to a consumer (docs/decisions.md).
    """
    if outcome.action is Action.ACK:
        await message.ack()
    elif outcome.action is Action.REQUEUE:
        if outcome.delay > 0:
            await asyncio.sleep(outcome.delay)
        await message.nack(requeue=True)
    else:
        await message.reject(requeue=False)


async def process(
    message: AbstractIncomingMessage,
    handler: Handler,
    consumer: AsyncConsumer,
    *,
    key: KeyOf = message_id,
) -> Outcome:
    """Handle one message through ``consumer`` and ack, requeue or reject it accordingly.

    For a loop of your own (``async for message in queue.iterator(): ...``); `consume`
    runs one for you.
    """
    outcome = await consumer.process(message, envelope(message, key), handler)
    await settle(message, outcome)
    return outcome


@asynccontextmanager
async def consume(
    queue: AbstractQueue,
    handler: Handler,
    consumer: AsyncConsumer,
    *,
    key: KeyOf = message_id,
) -> AsyncIterator[None]:
    """Consume ``queue`` while the block runs, each message in a task of its own.

    The channel's prefetch (``channel.set_qos``) bounds how many run at once. Leaving the
    block stops consuming, hands back messages received but not started, and waits for the
    handlers in flight to finish and settle.
    """
    running: set[asyncio.Task[None]] = set()
    iterator = queue.iterator()
    await iterator.consume()

    async def one(message: AbstractIncomingMessage) -> None:
        try:
            await process(message, handler, consumer, key=key)
        except Exception:
            # Most often the channel went away before the ack: RabbitMQ redelivers the
            # message, and a redelivery of a handled one is answered as a duplicate.
            logger.exception("idempo: message %r was not settled", message.message_id)
            if not message.processed:
                with suppress(Exception):
                    await message.nack(requeue=True)

    async def pull() -> None:
        async for message in iterator:
            task = asyncio.create_task(one(message))
            running.add(task)
            task.add_done_callback(running.discard)

    puller = asyncio.create_task(pull())
    try:
        yield
    finally:
        puller.cancel()
        with suppress(asyncio.CancelledError):
            await puller
        await iterator.close()
        while running:
            await asyncio.gather(*running, return_exceptions=True)


async def publish(
    exchange: AbstractExchange,
    body: bytes,
    *,
    routing_key: str,
    message_id: str,
    timestamp: datetime | None = None,
    **properties: Any,
) -> Any:
    """Publish ``body`` with the event id as its ``message_id`` and a ``timestamp``.

    Mint ``message_id`` once per event and publish every retry of that event with it: the
    consumer deduplicates on it. (aio-pika invents a fresh id for a message that has none,
    so a retried publish would otherwise look like a new event.) Messages are persistent
    unless ``delivery_mode`` says otherwise; other keyword arguments are `aio_pika.Message`
    properties (``headers``, ``content_type``...).

    Args:
        exchange: where to publish (``channel.default_exchange`` routes by queue name).
        body: the message body; the consumer fingerprints it.
        routing_key: the routing key.
        message_id: the event id (1-255 printable ASCII characters).
        timestamp: when the event was published (aware); now by default. The consumer's
            horizon guard reads it.

    Returns:
        The broker's confirmation, as ``exchange.publish`` returns it.
    """
    validate_key(message_id)
    properties.setdefault("delivery_mode", aio_pika.DeliveryMode.PERSISTENT)
    message = aio_pika.Message(
        body, message_id=message_id, timestamp=timestamp or utcnow(), **properties
    )
    return await exchange.publish(message, routing_key=routing_key)
