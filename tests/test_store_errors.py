"""Store faults as a user meets them, against the real servers: a SQLite file that cannot be
opened (defect 10), a server that cannot be reached, which fails within the connect timeout
and says why (defect 11), and a schema that was never migrated (defect 13); on every store,
sync and async, and over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import psycopg
import pymysql
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from helpers import new_key
from idempo import (
    AsyncIdempotency,
    Idempotency,
    SchemaMissingError,
    Scope,
    StoreError,
    StoreUnavailableError,
    open_async_store,
    open_store,
)
from idempo.asgi import IdempotencyMiddleware
from idempo.stores.mysql import AsyncMySQLStore, MySQLStore, connect_options
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.redis import AsyncRedisStore, RedisStore
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idempo.wsgi import IdempotencyWSGIMiddleware

TIMEOUT = timedelta(seconds=2)
# Every unreachable case must fail well before psycopg_pool's 30 s; no tighter timing is
# asserted, the machine is shared.
BOUND = 10.0


def free_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@contextmanager
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never says a word: a hung server."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.1)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        server.close()
        for conn in accepted:
            conn.close()


def with_netloc(url: str, *, user: str | None = None, port: int | None = None,
                host: str | None = None, path: str | None = None) -> str:  # fmt: skip
    """``url`` with some of its parts replaced."""
    parts = urlsplit(url)
    name = user if user is not None else parts.username or ""
    netloc = f"{name}@" if name else ""
    netloc += f"{host or parts.hostname}:{port or parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path if path is None else path, "", ""))


def scope() -> Scope:
    return Scope.of(new_key(), operation="charge")


def fails_with(call: Callable[[], Any], error: type[Exception], pattern: str) -> float:
    """Run ``call``, which must raise ``error`` matching ``pattern``; the seconds it took."""
    started = time.monotonic()
    with pytest.raises(error, match=pattern) as caught:
        call()
    elapsed = time.monotonic() - started
    assert caught.value.__cause__ is not None, "the driver's error is kept as the cause"
    return elapsed


async def afails_with(call: Callable[[], Awaitable[Any]], error: type[Exception],
                      pattern: str) -> float:  # fmt: skip
    started = time.monotonic()
    with pytest.raises(error, match=pattern) as caught:
        await call()
    elapsed = time.monotonic() - started
    assert caught.value.__cause__ is not None, "the driver's error is kept as the cause"
    return elapsed


def reserve(store: Any) -> None:
    with Idempotency(store).once(new_key(), operation="charge") as attempt:
        attempt.result = 1


async def areserve(store: Any) -> None:
    async with AsyncIdempotency(store).once(new_key(), operation="charge") as attempt:
        attempt.result = 1


# --- defect 10: a SQLite file that cannot be opened ---------------------------------------


def _missing_directory(tmp: Path) -> Path:
    return tmp / "no" / "such" / "dir" / "idempo.db"


def _a_directory(tmp: Path) -> Path:
    return tmp


def _under_a_file(tmp: Path) -> Path:
    (tmp / "plain").write_text("not a directory")
    return tmp / "plain" / "idempo.db"


def _not_a_database(tmp: Path) -> Path:
    (tmp / "garbage.db").write_bytes(b"this is no SQLite file, " * 100)
    return tmp / "garbage.db"


UNOPENABLE = [
    pytest.param(_missing_directory, r"directory .*/no/such/dir does not exist", id="no-dir"),
    pytest.param(_a_directory, r"is a directory", id="a-directory"),
    pytest.param(_under_a_file, r"plain is not a directory", id="under-a-file"),
    pytest.param(_not_a_database, r"not a database", id="not-a-database"),
]


@pytest.mark.parametrize(("where", "reason"), UNOPENABLE)
def test_sqlite_file_that_cannot_be_opened_is_store_unavailable(
    tmp_path: Path, where: Callable[[Path], Path], reason: str
) -> None:
    """Every verb, and migrate, raise StoreUnavailableError naming the file and the cause,
    never a raw sqlite3 error; nothing is created on the way."""
    path = where(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    store = SQLiteStore(str(path))
    try:
        for call in (lambda: reserve(store), lambda: store.get(scope()), store.stats,
                     store.migrate):  # fmt: skip
            fails_with(call, StoreUnavailableError, rf"cannot open {path}: .*{reason}")
    finally:
        store.close()
    assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.anyio
@pytest.mark.parametrize(("where", "reason"), UNOPENABLE)
async def test_async_sqlite_file_that_cannot_be_opened_is_store_unavailable(
    tmp_path: Path, where: Callable[[Path], Path], reason: str
) -> None:
    """The async store says the same."""
    path = where(tmp_path)
    store = AsyncSQLiteStore(str(path))
    try:
        await afails_with(partial(areserve, store), StoreUnavailableError, rf"{path}: .*{reason}")
        await afails_with(store.stats, StoreUnavailableError, rf"cannot open {path}: .*{reason}")
    finally:
        await store.aclose()


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        return False
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False)
    return probe.returncode == 0


needs_mounts = pytest.mark.skipif(
    not _unshare_works(), reason="needs root and unshare -m to mount a read-only volume"
)


def on_read_only_volume(directory: Path, script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (Python) in a mount namespace where ``directory`` is read-only."""
    shell = (
        f'mount --bind {directory} {directory} && mount -o remount,ro,bind {directory} && exec "$@"'
    )
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", shell, "sh", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@needs_mounts
def test_sqlite_on_a_read_only_volume(tmp_path: Path) -> None:
    """On a read-only volume a writing store says so (StoreUnavailableError, read-only file
    system), and a read-only one still reads."""
    path = tmp_path / "idempo.db"
    store = SQLiteStore(str(path))
    store.migrate()
    reserve(store)
    store.close()
    script = textwrap.dedent(f"""
        from idempo import Idempotency, StoreUnavailableError
        from idempo.stores.sqlite import SQLiteStore
        try:
            with Idempotency(SQLiteStore({str(path)!r})).once("k", operation="op") as a:
                a.result = 1
        except StoreUnavailableError as exc:
            print("refused:", exc)
        print("stats:", SQLiteStore({str(path)!r}, read_only=True).stats())
    """)
    result = on_read_only_volume(tmp_path, script)
    assert result.returncode == 0, result.stderr
    assert f"refused: cannot open {path}: read-only file system" in result.stdout
    assert "stats: {'completed': 1}" in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["idempo.db"]


