"""Purge against takeovers and completions, racing on separate real connections.

SPEC §2 rule 10: purge never deletes a record inside its retention or under a live lease,
however it races. The bug this guards against lived between two transactions: PostgreSQL's
``DELETE ... WHERE pk IN (SELECT ... LIMIT)`` picked an expired row, waited on its lock while
a takeover rewrote it, and then re-checked only ``pk IN (...)`` on the new row version, so it
deleted the fresh record. Times are explicit (``now``/``before``), so which records are
expired is fixed; only the interleaving is left to the race.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pymysql
import pytest

from helpers import Database
from idempo import FencedError, Scope, Status
from idempo._core.record import Acquired
from idempo.stores.memory import MemoryStore
from idempo.stores.mysql import connect_options
from idempo.stores.postgres import PostgresStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)
SHORT = timedelta(seconds=1)
T1 = T0 + timedelta(hours=1)  # every record written at T0 is past its retention by then
LONG = timedelta(hours=1)
ROUNDS = 3
KEYS_PER_ROUND = 600
WORKERS = 6
PURGERS = 3

SQL_MEMORY_AND_REDIS = [
    pytest.param("memory", id="memory"),
    pytest.param("sqlite", id="sqlite"),
    pytest.param("pg", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
    pytest.param("redis_cluster", marks=pytest.mark.redis, id="redis-cluster"),
]


@pytest.fixture(params=SQL_MEMORY_AND_REDIS)
def store(request: pytest.FixtureRequest) -> Any:
    """The SQL stores, the memory store and the Redis store (on a server and on a cluster,
    where purge reads the records it may delete from its ``expiring`` set and re-checks each
    in a script), migrated and empty."""
    if request.param == "memory":
        return MemoryStore()
    return request.getfixturevalue(f"{request.param}_store")


def scope(key: str) -> Scope:
    return Scope.of(key, operation="charge", principal="alice")


def seed_expired(store: Any, keys: list[str]) -> None:
    """A record per key, completed at T0 with a short retention: expired at T1."""
    for key in keys:
        reservation = store.reserve(scope(key), "fp-old", now=T0, lease=SHORT, ttl=SHORT)
        assert isinstance(reservation, Acquired), reservation
        store.complete(scope(key), reservation.token, b"old", now=T0, ttl=SHORT)


class BackgroundPurge:
    """One ``purge(before=T1)`` in a thread of its own, on the store's own connections."""

    def __init__(self, store: Any) -> None:
        self.started, self.done = threading.Event(), threading.Event()
        self.purged: list[int] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._purge, args=(store,))
        self._thread.start()
        assert self.started.wait(10)

    def _purge(self, store: Any) -> None:
        self.started.set()
        try:
            self.purged.append(store.purge(before=T1))
        except BaseException as exc:  # the test asserts on it
            self.errors.append(exc)
        finally:
            self.done.set()

    def wait_blocked_or_done(self, database: Database) -> None:
        """Return once the purge waits on a row lock (PostgreSQL, MariaDB) or finished.

        SQLite shows no lock wait, but there the purge cannot get past BEGIN IMMEDIATE while
        another write transaction is open, so having started it is enough.
        """
        deadline = time.monotonic() + 10
        while not self.done.is_set():
            if database.kind == "sqlite" or lock_waits(database) > 0:
                return
            assert time.monotonic() < deadline, "the purge neither finished nor waited"
            time.sleep(0.005)  # polling the server's lock table, not hoping

    def join(self) -> int:
        self._thread.join(20)
        assert not self._thread.is_alive()
        assert self.errors == []
        return self.purged[0]


def lock_waits(database: Database) -> int:
    """How many of this test's statements wait on a lock (other tests share the server)."""
    if database.kind == "postgres":
        with psycopg.connect(database.location, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND query LIKE %s",
                (f"%DELETE FROM {database.schema}.%",),  # the purge is a CTE's delete
            ).fetchone()
    else:
        with pymysql.connect(**connect_options(database.location), autocommit=True) as conn:
            cursor = conn.cursor()
            cursor.execute(
                "SELECT count(*) FROM information_schema.innodb_trx"
                " WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE %s",
                (f"%{database.schema}.%",),
            )
            row = cursor.fetchone()
    return int(row[0]) if row else 0


