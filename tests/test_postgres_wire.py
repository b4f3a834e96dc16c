"""The PostgreSQL store's statements sent straight through libpq (`idempo.stores._pgwire`)
and the connections the store keeps out of its own pool (`idempo.stores._kept`), against the
real server: prepared statements that vanish behind the store's back, a batch cut short
between its send and its read, errors, broken connections, a pool of one shared by threads,
and the connections the wire leaves alone (psycopg's pipeline mode, ``prepare_threshold``
None) or reads otherwise (a client encoding other than UTF-8).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.pq import PipelineStatus, TransactionStatus

from conftest import migrated_pg_store
from helpers import new_key
from idempo import AsyncIdempotency, Idempotency, Scope, Status
from idempo.errors import SchemaMissingError, StoreUnavailableError
from idempo.stores import _kept
from idempo.stores._pgwire import SKIPPED, exchange
from idempo.stores._sql.transaction import adrive, drive
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore

pytestmark = pytest.mark.postgres

OPERATION = "wire"
LEASE, TTL = timedelta(minutes=1), timedelta(hours=1)


@pytest.fixture
def app(postgres_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(postgres_url) as conn:
        yield conn


def ours(conn: psycopg.Connection[Any]) -> int:
    """How many statements the store prepared in ``conn``'s session (a transaction this
    began is committed: psycopg deallocates its statements after a rollback)."""
    began = conn.info.transaction_status == TransactionStatus.IDLE
    row = conn.execute(
        "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idempo\\_%'",
        prepare=False,
    ).fetchone()
    if began and not conn.autocommit:
        conn.commit()
    assert row is not None
    return int(row[0])


def pay(
    idem: Idempotency, conn: psycopg.Connection[Any], table: str, key: str, inside: Any = None
) -> Any:
    """One guarded payment on ``conn``; ``inside(conn)`` runs in the block after the write."""
    with idem.once(key, operation=OPERATION, conn=conn) as attempt:
        if not attempt.replayed:
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'paid')", (key,), prepare=False)
            if inside is not None:
                inside(conn)
            attempt.result = {"paid": key}
    return attempt


def notes(conn: psycopg.Connection[Any], table: str) -> list[str]:
    rows = conn.execute(f"SELECT idem_key FROM {table} ORDER BY idem_key", prepare=False)
    keys = [str(row[0]) for row in rows.fetchall()]
    conn.commit()
    return keys


def assert_in_step(conn: psycopg.Connection[Any]) -> None:
    """No pipeline left open, no transaction of the guard's, and the connection answers."""
    assert conn.pgconn.pipeline_status == PipelineStatus.OFF
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert conn.execute("SELECT 2", prepare=False).fetchone() == (2,)
    conn.rollback()


# -- prepared statements that vanish ----------------------------------------------------------


def test_a_statement_deallocated_on_a_kept_connection_is_prepared_again(
    pg_store: PostgresStore,
) -> None:
    scope = Scope("", OPERATION, new_key())
    assert pg_store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
    assert pg_store._kept is not None
    (conn, _), *_ = pg_store._kept._idle
    assert ours(conn) > 0
    conn.execute("DEALLOCATE ALL")
    assert ours(conn) == 0
    record = pg_store.get(scope)
    assert record is not None
    assert record.status is Status.IN_PROGRESS
    assert ours(conn) > 0


def test_a_completion_whose_statement_the_block_deallocated_commits_the_work(
    pg_store: PostgresStore, app: psycopg.Connection[Any], business: str
) -> None:
    """psycopg deallocates every prepared statement of the session after a rollback, a
    nested transaction's too, once it prepared one of its own: the completion's statement
    is gone when the block ends. It is prepared again behind a savepoint of the guard's
    own, and the work it follows commits."""
    idem = Idempotency(pg_store)
    pay(idem, app, business, new_key())  # every statement of the guard's prepared
    app.prepare_threshold = 0  # psycopg prepares its own at once

    def nested_rollback(conn: psycopg.Connection[Any]) -> None:
        conn.execute("SELECT 1")  # prepared by psycopg
        with conn.transaction():
            conn.execute("SELECT 2")
            raise psycopg.Rollback  # psycopg: ROLLBACK TO SAVEPOINT, then DEALLOCATE ALL
        assert ours(conn) == 0  # the guard's are gone too

    key = new_key()
    attempt = pay(idem, app, business, key, inside=nested_rollback)
    assert attempt.result == {"paid": key}
    assert_in_step(app)
    assert ours(app) > 0  # the completion's, prepared again
    assert key in notes(app, business)
    record = pg_store.get(Scope("", OPERATION, key))
    assert record is not None
    assert record.status is Status.COMPLETED
    assert pay(idem, app, business, key).replayed


