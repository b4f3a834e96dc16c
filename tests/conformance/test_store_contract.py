"""The store contract (`idempo.testing.StoreContract`) run against every store idempo ships,
sync and async, on the real servers; then what is particular to one store."""

from __future__ import annotations

from datetime import UTC, timedelta
from typing import Any

import pytest

from idempo import Scope
from idempo.stores.postgres import PostgresStore
from idempo.testing import FakeClock, StoreContract
from idempo.testing.contract import LEASE, TTL


class TestEveryStore(StoreContract):
    """Every store, in both faces (conftest's ``store_face``): memory, SQLite, PostgreSQL,
    Redis, MariaDB and a Redis Cluster."""

    @pytest.fixture
    def store(self, store_face: tuple[Any, bool]) -> Any:
        return store_face[0]


@pytest.mark.postgres
def test_postgres_times_are_utc_in_any_session_time_zone(
    postgres_url: str, pg_schema: str, clock: FakeClock
) -> None:
    """A PostgreSQL session in another time zone still gives records in UTC."""
    url = f"{postgres_url}?options=-c%20TimeZone%3DAsia/Tokyo"
    store = PostgresStore(url, table=f"{pg_schema}.idempo_records")
    scope = Scope.of("k-1", operation="charge", principal="alice")
    try:
        store.migrate()
        store.reserve(scope, "fp", now=clock(), lease=LEASE, ttl=TTL)
        record = store.get(scope)
    finally:
        store.close()
    assert record is not None
    for moment in (record.created_at, record.updated_at, record.expires_at):
        assert moment == clock() or moment == clock() + LEASE + TTL
        assert moment.utcoffset() == timedelta(0)
        assert moment.tzinfo == UTC
