"""``idempo doctor`` against real servers set up well and badly: private redis-servers
(persistence, eviction), SQLite files (WAL or rollback journal, schema or none), PostgreSQL
(a role whose sessions run with synchronous_commit=off, a missing or old table), MariaDB,
clock skew and a retention shorter than the retry horizon; the report as JSON and exit codes."""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pymysql
import pytest
from typer.testing import CliRunner

import idempo._cli_ops  # noqa: F401 - registers doctor on the app
from idempo import Idempotency, Policy
from idempo.cli import app
from idempo.doctor import Level, Report, diagnose, parse_duration
from idempo.errors import ConfigurationError
from idempo.stores.mysql import connect_options
from idempo.stores.sqlite import SQLiteStore
from redis_servers import free_ports, installed, redis_server

# One test sets the MariaDB server's innodb_flush_log_at_trx_commit (a global) for a while,
# and the others read it: on pytest-xdist's workers they take turns on one, and across
# processes (another checkout's suite on the same server) they hold `flush_turn`'s lock.
pytestmark = pytest.mark.xdist_group("doctor")

runner = CliRunner()


def _migrated(path: Path) -> None:
    store = SQLiteStore(str(path))
    store.migrate()
    store.close()


def _levels(report: Report) -> dict[str, Level]:
    return {finding.check: finding.level for finding in report.findings}


def _doctor_json(*args: str) -> tuple[int, dict[str, Any]]:
    result = runner.invoke(app, ["doctor", *args, "--json"])
    return result.exit_code, json.loads(result.output)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[Any]:
    """Start a private redis-server with the given options: ``private_redis(*options)``."""
    problem = installed()
    if problem:
        pytest.skip(problem)
    servers: list[Any] = []

    def start(*options: str) -> str:
        (port,) = free_ports(1)
        context = redis_server(port, "--dir", str(tmp_path), *options)
        context.__enter__()
        servers.append(context)
        return f"redis://127.0.0.1:{port}/0"

    yield start
    for context in servers:
        context.__exit__(None, None, None)


# -- Redis -----------------------------------------------------------------------------------


def test_redis_without_persistence_and_with_lru_eviction_fails(private_redis: Any) -> None:
    """appendonly no and allkeys-lru under a memory limit: both fail, each saying what to
    change; the JSON report parses and the exit code is 2."""
    url = private_redis("--appendonly", "no", "--maxmemory", "64mb",
                        "--maxmemory-policy", "allkeys-lru")  # fmt: skip
    code, report = _doctor_json(url)
    assert code == 2
    assert report["store"] == "redis"
    assert report["exit_code"] == 2
    found = {f["check"]: f for f in report["findings"]}
    assert found["appendonly"]["level"] == "fail"
    assert "appendonly yes" in found["appendonly"]["fix"]
    assert found["maxmemory-policy"]["level"] == "fail"
    assert found["maxmemory-policy"]["value"] == "allkeys-lru"
    assert "noeviction" in found["maxmemory-policy"]["fix"]
    assert found["clock"]["level"] == "pass"
    table = runner.invoke(app, ["doctor", url])
    assert table.exit_code == 2
    assert "FAIL" in table.output
    assert "noeviction" in table.output


def test_redis_set_up_well_passes(private_redis: Any) -> None:
    """appendonly yes, appendfsync always, noeviction: every check passes, exit 0."""
    url = private_redis("--appendonly", "yes", "--appendfsync", "always",
                        "--maxmemory-policy", "noeviction")  # fmt: skip
    report = diagnose(url)
    assert report.exit_code == 0, report.as_dict()
    assert _levels(report) == {
        "appendfsync": Level.PASS,
        "maxmemory-policy": Level.PASS,
        "clock": Level.PASS,
        "schema": Level.PASS,
        "retention": Level.PASS,
    }


