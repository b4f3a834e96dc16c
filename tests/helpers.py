"""Plain helpers for the tests that run against a real database (SQLite, PostgreSQL, MariaDB).

A plain module, not a conftest: test_races pickles a `Database` into spawned processes, which
import this module by name (pytest puts tests/ on sys.path, and spawn hands sys.path on).
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import psycopg
import pymysql

from idempo.stores.mysql import AsyncMySQLStore, MySQLStore, connect_options
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore


def migrated_sqlite(path: Path, **options: Any) -> SQLiteStore:
    """A `SQLiteStore` on the file ``path``, migrated."""
    store = SQLiteStore(str(path), **options)
    store.migrate()
    return store


def new_key() -> str:
    """An idempotency key no other test uses."""
    return f"k-{uuid.uuid4().hex}"


# How long a test that opens many app connections of its own (the races: one per thread, task
# or process) waits for PostgreSQL to have room for them. The server's 100 connections are
# shared with the other pytest-xdist worker and the rest of the machine, and what a busy
# moment fills frees up within seconds.
_PG_ROOM_SECONDS = 60.0


def _no_room(exc: psycopg.OperationalError, started: float) -> bool:
    return "too many clients" in str(exc) and time.monotonic() - started < _PG_ROOM_SECONDS


def pg_connect(location: str, *, autocommit: bool = False) -> psycopg.Connection[Any]:
    """A psycopg connection, waiting while the server is full (``too many clients``)."""
    started = time.monotonic()
    while True:
        try:
            return psycopg.connect(location, autocommit=autocommit)
        except psycopg.OperationalError as exc:
            if not _no_room(exc, started):
                raise
            time.sleep(0.2)


async def pg_aconnect(location: str, *, autocommit: bool = False) -> psycopg.AsyncConnection[Any]:
    """`pg_connect`'s async twin."""
    started = time.monotonic()
    while True:
        try:
            return await psycopg.AsyncConnection.connect(location, autocommit=autocommit)
        except psycopg.OperationalError as exc:
            if not _no_room(exc, started):
                raise
            await asyncio.sleep(0.2)


class MySQLConnection(pymysql.connections.Connection):
    """An app's PyMySQL connection with the ``execute`` shortcut psycopg and sqlite3 have."""

    def execute(self, text: str, params: tuple[Any, ...] = ()) -> None:
        with self.cursor() as cursor:
            cursor.execute(text, params)


@dataclass(frozen=True)
class Database:
    """A SQLite file, a PostgreSQL schema or a MariaDB database: its records and business
    tables, and the ways the stores, the app and the test itself reach them."""

    kind: Literal["sqlite", "postgres", "mysql"]
    location: str  # the SQLite file, or the PostgreSQL or MariaDB URL
    schema: str = ""

    def table(self, name: str) -> str:
        """``name`` qualified with this database's schema, if it has one."""
        return f"{self.schema}.{name}" if self.schema else name

    @property
    def records_table(self) -> str:
        return self.table("idempo_records")

    @property
    def business_table(self) -> str:
        return self.table("business")

    def sql(self, text: str) -> str:
        """``text`` with ``?`` placeholders in this database's style."""
        return text if self.kind == "sqlite" else text.replace("?", "%s")

    def store(self, *, busy_timeout: timedelta | None = None, pool_size: int = 4) -> Any:
        """A store on the records table; ``busy_timeout`` is SQLite's (None: the store's
        default), ``pool_size`` PostgreSQL's."""
        if self.kind == "sqlite":
            if busy_timeout is None:
                return SQLiteStore(self.location)
            return SQLiteStore(self.location, busy_timeout=busy_timeout)
        if self.kind == "mysql":
            return MySQLStore(self.location, table=self.records_table, max_size=pool_size)
        return PostgresStore(self.location, table=self.records_table, max_size=pool_size)

    def async_store(self, *, busy_timeout: timedelta | None = None, pool_size: int = 4) -> Any:
        """The asynchronous twin of `store`."""
        if self.kind == "sqlite":
            if busy_timeout is None:
                return AsyncSQLiteStore(self.location)
            return AsyncSQLiteStore(self.location, busy_timeout=busy_timeout)
        if self.kind == "mysql":
            return AsyncMySQLStore(self.location, table=self.records_table, max_size=pool_size)
        return AsyncPostgresStore(self.location, table=self.records_table, max_size=pool_size)

    def connect(self, store: Any, *, autocommit: bool = False) -> Any:
        """An app connection: sqlite3 as ``store`` sets it up (always in autocommit mode: the
        guard begins its own transactions), or psycopg or PyMySQL in the ``autocommit`` mode asked
        for."""
        if self.kind == "sqlite":
            return store.connect()
        if self.kind == "mysql":
            return MySQLConnection(**connect_options(self.location), autocommit=autocommit)
        return pg_connect(self.location, autocommit=autocommit)

    def execute(self, text: str) -> None:
        """Run one statement on a plain driver connection of its own, committed at once."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.location, isolation_level=None)
            try:
                conn.execute(text)
            finally:
                conn.close()
        elif self.kind == "mysql":
            with MySQLConnection(**connect_options(self.location), autocommit=True) as my:
                my.execute(text)
        else:
            with psycopg.connect(self.location, autocommit=True) as pg:
                pg.execute(text)

    def select(self, text: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        """Committed rows as a plain driver connection of their own sees them, read without
        waiting on any lock; ``text`` takes ``?`` placeholders."""
        if self.kind == "sqlite":
            conn = sqlite3.connect(self.location)
            try:
                return [tuple(row) for row in conn.execute(text, params).fetchall()]
            finally:
                conn.close()
        if self.kind == "mysql":
            with pymysql.connect(**connect_options(self.location), autocommit=True) as my:
                cursor = my.cursor()
                cursor.execute(self.sql(text), params or None)
                return [tuple(row) for row in cursor.fetchall()]
        with psycopg.connect(self.location) as pg:
            # No parameters: no placeholders either, so a literal ``%`` stays as it is.
            found = pg.execute(self.sql(text), params or None).fetchall()
            return [tuple(row) for row in found]

    def migrate(self) -> None:
        """Create the records table."""
        store = self.store()
        try:
            store.migrate()
        finally:
            store.close()

    def create_business_table(self, columns: str) -> None:
        """Create the business table, with no unique constraint on the key: a second execution
        shows as a second row."""
        self.execute(f"CREATE TABLE {self.business_table} ({columns})")
