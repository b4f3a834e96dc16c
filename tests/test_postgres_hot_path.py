"""PostgreSQL's transactional hot path on the app's psycopg connection (issue 15).

The reservation's statement sets its own lock timeout and puts the app's back; when the guard
begins the transaction on a connection with no transaction settings of its own, BEGIN goes
behind the reservation, so a replay costs one round trip and leaves the connection idle.
These tests hold the app's setting, the connection's state, the isolation level and the round
trips to that, and race duplicates through both orders.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import IsolationLevel
from psycopg.pq import Trace, TransactionStatus
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from conftest import migrated_pg_store
from helpers import new_key
from idempo import AsyncIdempotency, Idempotency, Policy, RequestInProgressError
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore

pytestmark = pytest.mark.postgres

OPERATION = "hot.path"
APP_LOCK_TIMEOUT = "10min"  # the app's own: a reservation waiting by it would hang the test
# The guard's connection settings: none (BEGIN behind the reservation), autocommit, and an
# isolation level of its own (BEGIN first, carrying it).
SETTINGS = {
    "default": {},
    "autocommit": {"autocommit": True},
    "isolation": {"isolation_level": IsolationLevel.READ_COMMITTED},
}


class RoundTrips:
    """Counts a connection's round trips: the server's ReadyForQuery answers, one per plain
    query or pipeline Sync the client then waits on (libpq's trace of the connection)."""

    def __init__(self, conn: Any, into: Path) -> None:
        self._pgconn = conn.pgconn
        self._path = into

    @contextmanager
    def counting(self) -> Iterator[list[int]]:
        """Trace what runs in the block; the list holds its round trips when it ends."""
        counted: list[int] = []
        with self._path.open("w+") as trace:
            self._pgconn.trace(trace.fileno())
            self._pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS | Trace.REGRESS_MODE)
            try:
                yield counted
            finally:
                self._pgconn.untrace()  # flushes the trace
                trace.seek(0)
                lines = trace.read().splitlines()
        counted.append(sum(line.startswith("B\t5\tReadyForQuery") for line in lines))


@pytest.fixture
def pg_store(postgres_url: str, pg_schema: str) -> Iterator[PostgresStore]:
    """The store with replays in one round trip (``one_trip_replays``), which most tests here
    are about; `test_by_default_a_replay_ends_its_transaction_without_an_error` is not."""
    with migrated_pg_store(postgres_url, pg_schema, one_trip_replays=True) as store:
        yield store


def app_connection(url: str, **settings: Any) -> psycopg.Connection[Any]:
    """An app's connection with a lock timeout of its own, set for the session."""
    conn = psycopg.connect(url, autocommit=True)
    conn.execute(f"SET lock_timeout = '{APP_LOCK_TIMEOUT}'")
    conn.autocommit = settings.pop("autocommit", False)
    for name, value in settings.items():
        setattr(conn, name, value)
    return conn


def setting(conn: psycopg.Connection[Any], name: str) -> str:
    row = conn.execute(f"SHOW {name}", prepare=False).fetchone()
    assert row is not None
    return str(row[0])


def pay(idem: Idempotency, conn: psycopg.Connection[Any], table: str, key: str) -> Any:
    """One guarded payment; inside the block the app's lock timeout must be its own."""
    with idem.once(key, operation=OPERATION, conn=conn) as attempt:
        if not attempt.replayed:
            assert setting(conn, "lock_timeout") == APP_LOCK_TIMEOUT
            # Never prepared: psycopg's own Parse round trip, past its threshold, would count.
            conn.execute(f"INSERT INTO {table} VALUES (%s, 'paid')", (key,), prepare=False)
            attempt.result = {"paid": key}
    return attempt


def assert_as_the_app_left_it(conn: psycopg.Connection[Any]) -> None:
    """No transaction left open by the guard, and the app's lock timeout in force."""
    assert conn.info.transaction_status == TransactionStatus.IDLE
    assert setting(conn, "lock_timeout") == APP_LOCK_TIMEOUT
    if not conn.autocommit:
        conn.rollback()  # the SHOW's own transaction


