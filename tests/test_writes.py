"""idempo.writes on the real databases: create-once, the version guard and last-writer-wins
under duplicate and reordered deliveries, raced by threads and by processes, and a property
over random delivery orders; names that are not identifiers never reach SQL."""

from __future__ import annotations

import multiprocessing
import random
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from idempo import ConfigurationError, ConflictError, VersionConflictError
from idempo.writes import Upserted, apply_if_newer, create_once, update_if_version
from test_writes_child import Spec, connect, deliver, in_tx

THREADS = 8
PROCESSES = 3


EVENTS_DDL = (
    "CREATE TABLE {t} (k VARCHAR(64) NOT NULL PRIMARY KEY, payload VARCHAR(200) NOT NULL,"
    " note VARCHAR(200), version BIGINT NOT NULL)"
)


class Db:
    """One test's database: its spec, and tables made for the test and dropped after it."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.conn = connect(spec)
        self._made: list[str] = []

    def connect(self) -> Any:
        return connect(self.spec)

    def table(self, name: str, ddl: str = EVENTS_DDL) -> str:
        full = f"{self.spec.prefix}{name}"
        self.execute(ddl.format(t=full))
        self._made.append(full)
        return full

    def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        cursor = self.conn.cursor()
        try:
            cursor.execute(sql, () if params is None else params)
            rows = list(cursor.fetchall()) if cursor.description else []
        finally:
            cursor.close()
        self.conn.commit()
        return [tuple(row) for row in rows]

    def rows(self, table: str, order: str = "k") -> list[tuple[Any, ...]]:
        return self.execute(f"SELECT * FROM {table} ORDER BY {order}")

    def close(self) -> None:
        self.conn.rollback()
        for table in self._made:
            self.execute(f"DROP TABLE IF EXISTS {table}")
        self.conn.close()


DBS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mariadb", marks=pytest.mark.mysql, id="mariadb"),
]


def spec_for(request: pytest.FixtureRequest, kind: str) -> Spec:
    if kind == "sqlite":
        path = request.getfixturevalue("tmp_path") / "writes.db"
        return Spec("sqlite", str(path), "")
    if kind == "postgres":
        url = request.getfixturevalue("postgres_url")
        return Spec("postgres", url, request.getfixturevalue("pg_schema") + ".")
    url = request.getfixturevalue("mysql_url")
    name = request.getfixturevalue("mysql_db")
    return Spec("mariadb", url, name + ".", database=name)


@pytest.fixture(params=DBS)
def db(request: pytest.FixtureRequest) -> Iterator[Db]:
    database = Db(spec_for(request, request.param))
    try:
        yield database
    finally:
        database.close()


def event(key: str, version: int, note: str | None = None) -> dict[str, Any]:
    return {"k": key, "payload": f"{key}@{version}", "note": note, "version": version}


def final_state(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """The table after applying each distinct event once, in version order."""
    table: dict[str, dict[str, Any]] = {}
    for e in sorted(
        {(e["k"], e["version"]): e for e in events}.values(), key=lambda e: e["version"]
    ):
        table[e["k"]] = e
    return [(e["k"], e["payload"], e["note"], e["version"]) for _, e in sorted(table.items())]


# -- create_once ---------------------------------------------------------------------------


def test_create_once_returns_the_row_made_now_or_before(db: Db) -> None:
    t = db.table("users")
    conn = db.conn
    first = create_once(conn, t, event("a", 1), key="k")
    again = create_once(conn, t, {**event("a", 2), "note": "ignored"}, key="k")
    conn.commit()
    assert first == Upserted(row=event("a", 1), created=True)
    assert again == Upserted(row=event("a", 1), created=False)
    narrow = create_once(conn, t, event("a", 3), key="k", returning=["version"])
    assert narrow == Upserted(row={"version": 1}, created=False)
    conn.commit()
    assert db.rows(t) == [("a", "a@1", None, 1)]


def test_a_deterministic_upsert_overwrites_and_still_says_who_created(db: Db) -> None:
    t = db.table("profiles")
    conn = db.conn
    made = create_once(conn, t, event("a", 1, "n1"), key="k", update=["payload", "note"])
    moved = create_once(conn, t, event("a", 7, "n2"), key=["k"], update=("payload", "note"))
    conn.commit()
    assert made.created
    assert not moved.created
    # The update names payload and note only: the version stays the creator's.
    assert moved.row == {"k": "a", "payload": "a@7", "note": "n2", "version": 1}
    assert db.rows(t) == [("a", "a@7", "n2", 1)]


def test_create_once_in_a_rolled_back_transaction_leaves_nothing(db: Db) -> None:
    t = db.table("orders")
    assert create_once(db.conn, t, event("a", 1), key="k").created
    db.conn.rollback()  # the helper never commits: the caller's rollback undoes it
    assert db.rows(t) == []
    assert create_once(db.conn, t, event("a", 2), key="k").created


@pytest.mark.parametrize("upsert", [False, True], ids=["create-once", "upsert"])
def test_concurrent_create_once_has_one_creator_per_key(db: Db, upsert: bool) -> None:
    """Eight connections race to create the same five keys: each key is created exactly
    once, and every racer gets the creator's row back; or, upserting, its own write (the
    row as its transaction left it)."""
    update = ["payload"] if upsert else []
    t = db.table("accounts")
    keys = [f"k{i}" for i in range(5)]
    barrier = threading.Barrier(THREADS)
    results: list[tuple[int, str, Upserted]] = []
    lock = threading.Lock()
    problems: list[BaseException] = []

    def racer(n: int) -> None:
        conn = db.connect()
        try:
            barrier.wait()
            for key in keys:
                values = {"k": key, "payload": f"by {n}", "note": None, "version": n}
                got = in_tx(conn, lambda v=values: create_once(conn, t, v, key="k", update=update))
                with lock:
                    results.append((n, key, got))
        except BaseException as exc:
            problems.append(exc)
            barrier.abort()
        finally:
            conn.close()

    threads = [threading.Thread(target=racer, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems, problems
    stored = {row[0]: row for row in db.rows(t)}
    assert sorted(stored) == keys
    for key in keys:
        mine = [(n, got) for n, k, got in results if k == key]
        creators = [n for n, got in mine if got.created]
        assert len(mine) == THREADS, mine
        assert len(creators) == 1, mine
        if upsert:
            assert all(got.row["payload"] == f"by {n}" for n, got in mine), mine
            assert stored[key][1] in {f"by {n}" for n in range(THREADS)}
        else:
            assert {got.row["payload"] for _, got in mine} == {f"by {creators[0]}"}
            assert stored[key][1] == f"by {creators[0]}"
        assert stored[key][3] == creators[0]  # the version column is the creator's


# -- apply_if_newer ------------------------------------------------------------------------


def test_apply_if_newer_skips_duplicates_and_late_events(db: Db) -> None:
    t = db.table("stock")
    conn = db.conn
    deliveries = [event("a", 2, "x"), event("a", 1), event("a", 2), event("a", 3, "y")]
    applied = [apply_if_newer(conn, t, e, key="k") for e in deliveries]
    conn.commit()
    assert applied == [True, False, False, True]
    assert db.rows(t) == [("a", "a@3", "y", 3)]


def test_every_column_follows_the_version_on_mariadb_too(db: Db) -> None:
    """Two state columns and the version: a newer event moves all of them, an older one
    none. On MariaDB the version is assigned last, since ON DUPLICATE KEY UPDATE assigns
    left to right and a version assigned first makes every later IF() see the new one."""
    t = db.table("state")
    conn = db.conn
    assert apply_if_newer(conn, t, event("a", 1, "first"), key="k")
    assert apply_if_newer(conn, t, event("a", 5, "fifth"), key="k")
    assert not apply_if_newer(conn, t, event("a", 4, "fourth"), key="k")
    conn.commit()
    assert db.rows(t) == [("a", "a@5", "fifth", 5)]


@pytest.mark.mysql
def test_on_mariadb_assigning_the_version_first_would_lose_the_state(
    mysql_url: str, mysql_db: str
) -> None:
    """Why the order matters: the same upsert with the version assigned first keeps the
    old payload, so the row claims version 2 with version 1's state."""
    database = Db(Spec("mariadb", mysql_url, mysql_db + ".", database=mysql_db))
    try:
        t = database.table("order_matters")
        database.execute(f"INSERT INTO {t} VALUES ('a', 'a@1', NULL, 1)")
        database.execute(
            f"INSERT INTO {t} VALUES ('a', 'a@2', NULL, 2) ON DUPLICATE KEY UPDATE"
            " version = IF(VALUES(version) > version, VALUES(version), version),"
            " payload = IF(VALUES(version) > version, VALUES(payload), payload)"
        )
        assert database.rows(t) == [("a", "a@1", None, 2)]  # the bug the helper avoids
        database.execute(f"DELETE FROM {t}")
        database.execute(f"INSERT INTO {t} VALUES ('a', 'a@1', NULL, 1)")
        assert apply_if_newer(database.conn, t, event("a", 2), key="k")
        database.conn.commit()
        assert database.rows(t) == [("a", "a@2", None, 2)]
    finally:
        database.close()


