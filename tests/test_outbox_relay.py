"""The outbox relay on the real SQLite, PostgreSQL and MariaDB: it publishes what was staged,
marks it sent, retries a failed publish after its backoff (an injected clock), hands each
message to exactly one of several concurrent relays, republishes what a relay cancelled
between publish and mark had published (at least once, same id), and runs as a task inside an
app. Then purge, stats and ``idempo relay``. The publisher is a recording one in memory: the
real brokers are tests/test_outbox_e2e*.py's.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from helpers import Database, new_key
from idempo import Idempotency
from idempo.cli import app
from idempo.errors import ConfigurationError
from idempo.outbox import (
    Drained,
    Outbox,
    OutboxMessage,
    Publisher,
    Relay,
    exponential_backoff,
    outbox_table,
)
from idempo.testing import FakeClock

pytestmark = pytest.mark.anyio
runner = CliRunner()


class Recording:
    """A publisher that keeps what it was given; ``fail`` says which calls raise (by number,
    from 1); ``hold`` makes every publish yield to the loop first, so relays interleave;
    ``grew`` is set on every publish."""

    def __init__(self, *, fail: set[int] | None = None, hold: bool = False) -> None:
        self.published: list[OutboxMessage] = []
        self.grew = asyncio.Event()
        self.calls = 0
        self.fail = fail or set()
        self.hold = hold
        self.closed = False

    async def publish(self, message: OutboxMessage) -> None:
        self.calls += 1
        if self.hold:
            await asyncio.sleep(0)
        if self.calls in self.fail:
            raise ConnectionError("the broker is down")
        self.published.append(message)
        self.grew.set()

    async def aclose(self) -> None:
        self.closed = True


def store_url(database: Database) -> str:
    if database.kind == "sqlite":
        return f"sqlite:///{database.location}"
    return f"{database.location}?table={database.records_table}"


def migrated(database: Database) -> Outbox:
    outbox = Outbox(outbox_table(database.records_table))
    store = database.store()
    try:
        outbox.migrate(store)
    finally:
        store.close()
    return outbox


def staged(database: Database, keys: int, per_key: int) -> list[str]:
    """Stage ``per_key`` messages under each of ``keys`` guarded calls; their ids, in order."""
    outbox = Outbox(outbox_table(database.records_table))
    store = database.store()
    conn = database.connect(store)
    ids: list[str] = []
    try:
        idem = Idempotency(store)
        for _ in range(keys):
            with idem.once(new_key(), operation="capture", conn=conn) as attempt:
                for n in range(per_key):
                    ids.append(outbox.stage(conn, attempt, "payments", {"n": n}).id)
                attempt.result = "ok"
    finally:
        conn.close()
        store.close()
    return ids


async def drain(url: str) -> Drained:
    async with Relay(url, Recording()) as relay:
        return await relay.drain()


def rows(database: Database) -> dict[str, tuple[Any, ...]]:
    """id -> (attempts, sent, last_error, available_at) as committed."""
    found = database.select(
        "SELECT id, attempts, sent_at IS NOT NULL, last_error, available_at"
        f" FROM {outbox_table(database.records_table)}"
    )
    return {row[0]: (row[1], bool(row[2]), row[3], row[4]) for row in found}


async def test_relay_publishes_each_message_and_marks_it_sent(database: Database) -> None:
    """drain() publishes every staged message once, in the order staged, with its id, body
    and headers, and marks it sent; a second drain has nothing to do."""
    outbox = migrated(database)
    ids = staged(database, keys=3, per_key=4)
    publisher = Recording()
    async with Relay(store_url(database), publisher, batch=5) as relay:
        assert await relay.drain() == Drained(sent=12, failed=0)
        assert await relay.drain() == Drained(sent=0, failed=0)
    assert [m.id for m in publisher.published] == ids
    assert {m.body for m in publisher.published} == {b'{"n":0}', b'{"n":1}', b'{"n":2}', b'{"n":3}'}
    assert {m.attempts for m in publisher.published} == {0}
    assert not publisher.closed  # the relay does not close what it was given
    assert {row[:3] for row in rows(database).values()} == {(1, True, None)}
    store = database.store()
    try:
        assert outbox.stats(store) == {"pending": 0, "failing": 0, "sent": 12}
    finally:
        store.close()


async def test_a_failed_publish_is_retried_after_its_backoff(database: Database) -> None:
    """The first publish fails: it gets one attempt, its error and a next try 10 s later
    (the injected clock); the rest of the batch goes back untried and is published at once;
    the failed one only once the clock passed its backoff, with attempts=1."""
    migrated(database)
    first, second = staged(database, keys=1, per_key=2)
    clock = FakeClock(datetime.now(UTC) + timedelta(seconds=1))
    publisher = Recording(fail={1})
    backoff = exponential_backoff(base=timedelta(seconds=10), jitter=0)
    async with Relay(store_url(database), publisher, clock=clock, backoff=backoff) as relay:
        assert await relay.step() == Drained(sent=0, failed=1)
        found = rows(database)
        assert found[first][:3] == (1, False, "ConnectionError: the broker is down")
        assert found[second][:3] == (0, False, None)
        assert await relay.drain() == Drained(sent=1, failed=0)
        clock.advance(seconds=9)
        assert await relay.drain() == Drained(sent=0, failed=0)
        clock.advance(seconds=2)
        assert await relay.drain() == Drained(sent=1, failed=0)
    assert [(m.id, m.attempts) for m in publisher.published] == [(second, 0), (first, 1)]
    assert rows(database)[first][:3] == (2, True, None)


CONCURRENT = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
]


@pytest.mark.slow
@pytest.mark.parametrize("kind", CONCURRENT)
def test_concurrent_relays_publish_each_message_once(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Four relays, each in a thread of its own with its own event loop and connection,
    drain 300 messages at once in batches of 7: every message is published exactly once and
    marked sent, and more than one relay did some of the work."""
    database: Database = request.getfixturevalue(f"{kind}_database")
    migrated(database)
    ids = staged(database, keys=30, per_key=10)
    publisher = Recording(hold=True)  # list.append is atomic: one list for all threads
    start = threading.Barrier(4)
    done: list[Drained] = []
    errors: list[BaseException] = []

    async def relay_once() -> Drained:
        async with Relay(store_url(database), publisher, batch=7) as relay:
            await asyncio.to_thread(start.wait)
            return await relay.drain()

    def thread() -> None:
        try:
            done.append(asyncio.run(relay_once()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=thread) for _ in range(4)]
    for each in threads:
        each.start()
    for each in threads:
        each.join(60)
    assert errors == []
    assert asyncio.run(drain(store_url(database))) == Drained(sent=0, failed=0)
    counts = Counter(m.id for m in publisher.published)
    assert set(counts) == set(ids)
    assert set(counts.values()) == {1}
    assert sum(d.sent for d in done) == 300
    assert sum(1 for d in done if d.sent) >= 2  # the work was shared, not one relay's
    assert all(row[1] for row in rows(database).values())