@pytest.mark.parametrize(
    ("settings", "replay_trips"), [("default", 1), ("autocommit", 1), ("isolation", 2)]
)
def test_a_replay_is_one_round_trip_where_the_guard_begins_the_transaction(
    pg_store: PostgresStore,
    business: str,
    postgres_url: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    settings: str,
    replay_trips: int,
) -> None:
    """A first execution costs three round trips, as the bare transaction does (reservation,
    the app's write, completion); a replay one where BEGIN can go behind the reservation,
    two where the connection's isolation level must go first. Past psycopg's prepare
    threshold too, with nothing logged, and the connection left idle with its setting."""
    idem = Idempotency(pg_store)
    conn = app_connection(postgres_url, **SETTINGS[settings])
    trips = RoundTrips(conn, tmp_path / "trace")
    costs = []
    with conn, caplog.at_level(logging.WARNING):
        for _ in range(8):
            key = new_key()
            for replayed in (False, True):
                with trips.counting() as counted:
                    attempt = pay(idem, conn, business, key)
                costs.append(counted[0] - (0 if replayed else 1))  # less the block's SHOW
                assert attempt.replayed is replayed
                assert attempt.result == {"paid": key}
                assert_as_the_app_left_it(conn)
    assert costs == [3, replay_trips] * 8
    assert caplog.records == []


def test_by_default_a_replay_ends_its_transaction_without_an_error(
    postgres_url: str, pg_schema: str, business: str, tmp_path: Path
) -> None:
    """Without ``one_trip_replays`` BEGIN goes first: a replay costs two round trips and
    ends its transaction with a COMMIT, so the server logs no error and counts no rollback."""
    store = PostgresStore(postgres_url, table=f"{pg_schema}.idempo_records")
    store.migrate()
    idem = Idempotency(store)
    conn = app_connection(postgres_url)
    trips = RoundTrips(conn, tmp_path / "trace")
    try:
        key = new_key()
        pay(idem, conn, business, key)
        conn.rollback()  # the SHOW's own transaction
        with trips.counting() as counted:
            attempt = pay(idem, conn, business, key)
        assert attempt.replayed
        assert counted == [2]
        assert_as_the_app_left_it(conn)
    finally:
        conn.close()
        store.close()


@pytest.mark.anyio
async def test_an_async_replay_is_one_round_trip(
    postgres_url: str, pg_schema: str, business: str, tmp_path: Path
) -> None:
    """The async face shares the logic: a replay in one round trip, the connection idle."""
    store = AsyncPostgresStore(
        postgres_url, table=f"{pg_schema}.idempo_records", one_trip_replays=True
    )
    await store.migrate()
    idem = AsyncIdempotency(store)
    conn = await psycopg.AsyncConnection.connect(postgres_url)
    trips = RoundTrips(conn, tmp_path / "trace")
    costs = []
    try:
        for _ in range(7):
            key = new_key()
            for replayed in (False, True):
                with trips.counting() as counted:
                    async with idem.once(key, operation=OPERATION, conn=conn) as attempt:
                        if not attempt.replayed:
                            await conn.execute(
                                f"INSERT INTO {business} VALUES (%s, 'a')", (key,), prepare=False
                            )
                            attempt.result = key
                costs.append(counted[0])
                assert (attempt.replayed, attempt.result) == (replayed, key)
                assert conn.info.transaction_status == TransactionStatus.IDLE
    finally:
        await conn.close()
        await store.aclose()
    assert costs == [3, 1] * 7


def wait_until_waiting(postgres_url: str, conn: psycopg.Connection[Any]) -> None:
    """Until ``conn``'s backend waits on a lock (10 s at most)."""
    pid = conn.info.backend_pid
    deadline = time.monotonic() + 10
    with psycopg.connect(postgres_url, autocommit=True) as watcher:
        while not watcher.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = 'Lock'", (pid,)
        ).fetchone():
            assert time.monotonic() < deadline, "the duplicate never waited on the lock"
            time.sleep(0.01)


@pytest.mark.parametrize("settings", ["default", "isolation", "in a transaction"])
def test_the_apps_lock_timeout_survives_every_outcome(
    pg_store: PostgresStore, business: str, postgres_url: str, settings: str
) -> None:
    """Fresh, replayed, refused as in progress after the reservation's own lock timeout ran
    out (its statement failed), and a lost race asked again after the holder committed: the
    app's lock timeout is in force after each, and no transaction of the guard's is left."""
    quick = Idempotency(pg_store, Policy(lock_timeout=timedelta(milliseconds=200)))
    patient = Idempotency(pg_store, Policy(lock_timeout=timedelta(seconds=20)))
    options = SETTINGS.get(settings, {})
    conn = app_connection(postgres_url, **options)
    holder = app_connection(postgres_url)

    def ready() -> None:
        if settings == "in a transaction":
            conn.execute("SELECT 1")  # the app's transaction, which the guard joins

    with conn, holder:
        key = new_key()
        ready()
        assert not pay(quick, conn, business, key).replayed
        assert_as_the_app_left_it(conn)
        ready()
        assert pay(quick, conn, business, key).replayed
        assert_as_the_app_left_it(conn)

        held = new_key()
        with quick.once(held, operation=OPERATION, conn=holder) as holding:
            ready()
            with pytest.raises(RequestInProgressError):
                pay(quick, conn, business, held)
            conn.rollback()  # the app's, if it had one: the failed statement aborted it
            assert_as_the_app_left_it(conn)
            holding.result = {"paid": held}

        raced = new_key()
        with ThreadPoolExecutor(1) as pool:
            with patient.once(raced, operation=OPERATION, conn=holder) as holding:
                ready()
                duplicate = pool.submit(pay, patient, conn, business, raced)
                wait_until_waiting(postgres_url, conn)
                holding.result = {"paid": raced}
            # The duplicate's statement saw no record, then lost the insert: asked again.
            assert duplicate.result(timeout=20).replayed
        assert_as_the_app_left_it(conn)


