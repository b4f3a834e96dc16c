"""FastStream: one middleware runs each delivery once per event id, on any of its brokers.

    from faststream.nats import NatsBroker, NatsRouter, PullSub
    from idempo.consumer import AsyncConsumer, current_delivery
    from idempo.contrib.faststream import IdempotencyMiddleware, publish

    consumer = AsyncConsumer(idem, name="billing.charge", horizon=timedelta(days=7),
                             connection=pool.connection)
    router = NatsRouter(middlewares=[IdempotencyMiddleware(consumer)])

    @router.subscriber("orders.placed", stream="orders", durable="billing", pull_sub=PullSub())
    async def charge(order: Order) -> None:
        delivery = current_delivery()                  # this message's key and connection
        await delivery.conn.execute("INSERT INTO payments ...")   # commits with the record

    broker = NatsBroker()
    broker.include_router(router)

    await publish(broker, order, "orders.placed", event_id=order.id, stream="orders")

The middleware wraps the subscriber's handler in `AsyncConsumer.process` and settles the
message itself from the outcome; FastStream's own acknowledgement then finds it settled.
Per broker, the only differences live in the small ``_WAYS`` table below:

========  ==========================  ========================  ===========================
broker    event id (or ``key=``)      REQUEUE (after delay)     DEAD_LETTER
========  ==========================  ========================  ===========================
RabbitMQ  AMQP ``message_id``         hold, then ``nack``       ``reject``: to the DLX
NATS      ``Nats-Msg-Id`` header      ``nak(delay=...)``        ``term``: never redelivered
Kafka     ``id_header`` header        hold, then seek back      commit past it
Redis     ``id_header`` header/field  left pending (claim it)   ``XACK``: out of the PEL
========  ==========================  ========================  ===========================

``quarantine=`` (an async callable taking the message and its outcome) runs before every
dead-letter action: brokers without a dead-letter queue (Kafka, Redis Streams, NATS) keep
what they refuse only if you copy it somewhere there. A handler's return value is stored with
its record: FastStream publishes it (``reply_to``, ``@publisher``) after the first execution
and again for every duplicate, under an id derived from the event's, so a consumer one hop
down recognises the copies. docs/consumers.md has the whole story.

Needs ``pip install 'idempo[faststream]'`` and FastStream's extra for your broker.

.. versionadded:: 0.1
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from .._optional import optional_import
from ..errors import ConfigurationError

with optional_import("idempo.contrib.faststream needs FastStream", extra="faststream"):
    from faststream import BaseMiddleware
    from faststream.exceptions import SkipMessage

from .. import derive_key, validate_key
from ..consumer import Action, AsyncConsumer, Delivery, Envelope, Outcome, Reason
from ..policy import utcnow

if TYPE_CHECKING:
    from faststream import ContextRepo, StreamMessage

__all__ = [
    "DEFAULT_HEADER",
    "NATS_MSG_ID",
    "IdempotencyMiddleware",
    "jetstream_horizon",
    "publish",
]

logger = logging.getLogger("idempo.consumer")

DEFAULT_HEADER = "message-id"
"""Where the event id travels on Kafka and Redis unless ``id_header=`` says otherwise."""
NATS_MSG_ID = "Nats-Msg-Id"
"""The header JetStream deduplicates publishes on, and the key on NATS."""

KeyOf = Callable[["StreamMessage[Any]"], str | None]
TimeOf = Callable[["StreamMessage[Any]"], datetime | None]
Quarantine = Callable[["StreamMessage[Any]", Outcome], Awaitable[Any]]


# -- what differs per broker -----------------------------------------------------------------


def _text(value: Any) -> str | None:
    """A header value as the key's text (JSON-carried headers may be numbers)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")  # not ASCII: refused as an invalid key
    return str(value)


def _header_id(message: Any, header: str) -> str | None:
    return _text(message.headers.get(header))


def _rabbit_id(message: Any, header: str) -> str | None:
    # Not StreamMessage.message_id: FastStream fills that with a fresh uuid when the AMQP
    # property is absent, and a fresh id per copy would make every redelivery look new.
    return _text(message.raw_message.message_id)


def _nats_id(message: Any, header: str) -> str | None:
    return _text(message.headers.get(NATS_MSG_ID))


def _redis_id(message: Any, header: str) -> str | None:
    found = _header_id(message, header)
    data = message.raw_message.get("data")
    if found is None and isinstance(data, dict):
        # A stream entry written by plain XADD (not FastStream) carries it as a field.
        found = _text(data.get(header.encode()))
    return found


