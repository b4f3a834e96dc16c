"""What is particular to the MariaDB store: URLs, the server check, long scopes, lock waits,
fencing on the app's connection, unreachable servers and the round trips each verb costs.

The shared contract (tests/conformance), the races (test_races.py) and the SIGKILL tests
(test_crashes.py) run on MariaDB too; these tests cover what they do not.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from typing import Any

import pymysql
import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session

from helpers import Database, new_key
from idempo import (
    AsyncIdempotency,
    ConfigurationError,
    FencedError,
    Idempotency,
    Policy,
    RequestInProgressError,
    SchemaMissingError,
    Scope,
    Status,
    StoreUnavailableError,
    open_async_store,
    open_store,
)
from idempo._core.record import Acquired, Replay
from idempo.stores._sql.mysql import lock_wait_seconds, scope_hash
from idempo.stores._sql.transaction import LockTimeoutError
from idempo.stores.mysql import (
    AsyncMySQLStore,
    MySQLStore,
    check_server,
    connect_options,
    map_error,
)
from idempo.testing import FakeClock

pytestmark = pytest.mark.mysql

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
OPERATION = "pay"
UNREACHABLE = "mysql://root@127.0.0.1:1/test?connect_timeout=2"


# -- URLs and configuration ----------------------------------------------------------------


def test_urls_build_mysql_stores_with_their_table(mysql_url: str, mysql_db: str) -> None:
    """mysql:// and mariadb:// build the MariaDB stores, sync and async, and ?table= names the
    table the store then migrates and uses."""
    table = f"{mysql_db}.my_records"
    store = open_store(f"{mysql_url}?table={table}")
    assert isinstance(store, MySQLStore)
    try:
        assert store.dialect.table == table
        store.migrate()
        scope = Scope.of("k-url", operation=OPERATION)
        reservation = store.reserve(scope, "fp", now=FakeClock()(), lease=LEASE, ttl=TTL)
        assert isinstance(reservation, Acquired)
    finally:
        store.close()
    rows = Database("mysql", mysql_url, mysql_db).select(f"SELECT idem_key FROM {table}")
    assert rows == [("k-url",)]
    maria = open_async_store(f"{mysql_url.replace('mysql://', 'mariadb://')}?table={table}")
    assert isinstance(maria, AsyncMySQLStore)
    assert maria.dialect.table == table


def test_connect_options_read_the_whole_url() -> None:
    """User, password (percent-decoded), host, port, database and the known query options come
    from the URL; defaults fill what it leaves out."""
    assert connect_options(
        "mysql+pymysql://app:p%40ss%2Fword@db.internal:3307/shop?connect_timeout=4"
    ) == {
        "host": "db.internal",
        "port": 3307,
        "user": "app",
        "password": "p@ss/word",
        "database": "shop",
        "connect_timeout": 4.0,
    }
    assert connect_options("mariadb:///?unix_socket=/run/mysqld/mysqld.sock") == {
        "host": "localhost",
        "port": 3306,
        "unix_socket": "/run/mysqld/mysqld.sock",
    }


@pytest.mark.parametrize(
    "url",
    [
        "mysql://root@127.0.0.1:99999/test",
        "mysql://root@127.0.0.1/test?sslmode=require",
        "postgresql://root@127.0.0.1/test",
    ],
)
def test_bad_urls_raise_configuration_errors(url: str) -> None:
    """A bad port, an unknown option or another scheme is a ConfigurationError."""
    with pytest.raises(ConfigurationError):
        MySQLStore(url)


@pytest.mark.parametrize(
    ("version", "accepted"),
    [
        ("5.5.5-10.11.19-MariaDB-0+deb12u1", True),
        ("10.5.0-MariaDB", True),
        ("11.4.2-MariaDB-ubu2404", True),
        ("10.4.34-MariaDB", False),
        ("8.0.36", False),
        ("8.4.0-0ubuntu0.24.04.1", False),
    ],
)
def test_only_mariadb_with_insert_returning_is_accepted(version: str, accepted: bool) -> None:
    """MariaDB 10.5+ is accepted; MySQL and older MariaDB, which lack INSERT ... RETURNING,
    are refused with a ConfigurationError that says why."""
    if accepted:
        check_server(version)
    else:
        with pytest.raises(ConfigurationError, match=r"MariaDB 10\.5"):
            check_server(version)


def test_lock_waits_round_up_to_whole_seconds() -> None:
    """InnoDB counts lock waits in whole seconds: any positive timeout waits at least one,
    zero does not wait."""
    assert lock_wait_seconds(timedelta(milliseconds=200)) == 1
    assert lock_wait_seconds(timedelta(seconds=5)) == 5
    assert lock_wait_seconds(timedelta(seconds=5, milliseconds=1)) == 6
    assert lock_wait_seconds(timedelta(0)) == 0


@pytest.mark.parametrize(
    ("error", "mapped"),
    [
        (pymysql.err.OperationalError(1205, "Lock wait timeout exceeded"), LockTimeoutError),
        (pymysql.err.OperationalError(1213, "Deadlock found"), LockTimeoutError),
        (pymysql.err.OperationalError(2003, "Can't connect"), StoreUnavailableError),
        (pymysql.err.OperationalError(2013, "Lost connection"), StoreUnavailableError),
        (pymysql.err.OperationalError(1040, "Too many connections"), StoreUnavailableError),
        (pymysql.err.InterfaceError(0, ""), StoreUnavailableError),
        (ConnectionResetError("reset by peer"), StoreUnavailableError),
        (pymysql.err.ProgrammingError(1146, "Table 't.x' doesn't exist"), SchemaMissingError),
        (pymysql.err.OperationalError(1049, "Unknown database 'x'"), StoreUnavailableError),
        (pymysql.err.ProgrammingError(1064, "You have an error in your SQL syntax"), Exception),
    ],
)
def test_driver_errors_map_to_what_they_mean(error: Exception, mapped: type) -> None:
    """Lock waits and deadlocks become the internal lock timeout (an in-progress answer),
    connection failures and refused logins StoreUnavailableError, a missing table
    SchemaMissingError, other server errors a plain StoreError."""
    result = map_error(error)
    assert isinstance(result, mapped)
    if mapped is Exception:
        assert type(result).__name__ == "StoreError"


# -- scopes --------------------------------------------------------------------------------


def test_scope_hash_separates_the_parts() -> None:
    """The primary key is a 32-byte hash in which moving text between the parts of a scope
    changes the key."""
    key = scope_hash(Scope("ab", "c", "k"))
    assert len(key) == 32
    assert key != scope_hash(Scope("a", "bc", "k"))
    assert key != scope_hash(Scope("ab", "", "ck"))
    assert key == scope_hash(Scope("ab", "c", "k"))


def test_long_and_unicode_scopes_fit_and_stay_apart(mysql_store: MySQLStore) -> None:
    """Principals and operations far past InnoDB's index limit, a 255-character key and
    non-ASCII text are stored verbatim; scopes that differ only in their last character, or
    in letter case, are separate records."""
    clock = FakeClock()
    long_principal = "tenant-" + "x" * 10_000
    scopes = [
        Scope.of("k" * 255, operation="POST /" + "p" * 3000, principal=long_principal),
        Scope.of("k" * 255, operation="POST /" + "p" * 3000, principal=long_principal + "y"),
        Scope.of("k" * 255, operation="POST /" + "p" * 3000, principal="Tenant-" + "x" * 10_000),
        Scope.of("order-1", operation="créer 🧾", principal="zoë"),
    ]
    for index, scope in enumerate(scopes):
        reservation = mysql_store.reserve(scope, f"fp-{index}", now=clock(), lease=LEASE, ttl=TTL)
        assert isinstance(reservation, Acquired), reservation
        mysql_store.complete(
            scope, reservation.token, f"answer {index}".encode(), now=clock(), ttl=TTL
        )
    for index, scope in enumerate(scopes):
        verdict = mysql_store.reserve(scope, f"fp-{index}", now=clock(), lease=LEASE, ttl=TTL)
        assert isinstance(verdict, Replay)
        assert verdict.record.scope == scope
        assert verdict.record.response == f"answer {index}".encode()
    assert mysql_store.stats() == {"completed": 4}


def test_takeover_works_with_simultaneous_assignment(mysql_url: str, mysql_db: str) -> None:
    """With MariaDB's SIMULTANEOUS_ASSIGNMENT mode (every SET term sees the old row) an
    expired lease and an expired record are still taken over whole, and a live one is not."""
    store = MySQLStore(
        mysql_url,
        table=f"{mysql_db}.idempo_records",
        connect_args={"sql_mode": "STRICT_TRANS_TABLES,SIMULTANEOUS_ASSIGNMENT"},
    )
    clock = FakeClock()
    scope = Scope.of("k-sim", operation=OPERATION)
    try:
        store.migrate()
        first = store.reserve(scope, "fp", now=clock(), lease=LEASE, ttl=TTL)
        assert isinstance(first, Acquired)
        clock.advance(LEASE - timedelta(microseconds=1))
        assert not isinstance(
            store.reserve(scope, "fp", now=clock(), lease=LEASE, ttl=TTL), Acquired
        )
        clock.advance(timedelta(microseconds=1))
        second = store.reserve(scope, "fp", now=clock(), lease=LEASE, ttl=TTL)
        assert isinstance(second, Acquired)
        assert second.token > first.token
        record = store.get(scope)
        assert record is not None
        assert (record.token, record.lease_expires_at) == (second.token, clock() + LEASE)
        store.complete(scope, second.token, b"done", now=clock(), ttl=TTL)
        clock.advance(timedelta(hours=2))
        third = store.reserve(scope, "other", now=clock(), lease=LEASE, ttl=TTL)
        assert isinstance(third, Acquired)
        assert third.token > second.token
        record = store.get(scope)
        assert record is not None
        assert (record.status, record.fingerprint, record.response, record.created_at) == (
            Status.IN_PROGRESS,
            "other",
            None,
            clock(),
        )
    finally:
        store.close()


# -- the app's connection ------------------------------------------------------------------


@pytest.fixture
def payments(mysql_database: Database) -> Database:
    """The test's MariaDB database with an empty payments table without a unique key."""
    mysql_database.create_business_table("idem_key TEXT NOT NULL, worker TEXT NOT NULL")
    return mysql_database


