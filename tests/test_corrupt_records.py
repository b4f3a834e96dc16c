"""A stored row the SQL store cannot decode is a `CorruptRecordError` that says how to evict
it, from ``reserve`` and ``get``, never a ValueError; `evict` removes it and the key works
again. Rows are damaged with plain SQL, as another program or a hand edit would.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pymysql
import pytest

from idempo import CorruptRecordError, Scope
from idempo._core.digest import key_digest
from idempo._core.record import Acquired
from idempo.stores.mysql import connect_options

NOW = datetime(2026, 1, 1, tzinfo=UTC)
LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)

Execute = Callable[[str], None]


def _sqlite(store: Any) -> Execute:
    def run(sql: str) -> None:
        conn = sqlite3.connect(store.path, isolation_level=None)
        try:
            conn.execute(sql)
        finally:
            conn.close()

    return run


def _postgres(url: str) -> Execute:
    def run(sql: str) -> None:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(sql)

    return run


def _mysql(url: str) -> Execute:
    def run(sql: str) -> None:
        with pymysql.connect(**connect_options(url), autocommit=True) as conn:
            cursor = conn.cursor()
            # Not strict: MariaDB then stores an unknown ENUM value as '', as a lax writer
            # (or an old sql_mode) would.
            cursor.execute("SET SESSION sql_mode = ''")
            cursor.execute(sql)

    return run


# (store kind, a damage that kind of database can hold)
DAMAGE = [
    pytest.param("sqlite", "state = 'paused'", id="sqlite-state"),
    pytest.param("sqlite", "token = 'abc'", id="sqlite-token"),
    pytest.param("sqlite", "created_at = 'yesterday'", id="sqlite-time"),
    pytest.param("sqlite", "response = 'text, not bytes'", id="sqlite-response"),
    pytest.param("pg", "state = 'paused'", marks=pytest.mark.postgres, id="postgres-state"),
    pytest.param("pg", "token = 0", marks=pytest.mark.postgres, id="postgres-token"),
    pytest.param("mysql", "state = 'paused'", marks=pytest.mark.mysql, id="mysql-state"),
    pytest.param("mysql", "token = -5", marks=pytest.mark.mysql, id="mysql-token"),
]


@pytest.mark.parametrize(("kind", "damage"), DAMAGE)
def test_an_undecodable_row_is_a_corrupt_record_until_evicted(
    request: pytest.FixtureRequest, kind: str, damage: str
) -> None:
    """reserve and get raise CorruptRecordError naming the key's digest and the evict command,
    and change nothing; after evict the key is reserved afresh."""
    store = request.getfixturevalue(f"{kind}_store")
    execute = {
        "sqlite": lambda: _sqlite(store),
        "pg": lambda: _postgres(request.getfixturevalue("postgres_url")),
        "mysql": lambda: _mysql(request.getfixturevalue("mysql_url")),
    }[kind]()
    scope = Scope.of("order-7", operation="POST /pay", principal="user:1")
    reservation = store.reserve(scope, "fp", now=NOW, lease=LEASE, ttl=TTL)
    assert isinstance(reservation, Acquired)
    store.complete(scope, reservation.token, b"ok", now=NOW, ttl=TTL)
    execute(f"UPDATE {store.dialect.table} SET {damage}")

    for call in (
        lambda: store.reserve(scope, "fp", now=NOW, lease=LEASE, ttl=TTL),
        lambda: store.get(scope),
    ):
        with pytest.raises(CorruptRecordError) as raised:
            call()
        message = str(raised.value)
        assert "order-7" not in message
        assert "user:1" not in message
        assert "idempo evict STORE-URL KEY --operation 'POST /pay' --principal PRINCIPAL" in (
            message
        )
        assert f"the key whose digest is {key_digest('order-7')}" in message

    assert store.evict(scope) is True
    again = store.reserve(scope, "fp", now=NOW, lease=LEASE, ttl=TTL)
    assert isinstance(again, Acquired)
    assert again.token > reservation.token
