"""The example payments API: its contract, on every store it runs on, through its own test
client (the real SQLite file, PostgreSQL schema or Redis prefix behind it)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from starlette.testclient import TestClient

from idempo import Scope
from idempo.example import create_app
from idempo.outbox import message_id

GOOD = {"amount": 1250, "currency": "EUR", "card": "4242424242424242"}
DECLINED = {"amount": 1250, "currency": "EUR", "card": "4000000000000002"}


async def _no_sleep(seconds: float) -> None:
    return None


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres),
                        pytest.param("redis", marks=pytest.mark.redis)])  # fmt: skip
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh store URL of each kind: the example keeps its data next to the records."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'payments.db'}"
    elif request.param == "postgres":
        schema = request.getfixturevalue("pg_schema")
        yield f"{request.getfixturevalue('postgres_url')}?table={schema}.idempo_records"
    else:
        prefix = request.getfixturevalue("redis_prefix")
        url = request.getfixturevalue("redis_url")
        yield f"{url}?prefix={prefix}"
        with redis.Redis.from_url(url) as client:
            for key in client.scan_iter(match=f"{prefix}.demo:*"):
                client.delete(key)


@pytest.fixture
def api(store_url: str) -> Iterator[TestClient]:
    with TestClient(create_app(store_url, sleep=_no_sleep)) as client:
        yield client


def _pay(api: TestClient, key: str, body: Any = GOOD, **headers: str) -> Any:
    return api.post("/payments", json=body, headers={"Idempotency-Key": key, **headers})


def _money(api: TestClient) -> dict[str, int]:
    """The ledger's money columns (the events column has tests of its own)."""
    ledger: dict[str, int] = api.get("/demo/ledger").json()
    ledger.pop("events")
    return ledger


def test_a_payment_is_made_once_and_replayed_byte_for_byte(api: TestClient) -> None:
    first = _pay(api, "order-1")
    assert first.status_code == 201
    payment = first.json()
    assert payment["status"] == "succeeded"
    assert payment["amount"] == 1250
    assert payment["currency"] == "EUR"
    assert payment["charge_id"].startswith("ch_")
    assert first.headers["location"] == f"/payments/{payment['id']}"
    again = _pay(api, "order-1")
    assert again.status_code == 201
    assert again.content == first.content
    assert again.headers["location"] == first.headers["location"]
    assert again.headers["idempotent-replayed"] == "true"
    assert api.get(f"/payments/{payment['id']}").json() == payment
    assert _money(api) == {"payments": 1, "charges": 1, "psp_calls": 1, "double_charges": 0}


def test_a_declined_card_is_a_stored_402_and_no_charge(api: TestClient) -> None:
    first = _pay(api, "order-2", DECLINED)
    assert first.status_code == 402
    assert first.json()["error"] == "card_declined"
    again = _pay(api, "order-2", DECLINED)
    assert (again.status_code, again.content) == (402, first.content)
    assert again.headers["idempotent-replayed"] == "true"
    assert _money(api) == {"payments": 0, "charges": 0, "psp_calls": 1, "double_charges": 0}


@pytest.mark.parametrize(
    "body",
    [
        {**GOOD, "amount": "1250"},
        {**GOOD, "amount": 0},
        {**GOOD, "amount": 100_000_001},
        {**GOOD, "amount": 12.5},
        {**GOOD, "amount": True},
        {**GOOD, "currency": "eur"},
        {**GOOD, "currency": "EURO"},
        {**GOOD, "card": "42424242"},
        {**GOOD, "card": "4242-4242-4242-4242"},
        {**GOOD, "tip": 5},
        {"amount": 1250, "currency": "EUR"},
        [],
    ],
)
def test_an_invalid_body_is_a_400_problem_and_charges_nothing(api: TestClient, body: Any) -> None:
    answer = _pay(api, "bad-body", body)
    assert answer.status_code == 400
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"] == "urn:idempo:problem:invalid-payment"
    assert api.get("/demo/ledger").json()["psp_calls"] == 0


def test_a_body_that_is_not_json_is_a_400(api: TestClient) -> None:
    answer = api.post(
        "/payments",
        content=b"amount=5",
        headers={"Idempotency-Key": "form", "content-type": "application/json"},
    )
    assert answer.status_code == 400
    assert answer.headers["content-type"] == "application/problem+json"


def test_missing_and_malformed_keys_are_400s(api: TestClient) -> None:
    assert api.post("/payments", json=GOOD).status_code == 400
    assert _pay(api, '"unterminated').status_code == 400
    assert _pay(api, "x" * 256).status_code == 400
    assert api.get("/demo/ledger").json()["psp_calls"] == 0


def test_a_key_reused_with_another_payload_is_a_422(api: TestClient) -> None:
    assert _pay(api, "order-3").status_code == 201
    reused = _pay(api, "order-3", {**GOOD, "amount": 1251})
    assert reused.status_code == 422
    assert reused.headers["content-type"] == "application/problem+json"
    assert api.get("/demo/ledger").json()["charges"] == 1


def test_a_transient_failure_releases_the_key_and_the_retry_charges_once(api: TestClient) -> None:
    failed = _pay(api, "order-4", **{"X-Demo-Fail": "transient"})
    assert failed.status_code == 503
    assert failed.headers["retry-after"] == "1"
    assert api.get("/demo/ledger").json()["psp_calls"] == 0
    retried = _pay(api, "order-4")
    assert retried.status_code == 201
    assert "idempotent-replayed" not in retried.headers
    assert _money(api) == {"payments": 1, "charges": 1, "psp_calls": 1, "double_charges": 0}