@pytest.fixture
def shop(payments: Database) -> Iterator[MySQLStore]:
    """The store on the test's database."""
    store = payments.store(pool_size=4)
    try:
        yield store
    finally:
        store.close()


def _insert(database: Database) -> str:
    return database.sql(f"INSERT INTO {database.business_table} (idem_key, worker) VALUES (?, ?)")


def pay(idem: Idempotency, key: str, conn: Any, database: Database, worker: str, **kw: Any) -> Any:
    """A guarded call whose work inserts a payment row; its result, or what it raised."""
    with idem.once(key, operation=OPERATION, conn=conn, **kw) as attempt:
        if not attempt.replayed:
            conn.execute(_insert(database), (key, worker))
            attempt.result = worker
    return attempt.result


def test_a_duplicate_waits_for_the_lock_timeout_then_is_in_progress(
    payments: Database, shop: MySQLStore
) -> None:
    """In transactional mode a duplicate waits on the first attempt's row lock; past the lock
    timeout it is told the key is in progress and runs nothing. Once the first commits, the
    duplicate replays its result."""
    key = new_key()
    idem = Idempotency(shop, Policy(lock_timeout=timedelta(milliseconds=300)))
    first = payments.connect(shop)
    second = payments.connect(shop)
    try:
        with ExitStack() as holding:
            attempt = holding.enter_context(idem.once(key, operation=OPERATION, conn=first))
            first.execute(_insert(payments), (key, "first"))
            attempt.result = "first"
            with pytest.raises(RequestInProgressError) as raised:
                pay(idem, key, second, payments, "second")
            assert raised.value.retry_after == pytest.approx(0.3)
        assert pay(idem, key, second, payments, "second") == "first"
    finally:
        first.close()
        second.close()
    assert payments.select(f"SELECT worker FROM {payments.business_table}") == [("first",)]


