"""PostgreSQL's reservation function (issue 15): it reads the record first and writes only
where the reservation statement would, so that a replay costs the server a primary-key read.

Every answer of the function is held against the reservation statement's on the same record
(the statement still runs where the function is missing: a table migrated before it), races
of threads and processes at one key, a takeover, a purge, a stale holder, a duplicate that
commits between the function's read and its insert; the fallback, `idempo doctor` and
`migrate` on a table migrated before the function; and one statement per reservation.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo
from typer.testing import CliRunner

from idempo import Scope
from idempo._core.record import Acquired, InProgress, Mismatch, Replay, Reservation
from idempo.cli import app
from idempo.doctor import Level, diagnose
from idempo.errors import CorruptRecordError, FencedError, SchemaMissingError
from idempo.stores._sql.dialect import Statement
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from test_races import report_outcomes, run_processes

pytestmark = pytest.mark.postgres

runner = CliRunner()
NOW = datetime(2030, 1, 1, 12, tzinfo=UTC)
LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
OPERATION = "charge"
BARRIER_TIMEOUT = 60.0


def _open(url: str, table: str, *, function: bool = True, **options: Any) -> PostgresStore:
    """A migrated store on ``table``; without the reservation function if ``function`` is
    False (what a table migrated before the function has)."""
    store = PostgresStore(url, table=table, **options)
    store.migrate()
    if not function:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"DROP FUNCTION {store.dialect.signature}")
    return store


@contextmanager
def opened(url: str, table: str, *, function: bool = True, **options: Any) -> Iterator[Any]:
    store = _open(url, table, function=function, **options)
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def table(pg_schema: str) -> str:
    return f"{pg_schema}.idempo_records"


@pytest.fixture
def store(postgres_url: str, table: str) -> Iterator[PostgresStore]:
    """A migrated store that has found its function (its first reservation, the statement,
    asks: every reservation of a test then goes through the function)."""
    with opened(postgres_url, table, max_size=40) as store:
        reserve(store, "first")
        assert store.dialect.installed.present is True
        yield store


def reserve(store: Any, key: str, fingerprint: str = "fp", now: datetime | None = NOW) -> Any:
    return store.reserve(Scope.of(key, operation=OPERATION), fingerprint, now=now, lease=LEASE,
                         ttl=TTL)  # fmt: skip


# -- every answer is the reservation statement's ---------------------------------------------


@dataclass(frozen=True)
class Case:
    """A record as it stands before a reservation at `NOW` with fingerprint ``fp``, and
    what the reservation must answer."""

    name: str
    expect: type
    state: str | None = "completed"  # None: no record
    fingerprint: str = "fp"
    lease: timedelta | None = None  # the lease's end, from NOW
    expires: timedelta = timedelta(minutes=30)  # the retention's end, from NOW
    point: str | None = None


CASES = [
    Case("no record", Acquired, state=None),
    Case("completed", Replay),
    Case("failed", Replay, state="failed"),
    Case("completed, another request", Mismatch, fingerprint="other"),
    Case("in progress, lease live", InProgress, "in_progress", lease=timedelta(seconds=5)),
    Case(
        "in progress, lease live, another request",
        Mismatch,
        "in_progress",
        "other",
        lease=timedelta(seconds=5),
    ),
    Case("in progress, lease over", Acquired, "in_progress", lease=-timedelta(seconds=1)),
    Case("in progress, lease ends now", Acquired, "in_progress", lease=timedelta(0)),
    Case(
        "in progress, lease over, another request",
        Mismatch,
        "in_progress",
        "other",
        lease=-timedelta(seconds=1),
    ),
    Case(
        "in progress, lease over, steps done",
        Acquired,
        "in_progress",
        lease=-timedelta(seconds=1),
        point="step-2",
    ),
    Case("completed, retention over", Acquired, expires=timedelta(0)),
    Case(
        "completed, retention over, another request",
        Acquired,
        fingerprint="other",
        expires=-timedelta(seconds=1),
    ),
    Case(
        "in progress, lease live, retention over",
        Acquired,
        "in_progress",
        lease=timedelta(seconds=5),
        expires=-timedelta(seconds=1),
    ),
]


def seed(url: str, table: str, key: str, case: Case, token: int = 7) -> None:
    """Write ``case``'s record for ``key`` as a store would have left it."""
    if case.state is None:
        return
    lease = None if case.lease is None else NOW + case.lease
    response = None if case.state == "in_progress" else b"stored"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            f"INSERT INTO {table} VALUES ('', %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (OPERATION, key, case.fingerprint, case.state, token, lease, response,
             NOW - timedelta(minutes=1), NOW - timedelta(minutes=1), NOW + case.expires,
             case.point),
        )  # fmt: skip


