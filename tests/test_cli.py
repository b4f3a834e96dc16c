"""The idempo command: demo, migrate, purge, inspect, stats, evict, against real stores,
through the real entry point (typer's CliRunner on the app, or the installed script)."""

from __future__ import annotations

import re
import socket
import sqlite3
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
from click.testing import Result
from typer.testing import CliRunner

from helpers import new_key
from idempo import Idempotency, Policy, Scope
from idempo._purge import purge_records
from idempo.cli import app
from idempo.events import key_digest
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
def test_purge_rests_after_each_full_batch_in_proportion_to_its_time() -> None:
    """idempo purge's loop stops at the first short batch and, after each full one, pauses
    ``rest`` times as long as that batch took (on an injected clock), so a long purge leaves
    live calls that share of the time; ``rest=0`` never pauses."""

    class Batches:
        def __init__(self) -> None:
            self.left = [3, 3, 1]

        def purge(self, *, before: datetime | None, limit: int) -> int:
            assert limit == 3
            return self.left.pop(0)

    ticks = iter([0.0, 0.5, 10.0, 10.2, 20.0, 20.1])
    rests: list[float] = []
    total = purge_records(
        Batches(), batch=3, rest=2.0, sleep=rests.append, clock=lambda: next(ticks)
    )
    assert total == 7
    assert rests == pytest.approx([1.0, 0.4])  # not after the short, last batch
    rests.clear()
    assert purge_records(Batches(), batch=3, rest=0, sleep=rests.append) == 7
    assert rests == []


def test_purge_batch_time_reaches_the_loop_and_bad_values_are_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--batch-time takes seconds or ms and sizes the loop's batches (0: fixed batches);
    without it the store's own budget is used. A bad value is one line, exit 2, before the
    store is opened (no file made)."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    assert runner.invoke(app, ["migrate", url]).exit_code == 0
    _completed_and_expired(url)
    purged = runner.invoke(app, ["purge", url, "--batch-time", "5ms", "--batch", "50"])
    assert purged.exit_code == 0, purged.output
    assert "purged 1 record" in purged.output
    asked: list[dict[str, Any]] = []

    def loop(store: Any, **kwargs: Any) -> int:
        asked.append(kwargs)
        return 0

    monkeypatch.setattr("idempo.cli.purge_records", loop)
    for given, budget, batch in (
        (["--batch-time", "5ms"], 0.005, None),
        (["--batch-time", "0.25", "--batch", "9"], 0.25, 9),
        (["--batch-time", "0"], 0.0, None),
        ([], None, None),
    ):
        asked.clear()
        assert runner.invoke(app, ["purge", url, *given]).exit_code == 0
        assert asked[0]["batch_time"] == pytest.approx(budget)
        assert asked[0]["batch"] == batch
    fresh = f"sqlite:///{tmp_path / 'none.db'}"
    for bad in ("fast", "-1", "5 minutes", "nan", ""):
        one_line_error(runner.invoke(app, ["purge", fresh, "--batch-time", bad]), 2, "--batch-time")
    assert not (tmp_path / "none.db").exists()


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


# --- errors: one line, a non-zero exit, no traceback ---------------------------------------


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def one_line_error(result: Result, code: int, pattern: str) -> str:
    """The command failed with ``code`` and said so in one line on stderr matching
    ``pattern``, nothing on stdout, no traceback."""
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in result.output
    assert result.stdout == ""
    return lines[0]


def _fresh_sqlite(tmp: Path) -> str:
    """A SQLite file that exists, without idempo's table."""
    sqlite3.connect(tmp / "fresh.db").close()
    return f"sqlite:///{tmp / 'fresh.db'}"


def test_unmigrated_sqlite_store_is_one_line_naming_migrate(tmp_path: Path) -> None:
    """A file without the table: each command says so in one line, with the exact migrate
    command to run, and exits 3."""
    url = _fresh_sqlite(tmp_path)
    for args in (["stats", url], ["purge", url], ["inspect", url, "k", "--operation", "op"],
                 ["evict", url, "k", "--operation", "op"]):  # fmt: skip
        line = one_line_error(runner.invoke(app, args), 3, r"does not exist")
        assert f"idempo migrate {url!r}" in line


