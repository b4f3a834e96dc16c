"""idempo purge's loop (idempo._purge): batches sized by a time budget, on an injected clock,
and on PostgreSQL the asynchronous commit of a purge batch, which must end with it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from idempo import Scope
from idempo._core.record import Acquired
from idempo._purge import FIRST, MOST, SPEEDS, BatchSizer, batch_seconds, purge_records
from idempo.errors import ConfigurationError
from idempo.stores.postgres import PostgresStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Timed:
    """A store of ``records`` expired records that deletes them at ``speed`` records/s (or
    at the speeds given batch by batch) on ``clock``; it logs the limit of every call."""

    purge_batch_time: float | None = None

    def __init__(self, records: int, clock: Clock, speeds: list[float]) -> None:
        self.left = records
        self.clock = clock
        self.speeds = speeds
        self.limits: list[int] = []

    def purge(self, *, before: datetime | None, limit: int) -> int:
        self.limits.append(limit)
        deleted = min(limit, self.left)
        self.left -= deleted
        speed = self.speeds[min(len(self.limits), len(self.speeds)) - 1]
        self.clock.now += deleted / speed
        return deleted


def test_batches_take_about_the_time_budget() -> None:
    """The first batch is FIRST records; each next one is the budget times the best speed
    measured, so at 200,000 records/s a 1 ms budget asks for 200 records a batch. The rest
    after each full batch is ``rest`` times its time, on the injected clock."""
    clock = Clock()
    store = Timed(10_000, clock, [200_000.0])
    rests: list[float] = []
    total = purge_records(store, batch_time=0.001, rest=2.0, sleep=rests.append, clock=clock)
    assert total == 10_000
    assert store.left == 0
    assert store.limits[0] == FIRST
    assert set(store.limits[1:-1]) == {200}
    assert store.limits[-1] >= 200  # the last call comes up short (or finds nothing)
    assert rests[0] == pytest.approx(2 * FIRST / 200_000)
    assert rests[1:] == pytest.approx([2 * 0.001] * (len(rests) - 1))


def test_batch_size_follows_the_best_of_the_last_speeds() -> None:
    """A slow batch (the machine busy) does not shrink the next one: the best of the last
    SPEEDS speeds sizes it. Only a purge that stays slow for SPEEDS batches gets smaller
    batches; a faster one gets larger batches at once."""
    sizer = BatchSizer(0.01)
    sizer.measured(FIRST, FIRST / 10_000)  # 10,000 records/s: 100 records in 10 ms
    assert sizer.size == 100
    sizer.measured(100, 100 / 1_000)  # one batch at a tenth of that
    assert sizer.size == 100
    for _ in range(SPEEDS - 2):
        sizer.measured(100, 100 / 1_000)
    assert sizer.size == 100  # the fast one is still among the last SPEEDS
    sizer.measured(100, 100 / 1_000)
    assert sizer.size == 10  # now it is not: 1,000 records/s x 10 ms
    sizer.measured(10, 10 / 50_000)
    assert sizer.size == 500


def test_batch_size_is_bounded() -> None:
    """At least one record, at most ``most`` (MOST by default, ``batch`` in purge_records),
    and a batch too fast for the clock doubles the next one up to that bound."""
    sizer = BatchSizer(0.001, most=300)
    sizer.measured(FIRST, 0.0)
    assert sizer.size == 200
    sizer.measured(200, 0.0)
    assert sizer.size == 300
    sizer.measured(300, 0.001)  # 300,000 records/s: 300 in 1 ms, the bound anyway
    sizer.measured(300, 100.0)
    assert sizer.size == 300  # the fast measure is still among the last SPEEDS
    slow = BatchSizer(0.001, most=MOST)
    slow.measured(FIRST, 10.0)  # 10 records/s: still one record a batch, not none
    assert slow.size == 1
    fast = BatchSizer(1.0)
    fast.measured(FIRST, FIRST / 1e9)
    assert fast.size == MOST
    clock = Clock()
    store = Timed(5_000, clock, [1e9])
    assert purge_records(store, batch=250, batch_time=1.0, rest=0, clock=clock) == 5_000
    assert max(store.limits) == 250


def test_the_store_declares_the_default_budget_and_zero_turns_it_off() -> None:
    """No batch_time: the store's ``purge_batch_time`` if it has one, else fixed batches of
    1000 (or ``batch``); ``batch_time=0`` asks for fixed batches whatever the store says."""
    clock = Clock()
    store = Timed(3_000, clock, [100_000.0])
    store.purge_batch_time = 0.002
    purge_records(store, rest=0, clock=clock)
    assert store.limits[:3] == [FIRST, 200, 200]
    for kwargs, limit in (({"batch_time": 0}, 1000), ({"batch_time": 0, "batch": 7}, 7)):
        fixed = Timed(3_000, clock, [100_000.0])
        fixed.purge_batch_time = 0.002
        purge_records(fixed, rest=0, clock=clock, **kwargs)
        assert set(fixed.limits) == {limit}
    plain = Timed(3_000, clock, [100_000.0])
    purge_records(plain, rest=0, clock=clock)
    assert set(plain.limits) == {1000}


def test_batch_seconds_reads_seconds_and_milliseconds() -> None:
    assert batch_seconds("0.005") == 0.005
    assert batch_seconds(" 5ms ") == pytest.approx(0.005)
    assert batch_seconds("2S") == 2.0
    assert batch_seconds("0") == 0.0
    for bad in ("", "ms", "fast", "-1", "-2ms", "nan", "inf", "1h", "1e999"):
        with pytest.raises(ConfigurationError, match="--batch-time"):
            batch_seconds(bad)


# --- PostgreSQL: the purge's asynchronous commit stays in its own transaction ----------


@pytest.mark.postgres
def test_postgres_purge_commits_asynchronously_and_the_setting_ends_with_it(
    postgres_url: str, pg_schema: str
) -> None:
    """A trigger records the synchronous_commit each write on the table ran with, and on
    which connection: the purge's delete ran with it off; the next statements on that same
    connection (the store's next verb, a plain query) run with it on again."""
    table = f"{pg_schema}.idempo_records"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {pg_schema}.seen (op text, sync text, pid int)")
    # One connection, the app's pool: every verb of the store runs on it.
    pool: ConnectionPool[Any] = ConnectionPool(
        postgres_url, min_size=1, max_size=1, kwargs={"autocommit": True}, open=True
    )
    store = PostgresStore(pool, table=table)
    try:
        store.migrate()
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(
                f"CREATE FUNCTION {pg_schema}.note() RETURNS trigger LANGUAGE plpgsql AS $$"
                f" BEGIN INSERT INTO {pg_schema}.seen VALUES (TG_OP,"
                " current_setting('synchronous_commit'), pg_backend_pid()); RETURN NULL; END $$"
            )
            conn.execute(
                f"CREATE TRIGGER note AFTER INSERT OR UPDATE OR DELETE ON {table}"
                f" FOR EACH ROW EXECUTE FUNCTION {pg_schema}.note()"
            )
        t0 = datetime(2026, 1, 1, tzinfo=UTC)
        short = timedelta(seconds=1)
        for key in ("a", "b", "c"):
            scope = Scope.of(key, operation="op")
            got = store.reserve(scope, "fp", now=t0, lease=short, ttl=short)
            assert isinstance(got, Acquired)
            store.complete(scope, got.token, b"ok", now=t0, ttl=short)
        assert store.purge(before=t0 + timedelta(hours=1), limit=2) == 2
        fresh = store.reserve(Scope.of("d", operation="op"), "fp", now=None, lease=short, ttl=short)
        assert isinstance(fresh, Acquired)
        with pool.connection() as conn:
            shown = conn.execute("SHOW synchronous_commit").fetchone()
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()
        assert shown == ("on",)
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            seen = conn.execute(f"SELECT op, sync, pid FROM {pg_schema}.seen").fetchall()
        assert pid is not None
        assert {row[2] for row in seen} == {pid[0]}  # one connection throughout
        assert [(op, sync) for op, sync, _ in seen if op == "DELETE"] == [("DELETE", "off")] * 2
        assert all(sync == "on" for op, sync, _ in seen if op != "DELETE"), seen
        assert seen[-1][:2] == ("INSERT", "on")  # the reservation after the purge
    finally:
        store.close()
        pool.close()