def test_purge_spares_a_transactional_takeover_that_commits(database: Database) -> None:
    """A purge that starts while a transactional takeover of an expired record holds its row
    lock does not delete the record the takeover then commits as COMPLETED."""
    store = database.store(pool_size=4)
    conn = database.connect(store)
    try:
        seed_expired(store, ["k"])
        unit = store.bind(conn, mode="transactional")
        taken = unit.reserve(scope("k"), "fp-new", now=T1, lease=LONG, ttl=LONG)
        assert isinstance(taken, Acquired), taken

        purge = BackgroundPurge(store)
        purge.wait_blocked_or_done(database)
        unit.complete(scope("k"), taken.token, b"fresh", now=T1, ttl=LONG)

        assert purge.join() == 0
        record = store.get(scope("k"))
        assert record is not None, "purge deleted the record the takeover committed"
        assert (record.status, record.token, record.response) == (
            Status.COMPLETED,
            taken.token,
            b"fresh",
        )
    finally:
        conn.close()
        store.close()


@pytest.mark.parametrize(
    "database",
    [
        pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
        pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
    ],
    indirect=True,
)
def test_purge_held_up_by_a_lock_spares_takeovers_made_meanwhile(database: Database) -> None:
    """A purge waits on the row lock of a transactional takeover while many leased
    takeovers of the other expired records it picked commit on other connections: once it
    goes on, it deletes none of them, live reservations and fresh completions alike."""
    store = database.store(pool_size=WORKERS + 2)
    conn = database.connect(store)
    keys = [f"k-{i}" for i in range(120)]
    try:
        # The first record in any order the purge may take: oldest, and written first.
        seed_expired(store, ["first"])
        for key in keys:
            store.reserve(scope(key), "fp-old", now=T0, lease=SHORT, ttl=SHORT)
        unit = store.bind(conn, mode="transactional")
        first = unit.reserve(scope("first"), "fp-new", now=T1, lease=LONG, ttl=LONG)
        assert isinstance(first, Acquired), first

        purge = BackgroundPurge(store)
        purge.wait_blocked_or_done(database)
        with ThreadPoolExecutor(WORKERS) as pool:
            chunks = [keys[w::WORKERS] for w in range(WORKERS)]
            held = [h for chunk in pool.map(_take_over, [store] * WORKERS, chunks) for h in chunk]
        unit.complete(scope("first"), first.token, b"fresh", now=T1, ttl=LONG)
        purge.join()

        assert store.get(scope("first")) is not None
        assert lost_records(store, held) == []
    finally:
        conn.close()
        store.close()


def _take_over(
    store: Any, keys: list[str], started: threading.Event | None = None
) -> list[tuple[str, int, bool | None]]:
    """Take every key over at T1, last key first; complete every other one at once, hold
    the rest. Returns ``(key, token, completed)`` per key; ``completed`` is None where the
    completion was refused (the reservation was gone already)."""
    held: list[tuple[str, int, bool | None]] = []
    for i, key in enumerate(reversed(keys)):
        reservation = store.reserve(scope(key), "fp-new", now=T1, lease=LONG, ttl=LONG)
        if started is not None:
            started.set()
        assert isinstance(reservation, Acquired), (key, reservation)
        completed: bool | None = i % 2 == 0
        if completed:
            try:
                store.complete(scope(key), reservation.token, key.encode(), now=T1, ttl=LONG)
            except FencedError:
                completed = None
        held.append((key, reservation.token, completed))
    return held


def lost_records(
    store: Any, held: list[tuple[str, int, bool | None]]
) -> list[tuple[str, str, Any]]:
    """The takeovers whose record is gone: a completion no longer stored, or a holder whose
    completion is refused (fencing: its reservation was deleted)."""
    lost: list[tuple[str, str, Any]] = []
    for key, token, completed in held:
        if completed is None:
            lost.append((key, "reservation, before its completion", None))
        elif completed:
            record = store.get(scope(key))
            if record is None or (record.status, record.token) != (Status.COMPLETED, token):
                lost.append((key, "completion", record))
        else:
            try:
                store.complete(scope(key), token, b"late", now=T1, ttl=LONG)
            except Exception as exc:  # reported with the rest
                lost.append((key, "reservation", exc))
    return lost


def _purge_until(
    store: Any, started: threading.Event, stop: threading.Event, limit: int = KEYS_PER_ROUND
) -> int:
    # The first purge starts while the takeovers run, so they rewrite rows it picked.
    assert started.wait(10)
    purged = 0
    while not stop.is_set():
        # One batch may hold every expired record: deleting them takes long enough for
        # the takeovers, which start from the other end, to rewrite rows it picked.
        purged += store.purge(before=T1, limit=limit)
    return purged


