"""The hot commands of a store's own client, sent straight on pooled connections.

redis-py's client spends more on each command than Redis does: ``execute_command`` checks a
connection out of the pool and back in (about 60 k instructions in redis-py 8: a lock, a
readiness poll, connection-count metrics), wraps the call in observability timing and
response callbacks, and only then sends it (about 40 k). A fresh guarded call makes two such
commands. `Lane` keeps the connections it has used in a list of its own between calls, so
a command costs the sending and the reading and the client's retry, nothing more.

It is used for the store's own client only (built from the URL). An app's client is used as
the app set it up: its pool may be bounded and shared, and its commands may be instrumented
by the app. The pipeline, scripts loading and the rare commands keep going through the
client.
"""

from __future__ import annotations

import os
from typing import Any

import redis
import redis.exceptions


class Lane:
    """Send one command and read its reply on a connection of ``client``'s pool that is kept
    for the next command (each one used by one caller at a time).

        lane = Lane(redis.Redis.from_url("redis://localhost:6379/0"))
        lane.call("SET", "k", b"v", "NX", "GET", "PX", 1000)  # None, or the value found
        lane.close()
    """

    def __init__(self, client: redis.Redis) -> None:
        self._pool = client.connection_pool
        # Taken with pop() and given back with append(), each atomic: no lock is needed.
        self._idle: list[Any] = []
        self._pid = os.getpid()

    def call(self, *args: Any) -> Any:
        """The reply to command ``args``, raw (no response callback); a connection that
        broke is retried as the client's retry says, and an error reply is raised."""
        if self._pid != os.getpid():
            self._forked()
        try:
            conn = self._idle.pop()
        except IndexError:
            conn = self._pool.get_connection()
        try:
            return conn.retry.call_with_retry(
                lambda: _send(conn, args), lambda _error: conn.disconnect()
            )
        except redis.exceptions.ResponseError:
            raise  # Redis answered: the connection is in step
        except BaseException:
            # A reply may be half read (a timeout, an interrupt): the next caller must not
            # read it as its own. A disconnected connection connects again when next used.
            conn.disconnect()
            raise
        finally:
            self._idle.append(conn)

    def _forked(self) -> None:
        # The parent's sockets are not this process's to use or to close.
        self._idle = []
        self._pid = os.getpid()

    def close(self) -> None:
        """Give every kept connection back to the pool (the client's close then closes it)."""
        while self._idle:
            self._pool.release(self._idle.pop())


def _send(conn: Any, args: tuple[Any, ...]) -> Any:
    conn.send_command(*args)
    return conn.read_response()


def lane_for(client: Any, owned: bool) -> Lane | None:
    """A `Lane` for the store's own single-server client; None where the client must carry
    every command itself (the app's client, a cluster, a client with one connection)."""
    if not owned or type(client) is not redis.Redis or client.connection is not None:
        return None
    return Lane(client)
