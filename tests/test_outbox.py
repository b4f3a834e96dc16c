"""Staging outbox messages: they commit in the guard's transaction, with the business write and
the stored result, on the real SQLite, PostgreSQL and MariaDB, through every kind of app
connection (sqlite3, psycopg, PyMySQL, aiomysql, SQLAlchemy sync and async), in transactional
and leased mode, from the function API and from a FastAPI endpoint. A rolled-back block, a
replay and a losing duplicate stage nothing. What is committed is read through a separate,
plain connection (`Database.select`).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any

import aiomysql
import httpx
import psycopg
import pytest
from fastapi import Depends, FastAPI
from sqlalchemy import create_engine, text
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine
from sqlalchemy.orm import Session

from helpers import Database, new_key
from idempo import AsyncIdempotency, ConfigurationError, Idempotency, Policy, Scope
from idempo.asgi import IdempotencyMiddleware
from idempo.consumer import Consumer, Envelope, Reason
from idempo.contrib.starlette import current_attempt, idempotent_connection
from idempo.errors import StoreError
from idempo.guard import Attempt
from idempo.outbox import Outbox, encode_body, message_id, outbox_table
from idempo.outbox import astage as default_astage
from idempo.outbox import stage as default_stage
from idempo.stores.mysql import connect_options
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore
from idempo.testing import FakeClock


@pytest.fixture
def app_db(database: Database) -> Database:
    """Every real database, with the outbox migrated beside the records and a business
    table."""
    store = database.store()
    try:
        Outbox(outbox_table(database.records_table)).migrate(store)
    finally:
        store.close()
    database.create_business_table("k VARCHAR(100), n INTEGER")
    return database


def box(database: Database) -> Outbox:
    """The outbox beside the database's records table (in its schema)."""
    return Outbox(outbox_table(database.records_table))


def outbox(database: Database) -> list[tuple[Any, ...]]:
    """The committed outbox rows: (id, principal, operation, key, label, destination, body,
    headers, attempts, sent_at)."""
    rows = database.select(
        "SELECT id, principal, operation, idem_key, label, destination, body, headers,"
        f" attempts, sent_at FROM {outbox_table(database.records_table)} ORDER BY label"
    )
    return [(*row[:6], bytes(row[6]), *row[7:]) for row in rows]


def business(database: Database) -> list[tuple[Any, ...]]:
    return database.select(f"SELECT k, n FROM {database.business_table}")


def insert(database: Database, conn: Any, key: str, n: int) -> None:
    sql = database.sql(f"INSERT INTO {database.business_table} (k, n) VALUES (?, ?)")
    conn.execute(sql, (key, n))


def run_once(idem: Idempotency, database: Database, conn: Any, key: str, **options: Any) -> Any:
    """One guarded call that writes a business row and stages two messages."""
    app_db = database
    with idem.once(key, operation="capture", principal="u1", conn=conn, **options) as attempt:
        if not attempt.replayed:
            insert(database, conn, key, 1)
            box(app_db).stage(conn, attempt, "payments", {"event": "payment.captured", "key": key})
            box(app_db).stage(
                conn, attempt, "audit", b"raw", label="audit-1", headers={"x-kind": "a"}
            )
            attempt.result = {"captured": key}
    return attempt


@pytest.mark.parametrize("mode", ["transactional", "leased"])
def test_staged_messages_commit_with_the_write_and_the_record(app_db: Database, mode: str) -> None:
    """Both messages, the business row and the record commit together; the ids are derived
    from the scope; a replay returns the stored result and stages nothing again."""
    store = app_db.store()
    idem = Idempotency(store)
    conn = app_db.connect(store)
    key = new_key()
    try:
        first = run_once(idem, app_db, conn, key, mode=mode)
        again = run_once(idem, app_db, conn, key, mode=mode)
    finally:
        conn.close()
        store.close()
    assert not first.replayed
    assert again.replayed
    assert again.result == {"captured": key}
    scope = Scope.of(key, operation="capture", principal="u1")
    assert outbox(app_db) == [
        (message_id(scope, "audit-1"), "u1", "capture", key, "audit-1", "audit", b"raw",
         '{"x-kind":"a"}', 0, None),
        (message_id(scope, "payments#0"), "u1", "capture", key, "payments#0", "payments",
         encode_body({"event": "payment.captured", "key": key}), "{}", 0, None),
    ]  # fmt: skip
    assert business(app_db) == [(key, 1)]


