"""The ASGI middleware against SPEC §4's HTTP table, through Starlette's and FastAPI's
TestClient on every store, plus a real uvicorn server under concurrent duplicates."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import anyio
import httpx
import pytest
import uvicorn
from fastapi import APIRouter, FastAPI
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket

from helpers import new_key
from idempo import AsyncIdempotency, Policy, Scope, Status, StoreUnavailableError
from idempo._core.ops import Release, Settle
from idempo.asgi import IdempotencyMiddleware, _Renewal
from idempo.events import key_digest
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.postgres import AsyncPostgresStore
from idempo.stores.sqlite import AsyncSQLiteStore

PAYMENT = {"amount": 1000, "currency": "EUR"}
GATE_SECONDS = 10  # the most a gated handler waits for its test to open the gate


# --- the example app ----------------------------------------------------------------------


@dataclass
class Backend:
    """The app's side of a test: what ran, and a gate that holds a handler until opened."""

    store: Any = None  # the async store, for handlers that read their own record
    calls: Counter[str] = field(default_factory=Counter)
    started: threading.Event = field(default_factory=threading.Event)
    gate: threading.Event = field(default_factory=threading.Event)
    seen: list[Any] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def count(self, name: str) -> int:
        with self.lock:
            self.calls[name] += 1
            return self.calls[name]


Endpoint = Callable[[Request], Awaitable[Response]]


def endpoints(backend: Backend) -> tuple[list[tuple[str, Endpoint, list[str]]], Endpoint]:
    """The example API as (path, endpoint, methods), the same for Starlette and FastAPI, and
    the endpoint each framework mounts under /api its own way."""

    async def payment(request: Request) -> Response:
        n = backend.count("payment")
        response = JSONResponse(
            {"payment": request.path_params["id"], "execution": n}, status_code=201
        )
        response.set_cookie("session", "secret-for-the-first-caller")
        return response

    async def order(request: Request) -> Response:
        n = backend.count("order")
        return JSONResponse({"order": n}, status_code=201)

    async def status(request: Request) -> Response:
        code = int(request.path_params["code"])
        n = backend.count(f"status-{code}")
        return Response(f"status {code}, execution {n}", status_code=code)

    async def boom(request: Request) -> Response:
        backend.count("boom")
        raise RuntimeError("the handler died")

    async def dies(request: Request) -> Response:
        backend.count("dies")
        await asyncio.sleep(0.35)  # long enough for a few renewals of a 0.3 s lease
        raise RuntimeError("died after a while")

    async def slow(request: Request) -> Response:
        n = backend.count("slow")
        backend.started.set()
        await asyncio.to_thread(backend.gate.wait, GATE_SECONDS)
        return JSONResponse({"slow": n}, status_code=201)

    async def raw(request: Request) -> Response:
        backend.count("raw")
        response = Response(b"\x00\x01 binary \xff\xfe body", status_code=202)
        response.raw_headers.extend(
            [
                (b"content-type", b"application/octet-stream"),
                (b"x-multi", b"one"),
                (b"x-multi", b"two"),
                (b"cache-control", b"no-store"),
                (b"set-cookie", b"a=1"),
                (b"set-cookie", b"b=2"),
                (b"keep-alive", b"timeout=5"),
                (b"connection", b"x-hop"),
                (b"x-hop", b"hop-by-hop by name"),
            ]
        )
        return response

    async def big(request: Request) -> Response:
        backend.count("big")
        return Response(b"x" * int(request.query_params["size"]), status_code=201)

    async def stream(request: Request) -> Response:
        backend.count("stream")
        chunks = int(request.query_params["chunks"])

        async def body() -> AsyncIterator[bytes]:
            for i in range(chunks):
                yield f"chunk {i:04d}|".encode() * 10

        return StreamingResponse(body(), status_code=201, media_type="text/plain")

    async def echo(request: Request) -> Response:
        n = backend.count("echo")
        body = await request.body()
        return JSONResponse({"received": body.decode("latin-1"), "execution": n}, status_code=201)

    async def background(request: Request) -> Response:
        backend.count("background")
        key = request.headers["idempotency-key"]
        operation = "POST /background"
        principal = ""

        async def after_response() -> None:
            # Runs after the response was sent: the record must already be settled.
            record = await backend.store.get(Scope(principal, operation, key))
            backend.seen.append(record.status if record else None)

        return JSONResponse(
            {"ok": True}, status_code=201, background=BackgroundTask(after_response)
        )

    async def thing(request: Request) -> Response:
        n = backend.count("thing")
        return JSONResponse({"thing": request.path_params["id"], "execution": n}, status_code=201)

    async def unguarded(request: Request) -> Response:
        n = backend.count(f"unguarded-{request.method}")
        return JSONResponse({"method": request.method, "execution": n})

    return [
        ("/payments/{id}", payment, ["POST", "PATCH"]),
        ("/payments/{id}", unguarded, ["GET", "PUT", "DELETE"]),
        ("/orders", order, ["POST"]),
        ("/status/{code}", status, ["POST"]),
        ("/boom", boom, ["POST"]),
        ("/dies", dies, ["POST"]),
        ("/slow", slow, ["POST"]),
        ("/raw", raw, ["POST"]),
        ("/big", big, ["POST"]),
        ("/stream", stream, ["POST"]),
        ("/echo", echo, ["POST"]),
        ("/background", background, ["POST"]),
    ], thing


