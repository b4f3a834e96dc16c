"""The aiohttp middleware (`idempo.contrib.aiohttp`) against the whole HTTP contract table of
SPEC §4, on a real aiohttp server listening on loopback (aiohttp's `TestServer`), with a
memory store and a real SQLite file, and transactional ``connection=`` on SQLite."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

from helpers import new_key
from idempo import ConfigurationError, Scope, StoreUnavailableError
from idempo.contrib.aiohttp import (
    USER,
    IdempotencyMiddleware,
    current_attempt,
    idempotent_connection,
)
from idempo.stores.memory import AsyncMemoryStore
from idempo.stores.sqlite import AsyncSQLiteStore

pytestmark = pytest.mark.anyio

PAYMENT = {"amount": 1000, "currency": "EUR"}
WAIT = 10


class Backend:
    """The app's handlers: they count their runs; ``/slow`` waits for ``gate``."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.started = asyncio.Event()
        self.gate = asyncio.Event()
        self.attempts: list[Scope] = []

    async def payment(self, request: web.Request) -> web.Response:
        self.calls["payment"] += 1
        with contextlib.suppress(ConfigurationError):  # unguarded: no attempt
            self.attempts.append(current_attempt(request).scope)
        body = await request.json()
        response = web.json_response(
            {"id": request.match_info["pid"], "amount": body["amount"], "n": self.calls["payment"]},
            status=201,
        )
        response.set_cookie("session", "first-caller-only")
        return response

    async def slow(self, request: web.Request) -> web.Response:
        self.calls["slow"] += 1
        self.started.set()
        await asyncio.wait_for(self.gate.wait(), WAIT)
        return web.json_response({"n": self.calls["slow"]}, status=201)

    async def put(self, request: web.Request) -> web.Response:
        self.calls["put"] += 1
        return web.json_response({"n": self.calls["put"]})

    async def refused(self, request: web.Request) -> web.Response:
        self.calls["refused"] += 1
        raise web.HTTPConflict(text=f"refused {self.calls['refused']}")  # transient: released

    async def missing(self, request: web.Request) -> web.Response:
        self.calls["missing"] += 1
        raise web.HTTPNotFound(text="no such thing")  # the app's own 404: stored, replayed


@web.middleware
async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
    """An outer auth middleware: ``X-User`` names the signed-in user."""
    user = request.headers.get("X-User")
    if user is not None:
        request[USER] = {"id": user}
    return await handler(request)


Serve = Callable[..., Awaitable[tuple[str, Backend, Any]]]


@pytest.fixture(params=["memory", "sqlite"])
async def serve(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Serve]:
    """Starts a real aiohttp server with the middleware; yields ``(base_url, backend, mw)``."""
    servers: list[TestServer] = []
    stores: list[Any] = []

    async def start(**options: Any) -> tuple[str, Backend, Any]:
        if "store" not in options and "idempotency" not in options:
            if request.param == "memory":
                options["store"] = AsyncMemoryStore()
            else:
                store = AsyncSQLiteStore(tmp_path / f"idem{len(stores)}.db")
                await store.migrate()
                stores.append(store)
                options["store"] = store
        backend = Backend()
        middleware = IdempotencyMiddleware(**options)
        app = web.Application(middlewares=[auth, middleware])
        app.router.add_post("/payments/{pid}", backend.payment)
        app.router.add_post("/slow", backend.slow)
        app.router.add_put("/things", backend.put)
        app.router.add_get("/things", backend.put)
        app.router.add_post("/refused", backend.refused)
        app.router.add_post("/missing", backend.missing)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/"), backend, middleware

    yield start
    for server in servers:
        await server.close()
    for store in stores:
        await store.aclose()


@pytest.fixture
async def http() -> AsyncIterator[ClientSession]:
    async with ClientSession() as session:
        yield session


async def post(
    http: ClientSession, url: str, key: str | None, body: Any = PAYMENT, **headers: str
) -> tuple[int, Mapping[str, str], bytes]:
    if key is not None:
        headers["Idempotency-Key"] = key
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, response.headers.copy(), await response.read()


