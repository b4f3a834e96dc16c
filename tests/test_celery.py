"""Celery tasks run once per intent: real workers, real brokers, a real PostgreSQL.

The workers are separate processes (``celery -A celery_tasks worker``, tests/celery_tasks.py)
consuming a queue of the test's own, on RabbitMQ and on Redis as the broker, with results in
Redis; their effect is a row in the test's own PostgreSQL schema, written in the record's
transaction. A worker is SIGKILLed mid-task by the test, after the task said (a marker file)
it is inside. Nothing sleeps and hopes: the tests wait on files, results and rows, to a
deadline. The API tests at the end run tasks in this process with ``task.apply`` (Celery's
eager path) on the memory store: they check arguments and answers, not delivery.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any
from uuid import UUID

import kombu
import pytest
import redis
from celery import Celery
from celery.exceptions import Retry

from celery_tasks import make_app
from helpers import Database
from idempo import (
    ConfigurationError,
    FingerprintMismatchError,
    Idempotency,
    InvalidKeyError,
    InvalidPayloadError,
    MissingKeyError,
    Policy,
    ReplayedFailureError,
    RequestInProgressError,
    StoreUnavailableError,
)
from idempo.consumer import Consumer, Reason, current_delivery
from idempo.contrib.celery import (
    HEADER,
    PUBLISHED_HEADER,
    ExpiredTaskError,
    idempotent_task,
    publish,
)
from idempo.policy import utcnow
from idempo.stores.memory import MemoryStore

AMQP_URL = os.environ.get("IDEMPO_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
REQUIRE_ALL = os.environ.get("IDEMPO_TEST_REQUIRE_ALL") == "1"
TESTS = Path(__file__).resolve().parent
DEADLINE = 45.0  # seconds any one wait may take before the test fails


# -- real workers ----------------------------------------------------------------------------


def _broker_problem(url: str) -> str | None:
    try:
        with kombu.Connection(url, connect_timeout=3) as connection:
            connection.ensure_connection(max_retries=1)
    except Exception as exc:
        return repr(exc)
    return None


@dataclass
class Broker:
    """One test's place on a broker: a queue (and on Redis a key prefix) of its own."""

    kind: str  # "rabbitmq" or "redis"
    url: str
    prefix: str = field(default_factory=lambda: f"idempo-test-{secrets.token_hex(6)}")

    def clean(self) -> None:
        if self.kind == "rabbitmq":
            with kombu.Connection(self.url) as connection:
                channel = connection.default_channel
                channel.queue_delete(self.prefix)
                channel.exchange_delete(self.prefix)
            return
        with redis.Redis.from_url(self.url) as client:
            keys = list(client.scan_iter(match=f"{self.prefix}:*", count=1000))
            if keys:
                client.delete(*keys)


