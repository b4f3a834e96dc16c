"""Fresh stores on the real servers, one per hypothesis example, in either face.

A state machine runs many examples in one test, and each example must start from an empty
store: a purge or `stats` sees the whole table, so leftovers from the previous example would
be answers the model cannot predict. Each `Backend.fresh` therefore makes a new table (in the
test's own PostgreSQL schema or MariaDB database), a new SQLite file or a new Redis prefix,
migrated, and `Fresh.close` cleans it up. Connections to the server are shared by the
examples where the store accepts a pool or client of the app's, so an example costs a
migration, not a connection.

An async store is driven through `Synced`, which runs each awaited verb to completion on one
event loop kept for the whole test: the state machine is synchronous, the store's code path
is the async one.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import sqlite3
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import redis
import redis.asyncio
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from idempo import Scope
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.mysql import AsyncMySQLStore, MySQLStore, connect_options
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.redis import AsyncRedisStore, RedisStore
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore

KINDS = ("memory", "sqlite", "postgres", "mysql", "redis")


class Synced:
    """A store's verbs as plain calls: an async store's run to completion on ``runner``."""

    def __init__(self, store: Any, runner: asyncio.Runner | None) -> None:
        self.store = store
        self._runner = runner

    def __getattr__(self, name: str) -> Callable[..., Any]:
        verb = getattr(self.store, name)
        runner = self._runner
        if runner is None:
            return verb  # type: ignore[no-any-return]

        def call(*args: Any, **kwargs: Any) -> Any:
            return runner.run(verb(*args, **kwargs))

        return call


@dataclass
class Fresh:
    """One example's store: its verbs, a raw delete of one record, and its cleanup."""

    store: Synced
    raw_delete: Callable[[Scope], None]
    close: Callable[[], None]


_WHERE = "principal = {p} AND operation = {p} AND idem_key = {p}"


def _scope_args(scope: Scope) -> tuple[str, str, str]:
    return (scope.principal, scope.operation, scope.key)


class Backend:
    """Makes fresh stores of one kind in one face; `close` frees what the examples shared.

    ``where`` is the test's own place on the server: a SQLite directory, a PostgreSQL schema
    or a MariaDB database (none for memory and Redis, which use fresh prefixes).
    """

    def __init__(self, kind: str, is_async: bool, url: str = "", where: str = "") -> None:
        assert kind in KINDS, kind
        self.kind = kind
        self.is_async = is_async
        self.url = url
        self.where = where
        self._names = itertools.count()
        self._shared = ExitStack()
        self.runner: asyncio.Runner | None = None
        if is_async:
            self.runner = self._shared.enter_context(asyncio.Runner())
        self._pg_pool: Any = None
        self._raw: Any = None  # a plain driver connection or client for raw deletes
        if kind == "postgres":
            self._raw = self._shared.enter_context(psycopg.connect(url, autocommit=True))
        elif kind == "mysql":
            self._raw = pymysql.connect(**connect_options(url), autocommit=True)
            self._shared.callback(self._raw.close)
        elif kind == "redis":
            self._raw = redis.Redis.from_url(url)
            self._shared.callback(self._raw.close)
            if is_async:
                self._aredis = redis.asyncio.Redis.from_url(url)
                self._shared.callback(lambda: self._run(self._aredis.aclose()))

    def _run(self, awaitable: Any) -> Any:
        assert self.runner is not None
        return self.runner.run(awaitable)

    def _postgres_pool(self) -> Any:
        if self._pg_pool is None:
            if self.is_async:

                async def open_pool() -> AsyncConnectionPool[Any]:
                    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                        self.url, kwargs={"autocommit": True}, min_size=1, max_size=2, open=False
                    )
                    await pool.open()
                    return pool

                self._pg_pool = self._run(open_pool())
                self._shared.callback(lambda: self._run(self._pg_pool.close()))
            else:
                self._pg_pool = ConnectionPool(
                    self.url, kwargs={"autocommit": True}, min_size=1, max_size=2, open=True
                )
                self._shared.callback(self._pg_pool.close)
        return self._pg_pool

    def fresh(self) -> Fresh:
        """A migrated, empty store no earlier example touched."""
        name = f"m{next(self._names)}"
        return getattr(self, f"_fresh_{self.kind}")(name)  # type: ignore[no-any-return]

    def _closer(self, store: Any) -> Callable[[], None]:
        if self.is_async:
            return lambda: self._run(store.aclose())
        return store.close  # type: ignore[no-any-return]

    def _migrated(self, store: Any) -> Synced:
        synced = Synced(store, self.runner)
        synced.migrate()
        return synced

    def _fresh_memory(self, name: str) -> Fresh:
        store = AsyncMemoryStore() if self.is_async else MemoryStore()
        synced = Synced(store, self.runner)

        def raw_delete(scope: Scope) -> None:
            # Nothing expires a memory record by itself: eviction is the only other way out.
            synced.evict(scope)

        return Fresh(synced, raw_delete, lambda: None)

    def _fresh_sqlite(self, name: str) -> Fresh:
        path = Path(self.where) / f"{name}.db"
        store = (AsyncSQLiteStore if self.is_async else SQLiteStore)(str(path))
        synced = self._migrated(store)
        close_store = self._closer(store)
        table = store.dialect.table

        def raw_delete(scope: Scope) -> None:
            conn = sqlite3.connect(path, isolation_level=None)
            try:
                conn.execute(
                    f"DELETE FROM {table} WHERE {_WHERE.format(p='?')}", _scope_args(scope)
                )
            finally:
                conn.close()

        def close() -> None:
            close_store()
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)

        return Fresh(synced, raw_delete, close)

    def _fresh_postgres(self, name: str) -> Fresh:
        table = f"{self.where}.{name}"
        cls = AsyncPostgresStore if self.is_async else PostgresStore
        store = cls(self._postgres_pool(), table=table)
        synced = self._migrated(store)
        raw = self._raw

        def raw_delete(scope: Scope) -> None:
            raw.execute(f"DELETE FROM {table} WHERE {_WHERE.format(p='%s')}", _scope_args(scope))

        return Fresh(synced, raw_delete, self._closer(store))

    def _fresh_mysql(self, name: str) -> Fresh:
        table = f"{self.where}.{name}"
        cls = AsyncMySQLStore if self.is_async else MySQLStore
        store = cls(self.url, table=table, max_size=2)
        synced = self._migrated(store)
        raw = self._raw

        def raw_delete(scope: Scope) -> None:
            with raw.cursor() as cursor:
                cursor.execute(
                    f"DELETE FROM {table} WHERE {_WHERE.format(p='%s')}", _scope_args(scope)
                )

        return Fresh(synced, raw_delete, self._closer(store))

    def _fresh_redis(self, name: str) -> Fresh:
        prefix = f"idempo-model-{secrets.token_hex(6)}"
        if self.is_async:
            store: Any = AsyncRedisStore(client=self._aredis, prefix=prefix)
        else:
            store = RedisStore(client=self._raw, prefix=prefix)
        synced = Synced(store, self.runner)
        raw = self._raw

        def raw_delete(scope: Scope) -> None:
            # What Redis's own expiry of the key does: the hash is simply gone.
            raw.delete(store._keys.key(scope))

        def close() -> None:
            keys = list(raw.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                raw.delete(*keys)

        return Fresh(synced, raw_delete, close)

    def close(self) -> None:
        self._shared.close()