def transient(idem: Idempotency, key: str, conn: Any, database: Database) -> None:
    """A guarded call whose work inserts a row, then raises a transient error."""
    with idem.once(key, operation=OPERATION, conn=conn):
        conn.execute(_insert(database), (key, "raised"))
        raise RuntimeError("transient")


def test_autocommit_connection_is_wrapped_in_a_transaction(
    payments: Database, shop: MySQLStore
) -> None:
    """On an app connection in autocommit mode the guard begins a transaction: work that
    raises leaves neither its row nor a record, and the connection is in autocommit mode
    again afterwards."""
    key = new_key()
    idem = Idempotency(shop)
    conn = payments.connect(shop, autocommit=True)
    try:
        with pytest.raises(RuntimeError, match="transient"):
            transient(idem, key, conn, payments)
        assert conn.get_autocommit()
        assert payments.select(f"SELECT worker FROM {payments.business_table}") == []
        assert pay(idem, key, conn, payments, "retried") == "retried"
    finally:
        conn.close()
    assert payments.select(f"SELECT worker FROM {payments.business_table}") == [("retried",)]
    assert payments.select(f"SELECT state FROM {payments.records_table}") == [("completed",)]


def test_stale_holder_on_the_app_connection_rolls_its_write_back(
    payments: Database, shop: MySQLStore
) -> None:
    """In leased mode on the app's connection, a holder whose lease was taken over meanwhile
    gets FencedError at the end of its block and its business row is rolled back; the new
    holder's row and result stand."""
    key = new_key()
    clock = FakeClock()
    idem = Idempotency(shop, Policy(lease=timedelta(seconds=5), clock=clock))
    stale = payments.connect(shop)
    fresh = payments.connect(shop)
    try:
        holding = ExitStack()
        old = holding.enter_context(idem.once(key, operation=OPERATION, conn=stale, mode="leased"))
        stale.execute(_insert(payments), (key, "stale"))
        old.result = "stale"
        clock.advance(seconds=6)
        assert pay(idem, key, fresh, payments, "fresh", mode="leased") == "fresh"
        with pytest.raises(FencedError):
            holding.close()
    finally:
        stale.close()
        fresh.close()
    assert payments.select(f"SELECT worker FROM {payments.business_table}") == [("fresh",)]
    assert payments.select(f"SELECT state, token FROM {payments.records_table}") == [
        ("completed", 2)
    ]


