"""A reservation on SQLite reads the record first: a settled record is replayed, and a
mismatch refused, from that one read (no write transaction, no writer lock); anything else
(no record, one in progress, one expired) goes on to the atomic reservation. These tests
race that read against the first attempt settling or releasing, in threads and processes
with connections of their own, and hold its clock at the expiry boundaries."""

from __future__ import annotations

import asyncio
import multiprocessing
import queue
import sqlite3
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from helpers import migrated_sqlite
from idempo import Scope
from idempo._core.record import Acquired, InProgress, Mismatch, Replay
from idempo.errors import StoreUnavailableError
from idempo.stores.sqlite import AsyncSQLiteStore, SQLiteStore

LEASE, TTL = timedelta(seconds=30), timedelta(hours=1)
T0 = datetime(2030, 1, 1, tzinfo=UTC)
ONE_US = timedelta(microseconds=1)
DUPLICATES = 4
ROUNDS = 30
STEP = 30.0  # the most one step of a race waits, seconds


def _reserve(store: SQLiteStore, scope: Scope, fp: str = "fp", now: datetime | None = None) -> Any:
    return store.reserve(scope, fp, now=now, lease=LEASE, ttl=TTL)


def _settled(store: SQLiteStore, scope: Scope, now: datetime | None = None) -> int:
    acquired = _reserve(store, scope, now=now)
    assert isinstance(acquired, Acquired)
    store.complete(scope, acquired.token, b"first", now=now, ttl=TTL)
    return acquired.token


