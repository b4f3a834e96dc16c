"""Internal review: the HTTP adapters' contract (SPEC §2 rule 7, §4), through the public
ASGI middleware on FastAPI and Litestar apps.

Each defect the review found was first a test marked ``xfail(strict=True)``; the mark came
off with its fix (docs/testing.md). The other tests are checks that held.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import fastapi
import httpx
import litestar
import pydantic
import pytest
from litestar.middleware import DefineMiddleware
from litestar.params import JSONBody

from idempo.asgi import IdempotencyMiddleware
from idempo.stores.memory import AsyncMemoryStore

pytestmark = pytest.mark.anyio


class Order(pydantic.BaseModel):
    amount: int


def fastapi_app(runs: list[int]) -> Any:
    app = fastapi.FastAPI()

    @app.post("/orders", status_code=201)
    async def create(order: Order) -> dict[str, int]:
        runs.append(order.amount)
        if order.amount < 0:
            raise fastapi.HTTPException(status_code=400, detail="negative")
        return {"amount": order.amount}

    app.add_middleware(IdempotencyMiddleware, store=AsyncMemoryStore())
    return app


@dataclass
class LitestarOrder:
    amount: int


def litestar_app(runs: list[int]) -> Any:
    @litestar.post("/orders")
    async def create(data: JSONBody[LitestarOrder]) -> dict[str, int]:
        runs.append(data.amount)
        return {"amount": data.amount}

    middleware = [DefineMiddleware(IdempotencyMiddleware, store=AsyncMemoryStore())]
    return litestar.Litestar([create], middleware=middleware)


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


@pytest.mark.parametrize("framework", ["fastapi", "litestar"])
async def test_validation_answer_is_not_stored(framework: str) -> None:
    """SPEC §2 rule 7: "As at Stripe, an answer given before the endpoint ran (the
    framework's request validation, ...) is not stored: the key is released, so a client
    that fixes its request may retry with the same key"."""
    runs: list[int] = []
    app = fastapi_app(runs) if framework == "fastapi" else litestar_app(runs)
    headers = {"Idempotency-Key": "order-1"}
    async with client(app) as http:
        refused = await http.post("/orders", json={"amount": "lots"}, headers=headers)
        assert refused.status_code in (400, 422)
        assert "urn:idempo" not in refused.text  # the framework's own answer
        fixed = await http.post("/orders", json={"amount": 5}, headers=headers)
    assert (fixed.status_code, runs) == (201, [5]), fixed.text


async def test_endpoints_own_4xx_is_stored_and_replayed() -> None:
    """A check that held: a 4xx the endpoint itself answered (FastAPI's HTTPException) is
    FAILED and replayed byte for byte, with Idempotent-Replayed; the endpoint runs once."""
    runs: list[int] = []
    headers = {"Idempotency-Key": "order-2"}
    async with client(fastapi_app(runs)) as http:
        first = await http.post("/orders", json={"amount": -1}, headers=headers)
        again = await http.post("/orders", json={"amount": -1}, headers=headers)
    assert first.status_code == again.status_code == 400
    assert first.content == again.content
    assert again.headers.get("idempotent-replayed") == "true"
    assert runs == [-1]


async def test_replay_is_byte_identical() -> None:
    """A check that held: the stored 201 comes back with the same status, body bytes and
    headers (hop-by-hop excepted), plus Idempotent-Replayed."""
    runs: list[int] = []
    headers = {"Idempotency-Key": "order-3"}
    async with client(fastapi_app(runs)) as http:
        first = await http.post("/orders", json={"amount": 3}, headers=headers)
        respelled = {**headers, "Content-Type": "application/json"}
        again = await http.post("/orders", content=b'{ "amount" : 3 }', headers=respelled)
    assert (first.status_code, again.status_code) == (201, 201)
    assert first.content == again.content
    kept = {k: v for k, v in first.headers.items() if k not in ("date", "server")}
    replayed = {k: v for k, v in again.headers.items() if k != "idempotent-replayed"}
    assert {k: v for k, v in replayed.items() if k not in ("date", "server")} == kept
    assert runs == [3]


def routed_app(store: Any, runs: list[str]) -> Any:
    app = fastapi.FastAPI()

    @app.post("/orders/{oid}", status_code=201)
    async def create(oid: str) -> dict[str, str]:
        runs.append(oid)
        return {"oid": oid}

    app.add_middleware(IdempotencyMiddleware, store=store)
    return app