def test_a_reservation_joining_the_apps_transaction_after_a_deallocate_keeps_its_writes(
    pg_store: PostgresStore, app: psycopg.Connection[Any], business: str
) -> None:
    """The app's transaction is open when the guard reserves in it: a reservation whose
    statement vanished must not abort what the app wrote before."""
    idem = Idempotency(pg_store)
    pay(idem, app, business, new_key())
    app.execute(f"INSERT INTO {business} VALUES ('before', 'app')", prepare=False)
    app.execute("DEALLOCATE ALL", prepare=False)
    key = new_key()
    assert pay(idem, app, business, key).result == {"paid": key}
    assert_in_step(app)
    assert {"before", key} <= set(notes(app, business))


def test_a_reservation_the_guard_begins_after_a_deallocate_starts_over(
    pg_store: PostgresStore, app: psycopg.Connection[Any], business: str
) -> None:
    idem = Idempotency(pg_store)
    pay(idem, app, business, new_key())
    app.execute("DEALLOCATE ALL", prepare=False)
    app.commit()
    key = new_key()
    assert pay(idem, app, business, key).result == {"paid": key}
    assert ours(app) > 0
    assert_in_step(app)
    assert pay(idem, app, business, key).replayed


def test_no_prepared_statements_where_psycopg_is_told_to_make_none(
    pg_store: PostgresStore, app: psycopg.Connection[Any], business: str
) -> None:
    """``prepare_threshold = None`` is psycopg's setting for a PgBouncer that keeps no
    prepared statements: the guard's statements are parsed on every use there too."""
    app.prepare_threshold = None
    idem = Idempotency(pg_store)
    key = new_key()
    assert pay(idem, app, business, key).result == {"paid": key}
    assert pay(idem, app, business, key).replayed
    assert ours(app) == 0


# -- errors, interrupts and broken connections ------------------------------------------------


def test_a_failed_batch_leaves_the_apps_connection_in_step(
    postgres_url: str, pg_schema: str, app: psycopg.Connection[Any]
) -> None:
    store = PostgresStore(postgres_url, table=f"{pg_schema}.never_migrated")
    try:
        with (
            pytest.raises(SchemaMissingError),
            Idempotency(store).once(new_key(), operation=OPERATION, conn=app),
        ):
            raise AssertionError("the work ran")
        assert_in_step(app)
    finally:
        store.close()


def _pending() -> list[tuple[Any, Any]]:
    return [(b"SELECT pg_sleep(0.2)", None), ("SELECT :n::int", {"n": 7})]


def test_an_interrupt_between_send_and_read_leaves_the_connection_in_step(
    postgres_url: str,
) -> None:
    """The batch is sent, then the wait for its answer is interrupted (an exception thrown
    where the connection's wait would raise it): what is left is read to the Sync, the
    pipeline mode is left, and the next statement gets its own answer."""
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        gen = exchange(conn, _pending())
        next(gen)  # sent; the answer not read
        with pytest.raises(KeyboardInterrupt):
            drive_after_throw(gen, conn, KeyboardInterrupt())
        assert conn.pgconn.pipeline_status == PipelineStatus.OFF
        assert conn.execute("SELECT 3", prepare=False).fetchone() == (3,)
        assert drive(exchange(conn, _pending()), conn.wait)[1] == [(7,)]