def row(url: str, table: str, key: str) -> tuple[Any, ...] | None:
    """The record's columns but its token, and the row version (``xmin``: a write moves it)."""
    with psycopg.connect(url) as conn:
        return conn.execute(
            f"SELECT fingerprint, state, lease_expires_at, response, created_at, updated_at,"
            f" expires_at, recovery_point, xmin::text FROM {table} WHERE idem_key = %s",
            (key,),
        ).fetchone()


def answer(reservation: Reservation) -> tuple[Any, ...]:
    """What a reservation answered, with the token left out (tokens come from a sequence
    per table)."""
    if isinstance(reservation, Acquired):
        return ("acquired", reservation.recovery_point, reservation.taken_over)
    if isinstance(reservation, Replay | Mismatch):
        record = reservation.record
        return (type(reservation).__name__, record.fingerprint, record.status, record.response,
                record.lease_expires_at, record.expires_at, record.recovery_point)  # fmt: skip
    return ("in_progress", reservation)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_function_answers_as_the_reservation_statement_does(
    postgres_url: str, pg_schema: str, case: Case
) -> None:
    """On every kind of record, the function's answer and what it leaves stored are the
    reservation statement's (run where the function is missing), and the answer is the
    one the contract asks for; where nothing is to be written, nothing is."""
    with_fn, without = f"{pg_schema}.with_fn", f"{pg_schema}.without_fn"
    got = {}
    with (
        opened(postgres_url, with_fn) as fast,
        opened(postgres_url, without, function=False) as plain,
    ):
        for name, store in (("function", fast), ("statement", plain)):
            # The store's first reservation is the statement, which finds out whether the
            # function is there: the case's is the one after it.
            reserve(store, "first")
            assert store.dialect.installed.present is (name == "function")
            seed(postgres_url, store.dialect.table, "k", case)
            before = row(postgres_url, store.dialect.table, "k")
            reservation = reserve(store, "k")
            after = row(postgres_url, store.dialect.table, "k")
            assert isinstance(reservation, case.expect), (name, reservation)
            if not isinstance(reservation, Acquired):
                assert after == before, f"{name} wrote a record it only answered"
            got[name] = (answer(reservation), after and after[:-1])
            if isinstance(reservation, Acquired) and case.state is not None:
                assert reservation.token > 7  # the takeover's token grows
    assert got["function"] == got["statement"]


def test_a_corrupt_record_is_refused_by_both(postgres_url: str, pg_schema: str) -> None:
    """An in-progress record without a lease (no store writes one) is refused as corrupt
    through the function as through the statement, and nothing is run."""
    case = Case("corrupt", CorruptRecordError, "in_progress")
    for function in (True, False):
        table = f"{pg_schema}.records_{int(function)}"
        with opened(postgres_url, table, function=function) as store:
            reserve(store, "first")
            seed(postgres_url, table, "k", case)
            with pytest.raises(CorruptRecordError):
                reserve(store, "k")


# -- one statement per reservation, and the fallback -----------------------------------------


def recorded(gen: Generator[Any, Any, Any], seen: list[str]) -> Generator[Any, Any, Any]:
    """``gen``, noting the SQL of each statement it yields."""
    try:
        op = next(gen)
        while True:
            if isinstance(op, Statement):
                seen.append(op.sql)
            try:
                result = yield op
            except BaseException as exc:
                op = gen.throw(exc)
            else:
                op = gen.send(result)
    except StopIteration as stop:
        return stop.value