async def websocket_echo(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text(await websocket.receive_text())
    await websocket.close()


def build_app(
    framework: str,
    backend: Backend,
    *,
    startup: Sequence[Callable[[], Awaitable[Any]]] = (),
    shutdown: Sequence[Callable[[], Awaitable[Any]]] = (),
    **options: Any,
) -> Any:
    """The example API on ``framework``, guarded by the middleware with ``options``."""
    routes, thing = endpoints(backend)

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        for hook in startup:
            await hook()
        try:
            yield
        finally:
            for hook in shutdown:
                await hook()

    if framework == "starlette":
        return Starlette(
            routes=[
                *(Route(path, endpoint, methods=methods) for path, endpoint, methods in routes),
                Mount("/api", routes=[Route("/things/{id}", thing, methods=["POST"])]),
                WebSocketRoute("/ws", websocket_echo),
            ],
            middleware=[Middleware(IdempotencyMiddleware, **options)],
            lifespan=lifespan,
        )
    app = FastAPI(lifespan=lifespan)
    for path, endpoint, methods in routes:
        app.add_api_route(path, endpoint, methods=methods)
    router = APIRouter(prefix="/api")
    router.add_api_route("/things/{id}", thing, methods=["POST"])
    app.include_router(router)
    app.add_api_websocket_route("/ws", websocket_echo)
    app.add_middleware(IdempotencyMiddleware, **options)
    return app


# --- fixtures -----------------------------------------------------------------------------


@dataclass
class Stores:
    """One store, twice: the async face the middleware uses (a new one per app, since a
    PostgreSQL pool belongs to the event loop that opened it) and a sync face to inspect."""

    kind: str
    sync: Any
    make_async: Callable[[], Any]


@pytest.fixture(
    params=[
        pytest.param("memory", id="memory"),
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    ]
)
def stores(request: pytest.FixtureRequest) -> Stores:
    """Every store: memory, SQLite and PostgreSQL, migrated and empty."""
    if request.param == "memory":
        sync = MemoryStore()
        return Stores("memory", sync, lambda: AsyncMemoryStore(sync))
    if request.param == "sqlite":
        sqlite = request.getfixturevalue("sqlite_store")
        return Stores("sqlite", sqlite, lambda: AsyncSQLiteStore(sqlite.path))
    pg = request.getfixturevalue("pg_store")
    url = request.getfixturevalue("postgres_url")
    table = f"{request.getfixturevalue('pg_schema')}.idempo_records"
    return Stores("postgres", pg, lambda: AsyncPostgresStore(url, table=table, max_size=8))


@pytest.fixture(params=["starlette", "fastapi"])
def framework(request: pytest.FixtureRequest) -> str:
    """Both frameworks the middleware is documented for."""
    return str(request.param)


@pytest.fixture
def backend() -> Iterator[Backend]:
    """A fresh example backend; its gate is opened at teardown so no handler outlives a test."""
    backend = Backend()
    yield backend
    backend.gate.set()


Serve = Callable[..., TestClient]


@pytest.fixture
def serve(framework: str, stores: Stores, backend: Backend) -> Iterator[Serve]:
    """Start the example app with middleware options; the client runs its lifespan."""
    with contextlib.ExitStack() as stack:

        def start(**options: Any) -> TestClient:
            store = stores.make_async()
            backend.store = store
            app = build_app(framework, backend, shutdown=[store.aclose], store=store, **options)
            client = TestClient(app, raise_server_exceptions=False)
            return stack.enter_context(client)

        yield start


def post(client: TestClient, path: str, key: str | None, **kwargs: Any) -> httpx.Response:
    headers = dict(kwargs.pop("headers", {}))
    if key is not None:
        headers["Idempotency-Key"] = key
    return client.post(path, headers=headers, **kwargs)


def replayed(response: Any) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def problem_of(response: Any, status: int, kind: str) -> dict[str, Any]:
    """The RFC 9457 body of a refusal, after checking its status, media type and type."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["type"] == f"urn:idempo:problem:{kind}"
    assert body["status"] == status
    assert body["title"]
    assert body["detail"]
    return body


# --- first request and replay -------------------------------------------------------------


def test_first_request_gets_the_apps_own_answer(serve: Serve, backend: Backend) -> None:
    """The first request runs the handler and gets its status, body and cookies unchanged."""
    client = serve()
    response = post(client, "/payments/1", new_key(), json=PAYMENT)
    assert response.status_code == 201
    assert response.json() == {"payment": "1", "execution": 1}
    assert "session=" in response.headers["set-cookie"]
    assert not replayed(response)
    assert backend.calls["payment"] == 1


def test_duplicate_replays_the_stored_answer(serve: Serve, backend: Backend) -> None:
    """A duplicate gets the stored status and body with Idempotent-Replayed and no rerun."""
    client = serve()
    key = new_key()
    first = post(client, "/payments/1", key, json=PAYMENT)
    second = post(client, "/payments/1", key, json=PAYMENT)
    assert second.status_code == 201
    assert second.content == first.content
    assert replayed(second)
    assert backend.calls["payment"] == 1


def test_replay_is_byte_identical_minus_hop_by_hop_and_cookies(
    serve: Serve, backend: Backend
) -> None:
    """A replay repeats status, body and every header in order, except hop-by-hop fields
    (named in Connection too) and Set-Cookie, and adds Idempotent-Replayed: true."""
    client = serve()
    key = new_key()
    first = post(client, "/raw", key, content=b"payload")
    second = post(client, "/raw", key, content=b"payload")
    dropped = {b"set-cookie", b"keep-alive", b"connection", b"x-hop"}
    expected = [(name, value) for name, value in first.headers.raw if name not in dropped]
    assert second.status_code == first.status_code == 202
    assert second.content == first.content == b"\x00\x01 binary \xff\xfe body"
    assert second.headers.raw == [*expected, (b"idempotent-replayed", b"true")]
    assert backend.calls["raw"] == 1


def test_set_cookie_is_never_stored(serve: Serve, stores: Stores) -> None:
    """The first caller's session cookie does not reach the store at all."""
    client = serve()
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT)
    record = stores.sync.get(Scope("", "POST /payments/{id}", key))
    assert record is not None
    assert record.status is Status.COMPLETED
    assert b"secret-for-the-first-caller" not in record.response
    assert b"set-cookie" not in record.response.lower()