def _millis(value: Any) -> datetime | None:
    if not isinstance(value, int) or value < 0:
        return None
    return datetime.fromtimestamp(value / 1000, UTC)


def _no_time(message: Any) -> datetime | None:
    return None


def _rabbit_time(message: Any) -> datetime | None:
    stamped: datetime | None = message.raw_message.timestamp
    return stamped


def _nats_time(message: Any) -> datetime | None:
    # When JetStream stored it: a republished copy is stored (and stamped) anew.
    raw = message.raw_message
    if not (raw.reply or "").startswith("$JS.ACK."):
        return None  # core NATS: no stream, no metadata
    stored: datetime = raw.metadata.timestamp
    return stored


def _kafka_time(message: Any) -> datetime | None:
    return _millis(getattr(message.raw_message, "timestamp", None))


def _redis_time(message: Any) -> datetime | None:
    # A stream entry's id is "<milliseconds>-<sequence>", the time XADD stored it.
    raw = message.raw_message
    if raw.get("type") != "stream" or not raw.get("message_ids"):
        return None
    first: bytes = raw["message_ids"][0]
    millis, _, _ = first.partition(b"-")
    return _millis(int(millis)) if millis.isdigit() else None


def _unsettled(message: Any) -> bool:
    return message.committed is None


def _nats_unsettled(message: Any) -> bool:
    # FastStream marks core NATS messages (which cannot be acked) as acked on arrival.
    return not message.raw_message._ackd


def _redis_unsettled(message: Any) -> bool:
    # Only a stream read by a consumer group has a pending list to leave a message in.
    raw = message.raw_message
    return message.committed is None and raw.get("type") == "stream" and message.group is not None


async def _hold(delay: float) -> None:
    # The broker would hand a nacked message straight back: wait here instead, holding the
    # message (and its prefetch slot) until it is worth trying again.
    if delay > 0:
        await asyncio.sleep(delay)


async def _rabbit_requeue(message: Any, delay: float) -> None:
    await _hold(delay)
    await message.nack(requeue=True)


async def _nats_requeue(message: Any, delay: float) -> None:
    await message.nack(delay=delay or None)  # JetStream redelivers after the delay


async def _hold_and_nack(message: Any, delay: float) -> None:
    await _hold(delay)
    await message.nack()  # Kafka: seek back to this record, so it is read again


async def _leave_pending(message: Any, delay: float) -> None:
    # Redis has no nack: the entry stays in the group's pending list until a subscriber
    # with ``min_idle_time`` claims it (its idle time is the delay).
    await message.nack()


async def _reject(message: Any) -> None:
    await message.reject()  # RabbitMQ: to the DLX; NATS: term; Kafka: commit past it


async def _rabbit_reject(message: Any) -> None:
    await message.reject(requeue=False)


async def _xack(message: Any) -> None:
    # FastStream's reject leaves a Redis entry pending, to be claimed and refused forever.
    await message.ack()


def _stamp_header(header: str) -> Callable[[Any, str, str], None]:
    def stamp(command: Any, configured: str, event_id: str) -> None:
        command.headers.setdefault(header or configured, event_id)

    return stamp


def _stamp_property(command: Any, configured: str, event_id: str) -> None:
    command.message_options.setdefault("message_id", event_id)


PublishArgs = tuple[tuple[Any, ...], dict[str, Any]]


def _headers(options: dict[str, Any], header: str, event_id: str) -> dict[str, Any]:
    return {**(options.pop("headers", None) or {}), header: event_id}


def _rabbit_args(
    destination: str, event_id: str, header: str, at: datetime, options: dict[str, Any]
) -> PublishArgs:
    options.setdefault("persist", True)
    return (destination,), {"message_id": event_id, "timestamp": at, **options}


def _nats_args(
    destination: str, event_id: str, header: str, at: datetime, options: dict[str, Any]
) -> PublishArgs:
    return (destination,), {"headers": _headers(options, NATS_MSG_ID, event_id), **options}


def _kafka_args(
    destination: str, event_id: str, header: str, at: datetime, options: dict[str, Any]
) -> PublishArgs:
    options.setdefault("timestamp_ms", int(at.timestamp() * 1000))
    return (destination,), {"headers": _headers(options, header, event_id), **options}