@contextmanager
def statements(store: PostgresStore) -> Iterator[list[str]]:
    """The SQL of each statement the store sends on its own connections in the block."""
    seen: list[str] = []
    run = store._run
    store._run = lambda gen: run(recorded(gen, seen))  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        store._run = run  # type: ignore[method-assign]


@pytest.mark.parametrize("function", [True, False], ids=["function", "fallback"])
def test_one_statement_per_reservation(postgres_url: str, table: str, function: bool) -> None:
    """A fresh call is one reservation statement and one settle; a replay one statement;
    with the function, or (a table migrated before it) the reservation statement, which the
    first reservation learns without a statement of its own."""
    with opened(postgres_url, table, function=function) as store, statements(store) as seen:
        first = reserve(store, "k", now=None)
        assert isinstance(first, Acquired)
        store.complete(Scope.of("k", operation=OPERATION), first.token, b"r", now=None, ttl=TTL)
        assert len(seen) == 2
        assert store.dialect.installed.present is function
        seen.clear()
        for _ in range(3):
            assert isinstance(reserve(store, "k", now=None), Replay)
        fresh = reserve(store, "k2", now=None)
        assert isinstance(fresh, Acquired)
        assert len(seen) == 4
        called = store.dialect.function in " ".join(seen)
        assert called is function


def test_a_table_migrated_before_the_function(postgres_url: str, table: str) -> None:
    """On a table migrated before the function, the store keeps working on the reservation
    statement; `idempo doctor` warns, naming `idempo migrate`, which makes the function and
    is harmless run again; a store then uses it."""
    url = f"{postgres_url}?table={table}"
    with opened(postgres_url, table, function=False) as store:
        first = reserve(store, "k")
        assert isinstance(first, Acquired)
        assert store.dialect.installed.present is False
        found = {f.check: f for f in diagnose(url).findings}
        assert found["reserve_function"].level is Level.WARN
        assert found["reserve_function"].value == "missing"
        assert "idempo migrate" in (found["reserve_function"].fix or "")
        for _ in range(2):
            assert runner.invoke(app, ["migrate", url]).exit_code == 0
        found = {f.check: f for f in diagnose(url).findings}
        assert found["reserve_function"].level is Level.PASS
        assert diagnose(url).exit_code == 0
        # The running store keeps what it learnt until its own migrate (or a restart).
        assert isinstance(reserve(store, "k"), InProgress)
        store.migrate()
        assert isinstance(reserve(store, "k"), InProgress)
        assert store.dialect.installed.present is True


def test_an_outdated_function_is_reported(postgres_url: str, table: str) -> None:
    """A function whose body is not this version's (another version of idempo made it) is a
    warning that names `idempo migrate`, which puts this version's back."""
    url = f"{postgres_url}?table={table}"
    with opened(postgres_url, table) as store, psycopg.connect(postgres_url) as conn:
        body = store.dialect.function_ddl.replace(
            "IF FOUND AND NOT stale", "IF FOUND AND NOT stale AND true"
        )
        conn.execute(body)
        conn.commit()
        found = {f.check: f for f in diagnose(url).findings}
        assert (found["reserve_function"].level, found["reserve_function"].value) == (
            Level.WARN,
            "outdated",
        )
        store.migrate()
        assert {f.check: f.level for f in diagnose(url).findings}["reserve_function"] is Level.PASS


