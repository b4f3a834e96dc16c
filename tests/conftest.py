"""Shared fixtures: real services, a fresh PostgreSQL schema and Redis key prefix per test,
every store.

PostgreSQL comes from IDEMPO_TEST_POSTGRES_URL, Redis from IDEMPO_TEST_REDIS_URL and MariaDB
from IDEMPO_TEST_MYSQL_URL (default: the machine's servers; on Redis, database 1, so that the
SCANs of a test's cleanup and of the store's stats, scan and purge walk only the tests' keys,
not the millions a benchmark may have left in database 0). Redis Cluster is a private
three-node cluster the session starts on free loopback ports (tests/redis_servers.py). Locally
a missing server skips its tests; with IDEMPO_TEST_REQUIRE_ALL=1 (``make test``, CI) it fails.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest
import redis

from helpers import Database
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.mysql import AsyncMySQLStore, MySQLStore, connect_options
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.redis import AsyncRedisStore, RedisStore
from idempo.stores.redis._protocol import TokenClock
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idempo.testing import FakeClock
from redis_servers import installed, redis_cluster

POSTGRES_URL = os.environ.get(
    "IDEMPO_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
REDIS_URL = os.environ.get("IDEMPO_TEST_REDIS_URL", "redis://127.0.0.1:6379/1")
MYSQL_URL = os.environ.get("IDEMPO_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")
REQUIRE_ALL = os.environ.get("IDEMPO_TEST_REQUIRE_ALL") == "1"


def _postgres_reachable() -> str | None:
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        return str(exc)
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``make test``'s workers (pytest-xdist, ``--dist loadgroup``) the ``slow`` tests,
    which spawn processes or race dozens of threads each on connections of their own, take
    turns on one worker: two at once overran PostgreSQL's 100 connections (shared with the
    rest of the machine) and starved each other's servers past their callers' deadlines."""
    for item in items:
        if item.get_closest_marker("slow") and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group("slow"))


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The server's URL, after checking it answers (fail in CI, skip locally)."""
    problem = _postgres_reachable()
    if problem:
        message = f"PostgreSQL at {POSTGRES_URL} is unreachable: {problem}"
        if REQUIRE_ALL:
            pytest.fail(message)
        pytest.skip(message)
    return POSTGRES_URL


def _unavailable(message: str) -> None:
    if REQUIRE_ALL:
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The Redis server's URL, after checking it answers (fail in CI, skip locally)."""
    try:
        with redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3) as client:
            client.ping()
    except redis.RedisError as exc:
        _unavailable(f"Redis at {REDIS_URL} is unreachable: {exc}")
    return REDIS_URL


@contextmanager
def _fresh_prefix(url: str) -> Iterator[str]:
    """A key prefix no other test uses; only its keys are deleted afterwards."""
    prefix = f"idempo-test-{secrets.token_hex(6)}"
    try:
        yield prefix
    finally:
        cleaner = RedisStore(url, prefix=prefix)  # its client talks to a server or a cluster
        try:
            keys = list(cleaner.client.scan_iter(match=f"{prefix}:*", count=1000))
            for start in range(0, len(keys), 500):
                cleaner.client.delete(*keys[start : start + 500])
        finally:
            cleaner.close()


@pytest.fixture
def redis_prefix(redis_url: str) -> Iterator[str]:
    """A key prefix no other test uses; only its keys are deleted afterwards."""
    with _fresh_prefix(redis_url) as prefix:
        yield prefix


@pytest.fixture(scope="session")
def redis_cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private three-node Redis Cluster on free loopback ports, started once per session:
    its ``redis+cluster://`` URL (fail in CI, skip locally without redis-server)."""
    problem = installed()
    if problem:
        _unavailable(f"cannot start a Redis Cluster: {problem}")
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        yield cluster.url


@pytest.fixture
def redis_cluster_prefix(redis_cluster_url: str) -> Iterator[str]:
    """A key prefix on the cluster no other test uses; its keys are deleted afterwards."""
    with _fresh_prefix(redis_cluster_url) as prefix:
        yield prefix


@pytest.fixture(
    params=[pytest.param("redis", id="server"), pytest.param("redis_cluster", id="cluster")]
)
def redis_at(request: pytest.FixtureRequest) -> tuple[str, str]:
    """A Redis URL and a fresh key prefix on it: the machine's server, then the private
    three-node cluster (where a test's keys spread over three primaries)."""
    kind = request.param
    return request.getfixturevalue(f"{kind}_url"), request.getfixturevalue(f"{kind}_prefix")