def problem(answer: tuple[int, Mapping[str, str], bytes], status: int, kind: str) -> None:
    import json

    code, headers, body = answer
    assert code == status, body
    assert headers["Content-Type"] == "application/problem+json"
    assert json.loads(body)["type"] == f"urn:idempo:problem:{kind}"


async def test_first_request_then_a_byte_identical_replay(
    serve: Serve, http: ClientSession
) -> None:
    base, backend, _ = await serve()
    key = new_key()
    first = await post(http, f"{base}/payments/7", key)
    assert first[0] == 201
    assert "Idempotent-Replayed" not in first[1]
    assert "Set-Cookie" in first[1]  # the first caller gets the app's own response
    again = await post(http, f"{base}/payments/7", key)
    assert again[0] == 201
    assert again[2] == first[2]  # byte-identical
    assert again[1]["Idempotent-Replayed"] == "true"
    assert again[1]["Content-Type"] == first[1]["Content-Type"]
    assert "Set-Cookie" not in again[1]
    assert backend.calls["payment"] == 1
    assert backend.attempts == [Scope("", "POST /payments/{pid}", key)]  # the route template


async def test_replay_status_200_option(serve: Serve, http: ClientSession) -> None:
    base, _, _ = await serve(replay_status_200=True)
    key = new_key()
    first = await post(http, f"{base}/payments/1", key)
    again = await post(http, f"{base}/payments/1", key)
    assert (first[0], again[0], again[2]) == (201, 200, first[2])