def _redis_args(
    destination: str, event_id: str, header: str, at: datetime, options: dict[str, Any]
) -> PublishArgs:
    return (), {"stream": destination, "headers": _headers(options, header, event_id), **options}


@dataclass(frozen=True, slots=True)
class _Way:
    """How one broker carries the event id, and how it takes each outcome."""

    event_id: Callable[[Any, str], str | None]
    timestamp: Callable[[Any], datetime | None]
    unsettled: Callable[[Any], bool]
    requeue: Callable[[Any, float], Awaitable[None]]
    dead_letter: Callable[[Any], Awaitable[None]]
    stamp: Callable[[Any, str, str], None]
    publish_args: Callable[[str, str, str, datetime, dict[str, Any]], PublishArgs] | None = None


_GENERIC = _Way(_header_id, _no_time, _unsettled, _hold_and_nack, _reject, _stamp_header(""))

_WAYS = {
    "rabbit": _Way(
        _rabbit_id,
        _rabbit_time,
        _unsettled,
        _rabbit_requeue,
        _rabbit_reject,
        _stamp_property,
        _rabbit_args,
    ),
    "nats": _Way(
        _nats_id,
        _nats_time,
        _nats_unsettled,
        _nats_requeue,
        _reject,
        _stamp_header(NATS_MSG_ID),
        _nats_args,
    ),
    "kafka": dataclasses.replace(_GENERIC, timestamp=_kafka_time, publish_args=_kafka_args),
    "redis": _Way(
        _redis_id,
        _redis_time,
        _redis_unsettled,
        _leave_pending,
        _xack,
        _stamp_header(""),
        _redis_args,
    ),
}


def _kind(obj: object) -> str:
    """Which FastStream broker a broker or message class comes from ("" if none we know)."""
    for cls in type(obj).__mro__:
        parts = cls.__module__.split(".")
        if len(parts) > 1 and parts[0] == "faststream" and parts[1] in _WAYS:
            return parts[1]
    return ""


# -- the middleware --------------------------------------------------------------------------


class _Settled(SkipMessage):
    """Raised past FastStream's publishers when there is no result to publish; the
    middleware that raised it settles the message and swallows it."""


