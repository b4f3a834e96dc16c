"""Transactional mode over HTTP: ``IdempotencyMiddleware(connection=..., mode=...)``, with the
endpoint writing on the connection that carries its idempotency record.

Real SQLite files (SQLAlchemy + aiosqlite) and the real PostgreSQL (SQLAlchemy + psycopg),
each test in its own file or schema; FastAPI (``Depends(idempotent_connection)``) and plain
Starlette (``idempotent_connection(request)``); ``engine.connect`` and ``async_sessionmaker``
factories. The business table has no unique constraint on the key, so a second execution would
show as a second row. What is committed is always read through a separate, plain driver
connection (`AppDatabase`).
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Annotated, Any

import anyio
import httpx
import pytest
from fastapi import Depends, FastAPI
from psycopg_pool import AsyncConnectionPool
from sqlalchemy import String, text
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from helpers import Database, new_key
from idempo import AsyncAttempt, ConfigurationError, Policy, derive_key
from idempo.asgi import IdempotencyMiddleware
from idempo.contrib.starlette import current_attempt, idempotent_connection
from idempo.events import key_digest
from idempo.stores.memory import AsyncMemoryStore
from idempo.stores.redis import AsyncRedisStore
from idempo.testing import FakeClock
from test_sqlalchemy import AppDatabase

pytestmark = pytest.mark.anyio

MODES = ["transactional", "leased"]
DATABASES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    # SQLAlchemy's aiomysql: bytes parameters (the stored response) went through a PyMySQL
    # helper that is no longer there (aio-libs/aiomysql#1080) until idempo mended it.
    pytest.param("mysql", marks=pytest.mark.mysql, id="mariadb"),
]
# (framework, connection factory): FastAPI and Starlette on engine.connect, and FastAPI on
# async_sessionmaker (an AsyncSession).
APPS = [
    pytest.param(("fastapi", "connect"), id="fastapi"),
    pytest.param(("starlette", "connect"), id="starlette"),
    pytest.param(("fastapi", "session"), id="fastapi-session"),
]
WAIT = 10  # the most any test waits for a condition, in seconds

Hook = Callable[[int], Awaitable[None]]


# --- the app --------------------------------------------------------------------------------


@dataclass
class Handler:
    """The endpoint behind ``POST /work``: it counts its runs, writes one business row on the
    idempotent connection, and answers as ``script`` says (one entry per run, then 201).

    ``before_write`` and ``after_write`` are awaited with the run's number, so a test can hold
    a run or look at what is committed while it is in flight.
    """

    database: AppDatabase
    executions: int = 0
    script: list[str] = field(default_factory=list)
    before_write: Hook | None = None
    after_write: Hook | None = None
    attempts: list[AsyncAttempt] = field(default_factory=list)

    async def work(self, request: Request, conn: Any) -> Response:
        self.executions += 1
        n = self.executions
        outcome = self.script.pop(0) if self.script else "201"
        self.attempts.append(current_attempt(request))
        if self.before_write is not None:
            await self.before_write(n)
        key = request.headers["idempotency-key"]
        await conn.execute(text(self.database.insert), {"key": key, "worker": f"run-{n}"})
        if self.after_write is not None:
            await self.after_write(n)
        if outcome == "raise":
            raise RuntimeError("the endpoint broke after its write")
        if outcome == "raise-404":
            raise HTTPException(404, "no such thing")
        if outcome == "big":  # one message over the test's 1000-byte response limit
            return Response(b"x" * 2000, status_code=201)
        if outcome == "stream":  # 2000 bytes in four chunks: streams once past the limit
            return StreamingResponse(_chunks(4, b"y" * 500), status_code=201)
        return JSONResponse(
            {"run": n, "key": key}, status_code=int(outcome), headers={"x-run": "1"}
        )


async def _chunks(count: int, chunk: bytes) -> AsyncIterator[bytes]:
    for _ in range(count):
        yield chunk


async def fastapi_work(
    request: Request,
    conn: Annotated[Any, Depends(idempotent_connection)],
    attempt: Annotated[AsyncAttempt, Depends(current_attempt)],
) -> Response:
    assert attempt is current_attempt(request)
    handler: Handler = request.app.state.handler
    return await handler.work(request, conn)


async def fastapi_lookup(conn: Annotated[Any, Depends(idempotent_connection)]) -> dict[str, str]:
    return {"connection": type(conn).__name__}


async def starlette_work(request: Request) -> Response:
    handler: Handler = request.app.state.handler
    return await handler.work(request, idempotent_connection(request))


async def starlette_lookup(request: Request) -> Response:
    return JSONResponse({"connection": type(idempotent_connection(request)).__name__})


def build_app(framework: str, handler: Handler, **options: Any) -> Any:
    """``POST /work`` (guarded) and ``GET /lookup`` (not guarded, asks for the connection
    anyway) on ``framework``, behind the middleware with ``options``."""
    if framework == "starlette":
        app: Any = Starlette(
            routes=[
                Route("/work", starlette_work, methods=["POST"]),
                Route("/lookup", starlette_lookup, methods=["GET"]),
            ],
            middleware=[Middleware(IdempotencyMiddleware, **options)],
        )
    else:
        app = FastAPI()
        app.add_api_route("/work", fastapi_work, methods=["POST"])
        app.add_api_route("/lookup", fastapi_lookup, methods=["GET"])
        app.add_middleware(IdempotencyMiddleware, **options)
    app.state.handler = handler
    return app


def client_for(app: Any, *, raise_app_exceptions: bool = False) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app, raise_app_exceptions=raise_app_exceptions)
    return httpx.AsyncClient(transport=transport, base_url="http://testserver")


async def post(client: httpx.AsyncClient, key: str, path: str = "/work") -> httpx.Response:
    return await client.post(path, headers={"Idempotency-Key": key}, json={"amount": 5})


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def problem_of(response: httpx.Response, status: int, kind: str) -> dict[str, Any]:
    """The RFC 9457 body of a refusal, after checking its status, media type and type."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = response.json()
    assert body["type"] == f"urn:idempo:problem:{kind}"
    assert body["status"] == status
    return body