async def test_a_relay_cancelled_between_publish_and_mark_publishes_again(
    database: Database,
) -> None:
    """Cancelled while its batch is in flight (one message confirmed, the next one being
    published). PostgreSQL and MariaDB: the relay's transaction rolls back, nothing is
    marked, and the next relay publishes both, the first a second time with the same id (at
    least once). SQLite (a claim is a lease): the confirmed one is marked sent on the way
    out and the other is due again at once."""
    migrated(database)
    ids = staged(database, keys=1, per_key=2)
    confirmed = asyncio.Event()

    class Stalling(Recording):
        async def publish(self, message: OutboxMessage) -> None:
            if self.published:
                confirmed.set()
                await asyncio.sleep(3600)  # the broker never answers: cancelled here
            await super().publish(message)

    stalling = Stalling()
    relay = Relay(store_url(database), stalling)
    task = asyncio.get_running_loop().create_task(relay.drain())
    await asyncio.wait_for(confirmed.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await relay.aclose()
    assert [m.id for m in stalling.published] == ids[:1]
    marked = [id_ for id_, row in rows(database).items() if row[1]]
    republished = ids if database.kind != "sqlite" else ids[1:]
    assert marked == ([] if database.kind != "sqlite" else ids[:1])
    again = Recording()
    async with Relay(store_url(database), again) as second:
        assert await second.drain() == Drained(sent=len(republished), failed=0)
    assert [m.id for m in again.published] == republished


async def test_relay_runs_as_a_task_inside_an_app(sqlite_database: Database) -> None:
    """running(): the relay polls in the background, publishes what is staged while it runs,
    and stops cleanly on leaving the block."""
    migrated(sqlite_database)
    publisher = Recording()
    relay = Relay(store_url(sqlite_database), publisher, poll=0.02)
    async with relay.running() as task:
        ids = await asyncio.to_thread(staged, sqlite_database, 2, 3)
        async with asyncio.timeout(10):
            while len(publisher.published) < len(ids):
                publisher.grew.clear()
                await publisher.grew.wait()
    assert task.cancelled()
    assert [m.id for m in publisher.published] == ids
    # Cancelled right after the last confirm, it still wrote the marks before stopping.
    assert all(row[1] for row in rows(sqlite_database).values())


async def test_relay_refuses_bad_settings_and_stores_without_sql() -> None:
    """Typed errors, before anything connects."""
    with pytest.raises(ConfigurationError, match="batch"):
        Relay("sqlite:///x.db", Recording(), batch=0)
    with pytest.raises(ConfigurationError, match="poll"):
        Relay("sqlite:///x.db", Recording(), poll=0)
    with pytest.raises(ConfigurationError, match="table"):
        Relay("sqlite:///x.db", Recording(), table="no such; table")
    with pytest.raises(ConfigurationError, match="needs a SQL store"):
        await Relay("memory://", Recording()).drain()
    assert isinstance(Recording(), Publisher)


def test_purge_deletes_sent_messages_past_retention_and_keeps_pending(
    database: Database,
) -> None:
    """Sent messages older than the retention go, in bounded batches; pending ones stay,
    whatever their age; stats counts what is left."""
    outbox = migrated(database)
    staged(database, keys=1, per_key=5)
    asyncio.run(drain(store_url(database)))
    pending = staged(database, keys=1, per_key=2)
    store = database.store()
    try:
        assert outbox.purge(store, retention=timedelta(hours=1)) == 0
        assert outbox.purge(store, retention=timedelta(0), limit=3) == 3
        assert outbox.purge(store, retention=timedelta(0), limit=3) == 2
        assert outbox.purge(store, retention=timedelta(0)) == 0
        assert outbox.stats(store) == {"pending": 2, "failing": 0, "sent": 0}
    finally:
        store.close()
    assert sorted(rows(database)) == sorted(pending)


# --- the command -----------------------------------------------------------------------------


@pytest.fixture
def cli_publisher(monkeypatch: pytest.MonkeyPatch) -> Recording:
    """What ``idempo relay --to test://...`` publishes to."""
    from idempo.outbox import publishers

    publisher = Recording()
    seen: list[tuple[str, dict[str, Any]]] = []

    def open_publisher(url: str, **options: Any) -> Publisher:
        if not url.startswith("test://"):
            raise ConfigurationError(f"no outbox publisher for {url}")
        seen.append((url, options))
        return publisher

    monkeypatch.setattr(publishers, "open_publisher", open_publisher)
    publisher.seen = seen  # type: ignore[attr-defined]
    return publisher


def test_cli_migrate_relay_stats_and_purge(database: Database, cli_publisher: Recording) -> None:
    """migrate makes the outbox table; stats shows the backlog; relay --once publishes it
    all and exits 0; purge then deletes what was sent."""
    url = store_url(database)
    migrated_ = runner.invoke(app, ["migrate", url])
    assert migrated_.exit_code == 0, migrated_.output
    assert "idempo_outbox" in migrated_.output
    ids = staged(database, keys=2, per_key=2)
    stats = runner.invoke(app, ["stats", url])
    assert stats.exit_code == 0, stats.output
    assert re.search(r"pending \(not sent yet\)\s*│\s*4\s*│", stats.output), stats.output
    relayed = runner.invoke(
        app, ["relay", "--store", url, "--to", "test://broker", "--once", "--batch", "3",
              "-o", "exchange=payments"],
    )  # fmt: skip
    assert relayed.exit_code == 0, relayed.output
    assert "published 4 message(s); 0 failed" in relayed.output
    assert [m.id for m in cli_publisher.published] == ids
    assert cli_publisher.seen == [("test://broker", {"exchange": "payments"})]  # type: ignore[attr-defined]
    assert cli_publisher.closed
    stats = runner.invoke(app, ["stats", url])
    assert re.search(r"sent \(kept until purged\)\s*│\s*4\s*│", stats.output), stats.output
    purged = runner.invoke(app, ["purge", url, "--outbox-retention", "0"])
    assert purged.exit_code == 0, purged.output
    assert "purged 4 outbox message(s)" in purged.output


def test_cli_relay_errors_are_one_line(sqlite_database: Database, cli_publisher: Recording) -> None:
    """A publisher URL nobody knows: exit 2; an outbox never migrated: exit 3 naming migrate;
    a failed publish with --once: exit 1, retried later. One line each, no traceback."""
    url = store_url(sqlite_database)
    unknown = runner.invoke(app, ["relay", "--store", url, "--to", "kafka://x", "--once"])
    assert unknown.exit_code == 2, unknown.output
    assert unknown.output.count("\n") == 1
    assert "no outbox publisher" in unknown.output
    missing = runner.invoke(app, ["relay", "--store", url, "--to", "test://b", "--once"])
    assert missing.exit_code == 3, missing.output
    assert "migrate" in missing.output
    assert "Traceback" not in missing.output
    stats = runner.invoke(app, ["stats", url])
    assert stats.exit_code == 0
    assert "outbox: no table idempo_outbox" in stats.output
    migrated(sqlite_database)
    staged(sqlite_database, keys=1, per_key=1)
    cli_publisher.fail = {1}
    failed = runner.invoke(app, ["relay", "--store", url, "--to", "test://b", "--once"])
    assert failed.exit_code == 1, failed.output
    assert "published 0 message(s); 1 failed (retried later)" in failed.output
    bad = runner.invoke(app, ["relay", "--store", url, "--to", "test://b", "-o", "nonsense"])
    assert bad.exit_code == 2
    assert "NAME=VALUE" in bad.output
    nowhere = Path(sqlite_database.location).with_name("never-migrated.db")
    absent = runner.invoke(app, ["relay", "--store", f"sqlite:///{nowhere}", "--to", "test://b"])
    assert absent.exit_code == 3, absent.output
    assert "the file does not exist" in absent.output
    assert not nowhere.exists()  # a relay creates no database


@pytest.mark.slow
def test_cli_relay_runs_until_sigterm_and_stops_cleanly(sqlite_database: Database) -> None:
    """``idempo relay`` without --once (a real process): it publishes what is staged, and
    SIGTERM ends it with exit 0 and every published message marked."""
    migrated(sqlite_database)
    ids = staged(sqlite_database, keys=2, per_key=2)
    log = Path(sqlite_database.location).with_suffix(".published")
    code = textwrap.dedent(f"""
        import sys
        from idempo.outbox import publishers

        class FilePublisher:
            async def publish(self, message):
                with open({str(log)!r}, "a") as out:
                    out.write(message.id + "\\n")
            async def aclose(self):
                pass

        publishers.open_publisher = lambda url, **options: FilePublisher()
        from idempo.cli import main
        sys.argv[0] = "idempo"
        main()
    """)
    url = store_url(sqlite_database)
    child = subprocess.Popen(
        [sys.executable, "-c", code, "relay", "--store", url, "--to", "test://b", "--poll", "0.05"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 20
        while not (log.exists() and len(log.read_text().split()) == len(ids)):
            assert time.monotonic() < deadline, "the relay published nothing"
            assert child.poll() is None, child.communicate()
            time.sleep(0.05)
        while not all(row[1] for row in rows(sqlite_database).values()):
            assert time.monotonic() < deadline, "the relay marked nothing"
            time.sleep(0.05)
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    assert child.returncode == 0, (out, err)
    assert "relaying" in out
    assert "Traceback" not in err
    assert log.read_text().split() == ids
