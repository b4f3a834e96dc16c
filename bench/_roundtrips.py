"""Count client/server round trips with a small loopback TCP proxy in front of PostgreSQL.

A round trip is counted each time a client starts sending after the server last sent on
that connection. A pipelined burst (several messages written before any reply arrives)
therefore counts once, and server-initiated traffic (notices, notifications) counts for
nothing. The count is summed over every connection that goes through the proxy, so a
library that spreads one call over a pool of connections is charged for all of them.

The proxy adds latency of its own, so it is only for counting, never for timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any

_CHUNK_BYTES = 64 * 1024


class _Exchange:
    """Turn-taking on one proxied connection: a new client turn is a new round trip."""

    def __init__(self, on_round_trip: Callable[[], None]) -> None:
        self._on_round_trip = on_round_trip
        # True at the start so the very first client bytes open a round trip too.
        self._server_spoke_last = True

    def client_sent(self) -> None:
        if self._server_spoke_last:
            self._server_spoke_last = False
            self._on_round_trip()

    def server_sent(self) -> None:
        self._server_spoke_last = True


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_data: Callable[[], None]
) -> None:
    """Forward one direction until EOF, noting each chunk before it is forwarded.

    Noting before forwarding matters: the peer cannot answer bytes it has not received,
    so the turn is always recorded before any reply to it can arrive.
    """
    try:
        while data := await reader.read(_CHUNK_BYTES):
            on_data()
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        # Closing our outbound side ends the opposite pump too: one hang-up tears down both.
        writer.close()


class RoundTripProxy:
    """Forward 127.0.0.1:<port> to the upstream server and count round trips.

    The proxy runs its own asyncio loop in a daemon thread, so synchronous and
    asynchronous clients in the main process can both use it.
    """

    def __init__(self, upstream_host: str = "127.0.0.1", upstream_port: int = 5432) -> None:
        self._upstream = (upstream_host, upstream_port)
        self._lock = threading.Lock()
        self._round_trips = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="roundtrip-proxy", daemon=True
        )
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self.port = 0

    def __enter__(self) -> RoundTripProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result()
        self.port = self._server.sockets[0].getsockname()[1]

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def reset(self) -> None:
        with self._lock:
            self._round_trips = 0

    @property
    def round_trips(self) -> int:
        with self._lock:
            return self._round_trips

    def _count(self) -> None:
        with self._lock:
            self._round_trips += 1

    async def _listen(self) -> asyncio.Server:
        # Port 0: the OS picks a free ephemeral port, so parallel runs never collide.
        return await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def _handle(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        # Tracked so stop() can wait for connections a client left open.
        task = asyncio.current_task()
        if task is not None:
            self._connections.add(task)
        try:
            await self._relay(client_reader, client_writer)
        finally:
            if task is not None:
                self._connections.discard(task)

    async def _relay(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        try:
            server_reader, server_writer = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_writer.close()
            return
        writers = (client_writer, server_writer)
        self._writers.update(writers)
        exchange = _Exchange(self._count)
        try:
            await asyncio.gather(
                _pump(client_reader, server_writer, exchange.client_sent),
                _pump(server_reader, client_writer, exchange.server_sent),
            )
        finally:
            for writer in writers:
                writer.close()
                self._writers.discard(writer)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        # Closing the sockets ends the pumps normally. Cancelling the handler tasks instead
        # would trip asyncio.start_server's done-callback, which logs a cancelled handler.
        for writer in list(self._writers):
            writer.close()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