def test_a_second_interrupt_while_reading_what_is_left_closes_the_connection(
    postgres_url: str,
) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        gen = exchange(conn, _pending())
        next(gen)
        gen.throw(KeyboardInterrupt())  # the first: it goes on to read what is left
        with pytest.raises(KeyboardInterrupt):
            gen.throw(KeyboardInterrupt())  # the second, while it reads
        assert conn.closed


def drive_after_throw(gen: Any, conn: psycopg.Connection[Any], exc: BaseException) -> Any:
    """Throw ``exc`` into ``gen`` at its wait, then run what it yields on ``conn``."""
    op = gen.throw(exc)
    while True:
        op = gen.send(conn.wait(op))


@pytest.mark.anyio
async def test_a_cancelled_async_batch_leaves_the_connection_in_step(postgres_url: str) -> None:
    conn = await psycopg.AsyncConnection.connect(postgres_url, autocommit=True)
    try:
        pending = [(b"SELECT pg_sleep(5)", None), ("SELECT :n::int", {"n": 7})]
        task = asyncio.create_task(adrive(exchange(conn, pending), conn.wait))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert conn.pgconn.pipeline_status == PipelineStatus.OFF
        assert conn.info.transaction_status == TransactionStatus.IDLE
        cur = await conn.execute("SELECT 3", prepare=False)
        assert await cur.fetchone() == (3,)
        answers = await adrive(exchange(conn, _pending()), conn.wait)
        assert answers[1] == [(7,)]
    finally:
        await conn.close()