def test_a_block_that_raises_stages_nothing(app_db: Database) -> None:
    """The block's exception rolls back its write and its messages; the retry runs again and
    stages the same ids once."""
    store = app_db.store()
    idem = Idempotency(store)
    conn = app_db.connect(store)
    key = new_key()
    try:

        def broken() -> None:
            with idem.once(key, operation="capture", conn=conn) as attempt:
                insert(app_db, conn, key, 1)
                box(app_db).stage(conn, attempt, "payments", b"first try")
                raise RuntimeError("broke after staging")

        with pytest.raises(RuntimeError):
            broken()
        assert outbox(app_db) == []
        assert business(app_db) == []
        with idem.once(key, operation="capture", conn=conn) as attempt:
            retried = box(app_db).stage(conn, attempt, "payments", b"second try")
            attempt.result = "ok"
    finally:
        conn.close()
        store.close()
    rows = outbox(app_db)
    assert [(row[0], row[6]) for row in rows] == [(retried.id, b"second try")]
    assert retried.id == message_id(Scope.of(key, operation="capture"), "payments#0")


def test_a_replayed_attempt_cannot_stage(app_db: Database) -> None:
    """Staging on a replay is refused: its messages were staged by the first execution."""
    store = app_db.store()
    idem = Idempotency(store)
    conn = app_db.connect(store)
    key = new_key()
    try:
        run_once(idem, app_db, conn, key)
        with idem.once(key, operation="capture", principal="u1", conn=conn) as attempt:
            assert attempt.replayed
            with pytest.raises(ConfigurationError, match="replay"):
                box(app_db).stage(conn, attempt, "payments", b"again")
    finally:
        conn.close()
        store.close()
    assert len(outbox(app_db)) == 2


