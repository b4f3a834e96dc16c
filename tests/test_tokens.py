"""Fencing tokens are never reused (SPEC §2 rule 8), on the SQL stores and the memory store.

A scope's tokens come from a counter shared by the whole store that never goes back (a
PostgreSQL or MariaDB sequence, SQLite's counter row, the memory store's counter), so when a
record is deleted (purged after its retention, evicted, or gone by other means) and made
again, the new holder's token is larger than any earlier holder's: a holder stalled past all
that is fenced out, and its release cannot delete the new reservation.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pymysql
import pytest

from idempo import FencedError, SchemaMissingError, Scope, Status
from idempo._core.record import Acquired
from idempo.stores._sql.dialect import derived_name
from idempo.stores.memory import MemoryStore
from idempo.stores.mysql import connect_options
from idempo.stores.postgres import PostgresStore
from idempo.stores.sqlite import SQLiteStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SHORT = timedelta(seconds=1)
T1 = T0 + timedelta(hours=1)
LONG = timedelta(hours=1)

SQL = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("pg", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
]


Execute = Callable[[str], None]


def _executor(request: pytest.FixtureRequest, kind: str, store: Any) -> Execute:
    """Runs SQL on a plain driver connection of its own, committed at once: something other
    than idempo changing the store's database."""

    def sqlite(sql: str) -> None:
        conn = sqlite3.connect(store.path, isolation_level=None)
        try:
            conn.execute(sql)
        finally:
            conn.close()

    def postgres(sql: str) -> None:
        with psycopg.connect(request.getfixturevalue("postgres_url"), autocommit=True) as pg:
            pg.execute(sql)

    def mysql(sql: str) -> None:
        options = connect_options(request.getfixturevalue("mysql_url"))
        with pymysql.connect(**options, autocommit=True) as my:
            my.cursor().execute(sql)

    return {"sqlite": sqlite, "pg": postgres, "mysql": mysql}[kind]


@pytest.fixture(params=[pytest.param("memory", id="memory"), *SQL])
def store(request: pytest.FixtureRequest) -> tuple[Any, Execute | None]:
    """The SQL stores and the memory store, migrated and empty, with a way to change their
    database behind their back (None for memory)."""
    if request.param == "memory":
        return MemoryStore(), None
    store = request.getfixturevalue(f"{request.param}_store")
    return store, _executor(request, request.param, store)


@pytest.fixture(params=SQL)
def sql_store(request: pytest.FixtureRequest) -> tuple[Any, Execute]:
    """The SQL stores, migrated and empty, with a way to change their database."""
    store = request.getfixturevalue(f"{request.param}_store")
    return store, _executor(request, request.param, store)


def scope(key: str = "k") -> Scope:
    return Scope.of(key, operation="charge", principal="alice")


def delete(store: Any, execute: Execute | None, way: str) -> None:
    """Delete the record of `scope()` the way ``way`` says."""
    if way == "purge":
        assert store.purge(before=T1) == 1
    elif way == "evict":
        assert store.evict(scope()) is True
    elif execute is None:
        store._entries.clear()  # a memory store's record has no other way to vanish
    else:
        execute(f"DELETE FROM {store.dialect.table}")
    assert store.get(scope()) is None


WAYS = ["purge", "evict", "raw"]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("settle", [None, "complete", "fail"])
def test_a_record_made_again_gets_a_larger_token(
    store: tuple[Any, Execute | None], way: str, settle: str | None
) -> None:
    """However a record went (purged after its retention, evicted, deleted by other means),
    and whatever state it was in, the next reservation of its scope gets a larger token."""
    store, execute = store
    first = store.reserve(scope(), "fp", now=T0, lease=SHORT, ttl=SHORT)
    assert isinstance(first, Acquired)
    if settle is not None:
        getattr(store, settle)(scope(), first.token, b"old", now=T0, ttl=SHORT)
    delete(store, execute, way)

    again = store.reserve(scope(), "fp", now=T1, lease=LONG, ttl=LONG)

    assert isinstance(again, Acquired)
    assert again.token > first.token