class IdempotencyMiddleware:
    """A FastStream middleware: each delivery runs through ``consumer`` once per event id.

    Register it where its subscribers are: ``RabbitRouter(middlewares=[...])`` (or any
    broker's router, or the broker itself). One consumer is one operation: give each handler
    that must see every event (a fan-out) a middleware with a consumer of its own name, or
    the second would skip what the first handled.

    The subscribers need an acknowledgement policy that leaves the message to the handler's
    end (FastStream's default for RabbitMQ, NATS JetStream and Redis; on Kafka pass
    ``ack_policy=AckPolicy.ACK``): with ``AckPolicy.ACK_FIRST`` (Kafka's default
    auto-commit) a message is gone before its handler runs, and a transient failure cannot
    be retried (logged at ERROR). Batch subscribers are refused: one event id per message.

    Args:
        consumer: the `AsyncConsumer` (its name, store, horizon, connection, options).
        key: returns a message's event id; replaces the broker's default (AMQP
            ``message_id``, ``Nats-Msg-Id``, the ``id_header`` header or Redis field).
        id_header: the header (Kafka, Redis) or stream field (Redis) holding the event id.
        timestamp: returns when a message was published, for the horizon guard; replaces
            the broker's (AMQP ``timestamp``, JetStream's stored time, the Kafka record's,
            the Redis entry id's).
        quarantine: awaited with the message and its outcome before every dead-letter
            action (e.g. publish it to a dead-letter topic). If it raises, the message is
            requeued instead, so nothing refused is lost.

    >>> from idempo import AsyncIdempotency
    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> consumer = AsyncConsumer(
    ...     AsyncIdempotency(AsyncMemoryStore()), name="orders", horizon=timedelta(hours=1)
    ... )
    >>> middleware = IdempotencyMiddleware(consumer, id_header="event-id")
    >>> middleware.consumer.name
    'orders'

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        consumer: AsyncConsumer,
        *,
        key: KeyOf | None = None,
        id_header: str = DEFAULT_HEADER,
        timestamp: TimeOf | None = None,
        quarantine: Quarantine | None = None,
    ) -> None:
        if not isinstance(consumer, AsyncConsumer):
            raise ConfigurationError(
                "IdempotencyMiddleware needs an AsyncConsumer (FastStream handlers are async)"
            )
        if not isinstance(id_header, str) or not id_header:
            raise ConfigurationError("id_header must name a header")
        self.consumer = consumer
        self.key = key
        self.id_header = id_header
        self.timestamp = timestamp
        self.quarantine = quarantine

    def __call__(self, msg: Any, /, *, context: ContextRepo) -> _Scope:
        """What FastStream calls for each message (and each publish): a per-message scope."""
        return _Scope(self, msg, context=context)

    def envelope(self, message: StreamMessage[Any], way: _Way) -> Envelope:
        """The core's view of a FastStream message."""
        if message.batch_headers or isinstance(message.raw_message, (list, tuple)):
            raise ConfigurationError(
                "idempo's FastStream middleware handles one message per handler call; a "
                "batch has no single event id (subscribe with batch=False)"
            )
        body = message.body
        if not isinstance(body, bytes):
            raise ConfigurationError(f"expected the raw message body as bytes, not {type(body)}")
        key = self.key(message) if self.key else way.event_id(message, self.id_header)
        published = self.timestamp(message) if self.timestamp else way.timestamp(message)
        return Envelope(id=key, body=body, timestamp=published)

    async def settle(self, message: StreamMessage[Any], outcome: Outcome, way: _Way) -> None:
        """Tell the broker what the outcome says (see the table in the module docstring)."""
        try:
            if outcome.action is Action.DEAD_LETTER and self.quarantine is not None:
                outcome = await self._quarantine(self.quarantine, message, outcome)
            if outcome.action is Action.ACK:
                await message.ack()
            elif not way.unsettled(message):
                if outcome.action is Action.REQUEUE:
                    logger.error(
                        "idempo: consumer %r, message %s must be retried but was acknowledged "
                        "before its handler ran (AckPolicy.ACK_FIRST, Kafka auto-commit, core "
                        "NATS or Redis without a consumer group): it will not come back",
                        self.consumer.name,
                        outcome.key,
                    )
            elif outcome.action is Action.REQUEUE:
                await way.requeue(message, outcome.delay)
            else:
                await way.dead_letter(message)
        except Exception:
            # Most often the connection went away: the broker redelivers the message, and a
            # redelivery of a handled one is answered as a duplicate.
            logger.exception(
                "idempo: consumer %r, message %s (%s) was not settled",
                self.consumer.name,
                outcome.key,
                outcome.action.value,
            )

    async def _quarantine(
        self, quarantine: Quarantine, message: StreamMessage[Any], outcome: Outcome
    ) -> Outcome:
        try:
            await quarantine(message, outcome)
        except Exception:
            logger.exception(
                "idempo: consumer %r could not quarantine message %s; requeued instead",
                self.consumer.name,
                outcome.key,
            )
            return dataclasses.replace(
                outcome, action=Action.REQUEUE, delay=self.consumer.retry_delay
            )
        return outcome


class _Scope(BaseMiddleware[Any, Any]):
    """One message's (or one publish's) pass through the middleware."""

    def __init__(self, owner: IdempotencyMiddleware, msg: Any, *, context: ContextRepo) -> None:
        super().__init__(msg, context=context)
        self.owner = owner
        self.message: StreamMessage[Any] | None = None
        self.outcome: Outcome | None = None
        self.way = _GENERIC

    async def consume_scope(
        self, call_next: Callable[[Any], Awaitable[Any]], msg: StreamMessage[Any]
    ) -> Any:
        self.way = _WAYS.get(_kind(msg), _GENERIC)
        envelope = self.owner.envelope(msg, self.way)

        async def handle(delivery: Delivery[StreamMessage[Any]]) -> Any:
            return await call_next(msg)  # FastStream decodes and calls the user's function

        outcome = await self.owner.consumer.process(msg, envelope, handle)
        self.message, self.outcome = msg, outcome
        if outcome.reason in (Reason.EXECUTED, Reason.DUPLICATE) and outcome.error is None:
            # The first execution's result, stored with its record: FastStream publishes it
            # (reply_to, @publisher) now and again for any duplicate, then the message is acked.
            return outcome.result
        raise _Settled

    async def publish_scope(self, call_next: Callable[[Any], Awaitable[Any]], cmd: Any) -> Any:
        outcome = self.outcome
        if outcome is not None and outcome.key is not None:
            # Publishing a handled message's result: every copy gets the same id, derived
            # from the event's, so a consumer of the result recognises the republished ones.
            label = f"{self.owner.consumer.name}->{getattr(cmd, 'destination', '')}"
            self.way.stamp(cmd, self.owner.id_header, derive_key(outcome.key, label))
        return await call_next(cmd)

    async def after_processed(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: Any = None,
    ) -> bool | None:
        outcome, message = self.outcome, self.message
        if outcome is None or message is None:
            return False  # not a message this middleware handled (or it was cancelled)
        settled = isinstance(exc_val, _Settled)
        if exc_val is not None and not settled and outcome.action is Action.ACK:
            # The effect is recorded but its result was not published: have the message
            # redelivered; the duplicate publishes the stored result again.
            logger.warning(
                "idempo: consumer %r, message %s: publishing its result failed (%r); requeued",
                self.owner.consumer.name,
                outcome.key,
                exc_val,
            )
            outcome = dataclasses.replace(
                outcome, action=Action.REQUEUE, delay=self.owner.consumer.retry_delay
            )
        await self.owner.settle(message, outcome, self.way)
        return settled