async def test_same_key_other_request_is_422(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve()
    key = new_key()
    await post(http, f"{base}/payments/1", key)
    problem(await post(http, f"{base}/payments/1", key, {"amount": 5}), 422, "fingerprint-mismatch")
    assert backend.calls["payment"] == 1


async def test_in_progress_is_409_with_retry_after(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve()
    key = new_key()
    first = asyncio.ensure_future(post(http, f"{base}/slow", key))
    await asyncio.wait_for(backend.started.wait(), WAIT)
    second = await post(http, f"{base}/slow", key)
    problem(second, 409, "request-in-progress")
    assert 1 <= int(second[1]["Retry-After"]) <= 5
    backend.gate.set()
    assert (await first)[0] == 201
    assert (await post(http, f"{base}/slow", key))[1]["Idempotent-Replayed"] == "true"
    assert backend.calls["slow"] == 1


@pytest.mark.parametrize("value", ["", "a" * 256, "bad key", '"unterminated', '"a" b'])
async def test_a_malformed_key_is_400(serve: Serve, http: ClientSession, value: str) -> None:
    base, backend, _ = await serve()
    problem(await post(http, f"{base}/payments/1", value), 400, "invalid-key")
    assert backend.calls["payment"] == 0


async def test_a_missing_key_is_400_unless_not_required(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve()
    problem(await post(http, f"{base}/payments/1", None), 400, "missing-key")
    base, backend, _ = await serve(require_key=False)
    assert (await post(http, f"{base}/payments/1", None))[0] == 201
    assert (await post(http, f"{base}/payments/1", None))[0] == 201
    assert backend.calls["payment"] == 2


async def test_an_sf_string_names_the_same_key(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve()
    key = new_key()
    first = await post(http, f"{base}/payments/1", key)
    again = await post(http, f"{base}/payments/1", f'"{key}"')
    assert again[1]["Idempotent-Replayed"] == "true"
    assert again[2] == first[2]
    assert backend.calls["payment"] == 1


class DownStore(AsyncMemoryStore):
    async def reserve(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailableError("connection refused")


async def test_store_down_is_503_unless_fail_open(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve(store=DownStore(), store_retry_after=7)
    answer = await post(http, f"{base}/payments/1", new_key())
    problem(answer, 503, "store-unavailable")
    assert answer[1]["Retry-After"] == "7"
    assert backend.calls["payment"] == 0
    base, backend, _ = await serve(store=DownStore(), fail_open=True)
    assert (await post(http, f"{base}/payments/1", new_key()))[0] == 201


async def test_unguarded_methods_pass_through(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve()
    for _ in range(2):
        async with http.put(f"{base}/things", data=b"x", headers={"Idempotency-Key": ""}) as r:
            assert r.status == 200
            assert "Idempotent-Replayed" not in r.headers
        async with http.get(f"{base}/things", headers={"Idempotency-Key": "k"}) as r:
            assert r.status == 200
    assert backend.calls["put"] == 4


async def test_principals_keep_keys_apart(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve()
    key = new_key()
    await post(http, f"{base}/payments/1", key, Authorization="Bearer alice")
    await post(http, f"{base}/payments/1", key, Authorization="Bearer bob")
    again = await post(http, f"{base}/payments/1", key, Authorization="Bearer alice")
    await post(http, f"{base}/payments/1", key, **{"X-User": "42"})
    assert again[1]["Idempotent-Replayed"] == "true"
    alice = hashlib.sha256(b"Bearer alice").hexdigest()
    assert [scope.principal for scope in backend.attempts][::2] == [alice, "user:42"]
    assert backend.calls["payment"] == 3


async def test_a_resolver_that_cannot_tell_is_401(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve(principal=lambda request: request.headers.get("X-Tenant"))
    problem(await post(http, f"{base}/payments/1", new_key()), 401, "principal-required")
    assert (await post(http, f"{base}/payments/1", new_key(), **{"X-Tenant": "t1"}))[0] == 201
    assert backend.attempts[0].principal == "t1"


async def test_raised_answers_follow_the_status_rules(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve()
    key = new_key()
    assert (await post(http, f"{base}/refused", key))[0] == 409
    assert (await post(http, f"{base}/refused", key))[2] == b"refused 2"  # released: ran again
    first = await post(http, f"{base}/missing", key)
    again = await post(http, f"{base}/missing", key)
    assert (first[0], again[0], again[2]) == (404, 404, first[2])
    assert again[1]["Idempotent-Replayed"] == "true"
    assert backend.calls["missing"] == 1


async def test_an_unrouted_path_is_not_stored(serve: Serve, http: ClientSession) -> None:
    base, _, mw = await serve()
    key = new_key()
    assert (await post(http, f"{base}/nowhere", key))[0] == 404
    assert await mw.idempotency.store.get(Scope("", "POST /nowhere", key)) is None


async def test_too_large_request_is_413(serve: Serve, http: ClientSession) -> None:
    base, backend, _ = await serve(max_request_bytes=10)
    problem(await post(http, f"{base}/payments/1", new_key()), 413, "request-too-large")
    assert backend.calls["payment"] == 0


# --- transactional connection= on a real SQLite file -----------------------------------------


async def test_the_business_write_commits_with_the_record(
    tmp_path: Path, http: ClientSession
) -> None:
    """The handler writes on the idempotent connection: the write and the record commit
    together; a handler that fails after its write leaves neither."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    path = tmp_path / "app.db"
    store = AsyncSQLiteStore(path)
    await store.migrate()
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE orders (key TEXT)"))

    async def order(request: web.Request) -> web.Response:
        conn = idempotent_connection(request)
        await conn.execute(text("INSERT INTO orders VALUES (:k)"), {"k": request.headers["K"]})
        if request.headers.get("Crash"):
            raise RuntimeError("crashed after the write")
        return web.json_response({"ok": True}, status=201)

    app = web.Application(
        middlewares=[IdempotencyMiddleware(store=store, connection=engine.connect)]
    )
    app.router.add_post("/orders", order)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        url = str(server.make_url("/orders"))
        assert (await post(http, url, "k1", K="k1"))[0] == 201
        assert (await post(http, url, "k1", K="k1"))[1]["Idempotent-Replayed"] == "true"
        assert (await post(http, url, "k2", K="k2", Crash="1"))[0] == 500
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT key FROM orders"))).scalars().all()
        assert rows == ["k1"]
        assert await store.get(Scope("", "POST /orders", "k2")) is None  # released, not kept
        assert (await post(http, url, "k2", K="k2"))[0] == 201  # so the retry runs
    finally:
        await server.close()
        await engine.dispose()
        await store.aclose()