def test_replay_status_200_option(serve: Serve, backend: Backend) -> None:
    """With replay_status_200 a stored 201 replays as 200 with the same body; a stored 4xx
    keeps its status."""
    client = serve(replay_status_200=True)
    key = new_key()
    first = post(client, "/payments/1", key, json=PAYMENT)
    second = post(client, "/payments/1", key, json=PAYMENT)
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.content == first.content
    assert replayed(second)
    failed_key = new_key()
    post(client, "/status/404", failed_key)
    assert post(client, "/status/404", failed_key).status_code == 404


def test_duplicate_after_the_response_replays_while_background_tasks_run(
    serve: Serve, backend: Backend
) -> None:
    """The record is settled before the client sees the response, not after background
    tasks: a background task that reads it finds it completed."""
    client = serve()
    key = new_key()
    assert post(client, "/background", key).status_code == 201
    assert backend.seen == [Status.COMPLETED]
    assert replayed(post(client, "/background", key))


def test_request_body_reaches_the_app_intact(serve: Serve, backend: Backend) -> None:
    """The middleware reads the body to fingerprint it, and the app still receives all of it,
    even when it arrives in chunks."""
    client = serve()

    def chunks() -> Iterator[bytes]:
        yield b"first part, "
        yield b"second part"

    response = post(client, "/echo", new_key(), content=chunks())
    assert response.json() == {"received": "first part, second part", "execution": 1}


# --- what is stored: completed, failed, released ------------------------------------------


@pytest.mark.parametrize("code", [200, 201, 204, 302])
def test_success_statuses_are_completed_and_replayed(
    serve: Serve, backend: Backend, stores: Stores, code: int
) -> None:
    """2xx and 3xx answers are stored as COMPLETED and replayed without a rerun."""
    client = serve()
    key = new_key()
    first = post(client, f"/status/{code}", key, follow_redirects=False)
    second = post(client, f"/status/{code}", key, follow_redirects=False)
    assert first.status_code == second.status_code == code
    assert second.content == first.content
    assert replayed(second)
    assert backend.calls[f"status-{code}"] == 1
    record = stores.sync.get(Scope("", "POST /status/{code}", key))
    assert record.status is Status.COMPLETED


@pytest.mark.parametrize("code", [400, 404, 422])
def test_deterministic_4xx_is_stored_and_replayed(
    serve: Serve, backend: Backend, stores: Stores, code: int
) -> None:
    """The app's own 4xx (other than 408/409/425/429) is recorded FAILED and replayed."""
    client = serve()
    key = new_key()
    first = post(client, f"/status/{code}", key)
    second = post(client, f"/status/{code}", key)
    assert first.status_code == second.status_code == code
    assert second.content == first.content
    assert replayed(second)
    assert backend.calls[f"status-{code}"] == 1
    record = stores.sync.get(Scope("", "POST /status/{code}", key))
    assert record.status is Status.FAILED


@pytest.mark.parametrize("code", [408, 409, 425, 429, 500, 503])
def test_transient_statuses_release_the_key(
    serve: Serve, backend: Backend, stores: Stores, code: int
) -> None:
    """5xx, 408, 409, 425 and 429 release the key: the retry executes again, nothing is kept."""
    client = serve()
    key = new_key()
    first = post(client, f"/status/{code}", key)
    second = post(client, f"/status/{code}", key)
    assert (first.status_code, second.status_code) == (code, code)
    assert second.text == f"status {code}, execution 2"
    assert not replayed(second)
    assert stores.sync.get(Scope("", "POST /status/{code}", key)) is None


def test_exception_releases_the_key(serve: Serve, backend: Backend, stores: Stores) -> None:
    """A handler that raises answers 500 and releases the key, so the retry runs again."""
    client = serve()
    key = new_key()
    assert post(client, "/boom", key).status_code == 500
    assert post(client, "/boom", key).status_code == 500
    assert backend.calls["boom"] == 2
    assert stores.sync.get(Scope("", "POST /boom", key)) is None


def test_classification_is_configurable(serve: Serve, backend: Backend) -> None:
    """A custom classifier decides what is kept: here 4xx answers release the key."""
    client = serve(classify=lambda status: Status.COMPLETED if status < 400 else None)
    key = new_key()
    post(client, "/status/404", key)
    second = post(client, "/status/404", key)
    assert second.text == "status 404, execution 2"


# --- refusals: mismatch, in progress, keys, sizes -----------------------------------------


def test_same_key_different_body_is_422(serve: Serve, backend: Backend) -> None:
    """Reusing a key with another body is refused with 422 problem+json and never executes."""
    client = serve()
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT)
    response = post(client, "/payments/1", key, json={**PAYMENT, "amount": 1})
    problem_of(response, 422, "fingerprint-mismatch")
    assert backend.calls["payment"] == 1


def test_same_key_different_query_is_422(serve: Serve) -> None:
    """The query string is part of the request's fingerprint."""
    client = serve()
    key = new_key()
    post(client, "/payments/1?mode=a", key, json=PAYMENT)
    problem_of(post(client, "/payments/1?mode=b", key, json=PAYMENT), 422, "fingerprint-mismatch")