@pytest.fixture(
    params=[
        pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def broker(request: pytest.FixtureRequest, redis_url: str) -> Iterator[Broker]:
    url = AMQP_URL if request.param == "rabbitmq" else redis_url
    problem = _broker_problem(url)
    if problem:
        message = f"{request.param} at {url} is unreachable: {problem}"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    place = Broker(request.param, url)
    try:
        yield place
    finally:
        place.clean()


@dataclass
class Cluster:
    """The workers of one test, the app that publishes to them, and what they wrote."""

    broker: Broker
    db: Database
    backend: str
    markers: Path
    config: dict[str, Any] = field(default_factory=dict)
    workers: dict[str, tuple[subprocess.Popen[bytes], Path]] = field(default_factory=dict)
    results: list[Any] = field(default_factory=list)
    app: Celery | None = None

    def setup(self, **config: Any) -> Celery:
        """The test's configuration of workers to come, and the app to publish with."""
        self.config = {
            "broker": self.broker.url,
            "backend": self.backend,
            "prefix": self.broker.prefix,
            "database": self.db.location,
            "schema": self.db.schema,
            "markers": str(self.markers),
            **config,
        }
        self.app = make_app(self.config)
        return self.app

    def task(self, name: str) -> Any:
        assert self.app is not None
        return self.app.tasks[f"idempo_test.{name}"]

    def start(self, *names: str, pool: str = "threads", **config: Any) -> None:
        """Start one worker process per name, and wait until each consumes. (The threads
        pool, one thread: it runs tasks in the worker process, as the solo pool does, and
        Celery 5.7's solo pool on RabbitMQ can sit on a prefetched task for seconds.)"""
        for name in names:
            ready = self.markers / f"ready-{name}"
            log = self.markers / f"{name}.log"
            env = {
                **os.environ,
                "IDEMPO_CELERY_CONFIG": json.dumps({**self.config, "worker": name, **config}),
                "IDEMPO_CELERY_READY": str(ready),
                "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path]),
            }
            command = [sys.executable, "-m", "celery", "-A", "celery_tasks", "worker"]
            command += [f"--pool={pool}", "--concurrency=1", "--loglevel=INFO"]
            command += ["-Q", self.broker.prefix, "-n", f"{name}@{self.broker.prefix}"]
            command += ["--without-gossip", "--without-mingle", "--without-heartbeat"]
            with log.open("wb") as output:
                process = subprocess.Popen(
                    command, cwd=self.markers, env=env, stdout=output, stderr=subprocess.STDOUT
                )
            self.workers[name] = (process, log)
        for name in names:
            self.wait(lambda name=name: (self.markers / f"ready-{name}").exists(), f"{name} up")

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not condition():
            for name, (process, log) in self.workers.items():
                if process.poll() not in (None, -9):
                    pytest.fail(f"worker {name} exited: {process.returncode}\n{log.read_text()}")
            assert time.monotonic() < deadline, f"timed out waiting for {what}\n{self.logs()}"
            time.sleep(0.02)

    def inside(self, key: str) -> int:
        """Wait until a task is inside its body with ``key``: the pid that runs it."""
        marker = self.markers / f"inside-{key}"
        self.wait(lambda: marker.exists() and marker.read_text() != "", f"{key} inside")
        return int(marker.read_text())

    def kill(self, name: str) -> None:
        process, _ = self.workers[name]
        process.kill()  # SIGKILL
        process.wait(timeout=10)

    def log(self, name: str) -> str:
        return self.workers[name][1].read_text()

    def logs(self) -> str:
        return "\n".join(f"--- {name}\n{self.log(name)[-4000:]}" for name in self.workers)

    def get(self, result: Any) -> Any:
        self.results.append(result)
        return result.get(timeout=DEADLINE)

    def rows(self) -> Counter[str]:
        found = self.db.select(f"SELECT idem_key FROM {self.db.table('effects')}")
        return Counter(row[0] for row in found)

    def states(self) -> dict[str, str]:
        return dict(self.db.select(f"SELECT idem_key, state FROM {self.db.records_table}"))

    def close(self) -> None:
        # Killed, not stopped: every task has finished by now, the queue goes next, and a
        # warm shutdown takes seconds each.
        for process, _ in self.workers.values():
            process.kill()
            process.wait()
        for result in self.results:
            result.forget()
        if self.app is not None:
            self.app.close()


@pytest.fixture
def cluster(
    broker: Broker, postgres_database: Database, redis_url: str, tmp_path: Path
) -> Iterator[Cluster]:
    effects = postgres_database.table("effects")
    postgres_database.execute(
        f"CREATE TABLE {effects} (idem_key TEXT NOT NULL, worker TEXT, token BIGINT, pid INTEGER)"
    )
    running = Cluster(broker, postgres_database, redis_url, tmp_path)
    try:
        yield running
    finally:
        running.close()


def payments(count: int) -> list[str]:
    run = secrets.token_hex(4)
    return [f"pay-{run}-{index:03d}" for index in range(count)]


@pytest.mark.slow
@pytest.mark.postgres
def test_a_task_published_three_times_runs_once(cluster: Cluster) -> None:
    """Ten payments, each sent three times (positionally, by keyword, and again), and ten
    orders, each sent three times with its key in the message header: one row each, and all
    three results of every intent are the first execution's."""
    cluster.setup()
    charge, ship = cluster.task("charge"), cluster.task("ship")
    cluster.start("one")
    ids, orders = payments(10), payments(10)
    sent: list[tuple[Any, Any]] = []
    for payment in ids:
        expected = {"charged": payment, "amount": 5}
        sent.append((expected, charge.delay(payment, 5)))
        sent.append((expected, charge.apply_async(kwargs={"payment_id": payment, "amount": 5})))
        sent.append((expected, charge.delay(payment, amount=5)))
    for order in orders:
        for _ in range(3):
            sent.append(({"shipped": order}, publish(ship, ({"id": order},), key=order)))
    assert [cluster.get(result) for _, result in sent] == [expected for expected, _ in sent]
    assert cluster.rows() == Counter(dict.fromkeys(ids + orders, 1))
    assert set(cluster.states().values()) == {"completed"}


@pytest.mark.slow
@pytest.mark.postgres
def test_two_workers_racing_on_duplicates_have_one_effect_per_key(cluster: Cluster) -> None:
    """Two worker processes on one queue, thirty intents sent three times each, copies side
    by side so both workers hold copies of one intent at once: one row per intent, and every
    copy answers the first execution's result. On RabbitMQ the duplicates wait on the
    record's row lock (transactional mode); on Redis the mode is leased, and a copy that
    finds its intent in progress is retried later (``task.retry``), then replays."""
    mode = "transactional" if cluster.broker.kind == "rabbitmq" else "leased"
    cluster.setup(mode=mode, slow=0.05)
    ship = cluster.task("ship")
    cluster.start("a", "b")
    orders = payments(30)
    sent = [(order, publish(ship, ({"id": order},), key=order)) for order in orders for _ in "xyz"]
    assert [cluster.get(result) for _, result in sent] == [{"shipped": o} for o, _ in sent]
    assert cluster.rows() == Counter(dict.fromkeys(orders, 1))
    assert set(cluster.states().values()) == {"completed"}
    # Both really consumed: each ran some intents, or skipped some copies as duplicates.
    for name in ("a", "b"):
        ran = cluster.db.select(
            f"SELECT count(*) FROM {cluster.db.table('effects')} WHERE worker = ?", (name,)
        )[0][0]
        assert ran or "a duplicate, skipped" in cluster.log(name), cluster.logs()


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.parametrize(
    ("broker", "how"),
    [
        pytest.param("rabbitmq", "worker", marks=pytest.mark.rabbitmq, id="rabbitmq-worker"),
        pytest.param("redis", "worker", marks=pytest.mark.redis, id="redis-worker"),
        pytest.param("rabbitmq", "child", marks=pytest.mark.rabbitmq, id="rabbitmq-prefork-child"),
    ],
    indirect=["broker"],
)
def test_worker_killed_mid_task_is_redelivered_and_the_effect_happens_once(
    cluster: Cluster, how: str
) -> None:
    """A worker SIGKILLed inside a task, its row written but not committed: the broker
    redelivers the task (RabbitMQ when the connection drops; Redis once the visibility
    timeout passes) and a fresh worker runs it; every payment has one row. On RabbitMQ the
    mode is transactional (the killed attempt's writes rolled back with its connection); on
    Redis leased, with a one-second lease the fresh worker takes over once it ran out.
    ``prefork-child-killed``: only the pool's child dies; with ``reject_on_worker_lost`` the
    worker itself hands the task back and its next child runs it."""
    rabbit = cluster.broker.kind == "rabbitmq"
    mode = "transactional" if rabbit else "leased"
    cluster.setup(mode=mode, lease=1.0, visibility_timeout=2)
    charge = cluster.task("charge")
    ids = payments(6)
    victim = ids[0]
    cluster.start("doomed", pool="prefork" if how == "child" else "threads", hang=victim)
    sent = [(payment, charge.delay(payment, 5)) for payment in ids]
    inside = cluster.inside(victim)
    if how == "worker":
        assert inside == cluster.workers["doomed"][0].pid  # a thread of the worker itself
        cluster.kill("doomed")
        cluster.start("fresh")
    else:
        assert inside != cluster.workers["doomed"][0].pid
        os.kill(inside, signal.SIGKILL)
    answers = [cluster.get(result) for _, result in sent]
    assert answers == [{"charged": payment, "amount": 5} for payment, _ in sent]
    assert cluster.rows() == Counter(dict.fromkeys(ids, 1))
    assert set(cluster.states().values()) == {"completed"}
    [(worker, pid)] = cluster.db.select(
        f"SELECT worker, pid FROM {cluster.db.table('effects')} WHERE idem_key = ?", (victim,)
    )
    assert pid != inside  # the redelivery, not the killed attempt
    assert worker == ("fresh" if how == "worker" else "doomed")


# -- the API, in this process ----------------------------------------------------------------


class Declined(Exception):
    """A deterministic failure (the card was declined)."""


@dataclass
class Local:
    """An app whose tasks run in this process (``task.apply``), on the memory store."""

    app: Celery
    idem: Idempotency
    calls: list[Any] = field(default_factory=list)

    def consumer(self, name: str, **options: Any) -> Consumer:
        return Consumer(self.idem, name=name, horizon=timedelta(days=1), **options)


@pytest.fixture
def local() -> Iterator[Local]:
    app = Celery("idempo-test-local", set_as_current=False, broker="memory://")
    app.conf.update(task_always_eager=True)
    try:
        yield Local(app, Idempotency(MemoryStore(), Policy(ttl=timedelta(days=2))))
    finally:
        app.close()


def test_key_from_an_argument_positional_or_keyword(local: Local) -> None:
    """``key="payment_id"``: the argument, however it was passed; the fingerprint is the
    arguments by name, so the three calls are one intent, and the body runs once."""

    @local.app.task(shared=False, name="charge")
    @idempotent_task(local.consumer("charge"), key="payment_id")
    def charge(payment_id: str, amount: int, currency: str = "EUR") -> str:
        local.calls.append(payment_id)
        return f"{payment_id}:{amount}{currency}"

    answers = [
        charge.apply(("p-1", 5)).get(),
        charge.apply(kwargs={"payment_id": "p-1", "amount": 5}).get(),
        charge.delay("p-1", amount=5, currency="EUR").get(),
        charge("p-1", 5),  # called as a function: guarded too
    ]
    assert answers == ["p-1:5EUR"] * 4
    assert local.calls == ["p-1"]
    with pytest.raises(TypeError):  # Celery still checks the arguments against the body's
        charge.apply_async(("p-2",), kwargs={"amonut": 5})


def test_key_from_a_header_a_function_or_the_task_id(local: Local) -> None:
    """By default the ``idempotency_key`` header (``header=`` renames it); a function of the
    request; Celery's task id only when asked (``use_task_id=True``)."""

    @local.app.task(shared=False, name="by-header")
    @idempotent_task(local.consumer("by-header"))
    def by_header(order: str) -> str:
        local.calls.append(("header", order))
        return order

    @local.app.task(shared=False, name="by-other-header")
    @idempotent_task(local.consumer("by-other-header"), header="event-id")
    def by_other_header(order: str) -> str:
        local.calls.append(("other", order))
        return order

    @local.app.task(shared=False, name="by-function", bind=True)
    @idempotent_task(
        local.consumer("by-function"), key=lambda request, args, kwargs: f"{args[0]}:{args[1]}"
    )
    def by_function(self: Any, tenant: str, order: int) -> int:
        assert self.name == "by-function"  # bind=True: the task, not fingerprinted
        local.calls.append(("function", order))
        return order

    @local.app.task(shared=False, name="by-task-id")
    @idempotent_task(local.consumer("by-task-id"), use_task_id=True)
    def by_task_id(order: str) -> str:
        local.calls.append(("task-id", order))
        return order

    for _ in range(2):
        assert by_header.apply(("o-1",), headers={HEADER: "evt-1"}).get() == "o-1"
        assert publish(by_header, ("o-1",), key="evt-1").get() == "o-1"
        assert by_other_header.apply(("o-2",), headers={"event-id": "evt-2"}).get() == "o-2"
        assert by_function.apply(("acme", 3)).get() == 3
        assert by_task_id.apply(("o-4",), task_id="t-4").get() == "o-4"
    assert by_task_id.apply(("o-4",)).get() == "o-4"  # another task id: another intent
    assert local.calls == [
        ("header", "o-1"),
        ("other", "o-2"),
        ("function", 3),
        ("task-id", "o-4"),
        ("task-id", "o-4"),
    ]
    with pytest.raises(ConfigurationError, match="not both"):
        idempotent_task(local.consumer("x"), key="order", use_task_id=True)(lambda order: order)
    with pytest.raises(ConfigurationError, match="no parameter 'id'"):
        idempotent_task(local.consumer("x"), key="id")(lambda order: order)


def test_missing_or_invalid_key_is_refused_with_a_typed_error(local: Local) -> None:
    """No key (no header; an empty argument) raises MissingKeyError, naming where it was
    looked for; a key that cannot be one raises InvalidKeyError; the body never runs, and
    nothing is stored."""

    shipping, charging = local.consumer("ship"), local.consumer("charge")

    @local.app.task(shared=False, name="ship")
    @idempotent_task(shipping)
    def ship(order: str) -> None:
        local.calls.append(order)

    @local.app.task(shared=False, name="charge")
    @idempotent_task(charging, key="payment_id")
    def charge(payment_id: str | None) -> None:
        local.calls.append(payment_id)

    with pytest.raises(MissingKeyError, match="no 'idempotency_key' header"):
        ship.delay("o-1").get()
    with pytest.raises(MissingKeyError, match="argument 'payment_id' is empty"):
        charge.delay(None).get()
    with pytest.raises(InvalidKeyError):
        charge.delay("not a key").get()
    with pytest.raises(InvalidKeyError):  # refused before anything is sent
        publish(ship, ("o-1",), key="")
    assert local.calls == []
    assert shipping.counts == Counter({Reason.NO_KEY: 1})
    assert charging.counts == Counter({Reason.NO_KEY: 1, Reason.INVALID_KEY: 1})


def test_same_key_with_other_arguments_is_refused(local: Local) -> None:
    """The fingerprint is the arguments' canonical JSON: the key again with another amount
    raises FingerprintMismatchError and runs nothing; ``payload=`` narrows what counts."""

    @local.app.task(shared=False, name="charge")
    @idempotent_task(local.consumer("charge"), key="payment_id")
    def charge(payment_id: str, amount: int, note: str = "") -> int:
        local.calls.append(amount)
        return amount

    @local.app.task(shared=False, name="noted")
    @idempotent_task(
        local.consumer("noted"),
        key="payment_id",
        payload=lambda payment_id, amount, note="": amount,
    )
    def noted(payment_id: str, amount: int, note: str = "") -> int:
        local.calls.append(-amount)
        return amount

    assert charge.delay("p-1", 5).get() == 5
    with pytest.raises(FingerprintMismatchError):
        charge.delay("p-1", 6).get()
    with pytest.raises(FingerprintMismatchError):
        charge.delay("p-1", 5, note="again").get()
    assert noted.delay("p-1", 5).get() == 5
    assert noted.delay("p-1", 5, note="a retry says so").get() == 5
    with pytest.raises(InvalidPayloadError, match="payload="):  # no JSON form (pickled)
        charge.apply(("p-2", object())).get()
    assert local.calls == [5, -5]


def test_arguments_celerys_json_carries_are_fingerprinted(local: Local) -> None:
    """datetime, UUID, Decimal and bytes travel in Celery's JSON: a task that takes them
    runs once per key, and the key again with another of them is refused."""

    @local.app.task(shared=False, name="book")
    @idempotent_task(local.consumer("book"), key="booking")
    def book(booking: str, at: datetime, guest: UUID, price: Decimal, note: bytes) -> str:
        local.calls.append(booking)
        return booking

    at, guest = datetime(2026, 12, 3, 9, 30, tzinfo=UTC), UUID(int=7)
    assert book.delay("b-1", at, guest, Decimal("9.90"), b"n").get() == "b-1"
    assert book.delay("b-1", at, guest, Decimal("9.90"), b"n").get() == "b-1"
    with pytest.raises(FingerprintMismatchError):
        book.delay("b-1", at, guest, Decimal("9.95"), b"n").get()
    with pytest.raises(FingerprintMismatchError):
        book.delay("b-1", at + timedelta(hours=1), guest, Decimal("9.90"), b"n").get()
    assert local.calls == ["b-1"]


def test_deterministic_failure_is_stored_and_replayed(local: Local) -> None:
    """An exception named in ``fail_on`` is recorded: the first copy raises it, every later
    copy raises ReplayedFailureError naming it, and the body ran once."""

    @local.app.task(shared=False, name="charge")
    @idempotent_task(local.consumer("charge", fail_on=(Declined,)), key="payment_id")
    def charge(payment_id: str) -> None:
        local.calls.append(payment_id)
        raise Declined("card declined")

    with pytest.raises(Declined):
        charge.delay("p-1").get()
    for _ in range(2):
        with pytest.raises(ReplayedFailureError, match="card declined") as replayed:
            charge.delay("p-1").get()
        assert replayed.value.error_type.endswith("Declined")
    assert local.calls == ["p-1"]


def test_transient_failure_releases_the_key_and_raises_the_error(local: Local) -> None:
    """Any other exception releases the key and reaches Celery as it was (so
    ``autoretry_for`` applies): the next copy runs the body again, and its result stands."""

    @local.app.task(shared=False, name="charge", autoretry_for=(ConnectionError,), max_retries=1)
    @idempotent_task(local.consumer("charge"), key="payment_id")
    def charge(payment_id: str) -> str:
        local.calls.append(payment_id)
        if len(local.calls) < 3:
            raise ConnectionError("the PSP timed out")
        return "charged"

    with pytest.raises(ConnectionError):  # both tries of Celery's autoretry failed
        charge.delay("p-1").get()
    assert charge.delay("p-1").get() == "charged"
    assert charge.delay("p-1").get() == "charged"
    assert local.calls == ["p-1"] * 3


def test_copy_that_finds_its_intent_in_progress_is_retried_later(local: Local) -> None:
    """A copy that arrives while the first runs does not run: ``task.retry`` with a countdown
    (Retry), and once its retries run out the RequestInProgressError."""
    retries: list[Any] = []

    @local.app.task(shared=False, name="charge", bind=True, max_retries=2)
    @idempotent_task(local.consumer("charge", retry_delay=0.5), key="payment_id")
    def charge(self: Any, payment_id: str) -> str:
        local.calls.append(payment_id)
        original = self.retry

        def spy(**options: Any) -> Any:
            retries.append(options["countdown"])
            return original(**options)

        self.retry = spy  # the copies below run as this same task object
        try:
            # Eager, Celery runs each retry at once: two, then it gives up with the error.
            with pytest.raises(RequestInProgressError):
                charge.delay(payment_id).get(disable_sync_subtasks=False)
            with pytest.raises(Retry):  # what a worker gets: Retry, sent again for later
                charge.apply((payment_id,), throw=True)
        finally:
            del self.retry
        return "charged"

    assert charge.delay("p-1").get() == "charged"
    assert local.calls == ["p-1"]
    assert retries == [0.5] * 4  # retry_delay: the holder's lease ends later


def test_body_reads_its_delivery_and_the_consumer_is_made_once_per_process(
    local: Local,
) -> None:
    """The body finds its key and attempt in ``current_delivery()`` (and its connection,
    with ``connection=``); a factory of the consumer is called once, on the first task."""
    made: list[Consumer] = []

    def factory() -> Consumer:
        made.append(local.consumer("ship"))
        return made[-1]

    @local.app.task(shared=False, name="ship")
    @idempotent_task(factory, key="order")
    def ship(order: str) -> str:
        delivery = current_delivery()
        assert delivery is not None
        assert (delivery.key, delivery.conn, delivery.message.id) == (order, None, "t-1")
        return "shipped"

    assert ship.apply(("o-1",), task_id="t-1").get() == "shipped"
    assert ship.apply(("o-1",), task_id="t-2").get() == "shipped"
    assert len(made) == 1
    assert made[0].counts == Counter({Reason.EXECUTED: 1, Reason.DUPLICATE: 1})

    @local.app.task(shared=False, name="broken")
    @idempotent_task(lambda: "not a consumer", key="order")
    def broken(order: str) -> None: ...

    with pytest.raises(ConfigurationError, match=r"must return an idempo\.consumer\.Consumer"):
        broken.delay("o-1").get()
    with pytest.raises(ConfigurationError, match="call it as a Celery task"):
        ship.run("o-1")  # the body's wrapper, outside any task


def test_task_published_longer_ago_than_the_retention_is_not_run(local: Local) -> None:
    """`publish` stamps when the intent was first published; a copy older than the records'
    retention (its record may be gone) raises ExpiredTaskError, or with
    ``on_expired="ack"`` is dropped (None)."""

    @local.app.task(shared=False, name="ship")
    @idempotent_task(local.consumer("ship"))
    def ship(order: str) -> str:
        local.calls.append(order)
        return order

    @local.app.task(shared=False, name="dropping")
    @idempotent_task(local.consumer("dropping", on_expired="ack"))
    def dropping(order: str) -> str:
        local.calls.append(order)
        return order

    long_ago = utcnow() - timedelta(days=3)
    with pytest.raises(ExpiredTaskError, match="horizon guard"):
        publish(ship, ("o-1",), key="evt-1", published=long_ago).get()
    assert publish(dropping, ("o-1",), key="evt-1", published=long_ago).get() is None
    result = publish(ship, ("o-2",), key="evt-2", headers={"tenant": "acme"})
    assert result.get() == "o-2"
    assert local.calls == ["o-2"]
    # The headers as a worker gets them: the key, the time, and the producer's own.
    sent: dict[str, Any] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ship, "apply_async", lambda *args, **options: sent.update(options))
        publish(ship, ("o-3",), key="evt-3", headers={"tenant": "acme"}, countdown=5)
    assert sent["headers"][HEADER] == "evt-3"
    assert sent["headers"]["tenant"] == "acme"
    assert sent["headers"][PUBLISHED_HEADER].endswith("+00:00")
    assert sent["countdown"] == 5


def test_idempo_errors_reach_the_producer_through_a_json_result_backend() -> None:
    """A worker's error is stored as its type and ``args`` and rebuilt from them: idempo's
    errors come back as themselves, attributes and message included."""
    app = Celery("idempo-test-backend", set_as_current=False, backend="cache+memory://")
    app.conf.result_serializer = "json"
    errors = [
        ReplayedFailureError("billing.CardDeclined", "insufficient funds"),
        FingerprintMismatchError("pay-1"),
        RequestInProgressError("pay-1", 2.5),
        MissingKeyError("task 'charge' has no idempotency key", header=HEADER),
        ExpiredTaskError("too old"),
    ]
    try:
        for error in errors:
            stored = app.backend.prepare_exception(error, "json")
            rebuilt = app.backend.exception_to_python(json.loads(json.dumps(stored)))
            assert type(rebuilt) is type(error)
            assert (str(rebuilt), vars(rebuilt)) == (str(error), vars(error))
    finally:
        app.close()


def test_a_consumer_that_cannot_be_made_yet_retries_the_task(local: Local) -> None:
    """The factory failing (the database down at the worker's first task) runs nothing and
    retries the task; a factory that returns something else is a ConfigurationError."""
    attempts: list[int] = []

    def factory() -> Consumer:
        attempts.append(len(attempts))
        if len(attempts) == 1:
            raise StoreUnavailableError("PostgreSQL is restarting")
        return local.consumer("ship")

    @local.app.task(shared=False, name="ship", max_retries=1)
    @idempotent_task(factory, key="order")
    def ship(order: str) -> str:
        local.calls.append(order)
        return "shipped"

    assert ship.delay("o-1").get() == "shipped"  # eager: the retry ran at once
    assert (attempts, local.calls) == ([0, 1], ["o-1"])
