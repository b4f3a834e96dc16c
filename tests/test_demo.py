"""`idempo demo` and the example API end to end: a real uvicorn server process on loopback,
concurrent httpx clients, and a server SIGKILLed mid-request then restarted on the same store."""

from __future__ import annotations

import contextlib
import re
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis
from typer.testing import CliRunner

from idempo import Scope, Status
from idempo.cli import app
from idempo.client import IdempotentTransport, RetryPolicy
from idempo.demo import run_storm
from idempo.example.server import ExampleServer
from idempo.stores import open_store

pytestmark = pytest.mark.slow  # a server process per test, storms of concurrent clients

GOOD = {"amount": 990, "currency": "EUR", "card": "4242424242424242"}
LEASE = 1.0  # seconds: a killed server's keys free quickly


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ExampleServer]:
    example = ExampleServer(
        f"sqlite:///{tmp_path / 'api.db'}", tmp_path / "server.log", lease=LEASE
    )
    example.start()
    try:
        yield example
    finally:
        example.stop()


def _retrying(base: str) -> httpx.Client:
    policy = RetryPolicy(max_attempts=100, deadline=60, backoff_base=0.02, backoff_max=0.2)
    return httpx.Client(base_url=base, transport=IdempotentTransport(policy=policy), timeout=30)


def test_demo_command_reports_exactly_once_and_exits_zero(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    result = CliRunner().invoke(
        app, ["demo", "--store", url, "--intents", "40", "--retries", "3", "--concurrency", "6"]
    )
    assert result.exit_code == 0, result.output
    assert "exactly-once held" in result.output
    assert "double charges" in result.output
    assert "events applied downstream" in result.output
    assert "events lost" in result.output


def test_demo_on_its_own_store_says_where_and_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without --store: it prints the store's URL, its progress bar names what it counts,
    the report adds up in front of the reader, and its temporary directory is gone after."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = CliRunner().invoke(
        app, ["demo", "--intents", "24", "--retries", "2", "--concurrency", "4"]
    )
    assert result.exit_code == 0, result.output
    assert f"store: sqlite:///{tmp_path}/idempo-demo-" in result.output.replace("\n", "")
    assert "callers answered" in result.output
    match = re.search(r"intents = paid \+ declined: (\d+) = (\d+) \+ (\d+)", result.output)
    assert match is not None, result.output
    intents, paid, declined = map(int, match.groups())
    assert intents == 24 == paid + declined
    assert list(tmp_path.iterdir()) == []


