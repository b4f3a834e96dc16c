"""What the relay hands a publisher, and what a publisher promises: the outbox's one seam
between the database half (staging, the relay) and the broker half (`publishers`).

    class Printer:
        async def publish(self, message: OutboxMessage) -> None:
            print(message.id, message.destination, message.body)
        async def aclose(self) -> None:
            pass
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["OutboxMessage", "Publisher"]


@dataclass(frozen=True, slots=True)
class OutboxMessage:
    """One staged message, as the relay publishes it.

    Attributes:
        id: the message id, derived from the idempotency scope that staged it: the
            downstream dedupe key (AMQP ``message_id``, ``Nats-Msg-Id``, a stream field).
            The same on every re-execution of the handler and on every republish.
        destination: where it goes, as the publisher reads it (an exchange and routing key,
            a subject, a stream).
        body: the payload bytes.
        headers: extra headers the handler staged.
        attempts: how many times a relay tried to publish it before (0 the first time).

    >>> OutboxMessage("m-1", "orders", b"{}", {}, 0).attempts
    0
    """

    id: str
    destination: str
    body: bytes
    headers: Mapping[str, str]
    attempts: int


@runtime_checkable
class Publisher(Protocol):
    """**Protocol:** hands staged messages to a broker (see `idempo.outbox.publishers`)."""

    async def publish(self, message: OutboxMessage) -> None:
        """Return only once the broker confirmed it (publisher confirms, a JetStream ack,
        XADD's reply). Raise on failure: the relay retries later with backoff."""
        ...

    async def aclose(self) -> None:
        """Close the broker connection."""
        ...