def test_json_bodies_are_compared_canonically(serve: Serve, backend: Backend) -> None:
    """Two JSON bodies that mean the same (key order, spacing, 1.0 vs 1) are one request."""
    client = serve()
    key = new_key()
    json_type = {"content-type": "application/json"}
    post(client, "/payments/1", key, content=b'{"amount":1000,"currency":"EUR"}', headers=json_type)
    second = post(
        client,
        "/payments/1",
        key,
        content=b'{ "currency": "EUR", "amount": 1000.0 }',
        headers=json_type,
    )
    assert replayed(second)
    assert backend.calls["payment"] == 1


def test_other_bodies_are_compared_byte_for_byte(serve: Serve) -> None:
    """A non-JSON body counts as its raw bytes: a single changed space is another request."""
    client = serve()
    key = new_key()
    text = {"content-type": "text/plain"}
    post(client, "/echo", key, content=b"a b", headers=text)
    problem_of(
        post(client, "/echo", key, content=b"a  b", headers=text), 422, "fingerprint-mismatch"
    )


def test_fingerprint_headers_count_when_named(serve: Serve) -> None:
    """A header named in fingerprint_headers is part of the request; others are not."""
    client = serve(fingerprint_headers=("X-Tenant",))
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT, headers={"x-tenant": "a", "x-other": "1"})
    same = post(client, "/payments/1", key, json=PAYMENT, headers={"x-tenant": "a", "x-other": "2"})
    assert replayed(same)
    other = post(client, "/payments/1", key, json=PAYMENT, headers={"x-tenant": "b"})
    problem_of(other, 422, "fingerprint-mismatch")


def test_fingerprint_fields_are_configurable(serve: Serve, backend: Backend) -> None:
    """With only method and path counted, another body under the same key replays."""
    client = serve(fingerprint_fields=("method", "path"))
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT)
    assert replayed(post(client, "/payments/1", key, json={"anything": "else"}))
    assert backend.calls["payment"] == 1


def _in_background(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    return thread, result


def test_duplicate_while_running_is_409_with_retry_after(serve: Serve, backend: Backend) -> None:
    """A duplicate while the first request runs gets 409 problem+json with a whole-second
    Retry-After, and the first request's answer is replayed afterwards."""
    client = serve()
    key = new_key()
    thread, first = _in_background(lambda: post(client, "/slow", key))
    assert backend.started.wait(GATE_SECONDS)
    duplicate = post(client, "/slow", key)
    problem_of(duplicate, 409, "request-in-progress")
    assert 1 <= int(duplicate.headers["retry-after"]) <= 5
    backend.gate.set()
    thread.join(GATE_SECONDS)
    assert first[0].status_code == 201
    after = post(client, "/slow", key)
    assert replayed(after)
    assert after.content == first[0].content
    assert backend.calls["slow"] == 1


def test_policy_wait_turns_409_into_a_replay(serve: Serve, backend: Backend) -> None:
    """With Policy(wait=...) a duplicate of a running request waits for it and replays its
    answer instead of answering 409."""
    client = serve(policy=Policy(wait=timedelta(seconds=GATE_SECONDS)))
    key = new_key()
    thread, first = _in_background(lambda: post(client, "/slow", key))
    assert backend.started.wait(GATE_SECONDS)
    opener = threading.Timer(0.2, backend.gate.set)
    opener.start()
    duplicate = post(client, "/slow", key)  # sent while the first is held at the gate
    opener.join()
    thread.join(GATE_SECONDS)
    assert duplicate.status_code == 201
    assert replayed(duplicate)
    assert duplicate.content == first[0].content
    assert backend.calls["slow"] == 1


@pytest.mark.parametrize(
    ("value", "why"),
    [
        pytest.param("", "empty", id="empty"),
        pytest.param('""', "empty", id="empty-sf-string"),
        pytest.param("k" * 256, "255", id="too-long"),
        pytest.param("caf\xe9", "ASCII", id="non-ascii"),
        pytest.param("a\x7fb", "ASCII", id="non-printable"),
        pytest.param('"abc', "sf-string", id="unterminated-sf-string"),
        pytest.param('"a b"', "ASCII", id="space-in-sf-string"),
        pytest.param('"abc" trailing', "sf-string", id="trailing-after-sf-string"),
    ],
)
def test_malformed_keys_are_400(serve: Serve, backend: Backend, value: str, why: str) -> None:
    """A malformed key is refused with 400 problem+json and nothing runs or is stored."""
    client = serve()
    response = client.post(
        "/payments/1", json=PAYMENT, headers=[("Idempotency-Key", value.encode("latin-1"))]
    )
    body = problem_of(response, 400, "invalid-key")
    assert why.lower() in body["detail"].lower()
    assert backend.calls["payment"] == 0


def test_key_sent_twice_is_400(serve: Serve, backend: Backend) -> None:
    """Two Idempotency-Key headers are ambiguous: 400, nothing runs."""
    client = serve()
    headers = [("Idempotency-Key", "a"), ("Idempotency-Key", "b")]
    problem_of(client.post("/payments/1", json=PAYMENT, headers=headers), 400, "invalid-key")
    assert backend.calls["payment"] == 0


def test_key_of_255_characters_is_accepted(serve: Serve) -> None:
    """The longest valid key (255 printable characters) works."""
    client = serve()
    assert post(client, "/payments/1", "k" * 255, json=PAYMENT).status_code == 201


def test_missing_key_is_400(serve: Serve, backend: Backend, stores: Stores) -> None:
    """A guarded request without a key is refused with 400 problem+json by default."""
    client = serve()
    problem_of(post(client, "/payments/1", None, json=PAYMENT), 400, "missing-key")
    assert backend.calls["payment"] == 0


def test_missing_key_passes_through_when_not_required(serve: Serve, backend: Backend) -> None:
    """With require_key=False a request without a key runs unguarded, every time."""
    client = serve(require_key=False)
    assert post(client, "/payments/1", None, json=PAYMENT).status_code == 201
    assert post(client, "/payments/1", None, json=PAYMENT).status_code == 201
    assert backend.calls["payment"] == 2


def test_sf_string_and_bare_token_name_the_same_key(serve: Serve, backend: Backend) -> None:
    """``abc`` and ``"abc"`` are one key: the second replays the first."""
    client = serve()
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT)
    assert replayed(post(client, "/payments/1", f'"{key}"', json=PAYMENT))
    assert replayed(post(client, "/payments/1", f'"{key}";v=1', json=PAYMENT))
    assert backend.calls["payment"] == 1