@pytest.mark.slow
def test_concurrent_duplicates_stage_one_set(app_db: Database) -> None:
    """Eight threads, one key, each on its own connection: one executes and stages its two
    messages, the others replay (or are told it is in progress) and stage nothing."""
    store = app_db.store(pool_size=10)
    idem = Idempotency(store, Policy(wait=timedelta(seconds=10)))
    key = new_key()
    start = threading.Barrier(8)
    executed: list[bool] = []
    errors: list[BaseException] = []

    def duplicate() -> None:
        conn = app_db.connect(store)
        try:
            start.wait()
            executed.append(not run_once(idem, app_db, conn, key).replayed)
        except BaseException as exc:
            errors.append(exc)
        finally:
            conn.close()

    threads = [threading.Thread(target=duplicate) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    store.close()
    assert errors == []
    assert sorted(executed) == [False] * 7 + [True]
    assert len(outbox(app_db)) == 2
    assert business(app_db) == [(key, 1)]


def test_staging_needs_the_guards_connection_and_good_arguments(app_db: Database) -> None:
    """Every misuse is a ConfigurationError that says what to do; nothing is written."""
    store = app_db.store()
    idem = Idempotency(store)
    conn = app_db.connect(store)
    other = app_db.connect(store)
    key = new_key()
    try:
        with idem.once(key, operation="capture", conn=conn) as attempt:
            with pytest.raises(ConfigurationError, match="conn="):
                box(app_db).stage(None, attempt, "payments", b"x")
            with pytest.raises(ConfigurationError, match="no open transaction"):
                box(app_db).stage(other, attempt, "payments", b"x")
            with pytest.raises(ConfigurationError, match="destination"):
                box(app_db).stage(conn, attempt, "", b"x")
            with pytest.raises(ConfigurationError, match="headers"):
                box(app_db).stage(conn, attempt, "payments", b"x", headers={"n": 1})  # type: ignore[dict-item]
            with pytest.raises(ConfigurationError, match="JSON-able"):
                box(app_db).stage(conn, attempt, "payments", object())
            with pytest.raises(ConfigurationError, match="cannot stage on a"):
                box(app_db).stage(object(), attempt, "payments", b"x")
            box(app_db).stage(conn, attempt, "payments", b"x", label="one")
            with pytest.raises(ConfigurationError, match="labelled 'one' already"):
                box(app_db).stage(conn, attempt, "payments", b"y", label="one")
            attempt.result = "ok"
        with pytest.raises(ConfigurationError, match="not an attempt"):
            box(app_db).stage(conn, object(), "payments", b"x")
        # An attempt that names its connection is held to it.
        with idem.once(new_key(), operation="capture", conn=conn) as attempt:
            attempt.conn = other  # type: ignore[attr-defined]
            with pytest.raises(ConfigurationError, match="another connection"):
                box(app_db).stage(conn, attempt, "payments", b"x")
            attempt.conn = None  # type: ignore[attr-defined]
            with pytest.raises(ConfigurationError, match="has none"):
                box(app_db).stage(conn, attempt, "payments", b"x")
            attempt.result = "ok"
    finally:
        other.close()
        conn.close()
        store.close()
    assert [row[4] for row in outbox(app_db)] == ["one"]


def test_a_missing_outbox_table_is_a_store_error(tmp_path: Path) -> None:
    """Staging into a database whose outbox was never migrated fails the block (nothing
    commits) with the store's error, naming migrate."""
    store = SQLiteStore(str(tmp_path / "bare.db"))
    store.migrate()
    conn = store.connect()
    try:
        with (
            pytest.raises(StoreError, match="migrate"),
            Idempotency(store).once(new_key(), operation="op", conn=conn) as attempt,
        ):
            default_stage(conn, attempt, "payments", b"x")
    finally:
        conn.close()
        store.close()


def test_sync_stage_refuses_an_async_connection(tmp_path: Path) -> None:
    """The face must match: stage() on an async connection says to await astage()."""
    attempt = Attempt(Scope.of("k", operation="op"), replayed=False, token=1)

    class FakeAioMySQL:  # what the driver is known by: its classes' module
        __module__ = "aiomysql.connection"

    fake = FakeAioMySQL()
    with pytest.raises(ConfigurationError, match="astage"):
        default_stage(fake, attempt, "payments", b"x")


# --- async connections -----------------------------------------------------------------------


async def _async_conn(database: Database) -> tuple[Any, Any]:
    """An async app connection and what closes it: psycopg's on PostgreSQL, aiomysql's on
    MariaDB, SQLAlchemy's aiosqlite one on SQLite."""
    if database.kind == "postgres":
        pg = await psycopg.AsyncConnection.connect(database.location)
        return pg, pg.close
    if database.kind == "mysql":
        options = connect_options(database.location)
        options["db"] = options.pop("database")
        my = await aiomysql.connect(**options, autocommit=False)

        async def close() -> None:
            my.close()

        return my, close
    engine = create_async_engine(f"sqlite+aiosqlite:///{database.location}")
    sa = await engine.connect()

    async def dispose() -> None:
        await sa.close()
        await engine.dispose()

    return sa, dispose


async def _execute(database: Database, conn: Any, key: str) -> None:
    if isinstance(conn, AsyncConnection):
        await conn.execute(
            text(f"INSERT INTO {database.business_table} (k, n) VALUES (:k, 1)"), {"k": key}
        )
    elif isinstance(conn, psycopg.AsyncConnection):
        await conn.execute(f"INSERT INTO {database.business_table} (k, n) VALUES (%s, 1)", (key,))
    else:
        async with conn.cursor() as cursor:
            await cursor.execute(
                f"INSERT INTO {database.business_table} (k, n) VALUES (%s, 1)", (key,)
            )


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["transactional", "leased"])
async def test_async_staging_commits_with_the_record(app_db: Database, mode: str) -> None:
    """astage() on each async driver: committed with the write and the record; a raising
    block leaves nothing; a replay stages nothing."""
    store = app_db.async_store()
    idem = AsyncIdempotency(store)
    conn, close = await _async_conn(app_db)
    key, failed_key = new_key(), new_key()
    try:

        async def broken() -> None:
            async with idem.once(failed_key, operation="capture", conn=conn, mode=mode) as attempt:
                await _execute(app_db, conn, failed_key)
                await box(app_db).astage(conn, attempt, "payments", b"rolled back")
                raise RuntimeError("broke")

        with pytest.raises(RuntimeError):
            await broken()
        for _ in range(2):
            async with idem.once(key, operation="capture", conn=conn, mode=mode) as attempt:
                if not attempt.replayed:
                    await _execute(app_db, conn, key)
                    staged = await box(app_db).astage(conn, attempt, "payments", {"k": key})
                    attempt.result = staged.id
        with pytest.raises(ConfigurationError, match="stage"):
            box(app_db).stage(conn, attempt, "payments", b"wrong face")
    finally:
        await close()
        await store.aclose()
    assert attempt.replayed
    assert [(row[0], row[6]) for row in outbox(app_db)] == [
        (attempt.result, b'{"k":"%s"}' % key.encode())
    ]
    assert business(app_db) == [(key, 1)]