def same_answer(first: httpx.Response, again: httpx.Response) -> None:
    """``again`` is a replay of ``first``: the same status, headers and body bytes."""
    assert replayed(again)
    assert not replayed(first)
    assert again.status_code == first.status_code
    assert again.content == first.content
    replay_headers = [(n, v) for n, v in again.headers.raw if n != b"idempotent-replayed"]
    assert replay_headers == first.headers.raw


# --- the databases --------------------------------------------------------------------------


@dataclass
class Env:
    """One database as the app sees it (an async engine and the async store of its records)
    and as the test sees it (`AppDatabase`, plain driver connections)."""

    database: AppDatabase
    engine: AsyncEngine
    store: Any
    handler: Handler

    def app(self, framework: str = "fastapi", face: str = "connect", **options: Any) -> Any:
        """The app on this database, its connections from ``engine.connect`` or from an
        ``async_sessionmaker`` as ``face`` says."""
        factory = self.engine.connect if face == "connect" else async_sessionmaker(self.engine)
        options.setdefault("store", self.store)
        return build_app(framework, self.handler, connection=factory, **options)

    def rows(self) -> list[tuple[Any, ...]]:
        return self.database.rows()

    def records(self) -> list[tuple[Any, ...]]:
        """``(key, state)`` of every record: which token a record holds is the store's
        counter's business (tokens only grow, across scopes too)."""
        return [(key, state) for key, state, _ in self.database.records_seen()]

    async def committed(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """(rows, records) as committed, read off the event loop (a request is in flight)."""
        return await anyio.to_thread.run_sync(lambda: (self.rows(), self.records()))


@asynccontextmanager
async def open_env(base: Database, *, pool_size: int = 4) -> AsyncIterator[Env]:
    database = AppDatabase(**asdict(base))
    database.create_business_table("idem_key TEXT NOT NULL, worker TEXT NOT NULL")
    engine = create_async_engine(database.url(asynchronous=True))
    store = database.async_store(pool_size=pool_size)
    try:
        yield Env(database, engine, store, Handler(database))
    finally:
        await store.aclose()
        await engine.dispose()


@pytest.fixture(params=DATABASES)
def app_database(request: pytest.FixtureRequest) -> Database:
    """A fresh SQLite file or PostgreSQL schema with a migrated records table."""
    database: Database = request.getfixturevalue(f"{request.param}_database")
    return database


@pytest.fixture
async def env(app_database: Database) -> AsyncIterator[Env]:
    """The app's side and the test's side of one fresh database."""
    async with open_env(app_database) as opened:
        yield opened


# --- 1. commit together, replay without running ---------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", APPS)
async def test_write_and_record_commit_together_and_replay(
    env: Env, kind: tuple[str, str], mode: str
) -> None:
    """The endpoint's row and the COMPLETED record become visible together when the response
    is settled (in leased mode only the reservation shows before); a duplicate replays the
    first answer byte for byte without running the endpoint or writing a second row."""
    key = new_key()
    seen: list[Any] = []

    async def look(n: int) -> None:
        seen.append(await env.committed())

    env.handler.after_write = look
    async with client_for(env.app(*kind, mode=mode)) as client:
        first = await post(client, key)
        again = await post(client, key)
        third = await post(client, key)
    assert first.status_code == 201
    assert first.json() == {"run": 1, "key": key}
    same_answer(first, again)
    same_answer(first, third)
    assert env.handler.executions == 1
    in_flight = [] if mode == "transactional" else [(key, "in_progress")]
    assert seen == [([], in_flight)]
    assert env.rows() == [(key, "run-1")]
    assert env.records() == [(key, "completed")]


# --- 2. and 3. failures ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", APPS)
async def test_endpoint_raising_rolls_back_and_releases(
    env: Env, kind: tuple[str, str], mode: str
) -> None:
    """An endpoint that writes its row and then raises answers 500 and leaves no row and no
    record; the retry executes and commits exactly one row."""
    key = new_key()
    env.handler.script = ["raise"]
    async with client_for(env.app(*kind, mode=mode)) as client:
        failed = await post(client, key)
        assert failed.status_code == 500
        assert env.rows() == []
        assert env.records() == []
        retried = await post(client, key)
    assert retried.status_code == 201
    assert not replayed(retried)
    assert env.handler.executions == 2
    assert env.rows() == [(key, "run-2")]
    assert env.records() == [(key, "completed")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", APPS)
@pytest.mark.parametrize("status", ["500", "503", "429"])
async def test_transient_answer_rolls_back_and_releases(
    env: Env, kind: tuple[str, str], mode: str, status: str
) -> None:
    """An endpoint that writes its row and then answers a transient status (5xx, 429) has its
    row rolled back and the key released: the client gets that answer, the retry executes and
    commits exactly one row."""
    key = new_key()
    env.handler.script = [status]
    async with client_for(env.app(*kind, mode=mode)) as client:
        failed = await post(client, key)
        assert failed.status_code == int(status)
        assert env.rows() == []
        assert env.records() == []
        retried = await post(client, key)
    assert retried.status_code == 201
    assert not replayed(retried)
    assert env.rows() == [(key, "run-2")]
    assert env.records() == [(key, "completed")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", APPS)
@pytest.mark.parametrize("outcome", ["402", "raise-404"])
async def test_deterministic_4xx_commits_its_writes_with_the_failure(
    env: Env, kind: tuple[str, str], mode: str, outcome: str
) -> None:
    """A 4xx answer (returned, or an HTTPException the framework turns into one) is a
    deterministic failure: the FAILED response is stored and replayed, and rows the endpoint
    wrote before answering it COMMIT with it, exactly as a success's would. An endpoint that
    must not keep its writes on a 4xx raises (500: rolled back, released) or writes nothing
    before deciding."""
    key = new_key()
    env.handler.script = [outcome]
    async with client_for(env.app(*kind, mode=mode)) as client:
        first = await post(client, key)
        again = await post(client, key)
    assert first.status_code == (402 if outcome == "402" else 404)
    same_answer(first, again)
    assert env.handler.executions == 1
    assert env.rows() == [(key, "run-1")]
    assert env.records() == [(key, "failed")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("framework", ["fastapi", "starlette"])
async def test_response_over_the_limit_commits_as_not_stored(
    env: Env, framework: str, mode: str
) -> None:
    """A response over max_response_bytes reaches its client whole; it is recorded as the
    FAILED response-not-stored problem, the endpoint's row commits with that record, and the
    retry gets the problem replayed instead of a second run."""
    key = new_key()
    env.handler.script = ["big"]
    async with client_for(env.app(framework, mode=mode, max_response_bytes=1000)) as client:
        first = await post(client, key)
        again = await post(client, key)
    assert first.status_code == 201
    assert first.content == b"x" * 2000
    problem_of(again, 500, "response-not-stored")
    assert replayed(again)
    assert env.handler.executions == 1
    assert env.rows() == [(key, "run-1")]
    assert env.records() == [(key, "failed")]


# --- 4. concurrent duplicates ---------------------------------------------------------------


@pytest.fixture
async def pg_env(postgres_database: Database, anyio_backend: str) -> AsyncIterator[Env]:
    """The app's side and the test's side of a fresh PostgreSQL schema."""
    async with open_env(postgres_database, pool_size=10) as opened:
        yield opened


DUPLICATES = 8
ROUNDS = 3


@pytest.mark.postgres
@pytest.mark.parametrize(
    ("mode", "lock_timeout", "others"),
    [
        pytest.param("transactional", 20.0, "replay", id="transactional-wait-then-replay"),
        pytest.param("transactional", 0.2, "409", id="transactional-lock-timeout-409"),
        pytest.param("leased", 20.0, "409", id="leased-409"),
    ],
)
async def test_concurrent_duplicates_execute_once(
    pg_env: Env, mode: str, lock_timeout: float, others: str
) -> None:
    """Eight duplicates sent at once, each on its own connection, leave exactly one row. The
    first holds its run until the others are provably racing it: in transactional mode they
    all wait on its row lock, then replay (long lock timeout) or, once the lock timeout ends
    their wait, get 409 with Retry-After; in leased mode they see the committed reservation
    and get 409 at once. Never a second execution."""
    env = pg_env
    answered: list[httpx.Response] = []
    all_answered = asyncio.Event()

    async def hold(n: int) -> None:
        if others == "replay":
            await anyio.to_thread.run_sync(env.database.wait_for_lock_waiters, DUPLICATES - 1)
        else:
            with anyio.fail_after(WAIT):
                await all_answered.wait()

    env.handler.after_write = hold
    policy = Policy(lock_timeout=timedelta(seconds=lock_timeout))
    app = env.app(mode=mode, policy=policy)

    async def duplicate(client: httpx.AsyncClient, key: str) -> httpx.Response:
        response = await post(client, key)
        if response.status_code != 201 or replayed(response):
            answered.append(response)
            if len(answered) == DUPLICATES - 1:
                all_answered.set()
        return response

    async with client_for(app) as client:
        for round_ in range(ROUNDS):
            key = new_key()
            answered.clear()
            all_answered.clear()
            with anyio.fail_after(3 * WAIT):
                responses = await asyncio.gather(
                    *(duplicate(client, key) for _ in range(DUPLICATES))
                )
            executed = [r for r in responses if r.status_code == 201 and not replayed(r)]
            assert len(executed) == 1, [r.status_code for r in responses]
            for response in answered:
                if others == "replay":
                    same_answer(executed[0], response)
                else:
                    problem_of(response, 409, "request-in-progress")
                    assert 1 <= int(response.headers["retry-after"]) <= 5
            assert env.handler.executions == round_ + 1
            same_answer(executed[0], await post(client, key))
    assert len(env.rows()) == ROUNDS
    assert sorted(state for _, state in env.records()) == ["completed"] * ROUNDS


# --- 5. and 6. leased mode ------------------------------------------------------------------


@pytest.mark.parametrize("framework", ["fastapi", "starlette"])
async def test_leased_duplicate_in_flight_gets_409_at_once(env: Env, framework: str) -> None:
    """In leased mode the reservation commits before the endpoint runs: while it runs, any
    other connection sees the record IN_PROGRESS and a duplicate gets 409 with Retry-After
    without waiting for it; the row and the completed record commit together at the end."""
    key = new_key()
    running, gate = asyncio.Event(), asyncio.Event()
    seen: list[Any] = []

    async def call_out(n: int) -> None:
        # Like a payment provider's call: before any write, so SQLite's single writer lock is
        # not held while the duplicate reserves.
        running.set()
        with anyio.fail_after(WAIT):
            await gate.wait()

    async def look(n: int) -> None:
        seen.append(await env.committed())

    env.handler.before_write = call_out
    env.handler.after_write = look
    async with client_for(env.app(framework, mode="leased")) as client:
        first = asyncio.create_task(post(client, key))
        with anyio.fail_after(WAIT):
            await running.wait()
        assert await env.committed() == ([], [(key, "in_progress")])
        # The gate stays shut until it answers: a duplicate that waited would time out here.
        with anyio.fail_after(WAIT):
            busy = await post(client, key)
        gate.set()
        answer = await first
    problem_of(busy, 409, "request-in-progress")
    assert 1 <= int(busy.headers["retry-after"]) <= 5
    assert answer.status_code == 201
    assert seen == [([], [(key, "in_progress")])]
    assert env.handler.executions == 1
    assert env.rows() == [(key, "run-1")]
    assert env.records() == [(key, "completed")]


def recorded(app: Any, exchanges: list[list[dict[str, Any]]]) -> Any:
    """``app`` with what it sends the server recorded, one list per request, in order."""

    async def recorder(scope: Any, receive: Any, send: Any) -> None:
        sent: list[dict[str, Any]] = []
        exchanges.append(sent)

        async def record(message: Any) -> None:
            sent.append(dict(message))
            await send(message)

        await app(scope, receive, record)

    return recorder


@pytest.mark.parametrize("answer", ["201", "big", "stream"])
async def test_lost_lease_rolls_back_the_endpoints_writes(
    env: Env, clock: FakeClock, caplog: pytest.LogCaptureFixture, answer: str
) -> None:
    """A leased attempt whose lease ran out and was taken over cannot commit: its fenced
    outcome is refused inside its own transaction, so its row rolls back, and its client never
    gets the whole response it built: a 503 problem+json instead, or, for a response already
    streaming past max_response_bytes, a response that breaks off before its end. The
    taker-over's row and answer stand.

    On PostgreSQL the first attempt has written its row when the key is taken over. SQLite has
    one writer for the whole file, so there the first attempt writes after the takeover (a
    writer holding SQLite's lock would make the takeover wait instead)."""
    key = new_key()
    running, gate = asyncio.Event(), asyncio.Event()

    async def stall(n: int) -> None:
        if n == 1:
            running.set()
            with anyio.fail_after(WAIT):
                await gate.wait()

    if env.database.kind == "postgres":
        env.handler.after_write = stall
    else:
        env.handler.before_write = stall
    env.handler.script = [answer]  # the first run's answer; the taker-over's is a 201
    policy = Policy(clock=clock, lease=timedelta(seconds=30))
    options = {"policy": policy, "store_retry_after": 3, "max_response_bytes": 1000}
    exchanges: list[list[dict[str, Any]]] = []
    app = recorded(env.app(mode="leased", **options), exchanges)
    async with client_for(app) as client:
        first = asyncio.create_task(post(client, key))
        with anyio.fail_after(WAIT):
            await running.wait()
        clock.advance(seconds=31)
        taker = await post(client, key)
        assert taker.status_code == 201
        assert taker.json()["run"] == 2
        gate.set()
        lost = await first
        again = await post(client, key)
    if answer == "stream":
        # Start and 1500 bytes were out when the commit failed; the end never is.
        bodies = [m for m in exchanges[0] if m["type"] == "http.response.body"]
        assert [len(m["body"]) for m in bodies] == [1500, 500]
        assert all(m["more_body"] for m in bodies)
    else:
        problem_of(lost, 503, "not-committed")
        assert lost.headers["retry-after"] == "3"
    lost_token, taker_token = (attempt.token for attempt in env.handler.attempts)
    assert lost_token < taker_token
    same_answer(taker, again)
    assert env.rows() == [(key, "run-2")]
    assert env.records() == [(key, "completed")]
    assert any(
        key_digest(key) in record.getMessage() and "did not commit" in record.getMessage()
        for record in caplog.records
    )
    assert not any(key in record.getMessage() for record in caplog.records)


# --- 7. the connection cannot be opened -----------------------------------------------------


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _refused() -> Any:
    raise OSError("connection refused by the test")


@pytest.mark.parametrize("framework", ["fastapi", "starlette"])
@pytest.mark.parametrize("failure", ["closed-port", "factory-raises"])
async def test_connection_that_cannot_open_is_503(
    sqlite_database: Database, anyio_backend: str, framework: str, failure: str
) -> None:
    """When the app's connection cannot be opened (its database is down) the request is
    refused with 503 and Retry-After before anything runs or is stored, as when the store is
    down."""
    handler = Handler(AppDatabase(**asdict(sqlite_database)))
    store = sqlite_database.async_store()
    engine = create_async_engine(f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/t")
    factory = engine.connect if failure == "closed-port" else _refused
    app = build_app(framework, handler, store=store, connection=factory, store_retry_after=7)
    try:
        async with client_for(app) as client:
            response = await post(client, new_key())
    finally:
        await store.aclose()
        await engine.dispose()
    problem_of(response, 503, "store-unavailable")
    assert response.headers["retry-after"] == "7"
    assert handler.executions == 0
    assert sqlite_database.select("SELECT count(*) FROM idempo_records") == [(0,)]


# --- 8. configuration errors ----------------------------------------------------------------


async def _app(scope: Any, receive: Any, send: Any) -> None: ...


async def test_connection_configuration_errors(sqlite_database: Database) -> None:
    """connection= needs a store that can join the app's transaction, cannot go with
    fail_open, and takes only the two modes: each refusal is a ConfigurationError when the
    middleware is made."""
    store = sqlite_database.async_store()
    factory = create_async_engine("sqlite+aiosqlite://").connect
    try:
        with pytest.raises(ConfigurationError, match="cannot join"):
            IdempotencyMiddleware(_app, store=AsyncMemoryStore(), connection=factory)
        with pytest.raises(ConfigurationError, match="fail_open"):
            IdempotencyMiddleware(_app, store=store, connection=factory, fail_open=True)
        with pytest.raises(ConfigurationError, match="mode"):
            IdempotencyMiddleware(_app, store=store, connection=factory, mode="serializable")  # type: ignore[arg-type]
        # The same store, a factory and a valid mode: accepted.
        assert IdempotencyMiddleware(_app, store=store, connection=factory, mode="leased").mode == (
            "leased"
        )
    finally:
        await store.aclose()


@pytest.mark.redis
async def test_connection_with_redis_is_a_configuration_error(
    async_redis_store: AsyncRedisStore,
) -> None:
    """Redis cannot hold the record in the app's SQL transaction: connection= refuses it."""
    factory = create_async_engine("sqlite+aiosqlite://").connect
    with pytest.raises(ConfigurationError, match="AsyncRedisStore cannot join"):
        IdempotencyMiddleware(_app, store=async_redis_store, connection=factory)


@pytest.mark.parametrize("framework", ["fastapi", "starlette"])
async def test_connection_outside_a_guarded_request_fails_loudly(env: Env, framework: str) -> None:
    """Asking for the idempotent connection where there is none (an unguarded GET, or a POST
    behind a middleware without connection=) raises ConfigurationError: a 500, never an
    endpoint silently writing outside the record's transaction."""
    guarded = env.app(framework)
    async with client_for(guarded) as client:
        assert (await client.get("/lookup")).status_code == 500
    async with client_for(guarded, raise_app_exceptions=True) as client:
        with pytest.raises(ConfigurationError, match="no idempotent connection"):
            await client.get("/lookup")
    without = build_app(framework, env.handler, store=env.store)
    key = new_key()
    async with client_for(without, raise_app_exceptions=True) as client:
        with pytest.raises(ConfigurationError, match="no idempotent connection"):
            await post(client, key)
    assert env.handler.executions == 0
    assert env.records() == []  # the failed request released its key


def test_current_attempt_outside_the_middleware_is_a_configuration_error() -> None:
    """current_attempt on a request the middleware did not guard raises ConfigurationError."""
    request = Request({"type": "http", "method": "GET", "path": "/", "headers": []})
    with pytest.raises(ConfigurationError, match="not guarded"):
        current_attempt(request)


# --- 9. plain Starlette: the connection and the attempt's scope -----------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_starlette_endpoint_uses_connection_and_attempt_scope(env: Env, mode: str) -> None:
    """A plain Starlette endpoint gets the connection with idempotent_connection(request) and
    the scope with current_attempt(request).scope, and derives a stable id from it: the same
    key from two principals is two intents with two ids; a retry replays the first id."""
    database = env.database

    async def create_order(request: Request) -> Response:
        conn = idempotent_connection(request)
        attempt = current_attempt(request)
        scope = attempt.scope
        order_id = derive_key(scope.key, f"order|{scope.principal}")
        await conn.execute(text(database.insert), {"key": scope.key, "worker": order_id})
        body = {
            "order": order_id,
            "operation": scope.operation,
            "principal": scope.principal,
            "token": attempt.token,
        }
        return JSONResponse(body, status_code=201)

    app = Starlette(
        routes=[Route("/regions/{region}/orders", create_order, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware, store=env.store, connection=env.engine.connect, mode=mode
            )
        ],
    )
    key = new_key()
    answers = {}
    async with client_for(app) as client:
        for user in ("alice", "bob", "alice"):
            response = await client.post(
                "/regions/eu/orders",
                headers={"Idempotency-Key": key, "Authorization": f"Bearer {user}"},
                content=b"{}",
            )
            answers.setdefault(user, []).append(response)
    principal = {
        user: hashlib.sha256(f"Bearer {user}".encode()).hexdigest() for user in ("alice", "bob")
    }
    for user, (first, *retries) in answers.items():
        assert first.status_code == 201
        assert first.json() == {
            "order": derive_key(key, f"order|{principal[user]}"),
            "operation": "POST /regions/{region}/orders",
            "principal": principal[user],
            "token": first.json()["token"],
        }
        assert first.json()["token"] > 0
        for retry in retries:
            same_answer(first, retry)
    assert sorted(env.rows()) == sorted(
        (key, derive_key(key, f"order|{principal[user]}")) for user in ("alice", "bob")
    )


# --- 10. an async_sessionmaker factory: ORM objects -----------------------------------------


class Base(DeclarativeBase):
    pass


class Payment(Base):
    """The business table as an ORM class (the table has no key; the mapper needs one)."""

    __tablename__ = "business"
    idem_key: Mapped[str] = mapped_column(String, primary_key=True)
    worker: Mapped[str] = mapped_column(String, primary_key=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("flush", [True, False], ids=["flushed", "pending"])
async def test_async_session_orm_objects_commit_with_the_record(
    env: Env, mode: str, flush: bool
) -> None:
    """With connection=async_sessionmaker(engine) the endpoint gets an AsyncSession: the ORM
    objects it adds (flushed, or still pending: the guard's commit flushes them) commit with
    the record, an exception discards them, and a duplicate replays without running."""
    schema = env.database.schema
    engine = env.engine.execution_options(schema_translate_map={None: schema} if schema else None)
    runs: list[str] = []

    async def pay(request: Request) -> Response:
        session = idempotent_connection(request)
        key = request.headers["idempotency-key"]
        runs.append(key)
        session.add(Payment(idem_key=key, worker=f"orm-{len(runs)}"))
        if flush:
            await session.flush()
        if request.query_params.get("fail") and runs.count(key) == 1:
            raise RuntimeError("the endpoint broke after adding its payment")
        return JSONResponse({"run": len(runs)}, status_code=201)

    app = Starlette(
        routes=[Route("/pay", pay, methods=["POST"])],
        middleware=[
            Middleware(
                IdempotencyMiddleware,
                store=env.store,
                connection=async_sessionmaker(engine),
                mode=mode,
            )
        ],
    )
    key, failing = new_key(), new_key()
    async with client_for(app) as client:
        first = await post(client, key, "/pay")
        again = await post(client, key, "/pay")
        broken = await post(client, failing, "/pay?fail=1")
        retried = await post(client, failing, "/pay?fail=1")
    assert first.status_code == 201
    same_answer(first, again)
    assert broken.status_code == 500
    assert retried.status_code == 201
    assert runs == [key, failing, failing]
    assert sorted(env.rows()) == sorted([(key, "orm-1"), (failing, "orm-3")])
    assert sorted(env.records()) == sorted([(key, "completed"), (failing, "completed")])


async def test_database_error_at_commit_is_503_and_keeps_nothing(
    env: Env, clock: FakeClock
) -> None:
    """An error that only the commit raises (here a pending ORM object that breaks a unique
    index when the guard's commit flushes it) rolls back everything of the attempt and answers
    503, not the 201 the endpoint built. In transactional mode the key is free again at once;
    in leased mode the committed reservation stands until its lease ends (a retry meanwhile
    gets 409), then a retry takes the key over and runs again."""
    database = env.database
    database.execute(f"CREATE UNIQUE INDEX one_per_worker ON {database.business_table} (worker)")
    database.execute(f"INSERT INTO {database.business_table} VALUES ('other', 'taken')")
    schema = database.schema
    engine = env.engine.execution_options(schema_translate_map={None: schema} if schema else None)

    async def pay(request: Request) -> Response:
        session = idempotent_connection(request)
        session.add(Payment(idem_key=request.headers["idempotency-key"], worker="taken"))
        return JSONResponse({"paid": True}, status_code=201)  # no flush: the commit fails

    def app(mode: str) -> Starlette:
        options = {"connection": async_sessionmaker(engine), "mode": mode}
        guarded = Middleware(
            IdempotencyMiddleware, store=env.store, policy=Policy(clock=clock), **options
        )
        return Starlette(routes=[Route("/pay", pay, methods=["POST"])], middleware=[guarded])

    key, leased_key = new_key(), new_key()
    async with client_for(app("transactional")) as client:
        problem_of(await post(client, key, "/pay"), 503, "not-committed")
        assert env.records() == []
    async with client_for(app("leased")) as client:
        problem_of(await post(client, leased_key, "/pay"), 503, "not-committed")
        assert env.records() == [(leased_key, "in_progress")]
        problem_of(await post(client, leased_key, "/pay"), 409, "request-in-progress")
        database.execute(f"DELETE FROM {database.business_table}")
        clock.advance(seconds=31)
        assert (await post(client, leased_key, "/pay")).status_code == 201
    assert env.rows() == [(leased_key, "taken")]
    assert env.records() == [(leased_key, "completed")]


# --- the connection belongs to the endpoint; psycopg's pool ---------------------------------


async def test_background_task_writes_on_the_connection_are_not_kept(env: Env) -> None:
    """A background task runs after the outcome committed: writes it makes on the idempotent
    connection are never committed (the connection closes with them pending), while the
    endpoint's own row and record stand. Background work needs a connection of its own."""
    database = env.database

    async def work(request: Request) -> Response:
        conn = idempotent_connection(request)
        key = request.headers["idempotency-key"]
        await conn.execute(text(database.insert), {"key": key, "worker": "endpoint"})

        async def later() -> None:
            await conn.execute(text(database.insert), {"key": key, "worker": "background"})

        return JSONResponse({}, status_code=201, background=BackgroundTask(later))

    app = Starlette(
        routes=[Route("/work", work, methods=["POST"])],
        middleware=[
            Middleware(IdempotencyMiddleware, store=env.store, connection=env.engine.connect)
        ],
    )
    key = new_key()
    async with client_for(app, raise_app_exceptions=True) as client:
        assert (await post(client, key)).status_code == 201
    assert env.rows() == [(key, "endpoint")]
    assert env.records() == [(key, "completed")]


@pytest.mark.parametrize("mode", MODES)
async def test_psycopg_pool_connection(pg_env: Env, mode: str) -> None:
    """psycopg's AsyncConnectionPool.connection works as the factory with the PostgreSQL
    store: the row commits with the record, a duplicate replays, an exception rolls back."""
    database = pg_env.database
    insert = f"INSERT INTO {database.business_table} (idem_key, worker) VALUES (%s, %s)"
    runs: list[str] = []

    async def work(request: Request) -> Response:
        conn = idempotent_connection(request)
        key = request.headers["idempotency-key"]
        runs.append(key)
        await conn.execute(insert, (key, f"psycopg-{len(runs)}"))
        if request.query_params.get("fail") and runs.count(key) == 1:
            raise RuntimeError("the endpoint broke after its write")
        return JSONResponse({"run": len(runs)}, status_code=201)

    pool = AsyncConnectionPool(database.location, min_size=1, max_size=4, open=False)
    await pool.open()
    try:
        guarded = Middleware(
            IdempotencyMiddleware, store=pg_env.store, connection=pool.connection, mode=mode
        )
        app = Starlette(routes=[Route("/work", work, methods=["POST"])], middleware=[guarded])
        key, failing = new_key(), new_key()
        async with client_for(app) as client:
            first = await post(client, key)
            same_answer(first, await post(client, key))
            assert (await post(client, failing, "/work?fail=1")).status_code == 500
            assert (await post(client, failing, "/work?fail=1")).status_code == 201
    finally:
        await pool.close()
    assert runs == [key, failing, failing]
    assert sorted(database.rows()) == sorted([(key, "psycopg-1"), (failing, "psycopg-3")])
    assert sorted((k, state) for k, state, _ in database.records_seen()) == sorted(
        [(key, "completed"), (failing, "completed")]
    )