def test_a_statement_the_server_skipped_answers_skipped(postgres_url: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        pending = [(b"SELECT 1/0", None), ("SELECT :n::int", {"n": 7})]
        failed, skipped = drive(exchange(conn, pending), conn.wait)
        assert isinstance(failed, psycopg.errors.DivisionByZero)
        assert skipped is SKIPPED
        assert conn.pgconn.pipeline_status == PipelineStatus.OFF


def test_a_kept_connection_killed_between_calls_is_replaced(
    pg_store: PostgresStore, postgres_url: str
) -> None:
    """As with a pooled connection killed between calls: the call that meets it fails as
    the store being unreachable (the statement may have been sent), and the next one gets
    another connection."""
    scope = Scope("", OPERATION, new_key())
    pg_store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
    assert pg_store._kept is not None
    (conn, _), *_ = pg_store._kept._idle
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    with pytest.raises(StoreUnavailableError):
        pg_store.get(scope)
    assert all(kept is not conn for kept, _ in pg_store._kept._idle)
    assert pg_store.get(scope) is not None


# -- the connections the store keeps ----------------------------------------------------------


def test_threads_sharing_a_pool_of_one_never_wait_on_a_kept_connection(
    postgres_url: str, pg_schema: str
) -> None:
    """A caller that finds no connection kept waits on the pool: what is given back
    meanwhile goes to the pool, which hands it over (were it kept instead, the caller would
    wait out the pool's timeout and fail)."""
    with migrated_pg_store(postgres_url, pg_schema) as store:
        single = PostgresStore(postgres_url, table=store.dialect.table, max_size=1)
        try:
            scope = Scope("", OPERATION, new_key())
            start = threading.Barrier(4)

            def calls() -> int:
                start.wait()
                return sum(single.get(scope) is None for _ in range(40))

            with ThreadPoolExecutor(4) as pool:
                assert sum(pool.map(lambda _: calls(), range(4))) == 160
        finally:
            single.close()


def test_closing_the_store_gives_every_kept_connection_back(pg_store: PostgresStore) -> None:
    scope = Scope("", OPERATION, new_key())
    assert pg_store.get(scope) is None
    kept = pg_store._kept
    assert kept is not None
    (conn, until), *_ = kept._idle
    pg_store.close()
    assert kept._idle == []
    assert conn.closed  # the pool closed it
    assert kept.give(conn, until) is conn  # one given back after closing goes to the pool


class _Conn:
    """What `KeptConnections` looks at on a connection."""

    def __init__(self) -> None:
        self.pgconn = self
        self.status = psycopg.pq.ConnStatus.OK
        self.transaction_status = TransactionStatus.IDLE


def test_a_kept_connection_goes_back_to_the_pool_when_its_time_is_up() -> None:
    kept, conn = _kept.KeptConnections(), _Conn()
    assert kept.give(conn, until=0.0) is conn
    assert kept.give(conn, until=float("inf")) is None
    assert kept.take() == (conn, float("inf"))


def test_a_connection_left_in_a_transaction_or_broken_is_not_kept() -> None:
    kept, conn = _kept.KeptConnections(), _Conn()
    conn.transaction_status = TransactionStatus.INERROR
    assert kept.give(conn, until=float("inf")) is conn
    conn.transaction_status, conn.status = TransactionStatus.IDLE, psycopg.pq.ConnStatus.BAD
    assert kept.give(conn, until=float("inf")) is conn
    assert kept.take() is None


def test_while_someone_waits_on_the_pool_a_connection_given_back_goes_there() -> None:
    kept, conn = _kept.KeptConnections(), _Conn()
    assert kept.take() is None  # none kept: the caller waits on the pool
    assert kept.give(conn, until=float("inf")) is conn
    kept.waited()
    assert kept.give(conn, until=float("inf")) is None
    assert kept.take() == (conn, float("inf"))


def test_a_forked_child_takes_none_of_its_parents_connections(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept, conn = _kept.KeptConnections(), _Conn()
    kept.give(conn, until=float("inf"))
    monkeypatch.setattr(_kept.os, "getpid", lambda: -1)
    assert kept.take() is None


# -- connections the wire leaves alone or reads otherwise --------------------------------------


@pytest.mark.parametrize("one_trip", [False, True])
def test_an_apps_connection_in_pipeline_mode_is_sent_through_psycopg(
    postgres_url: str, pg_schema: str, app: psycopg.Connection[Any], business: str, one_trip: bool
) -> None:
    """psycopg's pipeline queues would not know of statements sent past them: the guard's go
    through psycopg there, the replay that ends its transaction by an error included."""
    with migrated_pg_store(postgres_url, pg_schema, one_trip_replays=one_trip) as store:
        idem = Idempotency(store)
        key = new_key()
        with app.pipeline():
            assert pay(idem, app, business, key).result == {"paid": key}
            assert pay(idem, app, business, key).replayed
        assert_in_step(app)
        assert key in notes(app, business)


@pytest.mark.parametrize("encoding", ["LATIN1", "SQL_ASCII"])
def test_a_session_in_another_client_encoding_reads_text_in_it(
    postgres_url: str, pg_schema: str, encoding: str
) -> None:
    sep = "&" if "?" in postgres_url else "?"
    url = f"{postgres_url}{sep}options=-c%20client_encoding%3D{encoding}"
    with migrated_pg_store(url, pg_schema) as store:
        scope = Scope("caf\u00e9", "r\u00e9gler", new_key())
        token = store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL).token  # type: ignore[union-attr]
        store.complete(scope, token, b"\xe9t\xe9", now=None, ttl=TTL)
        record = store.get(scope)
        assert record is not None
        assert record.scope == scope
        assert record.response == b"\xe9t\xe9"
        assert record.created_at.utcoffset() == timedelta(0)


@pytest.mark.anyio
async def test_the_async_store_keeps_its_connections_and_replays(
    postgres_url: str, pg_schema: str
) -> None:
    store = AsyncPostgresStore(postgres_url, table=f"{pg_schema}.idempo_records", max_size=1)
    try:
        await store.migrate()
        idem = AsyncIdempotency(store)
        key = new_key()

        async def call() -> Any:
            async with idem.once(key, operation=OPERATION) as attempt:
                if not attempt.replayed:
                    attempt.result = "done"
            return attempt

        assert not (await call()).replayed
        results = await asyncio.gather(*(call() for _ in range(20)))
        assert all(attempt.replayed and attempt.result == "done" for attempt in results)
        assert store._kept is not None
        assert len(store._kept._idle) == 1
    finally:
        await store.aclose()
