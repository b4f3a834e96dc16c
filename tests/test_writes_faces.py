"""idempo.writes on every kind of connection it takes, on the real databases: SQLAlchemy
``Table``s through a Connection and a Session (typed columns), the async faces (psycopg
AsyncConnection, SQLAlchemy AsyncConnection and AsyncSession), and MariaDB connections that
count found rows (CLIENT_FOUND_ROWS), where the affected-row count says less."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pymysql
import pytest
from pymysql.constants import CLIENT
from sqlalchemy import BigInteger, Column, DateTime, MetaData, String, Table, create_engine, select
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import Session

from idempo import ConfigurationError, VersionConflictError
from idempo.stores.mysql import connect_options
from idempo.writes import (
    Upserted,
    aapply_if_newer,
    acreate_once,
    apply_if_newer,
    aupdate_if_version,
    create_once,
    update_if_version,
)

AT = datetime(2026, 12, 2, 6, 0, 0)
DBS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mariadb", marks=pytest.mark.mysql, id="mariadb"),
]


def urls(request: pytest.FixtureRequest, kind: str) -> tuple[str, str, str | None]:
    """(sync URL, async URL, schema) of the test's own database."""
    if kind == "sqlite":
        path = request.getfixturevalue("tmp_path") / "faces.db"
        return f"sqlite:///{path}", f"sqlite+aiosqlite:///{path}", None
    if kind == "postgres":
        url = request.getfixturevalue("postgres_url").replace(
            "postgresql://", "postgresql+psycopg://"
        )
        return url, url, request.getfixturevalue("pg_schema")
    base = request.getfixturevalue("mysql_url").replace("mysql://", "")
    name = request.getfixturevalue("mysql_db")
    host = base.rsplit("/", 1)[0]
    return f"mysql+pymysql://{host}/{name}", f"mysql+aiomysql://{host}/{name}", name


def events_table(schema: str | None) -> Table:
    return Table(
        "events",
        MetaData(schema=schema),
        Column("k", String(64), primary_key=True),
        Column("payload", String(200), nullable=False),
        Column("at", DateTime, nullable=True),
        Column("version", BigInteger, nullable=False),
    )


@pytest.fixture(params=DBS)
def engine(request: pytest.FixtureRequest) -> Iterator[tuple[Engine, Table, str, str | None]]:
    url, async_url, schema = urls(request, request.param)
    made = create_engine(url)
    table = events_table(schema)
    table.metadata.create_all(made)
    try:
        yield made, table, async_url, schema
    finally:
        table.metadata.drop_all(made)
        made.dispose()


def row(key: str, version: int, at: datetime | None = AT) -> dict[str, Any]:
    return {"k": key, "payload": f"{key}@{version}", "at": at, "version": version}


def test_a_sqlalchemy_connection_takes_a_table_and_its_types(engine: Any) -> None:
    made, table, _, _ = engine
    with made.connect() as conn:
        first = create_once(conn, table, row("a", 1), key="k")
        again = create_once(conn, table, row("a", 2), key=[table.c.k.name])
        # The columns come back through their types: a DateTime is a datetime on SQLite too.
        assert first == Upserted(row=row("a", 1), created=True)
        assert again == Upserted(row=row("a", 1), created=False)
        assert apply_if_newer(conn, table, row("a", 3), key="k")
        assert not apply_if_newer(conn, table, row("a", 2), key="k")
        assert update_if_version(conn, table, {"k": "a"}, {"payload": "edited"}, expected=3) == 4
        with pytest.raises(VersionConflictError):
            update_if_version(conn, table, {"k": "a"}, {"payload": "stale"}, expected=3)
        conn.commit()
        assert conn.execute(select(table)).all() == [("a", "edited", AT, 4)]


def test_a_sqlalchemy_session_works_the_same(engine: Any) -> None:
    made, table, _, _ = engine
    with Session(made) as session:
        assert create_once(session, table, row("s", 5), key="k", update=["payload"]).created
        moved = create_once(
            session, table, {**row("s", 5), "payload": "new"}, key="k", update=["payload"]
        )
        assert moved == Upserted(row={**row("s", 5), "payload": "new"}, created=False)
        assert not apply_if_newer(session, table, row("s", 4), key="k")
        session.commit()
    with Session(made) as session:
        assert session.execute(select(table.c.payload)).scalar_one() == "new"


def test_a_table_column_it_does_not_have_is_refused(engine: Any) -> None:
    made, table, _, _ = engine
    with made.connect() as conn:
        with pytest.raises(ConfigurationError, match="no column"):
            create_once(conn, table, {**row("a", 1), "nope": 1}, key="k")
        with pytest.raises(ConfigurationError, match="no column"):
            apply_if_newer(conn, table, {**row("a", 1), "nope": 2}, key="k", version="nope")
        # A plain name on a SQLAlchemy connection is checked like any other.
        with pytest.raises(ConfigurationError, match="identifier"):
            apply_if_newer(conn, "events; DROP TABLE events", row("a", 1), key="k")
        conn.rollback()
        assert conn.execute(select(table)).all() == []
    plain = sqlite3.connect(":memory:")
    with pytest.raises(ConfigurationError, match="SQLAlchemy connection"):
        create_once(plain, table, row("a", 1), key="k")
    with pytest.raises(
        ConfigurationError, match=r"cannot run on a sqlalchemy\.engine\.base\.Engine"
    ):
        create_once(made, table, row("a", 1), key="k")  # an Engine: no transaction to join