def test_sqlite_file_that_cannot_be_opened_is_one_line(tmp_path: Path) -> None:
    """A missing directory, and a directory given as the file, for every command."""
    for path, why in ((tmp_path / "no" / "x.db", r"directory .*/no does not exist"),
                      (tmp_path, r"it is a directory")):  # fmt: skip
        url = f"sqlite:///{path}"
        for args in (["migrate", url], ["stats", url], ["purge", url],
                     ["inspect", url, "k", "--operation", "op"]):  # fmt: skip
            one_line_error(runner.invoke(app, args), 3, rf"cannot open {path}: {why}")
    assert not (tmp_path / "no").exists()


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """An invalid key, an unknown scheme, a bad port, a bad timeout: exit 2, one line,
    before any store is touched (the SQLite file is not created)."""
    url = f"sqlite:///{tmp_path / 'x.db'}"
    cases = [
        (["inspect", url, "has space", "--operation", "op"], r"printable ASCII"),
        (["evict", url, "x" * 300, "--operation", "op"], r"key"),
        (["stats", "mongodb://localhost/x"], r"unknown store URL scheme 'mongodb'"),
        (["stats", "postgresql://u@127.0.0.1:abc/db"], r"bad port"),
        (["stats", "redis://127.0.0.1:abc/0"], r"bad redis URL"),
        (["stats", "mysql://root@127.0.0.1/db?connect_timeout=soon"], r"number of seconds"),
    ]
    for args, pattern in cases:
        one_line_error(runner.invoke(app, args), 2, pattern)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.postgres
def test_unreachable_and_unmigrated_postgres_are_one_line(
    postgres_url: str, pg_schema: str
) -> None:
    """A closed port, a missing database, an unmigrated schema: one line each, with the
    cause, within the connect timeout; the password never printed."""
    closed = f"postgresql://postgres:hunter2@127.0.0.1:{_closed_port()}/test?connect_timeout=2"
    one_line_error(runner.invoke(app, ["stats", closed]), 3, r"connection refused")
    nodb = postgres_url.rsplit("/", 1)[0] + "/idempo_no_such_db"
    one_line_error(runner.invoke(app, ["stats", nodb]), 3, r'database "idempo_no_such_db"')
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    for args in (["stats", url], ["purge", url], ["inspect", url, "k", "--operation", "op"]):
        one_line_error(runner.invoke(app, args), 3, rf"{pg_schema}\.idempo_records.*migrate")
    assert "hunter2" not in runner.invoke(app, ["stats", closed]).output


@pytest.mark.postgres
def test_read_only_commands_never_create_a_table(postgres_url: str, pg_schema: str) -> None:
    """inspect and stats on an unmigrated PostgreSQL schema leave it empty."""
    url = f"{postgres_url}?table={pg_schema}.idempo_records"
    runner.invoke(app, ["stats", url])
    runner.invoke(app, ["inspect", url, "k", "--operation", "op"])
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname = %s",
            (pg_schema,),
        ).fetchone()
    assert row == (0,)


def test_read_only_commands_never_create_a_file(tmp_path: Path) -> None:
    """inspect and stats on a fresh SQLite URL say the file does not exist and create
    nothing, and neither do purge and evict; migrate does create it."""
    url = f"sqlite:///{tmp_path / 'new.db'}"
    for args in (["stats", url], ["inspect", url, "k", "--operation", "op"], ["purge", url],
                 ["evict", url, "k", "--operation", "op"]):  # fmt: skip
        one_line_error(runner.invoke(app, args), 3, r"new\.db: the file does not exist")
    assert list(tmp_path.iterdir()) == []
    assert runner.invoke(app, ["migrate", url]).exit_code == 0
    assert (tmp_path / "new.db").exists()


def _idempo(*args: str, blocked: str | None = None) -> subprocess.CompletedProcess[str]:
    """The installed ``idempo`` entry point in a fresh process; ``blocked``: a module that
    cannot be imported there, as if its extra were not installed."""
    code = "import sys\n"
    if blocked:
        code += f"sys.modules[{blocked!r}] = None\n"
    code += "from idempo.cli import main\nsys.argv[0] = 'idempo'\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


def test_missing_extra_hint_is_printed_literally() -> None:
    """Without psycopg the hint reads pip install 'idempo[postgres]', brackets and all."""
    result = _idempo("stats", "postgresql://u@127.0.0.1/db", blocked="psycopg")
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert "pip install 'idempo[postgres]'" in result.stderr


@pytest.mark.postgres
def test_installed_script_prints_one_line_and_debug_the_traceback() -> None:
    """The real process: one line on stderr (no pool warnings from psycopg's threads), and
    with --debug the traceback."""
    port = _closed_port()
    url = f"postgresql://postgres@127.0.0.1:{port}/test?connect_timeout=2"
    plain = _idempo("stats", url)
    assert plain.returncode == 3
    assert plain.stderr.splitlines() == [
        f"error: cannot connect to PostgreSQL at 127.0.0.1:{port}/test: connection refused"
    ]
    debug = _idempo("--debug", "stats", url)
    assert debug.returncode != 0
    assert "Traceback" in debug.stderr or "StoreUnavailableError" in debug.stderr
    assert "connection refused" in debug.stderr


