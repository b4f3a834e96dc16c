"""`idempo demo`: a retry storm against the example payments API, served on loopback.

The example API (`idempo.example`) runs in a server process of its own. Each intent (a payment
one customer wants) gets one key, and several concurrent clients send it, each through
`idempo.client.IdempotentTransport`, which retries timeouts, dropped connections, 5xx and
409-in-progress with the same key. Some intents hold their reservation a while
(``X-Demo-Delay-Ms``), so duplicates arrive in flight; some first meet a transient failure
(``X-Demo-Fail``); some are declined; some keys are reused later with another payload. Partway
through, the server is SIGKILLed with requests in flight and started again on the same store.

Each payment stages a "payment.captured" event in the outbox, in the payment's transaction.
Meanwhile a relay (`idempo.outbox.Relay`) publishes them to an in-process publisher that hands
each to an idempo consumer; now and then the publisher loses the confirm of a message it did
deliver (as when a relay dies between the broker's confirm and marking the message sent), so
the relay publishes it again and the consumer must skip the copy.

Exactly-once is then checked against the data, not the clients' word: every caller of an
intent got the same bytes, the ledger holds one payment and one charge per paid intent, no
intent was charged twice, and every payment's event was applied downstream once: none lost,
none applied twice. (On Redis there is no outbox: no event is staged or counted.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx

from .client import IdempotentTransport, RetryPolicy
from .consumer import AsyncConsumer, Delivery, Envelope, Reason
from .example.backends import backend_kind
from .example.server import ExampleServer
from .guard import AsyncIdempotency
from .outbox import OutboxMessage, Relay, exponential_backoff
from .outbox.publishers import MemoryPublisher
from .stores.memory import AsyncMemoryStore

__all__ = ["Events", "Report", "Tally", "backend_kind", "run_storm"]

# Short, so the storm also shows a crashed server's keys coming free; renewed while handlers live.
DEMO_LEASE_SECONDS = 2.0
DECLINED_CARD = "4000000000000002"
GOOD_CARD = "4242424242424242"


@dataclass(frozen=True)
class Intent:
    """One payment a customer wants, and how the storm will treat it."""

    key: str
    user: str
    amount: int
    card: str
    delay_ms: int = 0
    flaky: bool = False
    reused: bool = False  # the key is sent again later with another amount

    def body(self, amount: int | None = None) -> dict[str, Any]:
        return {"amount": amount or self.amount, "currency": "EUR", "card": self.card}

    def headers(self) -> dict[str, str]:
        headers = {"Idempotency-Key": self.key, "Authorization": f"Bearer {self.user}"}
        if self.delay_ms:
            headers["X-Demo-Delay-Ms"] = str(self.delay_ms)
        return headers


@dataclass
class Tally:
    """What the clients saw, counted as it happened (every attempt, retries included)."""

    requests: int = 0
    replays: int = 0
    conflicts: int = 0
    in_progress: int = 0
    transient: int = 0
    dropped: int = 0
    unanswered: int = 0
    in_flight: int = 0
    delayed_in_flight: int = 0
    cut_off_by_crash: int = 0
    answers: dict[str, set[tuple[int, bytes]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **counts: int) -> None:
        with self.lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def answer(self, key: str, status: int, body: bytes) -> None:
        with self.lock:
            self.answers.setdefault(key, set()).add((status, body))


@dataclass(frozen=True)
class Events:
    """The "payment.captured" events, from the outbox to the consumer that applied them.

    Attributes:
        staged: events the payments staged (the outbox's rows, a delta over the run).
        published: distinct events the relay published.
        publishes: publish calls, the relay's retries included.
        lost_confirms: publishes delivered whose confirm the publisher then lost, so the
            relay published them again.
        deliveries: messages handed to the consumer, copies included.
        applied: distinct events the consumer applied.
        applied_twice: events applied more than once (must be 0).
        duplicates: copies the consumer recognised and skipped.
    """

    staged: int
    published: int
    publishes: int
    lost_confirms: int
    deliveries: int
    applied: int
    applied_twice: int
    duplicates: int

    @property
    def lost(self) -> int:
        """Staged events never applied (must be 0)."""
        return max(self.staged - self.applied, 0)


@dataclass(frozen=True)
class Report:
    """The outcome, from the clients' answers and the server's ledger (before/after deltas)."""

    intents: int
    tally: Tally
    ledger: dict[str, int]
    paid: int
    declined: int
    reused: int
    crashes: int
    events: Events | None = None  # None on Redis: no outbox there
    server_log: str | None = None  # the server's last lines, when exactly-once did not hold

    @property
    def inconsistent(self) -> int:
        """Intents whose callers did not all get the same status and bytes."""
        return sum(1 for answers in self.tally.answers.values() if len(answers) != 1)

    @property
    def exactly_once(self) -> bool:
        return (
            self.inconsistent == 0
            and self.tally.unanswered == 0
            and len(self.tally.answers) == self.intents
            and self.ledger["payments"] == self.paid
            and self.ledger["charges"] == self.paid
            and self.ledger["double_charges"] == 0
            and self.tally.conflicts == self.reused
            and (self.events is None or self._events_once(self.events))
        )

    def event_rows(self) -> list[tuple[str, int | str]]:
        """The report's rows for the "payment.captured" events (`idempo demo` prints them)."""
        events = self.events
        if events is None:
            return [("payment.captured events", "none: no outbox on Redis")]
        return [
            ("payment.captured events staged (with their payments)", events.staged),
            ("events published by the relay", events.published),
            ("confirms lost after delivery (published again)", events.lost_confirms),
            ("deliveries to the consumer (copies included)", events.deliveries),
            ("copies skipped by the consumer (duplicates)", events.duplicates),
            ("events applied downstream", events.applied),
            ("events lost", events.lost),
            ("events applied twice", events.applied_twice),
        ]

    def _events_once(self, events: Events) -> bool:
        return (
            events.staged == self.paid
            and events.lost == 0
            and events.applied_twice == 0
            and events.applied == events.staged
        )


class _Counting(httpx.BaseTransport):
    """Sees every attempt the retrying transport makes, so the report can count them."""

    def __init__(self, inner: httpx.BaseTransport, tally: Tally) -> None:
        self.inner = inner
        self.tally = tally

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        delayed = int("x-demo-delay-ms" in request.headers)
        self.tally.add(requests=1, in_flight=1, delayed_in_flight=delayed)
        try:
            response = self.inner.handle_request(request)
            response.read()
        except httpx.TransportError:
            self.tally.add(dropped=1)
            raise
        finally:
            self.tally.add(in_flight=-1, delayed_in_flight=-delayed)
        if response.status_code == 409:
            self.tally.add(in_progress=1)
        elif response.status_code >= 500:
            self.tally.add(transient=1)
        return response

    def close(self) -> None:
        self.inner.close()


def _plan(intents: int, rng: random.Random) -> list[Intent]:
    users = [f"user-{n}" for n in range(5)]
    return [
        Intent(
            key=str(uuid.uuid4()),
            user=rng.choice(users),
            amount=rng.randint(100, 100_000),
            card=DECLINED_CARD if rng.random() < 0.05 else GOOD_CARD,
            delay_ms=rng.randint(100, 400) if rng.random() < 0.1 else 0,
            flaky=rng.random() < 0.1,
            reused=rng.random() < 0.05,
        )
        for _ in range(intents)
    ]


@contextmanager
def _clients(
    base: str, tally: Tally, concurrency: int
) -> Iterator[tuple[httpx.Client, httpx.Client]]:
    """A retrying client for the callers, and a plain one for single, unretried requests."""
    limits = httpx.Limits(max_connections=concurrency * 2)
    # Generous: a caller rides out the crash, the restart and the dead server's lease.
    policy = RetryPolicy(max_attempts=50, deadline=90, backoff_base=0.05, backoff_max=0.5)
    retrying = IdempotentTransport(
        _Counting(httpx.HTTPTransport(limits=limits), tally), policy=policy
    )
    single = _Counting(httpx.HTTPTransport(), tally)
    with (
        httpx.Client(base_url=base, transport=retrying, timeout=30) as client,
        httpx.Client(base_url=base, transport=single, timeout=30) as once,
    ):
        yield client, once


def _caller(
    client: httpx.Client, once: httpx.Client, tally: Tally, intent: Intent, first: bool
) -> None:
    """One client: sends its intent (retrying inside the transport) and notes the answer."""
    if first and intent.flaky:
        # A transient failure before any charge: the key is released, a retry runs it. The
        # crash may cut this request off too: a dropped connection is as transient.
        with contextlib.suppress(httpx.TransportError):
            once.post(
                "/payments",
                json=intent.body(),
                headers={**intent.headers(), "X-Demo-Fail": "transient"},
            )
    try:
        response = client.post("/payments", json=intent.body(), headers=intent.headers())
    except httpx.TransportError:
        tally.add(unanswered=1)
        return
    if response.status_code not in (201, 402):
        tally.add(unanswered=1)
        return
    if response.headers.get("idempotent-replayed") == "true":
        tally.add(replays=1)
    tally.answer(intent.key, response.status_code, response.content)


def _reuse(once: httpx.Client, tally: Tally, intent: Intent) -> None:
    """A client bug: the same key with another amount. It must be refused, never run."""
    response = once.post("/payments", json=intent.body(intent.amount + 1), headers=intent.headers())
    if response.status_code == 422:
        tally.add(conflicts=1)


def run_storm(
    url: str | None = None,
    *,
    intents: int = 200,
    retries: int = 4,
    concurrency: int = 16,
    crash: bool = True,
    seed: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_start: Callable[[str], None] | None = None,
) -> Report:
    """Serve the example API on ``url`` (default: a fresh SQLite file), storm it, report.

    ``on_start`` hears the store URL before the storm. The server's log and the default
    store live in a temporary directory removed at the end; when the storm fails, or does
    not hold, the log's last lines are in the error or in `Report.server_log`.
    """
    if url is not None:
        backend_kind(url)  # an unsupported store is one clear error, before anything starts
    with tempfile.TemporaryDirectory(prefix="idempo-demo-") as workdir:
        url = url or f"sqlite:///{Path(workdir) / 'demo.db'}"
        if on_start is not None:
            on_start(url)
        rng = random.Random(seed)
        server = ExampleServer(url, Path(workdir) / "server.log", lease=DEMO_LEASE_SECONDS)
        server.start()
        relay = None if backend_kind(url) == "redis" else _RelayThread(url, rng.random())
        try:
            # The lost confirms are on purpose: the report counts them, the log need not.
            with _quiet("idempo.outbox"):
                report = _run(server, relay, intents, retries, concurrency, crash, rng, on_progress)
        except Exception as exc:
            raise RuntimeError(
                f"{exc}\nthe example server's last lines:\n{server.log_tail()}"
            ) from exc
        if report.exactly_once:
            return report
        return dataclasses.replace(report, server_log=server.log_tail())


def _run(
    server: ExampleServer,
    relay: _RelayThread | None,
    intents: int,
    retries: int,
    concurrency: int,
    crash: bool,
    rng: random.Random,
    on_progress: Callable[[int, int], None] | None,
) -> Report:
    try:
        if relay is not None:
            relay.start()
        report = _storm(server, intents, retries, concurrency, crash, rng, on_progress)
        if relay is None:
            return report
        return dataclasses.replace(report, events=relay.finish(report.ledger["events"]))
    finally:
        if relay is not None:
            relay.stop()
        server.stop()


@contextmanager
def _quiet(name: str) -> Iterator[None]:
    """The ``name`` logger silenced for the block, as it was after."""
    log = logging.getLogger(name)
    propagate, log.propagate = log.propagate, False
    silent = logging.NullHandler()
    log.addHandler(silent)
    try:
        yield
    finally:
        log.removeHandler(silent)
        log.propagate = propagate


class _RelayThread:
    """A relay on the demo's database, publishing to an in-process publisher that hands each
    message to an idempo consumer; its own event loop, in a thread beside the storm."""

    # About one message in eight first loses its confirm after it was delivered.
    LOST_CONFIRM = 0.125

    def __init__(self, url: str, seed: float) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.consumer = AsyncConsumer(
            AsyncIdempotency(AsyncMemoryStore()), name="ledger.captured", horizon=timedelta(0)
        )
        self.publisher = MemoryPublisher(self._deliver)
        self.applied: Counter[str] = Counter()
        self.deliveries = 0
        self.lost_confirms = 0
        self.expected: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, name="idempo-demo-relay", daemon=True)
        self.error: BaseException | None = None

    async def _apply(self, delivery: Delivery[OutboxMessage]) -> None:
        self.applied[delivery.key] += 1  # the downstream effect

    async def _deliver(self, message: OutboxMessage) -> None:
        self.deliveries += 1
        await self.consumer.process(message, Envelope(message.id, message.body), self._apply)
        if message.attempts == 0 and self.rng.random() < self.LOST_CONFIRM:
            self.lost_confirms += 1
            raise ConnectionError("the broker's confirm was lost (the message was delivered)")

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        try:
            asyncio.run(self._relay())
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self.error = exc

    async def _relay(self) -> None:
        backoff = exponential_backoff(timedelta(milliseconds=50), timedelta(seconds=1), jitter=0)
        async with Relay(self.url, self.publisher, poll=0.05, backoff=backoff) as relay:
            # Step by step rather than relay.running(): stopping between two batches, never
            # cancelling one whose database call is still running in the store's thread.
            while not self._stop.is_set():
                await relay.drain()
                await asyncio.sleep(0.05)
            # The storm is over: publish what is left (and what waits for its retry).
            deadline = time.monotonic() + 30
            while len(self.applied) < (self.expected or 0) and time.monotonic() < deadline:
                await relay.drain()
                await asyncio.sleep(0.05)

    def finish(self, staged: int) -> Events:
        """Let the relay publish all ``staged`` events, stop it, and count."""
        self.expected = staged
        self.stop()
        if self.error is not None:
            raise self.error
        counts = self.consumer.counts
        return Events(
            staged=staged,
            published=len({message.id for message in self.publisher.published}),
            publishes=len(self.publisher.published),
            lost_confirms=self.lost_confirms,
            deliveries=self.deliveries,
            applied=len(self.applied),
            applied_twice=sum(1 for n in self.applied.values() if n > 1),
            duplicates=counts[Reason.DUPLICATE],
        )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def _storm(
    server: ExampleServer,
    intents: int,
    retries: int,
    concurrency: int,
    crash: bool,
    rng: random.Random,
    on_progress: Callable[[int, int], None] | None,
) -> Report:
    plan = _plan(intents, rng)
    # Each intent's callers side by side, so the pool runs them at the same moment.
    jobs = [(intent, n == 0) for intent in plan for n in range(retries)]
    reused = [intent for intent in plan if intent.reused]
    total = len(jobs) + len(reused)
    before = server.ledger()
    tally = Tally()
    crashes = 0
    done = 0
    with _clients(server.base, tally, concurrency) as (client, once):
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = [
                pool.submit(_caller, client, once, tally, intent, first) for intent, first in jobs
            ]
            for future in futures:
                future.result()
                done += 1
                if on_progress:
                    on_progress(done, total)
                if crash and not crashes and _crash_due(tally, done, len(jobs)):
                    with tally.lock:
                        tally.cut_off_by_crash = tally.in_flight
                    server.kill()
                    crashes += 1
                    server.start()
        for intent in reused:
            _reuse(once, tally, intent)
            done += 1
            if on_progress:
                on_progress(done, total)
    after = server.ledger()
    statuses = [next(iter(answers))[0] for answers in tally.answers.values() if answers]
    return Report(
        intents=intents,
        tally=tally,
        ledger={name: after[name] - before[name] for name in after},
        paid=statuses.count(201),
        declined=statuses.count(402),
        reused=len(reused),
        crashes=crashes,
    )


def _crash_due(tally: Tally, done: int, jobs: int) -> bool:
    # A third of the way in, at a moment when a slow handler holds its key (so the crash
    # leaves a reservation behind to recover), or unconditionally by two thirds.
    if done < jobs / 3:
        return False
    return tally.delayed_in_flight > 0 or done >= 2 * jobs / 3