@pytest.mark.parametrize("path", ["/no%00such", "long"], ids=["nul", "long"])
@pytest.mark.postgres
async def test_hostile_unmatched_path_is_not_a_5xx(async_pg_store: Any, path: str) -> None:
    """SPEC §8: no request, however malformed, makes idempo answer a 5xx. The path is the
    operation of a request no route matched; a NUL byte in it, or a few KB of it, must not
    turn into a store error."""
    if path.endswith("long"):
        path = "/" + secrets.token_hex(1500)  # random: PostgreSQL cannot compress it
    runs: list[str] = []
    async with client(routed_app(async_pg_store, runs)) as http:
        answer = await http.post(path, json={}, headers={"Idempotency-Key": "hostile-1"})
    assert answer.status_code < 500, answer.text


@pytest.mark.postgres
async def test_nul_in_a_matched_path_is_harmless(async_pg_store: Any) -> None:
    """A check that held: in a matched route the operation is the route's template, so a NUL
    in the path parameter is the app's business; the request runs once and replays."""
    runs: list[str] = []
    headers = {"Idempotency-Key": "nul-2"}
    async with client(routed_app(async_pg_store, runs)) as http:
        first = await http.post("/orders/a%00b", json={}, headers=headers)
        again = await http.post("/orders/a%00b", json={}, headers=headers)
    assert (first.status_code, again.status_code) == (201, 201)
    assert first.content == again.content
    assert runs == ["a\x00b"]


# --- F-C: the fixes' own tests ------------------------------------------------------------


def paying_fastapi_app(runs: list[int]) -> Any:
    app = fastapi.FastAPI()

    @app.post("/orders", status_code=201)
    async def create(order: Order) -> dict[str, int]:
        runs.append(order.amount)
        if order.amount == 0:
            raise fastapi.HTTPException(status_code=402, detail="pay first")
        return {"amount": order.amount}

    @app.get("/orders/{oid}")
    async def read(oid: str) -> dict[str, str]:
        return {"oid": oid}

    app.add_middleware(IdempotencyMiddleware, store=AsyncMemoryStore())
    return app


def paying_litestar_app(runs: list[int]) -> Any:
    @litestar.post("/orders")
    async def create(data: JSONBody[LitestarOrder]) -> dict[str, int]:
        runs.append(data.amount)
        if data.amount == 0:
            raise litestar.exceptions.HTTPException(status_code=402, detail="pay first")
        if data.amount < 0:  # the endpoint's own validation: its answer, stored
            raise litestar.exceptions.ValidationException(detail="negative")
        return {"amount": data.amount}

    middleware = [DefineMiddleware(IdempotencyMiddleware, store=AsyncMemoryStore())]
    return litestar.Litestar([create], middleware=middleware)


def outer_fastapi_app(runs: list[int]) -> Any:
    """The middleware wrapping a FastAPI app from outside (its stack not built yet)."""
    app = fastapi.FastAPI()

    @app.post("/orders", status_code=201)
    async def create(order: Order) -> dict[str, int]:
        runs.append(order.amount)
        return {"amount": order.amount}

    return IdempotencyMiddleware(app, store=AsyncMemoryStore())


APPS = {"fastapi": paying_fastapi_app, "fastapi-outer": outer_fastapi_app}


@pytest.mark.parametrize("framework", ["fastapi", "fastapi-outer", "litestar"])
async def test_a_corrected_retry_runs_once_then_replays(framework: str) -> None:
    """SPEC §2 rule 7: after the framework refused the request, the corrected one with the
    same key runs (once), and its duplicates replay it."""
    runs: list[int] = []
    app = APPS.get(framework, paying_litestar_app)(runs)
    headers = {"Idempotency-Key": "fix-1"}
    async with client(app) as http:
        refused = [await http.post("/orders", json={"amount": "x"}, headers=headers)]
        refused.append(await http.post("/orders", json={"amount": "x"}, headers=headers))
        fixed = await http.post("/orders", json={"amount": 5}, headers=headers)
        again = await http.post("/orders", json={"amount": 5}, headers=headers)
    assert [r.status_code for r in refused] in ([422, 422], [400, 400])
    assert all("idempotent-replayed" not in r.headers for r in refused)
    assert fixed.status_code == again.status_code == 201
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.content == fixed.content
    assert runs == [5]