@contextmanager
def _redis_store(url: str, prefix: str) -> Iterator[RedisStore]:
    store = RedisStore(url, prefix=prefix)
    try:
        yield store
    finally:
        store.close()


@asynccontextmanager
async def _async_redis_store(url: str, prefix: str) -> AsyncIterator[AsyncRedisStore]:
    store = AsyncRedisStore(url, prefix=prefix)
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
def redis_cluster_store(redis_cluster_url: str, redis_cluster_prefix: str) -> Iterator[RedisStore]:
    """A RedisStore on the private cluster, under the test's own prefix."""
    with _redis_store(redis_cluster_url, redis_cluster_prefix) as store:
        yield store


@pytest.fixture
async def async_redis_cluster_store(
    anyio_backend: str, redis_cluster_url: str, redis_cluster_prefix: str
) -> AsyncIterator[AsyncRedisStore]:
    """An AsyncRedisStore on the private cluster, under the test's own prefix."""
    async with _async_redis_store(redis_cluster_url, redis_cluster_prefix) as store:
        yield store


@pytest.fixture
def redis_store(redis_url: str, redis_prefix: str) -> Iterator[RedisStore]:
    """A RedisStore whose keys live under the test's own prefix."""
    with _redis_store(redis_url, redis_prefix) as store:
        yield store


@pytest.fixture
async def async_redis_store(
    anyio_backend: str, redis_url: str, redis_prefix: str
) -> AsyncIterator[AsyncRedisStore]:
    """An AsyncRedisStore whose keys live under the test's own prefix."""
    async with _async_redis_store(redis_url, redis_prefix) as store:
        yield store


@pytest.fixture
def pg_schema(postgres_url: str) -> Iterator[str]:
    """A fresh schema for one test, dropped afterwards."""
    schema = f"t_{secrets.token_hex(6)}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    try:
        yield schema
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@contextmanager
def migrated_pg_store(url: str, schema: str, **options: Any) -> Iterator[PostgresStore]:
    """A migrated PostgresStore (``options`` given to it) with its table in ``schema``."""
    store = PostgresStore(url, table=f"{schema}.idempo_records", max_size=40, **options)
    store.migrate()
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def pg_store(postgres_url: str, pg_schema: str) -> Iterator[PostgresStore]:
    """A migrated PostgresStore whose table lives in the test's own schema."""
    with migrated_pg_store(postgres_url, pg_schema) as store:
        yield store


@pytest.fixture
def business(postgres_url: str, pg_schema: str) -> str:
    """A business table in the test's own schema: an idempotency key and a note per row."""
    table = f"{pg_schema}.business"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (idem_key text PRIMARY KEY, note text)")
    return table


@pytest.fixture
def sqlite_store(tmp_path: Path) -> Iterator[SQLiteStore]:
    """A migrated SQLiteStore in a fresh file."""
    store = SQLiteStore(str(tmp_path / "idempo.db"))
    store.migrate()
    try:
        yield store
    finally:
        store.close()


@pytest.fixture(scope="session")
def mysql_url() -> str:
    """The MariaDB server's URL, after checking it answers (fail in CI, skip locally)."""
    try:
        with pymysql.connect(**connect_options(MYSQL_URL), connect_timeout=3) as conn:
            conn.ping()
    except pymysql.err.Error as exc:
        _unavailable(f"MariaDB at {MYSQL_URL} is unreachable: {exc}")
    return MYSQL_URL


@pytest.fixture
def mysql_db(mysql_url: str) -> Iterator[str]:
    """A fresh MariaDB database for one test, dropped afterwards."""
    name = f"idempo_t_{secrets.token_hex(6)}"
    with pymysql.connect(**connect_options(mysql_url), autocommit=True) as conn:
        conn.cursor().execute(f"CREATE DATABASE {name}")
    try:
        yield name
    finally:
        with pymysql.connect(**connect_options(mysql_url), autocommit=True) as conn:
            conn.cursor().execute(f"DROP DATABASE {name}")


@pytest.fixture
def mysql_store(mysql_url: str, mysql_db: str) -> Iterator[MySQLStore]:
    """A migrated MySQLStore whose table lives in the test's own database."""
    store = MySQLStore(mysql_url, table=f"{mysql_db}.idempo_records", max_size=40)
    store.migrate()
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
async def async_mysql_store(
    anyio_backend: str, mysql_url: str, mysql_db: str
) -> AsyncIterator[AsyncMySQLStore]:
    """A migrated AsyncMySQLStore whose table lives in the test's own database."""
    store = AsyncMySQLStore(mysql_url, table=f"{mysql_db}.idempo_records", max_size=10)
    await store.migrate()
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
def mysql_database(mysql_url: str, mysql_db: str) -> Database:
    """The test's own MariaDB database with a migrated records table and no business table
    yet."""
    database = Database("mysql", mysql_url, mysql_db)
    database.migrate()
    return database


