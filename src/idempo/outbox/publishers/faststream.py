"""Any FastStream broker as the outbox's `Publisher`: how Kafka is reached.

    from faststream.kafka import KafkaBroker
    publisher = FastStreamPublisher(KafkaBroker("127.0.0.1:9092"))
    await publisher.publish(message)
    await publisher.aclose()

It publishes through `idempo.contrib.faststream.publish`, which puts the message id where
idempo's FastStream middleware reads it on each broker: the AMQP ``message_id`` on RabbitMQ,
``Nats-Msg-Id`` on NATS, the ``message-id`` header (``id_header``) on Kafka and Redis. The
broker is connected on the first publish; `aclose` stops it if this publisher connected it.

What "confirmed" means is the broker's: FastStream's RabbitBroker waits for the publisher
confirm, KafkaBroker for the partition leader's acknowledgement (raise the producer's
``acks`` to ``"all"`` for replicas too), RedisBroker for XADD's reply. On NATS a publish is
acknowledged only with ``stream=`` (JetStream's PubAck), so a NatsBroker without one is
refused. Kafka is not tested against a real Kafka server in idempo's own suite (there is none
on its test machines); RabbitMQ, NATS and Redis are.

Needs ``pip install 'idempo[faststream]'`` and FastStream's extra for the broker.
"""

from __future__ import annotations

from typing import Any

from ...contrib.faststream import DEFAULT_HEADER, publish
from ...errors import ConfigurationError, IdempotencyError
from .._message import OutboxMessage
from ._base import PublishError

__all__ = ["FastStreamPublisher"]


class FastStreamPublisher:
    """Publishes outbox messages through a FastStream broker (RabbitMQ, NATS, Kafka, Redis).

    Args:
        broker: a FastStream ``RabbitBroker``, ``NatsBroker``, ``KafkaBroker`` or
            ``RedisBroker``; connected on first use unless it is already.
        id_header: the header holding the id on Kafka and Redis (the consumers'
            ``id_header``).
        **publish_options: passed to every ``broker.publish`` (``stream=`` on NATS,
            ``exchange=`` on RabbitMQ...).

    Raises:
        ConfigurationError: a NatsBroker without ``stream=`` (core NATS confirms nothing).

    >>> from faststream.kafka import KafkaBroker
    >>> FastStreamPublisher(KafkaBroker("127.0.0.1:9092")).id_header
    'message-id'
    """

    def __init__(self, broker: Any, *, id_header: str = DEFAULT_HEADER, **publish_options: Any):
        kind = type(broker).__module__.split(".")
        if kind[:2] == ["faststream", "nats"] and "stream" not in publish_options:
            raise ConfigurationError(
                "FastStreamPublisher on a NatsBroker needs stream=: without it a publish is "
                "core NATS, which confirms nothing (or use NatsPublisher)"
            )
        self.broker = broker
        self.id_header = id_header
        self.publish_options = publish_options
        self._connected_here = False

    async def publish(self, message: OutboxMessage) -> None:
        """Publish ``message`` and return once the broker confirmed it.

        Raises:
            PublishError: the broker could not be reached or did not confirm it.
        """
        options = {**self.publish_options, "headers": dict(message.headers)}
        try:
            if not self._connected_here and not _is_connected(self.broker):
                await self.broker.connect()
                self._connected_here = True
            await publish(
                self.broker,
                message.body,
                message.destination,
                event_id=message.id,
                id_header=self.id_header,
                **options,
            )
        except IdempotencyError:
            raise
        except Exception as exc:
            raise PublishError(
                f"{type(self.broker).__name__} did not confirm message {message.id!r} to "
                f"{message.destination!r}: {type(exc).__name__}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        """Stop the broker if this publisher connected it."""
        if self._connected_here:
            self._connected_here = False
            await self.broker.stop()


def _is_connected(broker: Any) -> bool:
    # FastStream's connect() is idempotent; this only tells whether this publisher made it.
    return getattr(broker, "_connection", None) is not None
