"""The ASGI middleware under Litestar, through Litestar's own test client: the same contract,
with the operation taken from the route template Litestar puts in the scope."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar, get, post
from litestar.middleware import DefineMiddleware
from litestar.params import FromPath, JSONBody
from litestar.testing import TestClient

from idempo.asgi import IdempotencyMiddleware
from idempo.stores.sqlite import AsyncSQLiteStore

runs: list[int] = []


@post("/orders/{order_id:int}", status_code=201)
async def create_order(order_id: FromPath[int], data: JSONBody[dict[str, Any]]) -> dict[str, Any]:
    runs.append(order_id)
    return {"order": order_id, "run": len(runs), **data}


@get("/orders/{order_id:int}")
async def read_order(order_id: FromPath[int]) -> dict[str, Any]:
    return {"order": order_id, "runs": len(runs)}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient[Litestar]]:
    runs.clear()
    store = AsyncSQLiteStore(str(tmp_path / "idem.db"))
    store._sync.migrate()  # the sync twin migrates without an event loop
    app = Litestar(
        route_handlers=[create_order, read_order],
        middleware=[DefineMiddleware(IdempotencyMiddleware, store=store)],
    )
    with TestClient(app) as test_client:
        yield test_client


def test_first_response_is_stored_and_replayed_byte_for_byte(client: TestClient[Any]) -> None:
    first = client.post("/orders/1", json={"qty": 2}, headers={"Idempotency-Key": "k1"})
    again = client.post("/orders/1", json={"qty": 2}, headers={"Idempotency-Key": "k1"})
    assert first.status_code == again.status_code == 201
    assert again.content == first.content
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert runs == [1]


def test_operation_is_the_route_template(client: TestClient[Any]) -> None:
    """/orders/1 and /orders/2 are one operation: the same key at another path is a reused
    key with another request (422), not a second scope."""
    assert client.post("/orders/1", json={}, headers={"Idempotency-Key": "k2"}).status_code == 201
    reused = client.post("/orders/2", json={}, headers={"Idempotency-Key": "k2"})
    assert reused.status_code == 422
    assert reused.headers["content-type"] == "application/problem+json"
    assert runs == [1]


def test_refusals_and_unguarded_methods(client: TestClient[Any]) -> None:
    missing = client.post("/orders/3", json={})
    assert missing.status_code == 400
    assert missing.headers["content-type"] == "application/problem+json"
    assert client.post("/orders/3", json={}, headers={"Idempotency-Key": ""}).status_code == 400
    assert client.get("/orders/3").json() == {"order": 3, "runs": 0}
    assert runs == []