def deliveries_for(seed: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Three keys with eight versions each, every event delivered three times, shuffled."""
    events = [event(f"k{k}", v, f"n{v}") for k in range(3) for v in range(1, 9)]
    deliveries = events * 3
    random.Random(seed).shuffle(deliveries)
    return events, deliveries


def test_threads_delivering_duplicates_out_of_order_end_in_version_order(db: Db) -> None:
    t = db.table("lww_threads")
    events, deliveries = deliveries_for(12)
    barrier = threading.Barrier(THREADS)
    applied: list[tuple[str, int]] = []
    problems: list[BaseException] = []

    def deliverer(n: int) -> None:
        conn = db.connect()
        try:
            barrier.wait()
            for e in deliveries[n::THREADS]:
                if in_tx(conn, lambda e=e: apply_if_newer(conn, t, e, key="k")):
                    applied.append((e["k"], e["version"]))
        except BaseException as exc:
            problems.append(exc)
            barrier.abort()
        finally:
            conn.close()

    threads = [threading.Thread(target=deliverer, args=(n,)) for n in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems, problems
    assert db.rows(t) == final_state(events)
    # Each distinct event is applied at most once, whatever the duplicates.
    assert len(applied) == len(set(applied))
    assert {k for k, _ in applied} == {"k0", "k1", "k2"}


@pytest.mark.slow
def test_processes_delivering_duplicates_out_of_order_end_in_version_order(db: Db) -> None:
    t = db.table("lww_processes")
    events, deliveries = deliveries_for(34)
    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(PROCESSES), context.Queue()
    processes = [
        context.Process(target=deliver, args=(db.spec, t, deliveries[n::PROCESSES], start, out))
        for n in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    try:
        answers = [out.get(timeout=90) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert all(kind == "ok" for kind, _ in answers), answers
    applied = [item for _, got in answers for item in got]
    assert len(applied) == len(set(applied))
    assert db.rows(t) == final_state(events)


# -- the hypothesis properties: any delivery order, duplicates included --------------------

KEYS = ["a", "b", "c"]
EVENTS = [event(k, v) for k in KEYS for v in range(1, 6)]


@pytest.fixture(params=DBS)
def shared(request: pytest.FixtureRequest) -> Iterator[tuple[Db, str, str]]:
    """One database with one table of each kind, reused across a property's examples."""
    database = Db(spec_for(request, request.param))
    try:
        yield database, database.table("prop_lww"), database.table("prop_once")
    finally:
        database.close()


def truncate(database: Db, table: str) -> None:
    database.execute(f"DELETE FROM {table}")


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(order=st.lists(st.sampled_from(EVENTS), min_size=1, max_size=25))
def test_last_writer_wins_over_any_delivery_order(
    shared: tuple[Db, str, str], order: list[dict[str, Any]]
) -> None:
    database, t, _ = shared
    truncate(database, t)
    conn = database.conn
    applied = [apply_if_newer(conn, t, e, key="k") for e in order]
    conn.commit()
    newest: dict[str, int] = {}
    expected = []
    for e in order:  # the model: applied exactly when newer than everything before it
        expected.append(e["version"] > newest.get(e["k"], 0))
        newest[e["k"]] = max(newest.get(e["k"], 0), e["version"])
    assert applied == expected
    assert database.rows(t) == final_state(order)


PROPOSALS = [(k, p) for k in KEYS for p in ("p", "q", "r")]


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(order=st.lists(st.sampled_from(PROPOSALS), min_size=1, max_size=25), upsert=st.booleans())
def test_create_once_over_any_delivery_order(
    shared: tuple[Db, str, str], order: list[tuple[str, str]], upsert: bool
) -> None:
    """The first proposal of a key creates it and is the row every later one gets; with
    ``update``, every later one overwrites it instead (the last proposal stays)."""
    database, _, t = shared
    truncate(database, t)
    conn = database.conn
    got = [
        create_once(
            conn,
            t,
            {"k": k, "payload": p, "version": 1},
            key="k",
            update=["payload"] if upsert else (),
        )
        for k, p in order
    ]
    conn.commit()
    seen: dict[str, str] = {}
    for (k, p), result in zip(order, got, strict=True):
        assert result.created == (k not in seen)
        if upsert or k not in seen:
            seen[k] = p
        assert result.row == {"k": k, "payload": seen[k], "version": 1}
    assert database.rows(t) == [(k, p, None, 1) for k, p in sorted(seen.items())]


# -- update_if_version ---------------------------------------------------------------------

COUNTERS_DDL = (
    "CREATE TABLE {t} (id INT NOT NULL PRIMARY KEY, n BIGINT NOT NULL, version BIGINT NOT NULL)"
)


def test_the_version_guard_returns_the_new_version_or_raises_and_changes_nothing(db: Db) -> None:
    t = db.table("counters", COUNTERS_DDL)
    db.execute(f"INSERT INTO {t} VALUES (1, 10, 3)")
    conn = db.conn
    assert update_if_version(conn, t, {"id": 1}, {"n": 11}, expected=3) == 4
    conn.commit()
    with pytest.raises(VersionConflictError) as stale:
        update_if_version(conn, t, {"id": 1}, {"n": 99}, expected=3)
    conn.commit()
    assert isinstance(stale.value, ConflictError)
    assert (stale.value.expected, stale.value.actual, stale.value.key) == (3, 4, {"id": 1})
    assert db.rows(t, "id") == [(1, 11, 4)]
    with pytest.raises(VersionConflictError) as gone:
        update_if_version(conn, t, {"id": 2}, {"n": 1}, expected=1)
    assert gone.value.actual is None
    conn.rollback()
    assert update_if_version(conn, t, {"id": 1}, {}, expected=4) == 5  # a bare bump
    conn.commit()
    assert db.rows(t, "id") == [(1, 11, 5)]


def test_version_guarded_increments_lose_no_update(db: Db) -> None:
    """Eight connections each add 1 five times, read-then-write with the guard and a retry:
    the counter ends at exactly 40. All eight read the first version before any writes, so
    seven of those first writes are refused (and retried on a fresh read)."""
    t = db.table("hits", COUNTERS_DDL)
    db.execute(f"INSERT INTO {t} VALUES (1, 0, 1)")
    barrier, all_read = threading.Barrier(THREADS), threading.Barrier(THREADS)
    conflicts: list[Any] = []
    problems: list[BaseException] = []

    def incrementer() -> None:
        conn = db.connect()
        try:
            barrier.wait()
            first = True
            for _ in range(5):
                while True:
                    cursor = conn.cursor()
                    cursor.execute(f"SELECT n, version FROM {t} WHERE id = 1")
                    n, version = cursor.fetchone()
                    cursor.close()
                    if first:
                        all_read.wait()  # nobody writes before every thread read version 1
                        first = False
                    try:
                        in_tx(
                            conn,
                            lambda n=n, version=version: update_if_version(
                                conn, t, {"id": 1}, {"n": n + 1}, expected=version
                            ),
                        )
                        break
                    except VersionConflictError as conflict:
                        conn.rollback()  # a new transaction reads the new version
                        conflicts.append(conflict.actual)
        except BaseException as exc:
            problems.append(exc)
            barrier.abort()
            all_read.abort()
        finally:
            conn.close()

    threads = [threading.Thread(target=incrementer) for _ in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not problems, problems
    assert db.rows(t, "id") == [(1, 40, 41)]
    assert len(conflicts) >= THREADS - 1, conflicts
    # Each refusal names a version past the one it expected (the latest committed one).
    assert all(isinstance(actual, int) and actual > 1 for actual in conflicts), conflicts


# -- names that are not identifiers ---------------------------------------------------------

BAD_NAMES = ["t; DROP TABLE canary", "1abc", "a b", 'x"y', "a.b.c", "", "t--", "é"]


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_bad_identifiers_are_refused_before_anything_runs(tmp_path: Path, bad: str) -> None:
    conn = sqlite3.connect(tmp_path / "names.db")
    conn.execute("CREATE TABLE canary (k TEXT PRIMARY KEY, version INT)")
    ran: list[str] = []
    conn.set_trace_callback(ran.append)
    good = {"k": "a", "version": 1}
    calls: list[Callable[[], Any]] = [
        lambda: create_once(conn, bad, good, key="k"),
        lambda: create_once(conn, "canary", {**good, bad: 1}, key="k"),
        lambda: create_once(conn, "canary", good, key="k", returning=[bad]),
        lambda: apply_if_newer(conn, bad, good, key="k"),
        lambda: apply_if_newer(conn, "canary", {**good, bad: 2}, key="k"),
        lambda: update_if_version(conn, bad, {"k": "a"}, {}, expected=1),
        lambda: update_if_version(conn, "canary", {bad: "a"}, {}, expected=1),
        lambda: update_if_version(conn, "canary", {"k": "a"}, {bad: 1}, expected=1),
        lambda: update_if_version(conn, "canary", {"k": "a"}, {}, expected=1, version=bad),
    ]
    for made in calls:
        with pytest.raises(ConfigurationError):
            made()
    assert ran == []
    conn.set_trace_callback(None)
    assert conn.execute("SELECT count(*) FROM canary").fetchone() == (0,)


def test_bad_identifiers_are_refused_on_every_database(db: Db) -> None:
    t = db.table("canary")
    for bad in BAD_NAMES:
        with pytest.raises(ConfigurationError):
            apply_if_newer(db.conn, f"{t} ; DROP TABLE {t}", event("a", 1), key="k")
        with pytest.raises(ConfigurationError):
            create_once(db.conn, t, {**event("a", 1), bad: 1}, key="k")
    db.conn.rollback()
    assert db.rows(t) == []


@pytest.mark.parametrize(
    ("call", "why"),
    [
        (lambda c: create_once(c, "t", {"k": 1}, key=[]), "natural key"),
        (lambda c: create_once(c, "t", {"v": 1}, key="k"), "no value"),
        (lambda c: create_once(c, "t", {"k": 1}, key="k", update=["k"]), "key never changes"),
        (lambda c: create_once(c, "t", {"k": 1}, key=["k", "k"]), "twice"),
        (lambda c: apply_if_newer(c, "t", {"k": 1}, key="k"), "no value"),
        (lambda c: apply_if_newer(c, "t", {"k": 1, "version": None}, key="k"), "never be newer"),
        (lambda c: apply_if_newer(c, "t", {"k": 1, "version": 1}, key="k", version="k"), "part of"),
        (lambda c: update_if_version(c, "t", {"k": 1}, {}, expected=True), "int version"),
        (
            lambda c: update_if_version(c, "t", {"k": 1}, {"version": 3}, expected=1),
            "moves the version",
        ),
        (lambda c: update_if_version(c, "t", {}, {"n": 3}, expected=1), "the row's key"),
        (
            lambda c: create_once(object(), "t", {"k": 1}, key="k"),
            "cannot run on a builtins.object",
        ),
    ],
)
def test_misuse_is_a_configuration_error(call: Callable[[Any], Any], why: str) -> None:
    conn = sqlite3.connect(":memory:")
    with pytest.raises(ConfigurationError, match=why):
        call(conn)


@pytest.mark.mysql
@pytest.mark.parametrize(
    ("update", "payload", "kept"),
    [((), "a@2", "a@1"), (("payload",), "a@1", "a@1"), (("payload",), "a@2", "a@2")],
    ids=["create-once", "upsert-unchanged", "upsert"],
)
def test_on_mariadb_an_old_snapshot_still_sees_the_row_it_collided_with(
    mysql_url: str, mysql_db: str, update: tuple[str, ...], payload: str, kept: str
) -> None:
    """Under MariaDB's REPEATABLE READ, a transaction whose snapshot predates another's
    committed row collides with it on insert; where it then writes nothing to that row, a
    plain SELECT would find nothing (its snapshot), so the helper reads the row with a
    locking read, which sees it."""
    database = Db(Spec("mariadb", mysql_url, mysql_db + ".", database=mysql_db))
    late = database.connect()
    try:
        t = database.table("snapshots")
        with late.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {t}")  # the snapshot starts here, empty
            assert cursor.fetchone() == (0,)
        assert create_once(database.conn, t, event("a", 1), key="k").created
        database.conn.commit()
        got = create_once(late, t, {**event("a", 2), "payload": payload}, key="k", update=update)
        assert not got.created
        assert got.row["version"] == 1
        assert got.row["payload"] == kept
        with late.cursor() as cursor:
            cursor.execute(f"SELECT count(*) FROM {t}")
            # What a plain read sees: the snapshot, unless this transaction wrote the row.
            assert cursor.fetchone() == ((1,) if payload != "a@1" and update else (0,))
        late.commit()
    finally:
        late.close()
        database.close()