# --- evict ---------------------------------------------------------------------------------


@pytest.fixture(params=[
    "sqlite",
    pytest.param("pg", marks=pytest.mark.postgres),
    pytest.param("mysql", marks=pytest.mark.mysql),
    pytest.param("redis", marks=pytest.mark.redis),
])  # fmt: skip
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated store's URL on every kind of store."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'evict.db'}"
    elif request.param == "pg":
        schema = request.getfixturevalue("pg_schema")
        url = f"{request.getfixturevalue('postgres_url')}?table={schema}.idempo_records"
    elif request.param == "mysql":
        database = request.getfixturevalue("mysql_db")
        url = f"{request.getfixturevalue('mysql_url')}?table={database}.idempo_records"
    else:
        prefix = request.getfixturevalue("redis_prefix")
        return f"{request.getfixturevalue('redis_url')}?prefix={prefix}"
    assert runner.invoke(app, ["migrate", url]).exit_code == 0
    return url


def _complete(store: Any, key: str, principal: str) -> None:
    with Idempotency(store).once(key, operation="charge", principal=principal) as attempt:
        attempt.result = {"charged": True}


def test_evict_deletes_one_record(store_url: str) -> None:
    """evict removes the record of exactly one scope (a retry then runs again); a second
    evict, or another scope, finds nothing and exits 1."""
    key = new_key()
    store = open_store(store_url)
    try:
        _complete(store, key, "bob")
        _complete(store, key, "alice")
        args = ["evict", store_url, key, "--operation", "charge"]
        gone = runner.invoke(app, [*args, "--principal", "bob"])
        assert gone.exit_code == 0, gone.output
        assert "evicted" in gone.stdout
        assert store.get(Scope.of(key, operation="charge", principal="bob")) is None
        assert store.get(Scope.of(key, operation="charge", principal="alice")) is not None
        again = runner.invoke(app, [*args, "--principal", "bob"])
        assert (again.exit_code, again.stdout.strip()) == (1, "no record")
        assert runner.invoke(app, args).exit_code == 1  # the anonymous principal has none
    finally:
        store.close()


@pytest.mark.redis
def test_corrupt_record_says_how_to_evict_it(redis_url: str, redis_prefix: str) -> None:
    """inspect on a record that cannot be decoded: one line with the evict command to run,
    with this URL; that command then removes it."""
    url = f"{redis_url}?prefix={redis_prefix}"
    key = new_key()
    store = open_store(url)
    try:
        _complete(store, key, "bob")
        (name,) = store.client.scan_iter(f"{redis_prefix}:{{*}}")
        store.client.setrange(name, 0, b"z")  # a state no record has
        args = [url, key, "--operation", "charge", "--principal", "bob"]
        line = one_line_error(runner.invoke(app, ["inspect", *args]), 3, "cannot be decoded")
        assert key not in line  # by its digest only: the line may end up in a log
        assert "bob" not in line  # nor the principal
        assert f"idempo evict {url!r} KEY --operation charge --principal PRINCIPAL" in line
        assert f"the key whose digest is {key_digest(key)}" in line
        assert runner.invoke(app, ["evict", *args]).exit_code == 0
        assert store.get(Scope.of(key, operation="charge", principal="bob")) is None
    finally:
        store.close()


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["purge", "{url}", "--batch", "0"], "Invalid value for '--batch'"),
        (["purge", "{url}", "--batch", "many"], "Invalid value for '--batch'"),
        (["purge", "{url}", "--bogus"], "No such option: --bogus"),
        (["purge"], "Missing argument"),
        (["no-such-command"], "No such command"),
    ],
)
def test_installed_script_says_a_usage_error_in_one_line(
    tmp_path: Path, args: list[str], said: str
) -> None:
    """SPEC §8: every CLI error is one clear line and a non-zero exit, a usage error too
    (typer's own would be the usage and a box), and it creates nothing."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    result = _idempo(*(arg.format(url=url) for arg in args))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith("error: "), result.stderr
    assert said in result.stderr, result.stderr
    assert "--help" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_installed_script_still_prints_help_and_version() -> None:
    """What is not an error prints as typer prints it, with its exit status."""
    helped = _idempo("purge", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--batch-time" in helped.stdout
    bare = _idempo()
    assert bare.returncode == 2
    assert "Usage" in bare.stdout + bare.stderr
    version = _idempo("--version")
    assert version.returncode == 0
    assert version.stdout.startswith("idempo ")