# --- SQLAlchemy ------------------------------------------------------------------------------


def _sqlalchemy_url(database: Database) -> str:
    if database.kind == "sqlite":
        return f"sqlite:///{database.location}"
    if database.kind == "mysql":
        return database.location.replace("mysql://", "mysql+pymysql://", 1)
    return database.location.replace("postgresql://", "postgresql+psycopg://", 1)


def test_sqlalchemy_session_stages_in_the_guards_transaction(app_db: Database) -> None:
    """A SQLAlchemy Session: the guard commits the session with the staged message."""
    store = app_db.store()
    idem = Idempotency(store)
    engine = create_engine(_sqlalchemy_url(app_db))
    key = new_key()
    try:
        with Session(engine) as session:
            with idem.once(key, operation="capture", conn=session) as attempt:
                session.execute(
                    text(f"INSERT INTO {app_db.business_table} (k, n) VALUES (:k, 1)"), {"k": key}
                )
                staged = box(app_db).stage(session, attempt, "payments", "text body")
                attempt.result = "ok"

            def broken() -> None:
                with idem.once(new_key(), operation="x", conn=session) as other:
                    box(app_db).stage(session, other, "payments", b"never")
                    raise RuntimeError

            with pytest.raises(RuntimeError):
                broken()
    finally:
        engine.dispose()
        store.close()
    assert [(row[0], row[6]) for row in outbox(app_db)] == [(staged.id, b"text body")]


# --- a consumer ----------------------------------------------------------------------------


def test_a_consumer_stages_with_its_record(sqlite_database: Database) -> None:
    """A consumer with connection=: the handler stages on delivery.conn; a redelivery of
    the same event is a duplicate and stages nothing."""
    sqlite_store = sqlite_database.store()
    Outbox().migrate(sqlite_store)

    @contextmanager
    def connection() -> Any:
        conn = sqlite_store.connect()
        try:
            yield conn
        finally:
            conn.close()

    consumer = Consumer(
        Idempotency(sqlite_store), name="billing", horizon=timedelta(hours=1), connection=connection
    )

    def handler(delivery: Any) -> str:
        message = default_stage(delivery.conn, delivery.attempt, "invoices", delivery.envelope.body)
        return message.id

    envelope = Envelope(id="evt-1", body=b'{"order": 7}')
    try:
        outcomes = [consumer.process(None, envelope, handler) for _ in range(2)]
    finally:
        sqlite_store.close()
    assert [o.reason for o in outcomes] == [Reason.EXECUTED, Reason.DUPLICATE]
    assert [(row[0], row[6]) for row in outbox(sqlite_database)] == [
        (outcomes[0].result, b'{"order": 7}')
    ]