def test_sqlalchemy_session_commits_work_and_record_together(
    payments: Database, shop: MySQLStore
) -> None:
    """Through a SQLAlchemy Session on mysql+pymysql the business row and the record commit
    together, and a retry replays without running the work."""
    key = new_key()
    idem = Idempotency(shop)
    engine = create_engine(payments.location.replace("mysql://", "mysql+pymysql://", 1))
    insert = f"INSERT INTO {payments.business_table} (idem_key, worker) VALUES (:key, :worker)"
    runs = 0
    try:
        for _ in range(2):
            with Session(engine) as session:
                with idem.once(key, operation=OPERATION, conn=session) as attempt:
                    if not attempt.replayed:
                        runs += 1
                        session.execute(text(insert), {"key": key, "worker": "orm"})
                        attempt.result = {"paid": key}
                assert attempt.result == {"paid": key}
    finally:
        engine.dispose()
    assert runs == 1
    assert payments.select(f"SELECT worker FROM {payments.business_table}") == [("orm",)]


# -- faults ----------------------------------------------------------------------------------


def test_unreachable_server_fails_closed() -> None:
    """With nothing listening, a guarded call raises StoreUnavailableError and runs nothing."""
    store = MySQLStore(UNREACHABLE)
    runs = 0
    try:
        with (
            pytest.raises(StoreUnavailableError),
            Idempotency(store).once("k-down", operation=OPERATION),
        ):
            runs += 1
        with pytest.raises(StoreUnavailableError):
            store.get(Scope.of("k-down", operation=OPERATION))
    finally:
        store.close()
    assert runs == 0


@pytest.mark.anyio
async def test_unreachable_server_fails_closed_async(anyio_backend: str) -> None:
    """The async store fails closed the same way."""
    store = AsyncMySQLStore(UNREACHABLE)
    runs = 0
    try:
        with pytest.raises(StoreUnavailableError):
            async with AsyncIdempotency(store).once("k-down", operation=OPERATION):
                runs += 1
    finally:
        await store.aclose()
    assert runs == 0


# -- round trips ---------------------------------------------------------------------------


