"""The idempo command: demo, migrate, purge, inspect, stats, against real stores."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from idempo import Idempotency, Policy, Scope
from idempo.cli import app
from idempo.stores import open_store
from idempo.testing import FakeClock

runner = CliRunner()


def _completed_and_expired(url: str) -> None:
    """Two records: one completed an hour ago with a short ttl, one completed now."""
    clock = FakeClock(datetime.now(UTC) - timedelta(hours=1))
    store = open_store(url)
    old = Idempotency(store, Policy(clock=clock, lease=timedelta(seconds=1), ttl=timedelta(1e-3)))
    with old.once("old-key", operation="charge") as attempt:
        attempt.result = {"n": 1}
    with Idempotency(store).once("new-key", operation="charge", principal="bob") as attempt:
        attempt.result = {"n": 2}
    store.close()


def test_migrate_inspect_stats_and_purge_on_sqlite(tmp_path: Path) -> None:
    """migrate creates the table; inspect shows a record; stats counts it; purge deletes only
    what has expired."""
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    migrated = runner.invoke(app, ["migrate", url])
    assert migrated.exit_code == 0, migrated.output
    _completed_and_expired(url)

    shown = runner.invoke(app, ["inspect", url, "new-key", "--operation", "charge",
                                "--principal", "bob"])  # fmt: skip
    assert shown.exit_code == 0, shown.output
    assert "completed" in shown.output
    assert '{"n":2}' in shown.output
    missing = runner.invoke(app, ["inspect", url, "new-key", "--operation", "refund"])
    assert missing.exit_code == 1
    assert "no record" in missing.output

    stats = runner.invoke(app, ["stats", url])
    assert stats.exit_code == 0
    assert re.search(r"completed\s*│\s*2\s*│", stats.output), stats.output
    assert re.search(r"in_progress\s*│\s*0\s*│", stats.output), stats.output

    purged = runner.invoke(app, ["purge", url, "--batch", "1"])
    assert purged.exit_code == 0, purged.output
    assert "purged 1 record" in purged.output
    store = open_store(url)
    assert store.get(Scope.of("old-key", operation="charge")) is None
    assert store.get(Scope.of("new-key", operation="charge", principal="bob")) is not None
    store.close()


@pytest.mark.postgres
def test_migrate_and_purge_on_postgresql(postgres_url: str, pg_schema: str) -> None:
    """migrate and purge work against the real PostgreSQL server."""
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    assert runner.invoke(app, ["migrate", url]).exit_code == 0
    _completed_and_expired(url)
    purged = runner.invoke(app, ["purge", url])
    assert purged.exit_code == 0, purged.output
    assert "purged 1 record" in purged.output
    stats = runner.invoke(app, ["stats", url])
    assert "completed" in stats.output


def test_bad_store_url_is_a_clear_error() -> None:
    """An unknown scheme exits 2 with a message naming the known ones, not a traceback."""
    result = runner.invoke(app, ["stats", "mongodb://localhost/x"])
    assert result.exit_code == 2
    assert "unknown store URL scheme" in result.output
