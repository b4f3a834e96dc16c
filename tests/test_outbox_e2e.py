"""End to end, on the real RabbitMQ and NATS JetStream and PostgreSQL: from a storm of
duplicate HTTP requests to the downstream consumer's effect, through the outbox.

The example payments API (a server process) stages a "payment.captured" event with each
payment, in the payment's transaction. The storm sends every intent from several callers at
once; partway through the server is SIGKILLed and started again. A relay process publishes
the events; it SIGKILLs itself right after the broker confirmed its third publish (a hook in
this file's relay child, `_Killing`: the crash lands between publish and mark-sent, every
time), and a second relay process finishes the work. An idempo consumer applies each event
once: none lost, none applied twice, and the copies the dead relay caused are skipped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import threading
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from children import Children, spawned
from faststream_brokers import HARNESSES, Harness, reachable, unavailable
from idempo import AsyncIdempotency, Policy
from idempo.client import IdempotentTransport, RetryPolicy
from idempo.consumer import AsyncConsumer, Delivery, Reason, current_delivery
from idempo.contrib.aio_pika import consume
from idempo.contrib.faststream import IdempotencyMiddleware
from idempo.example.server import ExampleServer
from idempo.outbox import OutboxMessage, Relay
from idempo.outbox.publishers import open_publisher
from idempo.stores.memory import AsyncMemoryStore

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

INTENTS = 24
CALLERS = 3  # concurrent callers per intent, each retrying with the same key
KILL_AFTER = 3  # the first relay dies right after its third confirmed publish
GOOD = {"amount": 990, "currency": "EUR", "card": "4242424242424242"}


# -- the relay child (the crash hook lives here, not in src/) ---------------------------------


@dataclass(frozen=True)
class RelaySpec:
    store_url: str
    broker_url: str
    options: dict[str, Any]
    kill_after: int | None  # SIGKILL this process right after that many confirmed publishes
    lease: float = 60.0  # SQLite: how long a claimed message stays hidden from other relays


class _Killing:
    """A publisher that dies (SIGKILL, this very process) right after the broker confirmed
    its ``kill_after``-th message: the relay never gets to mark it, or its batch, sent."""

    def __init__(self, inner: Any, kill_after: int | None, said: Any) -> None:
        self.inner = inner
        self.kill_after = kill_after
        self.said = said
        self.confirmed = 0

    async def publish(self, message: OutboxMessage) -> None:
        await self.inner.publish(message)
        self.confirmed += 1
        self.said.put({"state": "confirmed", "id": message.id})
        if self.confirmed == self.kill_after:
            self.said.put({"state": "dying", "id": message.id})
            # The queue's feeder thread must hand the words over before the process dies.
            self.said.close()
            self.said.join_thread()
            os.kill(os.getpid(), signal.SIGKILL)

    async def aclose(self) -> None:
        await self.inner.aclose()


def relay_main(spec: RelaySpec, said: Any, stop: Any) -> None:
    asyncio.run(_relay(spec, said, stop))


async def _relay(spec: RelaySpec, said: Any, stop: Any) -> None:
    publisher = _Killing(open_publisher(spec.broker_url, **spec.options), spec.kill_after, said)
    lease = timedelta(seconds=spec.lease)
    async with Relay(spec.store_url, publisher, poll=0.05, batch=10, lease=lease) as relay:
        said.put({"state": "ready"})
        # Batch by batch, so a stop lands between two batches, never inside one.
        while not stop.is_set():
            await relay.drain()
            await asyncio.sleep(0.05)
    await publisher.aclose()
    said.put({"state": "stopped"})


# -- the storm --------------------------------------------------------------------------------


def _storm(server: ExampleServer) -> dict[str, set[tuple[int, bytes]]]:
    """Every intent from CALLERS callers at once; the server SIGKILLed and restarted a third
    of the way in. The answers each intent's callers got."""
    keys = [str(uuid.uuid4()) for _ in range(INTENTS)]
    answers: dict[str, set[tuple[int, bytes]]] = {key: set() for key in keys}
    lock = threading.Lock()
    policy = RetryPolicy(max_attempts=300, deadline=90, backoff_base=0.05, backoff_max=0.5)

    def call(key: str, slow: bool) -> None:
        headers = {"Idempotency-Key": key, **({"X-Demo-Delay-Ms": "300"} if slow else {})}
        transport = IdempotentTransport(policy=policy)
        with httpx.Client(base_url=server.base, transport=transport, timeout=30) as client:
            answer = client.post("/payments", json=GOOD, headers=headers)
        with lock:
            answers[key].add((answer.status_code, answer.content))

    with ThreadPoolExecutor(max_workers=12) as pool:
        futures = [
            pool.submit(call, key, n % 4 == 0) for n, key in enumerate(keys) for _ in range(CALLERS)
        ]
        for done, future in enumerate(futures):
            future.result()
            if done == len(futures) // 3:
                server.kill()  # requests in flight die with it; their callers retry
                server.start()
    return answers


@dataclass(frozen=True)
class Database:
    """The example's database: its store URL, and SQL on its outbox table."""

    store_url: str
    path: str | None = None  # SQLite's file
    postgres_url: str | None = None
    schema: str | None = None

    def query(self, sql: str) -> list[Any]:
        if self.path is not None:
            with sqlite3.connect(self.path) as conn:
                return conn.execute(sql.format(table="idempo_outbox")).fetchall()
        assert self.postgres_url is not None
        with psycopg.connect(self.postgres_url, autocommit=True) as conn:
            return conn.execute(sql.format(table=f"{self.schema}.idempo_outbox")).fetchall()

    def staged(self) -> list[str]:
        return [row[0] for row in self.query("SELECT id FROM {table}")]

    def sent(self) -> int:
        [(count,)] = self.query("SELECT count(*) FROM {table} WHERE sent_at IS NOT NULL")
        return int(count)


