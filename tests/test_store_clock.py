"""Whose clock decides (SPEC §2 rule 9): with ``now=None`` PostgreSQL and MariaDB decide on
the server's clock, SQLite, memory and the cache tier on the host's; an injected time wins.

A host whose clock jumped is simulated by moving `idempo.stores._clock.host_now` (the one
host clock the stores read) and `idempo.policy.utcnow`. The real server and this host share
a clock here, so "the server's clock" is the real time and the moved host clock is a day
ahead of it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from helpers import Database
from idempo import Scope, Status
from idempo._core.record import Acquired, InProgress, Replay
from idempo.stores import _clock
from idempo.stores.cache import CachedStore
from idempo.stores.memory import MemoryStore

LEASE = timedelta(seconds=30)
TTL = timedelta(hours=1)
AHEAD = timedelta(days=1)
# How far apart "now" on this host and on the server may be read in one test.
SLACK = timedelta(seconds=10)

SERVER_CLOCK = [
    pytest.param("pg", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
]


def scope(key: str = "k") -> Scope:
    return Scope.of(key, operation="charge", principal="alice")


@pytest.fixture
def host_ahead(monkeypatch: pytest.MonkeyPatch) -> datetime:
    """This host's clock, a day ahead of the server's from now on: the time it says."""
    ahead = datetime.now(UTC) + AHEAD
    monkeypatch.setattr(_clock, "host_now", lambda: ahead)
    monkeypatch.setattr("idempo.policy.utcnow", lambda: ahead)
    return ahead


@pytest.fixture(params=SERVER_CLOCK)
def server_store(request: pytest.FixtureRequest) -> Any:
    """PostgreSQL and MariaDB, migrated and empty."""
    return request.getfixturevalue(f"{request.param}_store")


def test_a_host_clock_far_ahead_cannot_take_over_a_live_lease(
    server_store: Any, host_ahead: datetime
) -> None:
    """With ``now=None`` the server's clock decides: a caller whose host clock is a day ahead
    sees the first caller's lease as live (with the server's time left on it) and cannot
    take over; the record's times are the server's."""
    first = server_store.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(first, Acquired)

    second = server_store.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)

    assert isinstance(second, InProgress), second
    assert 0 < second.retry_after <= LEASE.total_seconds()
    record = server_store.get(scope())
    assert record is not None
    assert (record.status, record.token) == (Status.IN_PROGRESS, first.token)
    real = datetime.now(UTC)
    assert abs(record.created_at - real) < SLACK
    assert record.lease_expires_at is not None
    assert abs(record.lease_expires_at - (record.created_at + LEASE)) < timedelta(seconds=1)


def test_the_server_clock_settles_renews_and_purges(
    server_store: Any, host_ahead: datetime
) -> None:
    """Completion, renewal and purge with no time given are timed by the server too: a purge
    on the server's clock keeps the live and fresh records a day-ahead host would purge,
    and deletes what is expired by the server's clock."""
    live = server_store.reserve(scope("live"), "fp", now=None, lease=LEASE, ttl=TTL)
    done = server_store.reserve(scope("done"), "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(live, Acquired)
    assert isinstance(done, Acquired)
    server_store.renew(scope("live"), live.token, now=None, lease=LEASE)
    server_store.complete(scope("done"), done.token, b"ok", now=None, ttl=TTL)
    past = datetime.now(UTC) - timedelta(days=3)
    old = server_store.reserve(scope("old"), "fp", now=past, lease=LEASE, ttl=TTL)
    assert isinstance(old, Acquired)

    assert server_store.purge(before=None) == 1

    assert server_store.get(scope("old")) is None
    record = server_store.get(scope("done"))
    assert record is not None
    assert abs(record.updated_at - datetime.now(UTC)) < SLACK
    # Retention from the reservation (lease + ttl) already covers ttl after completion.
    assert record.updated_at + TTL <= record.expires_at <= record.updated_at + TTL + LEASE
    assert isinstance(server_store.reserve(scope("live"), "fp", now=None, lease=LEASE, ttl=TTL),
                      InProgress)  # fmt: skip


def test_an_injected_time_still_wins(server_store: Any) -> None:
    """A time the caller passes decides, whatever the server's clock says: an injected clock
    past the lease takes over a lease the server would still call live."""
    first = server_store.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
    later = datetime.now(UTC) + LEASE + SLACK

    taken = server_store.reserve(scope(), "fp", now=later, lease=LEASE, ttl=TTL)

    assert isinstance(first, Acquired)
    assert isinstance(taken, Acquired)
    assert taken.token > first.token
    record = server_store.get(scope())
    assert record is not None
    assert record.updated_at == later


@pytest.mark.postgres
def test_postgres_decides_at_the_statement_not_the_transaction_start(
    postgres_database: Database,
) -> None:
    """In an app's transaction that began a while ago, PostgreSQL's store clock is the
    reservation statement's time, not the transaction's (``now()``)."""
    store = postgres_database.store()
    conn = psycopg.connect(postgres_database.location)
    try:
        began = conn.execute("SELECT now()").fetchone()
        conn.execute("SELECT pg_sleep(0.2)")  # the transaction grows old, on the server
        unit = store.bind(conn, mode="transactional")
        reservation = unit.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
        assert isinstance(reservation, Acquired)
        unit.complete(scope(), reservation.token, b"ok", now=None, ttl=TTL)
        record = store.get(scope())
    finally:
        conn.close()
        store.close()
    assert began is not None
    assert record is not None
    assert record.created_at - began[0] >= timedelta(seconds=0.2)


@pytest.fixture(params=["memory", "sqlite"])
def host_store(request: pytest.FixtureRequest) -> Any:
    """The stores without a clock of their own."""
    if request.param == "memory":
        return MemoryStore()
    return request.getfixturevalue("sqlite_store")


def test_stores_without_a_clock_decide_on_the_host_clock(
    host_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SQLite and memory take ``now=None`` as the host's time: a host clock moved past the
    lease takes the lease over, and a purge with no ``before`` uses it too."""
    at = datetime(2030, 1, 1, tzinfo=UTC)
    monkeypatch.setattr(_clock, "host_now", lambda: at)
    first = host_store.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
    record = host_store.get(scope())
    assert record is not None
    assert record.created_at == at

    at += LEASE
    second = host_store.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(first, Acquired)
    assert isinstance(second, Acquired)
    assert second.token > first.token
    host_store.complete(scope(), second.token, b"ok", now=None, ttl=TTL)

    at += LEASE + TTL
    assert host_store.purge(before=None) == 1


def test_the_cache_judges_on_the_host_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``now=None`` the cache tier serves a record until its retention ends by the
    host's clock, then asks the store (which may take the key over)."""
    at = datetime(2030, 1, 1, tzinfo=UTC)
    monkeypatch.setattr(_clock, "host_now", lambda: at)
    cached = CachedStore(MemoryStore())
    token = cached.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL)
    assert isinstance(token, Acquired)
    cached.complete(scope(), token.token, b"ok", now=None, ttl=TTL)
    assert isinstance(cached.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL), Replay)
    assert isinstance(cached.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL), Replay)
    assert cached.cache.hits == 1

    at += LEASE + TTL
    assert isinstance(cached.reserve(scope(), "fp", now=None, lease=LEASE, ttl=TTL), Acquired)
    assert cached.cache.hits == 1