def test_redis_everysec_and_an_eviction_policy_without_a_limit_warn(private_redis: Any) -> None:
    """appendfsync everysec (a machine crash loses a second) and volatile-lru with no memory
    limit yet are warnings: exit 1."""
    url = private_redis("--appendonly", "yes", "--appendfsync", "everysec",
                        "--maxmemory-policy", "volatile-lru")  # fmt: skip
    report = diagnose(url)
    assert _levels(report)["appendfsync"] is Level.WARN
    assert _levels(report)["maxmemory-policy"] is Level.WARN
    assert report.exit_code == 1


def test_a_redis_that_refuses_config_is_a_warning(private_redis: Any) -> None:
    """A managed Redis that hides CONFIG (renamed away here): the doctor cannot read its
    persistence and eviction, and says what to check instead."""
    url = private_redis("--rename-command", "CONFIG", '""')
    report = diagnose(url)
    config = next(f for f in report.findings if f.check == "config")
    assert config.level is Level.WARN
    assert "noeviction" in (config.fix or "")
    assert report.exit_code == 1


@pytest.mark.redis
def test_every_primary_of_a_cluster_is_checked(redis_cluster_url: str) -> None:
    """The private test cluster keeps nothing on disk: each of its three primaries fails."""
    report = diagnose(redis_cluster_url)
    persistence = [f for f in report.findings if f.check == "appendonly"]
    assert len(persistence) == 3
    assert all(f.level is Level.FAIL for f in persistence)
    assert len({f.summary for f in persistence}) == 3  # each names its node


# -- SQLite ----------------------------------------------------------------------------------


def test_sqlite_in_wal_mode_passes(tmp_path: Path) -> None:
    path = tmp_path / "good.db"
    _migrated(path)
    report = diagnose(f"sqlite:///{path}")
    assert report.exit_code == 0, report.as_dict()
    assert _levels(report)["journal_mode"] is Level.PASS
    assert _levels(report)["schema"] is Level.PASS


def test_sqlite_in_rollback_journal_mode_is_flagged_and_left_so(tmp_path: Path) -> None:
    """A file switched back to a rollback journal is a warning that says how to switch it;
    the doctor opens it read-only, so the file stays as it was."""
    path = tmp_path / "journal.db"
    _migrated(path)
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode=DELETE").fetchone() == ("delete",)
    code, report = _doctor_json(f"sqlite:///{path}")
    assert code == 1
    found = {f["check"]: f for f in report["findings"]}
    assert found["journal_mode"]["level"] == "warn"
    assert found["journal_mode"]["value"] == "delete"
    assert "journal_mode=WAL" in found["journal_mode"]["fix"]
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("delete",)


def test_sqlite_without_the_schema_fails_and_creates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    sqlite3.connect(path).close()
    report = diagnose(f"sqlite:///{path}")
    schema = next(f for f in report.findings if f.check == "schema")
    assert schema.level is Level.FAIL
    assert "idempo migrate" in (schema.fix or "")
    assert report.exit_code == 2
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)


def test_a_missing_file_is_one_line_and_stays_missing(tmp_path: Path) -> None:
    absent = tmp_path / "absent.db"
    result = runner.invoke(app, ["doctor", f"sqlite:///{absent}"])
    assert result.exit_code == 3
    assert result.output.startswith("error:")
    assert len(result.output.strip().splitlines()) == 1
    assert not absent.exists()


# -- retention against the horizon ---------------------------------------------------------


def test_a_horizon_longer_than_the_retention_fails(tmp_path: Path) -> None:
    """Retries for 7 days against the default 24 h retention: a failure naming the ttl to
    set; the records' own retention (30 days here) or --retention 30d passes it."""
    path = tmp_path / "ret.db"
    url = f"sqlite:///{path}"
    _migrated(path)
    code, report = _doctor_json(url, "--horizon", "7d")
    assert code == 2
    retention = next(f for f in report["findings"] if f["check"] == "retention")
    assert retention["level"] == "fail"
    assert "Policy(ttl=timedelta(seconds=604800))" in retention["fix"]
    assert (
        runner.invoke(app, ["doctor", url, "--horizon", "7d", "--retention", "30d"]).exit_code == 0
    )

    store = SQLiteStore(str(path))
    with Idempotency(store, Policy(ttl=timedelta(days=30))).once("k", operation="op") as attempt:
        attempt.result = 1
    store.close()
    observed = diagnose(url, horizon=timedelta(days=7))
    found = next(f for f in observed.findings if f.check == "retention")
    assert found.level is Level.PASS
    assert "as the stored records show" in found.summary
    assert observed.exit_code == 0