@pytest.mark.parametrize("settings", ["default", "isolation", "in a transaction"])
def test_a_lost_race_then_a_takeover_runs_the_work_with_the_apps_lock_timeout(
    pg_store: PostgresStore, business: str, postgres_url: str, settings: str
) -> None:
    """The reservation's first statement waits on a holder's insert and loses it (no row);
    the holder's record is past its retention (its clock is two days behind), so the one
    asked next takes it over in the same transaction. The app's setting must be back for
    the work after both statements, though the first found nothing to return."""
    behind = Policy(clock=lambda: datetime.now(UTC) - timedelta(days=2))
    holding_idem = Idempotency(pg_store, behind)
    patient = Idempotency(pg_store, Policy(lock_timeout=timedelta(seconds=20)))
    conn = app_connection(postgres_url, **SETTINGS.get(settings, {}))
    holder = app_connection(postgres_url)
    with conn, holder, ThreadPoolExecutor(1) as pool:
        if settings == "in a transaction":
            conn.execute("SELECT 1")
        key = new_key()
        with holding_idem.once(key, operation=OPERATION, conn=holder) as holding:
            duplicate = pool.submit(pay, patient, conn, business, key)
            wait_until_waiting(postgres_url, conn)
            holding.result = {"paid": "by the holder"}
        attempt = duplicate.result(timeout=20)  # pay asserts the setting inside the block
        assert not attempt.replayed
        assert attempt.token > holding.token  # taken over, not replayed
        assert_as_the_app_left_it(conn)


@pytest.mark.parametrize(
    ("prepare", "expected"),
    [
        (
            lambda conn: conn.execute("SET default_transaction_isolation = 'serializable'"),
            "serializable",
        ),
        (
            lambda conn: setattr(conn, "isolation_level", IsolationLevel.REPEATABLE_READ),
            "repeatable read",
        ),
    ],
    ids=["server-default", "connection"],
)
def test_the_work_runs_at_the_isolation_level_the_connection_has(
    pg_store: PostgresStore,
    business: str,
    postgres_url: str,
    prepare: Callable[[psycopg.Connection[Any]], Any],
    expected: str,
) -> None:
    """The session's default isolation level (BEGIN behind the reservation: the transaction
    the reservation starts has it) or the connection's own (BEGIN first, carrying it)."""
    idem = Idempotency(pg_store)
    conn = app_connection(postgres_url)
    with conn:
        prepare(conn)
        conn.commit()
        key = new_key()
        levels = []
        for _ in range(2):
            with idem.once(key, operation=OPERATION, conn=conn) as attempt:
                if not attempt.replayed:  # a replayed block runs after its transaction
                    levels.append(setting(conn, "transaction_isolation"))
                    attempt.result = "ok"
            assert conn.info.transaction_status == TransactionStatus.IDLE
        assert attempt.replayed
    assert levels == [expected]


def test_the_lock_timeout_is_kept_through_a_sqlalchemy_session(
    pg_store: PostgresStore, business: str, postgres_url: str
) -> None:
    """The SQLAlchemy executor runs the same statement: the app's setting after a first
    execution, a replay and a reservation refused on its own lock timeout."""
    engine = create_engine(postgres_url.replace("postgresql://", "postgresql+psycopg://", 1))
    idem = Idempotency(pg_store, Policy(lock_timeout=timedelta(milliseconds=200)))
    holder = app_connection(postgres_url)

    def lock_timeout(session: Session) -> str:
        value = session.execute(text("SHOW lock_timeout")).scalar_one()
        session.rollback()
        return str(value)

    try:
        with Session(engine) as session, holder:
            session.execute(text(f"SET SESSION lock_timeout = '{APP_LOCK_TIMEOUT}'"))
            session.commit()
            key = new_key()
            for _ in range(2):
                with idem.once(key, operation=OPERATION, conn=session) as attempt:
                    if not attempt.replayed:
                        inside = session.execute(text("SHOW lock_timeout")).scalar_one()
                        assert inside == APP_LOCK_TIMEOUT
                        attempt.result = "ok"
                assert lock_timeout(session) == APP_LOCK_TIMEOUT
            held = new_key()
            with idem.once(held, operation=OPERATION, conn=holder) as holding:
                with (
                    pytest.raises(RequestInProgressError),
                    idem.once(held, operation=OPERATION, conn=session),
                ):
                    raise AssertionError("the work ran")
                holding.result = "ok"
            assert lock_timeout(session) == APP_LOCK_TIMEOUT
    finally:
        engine.dispose()