def test_request_body_over_the_limit_is_413(serve: Serve, backend: Backend, stores: Stores) -> None:
    """A body over max_request_bytes gets 413 before anything runs or is stored, whether it
    declares its length or streams in chunks."""
    client = serve(max_request_bytes=100)
    key = new_key()
    problem_of(post(client, "/echo", key, content=b"x" * 101), 413, "request-too-large")

    def chunks() -> Iterator[bytes]:
        yield b"x" * 60
        yield b"x" * 60

    problem_of(post(client, "/echo", key, content=chunks()), 413, "request-too-large")
    assert backend.calls["echo"] == 0
    assert stores.sync.get(Scope("", "POST /echo", key)) is None
    assert post(client, "/echo", key, content=b"x" * 100).status_code == 201


# --- responses over the size limit --------------------------------------------------------


def test_response_over_the_limit_is_sent_and_recorded_as_not_stored(
    serve: Serve, backend: Backend, stores: Stores
) -> None:
    """A response over max_response_bytes reaches the first client whole; the record keeps
    a 500 response-not-stored problem, so a retry never runs the handler again."""
    client = serve(max_response_bytes=1000)
    key = new_key()
    first = post(client, "/big?size=5000", key)
    assert first.status_code == 201
    assert first.content == b"x" * 5000
    retry = post(client, "/big?size=5000", key)
    problem_of(retry, 500, "response-not-stored")
    assert replayed(retry)
    assert backend.calls["big"] == 1
    record = stores.sync.get(Scope("", "POST /big", key))
    assert record.status is Status.FAILED


def test_shared_guard_with_a_stricter_limit_still_answers(framework: str, backend: Backend) -> None:
    """A shared guard whose policy keeps less than the middleware's limit: the first client
    still gets the whole response, and a retry gets response-not-stored, never a rerun."""
    guard = AsyncIdempotency(AsyncMemoryStore(), Policy(max_response_bytes=100))
    key = new_key()
    with TestClient(build_app(framework, backend, idempotency=guard)) as client:
        first = post(client, "/big?size=500", key)
        assert first.content == b"x" * 500
        problem_of(post(client, "/big?size=500", key), 500, "response-not-stored")
    assert backend.calls["big"] == 1


def test_streamed_response_over_the_limit_streams_through(serve: Serve, backend: Backend) -> None:
    """A streamed response that outgrows the limit is passed on as it streams, complete."""
    client = serve(max_response_bytes=1000)
    key = new_key()
    first = post(client, "/stream?chunks=50", key)
    assert first.status_code == 201
    assert first.content == b"".join(f"chunk {i:04d}|".encode() * 10 for i in range(50))
    problem_of(post(client, "/stream?chunks=50", key), 500, "response-not-stored")
    assert backend.calls["stream"] == 1


def test_streamed_response_under_the_limit_is_stored_whole(serve: Serve, backend: Backend) -> None:
    """A response sent in many chunks is captured whole and replayed byte-identical."""
    client = serve()
    key = new_key()
    first = post(client, "/stream?chunks=20", key)
    second = post(client, "/stream?chunks=20", key)
    assert second.content == first.content
    assert len(first.content) == 20 * 110
    assert replayed(second)
    assert backend.calls["stream"] == 1


def test_transient_response_over_the_limit_still_releases(serve: Serve, backend: Backend) -> None:
    """Size does not change classification: a big 5xx releases the key like a small one."""
    client = serve(max_response_bytes=10)
    key = new_key()
    post(client, "/status/503", key)
    assert post(client, "/status/503", key).text == "status 503, execution 2"


# --- scopes: operations and principals ----------------------------------------------------


def test_route_template_makes_one_operation(serve: Serve, stores: Stores) -> None:
    """/payments/1 and /payments/2 are one operation (POST /payments/{id}): the same key on
    both is a mismatch, not two independent executions."""
    client = serve()
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT)
    problem_of(post(client, "/payments/2", key, json=PAYMENT), 422, "fingerprint-mismatch")
    assert stores.sync.get(Scope("", "POST /payments/{id}", key)) is not None


def test_mounted_and_included_routes_keep_their_prefix(serve: Serve, stores: Stores) -> None:
    """A route under a Starlette Mount or a FastAPI router prefix is named with its prefix."""
    client = serve()
    key = new_key()
    assert post(client, "/api/things/7", key).status_code == 201
    assert stores.sync.get(Scope("", "POST /api/things/{id}", key)) is not None


def test_same_key_at_another_endpoint_is_independent(serve: Serve, backend: Backend) -> None:
    """The same key at two endpoints names two scopes: both execute, neither replays."""
    client = serve()
    key = new_key()
    assert not replayed(post(client, "/payments/1", key, json=PAYMENT))
    assert not replayed(post(client, "/orders", key, json=PAYMENT))
    assert backend.calls["payment"] == backend.calls["order"] == 1


