"""An in-process publisher: messages go to a list (and, if given, a callback), not a broker.

For tests, and for ``idempo demo``, which runs the whole path (HTTP request, outbox, relay,
consumer) with nothing but SQLite::

    publisher = MemoryPublisher(deliver=handle)     # handle(message) is awaited per publish
    ...
    assert [m.id for m in publisher.published] == [...]
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from .._message import OutboxMessage

__all__ = ["MemoryPublisher"]


class MemoryPublisher:
    """Keeps every message it is handed, in order, and awaits ``deliver`` with each.

    Args:
        deliver: awaited with each message before `publish` returns, as a broker would
            hand it to a consumer; if it raises, the publish raises (not confirmed), and
            the message is still counted in ``published`` (it may have been delivered, as
            with a lost confirm).

    >>> import asyncio
    >>> publisher = MemoryPublisher()
    >>> asyncio.run(publisher.publish(OutboxMessage("m-1", "orders", b"{}", {}, 0)))
    >>> [message.id for message in publisher.published]
    ['m-1']
    """

    def __init__(self, deliver: Callable[[OutboxMessage], Awaitable[object]] | None = None):
        self.deliver = deliver
        self.published: list[OutboxMessage] = []
        self.closed = False

    async def publish(self, message: OutboxMessage) -> None:
        """Keep ``message``, then hand it to ``deliver``."""
        self.published.append(message)
        if self.deliver is not None:
            await self.deliver(message)

    async def aclose(self) -> None:
        """Mark the publisher closed (nothing to release)."""
        self.closed = True
