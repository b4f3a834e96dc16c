"""The opt-in migration on first use (issue 13): ``migrate=True`` or ``?migrate=true`` creates
a store's schema when it is opened, on SQLite, PostgreSQL and MariaDB, sync and async, and
through a middleware's ``store=`` URL; without it a missing schema is still an error that
names both ways to create it, and a read-only open never creates anything."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idempo import Scope
from idempo._core.record import Acquired
from idempo.asgi import IdempotencyMiddleware
from idempo.errors import ConfigurationError, SchemaMissingError
from idempo.stores import open_async_store, open_store

LEASE = timedelta(seconds=10)
TTL = timedelta(hours=1)
SCOPE = Scope.of("k-1", operation="charge")


def _urls(request: pytest.FixtureRequest, tmp_path: Path, kind: str) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'fresh.db'}"
    if kind == "postgres":
        schema = request.getfixturevalue("pg_schema")
        return f"{request.getfixturevalue('postgres_url')}?table={schema}.idempo_records"
    db = request.getfixturevalue("mysql_db")
    return f"{request.getfixturevalue('mysql_url')}?table={db}.idempo_records"


KINDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mariadb"),
]


@pytest.mark.parametrize("kind", KINDS)
def test_a_fresh_database_is_an_error_until_migrated_on_open(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    url = _urls(request, tmp_path, kind)
    store = open_store(url)
    try:
        with pytest.raises(SchemaMissingError, match=r"\?migrate=true"):
            store.reserve(SCOPE, "fp", now=None, lease=LEASE, ttl=TTL)
    finally:
        store.close()
    for query in ("migrate=true", "migrate=1"):  # and a second time: nothing changes
        joiner = "&" if "?" in url else "?"
        store = open_store(f"{url}{joiner}{query}")
        try:
            got = store.reserve(SCOPE, "fp", now=None, lease=LEASE, ttl=TTL)
            assert got is not None  # acquired the first time, in progress the second
            assert store.get(SCOPE) is not None
        finally:
            store.close()


@pytest.mark.parametrize("kind", KINDS)
def test_the_async_store_migrates_before_it_is_handed_back(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    url = _urls(request, tmp_path, kind)
    store = open_async_store(url, migrate=True)  # no event loop yet: as a middleware is made

    async def reserve() -> Any:
        try:
            return await store.reserve(SCOPE, "fp", now=None, lease=LEASE, ttl=TTL)
        finally:
            await store.aclose()

    assert isinstance(asyncio.run(reserve()), Acquired)


def test_a_middlewares_store_url_migrates_on_first_use(tmp_path: Path) -> None:
    """The quick start that answered 503 on a fresh file: with ?migrate=true it answers 201."""

    async def pay(request: Request) -> JSONResponse:
        return JSONResponse({"paid": True}, status_code=201)

    app = Starlette(routes=[Route("/pay", pay, methods=["POST"])])
    guarded = IdempotencyMiddleware(app, store=f"sqlite:///{tmp_path / 'app.db'}?migrate=true")

    async def post() -> int:
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answer = await client.post("/pay", json={}, headers={"Idempotency-Key": "k-1"})
            return answer.status_code

    assert asyncio.run(post()) == 201


def test_read_only_never_migrates_and_bad_values_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "kept.db"
    sqlite3.connect(path).close()  # an empty file, no schema
    store = open_store(f"sqlite:///{path}?migrate=true", read_only=True)
    try:
        with pytest.raises(SchemaMissingError):
            store.get(SCOPE)
    finally:
        store.close()
    with pytest.raises(ConfigurationError, match="migrate= takes true or false"):
        open_store(f"sqlite:///{path}?migrate=please")