@pytest.fixture
def round_trips(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """Requests sent per PyMySQL connection (each one a round trip), keyed by id()."""
    sent: Counter[int] = Counter()
    original = pymysql.connections.Connection._execute_command

    def counting(self: Any, command: int, sql: Any) -> Any:
        sent[id(self)] += 1
        return original(self, command, sql)

    monkeypatch.setattr(pymysql.connections.Connection, "_execute_command", counting)
    return sent


def test_each_leased_verb_is_one_round_trip(
    mysql_store: MySQLStore, round_trips: Counter[int]
) -> None:
    """On the store's own (warm) connection a fresh reservation, a completion, a replay and a
    takeover each cost one round trip."""
    clock = FakeClock()
    mysql_store.stats()  # opens the pooled connection
    steps = []
    scope = Scope.of("k-rt", operation=OPERATION)
    for step in ("fresh", "complete", "replay", "takeover"):
        round_trips.clear()
        if step == "complete":
            mysql_store.complete(scope, 1, b"ok", now=clock(), ttl=TTL)
        elif step == "takeover":
            other = Scope.of("k-rt-2", operation=OPERATION)
            mysql_store.reserve(other, "fp", now=clock(), lease=LEASE, ttl=TTL)
            clock.advance(LEASE)
            round_trips.clear()
            taken = mysql_store.reserve(other, "fp", now=clock(), lease=LEASE, ttl=TTL)
            assert isinstance(taken, Acquired)  # its token: the sequence's, so no value here
        else:
            mysql_store.reserve(scope, "fp", now=clock(), lease=LEASE, ttl=TTL)
        steps.append(sum(round_trips.values()))
    assert steps == [1, 1, 1, 1]


def test_a_guarded_transaction_costs_four_round_trips_more_than_the_bare_one(
    payments: Database, shop: MySQLStore, round_trips: Counter[int]
) -> None:
    """On the app's connection (autocommit off, PyMySQL's default) a first execution costs the
    reservation, the savepoint after it, the app's write, the savepoint's release (which
    shows the app did not end the guard's transaction itself), the completion and COMMIT; a
    replay the reservation and COMMIT. The transaction starts with the reservation, without
    a BEGIN of its own."""
    key = new_key()
    idem = Idempotency(shop)
    conn = payments.connect(shop)
    try:
        costs = []
        for _ in range(2):
            round_trips.clear()
            with idem.once(key, operation=OPERATION, conn=conn) as attempt:
                if not attempt.replayed:
                    conn.execute(_insert(payments), (key, "once"))
                    attempt.result = "ok"
            costs.append(round_trips[id(conn)])
        assert sum(round_trips.values()) == round_trips[id(conn)]  # nothing on the store's
    finally:
        conn.close()
    assert costs == [6, 2]


def test_a_held_reservation_delays_no_reservation_of_another_key(
    mysql_database: Database,
) -> None:
    """A takeover in transactional mode keeps its record's row lock until the app's
    transaction ends; fresh reservations of other keys made meanwhile do not wait on it,
    wherever their hashes fall beside its own. (With the hash a secondary unique index,
    InnoDB locked the gap before the held record as well, and they timed out as in progress:
    see decisions.md, "Purge at scale".)"""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    store = mysql_database.store(pool_size=2)
    conn = mysql_database.connect(store)
    try:
        held = Scope.of("held", operation=OPERATION)
        old = store.reserve(held, "fp", now=start, lease=timedelta(seconds=1), ttl=timedelta(0))
        assert isinstance(old, Acquired), old
        store.complete(held, old.token, b"old", now=start, ttl=timedelta(seconds=1))
        later = start + timedelta(hours=1)
        unit = store.bind(conn, mode="transactional")
        taken = unit.reserve(held, "fp", now=later, lease=timedelta(hours=1), ttl=timedelta(0))
        assert isinstance(taken, Acquired), taken
        for i in range(60):
            fresh = store.reserve(
                Scope.of(f"other-{i}", operation=OPERATION),
                "fp",
                now=later,
                lease=timedelta(hours=1),
                ttl=timedelta(0),
                lock_timeout=timedelta(seconds=1),
            )
            assert isinstance(fresh, Acquired), (i, fresh)
    finally:
        conn.rollback()
        conn.close()
        store.close()