# --- FastAPI ---------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_fastapi_endpoint_stages_with_its_stored_response(tmp_path: Path) -> None:
    """Behind IdempotencyMiddleware(connection=...): the endpoint stages on the idempotent
    connection; duplicates replay the stored response and stage nothing; a 500 stages
    nothing."""
    path = str(tmp_path / "app.db")
    sync = SQLiteStore(path)
    sync.migrate()
    Outbox().migrate(sync)
    sync.close()
    engine = create_async_engine(f"sqlite+aiosqlite:///{path}")
    store = AsyncSQLiteStore(path)
    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=store, connection=engine.connect)
    runs: list[str] = []

    @app.post("/captures/{pid}", status_code=201)
    async def capture(
        pid: str,
        conn: Annotated[AsyncConnection, Depends(idempotent_connection)],
        attempt: Annotated[Any, Depends(current_attempt)],
    ) -> dict[str, str]:
        runs.append(pid)
        message = await default_astage(
            conn, attempt, "payments", {"event": "payment.captured", "id": pid}
        )
        if pid == "broken":
            raise RuntimeError("after staging")
        return {"id": pid, "message": message.id}

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            key = new_key()
            answers = [
                await client.post("/captures/p1", headers={"Idempotency-Key": key})
                for _ in range(3)
            ]
            broken = await client.post("/captures/broken", headers={"Idempotency-Key": new_key()})
    finally:
        await store.aclose()
        await engine.dispose()
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert len({a.content for a in answers}) == 1
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert broken.status_code == 500
    assert runs == ["p1", "broken"]
    database = Database("sqlite", path)
    rows = outbox(database)
    assert [(row[0], row[3], row[2]) for row in rows] == [
        (answers[0].json()["message"], key, "POST /captures/{pid}")
    ]


# --- recovery points -------------------------------------------------------------------------


def test_steps_that_commit_one_by_one_never_reuse_an_id(app_db: Database) -> None:
    """Leased work made of steps: the first attempt stages a message in step "reserve",
    which commits with its checkpoint, then dies. The takeover resumes after "reserve" and
    stages in step "charge": its default label names the recorded step, so the two
    messages get two ids. A clashing label with another body is refused, not lost."""
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    store = app_db.store()
    idem = Idempotency(store, Policy(clock=clock, lease=timedelta(seconds=10)))
    first_conn, second_conn = app_db.connect(store), app_db.connect(store)
    key = new_key()
    try:
        handle = idem.begin(key, operation="order", conn=first_conn, mode="leased")
        first = handle.attempt
        reserved = box(app_db).stage(first_conn, first, "orders", b"reserved")
        box(app_db).stage(first_conn, first, "orders", b"kept", label="receipt")
        box(app_db).stage(first_conn, first, "orders", b"v1", label="invoice")
        first.checkpoint("reserve")
        first_conn.rollback()  # the process dies here: the next step's transaction is lost
        clock.advance(seconds=11)
        with idem.once(key, operation="order", conn=second_conn, mode="leased") as second:
            assert second.resumed
            assert not second.needs("reserve")
            charged = box(app_db).stage(second_conn, second, "orders", b"charged")
            box(app_db).stage(second_conn, second, "orders", b"kept", label="receipt")  # the same
            with pytest.raises(ConfigurationError, match="its own label"):
                box(app_db).stage(second_conn, second, "orders", b"v2", label="invoice")
            second.result = "placed"
    finally:
        first_conn.close()
        second_conn.close()
        store.close()
    assert reserved.id != charged.id
    assert charged.id == message_id(Scope.of(key, operation="order"), "orders#0@reserve")
    assert sorted(row[6] for row in outbox(app_db)) == [b"charged", b"kept", b"reserved", b"v1"]
