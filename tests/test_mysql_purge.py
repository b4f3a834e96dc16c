"""MariaDB's purge through a backlog: in primary key order, never waiting on a row lock.

When at least a batch and a quarter of the table is expired, a sweep walks the table in
``scope_hash`` order with one ``DELETE ... ORDER BY scope_hash LIMIT n`` per batch that waits
on no lock; a row another transaction holds fails it, and the batch is then picked skipping
held rows. These tests pin which order is chosen (by which records a batch takes) and that
neither form deletes a live record, racing takeovers on separate real connections. Times are
explicit, so which records are expired is fixed; only the interleaving is left to the race.
"""

from __future__ import annotations

from datetime import timedelta

import pymysql
import pytest

from helpers import Database
from idempo import Status
from idempo._core.record import Acquired
from idempo.stores._sql.mysql import scope_hash
from idempo.stores.mysql import MySQLStore, connect_options
from test_purge_races import LONG, SHORT, T0, T1, lost_records, race, scope, seed_expired

pytestmark = pytest.mark.mysql


def by_hash(keys: list[str]) -> list[str]:
    return sorted(keys, key=lambda key: scope_hash(scope(key)))


def seed_expiring_in_turn(store: MySQLStore, keys: list[str]) -> None:
    """A record per key, completed before T1 and expired by then, the first key's oldest."""
    for i, key in enumerate(keys):
        at = T0 - timedelta(minutes=len(keys) - i)
        taken = store.reserve(scope(key), "fp-old", now=at, lease=SHORT, ttl=SHORT)
        assert isinstance(taken, Acquired), taken
        store.complete(scope(key), taken.token, b"old", now=at, ttl=SHORT)


def analyze(database: Database) -> None:
    """Make InnoDB's row estimate exact (it is what tells a backlog from a routine purge)."""
    with pymysql.connect(**connect_options(database.location), autocommit=True) as conn:
        cursor = conn.cursor()
        cursor.execute(f"ANALYZE TABLE {database.records_table}")
        cursor.fetchall()


def present(store: MySQLStore, keys: list[str]) -> list[str]:
    return [key for key in keys if store.get(scope(key)) is not None]


def keep_live_records(store: MySQLStore) -> Acquired:
    """Two records completed at T1 and kept an hour, and one whose retention is over at T1
    but whose lease is still live; returns that lease."""
    for key in ("kept-1", "kept-2"):
        taken = store.reserve(scope(key), "fp", now=T1, lease=SHORT, ttl=LONG)
        assert isinstance(taken, Acquired), taken
        store.complete(scope(key), taken.token, b"kept", now=T1, ttl=LONG)
    leased = store.reserve(scope("leased"), "fp", now=T0, lease=LONG * 2, ttl=SHORT)
    assert isinstance(leased, Acquired), leased
    return leased


def test_a_backlog_is_purged_in_key_order_sparing_every_live_record(
    mysql_database: Database,
) -> None:
    """With most of the table expired, batches after the sweep's first take records in
    scope_hash order (not the oldest expiry first) and, to the end, every expired record
    and no live one."""
    store = mysql_database.store()
    try:
        expired = [f"old-{i}" for i in range(13)]
        seed_expiring_in_turn(store, expired)
        leased = keep_live_records(store)
        analyze(mysql_database)

        assert store.purge(before=T1, limit=3) == 3  # the sweep's first: oldest first
        assert present(store, expired[:3]) == []
        assert store.purge(before=T1, limit=3) == 3  # then in key order
        assert present(store, by_hash(expired[3:])[:3]) == []
        batches = [3, 3]
        while (deleted := store.purge(before=T1, limit=3)) > 0:
            batches.append(deleted)
            if deleted < 3:
                break
        assert batches == [3, 3, 3, 3, 1]
        assert present(store, expired) == []
        assert present(store, ["kept-1", "kept-2", "leased"]) == ["kept-1", "kept-2", "leased"]
        store.complete(scope("leased"), leased.token, b"done", now=T1, ttl=LONG)
    finally:
        store.close()


def test_a_routine_purge_takes_the_oldest_expiry_first(mysql_database: Database) -> None:
    """With a few records expired among many live ones, batches take the oldest expiries,
    as before: a walk in key order would read the whole table for them."""
    store = mysql_database.store()
    try:
        expired = by_hash([f"old-{i}" for i in range(6)])[::-1]  # oldest: the largest hash
        seed_expiring_in_turn(store, expired)
        for i in range(30):
            taken = store.reserve(scope(f"live-{i}"), "fp", now=T1, lease=SHORT, ttl=LONG)
            assert isinstance(taken, Acquired), taken
        analyze(mysql_database)

        assert store.purge(before=T1, limit=2) == 2
        assert store.purge(before=T1, limit=2) == 2
        assert present(store, expired[:4]) == []
        assert present(store, expired[4:]) == expired[4:]
    finally:
        store.close()


@pytest.mark.anyio
@pytest.mark.parametrize("face", ["sync", "async"])
async def test_a_key_order_purge_skips_a_held_takeover_without_waiting(
    mysql_database: Database, anyio_backend: str, face: str
) -> None:
    """A transactional takeover holds the row lock of one expired record on the app's own
    connection: purges in key order on the store's connections (sync, or async on aiomysql)
    go past it without waiting (the batch that meets it is picked again skipping it),
    delete every other expired record, and the record the takeover then commits is
    stored."""
    store = mysql_database.store(pool_size=4)
    purger = mysql_database.async_store() if face == "async" else None
    conn = mysql_database.connect(store)

    async def purge() -> int:
        if purger is None:
            return int(store.purge(before=T1, limit=3))
        return int(await purger.purge(before=T1, limit=3))

    try:
        keys = [f"k-{i}" for i in range(12)]
        seed_expired(store, keys)
        analyze(mysql_database)
        held = by_hash(keys)[4]  # met by the first batch in key order, the second
        unit = store.bind(conn, mode="transactional")
        taken = unit.reserve(scope(held), "fp-new", now=T1, lease=LONG, ttl=LONG)
        assert isinstance(taken, Acquired), taken

        purged = 0
        while (deleted := await purge()) > 0:
            purged += deleted
            if deleted < 3:
                break
        assert purged == 11
        unit.complete(scope(held), taken.token, b"fresh", now=T1, ttl=LONG)

        record = store.get(scope(held))
        assert record is not None, "purge deleted the record the takeover committed"
        assert (record.status, record.token, record.response) == (
            Status.COMPLETED,
            taken.token,
            b"fresh",
        )
        assert present(store, keys) == [held]
    finally:
        conn.close()
        if purger is not None:
            await purger.aclose()
        store.close()


@pytest.mark.slow
def test_key_order_purges_never_delete_takeovers_racing_them(mysql_database: Database) -> None:
    """Leased takeovers of expired records race purges in small batches (key order: the
    whole table is expired) on separate connections: every holder still holds its key and
    every fresh completion is still stored."""
    store = mysql_database.store(pool_size=10)
    try:
        for round_ in range(3):
            keys = [f"r{round_}-{i}" for i in range(400)]
            seed_expired(store, keys)
            analyze(mysql_database)
            held, purged = race(store, keys, [7, 25])
            lost = lost_records(store, held)
            assert lost == [], f"round {round_}: purge deleted {len(lost)} live records: {lost[:5]}"
            assert purged <= len(keys)
    finally:
        store.close()