def test_durations_parse_or_are_bad_input() -> None:
    assert parse_duration("90s") == timedelta(seconds=90)
    assert parse_duration("2w") == timedelta(weeks=2)
    with pytest.raises(ConfigurationError):
        parse_duration("a week")
    bad = runner.invoke(app, ["doctor", "memory://", "--horizon", "a week"])
    assert bad.exit_code == 2
    assert bad.output.startswith("error:")


def test_the_memory_store_fails_durability() -> None:
    assert diagnose("memory://").exit_code == 2


# -- PostgreSQL ------------------------------------------------------------------------------


@pytest.mark.postgres
def test_postgres_set_up_well_passes(postgres_url: str, pg_schema: str) -> None:
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    assert runner.invoke(app, ["migrate", url]).exit_code == 0
    report = diagnose(url)
    assert report.exit_code == 0, report.as_dict()
    assert set(_levels(report)) >= {"fsync", "synchronous_commit", "schema", "clock"}


@pytest.fixture
def lax_role(postgres_url: str, pg_schema: str) -> Iterator[str]:
    """A login role whose sessions run with synchronous_commit=off (set on the role, as a DBA
    would), owning a migrated table in the test's schema: its URL."""
    role = f"idempo_lax_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"ALTER ROLE {role} SET synchronous_commit = off")
        conn.execute(f"GRANT ALL ON SCHEMA {pg_schema} TO {role}")
    url = postgres_url.replace("postgres@", f"{role}@", 1)
    try:
        yield f"{url}?table={pg_schema}.idempo_records"
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")
            conn.execute(f"DROP ROLE {role}")


@pytest.mark.postgres
def test_postgres_with_synchronous_commit_off_fails(lax_role: str) -> None:
    assert runner.invoke(app, ["migrate", lax_role]).exit_code == 0
    code, report = _doctor_json(lax_role)
    assert code == 2
    found = {f["check"]: f for f in report["findings"]}
    assert found["synchronous_commit"]["level"] == "fail"
    assert found["synchronous_commit"]["value"] == "off"
    assert "synchronous_commit = on" in found["synchronous_commit"]["fix"]
    assert found["schema"]["level"] == "pass"


@pytest.mark.postgres
def test_postgres_without_the_schema_fails_and_creates_nothing(
    postgres_url: str, pg_schema: str
) -> None:
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    report = diagnose(url)
    assert _levels(report)["schema"] is Level.FAIL
    with psycopg.connect(postgres_url) as conn:
        tables = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s",
            (pg_schema,),
        ).fetchone()
    assert tables == (0,)


@pytest.mark.postgres
def test_postgres_table_from_an_older_version_fails_with_the_fix(
    postgres_url: str, pg_schema: str
) -> None:
    """A records table without the recovery_point column: the fix is the ALTER TABLE."""
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    assert runner.invoke(app, ["migrate", url]).exit_code == 0
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {pg_schema}.idempo_records DROP COLUMN recovery_point")
    schema = next(f for f in diagnose(url).findings if f.check == "schema")
    assert schema.level is Level.FAIL
    assert schema.fix == f"ALTER TABLE {pg_schema}.idempo_records ADD COLUMN recovery_point text"