def test_an_unsupported_store_is_one_line_and_starts_nothing(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["demo", "--store", "ftp://files.example/x"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        "error: the example API runs on sqlite://, postgresql://, mysql:// (MariaDB) or"
        " redis:// stores, not ftp://"
    ]


def test_a_server_that_cannot_start_shows_why(tmp_path: Path) -> None:
    """The server's own error is in the exception, not behind a path to a log file."""
    example = ExampleServer("sqlite:///" + str(tmp_path / "no" / "such" / "dir.db"),
                            tmp_path / "server.log")  # fmt: skip
    with pytest.raises(RuntimeError, match="the example server exited") as raised:
        example.start()
    assert "no/such does not exist" in str(raised.value)  # the real cause, from the server
    assert "Application startup failed" in str(raised.value)


def test_storm_with_a_crash_charges_each_intent_once(tmp_path: Path) -> None:
    """Every kind of answer happens, the server is killed and restarted, and the ledger still
    shows one payment and one charge per paid intent."""
    report = run_storm(
        f"sqlite:///{tmp_path / 'storm.db'}", intents=60, retries=4, concurrency=8, seed=7
    )
    tally = report.tally
    assert report.exactly_once
    assert report.crashes == 1
    assert report.paid + report.declined == 60
    assert report.ledger["payments"] == report.ledger["charges"] == report.paid
    assert report.ledger["double_charges"] == 0
    assert report.ledger["psp_calls"] >= 60
    assert tally.replays > 0
    assert tally.transient > 0
    assert tally.conflicts == report.reused
    assert len(tally.answers) == 60
    assert all(len(answers) == 1 for answers in tally.answers.values())
    events = report.events
    assert events is not None
    assert events.staged == events.published == events.applied == report.paid
    assert events.lost == events.applied_twice == 0
    # Some confirms were lost on purpose: those were published again, and skipped downstream.
    assert events.lost_confirms > 0
    assert events.publishes == events.deliveries == events.published + events.lost_confirms
    assert events.duplicates == events.lost_confirms


@pytest.mark.parametrize(
    "database",
    [
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgresql"),
        # The README lists MariaDB: the demo runs there too, outbox and all.
        pytest.param("mysql", marks=pytest.mark.mysql, id="mariadb"),
    ],
)
def test_storm_on_a_database_server(request: pytest.FixtureRequest, database: str) -> None:
    if database == "postgres":
        where = request.getfixturevalue("pg_schema")
        url = f"{request.getfixturevalue('postgres_url')}?table={where}.idempo_records"
    else:
        where = request.getfixturevalue("mysql_db")
        url = f"{request.getfixturevalue('mysql_url')}?table={where}.idempo_records"
    report = run_storm(url, intents=30, concurrency=6, seed=3)
    assert report.exactly_once, report.server_log
    assert report.ledger["payments"] == report.paid > 0
    assert report.events is not None
    assert report.events.applied == report.events.staged == report.paid


@pytest.mark.redis
def test_storm_on_redis(redis_url: str, redis_prefix: str) -> None:
    try:
        report = run_storm(f"{redis_url}?prefix={redis_prefix}", intents=30, concurrency=6, seed=5)
    finally:
        with redis.Redis.from_url(redis_url) as client:
            for key in client.scan_iter(match=f"{redis_prefix}.demo:*"):
                client.delete(key)
    assert report.exactly_once, report.server_log
    assert report.ledger["payments"] == report.paid > 0
    assert report.events is None  # no outbox on Redis


def test_concurrent_duplicates_execute_once_and_all_get_the_first_bytes(
    server: ExampleServer,
) -> None:
    """Twelve clients send one intent at once while its handler is slow: one execution, and
    every client ends with the same 201 bytes (after 409s, retried by the transport)."""
    key = str(uuid.uuid4())
    answers: list[httpx.Response] = []
    barrier = threading.Barrier(12)

    def client() -> None:
        with _retrying(server.base) as http:
            barrier.wait()
            answers.append(
                http.post(
                    "/payments",
                    json=GOOD,
                    headers={"Idempotency-Key": key, "X-Demo-Delay-Ms": "300"},
                )
            )

    threads = [threading.Thread(target=client) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(answers) == 12
    assert {(a.status_code, a.content) for a in answers} == {(201, answers[0].content)}
    assert sum(a.headers.get("idempotent-replayed") != "true" for a in answers) == 1
    assert server.ledger() == {
        "payments": 1, "charges": 1, "psp_calls": 1, "double_charges": 0, "events": 1
    }  # fmt: skip


def test_a_duplicate_in_flight_gets_409_with_retry_after(server: ExampleServer) -> None:
    headers = {"Idempotency-Key": "in-flight", "X-Demo-Delay-Ms": "1500"}
    with httpx.Client(base_url=server.base, timeout=30) as http:
        first = threading.Thread(target=http.post, args=("/payments",),
                                 kwargs={"json": GOOD, "headers": headers})  # fmt: skip
        first.start()
        _wait_for(lambda: _reserved(server, "in-flight"), "the reservation")
        duplicate = http.post("/payments", json=GOOD, headers=headers)
        first.join()
    assert duplicate.status_code == 409
    assert duplicate.headers["content-type"] == "application/problem+json"
    assert int(duplicate.headers["retry-after"]) >= 1


def _record(server: ExampleServer, key: str) -> Any:
    """The key's record, read from the store: no request is sent, so a probe never becomes
    an execution itself."""
    store = open_store(server.url)
    try:
        return store.get(Scope.of(key, operation="POST /payments"))
    finally:
        store.close()


def _reserved(server: ExampleServer, key: str) -> bool:
    record = _record(server, key)
    return record is not None and record.status is Status.IN_PROGRESS


def _status(server: ExampleServer, key: str) -> int:
    """The answer a plain (unretried) duplicate gets right now."""
    return httpx.post(
        f"{server.base}/payments", json=GOOD, headers={"Idempotency-Key": key}, timeout=30
    ).status_code


def _post_in_background(base: str, key: str, headers: dict[str, str]) -> threading.Thread:
    def send() -> None:
        # The server is killed under this request: that is the point.
        with contextlib.suppress(httpx.TransportError):
            httpx.post(f"{base}/payments", json=GOOD,
                       headers={"Idempotency-Key": key, **headers}, timeout=30)  # fmt: skip

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_server_killed_mid_request_recovers_and_charges_once(server: ExampleServer) -> None:
    """SIGKILL while a handler holds its key (before the charge); restart; the key is in
    progress until the dead server's lease ends, then a retry executes once."""
    sent = _post_in_background(server.base, "killed", {"X-Demo-Delay-Ms": "30000"})
    _wait_for(lambda: _reserved(server, "killed"), "the reservation")
    dead_token = _record(server, "killed").token
    server.kill()
    sent.join()
    assert _reserved(server, "killed")  # the dead holder's reservation outlives it
    server.start()
    with _retrying(server.base) as http:
        retried = http.post("/payments", json=GOOD, headers={"Idempotency-Key": "killed"})
    assert retried.status_code == 201
    assert server.ledger() == {
        "payments": 1, "charges": 1, "psp_calls": 1, "double_charges": 0, "events": 1
    }  # fmt: skip
    assert _record(server, "killed").token > dead_token  # taken over once its lease ran out


@pytest.mark.postgres
def test_a_server_killed_after_the_charge_never_charges_twice(
    tmp_path: Path, postgres_url: str, pg_schema: str
) -> None:
    """The worst moment: the provider has charged, the payment row is not committed. A lock
    held by the test stops the handler right there; SIGKILL; restart; the retry runs again,
    the provider answers the derived key with the first charge, and one payment commits."""
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    server = ExampleServer(url, tmp_path / "server.log", lease=LEASE)
    server.start()
    try:
        with psycopg.connect(postgres_url) as blocker:
            blocker.execute(f"LOCK TABLE {pg_schema}.demo_payments IN ACCESS EXCLUSIVE MODE")
            sent = _post_in_background(server.base, "charged", {})
            _wait_for(lambda: _psp_calls(postgres_url, pg_schema) == 1, "the charge")
            server.kill()
            sent.join()
            blocker.rollback()
        assert _ledger(postgres_url, pg_schema) == {"payments": 0, "charges": 1, "psp_calls": 1}
        server.start()
        with _retrying(server.base) as http:
            retried = http.post("/payments", json=GOOD, headers={"Idempotency-Key": "charged"})
        assert retried.status_code == 201
        assert server.ledger() == {
            "payments": 1, "charges": 1, "psp_calls": 2, "double_charges": 0, "events": 1
        }  # fmt: skip
        again = httpx.post(f"{server.base}/payments", json=GOOD,
                           headers={"Idempotency-Key": "charged"})  # fmt: skip
        assert again.content == retried.content
    finally:
        server.stop()


def _psp_calls(postgres_url: str, schema: str) -> int:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        row = conn.execute(f"SELECT count(*) FROM {schema}.demo_psp_calls").fetchone()
        return row[0] if row else 0


def _ledger(postgres_url: str, schema: str) -> dict[str, Any]:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        counts = {}
        for name, table in [("payments", "demo_payments"), ("charges", "demo_psp_charges"),
                            ("psp_calls", "demo_psp_calls")]:  # fmt: skip
            row = conn.execute(f"SELECT count(*) FROM {schema}.{table}").fetchone()
            counts[name] = row[0] if row else 0
        return counts