def test_the_same_key_from_two_principals_is_two_payments(api: TestClient) -> None:
    alice = _pay(api, "order-5", Authorization="Bearer alice")
    bob = _pay(api, "order-5", Authorization="Bearer bob")
    assert alice.status_code == bob.status_code == 201
    assert alice.json()["id"] != bob.json()["id"]
    assert alice.json()["charge_id"] != bob.json()["charge_id"]
    assert "idempotent-replayed" not in bob.headers
    assert api.get("/demo/ledger").json()["charges"] == 2


def test_demo_headers_are_validated(api: TestClient) -> None:
    assert _pay(api, "h1", **{"X-Demo-Delay-Ms": "60001"}).status_code == 400
    assert _pay(api, "h2", **{"X-Demo-Delay-Ms": "soon"}).status_code == 400
    assert _pay(api, "h3", **{"X-Demo-Fail": "permanent"}).status_code == 400
    assert _pay(api, "h4", **{"X-Demo-Delay-Ms": "5"}).status_code == 201


def test_an_unknown_payment_is_a_404_problem(api: TestClient) -> None:
    answer = api.get("/payments/pay_nope")
    assert answer.status_code == 404
    assert answer.headers["content-type"] == "application/problem+json"


def test_a_restart_on_the_same_url_sees_the_same_payments(store_url: str) -> None:
    with TestClient(create_app(store_url)) as first:
        made = _pay(first, "order-6").json()
    with TestClient(create_app(store_url)) as second:
        assert second.get(f"/payments/{made['id']}").json() == made
        assert _pay(second, "order-6").headers["idempotent-replayed"] == "true"
        assert second.get("/demo/ledger").json()["payments"] == 1


def test_the_openapi_document_describes_the_contract(tmp_path: Path) -> None:
    app = create_app(f"sqlite:///{tmp_path / 'doc.db'}")
    document = app.openapi()
    create = document["paths"]["/payments"]["post"]
    assert set(create["responses"]) == {"201", "400", "402", "409", "413", "422", "503"}
    assert "application/problem+json" in create["responses"]["422"]["content"]
    headers = {p["name"]: p for p in create["parameters"] if p["in"] == "header"}
    assert headers["Idempotency-Key"]["required"] is True
    assert {"X-Demo-Delay-Ms", "X-Demo-Fail", "authorization"} <= set(headers)
    assert "HTTPValidationError" not in json.dumps(document)
    assert set(document["paths"]) == {"/payments", "/payments/{payment_id}", "/demo/ledger"}


@pytest.mark.postgres
def test_the_payment_row_commits_with_the_record(postgres_url: str, pg_schema: str) -> None:
    """Leased-then-transactional on PostgreSQL: a payment row exists only with a completed
    record, and the provider's tables are separate from the business transaction."""
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    with TestClient(create_app(url)) as api:
        _pay(api, "order-7")
    with psycopg.connect(postgres_url) as conn:
        rows = conn.execute(
            f"SELECT p.id, r.state FROM {pg_schema}.demo_payments p, {pg_schema}.idempo_records r"
        ).fetchall()
    assert len(rows) == 1
    assert rows[0][1] == "completed"


# -- the payment.captured event (the outbox) --------------------------------------------------


def _events(store_url: str) -> list[tuple[str, str, dict[str, Any]]]:
    """The staged events, read from the outbox table: (id, destination, body)."""
    if store_url.startswith("sqlite"):
        path = store_url.removeprefix("sqlite:///")
        with sqlite3.connect(path) as conn:
            rows = conn.execute("SELECT id, destination, body FROM idempo_outbox").fetchall()
    else:
        base, _, query = store_url.partition("?")
        schema = query.removeprefix("table=").partition(".")[0]
        with psycopg.connect(base) as pg:
            rows = pg.execute(
                f"SELECT id, destination, body FROM {schema}.idempo_outbox"
            ).fetchall()
    return [(ident, destination, json.loads(bytes(body))) for ident, destination, body in rows]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sql_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'payments.db'}"
    schema = request.getfixturevalue("pg_schema")
    return f"{request.getfixturevalue('postgres_url')}?table={schema}.idempo_records"


def test_a_payment_stages_one_captured_event_and_a_replay_stages_none(sql_url: str) -> None:
    """The event commits with the payment; retries replay the answer and stage nothing; a
    declined card and a transient failure stage nothing either."""
    with TestClient(create_app(sql_url, sleep=_no_sleep, events="payments.events")) as api:
        made = _pay(api, "order-8").json()
        _pay(api, "order-8")
        _pay(api, "order-9", DECLINED)
        _pay(api, "order-10", **{"X-Demo-Fail": "transient"})
        assert api.get("/demo/ledger").json()["events"] == 1
    [(ident, destination, body)] = _events(sql_url)
    assert destination == "payments.events"
    assert body == {"event": "payment.captured", **made}
    # Derived from the request's scope: the same id on every re-execution of the handler.
    assert ident == message_id(Scope.of("order-8", operation="POST /payments"), "captured")


@pytest.mark.redis
def test_on_redis_no_event_is_staged(redis_url: str, redis_prefix: str) -> None:
    """Redis has no transaction to share, so no outbox: the payment is made, no event."""
    try:
        with TestClient(create_app(f"{redis_url}?prefix={redis_prefix}", sleep=_no_sleep)) as api:
            assert _pay(api, "order-11").status_code == 201
            assert api.get("/demo/ledger").json()["events"] == 0
    finally:
        with redis.Redis.from_url(redis_url) as client:
            for key in client.scan_iter(match=f"{redis_prefix}.demo:*"):
                client.delete(key)