STORE_KINDS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("pg", marks=pytest.mark.postgres, id="postgres"),  # the pg_store fixture
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
    pytest.param("redis_cluster", marks=pytest.mark.redis, id="redis-cluster"),
]


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest) -> Any:
    """Every store, migrated and empty."""
    if request.param == "memory":
        return MemoryStore()
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
async def async_pg_store(
    anyio_backend: str, postgres_url: str, pg_schema: str
) -> AsyncIterator[AsyncPostgresStore]:
    """A migrated AsyncPostgresStore whose table lives in the test's own schema."""
    store = AsyncPostgresStore(postgres_url, table=f"{pg_schema}.idempo_records", max_size=10)
    await store.migrate()
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture
async def async_sqlite_store(anyio_backend: str, tmp_path: Path) -> AsyncIterator[AsyncSQLiteStore]:
    """A migrated AsyncSQLiteStore in a fresh file."""
    store = AsyncSQLiteStore(str(tmp_path / "idempo.db"))
    await store.migrate()
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture(params=STORE_KINDS)
def async_store(request: pytest.FixtureRequest) -> Any:
    """Every async store, migrated and empty (async tests only)."""
    if request.param == "memory":
        return AsyncMemoryStore()
    return request.getfixturevalue(f"async_{request.param}_store")


# Every store on one node: tests of the call protocol, which the cluster's slot routing does
# not change.
SINGLE_NODE_KINDS = [kind for kind in STORE_KINDS if kind.id != "redis-cluster"]


@pytest.fixture(params=SINGLE_NODE_KINDS)
def node_store(request: pytest.FixtureRequest) -> Any:
    """Every store but the Redis cluster, migrated and empty."""
    if request.param == "memory":
        return MemoryStore()
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture(params=SINGLE_NODE_KINDS)
def async_node_store(request: pytest.FixtureRequest) -> Any:
    """Every async store but the Redis cluster, migrated and empty (async tests only)."""
    if request.param == "memory":
        return AsyncMemoryStore()
    return request.getfixturevalue(f"async_{request.param}_store")


STORE_FACES = [
    pytest.param((kind.values[0], face), marks=kind.marks, id=f"{kind.id}-{face}")
    for kind in STORE_KINDS
    for face in ("sync", "async")
]


@pytest.fixture(params=STORE_FACES)
def store_face(request: pytest.FixtureRequest) -> tuple[Any, bool]:
    """Every store in both faces (async tests only): ``(store, is_async)``."""
    kind, face = request.param
    is_async = face == "async"
    if kind == "memory":
        return (AsyncMemoryStore() if is_async else MemoryStore()), is_async
    return request.getfixturevalue(f"async_{kind}_store" if is_async else f"{kind}_store"), is_async


@pytest.fixture
def sqlite_database(tmp_path: Path) -> Database:
    """A fresh SQLite file with a migrated records table and no business table yet."""
    database = Database("sqlite", str(tmp_path / "app.db"))
    database.migrate()
    return database


@pytest.fixture
def postgres_database(postgres_url: str, pg_schema: str) -> Database:
    """The test's own PostgreSQL schema with a migrated records table and no business table
    yet."""
    database = Database("postgres", postgres_url, pg_schema)
    database.migrate()
    return database


DATABASE_KINDS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
]


@pytest.fixture(params=DATABASE_KINDS)
def database(request: pytest.FixtureRequest) -> Database:
    """Every real database, SQLite and PostgreSQL, with a migrated records table."""
    return request.getfixturevalue(f"{request.param}_database")


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    """Async tests run on asyncio, the loop the async stores are built for."""
    return "asyncio"


@pytest.fixture
def clock() -> FakeClock:
    """A clock that moves only when the test says so."""
    return FakeClock(datetime(2026, 1, 1, tzinfo=UTC))


@pytest.fixture(autouse=True)
def _token_clock_of_its_own() -> Iterator[None]:
    """Each test starts with this process's Redis token clock as it found it: a test that
    crafts a record with a token far ahead of Redis's clock (test_redis_protocol) would
    otherwise push every later fresh token in the process past it, and a later test that
    compares this process's tokens with a child process's would see them out of order."""
    saved = TokenClock._last
    yield
    TokenClock._last = saved
