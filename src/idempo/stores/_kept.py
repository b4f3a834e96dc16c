"""Connections a store keeps out of its own pool between calls.

psycopg_pool's checkout and return cost a replay on the store's connection more than the
replay's statement does: a lock, a deque, statistics, an INFO log record each way, the
connection's ``with`` block (a commit that has nothing to commit). A store that owns its
pool keeps the connections its calls used in a list of its own instead, taken with
``pop()`` and given back with ``append()``, each atomic, so no lock is needed, and goes to
the pool only when the list is empty.

What the pool is for still holds:

* **Its size.** A kept connection is still checked out of the pool, so the pool never
  makes more than its ``max_size``. Every user of the store's pool takes a kept connection
  first, and while one waits on the pool, connections given back go to the pool, which
  hands them to it: none waits for one the list holds.
* **Its upkeep.** A connection goes back to the pool within `KEEP_SECONDS` of leaving it
  (when it is given back after that, or when it lies unused at the bottom of the list), so
  the pool's own expiry and shrinking apply to it, only that much later; a connection that
  is broken, or left inside a transaction, goes back at once (the pool rolls back or
  replaces it).
* **A fork.** The parent's connections are not the child's to use: a child starts with an
  empty list.
* **Closing.** Once closed, the list keeps nothing: what it held and what comes back later
  goes to the pool, which closes it.
"""

from __future__ import annotations

import os
from time import monotonic
from typing import Any

from psycopg.pq import ConnStatus, TransactionStatus

# How long a connection stays out of its pool at most, seconds.
KEEP_SECONDS = 60.0

_OK = ConnStatus.OK
_IDLE = TransactionStatus.IDLE

# A kept connection and when it must go back to its pool (monotonic seconds).
Kept = tuple[Any, float]


class KeptConnections:
    """The list itself, and who waits on the pool. The store's faces take a kept connection
    first and give every connection back here; what ``give`` answers goes back to the
    pool."""

    def __init__(self) -> None:
        # Taken with pop() and given back with append(), each atomic: no lock is needed.
        self._idle: list[Kept] = []
        # One entry per caller waiting on the pool: a connection given back then goes to the
        # pool, which hands it to a waiter (a kept one would leave it waiting).
        self._waiting: list[None] = []
        self._pid = os.getpid()
        self.closed = False

    def take(self) -> Kept | None:
        """A kept connection and when it must go back to the pool; or None, and then the
        caller, about to wait on the pool, counts as waiting there (a connection given back
        meanwhile goes to the pool, which hands it to a waiter) until it says `waited`."""
        if self._pid != os.getpid():
            # The parent's sockets are not this process's to use or to close.
            self._idle = []
            self._pid = os.getpid()
        idle = self._idle
        try:
            return idle.pop()
        except IndexError:  # none kept (another thread may have taken the last one just now)
            pass
        self._waiting.append(None)
        try:  # once more: one may have been given back just before the caller counted
            kept = idle.pop()
        except IndexError:
            return None
        self._waiting.pop()
        return kept

    def waited(self) -> None:
        """The caller that `take` found none for has its connection from the pool."""
        self._waiting.pop()

    def give(self, conn: Any, until: float) -> Any:
        """Keep ``conn``, taken from the pool with ``until`` as its time; what to give back
        to the pool now, or None: ``conn`` itself when it cannot be kept (its time is up,
        it is closed, broken or inside a transaction), a kept one when someone waits on the
        pool, or the one kept longest unused when its time is up."""
        pgconn = conn.pgconn
        if (
            self.closed
            or until < monotonic()
            or pgconn.status != _OK
            or pgconn.transaction_status != _IDLE
        ):
            return conn
        idle, kept = self._idle, (conn, until)
        idle.append(kept)
        if self.closed:  # closed meanwhile: unless closing took it, it is the pool's again
            return _removed(idle, kept)
        if self._waiting or idle[0][1] < monotonic():
            try:
                return idle.pop(0)[0]
            except IndexError:  # another thread took it
                return None
        return None

    def drain(self) -> list[Any]:
        """What is kept now, for the pool."""
        kept, self._idle = self._idle, []
        return [conn for conn, _ in kept]

    def close(self) -> list[Any]:
        """Keep nothing from now on: what was kept, for the pool."""
        self.closed = True
        return self.drain()


def _removed(idle: list[Kept], kept: Kept) -> Any:
    try:
        idle.remove(kept)
    except ValueError:  # taken meanwhile
        return None
    return kept[0]