@pytest.mark.parametrize("rounds", [12])
def test_duplicates_on_their_own_connections_run_the_work_once(
    pg_store: PostgresStore, business: str, postgres_url: str, rounds: int
) -> None:
    """Eight duplicates per key, each on its own connection (half with BEGIN behind the
    reservation, half with BEGIN first), released together: the work runs once per key, every
    other duplicate replays its result (it waited on the holder's row lock, lost the insert,
    and asked again), and each connection is left idle with its own lock timeout."""
    idem = Idempotency(pg_store, Policy(lock_timeout=timedelta(seconds=20)))
    workers = 8
    conns = [
        app_connection(postgres_url, **(SETTINGS["isolation"] if i % 2 else {}))
        for i in range(workers)
    ]
    ran: list[str] = []
    start = threading.Barrier(workers)

    def duplicate(conn: psycopg.Connection[Any], key: str) -> tuple[bool, Any]:
        start.wait(timeout=20)
        with idem.once(key, operation=OPERATION, conn=conn) as attempt:
            if not attempt.replayed:
                ran.append(key)
                conn.execute(f"INSERT INTO {business} VALUES (%s, 'once')", (key,))
                attempt.result = {"paid": key}
        return attempt.replayed, attempt.result

    try:
        with ThreadPoolExecutor(workers) as pool:
            for _ in range(rounds):
                key = new_key()
                outcomes = list(pool.map(duplicate, conns, [key] * workers))
                assert sorted(replayed for replayed, _ in outcomes) == [False] + [True] * 7
                assert {str(result) for _, result in outcomes} == {str({"paid": key})}
        for conn in conns:
            assert_as_the_app_left_it(conn)
    finally:
        for conn in conns:
            conn.close()
    assert len(ran) == len(set(ran)) == rounds
    with psycopg.connect(postgres_url) as check:
        row = check.execute(f"SELECT count(*) FROM {business}").fetchone()
    assert row == (rounds,)


@pytest.mark.postgres
def test_record_times_come_back_in_utc_whatever_the_sessions_time_zone(
    postgres_url: str, pg_schema: str
) -> None:
    """The record decode converts with a builtin (`PostgresDialect.py_time`): a session in
    another time zone still gives UTC times, the same instants."""
    from idempo._core.keys import Scope
    from idempo.stores.postgres import PostgresStore

    sep = "&" if "?" in postgres_url else "?"
    url = f"{postgres_url}{sep}options=-c%20TimeZone%3DAsia/Kathmandu"
    store = PostgresStore(url, table=f"{pg_schema}.idempo_records")
    try:
        store.migrate()
        scope = Scope("", "charge", "k-1")
        store.reserve(scope, "fp", now=None, lease=timedelta(minutes=1), ttl=timedelta(hours=1))
        record = store.get(scope)
        assert record is not None
        with store._pool.connection() as conn:
            row = conn.execute("SELECT created_at FROM " + store.dialect.table).fetchone()
        assert row is not None
        assert row[0].utcoffset() == timedelta(hours=5, minutes=45)  # the session's zone
        for at in (record.created_at, record.updated_at, record.expires_at):
            assert at.tzinfo is UTC
        assert record.created_at == row[0]
    finally:
        store.close()


def test_statements_go_as_bytes_made_once_unless_they_are_not_ascii() -> None:
    from idempo.stores.postgres import _pyformat

    sql = "SELECT 1 FROM t WHERE k = :key"
    assert _pyformat(sql) == b"SELECT 1 FROM t WHERE k = %(key)s"
    assert _pyformat(sql) is _pyformat(sql)  # the same bytes: psycopg's hash is cached
    assert _pyformat("SELECT 1 FROM caf\u00e9 WHERE k = :key") == (
        "SELECT 1 FROM caf\u00e9 WHERE k = %(key)s"
    )
