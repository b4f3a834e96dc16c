"""RabbitMQ through aio-pika, with publisher confirms: the outbox's `Publisher` for ``amqp://``.

    publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:5672/", exchange="events")
    await publisher.publish(message)     # returns once RabbitMQ confirmed it
    await publisher.aclose()

Each message goes to ``exchange`` (the default exchange unless named, which routes by queue
name) with ``message.destination`` as its routing key, the message id as the AMQP
``message_id`` (where `idempo.contrib.aio_pika` and the FastStream middleware read the key),
its headers as AMQP headers, a ``timestamp`` (for the consumers' horizon guard) and
persistent delivery. A message RabbitMQ cannot route anywhere is returned and raises
`PublishError` rather than vanishing (``mandatory``), so the relay keeps it until a queue is
bound.

Needs ``pip install 'idempo[rabbitmq]'``.
"""

from __future__ import annotations

from ..._optional import optional_import
from ...policy import utcnow
from .._message import OutboxMessage
from ._base import Lazy, PublishError, redacted

with optional_import("the RabbitMQ publisher needs aio-pika", extra="rabbitmq"):
    import aio_pika
    from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

__all__ = ["RabbitMQPublisher"]


class RabbitMQPublisher:
    """Publishes outbox messages to RabbitMQ and returns once the broker confirmed each.

    Args:
        url: an ``amqp://`` or ``amqps://`` URL (``amqp://guest:guest@127.0.0.1:5672/``).
        exchange: the exchange to publish to; ``""`` (the default exchange) routes each
            message to the queue named by its destination. A named exchange must exist
            already (it is looked up, never declared).
        timeout: seconds to wait for the connection and for each confirm.
        mandatory: refuse a message no queue would receive (`PublishError`) instead of
            letting RabbitMQ drop it.
        persistent: persistent delivery (survives a broker restart on a durable queue).

    The connection opens on the first publish and is opened again after a failure.

    >>> publisher = RabbitMQPublisher("amqp://guest:guest@127.0.0.1:5672/", exchange="events")
    >>> publisher.exchange
    'events'
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "",
        timeout: float = 10.0,
        mandatory: bool = True,
        persistent: bool = True,
    ) -> None:
        self.url = url
        self.exchange = exchange
        self.timeout = timeout
        self.mandatory = mandatory
        self.delivery_mode = (
            aio_pika.DeliveryMode.PERSISTENT if persistent else aio_pika.DeliveryMode.NOT_PERSISTENT
        )
        self._connection: Lazy[AbstractConnection] = Lazy(self._connect, _close, _connected)
        self._exchange: Lazy[tuple[AbstractChannel, AbstractExchange]] = Lazy(
            self._open_exchange, _close_channel, _usable
        )

    async def _connect(self) -> AbstractConnection:
        return await aio_pika.connect(self.url, timeout=self.timeout)

    async def _open_exchange(self) -> tuple[AbstractChannel, AbstractExchange]:
        connection = await self._connection.get()
        # Confirms on, and a returned (unroutable) message raises instead of being dropped.
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        if not self.exchange:
            return channel, channel.default_exchange
        return channel, await channel.get_exchange(self.exchange, ensure=True)

    async def publish(self, message: OutboxMessage) -> None:
        """Publish ``message`` and wait for RabbitMQ's confirm.

        Raises:
            PublishError: the broker is unreachable, the exchange does not exist, the
                message was nacked or returned unroutable, or no confirm came in time.
        """
        amqp = aio_pika.Message(
            message.body,
            message_id=message.id,
            headers=dict(message.headers),
            timestamp=utcnow(),
            delivery_mode=self.delivery_mode,
        )
        try:
            _, exchange = await self._exchange.get()
            await exchange.publish(
                amqp,
                routing_key=message.destination,
                mandatory=self.mandatory,
                timeout=self.timeout,
            )
        except _FAILURES as exc:
            # Whatever broke, the next publish starts from a fresh channel (and connection).
            await self._exchange.drop()
            if not isinstance(exc, _REFUSED):
                await self._connection.drop()
            raise PublishError(
                f"RabbitMQ at {redacted(self.url)} did not confirm message {message.id!r} "
                f"(exchange {self.exchange!r}, routing key {message.destination!r}): "
                f"{_describe(exc)}"
            ) from exc

    async def aclose(self) -> None:
        """Close the connection (a later publish would open a new one)."""
        await self._exchange.drop()
        await self._connection.drop()


_FAILURES = (
    OSError,
    TimeoutError,
    aio_pika.exceptions.AMQPError,
    aio_pika.exceptions.ChannelInvalidStateError,  # the channel closed under a publish
)
# The broker answered, so the connection is fine: only the channel is replaced.
_REFUSED = (aio_pika.exceptions.PublishError, aio_pika.exceptions.DeliveryError)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aio_pika.exceptions.PublishError):
        return "returned unroutable: no queue is bound for this routing key"
    if isinstance(exc, aio_pika.exceptions.DeliveryError):
        return "nacked by the broker"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _close(connection: AbstractConnection) -> None:
    await connection.close()


async def _close_channel(opened: tuple[AbstractChannel, AbstractExchange]) -> None:
    await opened[0].close()


def _connected(connection: AbstractConnection) -> bool:
    return not connection.is_closed


def _usable(opened: tuple[AbstractChannel, AbstractExchange]) -> bool:
    return not opened[0].is_closed