def test_sqlite_read_only_store_never_creates_the_file(tmp_path: Path) -> None:
    """A read-only store on a missing file says so and creates nothing; on an existing file
    it reads, and refuses to write."""
    path = tmp_path / "idempo.db"
    reader = SQLiteStore(str(path), read_only=True)
    fails_with(reader.stats, StoreUnavailableError, rf"cannot open {path}: .*does not exist")
    reader.close()
    assert list(tmp_path.iterdir()) == []

    writer = SQLiteStore(str(path))
    writer.migrate()
    reserve(writer)
    writer.close()
    reader = SQLiteStore(str(path), read_only=True)
    try:
        assert reader.stats() == {"completed": 1}
        with pytest.raises(StoreError, match="read-only"):
            reserve(reader)
        assert reader.stats() == {"completed": 1}
    finally:
        reader.close()


# --- defect 11: unreachable servers fail within the connect timeout, with the cause ---------


REFUSED = r"at 127\.0\.0\.1:\d+/\w+: connection refused"
UNKNOWN_HOST = r"unknown host 'no-such-host\.invalid'"


def _pg_cases(url: str) -> list[tuple[str, str]]:
    return [
        (with_netloc(url, port=free_port()), REFUSED),
        (with_netloc(url, path="/no_such_db"), r'database "no_such_db" does not exist'),
        (with_netloc(url, user="no_such_role"), r'role "no_such_role" does not exist'),
        (with_netloc(url, host="no-such-host.invalid"), UNKNOWN_HOST),
    ]


@pytest.mark.postgres
def test_postgres_unreachable_fails_within_the_connect_timeout(postgres_url: str) -> None:
    """A closed port, an unknown database, a missing role, an unknown host: each call fails
    within the timeout (not psycopg_pool's 30 s) and names the cause; so does the next call."""
    for url, cause in _pg_cases(postgres_url):
        store = PostgresStore(url, connect_timeout=TIMEOUT)
        try:
            for _ in range(2):
                elapsed = fails_with(partial(reserve, store), StoreUnavailableError, cause)
                assert elapsed < BOUND, (url, elapsed)
            with pytest.raises(StoreError) as caught:
                store.stats()
            assert "unreachable" not in str(caught.value)
        finally:
            store.close()