@pytest.mark.anyio
async def test_the_sqlalchemy_async_faces_run_the_same_plans(engine: Any) -> None:
    _, table, async_url, _ = engine
    made = create_async_engine(async_url)
    try:
        async with made.connect() as conn:
            assert (await acreate_once(conn, table, row("x", 1), key="k")).created
            assert not (await acreate_once(conn, table, row("x", 9), key="k")).created
            assert await aapply_if_newer(conn, table, row("x", 2), key="k")
            assert not await aapply_if_newer(conn, table, row("x", 1), key="k")
            with pytest.raises(ConfigurationError, match="sync idempo"):
                apply_if_newer(conn, table, row("x", 5), key="k")  # the async face only
            await conn.commit()
        async with AsyncSession(made) as session:
            assert (
                await aupdate_if_version(session, table, {"k": "x"}, {"payload": "p"}, expected=2)
                == 3
            )
            with pytest.raises(VersionConflictError):
                await aupdate_if_version(session, table, {"k": "x"}, {"payload": "q"}, expected=2)
            await session.commit()
            assert (await session.execute(select(table.c.payload, table.c.version))).all() == [
                ("p", 3)
            ]
    finally:
        await made.dispose()


@pytest.mark.anyio
@pytest.mark.postgres
async def test_a_psycopg_async_connection(postgres_url: str, pg_schema: str) -> None:
    t = f"{pg_schema}.prices"
    async with await psycopg.AsyncConnection.connect(postgres_url) as conn:
        await conn.execute(
            f"CREATE TABLE {t} (sku TEXT PRIMARY KEY, cents INT, version INT NOT NULL)"
        )
        made = await acreate_once(conn, t, {"sku": "A", "cents": 1, "version": 1}, key="sku")
        assert made == Upserted(row={"sku": "A", "cents": 1, "version": 1}, created=True)
        assert await aapply_if_newer(conn, t, {"sku": "A", "cents": 5, "version": 3}, key="sku")
        assert not await aapply_if_newer(conn, t, {"sku": "A", "cents": 4, "version": 2}, key="sku")
        assert await aupdate_if_version(conn, t, {"sku": "A"}, {"cents": 6}, expected=3) == 4
        await conn.commit()
        cursor = await conn.execute(f"SELECT cents, version FROM {t}")
        assert await cursor.fetchall() == [(6, 4)]
        await conn.execute(f"DROP TABLE {t}")
        await conn.commit()


def test_a_sync_connection_is_refused_by_the_async_helpers() -> None:
    plain = sqlite3.connect(":memory:")
    with pytest.raises(ConfigurationError, match=r"async idempo\.writes helpers cannot run"):
        asyncio.run(acreate_once(plain, "t", {"k": 1}, key="k"))


@pytest.mark.mysql
def test_mariadb_counting_found_rows_keeps_the_table_right(mysql_url: str, mysql_db: str) -> None:
    """With CLIENT_FOUND_ROWS, ON DUPLICATE KEY UPDATE counts a kept row as 1, like an
    insert. The table still ends right, an older event still reads as not applied, and
    only a duplicate of the event the row holds reads as applied (documented)."""
    options = {**connect_options(mysql_url), "database": mysql_db}
    conn = pymysql.connect(**options, client_flag=CLIENT.FOUND_ROWS)
    exact = pymysql.connect(**options)
    try:
        with conn.cursor() as cursor:
            cursor.execute(
                "CREATE TABLE fr (k VARCHAR(8) PRIMARY KEY, v INT, version INT NOT NULL)"
            )
        deliveries = [(2, True), (1, False), (3, True), (2, False), (3, True)]
        for version, applied in deliveries:
            values = {"k": "a", "v": version * 10, "version": version}
            assert apply_if_newer(conn, "fr", values, key="k") is applied, version
        conn.commit()
        # Without the flag (PyMySQL's default), the same duplicate reads as not applied.
        assert not apply_if_newer(exact, "fr", {"k": "a", "v": 30, "version": 3}, key="k")
        exact.commit()
        assert create_once(conn, "fr", {"k": "b", "v": 1, "version": 1}, key="k").created
        assert not create_once(conn, "fr", {"k": "b", "v": 2, "version": 1}, key="k").created
        conn.commit()
        # SQLAlchemy connects with the flag; connect_args can leave it out, and then the
        # duplicate reads as not applied through SQLAlchemy too.
        url = f"mysql+pymysql://{mysql_url.split('://', 1)[1].rsplit('/', 1)[0]}/{mysql_db}"
        for client_flag, applied in ((None, True), (0, False)):
            args = {} if client_flag is None else {"connect_args": {"client_flag": client_flag}}
            made = create_engine(url, **args)
            with made.connect() as sa:
                assert (
                    apply_if_newer(sa, "fr", {"k": "a", "v": 30, "version": 3}, key="k") is applied
                )
            made.dispose()
        with conn.cursor() as cursor:
            cursor.execute("SELECT * FROM fr ORDER BY k")
            assert cursor.fetchall() == (("a", 30, 3), ("b", 1, 1))
    finally:
        with conn.cursor() as cursor:
            cursor.execute("DROP TABLE IF EXISTS fr")
        conn.close()
        exact.close()