def test_same_method_and_key_under_patch_is_another_operation(
    serve: Serve, backend: Backend
) -> None:
    """PATCH and POST on one route are different operations."""
    client = serve()
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT)
    response = client.patch("/payments/1", json=PAYMENT, headers={"Idempotency-Key": key})
    assert response.status_code == 201
    assert not replayed(response)
    assert backend.calls["payment"] == 2


def test_principals_are_isolated(serve: Serve, backend: Backend, stores: Stores) -> None:
    """Two Authorization headers are two principals: the same key runs once for each, and
    the store keeps a hash of the credential, never the credential."""
    client = serve()
    key = new_key()
    alice = {"Authorization": "Bearer alice-token"}
    bob = {"Authorization": "Bearer bob-token"}
    a1 = post(client, "/payments/1", key, json=PAYMENT, headers=alice)
    b1 = post(client, "/payments/1", key, json=PAYMENT, headers=bob)
    a2 = post(client, "/payments/1", key, json=PAYMENT, headers=alice)
    assert (a1.json()["execution"], b1.json()["execution"]) == (1, 2)
    assert not replayed(b1)
    assert replayed(a2)
    assert a2.content == a1.content
    principal = hashlib.sha256(b"Bearer alice-token").hexdigest()
    record = stores.sync.get(Scope(principal, "POST /payments/{id}", key))
    assert record is not None
    assert b"alice-token" not in record.response


def test_principal_and_operation_resolvers(serve: Serve, stores: Stores) -> None:
    """The app can name the principal and operation from the scope; a None operation means
    the default, a "" principal anonymous (a None principal is refused: test_principals)."""
    client = serve(
        principal=lambda scope: dict(scope["headers"]).get(b"x-user", b"").decode(),
        operation=lambda scope: "charge" if scope["path"].startswith("/payments") else None,
    )
    key = new_key()
    post(client, "/payments/1", key, json=PAYMENT, headers={"x-user": "u-1"})
    post(client, "/orders", key, json=PAYMENT)
    assert stores.sync.get(Scope("u-1", "charge", key)) is not None
    assert stores.sync.get(Scope("", "POST /orders", key)) is not None


# --- pass-through -------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["GET", "PUT", "DELETE"])
def test_unguarded_methods_pass_through(
    serve: Serve, backend: Backend, stores: Stores, method: str
) -> None:
    """GET, PUT and DELETE run every time, even with a malformed key, and store nothing."""
    client = serve()
    for _ in range(2):
        response = client.request(method, "/payments/1", headers={"Idempotency-Key": '"bad'})
        assert response.status_code == 200
        assert not replayed(response)
    assert backend.calls[f"unguarded-{method}"] == 2
    assert stores.sync.stats() == {}


def test_websockets_pass_through(serve: Serve) -> None:
    """Non-HTTP scopes (here a websocket) are not touched."""
    client = serve()
    with client.websocket_connect("/ws") as websocket:
        websocket.send_text("hello")
        assert websocket.receive_text() == "hello"


def test_guarded_methods_are_configurable(serve: Serve, backend: Backend) -> None:
    """methods=("PUT",) guards PUT and leaves POST alone."""
    client = serve(methods=("put",))
    key = new_key()
    assert client.put("/payments/1", headers={"Idempotency-Key": key}).status_code == 200
    assert replayed(client.put("/payments/1", headers={"Idempotency-Key": key}))
    post(client, "/payments/1", None, json=PAYMENT)
    assert backend.calls["payment"] == 1


# --- leases -------------------------------------------------------------------------------


def test_background_renewal_keeps_a_slow_handler_alone(serve: Serve, backend: Backend) -> None:
    """A handler running three times its 0.3 s lease keeps it by renewal: duplicates during
    that time get 409 and never a second execution."""
    client = serve(lease=0.3)
    key = new_key()
    thread, first = _in_background(lambda: post(client, "/slow", key))
    assert backend.started.wait(GATE_SECONDS)
    for _ in range(3):
        time.sleep(0.35)  # a real lease must pass: past the unrenewed lease's end
        problem_of(post(client, "/slow", key), 409, "request-in-progress")
    backend.gate.set()
    thread.join(GATE_SECONDS)
    assert first[0].status_code == 201
    assert replayed(post(client, "/slow", key))
    assert backend.calls["slow"] == 1


