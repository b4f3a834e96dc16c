"""SQLite's fresh call without transactions: a fresh key is reserved by one autocommit
INSERT whose token is the reservation's time in microseconds, made only when that is past
the token counter (which triggers keep); a settle within the retention is one autocommit
UPDATE fenced on the token. Anything those statements do not change goes to the
transactions as before, and so does a file migrated before the triggers.

These tests count the statements, hold the tokens to SPEC §2 rule 8 across deletions, race
duplicates in threads and processes on one file, kill a holder, and fence a stale one.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import queue
import signal
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from helpers import migrated_sqlite
from idempo import FencedError, Scope, Status
from idempo._core.ops import Reserve
from idempo._core.record import Acquired, InProgress, Replay
from idempo.cli import app
from idempo.doctor import Level, diagnose
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore

LEASE, TTL = timedelta(seconds=30), timedelta(hours=1)
T0 = datetime(2030, 1, 1, tzinfo=UTC)
ONE_US = timedelta(microseconds=1)
DUPLICATES = 4
ROUNDS = 20
STEP = 30.0  # the most one step of a race waits, seconds


def _us(when: datetime) -> int:
    return (when - datetime(1970, 1, 1, tzinfo=UTC)) // ONE_US


def _reserve(store: Any, scope: Scope, now: datetime | None = None, fp: str = "fp") -> Any:
    return store.reserve(scope, fp, now=now, lease=LEASE, ttl=TTL)


def _counter(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        ((value,),) = conn.execute("SELECT value FROM idempo_records_tokens").fetchall()
    return int(value)


def _drop_triggers(path: Path) -> None:
    """The file as `migrate` left it before the triggers existed."""
    with sqlite3.connect(path, isolation_level=None) as conn:
        for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'"):
            conn.execute(f"DROP TRIGGER {name}")
    conn.close()


@pytest.fixture
def executed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every statement idempo's connections run from now on (not a trigger's, which is
    part of the statement that fires it), by its first words."""
    seen: list[str] = []

    class Cursor(sqlite3.Cursor):
        def execute(self, sql: str, *args: Any) -> Any:  # type: ignore[override]
            seen.append(sql)
            return super().execute(sql, *args)

    class Connection(sqlite3.Connection):
        def execute(self, sql: str, *args: Any) -> Any:  # type: ignore[override]
            seen.append(sql)
            return super().execute(sql, *args)

        def cursor(self, *args: Any) -> Any:  # type: ignore[override]
            return super().cursor(Cursor)

    real = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        return real(*args, factory=Connection, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    return seen


def _verbs(statements: list[str]) -> list[str]:
    return [" ".join(sql.split()[:2]) for sql in statements if not sql.startswith("PRAGMA")]


def _fresh_call(store: SQLiteStore, scope: Scope, now: datetime | None = None) -> int:
    acquired = _reserve(store, scope, now)
    assert isinstance(acquired, Acquired)
    store.complete(scope, acquired.token, b"done", now=now, ttl=TTL)
    return acquired.token


# -- statements ------------------------------------------------------------------------------


def test_a_fresh_call_is_three_statements(tmp_path: Path, executed: list[str]) -> None:
    """The record's read, the INSERT and the settling UPDATE: no BEGIN, no COMMIT, no
    counter statement (the trigger moves it inside the INSERT)."""
    store = migrated_sqlite(tmp_path / "idempo.db")
    try:
        _fresh_call(store, Scope.of("k-warm", operation="pay"))  # opens, asks for triggers
        for n in range(5):
            executed.clear()
            _fresh_call(store, Scope.of(f"k-{n}", operation="pay"))
            assert _verbs(executed) == ["SELECT principal,", "INSERT INTO", "UPDATE idempo_records"]
        executed.clear()
        replay = _reserve(store, Scope.of("k-0", operation="pay"))
        assert isinstance(replay, Replay)
        assert _verbs(executed) == ["SELECT principal,"]
    finally:
        store.close()


def test_the_async_store_runs_them_at_once(tmp_path: Path, executed: list[str]) -> None:
    """On the event loop's thread, without suspending: the same three statements."""
    store = AsyncSQLiteStore(str(tmp_path / "idempo.db"))

    def at_once(awaitable: Any) -> Any:
        with pytest.raises(StopIteration) as done:
            awaitable.send(None)
        return done.value.value

    async def migrate() -> None:
        await store.migrate()

    asyncio.run(migrate())
    try:
        for n in range(3):
            executed.clear()
            scope = Scope.of(f"k-{n}", operation="pay")
            acquired = at_once(_reserve(store, scope))
            assert isinstance(acquired, Acquired)
            at_once(store.complete(scope, acquired.token, b"done", now=None, ttl=TTL))
            verbs = [v for v in _verbs(executed) if not v.startswith("SELECT count(*)")]
            assert verbs == ["SELECT principal,", "INSERT INTO", "UPDATE idempo_records"]
        record = store._sync.get(Scope.of("k-2", operation="pay"))
        assert record is not None
        assert (record.status, record.response) == (Status.COMPLETED, b"done")
    finally:
        asyncio.run(store.aclose())


def test_one_write_in_64_goes_to_a_connection_that_checkpoints(tmp_path: Path) -> None:
    """The connections that never wait never checkpoint the write-ahead log, so the single
    statements leave the checkpointing turn to the transaction on the thread's own
    connection, as `run_now` does."""
    store = migrated_sqlite(tmp_path / "idempo.db")
    ran: list[Any] = []
    run = store._run

    def counted(gen: Any) -> Any:
        ran.append(gen)
        return run(gen)

    store._run = counted
    try:
        for n in range(70):
            _fresh_call(store, Scope.of(f"k-{n}", operation="pay"))
        assert 1 <= len(ran) <= 4
    finally:
        store.close()


# -- tokens (SPEC §2 rule 8) -----------------------------------------------------------------


def test_the_token_is_the_time_and_the_counter_follows(tmp_path: Path) -> None:
    store = migrated_sqlite(tmp_path / "idempo.db")
    try:
        token = _fresh_call(store, Scope.of("k-1", operation="pay"), T0)
        assert token == _us(T0)
        assert _counter(tmp_path / "idempo.db") == token
    finally:
        store.close()


def test_tokens_grow_across_evict_when_the_clock_does_not(tmp_path: Path) -> None:
    """After the record is gone, a reservation at the same instant (or one earlier, a
    clock set back) cannot take the time as its token: it takes the counter's next."""
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    scope = Scope.of("k-1", operation="pay")
    try:
        tokens = [_fresh_call(store, scope, T0)]
        for when in (T0, T0 - timedelta(hours=1), T0 + ONE_US):
            assert store.evict(scope) is True
            tokens.append(_fresh_call(store, scope, when))
        assert tokens == sorted(set(tokens)), tokens
        assert tokens[1] == tokens[0] + 1
        assert _counter(path) == tokens[-1]
    finally:
        store.close()


def test_tokens_grow_across_purge_with_the_single_statement(tmp_path: Path) -> None:
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    scope = Scope.of("k-1", operation="pay")
    try:
        first = _fresh_call(store, scope, T0)
        assert store.purge(before=T0 + LEASE + TTL + timedelta(days=1)) == 1
        assert store.get(scope) is None
        second = _fresh_call(store, scope, T0)
        assert second > first
        stalled = Scope.of("k-1", operation="pay")
        with pytest.raises(FencedError):
            store.complete(stalled, first, b"stale", now=T0, ttl=TTL)
    finally:
        store.close()


def test_a_takeover_moves_the_counter_too(tmp_path: Path) -> None:
    """The UPDATE OF token trigger: a takeover's token is counted, so a fresh key reserved
    afterwards at an earlier instant still gets a larger token."""
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    try:
        scope = Scope.of("k-1", operation="pay")
        first = _reserve(store, scope, T0)
        later = T0 + LEASE + timedelta(minutes=5)
        taken = _reserve(store, scope, later)
        assert isinstance(taken, Acquired)
        assert taken.taken_over
        assert taken.token == _us(later) > first.token
        assert _counter(path) == taken.token
        other = _reserve(store, Scope.of("k-2", operation="pay"), T0 + ONE_US)
        assert other.token == taken.token + 1
    finally:
        store.close()


def test_a_hand_edited_token_does_not_stop_the_counter(tmp_path: Path) -> None:
    """The triggers follow integers only: SQLite orders text after every number."""
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    try:
        token = _fresh_call(store, Scope.of("k-1", operation="pay"), T0)
        with sqlite3.connect(path, isolation_level=None) as conn:
            conn.execute("UPDATE idempo_records SET token = 'abc'")
        conn.close()
        assert _counter(path) == token
        assert _fresh_call(store, Scope.of("k-2", operation="pay"), T0) == token + 1
    finally:
        store.close()


# -- settling --------------------------------------------------------------------------------


def test_a_settle_that_must_move_the_expiry_takes_the_transaction(tmp_path: Path) -> None:
    """A completion whose retention ends past the reservation's (a longer ttl, or a
    lease renewed... past it) moves ``expires_at``; within it, ``expires_at`` stays."""
    store = migrated_sqlite(tmp_path / "idempo.db")
    try:
        kept, moved = Scope.of("k-kept", operation="pay"), Scope.of("k-moved", operation="pay")
        for scope, ttl in ((kept, TTL), (moved, TTL * 3)):
            acquired = _reserve(store, scope, T0)
            store.complete(scope, acquired.token, b"done", now=T0 + ONE_US, ttl=ttl)
        kept_record, moved_record = store.get(kept), store.get(moved)
        assert kept_record is not None
        assert moved_record is not None
        assert kept_record.expires_at == T0 + LEASE + TTL
        assert moved_record.expires_at == T0 + ONE_US + TTL * 3
        assert moved_record.status is Status.COMPLETED
        assert kept_record.updated_at == T0 + ONE_US
    finally:
        store.close()


def test_a_stale_holder_is_fenced(tmp_path: Path) -> None:
    """A holder past its lease, taken over: its complete and fail raise FencedError, its
    release does nothing; the new holder's record is untouched."""
    store = migrated_sqlite(tmp_path / "idempo.db")
    scope = Scope.of("k-1", operation="pay")
    try:
        stale = _reserve(store, scope, T0)
        later = T0 + LEASE + ONE_US
        fresh = _reserve(store, scope, later)
        assert isinstance(fresh, Acquired)
        assert fresh.token > stale.token
        with pytest.raises(FencedError):
            store.complete(scope, stale.token, b"stale", now=later, ttl=TTL)
        with pytest.raises(FencedError):
            store.fail(scope, stale.token, b"stale", now=later, ttl=TTL)
        store.release(scope, stale.token)
        record = store.get(scope)
        assert record is not None
        assert (record.status, record.token) == (Status.IN_PROGRESS, fresh.token)
        store.complete(scope, fresh.token, b"fresh", now=later, ttl=TTL)
        with pytest.raises(FencedError):
            store.complete(scope, stale.token, b"stale", now=later, ttl=TTL)
        replay = _reserve(store, scope, later)
        assert isinstance(replay, Replay)
        assert replay.record.response == b"fresh"
    finally:
        store.close()


def test_a_settle_retried_with_the_same_outcome_is_accepted(tmp_path: Path) -> None:
    """A settle whose answer was lost, sent again: the single UPDATE changes nothing, and
    the transaction finds the record already holds that outcome."""
    store = migrated_sqlite(tmp_path / "idempo.db")
    scope = Scope.of("k-1", operation="pay")
    try:
        token = _fresh_call(store, scope, T0)
        store.complete(scope, token, b"done", now=T0, ttl=TTL)
        with pytest.raises(FencedError):
            store.complete(scope, token, b"another", now=T0, ttl=TTL)
    finally:
        store.close()


# -- a file from before the triggers ---------------------------------------------------------


def test_an_old_file_keeps_the_transaction_and_the_doctor_says_so(
    tmp_path: Path, executed: list[str]
) -> None:
    """Without the triggers, the INSERT would leave the counter behind: the store asks the
    file once, reserves in its write transaction (which moves the counter itself), and the
    doctor warns until `idempo migrate` runs again; then the single statement is used."""
    path = tmp_path / "idempo.db"
    migrated_sqlite(path).close()
    _drop_triggers(path)
    report = diagnose(f"sqlite:///{path}")
    found = {finding.check: finding for finding in report.findings}
    assert found["token_triggers"].level is Level.WARN
    assert "idempo migrate" in (found["token_triggers"].fix or "")
    assert report.exit_code == 1

    store = SQLiteStore(str(path))
    try:
        executed.clear()
        tokens = [_fresh_call(store, Scope.of("k-1", operation="pay"), T0)]
        verbs = _verbs(executed)
        assert verbs.count("SELECT count(*)") == 1
        assert "BEGIN IMMEDIATE" in verbs
        assert "UPDATE idempo_records_tokens" in verbs
        assert _counter(path) == tokens[0]
        executed.clear()
        tokens.append(_fresh_call(store, Scope.of("k-2", operation="pay"), T0))
        assert "SELECT count(*)" not in _verbs(executed)  # asked once
        assert "BEGIN IMMEDIATE" in _verbs(executed)
        assert tokens[1] == tokens[0] + 1

        assert CliRunner().invoke(app, ["migrate", f"sqlite:///{path}"]).exit_code == 0
        report = diagnose(f"sqlite:///{path}")
        assert {f.check: f.level for f in report.findings}["token_triggers"] is Level.PASS
        assert report.exit_code == 0
        store.migrate()  # the store's own migrate asks again
        executed.clear()
        tokens.append(_fresh_call(store, Scope.of("k-3", operation="pay"), T0 + ONE_US * 5))
        assert "BEGIN IMMEDIATE" not in _verbs(executed)
        assert tokens[2] == _us(T0) + 5
    finally:
        store.close()


def test_migrate_adds_the_triggers_and_keeps_the_counter(tmp_path: Path) -> None:
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    token = _fresh_call(store, Scope.of("k-1", operation="pay"), T0)
    store.close()
    _drop_triggers(path)
    for _ in range(2):
        migrated_sqlite(path).close()
    with sqlite3.connect(path) as conn:
        names = {name for (name,) in conn.execute("SELECT name FROM sqlite_master")}
    conn.close()
    assert {"idempo_records_token_made", "idempo_records_token_moved"} <= names
    assert _counter(path) == token


def test_migrate_leaves_one_counter_row_the_largest(tmp_path: Path) -> None:
    """Migrating again adds no row (it did: an aggregate over no rows is still a row), and
    a file that got extra rows that way keeps only the largest."""
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    token = _fresh_call(store, Scope.of("k-1", operation="pay"), T0)
    store.migrate()
    store.close()
    with sqlite3.connect(path, isolation_level=None) as conn:
        assert conn.execute("SELECT count(*) FROM idempo_records_tokens").fetchone() == (1,)
        conn.execute("INSERT INTO idempo_records_tokens (value) VALUES (5)")
        conn.execute("DELETE FROM idempo_records")
    conn.close()
    migrated_sqlite(path).close()
    assert _counter(path) == token


# -- races -----------------------------------------------------------------------------------


def _duplicate(path: str, keys: list[str], barrier: Any, results: Any, asynchronous: bool) -> None:
    """For each key, at the barrier: reserve it (a store of its own: its own connections and
    writer lock, as another process has), complete it if acquired. Puts each key's answer."""
    answers: list[str] = []
    if asynchronous:
        store: Any = AsyncSQLiteStore(path)

        async def reserve(scope: Scope) -> Any:
            got = await _reserve(store, scope)
            if isinstance(got, Acquired):
                await store.complete(scope, got.token, b"once", now=None, ttl=TTL)
            return got

        loop = asyncio.new_event_loop()
        call = lambda scope: loop.run_until_complete(reserve(scope))  # noqa: E731
    else:
        store = SQLiteStore(path)

        def call(scope: Scope) -> Any:
            got = _reserve(store, scope)
            if isinstance(got, Acquired):
                store.complete(scope, got.token, b"once", now=None, ttl=TTL)
            return got

    try:
        for key in keys:
            barrier.wait(STEP)
            answers.append(type(call(Scope.of(key, operation="pay"))).__name__)
    finally:
        if asynchronous:
            loop.run_until_complete(store.aclose())
            loop.close()
        else:
            store.close()
        results.put(answers)


def _workers(
    processes: bool, target: Any, args: list[tuple[Any, ...]], last: Any, *, indexed: bool = False
) -> list[Any]:
    """Run ``target(*args[i], barrier, results, last or i)`` in a thread or spawned process
    each, sharing a barrier and a results queue; what each put there."""
    context: Any = multiprocessing.get_context("spawn") if processes else None
    barrier = context.Barrier(len(args)) if processes else threading.Barrier(len(args))
    results = context.Queue() if processes else queue.Queue()
    kind = context.Process if processes else threading.Thread
    workers = [
        kind(target=target, args=(*each, barrier, results, index if indexed else last))
        for index, each in enumerate(args)
    ]
    for worker in workers:
        worker.start()
    try:
        return [results.get(timeout=STEP * 2) for _ in workers]
    finally:
        for worker in workers:
            worker.join(STEP)


def _race(tmp_path: Path, *, processes: bool, asynchronous: bool = False) -> list[list[str]]:
    path = tmp_path / "idempo.db"
    migrated_sqlite(path).close()
    keys = [f"k-{n}" for n in range(ROUNDS)]
    answered = _workers(processes, _duplicate, [(str(path), keys)] * DUPLICATES, asynchronous)
    store = SQLiteStore(str(path))
    try:
        for key in keys:
            record = store.get(Scope.of(key, operation="pay"))
            assert record is not None
            assert (record.status, record.response) == (Status.COMPLETED, b"once")
    finally:
        store.close()
    return [[answers[n] for answers in answered] for n in range(ROUNDS)]


def _one_winner(rounds: list[list[str]]) -> None:
    for answers in rounds:
        assert answers.count("Acquired") == 1, rounds
        assert set(answers) <= {"Acquired", "InProgress", "Replay"}, rounds


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_duplicates_in_threads_have_one_winner(tmp_path: Path, asynchronous: bool) -> None:
    _one_winner(_race(tmp_path, processes=False, asynchronous=asynchronous))


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_duplicates_in_processes_have_one_winner(tmp_path: Path, asynchronous: bool) -> None:
    _one_winner(_race(tmp_path, processes=True, asynchronous=asynchronous))


def _statement(path: str, keys: list[str], barrier: Any, results: Any, index: int) -> None:
    """For each key, at the barrier: the single INSERT itself, on a connection that waits
    for the lock (so every duplicate runs it, one after another), each at its own instant.
    Puts how many rows each changed."""
    dialect = SQLiteStore(path).dialect
    conn = sqlite3.connect(path, timeout=STEP, isolation_level=None)
    made: list[int] = []
    try:
        for n, key in enumerate(keys):
            op = Reserve(Scope.of(key, operation="pay"), "fp", None, LEASE, TTL)
            params = dialect.alone_reserve_params(op, _us(T0) + n * DUPLICATES + index)
            barrier.wait(STEP)
            made.append(conn.execute(dialect.alone_insert_sql, params).rowcount)
    finally:
        conn.close()
        results.put(made)


@pytest.mark.parametrize("processes", [False, True], ids=["threads", "processes"])
def test_the_single_statement_makes_one_record_among_duplicates(
    tmp_path: Path, processes: bool
) -> None:
    """SPEC §2 rule 1 for the statement alone: of duplicates that all run it, exactly one
    makes the record; the rest change nothing (and would go on to the transaction)."""
    path = tmp_path / "idempo.db"
    migrated_sqlite(path).close()
    keys = [f"k-{n}" for n in range(ROUNDS)]
    made = _workers(processes, _statement, [(str(path), keys)] * DUPLICATES, None, indexed=True)
    for n in range(ROUNDS):
        assert sum(rows[n] for rows in made) == 1, made
    assert _counter(path) >= _us(T0) + (ROUNDS - 1) * DUPLICATES


# -- a holder killed -------------------------------------------------------------------------


def _holder(path: str, said: Any) -> None:
    """Reserve a key at T0 with the single statement, say its token, then hang."""
    store = SQLiteStore(path)
    got = _reserve(store, Scope.of("k-killed", operation="pay"), T0)
    said.put(got.token if isinstance(got, Acquired) else repr(got))
    threading.Event().wait(STEP * 4)


def test_a_killed_holder_is_taken_over_after_its_lease(tmp_path: Path) -> None:
    """SIGKILL after the INSERT committed: the record is there, in progress until its lease
    ends; then a duplicate takes it over with a larger token, and the dead holder's token
    is fenced."""
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    context: Any = multiprocessing.get_context("spawn")
    said = context.Queue()
    holder = context.Process(target=_holder, args=(str(path), said))
    holder.start()
    try:
        token = said.get(timeout=STEP * 2)
        assert token == _us(T0)
    finally:
        assert holder.pid is not None
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(STEP)
    assert holder.exitcode == -signal.SIGKILL
    scope = Scope.of("k-killed", operation="pay")
    try:
        waiting = _reserve(store, scope, T0 + LEASE - ONE_US)
        assert isinstance(waiting, InProgress)
        taken = _reserve(store, scope, T0 + LEASE)
        assert isinstance(taken, Acquired)
        assert taken.taken_over
        assert taken.token > token
        with pytest.raises(FencedError):
            store.complete(scope, token, b"dead", now=T0 + LEASE, ttl=TTL)
        store.complete(scope, taken.token, b"alive", now=T0 + LEASE, ttl=TTL)
        replay = _reserve(store, scope, T0 + LEASE)
        assert isinstance(replay, Replay)
        assert replay.record.response == b"alive"
    finally:
        store.close()


# -- a lock held elsewhere -------------------------------------------------------------------


def test_a_held_write_lock_sends_the_call_to_the_transaction(tmp_path: Path) -> None:
    """The single statement never waits for another process's lock (its connection's busy
    timeout is zero): with the lock held, the reservation waits in its transaction and
    lands once the lock is gone, with the lease counted from then."""
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    result: list[Any] = []
    scope = Scope.of("k-1", operation="pay")
    thread = threading.Thread(target=lambda: result.append(_reserve(store, scope)))
    try:
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # waiting for the lock, in BEGIN IMMEDIATE
        released = datetime.now(UTC)
        blocker.rollback()
        thread.join(STEP)
        (acquired,) = result
        assert isinstance(acquired, Acquired)
        record = store.get(scope)
        assert record is not None
        assert record.created_at >= released
    finally:
        blocker.close()
        store.close()
