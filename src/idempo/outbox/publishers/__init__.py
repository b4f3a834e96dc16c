"""Publishers: hand staged outbox messages to a broker and return once it confirmed them.

    from idempo.outbox.publishers import open_publisher

    publisher = open_publisher("amqp://guest:guest@127.0.0.1:5672/", exchange="payments")
    publisher = open_publisher("nats://127.0.0.1:4222", stream="payments")
    publisher = open_publisher("redis://127.0.0.1:6379/0")

==========================  =========================  ===========================================
URL                         publisher                  the message id travels as
==========================  =========================  ===========================================
``amqp://``, ``amqps://``   `RabbitMQPublisher`        the AMQP ``message_id`` (publisher confirms)
``nats://``                 `NatsPublisher`            the ``Nats-Msg-Id`` header (JetStream PubAck)
``redis://``, ``rediss://`` `RedisStreamsPublisher`    the ``message-id`` field (XADD's reply)
==========================  =========================  ===========================================

Each puts the id where idempo's own consumers read the key on that broker
(`idempo.contrib.aio_pika`, `idempo.contrib.faststream`), so a message published twice (the
relay died between the broker's confirm and marking it sent) is applied once downstream.
`FastStreamPublisher` wraps any FastStream broker (it is how Kafka is reached);
`MemoryPublisher` keeps messages in process, for tests and the demo. Every publisher raises
`PublishError` when the broker did not confirm, and has ``aclose()``.

The broker modules import their client only when used: ``open_publisher("nats://...")``
without nats-py installed is a `ConfigurationError` naming the extra to install.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ...errors import ConfigurationError
from .._message import OutboxMessage, Publisher
from ._base import PublishError
from .memory import MemoryPublisher

if TYPE_CHECKING:
    from .faststream import FastStreamPublisher
    from .nats import NatsPublisher
    from .rabbitmq import RabbitMQPublisher
    from .redis import RedisStreamsPublisher

__all__ = [
    "FastStreamPublisher",
    "MemoryPublisher",
    "NatsPublisher",
    "OutboxMessage",
    "PublishError",
    "Publisher",
    "RabbitMQPublisher",
    "RedisStreamsPublisher",
    "open_publisher",
]

SCHEMES = ("amqp", "amqps", "nats", "redis", "rediss")

_LAZY = {
    "FastStreamPublisher": "faststream",
    "NatsPublisher": "nats",
    "RabbitMQPublisher": "rabbitmq",
    "RedisStreamsPublisher": "redis",
}


def __getattr__(name: str) -> Any:
    # The broker classes load their client library on first use, not on this import.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module  # noqa: PLC0415

    return getattr(import_module(f"{__name__}.{module}"), name)


def open_publisher(url: str, **options: Any) -> Publisher:
    """The publisher for ``url``'s scheme; ``options`` go to its constructor.

    ``amqp://`` / ``amqps://`` → `RabbitMQPublisher` (``exchange=``, ``timeout=``...),
    ``nats://`` → `NatsPublisher` (``stream=``...), ``redis://`` / ``rediss://`` →
    `RedisStreamsPublisher` (``maxlen=``...). Nothing connects until the first publish.

    Raises:
        ConfigurationError: another scheme (Kafka goes through `FastStreamPublisher`), a
            URL with no scheme, or the broker's client library is not installed.

    >>> open_publisher("redis://127.0.0.1:6379/0")
    <idempo.outbox.publishers.redis.RedisStreamsPublisher object at ...>
    >>> open_publisher("kafka://127.0.0.1:9092")
    Traceback (most recent call last):
    ...
    idempo.errors.ConfigurationError: no outbox publisher for kafka:// URLs; ...
    """
    scheme = urlsplit(url).scheme.lower() if isinstance(url, str) else ""
    if scheme in ("amqp", "amqps"):
        from .rabbitmq import RabbitMQPublisher  # noqa: PLC0415 - aio-pika only when asked

        return RabbitMQPublisher(url, **options)
    if scheme == "nats":
        from .nats import NatsPublisher  # noqa: PLC0415

        return NatsPublisher(url, **options)
    if scheme in ("redis", "rediss"):
        from .redis import RedisStreamsPublisher  # noqa: PLC0415

        return RedisStreamsPublisher(url, **options)
    shown = f"{scheme}://" if scheme else repr(url)
    raise ConfigurationError(
        f"no outbox publisher for {shown} URLs; open_publisher knows amqp://, amqps:// "
        "(RabbitMQ), nats:// (NATS JetStream), redis:// and rediss:// (Redis Streams). For "
        "Kafka, wrap a FastStream KafkaBroker in FastStreamPublisher."
    )
