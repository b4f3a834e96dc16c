"""The idempo command: demo, migrate, purge, inspect, stats, against real stores."""

from __future__ import annotations

import re
import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from typer.testing import CliRunner

from idempo import Idempotency, Policy, Scope
from idempo.cli import app
from idempo.demo import run_storm
from idempo.stores import open_store
from idempo.testing import FakeClock

runner = CliRunner()


def test_demo_reports_exactly_once_and_exits_zero(tmp_path: Path) -> None:
    """A small storm on a fresh SQLite file prints the report and exits 0 (exactly once)."""
    url = f"sqlite:///{tmp_path / 'demo.db'}"
    result = runner.invoke(
        app, ["demo", "--store", url, "--intents", "30", "--retries", "3", "--concurrency", "6"]
    )
    assert result.exit_code == 0, result.output
    assert "exactly-once held" in result.output
    assert "double charges" in result.output


def test_demo_storm_charges_each_intent_once_with_every_kind_of_answer(tmp_path: Path) -> None:
    """The storm really produces replays, conflicts, in-flight answers and transient retries,
    and still charges every intent exactly once; the payments table proves it."""
    url = f"sqlite:///{tmp_path / 'storm.db'}"
    report = run_storm(url, intents=60, retries=4, concurrency=8, work_seconds=0.01)
    tally = report.tally
    assert report.exactly_once
    assert sorted(report.charges.values()) == [1] * 60
    assert tally.replays > 0
    assert tally.transient > 0
    assert tally.executions == 60 + tally.transient
    conn = sqlite3.connect(tmp_path / "storm.db")
    rows = conn.execute("SELECT intent, count(*) FROM demo_payments GROUP BY intent").fetchall()
    conn.close()
    assert len(rows) == 60
    assert {count for _, count in rows} == {1}


@pytest.mark.postgres
def test_demo_runs_on_postgresql(postgres_url: str, pg_schema: str) -> None:
    """The same storm on PostgreSQL holds exactly once too."""
    report = run_storm(
        f"{postgres_url}?table={pg_schema}.idempo_records", intents=40, concurrency=6
    )
    with psycopg.connect(postgres_url) as conn:
        (rows,) = conn.execute(f"SELECT count(*) FROM {pg_schema}.demo_payments").fetchone() or (0,)
    assert rows == 40
    assert report.exactly_once


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