@pytest.mark.postgres
def test_clock_skew_is_measured_against_the_store(postgres_url: str, pg_schema: str) -> None:
    """A host clock 5 s off is a warning, 2 minutes off a failure (past the default lease)."""
    url = f"{postgres_url}?table={pg_schema}.idempo_records"

    def clock(off: timedelta) -> Any:
        return lambda: datetime.now(UTC) + off

    slightly = diagnose(url, clock=clock(timedelta(seconds=5)))
    assert _levels(slightly)["clock"] is Level.WARN
    far = next(f for f in diagnose(url, clock=clock(timedelta(minutes=-2))).findings
               if f.check == "clock")  # fmt: skip
    assert far.level is Level.FAIL
    assert 119 < float(far.value or 0) < 121  # the store is ahead of this (slow) host


# -- MariaDB ---------------------------------------------------------------------------------


@pytest.fixture
def flush_turn(mysql_url: str) -> Iterator[None]:
    """Holds a server-wide named lock while a test reads or sets innodb_flush_log_at_trx_commit:
    the setting is one for the whole server, which every suite running on it shares."""
    conn = pymysql.connect(**connect_options(mysql_url), autocommit=True)
    with conn, conn.cursor() as cursor:
        cursor.execute("SELECT GET_LOCK('idempo-tests-innodb-flush', 120)")
        ((taken,),) = cursor.fetchall()
        assert taken == 1, "another test run held the flush setting for two minutes"
        try:
            yield
        finally:
            cursor.execute("SELECT RELEASE_LOCK('idempo-tests-innodb-flush')")


@pytest.mark.mysql
@pytest.mark.usefixtures("flush_turn")
def test_mariadb_set_up_well_passes_and_a_missing_schema_fails(
    mysql_url: str, mysql_db: str
) -> None:
    url = f"{mysql_url}?table={mysql_db}.idempo_records"
    assert _levels(diagnose(url))["schema"] is Level.FAIL
    assert runner.invoke(app, ["migrate", url]).exit_code == 0
    report = diagnose(url)
    assert report.exit_code == 0, report.as_dict()
    assert _levels(report)["innodb_flush_log_at_trx_commit"] is Level.PASS


@pytest.fixture
def flush_setting(mysql_url: str, flush_turn: None) -> Iterator[Any]:
    """Sets the server's innodb_flush_log_at_trx_commit (a dynamic global) for the test,
    and puts the value it had back."""
    conn = pymysql.connect(**connect_options(mysql_url), autocommit=True)
    with conn, conn.cursor() as cursor:
        cursor.execute("SELECT @@GLOBAL.innodb_flush_log_at_trx_commit")
        ((before,),) = cursor.fetchall()

        def set_to(value: int) -> None:
            cursor.execute(f"SET GLOBAL innodb_flush_log_at_trx_commit = {int(value)}")

        try:
            yield set_to
        finally:
            set_to(before)


def test_mariadb_that_flushes_lazily_is_flagged(
    mysql_url: str, mysql_db: str, flush_setting: Any
) -> None:
    """A server that acknowledges commits before they are on disk: 0 (a server crash loses
    them) fails, 2 (only a machine crash does) warns; the fix is named; exit codes follow."""
    url = f"{mysql_url}?table={mysql_db}.idempo_records"
    assert runner.invoke(app, ["migrate", url]).exit_code == 0
    flush_setting(0)
    code, data = _doctor_json(url)
    (finding,) = [f for f in data["findings"] if f["check"] == "innodb_flush_log_at_trx_commit"]
    assert (code, finding["level"], finding["value"]) == (2, "fail", "0"), data
    assert "SET GLOBAL innodb_flush_log_at_trx_commit = 1" in finding["fix"]
    flush_setting(2)
    report = diagnose(url)
    assert _levels(report)["innodb_flush_log_at_trx_commit"] is Level.WARN
    assert report.exit_code == 1, report.as_dict()


def test_an_unreachable_server_is_one_line_with_the_cause() -> None:
    (port,) = free_ports(1)
    result = runner.invoke(app, ["doctor", f"redis://127.0.0.1:{port}/0", "--json"])
    assert result.exit_code == 3
    assert result.output.startswith("error:")
    assert "connection refused" in result.output
    assert len(result.output.strip().splitlines()) == 1
