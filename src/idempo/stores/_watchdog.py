"""A bound on how long a store's own connection may go without an answer.

A server that stops answering after the store connected (frozen, partitioned away behind a
host that still acknowledges TCP) would hold a call for ever: TCP keepalives and
``tcp_user_timeout`` never fire while the peer's kernel acknowledges, and psycopg has no
client-side statement timeout. So each call on one of the store's connections is noted here
with its start, and one thread per store, started on first use, shuts down the socket of
a connection whose call has waited longer than the bound plus the lock wait in force on
that connection (a lock wait is silence too: a statement waiting on a row lock sends
nothing). The driver then sees the connection end, fails the
call (`StoreUnavailableError`) and drops the connection; its pool makes a new one.

The caller's cost is two dict operations per call (a context manager would cost as much
again), no thread or timer of its own:

    watchdog = Watchdog(5.0, socket_of=lambda conn: conn.pgconn.socket)
    watchdog.watch(conn)
    try:
        ...  # the call's statements
    except Exception as exc:
        raise watchdog.failure(conn, exc)
    finally:
        watchdog.done(conn)
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

from ..errors import StoreUnavailableError

# A thread with nothing to watch for this long ends. Seconds.
IDLE_EXIT_SECONDS = 10.0
# How much later than a deadline the thread wakes (a timer may fire a little early).
_SLACK = 0.01
_FOREVER = float("inf")


class Watchdog:
    """Cuts off a connection whose call has waited more than ``bound`` seconds plus
    ``lock_wait(conn)`` for the server. ``socket_of(conn)``: the connection's socket file
    descriptor."""

    def __init__(
        self,
        bound: float,
        socket_of: Callable[[Any], int],
        lock_wait: Callable[[Any], float] | None = None,
        *,
        server: str = "the store",
    ) -> None:
        self.bound = bound
        self.server = server
        self._socket_of = socket_of
        self._lock_wait = lock_wait or _no_wait
        # conn -> when its call began; written by callers, read by the thread (the GIL keeps
        # each single dict operation atomic, so neither side takes a lock).
        self._busy: dict[Any, float] = {}
        self.cut: set[int] = set()  # id() of the connections cut off, until they are done
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._starting = threading.Lock()

    def watch(self, conn: Any, allowance: float = 0.0) -> None:
        """A call on ``conn`` begins; ``allowance``: seconds it may wait beyond the bound
        and the lock wait (a lock of its own that waits no longer than that)."""
        self._busy[conn] = monotonic() + allowance
        if self._thread is None:
            self._start()

    def done(self, conn: Any) -> bool:
        """The call on ``conn`` is over; whether it was cut off."""
        self._busy.pop(conn, None)
        if not self.cut:
            return False
        key = id(conn)
        if key in self.cut:
            self.cut.discard(key)
            return True
        return False

    def failure(self, conn: Any, exc: Exception) -> Exception:
        """What the failure of the call on ``conn`` means: ``exc`` itself, or, when the
        connection was cut off here, that the server did not answer (``exc`` its cause)."""
        if not self.done(conn):
            return exc
        error = StoreUnavailableError(
            f"{self.server} did not answer within {self.bound:g} s (read_timeout) past the"
            " call's lock wait; the connection was closed"
        )
        error.__cause__ = exc
        return error

    def _start(self) -> None:
        with self._starting:
            # An infinite bound (a read timeout turned off) needs no thread.
            if self._thread is None and not self._stopped.is_set() and self.bound < _FOREVER:
                thread = threading.Thread(target=self._run, name="idempo-watchdog", daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        busy, bound, lock_wait, cut = self._busy, self.bound, self._lock_wait, self.cut
        idle_since = monotonic()
        # It sleeps until the first deadline: a call that begins meanwhile has its own
        # later than that, and with nothing to watch no deadline comes sooner than ``bound``.
        wait = bound
        while not self._stopped.wait(wait):
            now = monotonic()
            wait = bound
            if busy:
                idle_since = now
            elif now - idle_since > IDLE_EXIT_SECONDS and self._retire():
                return
            for conn, began in list(busy.items()):
                left = began + bound + lock_wait(conn) - now
                if left > 0:
                    wait = min(wait, left)
                # Still the same call (not done, not a later one on the same connection).
                elif id(conn) not in cut and busy.get(conn) == began:
                    self._cut(conn)
            wait += _SLACK

    def _retire(self) -> bool:
        """Whether the thread may end, idle (a store nobody closes leaves no thread behind);
        the next call starts another. Cleared first, then checked: a call that came in
        meanwhile either sees no thread and starts one, or is seen here."""
        me = threading.current_thread()
        with self._starting:
            self._thread = None
            if not self._busy:
                return True
            self._thread = me
            return False

    def _cut(self, conn: Any) -> None:
        try:
            fd = self._socket_of(conn)
        except Exception:  # noqa: BLE001 - closed meanwhile: nothing left to cut
            return
        self.cut.add(id(conn))
        # A socket object of our own on a duplicate of the descriptor: shutting it down ends
        # the connection for the driver (its wait wakes, its read finds the end); closing
        # the duplicate leaves the driver's descriptor for the driver to close.
        try:
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return

    def close(self) -> None:
        self._stopped.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)


def _no_wait(conn: Any) -> float:
    return 0.0
