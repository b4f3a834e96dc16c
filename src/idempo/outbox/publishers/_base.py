"""What every publisher shares: the error it raises, and one connection opened on first use,
dropped on failure and opened again on the next publish."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

from ...errors import PublishError

__all__ = ["Lazy", "PublishError", "redacted"]

T = TypeVar("T")


def redacted(url: str) -> str:
    """``url`` without its password, for messages.

    >>> redacted("amqp://guest:secret@127.0.0.1:5672/")
    'amqp://guest:***@127.0.0.1:5672/'
    """
    return re.sub(r"(//[^/@:]*):[^/@]*@", r"\1:***@", url)


class Lazy(Generic[T]):
    """One connection (or channel, or client), opened by ``open`` on first use.

    ``get`` opens it (once, however many publishes wait for it); ``drop`` forgets a connection
    that failed, closing it with ``close``, so the next ``get`` opens a fresh one. A relay
    thus rides out a broker restart without being restarted itself.
    """

    def __init__(
        self,
        open: Callable[[], Awaitable[T]],
        close: Callable[[T], Awaitable[object]],
        alive: Callable[[T], bool] = lambda _: True,
    ) -> None:
        self._open = open
        self._close = close
        self._alive = alive
        self._value: T | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> T:
        value = self._value
        if value is not None and self._alive(value):
            return value
        async with self._lock:
            if self._value is not None and not self._alive(self._value):
                await self.drop()
            if self._value is None:
                self._value = await self._open()
            return self._value

    async def drop(self) -> None:
        value, self._value = self._value, None
        if value is not None:
            # It failed already: closing it is best effort.
            with contextlib.suppress(Exception):
                await self._close(value)