def _write_locked(path: Path) -> sqlite3.Connection:
    """Another connection holding the file's write lock."""
    blocker = sqlite3.connect(str(path), isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    return blocker


def test_a_settled_record_is_answered_past_a_held_write_lock(tmp_path: Path) -> None:
    """The replay and the mismatch are answered while another connection holds the write
    lock; a reservation that must write (a fresh key, a record in progress) waits for it."""
    store = migrated_sqlite(tmp_path / "idempo.db", busy_timeout=timedelta(milliseconds=50))
    settled, running = Scope.of("k-settled", operation="pay"), Scope.of("k-run", operation="pay")
    try:
        _settled(store, settled)
        assert isinstance(_reserve(store, running), Acquired)
        blocker = _write_locked(tmp_path / "idempo.db")
        try:
            replay = _reserve(store, settled)
            assert isinstance(replay, Replay)
            assert replay.record.response == b"first"
            assert isinstance(_reserve(store, settled, "another"), Mismatch)
            for must_write in (running, Scope.of("k-new", operation="pay")):
                with pytest.raises(StoreUnavailableError, match="locked"):
                    _reserve(store, must_write)
        finally:
            blocker.rollback()
            blocker.close()
    finally:
        store.close()


def test_the_async_store_answers_a_settled_record_without_suspending(tmp_path: Path) -> None:
    """On the event loop's thread too, past another connection's write lock."""
    store = AsyncSQLiteStore(str(tmp_path / "idempo.db"))
    scope = Scope.of("k-1", operation="pay")
    asyncio.run(store.migrate())
    try:
        _settled(store._sync, scope)
        blocker = _write_locked(tmp_path / "idempo.db")
        try:
            awaitable = store.reserve(scope, "fp", now=None, lease=LEASE, ttl=TTL)
            with pytest.raises(StopIteration) as done:
                awaitable.send(None)
            assert isinstance(done.value.value, Replay)
        finally:
            blocker.rollback()
            blocker.close()
    finally:
        asyncio.run(store.aclose())


def test_the_expiry_boundaries_are_judged_on_the_reservations_clock(tmp_path: Path) -> None:
    """A settled record replays (or refuses another fingerprint) until the microsecond its
    retention ends; from then on it is taken over. A lease in progress is waited for until
    the microsecond it ends, then taken over by the same request only."""
    store = migrated_sqlite(tmp_path / "idempo.db")
    try:
        done = Scope.of("k-done", operation="pay")
        first = _settled(store, done, now=T0)
        record = store.get(done)
        assert record is not None
        expires = record.expires_at
        assert isinstance(_reserve(store, done, now=expires - ONE_US), Replay)
        assert isinstance(_reserve(store, done, "another", now=expires - ONE_US), Mismatch)
        taken = _reserve(store, done, "another", now=expires)
        assert isinstance(taken, Acquired)
        assert taken.token > first

        running = Scope.of("k-run", operation="pay")
        assert isinstance(_reserve(store, running, now=T0), Acquired)
        lease_end = T0 + LEASE
        assert isinstance(_reserve(store, running, now=lease_end - ONE_US), InProgress)
        assert isinstance(_reserve(store, running, "another", now=lease_end), Mismatch)
        over = _reserve(store, running, now=lease_end)
        assert isinstance(over, Acquired)
        assert over.taken_over
    finally:
        store.close()


def test_a_record_that_cannot_be_read_is_left_to_the_reservation(tmp_path: Path) -> None:
    """A corrupt record is no answer for the read: the reservation decides, and takes it
    over once its retention is over (as it did before the read came first)."""
    path = tmp_path / "idempo.db"
    store = migrated_sqlite(path)
    scope = Scope.of("k-1", operation="pay")
    try:
        _settled(store, scope, now=T0)
        record = store.get(scope)
        assert record is not None
        with sqlite3.connect(str(path)) as conn:
            conn.execute("UPDATE idempo_records SET state = 'nonsense'")
        assert isinstance(_reserve(store, scope, now=record.expires_at), Acquired)
    finally:
        store.close()


# -- races: duplicates against a first attempt that settles or releases ----------------


def _duplicate(path: str, keys: list[str], barrier: Any, results: Any) -> None:
    """For each key: once the first attempt holds it, reserve it until a replay comes back,
    from a store of its own (its own connections and writer lock, as another process has).
    The first answer (in progress) comes before the barrier that lets the first attempt
    settle, so the rest race that settle. Puts every key's answers, in order, on ``results``."""
    store = SQLiteStore(path)
    rounds: list[list[str]] = []
    try:
        for key in keys:
            scope = Scope.of(key, operation="pay")
            answers: list[str] = []
            rounds.append(answers)
            barrier.wait(STEP)  # the first attempt holds the key
            for tries in range(100_000):
                reservation = _reserve(store, scope)
                answers.append(type(reservation).__name__)
                if tries == 0:
                    barrier.wait(STEP)  # everyone was told "in progress": settle now
                if isinstance(reservation, Acquired):
                    store.complete(scope, reservation.token, b"second", now=None, ttl=TTL)
                elif isinstance(reservation, Replay):
                    answers.append(bytes(reservation.record.response or b"").decode())
                    break
    finally:
        store.close()
        results.put(rounds)


def _race(tmp_path: Path, *, processes: bool, release: bool) -> list[list[list[str]]]:
    """A first attempt holds each key in turn while duplicates reserve it, then completes
    (or releases) it as they go on. Every duplicate's answers, key by key."""
    path = str(tmp_path / "idempo.db")
    first = migrated_sqlite(tmp_path / "idempo.db")
    keys = [f"k-{n}" for n in range(ROUNDS)]
    if processes:
        context: Any = multiprocessing.get_context("spawn")
        barrier, results = context.Barrier(DUPLICATES + 1), context.Queue()
        workers: list[Any] = [
            context.Process(target=_duplicate, args=(path, keys, barrier, results))
            for _ in range(DUPLICATES)
        ]
    else:
        barrier, results = threading.Barrier(DUPLICATES + 1), queue.Queue()
        workers = [
            threading.Thread(target=_duplicate, args=(path, keys, barrier, results))
            for _ in range(DUPLICATES)
        ]
    for worker in workers:
        worker.start()
    try:
        for key in keys:
            scope = Scope.of(key, operation="pay")
            held = _reserve(first, scope)
            assert isinstance(held, Acquired)
            barrier.wait(STEP)
            barrier.wait(STEP)
            if release:
                first.release(scope, held.token)
            else:
                first.complete(scope, held.token, b"first", now=None, ttl=TTL)
        return [results.get(timeout=STEP) for _ in workers]
    finally:
        first.close()
        for worker in workers:
            worker.join(STEP)


def _check(duplicates: list[list[list[str]]], *, release: bool) -> None:
    for n in range(ROUNDS):
        answered = [rounds[n] for rounds in duplicates]
        executed = sum(answers.count("Acquired") for answers in answered)
        # Released: exactly one duplicate runs it again; settled: none does.
        assert executed == (1 if release else 0), answered
        for answers in answered:
            assert answers[0] == "InProgress", answers
            *waits, last, body = answers
            assert last == "Replay", answers
            assert set(waits) <= {"InProgress", "Acquired"}, answers
            assert body == ("second" if release else "first"), answers


@pytest.mark.parametrize("release", [False, True], ids=["settles", "releases"])
def test_threads_race_a_first_attempt(tmp_path: Path, release: bool) -> None:
    """Threads with stores of their own on one file: while the first attempt is in progress
    they are told so (the read falls through to the reservation); once it settles they all
    replay its response; once it releases exactly one of them runs it again and the rest
    replay that one's."""
    _check(_race(tmp_path, processes=False, release=release), release=release)


@pytest.mark.parametrize("release", [False, True], ids=["settles", "releases"])
def test_processes_race_a_first_attempt(tmp_path: Path, release: bool) -> None:
    """The same with spawned processes sharing the file."""
    _check(_race(tmp_path, processes=True, release=release), release=release)