def test_without_renewal_a_duplicate_would_take_over(
    framework: str, backend: Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control for the renewal test: with renewal switched off, a duplicate after the 0.3 s
    lease takes the key over and runs the handler a second time."""
    monkeypatch.setattr(_Renewal, "start", lambda self: None)
    app = build_app(framework, backend, store=AsyncMemoryStore(), lease=0.3)
    key = new_key()
    with TestClient(app) as client:
        first, _ = _in_background(lambda: post(client, "/slow", key))
        assert backend.started.wait(GATE_SECONDS)
        time.sleep(0.35)  # a real lease must pass
        second, _ = _in_background(lambda: post(client, "/slow", key))
        deadline = time.monotonic() + GATE_SECONDS
        while backend.calls["slow"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        backend.gate.set()
        first.join(GATE_SECONDS)
        second.join(GATE_SECONDS)
    assert backend.calls["slow"] == 2


# --- the store failing --------------------------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _unreachable_app(framework: str, backend: Backend, **options: Any) -> Any:
    """The example app on a PostgreSQL store at a port where nothing listens."""
    pool = AsyncConnectionPool(
        f"postgresql://postgres@127.0.0.1:{_closed_port()}/test",
        kwargs={"autocommit": True},
        min_size=1,
        open=False,
        timeout=0.5,
    )
    store = AsyncPostgresStore(pool)
    return build_app(
        framework, backend, startup=[pool.open], shutdown=[pool.close], store=store, **options
    )


@pytest.fixture
def quiet_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """psycopg's pool logs every failed reconnection to the closed port; these tests expect
    them."""
    monkeypatch.setattr(logging.getLogger("psycopg.pool"), "disabled", True)


@pytest.mark.usefixtures("quiet_pool")
def test_unreachable_store_is_503(framework: str, backend: Backend) -> None:
    """When the store cannot be reached the request is refused with 503 and Retry-After,
    and the handler does not run (fail closed)."""
    with TestClient(_unreachable_app(framework, backend, store_retry_after=7)) as client:
        response = post(client, "/payments/1", new_key(), json=PAYMENT)
    problem_of(response, 503, "store-unavailable")
    assert response.headers["retry-after"] == "7"
    assert backend.calls["payment"] == 0


@pytest.mark.usefixtures("quiet_pool")
def test_unreachable_store_fails_open_when_asked(
    framework: str, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """With fail_open the request runs without idempotency, body intact, and a warning says so."""
    with TestClient(_unreachable_app(framework, backend, fail_open=True)) as client:
        response = post(client, "/echo", new_key(), content=b"still here")
    assert response.status_code == 201
    assert response.json()["received"] == "still here"
    assert any("unguarded" in record.getMessage() for record in caplog.records), caplog.records


class _FailingCompletion(AsyncMemoryStore):
    async def complete(self, *args: Any, **kwargs: Any) -> None:
        raise StoreUnavailableError("the store went away mid-request")


def test_store_failing_after_the_work_still_answers(
    framework: str, backend: Backend, caplog: pytest.LogCaptureFixture
) -> None:
    """If the store fails while recording a response, the client still gets the response it
    is owed (the work ran), and a warning names the key."""
    store = _FailingCompletion()
    key = new_key()
    with TestClient(build_app(framework, backend, store=store)) as client:
        response = post(client, "/payments/1", key, json=PAYMENT)
    assert response.status_code == 201
    assert response.json()["execution"] == 1
    # Named by its digest: raw keys stay out of log lines (idempo.events.key_digest).
    assert any(key_digest(key) in record.getMessage() for record in caplog.records)
    assert not any(key in record.getMessage() for record in caplog.records)


class _CountingRenewals(AsyncMemoryStore):
    def __init__(self) -> None:
        super().__init__()
        self.renewals = 0

    async def renew(self, *args: Any, **kwargs: Any) -> None:
        self.renewals += 1
        await super().renew(*args, **kwargs)


def test_handler_that_dies_stops_renewing(framework: str) -> None:
    """When the handler raises, renewal stops with it and the key is released at once."""
    store = _CountingRenewals()
    backend = Backend()
    key = new_key()
    app = build_app(framework, backend, store=store, lease=0.3)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert post(client, "/dies", key).status_code == 500
        renewals = store.renewals
        assert renewals >= 2
        time.sleep(0.3)  # a real interval must pass to show nothing renews any more
        assert store.renewals == renewals
        assert post(client, "/dies", key).status_code == 500
    assert backend.calls["dies"] == 2


# --- configuration ------------------------------------------------------------------------


def test_configuration_errors() -> None:
    """Impossible configurations raise ConfigurationError when the middleware is made."""
    from idempo import ConfigurationError

    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    store = AsyncMemoryStore()
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app)
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app, store=store, idempotency=AsyncIdempotency(store))
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app, idempotency=AsyncIdempotency(store), lease=1)
    with pytest.raises(ConfigurationError, match="AsyncStore"):
        IdempotencyMiddleware(app, store=MemoryStore())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app, store=store, fingerprint_fields=("cookies",))  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        IdempotencyMiddleware(app, store=store, max_retry_after=0)


def test_store_url_and_shared_guard() -> None:
    """A store URL opens an async store; a shared AsyncIdempotency keeps its own policy."""

    async def app(scope: Any, receive: Any, send: Any) -> None: ...

    assert isinstance(
        IdempotencyMiddleware(app, store="memory://").idempotency.store, AsyncMemoryStore
    )
    guard = AsyncIdempotency(AsyncMemoryStore(), Policy(lease=timedelta(seconds=9)))
    middleware = IdempotencyMiddleware(app, idempotency=guard)
    assert middleware.idempotency is guard
    assert middleware.renew_every == 3


def test_plain_asgi_app_uses_the_raw_path() -> None:
    """Without a router to ask, the operation is the method and the raw path."""
    store = MemoryStore()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"made"})

    key = new_key()
    # No lifespan: this bare app does not speak it.
    client = TestClient(IdempotencyMiddleware(app, store=AsyncMemoryStore(store)))
    assert post(client, "/things/9", key).content == b"made"
    assert replayed(post(client, "/things/9", key))
    assert store.get(Scope("", "POST /things/9", key)) is not None


def test_app_that_sends_no_response_releases_the_key() -> None:
    """An app that returns without a whole response stores nothing; the retry runs again."""
    store = MemoryStore()
    calls = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append(1)

    key = new_key()
    client = TestClient(IdempotencyMiddleware(app, store=AsyncMemoryStore(store)))
    for _ in range(2):
        # The test client, like a server, complains of an app that never answered.
        with pytest.raises(AssertionError):
            post(client, "/nothing", key)
    assert len(calls) == 2
    assert store.get(Scope("", "POST /nothing", key)) is None


# --- end to end: a real server, concurrent clients ----------------------------------------


@contextlib.contextmanager
def running_server(app: Any) -> Iterator[str]:
    """Serve ``app`` with uvicorn on a free loopback port in a thread; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:  # readiness, bounded: uvicorn has no callback for it
        assert thread.is_alive(), "uvicorn stopped before it started"
        assert time.monotonic() < deadline, "uvicorn did not start within 10 s"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_concurrent_duplicates_on_a_real_server(stores: Stores, backend: Backend) -> None:
    """20 concurrent duplicates of one key against uvicorn: exactly one execution; the
    others get 409 while it runs, and 20 more afterwards all get the byte-identical replay."""
    store = stores.make_async()
    backend.store = store
    app = build_app("fastapi", backend, shutdown=[store.aclose], store=store)
    key = new_key()
    headers = {"Idempotency-Key": key}

    async def storm(base_url: str) -> tuple[list[httpx.Response], list[httpx.Response]]:
        limits = httpx.Limits(max_connections=50)
        async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=20) as client:
            tasks = [
                asyncio.create_task(client.post("/slow", json=PAYMENT, headers=headers))
                for _ in range(20)
            ]
            # The first request holds the key behind the gate; the other 19 must answer
            # while it does, before the gate opens.
            while sum(task.done() for task in tasks) < 19:
                await asyncio.wait(
                    [task for task in tasks if not task.done()],
                    timeout=GATE_SECONDS,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            backend.gate.set()
            during = await asyncio.gather(*tasks)
            after = await asyncio.gather(
                *(client.post("/slow", json=PAYMENT, headers=headers) for _ in range(20))
            )
        return during, after

    with running_server(app) as base_url:
        during, after = asyncio.run(storm(base_url))
    assert backend.calls["slow"] == 1
    executed = [r for r in during if r.status_code == 201 and not replayed(r)]
    assert len(executed) == 1
    for response in during:
        if response is not executed[0]:
            problem_of(response, 409, "request-in-progress")
            assert int(response.headers["retry-after"]) >= 1
    for response in after:
        assert response.status_code == 201
        assert replayed(response)
        assert response.content == executed[0].content


# --- a client that disconnects while the endpoint runs (SPEC §8) --------------------------


class CancelOnDisconnect:
    """Outer middleware that cancels the app (an anyio cancel scope) when its client goes
    away, as servers and apps that stop work for a gone client do."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        inbox, outbox = anyio.create_memory_object_stream[dict[str, Any]](64)
        async with inbox, outbox, anyio.create_task_group() as group:

            async def watch() -> None:
                while True:
                    message = await receive()
                    await inbox.send(message)
                    if message["type"] == "http.disconnect":
                        group.cancel_scope.cancel()
                        return

            async def run() -> None:
                await self.app(scope, outbox.receive, send)
                group.cancel_scope.cancel()

            group.start_soon(watch)
            group.start_soon(run)


def _watched(store: Any, verb: str) -> threading.Event:
    """An event set once ``store.verb`` has returned or raised: the test waits on it. A
    store that takes operations (``perform``) is watched for the verb's operation."""
    done = threading.Event()
    if hasattr(store, "perform"):
        kind = {"release": Release, "complete": Settle}[verb]
        perform = store.perform

        def performed(op: Any) -> Any:
            result = perform(op)
            if not isinstance(op, kind):
                return result

            async def watched() -> Any:
                try:
                    return await result
                finally:
                    done.set()

            return watched()

        store.perform = performed
        return done
    original = getattr(store, verb)

    async def watched(*args: Any, **kwargs: Any) -> Any:
        try:
            return await original(*args, **kwargs)
        finally:
            done.set()

    setattr(store, verb, watched)
    return done


def _disconnect_during(base_url: str, backend: Backend, key: str) -> None:
    """POST /slow with ``key`` on a raw socket and close it once the handler runs."""
    host, port = base_url.removeprefix("http://").split(":")
    body = json.dumps(PAYMENT).encode()
    request = (
        f"POST /slow HTTP/1.1\r\nHost: {host}\r\nIdempotency-Key: {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection((host, int(port))) as client:
        client.sendall(request)
        assert backend.started.wait(GATE_SECONDS), "the handler never started"


def test_a_client_disconnect_that_cancels_the_handler_releases_the_key(
    stores: Stores, backend: Backend
) -> None:
    """On a real uvicorn, a client that goes away while the endpoint runs, under an app
    that cancels work for gone clients: the key is released (not left in progress for a
    lease), so the retry runs at once."""
    store = stores.make_async()
    released = _watched(store, "release")
    app = CancelOnDisconnect(build_app("starlette", backend, shutdown=[store.aclose], store=store))
    key = new_key()
    with running_server(app) as base_url:
        _disconnect_during(base_url, backend, key)
        assert released.wait(GATE_SECONDS), "the cancelled request never released its key"
        assert stores.sync.get(Scope("", "POST /slow", key)) is None
        backend.gate.set()
        retry = httpx.post(f"{base_url}/slow", json=PAYMENT, headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert not replayed(retry)
    assert backend.calls["slow"] == 2


def test_a_client_disconnect_the_handler_ignores_completes_the_key(
    stores: Stores, backend: Backend
) -> None:
    """uvicorn does not cancel an app whose client went away: the handler finishes, its
    response is stored, and the retry replays it instead of running the work again."""
    store = stores.make_async()
    completed = _watched(store, "complete")
    app = build_app("starlette", backend, shutdown=[store.aclose], store=store)
    key = new_key()
    with running_server(app) as base_url:
        _disconnect_during(base_url, backend, key)
        backend.gate.set()
        assert completed.wait(GATE_SECONDS), "the finished request never stored its response"
        retry = httpx.post(f"{base_url}/slow", json=PAYMENT, headers={"Idempotency-Key": key})
    assert retry.status_code == 201
    assert replayed(retry)
    assert backend.calls["slow"] == 1