# -- producers -------------------------------------------------------------------------------


async def publish(
    broker: Any,
    message: Any,
    destination: str,
    *,
    event_id: str,
    timestamp: datetime | None = None,
    id_header: str = DEFAULT_HEADER,
    **options: Any,
) -> Any:
    """Publish ``message`` with its event id where the broker's consumers look for it.

    Mint ``event_id`` once per event and publish every retry of that event with it: the
    consumer deduplicates on it. Where it goes:

    * RabbitMQ: the AMQP ``message_id``, with ``timestamp`` and ``persist=True`` (unless
      ``options`` say otherwise); ``destination`` is the queue (routing key).
    * NATS: the ``Nats-Msg-Id`` header, which JetStream also deduplicates publishes on
      within the stream's ``duplicate_window`` (pass ``stream=`` to get its `PubAck`, whose
      ``duplicate`` says whether the copy was dropped); ``destination`` is the subject.
    * Kafka: the ``id_header`` record header, and ``timestamp_ms``; ``destination`` is the
      topic.
    * Redis: the ``id_header`` header; ``destination`` is a stream.

    Other keyword arguments go to ``broker.publish`` as they are.

    Args:
        broker: a FastStream ``RabbitBroker``, ``NatsBroker``, ``KafkaBroker`` or
            ``RedisBroker``.
        message: the body, as FastStream encodes it (bytes, str, a dict, a model).
        destination: queue, subject, topic or stream.
        event_id: the event's id (1-255 printable ASCII characters).
        timestamp: when the event was published (aware); now by default.
        id_header: the header name on Kafka and Redis (the consumer's ``id_header``).

    Returns:
        What ``broker.publish`` returns.

    Raises:
        InvalidKeyError: ``event_id`` could not be a key; nothing is published.
        ConfigurationError: not a broker this helper knows.
    """
    validate_key(event_id)
    way = _WAYS.get(_kind(broker))
    if way is None or way.publish_args is None:
        raise ConfigurationError(
            f"publish() knows FastStream's Rabbit, NATS, Kafka and Redis brokers, not "
            f"{type(broker).__name__}"
        )
    args, kwargs = way.publish_args(
        destination, event_id, id_header, timestamp or utcnow(), dict(options)
    )
    return await broker.publish(message, *args, **kwargs)


async def jetstream_horizon(broker: Any, stream: str) -> timedelta:
    """How long ``stream`` keeps a message (its ``max_age``): the consumer's horizon.

    A JetStream consumer can be handed any message the stream still holds (a new durable
    replaying from the start, a redelivery after a long outage), so the records must outlive
    the stream's messages: pass this as the consumer's ``horizon`` and a ``ttl`` shorter
    than the stream's retention is a `ConfigurationError` at start-up.

    Args:
        broker: a connected FastStream ``NatsBroker``, or a nats-py ``JetStreamContext``.
        stream: the stream's name.

    Raises:
        ConfigurationError: the stream keeps messages forever (``max_age`` 0): no retention
            can cover that; give the stream a ``max_age`` or pass a horizon of your own.
    """
    js = broker.connection.jetstream() if hasattr(broker, "connection") else broker
    info = await js.stream_info(stream)
    max_age = info.config.max_age
    if not max_age:
        raise ConfigurationError(
            f"stream {stream!r} keeps messages forever (max_age 0), so a consumer may be "
            "handed one after any retention: set the stream's max_age, or pass a horizon"
        )
    return timedelta(seconds=max_age)