@pytest.mark.parametrize(
    ("framework", "amount", "status"),
    [("fastapi", 0, 402), ("litestar", 0, 402), ("litestar", -1, 400)],
    ids=["fastapi-402", "litestar-402", "litestar-own-validation"],
)
async def test_the_endpoints_own_4xx_is_stored(framework: str, amount: int, status: int) -> None:
    """An answer the endpoint itself gave (raised inside it) is FAILED and replayed, even
    when it is the framework's validation exception class (Litestar)."""
    runs: list[int] = []
    app = paying_fastapi_app(runs) if framework == "fastapi" else paying_litestar_app(runs)
    headers = {"Idempotency-Key": "own-1"}
    async with client(app) as http:
        first = await http.post("/orders", json={"amount": amount}, headers=headers)
        again = await http.post("/orders", json={"amount": amount}, headers=headers)
        other = await http.post("/orders", json={"amount": 5}, headers=headers)
    assert first.status_code == again.status_code == status
    assert again.headers.get("idempotent-replayed") == "true"
    assert first.content == again.content
    assert other.status_code == 422  # same key, another body: the stored failure stands
    assert runs == [amount]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("POST", "/nothing/here", 404), ("POST", "/orders/7", 405)],
    ids=["404", "405"],
)
async def test_an_unrouted_request_passes_through_unstored(
    method: str, path: str, status: int
) -> None:
    """The router's own 404 / 405 (no route matches) is passed through unguarded: nothing
    is stored, so the key stays free for the request the client meant."""
    runs: list[int] = []
    headers = {"Idempotency-Key": "lost-1"}
    async with client(paying_fastapi_app(runs)) as http:
        first = await http.request(method, path, json={}, headers=headers)
        again = await http.request(method, path, json={}, headers=headers)
        meant = await http.post("/orders", json={"amount": 3}, headers=headers)
    assert first.status_code == again.status_code == status
    assert "idempotent-replayed" not in again.headers
    assert (meant.status_code, runs) == (201, [3])


