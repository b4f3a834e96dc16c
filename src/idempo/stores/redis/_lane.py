"""The hot commands of a store's own client, sent straight on pooled connections.

redis-py's client spends more on each command than Redis does: ``execute_command`` checks a
connection out of the pool and back in (about 60 k instructions in redis-py 8: a lock, a
readiness poll, connection-count metrics), wraps the call in observability timing and
response callbacks, and only then sends it (about 40 k). A fresh guarded call makes two such
commands. `Lane` keeps the connections it has used in a list of its own between calls, so
a command costs the sending and the reading and the client's retry, nothing more. It packs
the command itself too: redis-py's packer encodes each argument through a Python call or two
(a replay's ``SET NX GET`` has seven), where hiredis's ``pack_command`` takes them all in C.

It is used for the store's own client only (built from the URL). An app's client is used as
the app set it up: its pool may be bounded and shared, and its commands may be instrumented
by the app. The pipeline, scripts loading and the rare commands keep going through the
client.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import functools
import os
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio
import redis.exceptions

Packer = Callable[[tuple[Any, ...]], bytes]


def _hiredis_pack() -> Packer | None:
    try:
        from hiredis import pack_command  # noqa: PLC0415 - optional: redis-py's is too
    except ImportError:  # pragma: no cover - the redis extra installs hiredis
        return None
    return pack_command


def packer(encoder: Any) -> Packer:
    """How a lane packs a command (a tuple of str, bytes and int, its name one word) into
    the bytes redis-py's own packer would give, with the client's ``encoder``: hiredis's,
    which encodes a str as UTF-8 (strict), when that is the client's encoding; else every
    argument through the encoder, as redis-py does."""
    pack = _hiredis_pack()
    utf8 = codecs.lookup(encoder.encoding).name == "utf-8"
    if pack is not None and utf8 and encoder.encoding_errors == "strict":
        return pack
    return functools.partial(_packed, encoder.encode)


def _packed(encode: Callable[[Any], bytes], args: tuple[Any, ...]) -> bytes:
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        item = encode(arg)
        parts.append(b"$%d\r\n%b\r\n" % (len(item), item))
    return b"".join(parts)


# How many forks this process is away from the one that imported this module: a lane
# compares it with its own on every call, where asking getpid() would be a system call.
_forks = 0


def _forked() -> None:
    global _forks  # noqa: PLW0603 - one counter for the whole process, moved only by a fork
    _forks += 1


os.register_at_fork(after_in_child=_forked)


class _Kept:
    """The connections a lane keeps between calls, by process: what both faces share."""

    def __init__(self, client: Any) -> None:
        self._pool = client.connection_pool
        self._pack = packer(client.get_encoder())
        # Taken with pop() and given back with append(), each atomic: no lock is needed.
        self._idle: list[Any] = []
        self._forks = _forks

    def _kept(self) -> Any:
        """A kept connection, or None when there is none to take."""
        if self._forks != _forks:
            # The parent's sockets are not this process's to use or to close.
            self._idle = []
            self._forks = _forks
        try:
            return self._idle.pop()
        except IndexError:  # none kept (another thread may have taken the last one just now)
            return None


class Lane(_Kept):
    """Send one command and read its reply on a connection of ``client``'s pool that is kept
    for the next command (each one used by one caller at a time).

        lane = Lane(redis.Redis.from_url("redis://localhost:6379/0"))
        lane.call("SET", "k", b"v", "NX", "GET", "PX", 1000)  # None, or the value found
        lane.close()
    """

    def call(self, *args: Any) -> Any:
        """The reply to command ``args``, raw (no response callback); a connection that
        broke is retried as the client's retry says, and an error reply is raised."""
        conn = self._kept()
        if conn is None:
            conn = self._pool.get_connection()
        # Partials, not lambdas: no closure cells, and no Python frame between the retry
        # and the send.
        send = functools.partial(_send, conn, self._pack(args))
        try:
            return conn.retry.call_with_retry(send, functools.partial(_drop, conn))
        except redis.exceptions.ResponseError:
            raise  # Redis answered: the connection is in step
        except BaseException:
            # A reply may be left unread (an interrupt between the send and the read): the
            # next caller must not read it as its own. A disconnected connection connects
            # again when next used.
            conn.disconnect()
            raise
        finally:
            self._idle.append(conn)

    def close(self) -> None:
        """Give every kept connection back to the pool (the client's close then closes it)."""
        while self._idle:
            self._pool.release(self._idle.pop())