def race(
    store: Any, keys: list[str], limits: list[int]
) -> tuple[list[tuple[str, int, bool | None]], int]:
    """Leased takeovers of ``keys`` in WORKERS threads against a purger per batch size in
    ``limits``, all on the store's own connections: what the takeovers hold (see
    `_take_over`) and how many records the purges deleted."""
    started, stop = threading.Event(), threading.Event()
    chunks = [keys[w::WORKERS] for w in range(WORKERS)]
    with ThreadPoolExecutor(WORKERS + len(limits)) as pool:
        purgers = [pool.submit(_purge_until, store, started, stop, limit) for limit in limits]
        try:
            workers = [pool.submit(_take_over, store, chunk, started) for chunk in chunks]
            held = [h for w in workers for h in w.result(60)]
        finally:
            stop.set()
        purged = sum(p.result(60) for p in purgers)
    return held, purged


@pytest.mark.slow
def test_purge_never_deletes_live_reservations_or_fresh_completions(store: Any) -> None:
    """Leased takeovers of expired records race repeated purges on the store's own
    connections: afterwards every holder still holds its key (its completion is accepted)
    and every fresh completion is still stored; only the expired records were purged."""
    for round_ in range(ROUNDS):
        keys = [f"r{round_}-{i}" for i in range(KEYS_PER_ROUND)]
        for key in keys:  # abandoned reservations, past lease and retention at T1
            store.reserve(scope(key), "fp-old", now=T0, lease=SHORT, ttl=SHORT)
        held, purged = race(store, keys, [KEYS_PER_ROUND] * PURGERS)
        lost = lost_records(store, held)
        assert lost == [], f"round {round_}: purge deleted {len(lost)} live records: {lost[:5]}"
        assert purged <= KEYS_PER_ROUND


@pytest.mark.postgres
@pytest.mark.parametrize("plan", ["force_custom_plan", "force_generic_plan"])
def test_postgres_purge_deletes_exactly_the_expired_records_on_either_plan(
    postgres_url: str, pg_schema: str, plan: str
) -> None:
    """The purge statement is prepared, so after a few runs PostgreSQL may switch to its
    generic plan: on either plan, batch after batch, purge deletes every expired record and
    nothing else (not a record inside its retention, not one under a live lease)."""
    url = f"{postgres_url}?options=-c%20plan_cache_mode%3D{plan}"
    store = PostgresStore(url, table=f"{pg_schema}.idempo_records", max_size=1)
    try:
        store.migrate()
        expired = [f"old-{i}" for i in range(23)]
        seed_expired(store, expired)
        for key in ("kept-1", "kept-2"):  # completed at T1, kept an hour
            taken = store.reserve(scope(key), "fp", now=T1, lease=SHORT, ttl=LONG)
            assert isinstance(taken, Acquired), taken
            store.complete(scope(key), taken.token, b"kept", now=T1, ttl=LONG)
        # Reserved at T0 with a lease running past T1: retention over, lease live.
        leased = store.reserve(scope("leased"), "fp", now=T0, lease=LONG * 2, ttl=SHORT)
        assert isinstance(leased, Acquired), leased

        batches = []
        while (deleted := store.purge(before=T1, limit=4)) > 0:
            batches.append(deleted)
        assert batches == [4, 4, 4, 4, 4, 3]  # more runs than PostgreSQL's 5 custom plans
        assert all(store.get(scope(key)) is None for key in expired)
        for key in ("kept-1", "kept-2", "leased"):
            assert store.get(scope(key)) is not None, key
        store.complete(scope("leased"), leased.token, b"done", now=T1, ttl=LONG)
    finally:
        store.close()


def test_purge_batches_until_a_short_one_leave_nothing_expired_behind(store: Any) -> None:
    """Batches pick up where the last full one ended, oldest expiry first; a record that
    expired behind that point (made earlier with a shorter retention) is still purged
    before a batch comes up short, so a purge run leaves nothing purgeable."""
    seed_expired(store, [f"a{i}" for i in range(4)])
    assert store.purge(before=T1, limit=2) == 2
    early = T0 - timedelta(minutes=30)  # expired half an hour before the others
    taken = store.reserve(scope("early"), "fp", now=early, lease=SHORT, ttl=SHORT)
    assert isinstance(taken, Acquired), taken
    store.complete(scope("early"), taken.token, b"early", now=early, ttl=SHORT)

    batches = []
    while (deleted := store.purge(before=T1, limit=2)) > 0:
        batches.append(deleted)
        if deleted < 2:
            break
    assert sum(batches) == 3
    assert all(store.get(scope(key)) is None for key in ["early", "a0", "a1", "a2", "a3"])