def test_migrate_leaves_an_earlier_versions_function_for_its_processes(
    postgres_url: str, table: str
) -> None:
    """A table migrated by the version whose function took no lock timeout keeps that
    function (same name, seven parameters) when this version migrates it: processes of the
    earlier version still call it during a rolling deploy. This version's store finds and
    uses its own."""
    earlier = table + "_reserve(text, text, text, text, timestamptz, interval, interval)"
    with opened(postgres_url, table, function=False) as store:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(
                f"CREATE FUNCTION {earlier.replace(')', ', OUT acquired boolean)')}"
                " LANGUAGE sql AS 'SELECT NULL::boolean'"
            )
        found = {f.check: f for f in diagnose(f"{postgres_url}?table={table}").findings}
        assert (found["reserve_function"].level, found["reserve_function"].value) == (
            Level.WARN,
            "outdated",
        )
        assert "earlier version's" in found["reserve_function"].summary
        store.migrate()
        assert isinstance(reserve(store, "k"), Acquired)
        assert store.dialect.installed.present is True
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            found = conn.execute(
                "SELECT to_regprocedure(%s) IS NOT NULL, to_regprocedure(%s) IS NOT NULL",
                (earlier, store.dialect.signature),
            ).fetchone()
        assert found == (True, True)
        # doctor passes, and names what is left for the operator to drop.
        found = {f.check: f for f in diagnose(f"{postgres_url}?table={table}").findings}
        assert found["reserve_function"].level is Level.PASS
        assert f"earlier version's {earlier} is still there" in found["reserve_function"].summary
        # Once no process of the earlier version runs, dropping its function (as
        # docs/stores.md shows) leaves this version's working.
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP FUNCTION {earlier}")
        assert isinstance(reserve(store, "k"), InProgress)
        found = {f.check: f for f in diagnose(f"{postgres_url}?table={table}").findings}
        assert (found["reserve_function"].level, found["reserve_function"].summary) == (
            Level.PASS,
            f"the reservation function {store.dialect.function} is current",
        )


def test_migrations_at_once_all_succeed(postgres_url: str, table: str) -> None:
    """Stores migrating the same table at once (migrate on open, in each of an app's
    workers) all succeed: the function is made under a lock, not replaced twice at once."""
    with opened(postgres_url, table):
        pass
    stores = [PostgresStore(postgres_url, table=table, max_size=2) for _ in range(6)]
    barrier = threading.Barrier(len(stores))

    def migrate(store: PostgresStore) -> None:
        barrier.wait(timeout=BARRIER_TIMEOUT)
        for _ in range(5):
            store.migrate()

    try:
        with ThreadPoolExecutor(len(stores)) as pool:
            list(pool.map(migrate, stores))
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize("round_", range(3))
def test_first_migrations_at_once_of_a_new_table_all_succeed(
    postgres_url: str, pg_schema: str, round_: int
) -> None:
    """Stores migrating a table that does not exist yet, at once (each of an app's workers
    migrating on open): all succeed, and the table works. Without the migration lock around
    the whole of it, two ``CREATE TABLE IF NOT EXISTS`` both passed their check and one
    failed on the catalog's unique index, in every round."""
    table = f"{pg_schema}.fresh_{round_}"
    stores = [PostgresStore(postgres_url, table=table, max_size=1) for _ in range(6)]
    barrier = threading.Barrier(len(stores))

    def migrate(store: PostgresStore) -> None:
        barrier.wait(timeout=BARRIER_TIMEOUT)
        store.migrate()

    try:
        with ThreadPoolExecutor(len(stores)) as pool:
            list(pool.map(migrate, stores))
        assert isinstance(reserve(stores[0], "k"), Acquired)
        assert isinstance(reserve(stores[1], "k"), InProgress)
    finally:
        for store in stores:
            store.close()


def test_a_function_dropped_later_is_a_missing_schema_then_the_statement(
    postgres_url: str, table: str
) -> None:
    """The function dropped after the store found it: that reservation fails as a missing
    schema (naming `idempo migrate`), and the next one falls back to the statement."""
    with opened(postgres_url, table) as store:
        assert isinstance(reserve(store, "k"), Acquired)
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP FUNCTION {store.dialect.signature}")
        with pytest.raises(SchemaMissingError, match="idempo migrate"):
            reserve(store, "k")
        assert isinstance(reserve(store, "k"), InProgress)
        assert store.dialect.installed.present is False


@pytest.mark.anyio
@pytest.mark.parametrize("function", [True, False], ids=["function", "fallback"])
async def test_the_async_store_replays_through_the_function_or_the_statement(
    anyio_backend: str, postgres_url: str, table: str, function: bool
) -> None:
    """`AsyncPostgresStore` reserves, completes and replays the same way, on both schemas."""
    _open(postgres_url, table, function=function).close()
    store = AsyncPostgresStore(postgres_url, table=table)
    try:
        scope = Scope.of("k", operation=OPERATION)
        first = await store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(first, Acquired)
        await store.complete(scope, first.token, b"done", now=None, ttl=TTL)
        again = await store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(again, Replay)
        assert again.record.response == b"done"
        assert store.dialect.installed.present is function
        await store.migrate()
        assert isinstance(await store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL),
                          Replay)  # fmt: skip
        assert store.dialect.installed.present is True
    finally:
        await store.aclose()


