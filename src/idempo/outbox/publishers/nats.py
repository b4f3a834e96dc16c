"""NATS JetStream through nats-py: the outbox's `Publisher` for ``nats://``.

    publisher = NatsPublisher("nats://127.0.0.1:4222", stream="payments")
    await publisher.publish(message)     # returns once JetStream stored it (its PubAck)
    await publisher.aclose()

Each message is published to the subject ``message.destination`` with its headers and a
``Nats-Msg-Id`` header holding the message id: JetStream drops a copy published again within
the stream's ``duplicate_window`` (its PubAck says ``duplicate``), and idempo's FastStream
middleware reads its key from the same header, so a copy published after the window is
acknowledged as a duplicate downstream. A subject no stream captures raises `PublishError`
(core NATS would drop the message without a word).

Needs nats-py (``pip install 'idempo[outbox-nats]'``; FastStream's ``nats`` extra has it).
"""

from __future__ import annotations

from typing import Any

from ..._optional import optional_import
from .._message import OutboxMessage
from ._base import Lazy, PublishError, redacted

with optional_import("the NATS publisher needs nats-py", extra="outbox-nats"):
    import nats
    import nats.errors
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.errors import APIError, NoStreamResponseError

__all__ = ["NATS_MSG_ID", "NatsPublisher"]

# The server answered (a refusal): the connection is fine and is kept.
_ANSWERED = (APIError, NoStreamResponseError, nats.errors.NoRespondersError)

NATS_MSG_ID = "Nats-Msg-Id"
"""The header JetStream deduplicates publishes on, and where idempo's consumers read the key."""


class NatsPublisher:
    """Publishes outbox messages to NATS JetStream and returns once each was stored.

    Args:
        url: a ``nats://`` URL (``nats://127.0.0.1:4222``); several, comma-separated, for a
            cluster.
        stream: if given, the stream every message must land in (JetStream refuses a
            publish another stream would capture).
        timeout: seconds to wait for the connection and for each PubAck.
        **connect_options: more `nats.connect` options (``user_credentials``, ``tls``...).

    The connection opens on the first publish and is opened again after a failure; the
    publisher reconnects itself rather than letting nats-py buffer publishes in the dark.

    >>> NatsPublisher("nats://127.0.0.1:4222", stream="payments").stream
    'payments'
    """

    def __init__(
        self, url: str, *, stream: str | None = None, timeout: float = 5.0, **connect_options: Any
    ) -> None:
        self.url = url
        self.stream = stream
        self.timeout = timeout
        self.connect_options = connect_options
        self._last_error: BaseException | None = None
        self._client: Lazy[tuple[Client, JetStreamContext]] = Lazy(
            self._connect, _close, _connected
        )

    async def _noted(self, error: Exception) -> None:
        # nats-py reports connection errors here (and otherwise logs them with a traceback);
        # the last one is the cause worth naming when the connect gives up.
        self._last_error = error

    async def _connect(self) -> tuple[Client, JetStreamContext]:
        options: dict[str, Any] = {
            "connect_timeout": self.timeout,
            # One try per server, then fail: the relay's backoff is the retry loop.
            "allow_reconnect": False,
            "max_reconnect_attempts": 1,
            "reconnect_time_wait": 0.1,
            "error_cb": self._noted,
            **self.connect_options,
        }
        self._last_error = None
        try:
            client = await nats.connect(self.url.split(","), **options)
        except nats.errors.NoServersError as exc:
            raise (self._last_error or exc) from exc
        return client, client.jetstream(timeout=self.timeout)

    async def publish(self, message: OutboxMessage) -> None:
        """Publish ``message`` and wait for JetStream's PubAck (a duplicate's too).

        Raises:
            PublishError: the server is unreachable, no stream captures the subject, the
                stream refused it, or no PubAck came in time.
        """
        headers = {**message.headers, NATS_MSG_ID: message.id}
        try:
            _, js = await self._client.get()
            await js.publish(
                message.destination,
                message.body,
                timeout=self.timeout,
                stream=self.stream,
                headers=headers,
            )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            if not isinstance(exc, _ANSWERED):
                await self._client.drop()
            raise PublishError(
                f"NATS JetStream at {redacted(self.url)} did not acknowledge message "
                f"{message.id!r} on subject {message.destination!r}: {_describe(exc)}"
            ) from exc

    async def aclose(self) -> None:
        """Close the connection (a later publish would open a new one)."""
        await self._client.drop()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, nats.errors.NoRespondersError | NoStreamResponseError):
        return "no stream captures this subject (add it to a stream's subjects)"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


async def _close(client: tuple[Client, JetStreamContext]) -> None:
    await client[0].close()


def _connected(client: tuple[Client, JetStreamContext]) -> bool:
    return client[0].is_connected