@pytest.fixture
def database(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    if request.param == "sqlite":
        path = str(tmp_path / "payments.db")
        return Database(f"sqlite:///{path}", path=path)
    postgres_url = request.getfixturevalue("postgres_url")
    schema = request.getfixturevalue("pg_schema")
    url = f"{postgres_url}?table={schema}.idempo_records"
    return Database(url, postgres_url=postgres_url, schema=schema)


# -- the broker sides -------------------------------------------------------------------------


async def _opened(kind: str) -> Harness:
    problem = await reachable(kind)
    if problem:
        unavailable(f"the {kind} server is unreachable: {problem}")
    harness: Harness = (
        HARNESSES[kind](duplicate_window=0.1) if kind == "nats" else HARNESSES[kind]()
    )
    await harness.open()
    return harness


def _consumer() -> AsyncConsumer:
    return AsyncConsumer(
        AsyncIdempotency(AsyncMemoryStore(), Policy(ttl=timedelta(days=7))),
        name="ledger.captured",
        horizon=timedelta(days=1),
        retry_delay=0.05,
    )


CASES = [
    pytest.param("postgres", "rabbit", marks=[pytest.mark.postgres, pytest.mark.rabbitmq],
                 id="postgres-rabbitmq"),
    pytest.param("postgres", "nats", marks=[pytest.mark.postgres, pytest.mark.nats],
                 id="postgres-nats"),
    pytest.param("sqlite", "rabbit", marks=pytest.mark.rabbitmq, id="sqlite-rabbitmq"),
]  # fmt: skip


@pytest.mark.parametrize(("database", "kind"), CASES, indirect=["database"])
async def test_duplicate_storm_server_and_relay_killed_each_event_applied_once(
    database: Database, kind: str, tmp_path: Path
) -> None:
    harness = await _opened(kind)
    applied: Counter[str] = Counter()
    consumer = _consumer()
    try:
        if kind == "rabbit":
            destination, broker_url, options = harness.queue, harness.url, {}
        else:
            destination, broker_url = harness.subject, harness.url
            options = {"stream": harness.stream}
        store_url = database.store_url
        server = ExampleServer(store_url, tmp_path / "server.log", lease=1.0, events=destination)
        server.start()
        try:
            answers = await asyncio.to_thread(_storm, server)
        finally:
            server.stop()
        # Every caller of an intent got the same answer, a 201.
        assert all(len(got) == 1 and next(iter(got))[0] == 201 for got in answers.values())
        staged = database.staged()
        assert len(staged) == len(set(staged)) == INTENTS  # one event per payment

        with spawned(relay_main) as relays:
            # SQLite's claims are leases: short, so the second relay soon takes what the
            # dead one had claimed.
            lease = 2.0 if database.path else 60.0
            dead = await _run_relays(relays, store_url, broker_url, options, lease)
            # The copies the dead relay caused are on the broker: consume everything.
            await _consume(kind, harness, consumer, applied, expected=INTENTS)
            # Every message is marked sent in the end (by the second relay).
            await _until(lambda: _done(database.sent() == INTENTS), deadline=20)
    finally:
        await harness.close()
    assert set(applied) == set(staged)  # 0 lost
    assert max(applied.values()) == 1  # 0 applied twice
    assert consumer.counts[Reason.EXECUTED] == INTENTS
    # The dead relay's confirmed-but-unmarked messages (PostgreSQL: its batch rolled back
    # with it; SQLite: its claim's lease ran out) were published again, and the consumer
    # skipped each copy.
    assert dead == KILL_AFTER
    assert consumer.counts[Reason.DUPLICATE] == KILL_AFTER


async def _run_relays(
    relays: Children, store_url: str, broker_url: str, options: dict[str, Any], lease: float
) -> int:
    """The first relay dies after KILL_AFTER confirms; a second one finishes. How many
    messages the dead one had confirmed."""
    relays.start("first", RelaySpec(store_url, broker_url, options, KILL_AFTER, lease))
    confirmed = 0
    while (said := await asyncio.to_thread(relays.message))["state"] != "dying":
        confirmed += said["state"] == "confirmed"
    process, _ = relays.processes.pop("first")
    await asyncio.to_thread(process.join, 30)
    assert process.exitcode == -signal.SIGKILL
    relays.start("second", RelaySpec(store_url, broker_url, options, None, lease))
    await relays.until("ready")
    return confirmed


async def _consume(
    kind: str, harness: Any, consumer: AsyncConsumer, applied: Counter[str], expected: int
) -> None:
    async def done() -> bool:
        return len(applied) >= expected and consumer.counts[Reason.DUPLICATE] >= KILL_AFTER

    if kind == "rabbit":

        async def apply(delivery: Delivery[Any]) -> None:
            applied[delivery.key] += 1

        queue = await harness.channel.get_queue(harness.queue)
        async with consume(queue, apply, consumer):
            await _until(done)
    else:

        async def apply_nats(body: Any) -> None:
            delivery = current_delivery()
            assert delivery is not None
            applied[delivery.key] += 1

        async with harness.running(IdempotencyMiddleware(consumer), apply_nats):
            await _until(done)


async def _done(value: bool) -> bool:
    return value


async def _until(condition: Any, deadline: float = 40.0) -> None:
    loop = asyncio.get_running_loop()
    ends = loop.time() + deadline
    while not await condition():
        assert loop.time() < ends, "timed out waiting for every event to be applied"
        await asyncio.sleep(0.05)