# -- races -----------------------------------------------------------------------------------

THREADS = 24
KEYS = 40


def race(calls: list[Callable[[], Any]]) -> list[Any]:
    """Run ``calls`` released together on threads of their own; what each returned."""
    barrier = threading.Barrier(len(calls))

    def run(call: Callable[[], Any]) -> Any:
        barrier.wait(timeout=BARRIER_TIMEOUT)
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def settle_first(store: PostgresStore, key: str) -> Callable[[], Any]:
    """A caller that completes the key at once if it wins it."""

    def call() -> Any:
        got = reserve(store, key, now=None)
        if isinstance(got, Acquired):
            scope = Scope.of(key, operation=OPERATION)
            store.complete(scope, got.token, b"first", now=None, ttl=TTL)
        return got

    return call


def one_winner(outcomes: list[Any]) -> None:
    kinds = Counter(type(outcome).__name__ for outcome in outcomes)
    assert kinds["Acquired"] == 1, kinds
    assert set(kinds) <= {"Acquired", "InProgress", "Replay"}, kinds
    for outcome in outcomes:
        if isinstance(outcome, Replay):
            assert outcome.record.response == b"first"


def test_threads_racing_one_key_leave_one_winner(store: PostgresStore) -> None:
    """Threads released together at a fresh key: exactly one acquires it; every other one
    is told it is in progress or, once the first completed, gets its replay."""
    for i in range(KEYS):
        one_winner(race([settle_first(store, f"k{i}")] * THREADS))
    assert store.dialect.installed.present is True