class AsyncLane(_Kept):
    """`Lane` for redis-py's asyncio client.

    A call cancelled while its reply is on the way keeps its connection out of use until
    that reply has been read, in the background; `settled` waits for such replies. So a
    command sent once they are read (the undo of a cancelled reservation, on whichever
    connection) reaches Redis after the cancelled one, which a command on another connection
    could overtake. Every other failure between the send and the read disconnects the
    connection (redis-py's asyncio connection disconnects itself when a send is interrupted),
    so no reply is ever left for the next caller.
    """

    def __init__(self, client: Any) -> None:
        super().__init__(client)
        self._owed: set[asyncio.Task[None]] = set()

    async def call(self, *args: Any) -> Any:
        """`Lane.call`, awaited."""
        conn = self._kept()
        if conn is None:
            conn = await self._pool.get_connection()
        send = functools.partial(_asend, conn, self._pack(args))
        try:
            reply = await conn.retry.call_with_retry(send, functools.partial(_drop, conn))
        except redis.exceptions.ResponseError:
            self._idle.append(conn)  # Redis answered: the connection is in step
            raise
        except asyncio.CancelledError:
            # Still connected: the command went whole (redis-py disconnects on a send cut
            # short) and its reply is owed.
            if conn.is_connected:
                self._read_later(conn)
            else:
                self._idle.append(conn)
            raise
        except BaseException:
            await conn.disconnect(nowait=True)  # a reply may come late (a timeout)
            self._idle.append(conn)
            raise
        self._idle.append(conn)
        return reply

    def _read_later(self, conn: Any) -> None:
        task = asyncio.get_running_loop().create_task(self._read_owed(conn))
        self._owed.add(task)
        task.add_done_callback(self._owed.discard)

    async def _read_owed(self, conn: Any) -> None:
        try:
            # An error reply is read whole; any other failure (the connection's timeout
            # among them) disconnected it.
            with contextlib.suppress(Exception):
                await conn.read_response()
        finally:
            self._idle.append(conn)

    async def settled(self, within: float) -> None:
        """Return once every reply owed to a cancelled call has been read, or ``within``
        seconds later."""
        if self._owed:
            await asyncio.wait(tuple(self._owed), timeout=within)

    async def aclose(self) -> None:
        """`Lane.close`, awaited (the replies still owed are given up on)."""
        for task in tuple(self._owed):
            task.cancel()
        if self._owed:
            await asyncio.wait(tuple(self._owed))
        while self._idle:
            await self._pool.release(self._idle.pop())


def _drop(conn: Any, _error: BaseException) -> Any:
    """What the retry does on a broken connection: it connects again when next used."""
    return conn.disconnect()


def _send(conn: Any, packed: bytes) -> Any:
    conn.send_packed_command((packed,))  # the sync face sends each item of what it is given
    return conn.read_response()


async def _asend(conn: Any, packed: bytes) -> Any:
    await conn.send_packed_command(packed)
    # `AsyncLane.call` decides what becomes of the connection when the read fails: a
    # cancelled read leaves it connected, its reply still to read.
    return await conn.read_response(disconnect_on_error=False)


def lane_for(client: Any, owned: bool) -> Lane | None:
    """A `Lane` for the store's own single-server client; None where the client must carry
    every command itself (the app's client, a cluster, a client with one connection)."""
    if not owned or type(client) is not redis.Redis or client.connection is not None:
        return None
    if getattr(client.connection_pool, "cache", None) is not None:
        return None  # redis-py's client-side cache reads its invalidations on each command
    return Lane(client)


def async_lane_for(client: Any, owned: bool) -> AsyncLane | None:
    """`lane_for`, for redis-py's asyncio client."""
    if not owned or type(client) is not redis.asyncio.Redis or client.connection is not None:
        return None
    return AsyncLane(client)