@pytest.mark.postgres
@pytest.mark.anyio
async def test_async_postgres_unreachable_fails_within_the_connect_timeout(
    postgres_url: str,
) -> None:
    """The async store says the same, as fast."""
    for url, cause in _pg_cases(postgres_url):
        store = AsyncPostgresStore(url, connect_timeout=TIMEOUT)
        try:
            for _ in range(2):
                elapsed = await afails_with(partial(areserve, store), StoreUnavailableError, cause)
                assert elapsed < BOUND, (url, elapsed)
        finally:
            await store.aclose()


@pytest.mark.postgres
def test_postgres_hung_server_fails_within_the_connect_timeout_from_the_url() -> None:
    """A server that accepts and never answers: the URL's connect_timeout bounds the wait."""
    with silent_server() as port:
        store = open_store(f"postgresql://postgres@127.0.0.1:{port}/test?connect_timeout=2")
        try:
            assert store.connect_timeout == TIMEOUT
            elapsed = fails_with(store.stats, StoreUnavailableError, r"no answer within 2 s")
            assert elapsed < BOUND
        finally:
            store.close()


@pytest.mark.postgres
@pytest.mark.anyio
async def test_async_postgres_hung_server_fails_within_the_default_timeout() -> None:
    """Without a connect_timeout the default (5 s) bounds the wait."""
    with silent_server() as port:
        store = open_async_store(f"postgresql://postgres@127.0.0.1:{port}/test")
        try:
            assert store.connect_timeout == timedelta(seconds=5)
            elapsed = await afails_with(store.stats, StoreUnavailableError, r"no answer within 5 s")
            assert elapsed < BOUND
        finally:
            await store.aclose()