def test_a_takeover_raced_by_duplicates_has_one_winner(
    postgres_url: str, table: str, store: PostgresStore
) -> None:
    """Duplicates released together at a record whose lease is over: exactly one takes it
    over, with a larger token; the rest find its new lease live."""
    for i in range(KEYS // 2):
        key = f"t{i}"
        seed(postgres_url, table, key, Case("over", Acquired, "in_progress",
                                            lease=-timedelta(seconds=1)))  # fmt: skip
        outcomes = race([lambda key=key: reserve(store, key)] * THREADS)
        winners = [o for o in outcomes if isinstance(o, Acquired)]
        assert len(winners) == 1, outcomes
        assert winners[0].taken_over
        assert winners[0].token > 7
        assert all(isinstance(o, InProgress) for o in outcomes if o is not winners[0])


def test_a_purge_racing_a_takeover_never_deletes_the_live_record(
    postgres_url: str, table: str, store: PostgresStore
) -> None:
    """A record past its retention, purged while duplicates take it over: whichever goes
    first, exactly one caller holds the key and its record is there afterwards."""
    for i in range(KEYS // 2):
        key = f"p{i}"
        seed(postgres_url, table, key, Case("expired", Acquired, expires=-timedelta(seconds=1)))
        calls: list[Callable[[], Any]] = [lambda key=key: reserve(store, key)] * (THREADS // 2)
        calls.append(lambda: store.purge(before=NOW, limit=1000))
        outcomes = race(calls)
        winners = [o for o in outcomes[:-1] if isinstance(o, Acquired)]
        assert len(winners) == 1, outcomes
        kept = store.get(Scope.of(key, operation=OPERATION))
        assert kept is not None
        assert kept.token == winners[0].token


def test_a_stale_holder_is_fenced_after_a_takeover(store: PostgresStore) -> None:
    """A holder whose lease ran out is fenced once the function let another take over: its
    completion is refused, and the new holder's answer is the one replayed."""
    scope = Scope.of("k", operation=OPERATION)
    old = reserve(store, "k")
    assert isinstance(old, Acquired)
    later = NOW + LEASE + timedelta(seconds=1)
    assert isinstance(reserve(store, "k", now=NOW + timedelta(seconds=1)), InProgress)
    new = reserve(store, "k", now=later)
    assert isinstance(new, Acquired)
    assert new.taken_over
    assert new.token > old.token
    with pytest.raises(FencedError):
        store.complete(scope, old.token, b"stale", now=later, ttl=TTL)
    store.complete(scope, new.token, b"new", now=later, ttl=TTL)
    replay = reserve(store, "k", now=later)
    assert isinstance(replay, Replay)
    assert replay.record.response == b"new"


def _backend_waits(url: str, application: str) -> Callable[[], bool]:
    def waiting() -> bool:
        with psycopg.connect(url) as conn:
            found = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
                " AND wait_event_type = 'Lock'",
                (application,),
            ).fetchone()
        return bool(found and found[0])

    return waiting


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait until ``condition`` holds (polled: it is the server's state), at most 30 s."""
    deadline = threading.Event()
    timer = threading.Timer(30, deadline.set)
    timer.start()
    try:
        while not condition():
            if deadline.wait(0.01):
                pytest.fail(f"never: {what}")
    finally:
        timer.cancel()


@pytest.mark.parametrize("commits", [True, False], ids=["commits", "rolls-back"])
def test_a_duplicate_between_the_read_and_the_insert(
    postgres_url: str, table: str, commits: bool
) -> None:
    """A duplicate's record inserted after the function's read found none, and not yet
    committed: the function's insert waits for it. Committed, the function answers it (the
    statement's fresh snapshot sees it: a replay, in the same statement); rolled back, the
    function's insert takes the key."""
    application = "idempo-read-insert"
    with opened(make_conninfo(postgres_url, application_name=application), table) as store:
        reserve(store, "warm-up")
        with psycopg.connect(postgres_url) as holder:
            seed_in(holder, table, "k")  # in the holder's open transaction
            with ThreadPoolExecutor(1) as pool, statements(store) as seen:
                pending = pool.submit(reserve, store, "k")
                _until(_backend_waits(postgres_url, application), "the insert waits")
                if commits:
                    holder.commit()
                else:
                    holder.rollback()
                got = pending.result(timeout=30)
        assert len(seen) == 1
    if commits:
        assert isinstance(got, Replay)
        assert got.record.response == b"stored"
    else:
        assert isinstance(got, Acquired)
        assert not got.taken_over


def seed_in(conn: psycopg.Connection[Any], table: str, key: str) -> None:
    conn.execute(
        f"INSERT INTO {table} VALUES ('', %s, %s, 'fp', 'completed', 3, NULL, 'stored',"
        " %s, %s, %s, NULL)",
        (OPERATION, key, NOW, NOW, NOW + TTL),
    )


def _process_main(
    url: str, table: str, index: int, keys: list[str], barrier: Any, results: Any
) -> None:
    """A spawned process (`test_races.run_processes`): its own store, one reservation per key
    at the barrier; what each got, and the replayed response."""

    def run(outcomes: list[Any]) -> None:
        with opened(url, table, max_size=2) as store:
            for key in keys:
                barrier.wait(timeout=BARRIER_TIMEOUT)
                got = settle_first(store, key)()
                response = got.record.response if isinstance(got, Replay) else None
                outcomes.append((key, type(got).__name__, response))
            assert store.dialect.installed.present is True

    report_outcomes(index, barrier, results, run)


@pytest.mark.slow
def test_processes_racing_one_key_leave_one_winner(postgres_url: str, table: str) -> None:
    """Spawned processes, each with its own store, released together at each key: exactly
    one acquires it, every other one is told it is in progress or gets its replay."""
    keys = [f"k{i}" for i in range(KEYS)]
    _open(postgres_url, table).close()  # made once: the children only migrate again
    by_key: dict[str, Counter[str]] = {key: Counter() for key in keys}
    for key, kind, response in run_processes(_process_main, (postgres_url, table), keys):
        by_key[key][kind] += 1
        assert response in (None, b"first")
    for key, kinds in by_key.items():
        assert kinds["Acquired"] == 1, (key, kinds)
        assert set(kinds) <= {"Acquired", "InProgress", "Replay"}, (key, kinds)
