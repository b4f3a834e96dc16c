"""Building stores: URLs, options, bring-your-own pools, capability checks."""

from __future__ import annotations

import sqlite3
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from idempo import (
    AsyncIdempotency,
    ConfigurationError,
    Idempotency,
    Policy,
    open_async_store,
    open_store,
)
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore


def test_memory_urls_build_memory_stores() -> None:
    """memory:// gives the in-process store, sync and async."""
    assert isinstance(open_store("memory://"), MemoryStore)
    assert isinstance(open_async_store("memory://"), AsyncMemoryStore)


def test_sqlite_urls_take_relative_and_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sqlite:///x.db is relative to the working directory, sqlite:////x.db absolute, and
    ?table= names the table."""
    monkeypatch.chdir(tmp_path)
    relative = open_store("sqlite:///relative.db?table=my_records")
    assert isinstance(relative, SQLiteStore)
    assert (relative.path, relative.dialect.table) == ("relative.db", "my_records")
    relative.migrate()
    relative.close()
    with sqlite3.connect(tmp_path / "relative.db") as conn:
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    assert "my_records" in tables
    absolute = open_async_store(f"sqlite:///{tmp_path / 'abs.db'}")
    assert isinstance(absolute, AsyncSQLiteStore)


@pytest.mark.parametrize(
    "url",
    ["mongodb://x/y", "sqlite://", "sqlite:///", "", "memory"],
)
def test_bad_urls_raise_configuration_errors(url: str) -> None:
    """An unknown scheme or a sqlite URL without a path is a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        open_store(url)


def test_table_names_are_validated() -> None:
    """A table name that is not a plain identifier is refused before any SQL runs."""
    with pytest.raises(ConfigurationError):
        SQLiteStore(":memory:", table="records; DROP TABLE x")


def test_memory_store_cannot_join_a_transaction() -> None:
    """Asking a store without the capability to run on the app's connection fails clearly."""
    idem = Idempotency(MemoryStore())
    with pytest.raises(ConfigurationError, match="cannot join"):
        idem.once("k", operation="op", conn=object())


@pytest.mark.postgres
def test_postgres_store_uses_a_pool_the_app_owns(postgres_url: str, pg_schema: str) -> None:
    """A ConnectionPool the app made is used as given and stays open after the store closes."""
    pool: ConnectionPool[Any] = ConnectionPool(
        postgres_url, kwargs={"autocommit": True}, min_size=1, max_size=2, open=True
    )
    try:
        store = PostgresStore(pool, table=f"{pg_schema}.records")
        store.migrate()
        idem = Idempotency(store)
        for _ in range(2):
            with idem.once("k", operation="op", payload={"a": 1}) as attempt:
                if not attempt.replayed:
                    attempt.result = "first"
        assert attempt.replayed
        assert attempt.result == "first"
        store.close()
        with pool.connection() as conn:
            assert conn.execute(f"SELECT count(*) FROM {pg_schema}.records").fetchone() == (1,)
    finally:
        pool.close()


@pytest.mark.postgres
@pytest.mark.anyio
async def test_async_postgres_store_uses_a_pool_the_app_owns(
    postgres_url: str, pg_schema: str
) -> None:
    """An AsyncConnectionPool the app opened is used as given and left open."""
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        postgres_url, kwargs={"autocommit": True}, min_size=1, max_size=2, open=False
    )
    await pool.open()
    try:
        store = AsyncPostgresStore(pool, table=f"{pg_schema}.records")
        await store.migrate()
        idem = AsyncIdempotency(store)
        for _ in range(2):
            async with idem.once("k", operation="op") as attempt:
                if not attempt.replayed:
                    attempt.result = 7
        assert (attempt.replayed, attempt.result) == (True, 7)
        await store.aclose()
        async with pool.connection() as conn:
            cursor = await conn.execute(f"SELECT count(*) FROM {pg_schema}.records")
            assert await cursor.fetchone() == (1,)
    finally:
        await pool.close()


@pytest.mark.postgres
def test_postgres_urls_carry_the_table(postgres_url: str, pg_schema: str) -> None:
    """postgresql://...?table=schema.name builds a PostgresStore on that table."""
    store = open_store(f"{postgres_url}?table={pg_schema}.named")
    try:
        assert isinstance(store, PostgresStore)
        store.migrate()
        with psycopg.connect(postgres_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM information_schema.tables"
                " WHERE table_schema = %s AND table_name = 'named'",
                (pg_schema,),
            ).fetchone()
        assert row == (1,)
    finally:
        store.close()


@pytest.mark.parametrize(
    "changes",
    [
        {"lease": timedelta(0)},
        {"ttl": timedelta(seconds=-1)},
        {"max_response_bytes": -1},
    ],
)
def test_impossible_policies_are_refused(changes: dict[str, Any]) -> None:
    """A policy that cannot work raises ConfigurationError when it is made, not later."""
    with pytest.raises(ConfigurationError):
        Policy(**changes)