@pytest.mark.parametrize("way", WAYS)
def test_a_holder_stalled_past_the_deletion_is_fenced_out(
    store: tuple[Any, Execute | None], way: str
) -> None:
    """A holder whose reservation was deleted and made again by another attempt can neither
    release the new reservation nor complete, fail or renew over it; the new holder's
    completion is what stays."""
    store, execute = store
    stalled = store.reserve(scope(), "fp", now=T0, lease=SHORT, ttl=SHORT)
    assert isinstance(stalled, Acquired)
    delete(store, execute, way)
    fresh = store.reserve(scope(), "fp", now=T1, lease=LONG, ttl=LONG)
    assert isinstance(fresh, Acquired)

    store.release(scope(), stalled.token)
    for verb in ("complete", "fail"):
        with pytest.raises(FencedError):
            getattr(store, verb)(scope(), stalled.token, b"zombie", now=T1, ttl=LONG)
    with pytest.raises(FencedError):
        store.renew(scope(), stalled.token, now=T1, lease=LONG)

    record = store.get(scope())
    assert record is not None
    assert (record.status, record.token, record.response) == (
        Status.IN_PROGRESS,
        fresh.token,
        None,
    )
    store.complete(scope(), fresh.token, b"fresh", now=T1, ttl=LONG)
    record = store.get(scope())
    assert record is not None
    assert (record.status, record.response) == (Status.COMPLETED, b"fresh")


def test_tokens_also_grow_across_scopes_sharing_the_counter(
    store: tuple[Any, Execute | None],
) -> None:
    """The counter is the store's, not the scope's: fresh scopes get distinct, growing
    tokens, and a takeover's token is past every token handed out before it."""
    store, _ = store
    tokens = []
    for key in ("a", "b", "c"):
        reservation = store.reserve(scope(key), "fp", now=T0, lease=SHORT, ttl=LONG)
        assert isinstance(reservation, Acquired)
        tokens.append(reservation.token)
    taken = store.reserve(scope("a"), "fp", now=T0 + SHORT, lease=SHORT, ttl=LONG)

    assert isinstance(taken, Acquired)
    assert tokens == sorted(set(tokens))
    assert taken.token > max(tokens)


def test_a_missing_counter_is_a_missing_schema_and_migrate_makes_it(
    sql_store: tuple[Any, Execute],
) -> None:
    """Without its token counter a store refuses to reserve with `SchemaMissingError` naming
    ``idempo migrate``, changing nothing; `migrate` makes the counter, past the largest token
    already stored (an install from before it), and running it again never moves it back."""
    sql_store, execute = sql_store
    old = sql_store.reserve(scope("old"), "fp", now=T0, lease=LONG, ttl=LONG)
    assert isinstance(old, Acquired)
    execute(f"UPDATE {sql_store.dialect.table} SET token = 1000")
    kind = "TABLE" if isinstance(sql_store, SQLiteStore) else "SEQUENCE"
    execute(f"DROP {kind} {sql_store.dialect.tokens}")  # as before the counter existed

    with pytest.raises(SchemaMissingError, match="idempo migrate"):
        sql_store.reserve(scope("new"), "fp", now=T0, lease=LONG, ttl=LONG)
    assert sql_store.get(scope("new")) is None

    sql_store.migrate()
    first = sql_store.reserve(scope("new"), "fp", now=T0, lease=LONG, ttl=LONG)
    sql_store.migrate()
    second = sql_store.reserve(scope("newer"), "fp", now=T0, lease=LONG, ttl=LONG)

    assert isinstance(first, Acquired)
    assert isinstance(second, Acquired)
    assert 1000 < first.token < second.token


@pytest.mark.postgres
def test_postgres_sequence_lives_in_the_table_schema(
    pg_store: PostgresStore, pg_schema: str, postgres_url: str
) -> None:
    """PostgreSQL's token sequence is named after the table, in the table's schema."""
    assert pg_store.dialect.tokens == f"{pg_schema}.idempo_records_tokens"
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(
            "SELECT sequence_schema FROM information_schema.sequences WHERE sequence_name = %s",
            ("idempo_records_tokens",),
        ).fetchall()
    assert (pg_schema,) in row


def test_a_long_table_name_gets_a_counter_name_that_fits() -> None:
    """A table name near the 63-character limit gets a counter name that is shortened
    (PostgreSQL would cut it silently, perhaps onto the table's own name) and still unique."""
    long = "t" * 63
    name = derived_name(f"s.{long}", "tokens")
    assert name.startswith("s.")
    assert len(name.removeprefix("s.")) <= 63
    assert name != f"s.{long}"
    assert derived_name(f"s.{'t' * 62}u", "tokens") != name
