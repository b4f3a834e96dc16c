"""The relay: publishes what handlers staged, marks it sent, retries what failed.

    relay = Relay("postgresql://app@db/app", publisher)
    await relay.drain()                 # once, until nothing is due
    async with relay.running():         # or in the background, inside an app
        ...

Delivery is at least once: a relay that dies after the broker confirmed a message and before
its mark committed publishes it again. The message keeps its id, so a consumer that
deduplicates on it (idempo's consumers do) applies it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, NamedTuple, TypeVar

from ..errors import ConfigurationError, CorruptRecordError, SchemaMissingError, StoreError
from ..events import Emitter, Kind, Observer, dormancy
from ._db import RelayDb, open_db
from ._message import OutboxMessage, Publisher
from ._sql import OutboxSql, Publish, outbox_table

__all__ = ["Drained", "Relay", "exponential_backoff"]

_logger = logging.getLogger("idempo.outbox")

T = TypeVar("T")

Backoff = Callable[[int], timedelta]


def exponential_backoff(
    base: timedelta = timedelta(seconds=1),
    cap: timedelta = timedelta(minutes=5),
    *,
    jitter: float = 0.5,
    rng: Callable[[], float] = random.random,
) -> Backoff:
    """The wait before a failed message's next try, from how many tries it had before:
    ``base * 2**tries``, at most ``cap``, less a random part of up to ``jitter`` of it (so
    relays that failed together do not all come back at the same instant).

    >>> delay = exponential_backoff(jitter=0)
    >>> [delay(n).total_seconds() for n in (0, 1, 2, 20)]
    [1.0, 2.0, 4.0, 300.0]
    """
    if not 0 <= jitter <= 1:
        raise ConfigurationError(f"jitter is a fraction between 0 and 1, not {jitter!r}")

    def delay(tries: int) -> timedelta:
        # Past 2**40 tries the doubling would overflow a timedelta long after passing cap.
        span = cap if tries >= 40 else min(cap, base * 2**tries)
        return span * (1 - jitter * rng())

    return delay


async def _finished(work: Coroutine[Any, Any, T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile (then raise the
    cancellation after it): marks that the broker's confirms call for are not thrown away by
    a shutdown that arrives while they are being written. Bounded by the database's own
    lock wait."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            await task
        raise


class Drained(NamedTuple):
    """What `Relay.drain` did: messages published (and marked sent), and tries that failed
    (each retried later)."""

    sent: int
    failed: int


@dataclass(frozen=True, slots=True)
class _Settings:
    batch: int
    poll: float
    lease: timedelta
    publish_timeout: float


class Relay:
    """Publishes staged messages through a `Publisher` and marks them sent.

    Args:
        store: a store URL (``postgresql://``, ``sqlite:///``, ``mysql://``; the relay opens
            its own connection) or an async SQL store (``AsyncPostgresStore``, ...).
        publisher: where messages go (`idempo.outbox.publishers.open_publisher`); the relay
            does not close it.
        table: the outbox table; by default ``idempo_outbox`` beside the store's records.
        batch: messages per claim (and per transaction on PostgreSQL and MariaDB).
        poll: seconds between claims when nothing was due.
        backoff: the wait before a failed message's next try, from its tries so far
            (`exponential_backoff` by default: 1 s doubling up to 5 min, with jitter).
        clock: an injected clock (tests); None: the database's.
        lease: SQLite only: how long a claimed message is hidden from other relays while
            this one publishes it (there, a claim is a lease, not a row lock).
        publish_timeout: seconds a publish may take before it counts as failed.
        observers: `idempo.events` observers told of each message published
            (``Kind.PUBLISHED``) or not (``Kind.PUBLISH_FAILED``, with its ``error``), on the
            ``relay`` surface: the event's ``operation`` is the destination, its key the
            message id. `idempo.otel.OpenTelemetryObserver` makes a span and a count of each.

    Several relays may run at once: PostgreSQL and MariaDB claim with ``FOR UPDATE SKIP
    LOCKED``, so each message is claimed by one relay at a time; SQLite's claims are write
    transactions, one at a time, that lease what they took.

    >>> Relay("sqlite:///app.db", publisher=None, batch=0)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    idempo.errors.ConfigurationError: batch must be at least 1, not 0
    """

    def __init__(
        self,
        store: Any,
        publisher: Publisher,
        *,
        table: str | None = None,
        batch: int = 100,
        poll: float = 1.0,
        backoff: Backoff | None = None,
        clock: Callable[[], datetime] | None = None,
        lease: timedelta = timedelta(seconds=60),
        publish_timeout: float = 30.0,
        observers: Sequence[Observer] = (),
    ) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ConfigurationError(f"batch must be at least 1, not {batch!r}")
        if not poll > 0 or not publish_timeout > 0 or not lease > timedelta(0):
            raise ConfigurationError("poll, publish_timeout and lease must be more than 0 seconds")
        if table is not None:
            OutboxSql.of("postgresql", table)  # validates the name now
        self._store = store
        self.publisher = publisher
        self._table = table
        self._settings = _Settings(batch, float(poll), lease, float(publish_timeout))
        self._backoff = backoff or exponential_backoff()
        self._observers = tuple(observers)
        self._dormant = dormancy(self._observers)
        self._clock = clock
        self._db: RelayDb | None = None
        self._sql: OutboxSql | None = None
        self.sent = 0
        self.failed = 0

    # -- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> Relay:
        """Open the relay's connection and read the outbox once, so that a database that
        cannot be reached or an outbox never migrated fails here, at once, rather than
        being retried by `run` for ever."""
        try:
            await self.stats()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the relay's database connection (and the store it opened from a URL)."""
        db, self._db = self._db, None
        if db is not None:
            await db.aclose()

    async def _open(self) -> tuple[RelayDb, OutboxSql]:
        if self._db is None or self._sql is None:
            db = await open_db(self._store)
            self._sql = OutboxSql.of(db.name, self._table or outbox_table(db.table))
            self._db = db
        return self._db, self._sql

    async def stats(self) -> dict[str, int]:
        """The backlog: ``pending``, ``failing`` (pending, tried before) and ``sent``."""
        db, sql = await self._open()
        result: dict[str, int] = await db.run(sql.stats(), self._publish)
        return result

    # -- work -----------------------------------------------------------------------------
    async def drain(self) -> Drained:
        """Publish until nothing is due (what failed waits for its backoff); what was done.

        Raises `StoreError` if the database fails (nothing is marked that was not sent).
        """
        sent = failed = 0
        while True:
            done, missed = await self.step()
            sent, failed = sent + done, failed + missed
            if done + missed < self._settings.batch or done == 0:
                return Drained(sent, failed)

    async def step(self) -> Drained:
        """Claim one batch, publish it, and mark it: what was done."""
        db, sql = await self._open()
        settings = self._settings
        now = None if self._clock is None else self._clock()
        if sql.locks:
            sent, failed = await db.run(sql.batch(settings.batch, now, self._delay), self._publish)
        else:
            claimed = await db.run(sql.claim(settings.batch, now, settings.lease), self._publish)
            if not claimed:
                return Drained(0, 0)
            confirmed: list[str] = []
            try:
                failures = await self._publish(Publish(tuple(claimed)), confirmed)
            except BaseException:
                # Cancelled mid-batch: what the broker confirmed is marked sent and the rest
                # is due again at once, rather than hidden until its lease ends.
                rest: dict[str, str | None] = {m.id: None for m in claimed}
                for id_ in confirmed:
                    del rest[id_]
                settle = sql.settle_published(claimed, rest, now, self._delay)
                with contextlib.suppress(Exception):
                    await _finished(db.run(settle, self._publish))
                raise
            now = None if self._clock is None else self._clock()
            settle = sql.settle_published(claimed, failures, now, self._delay)
            await _finished(db.run(settle, self._publish))
            failed = sum(1 for error in failures.values() if error is not None)
            sent = len(claimed) - len(failures)
        self.sent += sent
        self.failed += failed
        return Drained(sent, failed)

    async def run(self) -> None:
        """Relay for ever: a batch, and a pause of ``poll`` seconds whenever one was not full.
        A database that fails is retried (its error logged), with a growing pause; a schema
        that is missing or a row that cannot be read ends it. Cancel the task to stop: a
        batch in flight rolls back, and what it had published is published again later."""
        failures = 0
        while True:
            try:
                done, missed = await self.step()
            except (SchemaMissingError, CorruptRecordError):
                raise
            except StoreError as exc:
                failures += 1
                pause = min(self._settings.poll * 2**failures, 30.0)
                _logger.warning(
                    "outbox relay: the database failed (%s); again in %.1f s", exc, pause
                )
                await asyncio.sleep(pause)
                continue
            failures = 0
            if done + missed < self._settings.batch:
                await asyncio.sleep(self._settings.poll)

    def start(self) -> asyncio.Task[None]:
        """`run` as a task of the running loop; cancel it to stop (then ``await
        relay.aclose()``), or use `running`."""
        return asyncio.get_running_loop().create_task(self.run(), name="idempo-outbox-relay")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[asyncio.Task[None]]:
        """Run the relay in the background for the block, inside an app:

            async with relay.running():
                await serve(app)

        On leaving, the task is cancelled and awaited and the connection closed. A relay
        that failed for good (a missing table) raises its error there.
        """
        task = self.start()
        try:
            yield task
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await self.aclose()

    # -- publishing -----------------------------------------------------------------------
    def _delay(self, message: OutboxMessage) -> timedelta:
        return self._backoff(message.attempts)

    async def _publish(
        self, op: Publish, confirmed: list[str] | None = None
    ) -> Mapping[str, str | None]:
        """Publish in order; stop at the first failure. The answer maps each message that was
        not confirmed to why (None: not tried, an earlier one failed, so it goes back as it
        was: a broker that is down costs one try per batch, not one per message). The ids
        confirmed so far are appended to ``confirmed`` as they are."""
        failures: dict[str, str | None] = {}
        timeout = self._settings.publish_timeout
        for message in op.messages:
            if failures:
                failures[message.id] = None
                continue
            heard = self._emitter(message)
            try:
                async with asyncio.timeout(timeout):
                    await self.publisher.publish(message)
                if confirmed is not None:
                    confirmed.append(message.id)
                if heard is not None:
                    heard.emit(Kind.PUBLISHED)
            except Exception as exc:  # noqa: BLE001 - any failure is a retry later
                if heard is not None:
                    heard.emit(Kind.PUBLISH_FAILED, error=exc)
                why = (
                    f"no confirmation within {timeout:g} s"
                    if isinstance(exc, TimeoutError)
                    else (f"{type(exc).__name__}: {exc}")
                )
                _logger.warning(
                    "outbox relay: publishing message %s to %r failed (try %d): %s",
                    message.id,
                    message.destination,
                    message.attempts + 1,
                    why,
                )
                failures[message.id] = why
        return failures

    def _emitter(self, message: OutboxMessage) -> Emitter | None:
        if not self._observers or (self._dormant is not None and self._dormant()):
            return None
        return Emitter(
            self._observers,
            operation=message.destination,
            key=message.id,
            store=self._db.name if self._db is not None else "outbox",
            surface="relay",
            reveal=True,  # a message id is derived from a key, never a key: it is safe to show
        )