def echo_asgi_app(runs: list[str]) -> Any:
    """A plain ASGI app: no router idempo can see, so the raw path is the operation."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        runs.append(scope["path"])
        await receive()
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"made", "more_body": False})

    return app


@pytest.mark.parametrize("path", ["/no%00such", "/caf%C3%A9", "long"], ids=["nul", "utf8", "long"])
async def test_a_hostile_path_is_safe_on_every_store(async_node_store: Any, path: str) -> None:
    """SPEC §8 on every store: the raw path of an app whose routes idempo cannot see is
    kept as the operation only when it is short printable ASCII, else it is hashed
    (``POST sha256:<hex>``): the request runs once and replays, no 5xx."""
    if path == "long":
        path = "/" + secrets.token_hex(1500)
    runs: list[str] = []
    app = IdempotencyMiddleware(echo_asgi_app(runs), store=async_node_store)
    headers = {"Idempotency-Key": "hostile-2"}
    async with client(app) as http:
        first = await http.post(path, json={}, headers=headers)
        again = await http.post(path, json={}, headers=headers)
    assert (first.status_code, again.status_code) == (201, 201), first.text
    assert again.headers.get("idempotent-replayed") == "true"
    assert len(runs) == 1


@pytest.mark.parametrize("principal", ["a\x00b", "long"], ids=["nul", "long"])
async def test_a_hostile_principal_is_safe_on_every_store(
    async_node_store: Any, principal: str
) -> None:
    """SPEC §8: a principal with a NUL or of any length never reaches a store as it is (it
    is hashed), and still separates its callers from the others."""
    if principal == "long":
        principal = "user:" + secrets.token_hex(2000)  # random: PostgreSQL cannot compress it
    runs: list[str] = []
    app = IdempotencyMiddleware(
        echo_asgi_app(runs),
        store=async_node_store,
        principal=lambda scope: principal if scope["query_string"] == b"" else "other",
    )
    headers = {"Idempotency-Key": "hostile-3"}
    async with client(app) as http:
        first = await http.post("/pay", json={}, headers=headers)
        again = await http.post("/pay", json={}, headers=headers)
        other = await http.post("/pay?x", json={}, headers=headers)
    assert (first.status_code, again.status_code, other.status_code) == (201, 201, 201)
    assert again.headers.get("idempotent-replayed") == "true"
    assert "idempotent-replayed" not in other.headers
    assert len(runs) == 2


async def test_an_apps_own_early_refusal_can_say_so() -> None:
    """`answered_before_endpoint(scope)`: an app's own check inside the guarded app (here
    an auth step) marks its refusal as given before the endpoint ran: not stored, the key is
    released, and the request that passes the check runs once and replays."""
    from idempo.asgi import answered_before_endpoint

    runs: list[str] = []
    endpoint = echo_asgi_app(runs)

    async def checked(scope: Any, receive: Any, send: Any) -> None:
        if dict(scope["headers"]).get(b"x-token") != b"ok":
            answered_before_endpoint(scope)
            await send({"type": "http.response.start", "status": 403, "headers": []})
            await send({"type": "http.response.body", "body": b"no", "more_body": False})
            return
        await endpoint(scope, receive, send)

    app = IdempotencyMiddleware(checked, store=AsyncMemoryStore())
    key = {"Idempotency-Key": "own-check"}
    async with client(app) as http:
        refused = await http.post("/pay", content=b"{}", headers=key)
        allowed = await http.post("/pay", content=b"{}", headers={**key, "X-Token": "ok"})
        again = await http.post("/pay", content=b"{}", headers={**key, "X-Token": "ok"})
    assert (refused.status_code, allowed.status_code, again.status_code) == (403, 201, 201)
    assert again.headers.get("idempotent-replayed") == "true"
    assert len(runs) == 1


def authed_fastapi_app(runs: list[str], *, outer: bool, sync: bool) -> Any:
    """An auth dependency (sync or async, so in a thread or not) that refuses with its own
    401, and an endpoint (the same) that may refuse with its own 403."""

    async def async_user(authorization: str | None = fastapi.Header(None)) -> str:
        if authorization != "Bearer ok":
            raise fastapi.HTTPException(status_code=401, detail="who are you?")
        return "ada"

    def sync_user(authorization: str | None = fastapi.Header(None)) -> str:
        if authorization != "Bearer ok":
            raise fastapi.HTTPException(status_code=401, detail="who are you?")
        return "ada"

    user_dependency = sync_user if sync else async_user

    def refuse(order: Order) -> None:
        if order.amount > 100:
            raise fastapi.HTTPException(status_code=403, detail="over your limit")

    app = fastapi.FastAPI()
    if sync:

        @app.post("/orders", status_code=201)
        def create_sync(order: Order, user: str = fastapi.Depends(user_dependency)) -> Any:
            refuse(order)  # in a helper the endpoint calls: still the endpoint's answer
            runs.append(user)
            return {"amount": order.amount}
    else:

        @app.post("/orders", status_code=201)
        async def create(order: Order, user: str = fastapi.Depends(user_dependency)) -> Any:
            refuse(order)
            runs.append(user)
            return {"amount": order.amount}

    # One principal for everyone: the 401 and the authenticated retry share a scope.
    options = {"store": AsyncMemoryStore(), "principal": lambda scope: "tenant-1"}
    if outer:
        return IdempotencyMiddleware(app, **options)
    app.add_middleware(IdempotencyMiddleware, **options)
    return app


@pytest.mark.parametrize("outer", [False, True], ids=["inner", "outer"])
@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
async def test_a_dependencys_refusal_is_not_stored(outer: bool, sync: bool) -> None:
    """SPEC §2 rule 7: an auth dependency's 401 is an answer given before the endpoint ran,
    so the retry that authenticates runs with the same key; the endpoint's own 403 (raised
    in a function it calls) is its answer, stored and replayed."""
    runs: list[str] = []
    app = authed_fastapi_app(runs, outer=outer, sync=sync)
    async with client(app) as http:
        key = {"Idempotency-Key": f"auth-{secrets.token_hex(4)}"}
        body = {"amount": 5}
        refused = await http.post("/orders", json=body, headers=key)
        authed = {**key, "Authorization": "Bearer ok"}
        fixed = await http.post("/orders", json=body, headers=authed)
        again = await http.post("/orders", json=body, headers=authed)
        limit = {"Idempotency-Key": f"limit-{secrets.token_hex(4)}", "Authorization": "Bearer ok"}
        over = [await http.post("/orders", json={"amount": 500}, headers=limit) for _ in "ab"]
    assert refused.status_code == 401
    assert fixed.status_code == again.status_code == 201
    assert again.headers.get("idempotent-replayed") == "true"
    assert runs == ["ada"]
    assert [r.status_code for r in over] == [403, 403]
    assert over[1].headers.get("idempotent-replayed") == "true"
