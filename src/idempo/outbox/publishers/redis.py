"""Redis Streams through redis-py: the outbox's `Publisher` for ``redis://``.

    publisher = RedisStreamsPublisher("redis://127.0.0.1:6379/0")
    await publisher.publish(message)     # returns with XADD's reply: the entry id
    await publisher.aclose()

Each message becomes one entry of the stream ``message.destination`` (under ``<prefix>:``
with ``?prefix=``) with three fields:
``message-id`` (the message id), ``body`` (the bytes as they are) and ``headers`` (a JSON
object). ``message-id`` is the field idempo's FastStream middleware falls back to on Redis
(its default ``id_header``), so a consumer group reading the stream through it skips a
republished copy. Redis keeps no publish-side dedupe window: that copy is stored, and it is
the consumer that recognises it.

Needs ``pip install 'idempo[redis]'``.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from ..._optional import optional_import
from .._message import OutboxMessage
from ._base import Lazy, PublishError, redacted

with optional_import("the Redis Streams publisher needs redis-py", extra="redis"):
    import redis.exceptions
    from redis.asyncio import Redis

__all__ = ["RedisStreamsPublisher"]

ID_FIELD = "message-id"
"""The field holding the message id: ``DEFAULT_HEADER`` of `idempo.contrib.faststream`."""


class RedisStreamsPublisher:
    """Appends outbox messages to Redis Streams (XADD) and returns with each entry's id.

    Args:
        url: a ``redis://`` or ``rediss://`` URL (``redis://127.0.0.1:6379/0``); a
            ``?prefix=`` in it is taken as ``prefix``.
        id_field: the field that carries the message id (the consumers' ``id_header``).
        body_field: the field that carries the body.
        headers_field: the field that carries the headers, as a JSON object.
        maxlen: trim each stream to about this many entries (``XADD MAXLEN ~``); None keeps
            them all. Trimming must leave the consumers time to read what they have not.
        timeout: seconds for the connection and each command.
        prefix: if given, each message goes to the stream ``<prefix>:<destination>``, the
            namespace idempo's Redis store keeps its keys under.

    >>> RedisStreamsPublisher("redis://127.0.0.1:6379/0").id_field
    'message-id'
    >>> RedisStreamsPublisher("redis://127.0.0.1:6379/0?prefix=app").stream("payments")
    'app:payments'
    """

    def __init__(
        self,
        url: str,
        *,
        id_field: str = ID_FIELD,
        body_field: str = "body",
        headers_field: str = "headers",
        maxlen: int | None = None,
        timeout: float = 5.0,
        prefix: str | None = None,
    ) -> None:
        parts = urlsplit(url)
        query = dict(parse_qsl(parts.query))
        # redis-py would take ?prefix= as a connection option it does not have.
        prefix = query.pop("prefix", None) if prefix is None else prefix
        query.pop("prefix", None)
        self.url = url
        self.prefix = prefix or None
        self._connect_url = urlunsplit(parts._replace(query=urlencode(query)))
        self.id_field = id_field
        self.body_field = body_field
        self.headers_field = headers_field
        self.maxlen = maxlen
        self.timeout = timeout
        self._client: Lazy[Redis] = Lazy(self._connect, _close)

    async def _connect(self) -> Redis:
        return Redis.from_url(
            self._connect_url, socket_connect_timeout=self.timeout, socket_timeout=self.timeout
        )

    def stream(self, destination: str) -> str:
        """The stream key a message for ``destination`` is added to."""
        return f"{self.prefix}:{destination}" if self.prefix else destination

    async def client(self) -> Redis:
        """The publisher's redis-py client (connected on first use), e.g. to read a stream."""
        return await self._client.get()

    def fields(self, message: OutboxMessage) -> dict[str, Any]:
        """The entry's fields for ``message``."""
        return {
            self.id_field: message.id,
            self.body_field: message.body,
            self.headers_field: json.dumps(dict(message.headers), sort_keys=True),
        }

    async def publish(self, message: OutboxMessage) -> None:
        """XADD ``message`` to its stream; returns once Redis replied with the entry id.

        Raises:
            PublishError: Redis is unreachable, timed out or refused the command (the key
                holds something that is not a stream, a read-only replica...).
        """
        try:
            client = await self._client.get()
            await client.xadd(
                self.stream(message.destination),
                self.fields(message),  # type: ignore[arg-type]  # bytes values are fine
                maxlen=self.maxlen,
                approximate=True,
            )
        except (OSError, redis.exceptions.RedisError) as exc:
            if isinstance(exc, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
                await self._client.drop()
            raise PublishError(
                f"Redis at {redacted(self.url)} did not add message {message.id!r} to stream "
                f"{message.destination!r}: {type(exc).__name__}: {exc}"
            ) from exc

    async def aclose(self) -> None:
        """Close the connection pool (a later publish would open a new one)."""
        await self._client.drop()


async def _close(client: Redis) -> None:
    await client.aclose()