@pytest.mark.postgres
def test_postgres_recovers_once_the_server_answers(
    postgres_url: str, pg_schema: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose pool failed to connect works on the first call once the server is
    there, though the pool's own retries back off (for minutes after a long outage): a
    failure it remembers is checked again by connecting, not trusted for ever."""
    # Every remembered failure counts as old, as after a long outage.
    monkeypatch.setattr("idempo.stores.postgres._FRESH_SECONDS", 0.0)
    table = f"{pg_schema}.idempo_records"
    migrated = PostgresStore(postgres_url, table=table)
    migrated.migrate()
    migrated.close()
    parts = urlsplit(postgres_url)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))  # ours and closed until it listens
        url = with_netloc(postgres_url, port=listener.getsockname()[1])
        store = PostgresStore(url, table=table, connect_timeout=TIMEOUT)
        try:
            fails_with(store.stats, StoreUnavailableError, "connection refused")
            listener.listen(8)
            with _forward(listener, parts.hostname or "127.0.0.1", parts.port or 5432):
                assert store.stats() == {}
                reserve(store)
        finally:
            store.close()


@contextmanager
def _forward(listener: socket.socket, host: str, port: int) -> Iterator[None]:
    """Forward connections on ``listener`` to ``host:port`` until the block ends."""
    stop = threading.Event()
    listener.settimeout(0.1)
    sockets: list[socket.socket] = []

    def pipe(source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.shutdown(socket.SHUT_RDWR)

    def serve() -> None:
        while not stop.is_set():
            try:
                client = listener.accept()[0]
            except TimeoutError:
                continue
            server = socket.create_connection((host, port))
            sockets.extend((client, server))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for end in sockets:
            end.close()


def _mysql_cases(url: str) -> list[tuple[str, str]]:
    return [
        (with_netloc(url, port=free_port()), REFUSED),
        (with_netloc(url, path="/no_such_db"), r"database 'no_such_db' does not exist"),
        (
            with_netloc(url, user="no_such_user"),
            r"access denied for user 'no_such_user'.*no such user or wrong password",
        ),
        (with_netloc(url, host="no-such-host.invalid"), UNKNOWN_HOST),
    ]


@pytest.mark.mysql
def test_mariadb_unreachable_says_why(mysql_url: str) -> None:
    """The same four causes on MariaDB, each a StoreUnavailableError that names it."""
    for url, cause in _mysql_cases(mysql_url):
        store = MySQLStore(url, connect_timeout=TIMEOUT)
        try:
            for _ in range(2):
                assert fails_with(partial(reserve, store), StoreUnavailableError, cause) < BOUND
        finally:
            store.close()


@pytest.mark.mysql
@pytest.mark.anyio
async def test_async_mariadb_unreachable_says_why(mysql_url: str) -> None:
    """And on the async MariaDB store."""
    for url, cause in _mysql_cases(mysql_url):
        store = AsyncMySQLStore(url, connect_timeout=TIMEOUT)
        try:
            for _ in range(2):
                elapsed = await afails_with(partial(areserve, store), StoreUnavailableError, cause)
                assert elapsed < BOUND
        finally:
            await store.aclose()


@pytest.mark.mysql
@pytest.mark.anyio
async def test_mariadb_hung_server_fails_within_the_connect_timeout() -> None:
    """PyMySQL's connect_timeout covers only the TCP connect, aiomysql's too: the handshake
    with a hung server is bounded as well, sync and async, from the URL."""
    with silent_server() as port:
        url = f"mysql://root@127.0.0.1:{port}/test?connect_timeout=2"
        store = open_store(url)
        astore = open_async_store(url)
        try:
            assert fails_with(store.stats, StoreUnavailableError, "no answer within 2 s") < BOUND
            elapsed = await afails_with(astore.stats, StoreUnavailableError, "no answer within 2 s")
            assert elapsed < BOUND
        finally:
            store.close()
            await astore.aclose()


def _redis_cases(url: str) -> list[tuple[str, str]]:
    return [
        (with_netloc(url, port=free_port()), r"127\.0\.0\.1:\d+.*connection refused"),
        (with_netloc(url, path="/4000"), r"database in the URL does not exist"),
        (with_netloc(url, user="idempo_no_such_user:secret"), r"refused the credentials"),
        (with_netloc(url, host="no-such-host.invalid"), UNKNOWN_HOST),
    ]


@pytest.mark.redis
def test_redis_unreachable_says_why(redis_url: str) -> None:
    """Redis: the same causes, each named."""
    for url, cause in _redis_cases(redis_url):
        store = RedisStore(url, connect_timeout=TIMEOUT)
        try:
            assert fails_with(partial(reserve, store), StoreUnavailableError, cause) < BOUND
        finally:
            store.close()


@pytest.mark.redis
@pytest.mark.anyio
async def test_async_redis_unreachable_says_why(redis_url: str) -> None:
    for url, cause in _redis_cases(redis_url):
        store = AsyncRedisStore(url, connect_timeout=TIMEOUT)
        try:
            elapsed = await afails_with(partial(areserve, store), StoreUnavailableError, cause)
            assert elapsed < BOUND
        finally:
            await store.aclose()


@pytest.mark.redis
@pytest.mark.anyio
async def test_redis_hung_server_fails_within_its_timeouts() -> None:
    """A Redis server that accepts and never answers: the socket timeout (5 s unless given)
    bounds its login, sync and async; ``?connect_timeout=`` in the URL is understood."""
    with silent_server() as port:
        url = f"redis://127.0.0.1:{port}/0?connect_timeout=2&socket_timeout=2"
        store, astore = open_store(url), open_async_store(url)
        for client in (store.client, astore.client):
            assert client.connection_pool.connection_kwargs["socket_connect_timeout"] == 2.0
        try:
            assert fails_with(store.stats, StoreUnavailableError, "no answer from Redis") < BOUND
            elapsed = await afails_with(astore.stats, StoreUnavailableError, "no answer from Redis")
            assert elapsed < BOUND
        finally:
            store.close()
            await astore.aclose()


# --- over HTTP -----------------------------------------------------------------------------


async def _hello(request: Request) -> JSONResponse:
    return JSONResponse({"ok": True}, status_code=201)


def asgi_app(store: Any) -> Starlette:
    app = Starlette(routes=[Route("/pay", _hello, methods=["POST"])])
    app.add_middleware(IdempotencyMiddleware, store=store)
    return app


def wsgi_app(store: Any) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("201 Created", [("content-type", "application/json")])
        return [b'{"ok": true}']

    return IdempotencyWSGIMiddleware(app, store=store)


def assert_problem(response: httpx.Response, kind: str) -> dict[str, Any]:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"] == "application/problem+json"
    body: dict[str, Any] = json.loads(response.content)
    assert body["type"] == f"urn:idempo:problem:{kind}", body
    return body


@pytest.mark.postgres
@pytest.mark.anyio
async def test_http_requests_to_an_unreachable_postgres_get_503_within_the_timeout() -> None:
    """Concurrent requests while PostgreSQL hangs: each gets its 503 within the connect
    timeout, none waits 30 s."""
    with silent_server() as port:
        store = AsyncPostgresStore(f"postgresql://postgres@127.0.0.1:{port}/test",
                                   connect_timeout=TIMEOUT)  # fmt: skip
        transport = httpx.ASGITransport(app=asgi_app(store))
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:

                async def one() -> tuple[httpx.Response, float]:
                    started = time.monotonic()
                    response = await client.post(
                        "/pay", json={"n": 1}, headers={"Idempotency-Key": new_key()}
                    )
                    return response, time.monotonic() - started

                for response, elapsed in await asyncio.gather(*(one() for _ in range(4))):
                    assert_problem(response, "store-unavailable")
                    assert elapsed < BOUND
        finally:
            await store.aclose()


@pytest.mark.postgres
def test_wsgi_requests_to_an_unreachable_postgres_get_503_within_the_timeout() -> None:
    """The WSGI middleware on a refusing PostgreSQL answers 503 at once."""
    store = PostgresStore(f"postgresql://postgres@127.0.0.1:{free_port()}/test",
                          connect_timeout=TIMEOUT)  # fmt: skip
    try:
        with httpx.Client(transport=httpx.WSGITransport(app=wsgi_app(store)),
                          base_url="http://t") as client:  # fmt: skip
            started = time.monotonic()
            response = client.post("/pay", json={}, headers={"Idempotency-Key": new_key()})
            assert time.monotonic() - started < BOUND
        assert_problem(response, "store-unavailable")
    finally:
        store.close()


@pytest.mark.anyio
async def test_asgi_on_a_sqlite_file_that_cannot_be_opened_is_503(tmp_path: Path) -> None:
    """Defect 10 over HTTP: a 503 problem+json, not a 500."""
    store = AsyncSQLiteStore(str(_missing_directory(tmp_path)))
    try:
        transport = httpx.ASGITransport(app=asgi_app(store))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.post("/pay", json={}, headers={"Idempotency-Key": "k1"})
        assert_problem(response, "store-unavailable")
    finally:
        await store.aclose()


def test_wsgi_on_a_sqlite_file_that_cannot_be_opened_is_503(tmp_path: Path) -> None:
    store = SQLiteStore(str(_missing_directory(tmp_path)))
    try:
        with httpx.Client(transport=httpx.WSGITransport(app=wsgi_app(store)),
                          base_url="http://t") as client:  # fmt: skip
            response = client.post("/pay", json={}, headers={"Idempotency-Key": "k1"})
        assert_problem(response, "store-unavailable")
    finally:
        store.close()


# --- defect 13: a schema that was never migrated -----------------------------------------


@pytest.fixture(params=[
    "sqlite",
    pytest.param("pg", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
])  # fmt: skip
def unmigrated(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """A store URL whose server (or file) is there and whose records table is not."""
    if request.param == "sqlite":
        sqlite3.connect(tmp_path / "fresh.db").close()
        return "sqlite", f"sqlite:///{tmp_path / 'fresh.db'}"
    if request.param == "pg":
        url: str = request.getfixturevalue("postgres_url")
        return "pg", f"{url}?table={request.getfixturevalue('pg_schema')}.idempo_records"
    url = request.getfixturevalue("mysql_url")
    return "mysql", f"{url}?table={request.getfixturevalue('mysql_db')}.idempo_records"


MIGRATE = r"does not exist.*idempo migrate"


def test_unmigrated_store_raises_schema_missing(unmigrated: tuple[str, str]) -> None:
    """Every verb on a store whose table is missing raises SchemaMissingError naming
    `idempo migrate`, never "unreachable"; migrate then makes it work."""
    _, url = unmigrated
    store = open_store(url)
    try:
        for call in (lambda: reserve(store), lambda: store.get(scope()), store.stats,
                     lambda: store.purge(before=datetime.now(UTC)),
                     lambda: store.evict(scope())):  # fmt: skip
            with pytest.raises(SchemaMissingError, match=MIGRATE) as caught:
                call()
            assert not isinstance(caught.value, StoreUnavailableError)
            assert "unreachable" not in str(caught.value)
        store.migrate()
        reserve(store)
    finally:
        store.close()


def _drop_tokens(kind: str, url: str) -> None:
    """Drop the store-wide token counter that migrate made (a sequence, SQLite's table)."""
    base, _, table = url.partition("?table=")
    tokens = f"{table or 'idempo_records'}_tokens"
    if kind == "sqlite":
        with sqlite3.connect(base.removeprefix("sqlite:///")) as conn:
            conn.execute(f"DROP TABLE {tokens}")
    elif kind == "pg":
        with psycopg.connect(base, autocommit=True) as pg:
            pg.execute(f"DROP SEQUENCE {tokens}")
    else:
        with pymysql.connect(**connect_options(base), autocommit=True) as my:
            my.cursor().execute(f"DROP SEQUENCE {tokens}")


def test_missing_token_sequence_is_schema_missing(unmigrated: tuple[str, str]) -> None:
    """A migrated table whose token sequence (SQLite: counter table) is gone: a fresh
    reservation raises SchemaMissingError naming it, not "unreachable"; migrate restores it."""
    kind, url = unmigrated
    store = open_store(url)
    try:
        store.migrate()
        reserve(store)
        _drop_tokens(kind, url)
        with pytest.raises(SchemaMissingError, match=r"_tokens.* does not exist.*idempo migrate"):
            reserve(store)
        store.migrate()
        reserve(store)
    finally:
        store.close()


@pytest.mark.anyio
async def test_async_unmigrated_store_raises_schema_missing(unmigrated: tuple[str, str]) -> None:
    _, url = unmigrated
    store = open_async_store(url)
    try:
        for call in (lambda: areserve(store), lambda: store.get(scope()), store.stats,
                     lambda: store.purge(before=datetime.now(UTC)),
                     lambda: store.evict(scope())):  # fmt: skip
            with pytest.raises(SchemaMissingError, match=MIGRATE):
                await call()
        await store.migrate()
        await areserve(store)
    finally:
        await store.aclose()


def assert_logged_schema_missing(caplog: pytest.LogCaptureFixture) -> None:
    assert any(
        r.levelno >= logging.ERROR and "idempo migrate" in r.getMessage() for r in caplog.records
    ), caplog.text


@pytest.mark.anyio
async def test_asgi_on_an_unmigrated_store_is_a_logged_schema_missing_503(
    unmigrated: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    """Over HTTP a missing schema is its own 503 problem (not store-unavailable) and an
    error in the log that names `idempo migrate`."""
    store = open_async_store(unmigrated[1])
    try:
        transport = httpx.ASGITransport(app=asgi_app(store))
        with caplog.at_level(logging.ERROR, logger="idempo"):
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                response = await client.post("/pay", json={}, headers={"Idempotency-Key": "k"})
        assert_problem(response, "schema-missing")
        assert_logged_schema_missing(caplog)
    finally:
        await store.aclose()


def test_wsgi_on_an_unmigrated_store_is_a_logged_schema_missing_503(
    unmigrated: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store(unmigrated[1])
    try:
        transport = httpx.WSGITransport(app=wsgi_app(store))
        with (
            caplog.at_level(logging.ERROR, logger="idempo"),
            httpx.Client(transport=transport, base_url="http://t") as client,
        ):
            response = client.post("/pay", json={}, headers={"Idempotency-Key": "k"})
        assert_problem(response, "schema-missing")
        assert_logged_schema_missing(caplog)
    finally:
        store.close()
