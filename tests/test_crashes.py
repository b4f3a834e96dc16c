"""Crashes and pauses with real processes: SIGKILL mid-work, SIGSTOP past the lease.

A child process enters the guard, writes its business row, tells the parent it is mid-work
(one JSON line on stdout) and waits on stdin. The parent then SIGKILLs it, or freezes it with
SIGSTOP while another attempt takes the key over, and wakes it to finish. Nothing here sleeps
and hopes: the parent waits on the child's messages, on its exit, on PostgreSQL dropping the
dead backend, and, where a lease must really run out, polls to a bound.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

import psycopg
import pytest

from helpers import Database, new_key
from idempo import (
    Idempotency,
    Policy,
    RequestInProgressError,
    Scope,
    StoreUnavailableError,
)
from idempo.policy import utcnow

pytestmark = pytest.mark.slow

OPERATION = "crash"
LEASE = timedelta(seconds=1)
MESSAGE_TIMEOUT = 30.0  # a cold child imports psycopg and idempo before it says anything
BUSY_TIMEOUT = timedelta(seconds=10)  # SQLite's, for the parent's store
BUSINESS_COLUMNS = "idem_key TEXT NOT NULL, token INTEGER, worker TEXT"
# transactional / leased: on the app's connection; store: leased on the store's own connections
Mode = Literal["transactional", "leased", "store"]

CHILD = r"""
import json, sys
from datetime import timedelta

import psycopg

from idempo import FencedError, Idempotency, Policy
from idempo.stores.postgres import PostgresStore
from idempo.stores.sqlite import SQLiteStore

spec = json.loads(sys.argv[1])


def say(**message):
    print(json.dumps(message), flush=True)


if spec["kind"] == "postgres":
    store = PostgresStore(spec["location"], table=spec["records"], max_size=2)
    conn = psycopg.connect(spec["location"], autocommit=spec["autocommit"])
    backend = conn.info.backend_pid
elif spec["kind"] == "mysql":
    sys.path.insert(0, spec["tests"])
    from helpers import Database

    database = Database("mysql", spec["location"], spec["schema"])
    store = database.store(pool_size=2)
    conn = database.connect(store, autocommit=spec["autocommit"])
    backend = conn.thread_id()
else:
    store = SQLiteStore(spec["location"])
    conn = store.connect()
    backend = None
idem = Idempotency(store, Policy(lease=timedelta(seconds=spec["lease"])))
key = spec["key"]


def write(token):
    conn.execute(spec["insert"], (key, token, "child"))


guarded = None if spec["mode"] == "store" else conn
mode = "leased" if spec["mode"] == "store" else spec["mode"]
try:
    with idem.once(key, operation="crash", payload={"key": key}, conn=guarded, mode=mode) as a:
        assert not a.replayed
        if spec["write_first"]:
            write(a.token)
        say(state="mid-work", token=a.token, backend=backend)
        sys.stdin.readline()  # killed here, or paused here and then told to go on
        if not spec["write_first"]:
            write(a.token)
        a.result = {"by": "child", "token": a.token}
except FencedError as exc:
    say(state="fenced", error=str(exc))
else:
    say(state="completed")
"""


class Setup(Database):
    """A database with the crash tests' business table, and what the parent reads from it."""

    @property
    def insert(self) -> str:
        return self.sql(
            f"INSERT INTO {self.business_table} (idem_key, token, worker) VALUES (?, ?, ?)"
        )

    def rows(self) -> list[tuple[Any, ...]]:
        """The business rows as (token, worker)."""
        return self.select(
            f"SELECT token, worker FROM {self.business_table} ORDER BY token, worker"
        )

    def records(self) -> list[tuple[Any, ...]]:
        """The records as (state, token)."""
        return self.select(f"SELECT state, token FROM {self.records_table}")

    def lease_end(self, key: str) -> datetime:
        """When the key's lease ends."""
        rows = self.select(
            f"SELECT lease_expires_at FROM {self.records_table} WHERE idem_key = ?", (key,)
        )
        assert len(rows) == 1, rows
        value = rows[0][0]
        if self.kind == "sqlite":  # integer microseconds since the epoch
            return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(microseconds=value)
        if self.kind == "mysql":  # DATETIME(6) in UTC
            return value.replace(tzinfo=UTC)
        end: datetime = value
        return end

    def wait_backend_gone(self, pid: int | None) -> None:
        """The server notices a killed client on its own (and rolls its transaction back);
        wait (bounded) until it has."""
        if self.kind == "mysql" and pid is not None:
            deadline = time.monotonic() + 10
            while self.select("SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = ?", (pid,)):
                assert time.monotonic() < deadline, f"connection {pid} outlived its client"
                time.sleep(0.01)
        if self.kind != "postgres" or pid is None:
            return
        deadline = time.monotonic() + 10
        with psycopg.connect(self.location, autocommit=True) as pg:
            while pg.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone():
                assert time.monotonic() < deadline, f"backend {pid} outlived its client"
                time.sleep(0.01)


class Child:
    """A child process running CHILD, spoken to over its stdin and stdout."""

    def __init__(
        self, setup: Setup, mode: Mode, key: str, *, write_first: bool, autocommit: bool, log: Path
    ):
        spec = {
            "kind": setup.kind,
            "location": setup.location,
            "records": setup.records_table,
            "insert": setup.insert,
            "mode": mode,
            "key": key,
            "lease": LEASE.total_seconds(),
            "write_first": write_first,
            "autocommit": autocommit or mode == "store",
            "schema": setup.schema,
            "tests": str(Path(__file__).parent),
        }
        self._start(CHILD, spec, log)

    def _start(self, script: str, spec: dict[str, Any], log: Path) -> None:
        """Run ``script`` with ``spec`` as its argument (the Redis crash tests bring their
        own script)."""
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read_all, daemon=True)
        self._reader.start()
        self._log_path = log

    def _read_all(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def message(self) -> dict[str, Any]:
        """The child's next message; fails with its stderr if it died instead."""
        try:
            line = self._lines.get(timeout=MESSAGE_TIMEOUT)
        except queue.Empty:
            pytest.fail(f"the child said nothing for {MESSAGE_TIMEOUT}s")
        if line is None:
            self.proc.wait(timeout=10)
            pytest.fail(f"the child exited ({self.proc.returncode}): {self._log_path.read_text()}")
        message: dict[str, Any] = json.loads(line)
        return message

    def signal(self, signum: signal.Signals) -> None:
        os.kill(self.proc.pid, signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc.wait(timeout=10) == -signal.SIGKILL

    def go_on(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
        self._reader.join(timeout=10)
        self._log.close()


@contextmanager
def child(
    setup: Setup,
    mode: Mode,
    key: str,
    tmp_path: Path,
    *,
    write_first: bool = True,
    autocommit: bool = False,
) -> Iterator[Child]:
    """A child holding ``key`` mid-work. PostgreSQL: ``autocommit`` sets its app connection's
    mode (SQLite connections are always in autocommit mode: the guard begins transactions)."""
    running = Child(
        setup, mode, key, write_first=write_first, autocommit=autocommit, log=tmp_path / "child.log"
    )
    try:
        yield running
    finally:
        running.close()


@dataclass
class Parent:
    """The parent's own attempts at the key: its store, its app connection and its policy."""

    setup: Setup
    store: Any
    conn: Any
    mode: Mode
    executions: int = 0

    def attempt(
        self, key: str, *, clock: Callable[[], datetime] = utcnow, **policy: Any
    ) -> tuple[bool, Any]:
        """(replayed, result) of one guarded call whose work writes a business row."""
        idem = Idempotency(self.store, Policy(lease=LEASE, clock=clock, **policy))
        guarded = None if self.mode == "store" else self.conn
        mode = "leased" if self.mode == "store" else self.mode
        guard = idem.once(key, operation=OPERATION, payload={"key": key}, conn=guarded, mode=mode)
        with guard as a:
            if a.replayed:
                return True, a.result
            self.executions += 1
            self.conn.execute(self.setup.insert, (key, a.token, "parent"))
            a.result = {"by": "parent", "token": a.token}
        return False, a.result


@contextmanager
def parent(setup: Setup, mode: Mode, *, busy_timeout: timedelta = BUSY_TIMEOUT) -> Iterator[Parent]:
    store = setup.store(busy_timeout=busy_timeout)
    conn = setup.connect(store, autocommit=mode == "store")
    try:
        yield Parent(setup, store, conn, mode)
    finally:
        conn.close()
        store.close()


def with_business_table(database: Database) -> Setup:
    """``database`` as a `Setup`, with an empty business table."""
    setup = Setup(**asdict(database))
    setup.create_business_table(BUSINESS_COLUMNS)
    return setup


@pytest.fixture
def setup(database: Database) -> Setup:
    """A migrated store with an empty business table (no unique constraint on the key)."""
    return with_business_table(database)


# -- transactional mode --------------------------------------------------------------------


def test_sigkill_in_transactional_mode_commits_nothing(setup: Setup, tmp_path: Path) -> None:
    """A child SIGKILLed mid-work in transactional mode leaves no record and no business row,
    and the retry executes exactly once and then replays."""
    key = new_key()
    with child(setup, "transactional", key, tmp_path) as running:
        said = running.message()
        assert said["state"] == "mid-work"
        # While it works, nothing of it is visible and a duplicate is told to come back.
        assert setup.records() == []
        assert setup.rows() == []
        with parent(setup, "transactional", busy_timeout=timedelta(milliseconds=200)) as dup:
            with pytest.raises(RequestInProgressError):
                dup.attempt(key, lock_timeout=timedelta(milliseconds=200))
            assert dup.executions == 0
        running.kill()
        setup.wait_backend_gone(said["backend"])

    assert setup.records() == []
    assert setup.rows() == []
    with parent(setup, "transactional") as retry:
        replayed, first = retry.attempt(key)
        # The token is the store's counter's next value: the dead child's reservation may
        # have used one up (a sequence does not roll back), so only its owner is known.
        assert (replayed, first["by"]) == (False, "parent")
        assert retry.attempt(key) == (True, first)
        assert retry.executions == 1
    assert setup.records() == [("completed", first["token"])]
    assert setup.rows() == [(first["token"], "parent")]


# -- leased mode ---------------------------------------------------------------------------

LEASED_MODES = [
    pytest.param("leased", id="leased-on-app-connection"),
    pytest.param("store", id="leased-on-store-connections"),
]


def take_over_after_expiry(retry: Parent, key: str, lease_end: datetime) -> Any:
    """Poll, to a bound, until the lease really runs out and an attempt takes the key over.

    Every attempt that starts before the lease ends must be told the key is in progress.
    """
    deadline = time.monotonic() + 10
    while True:
        started = utcnow()
        try:
            replayed, result = retry.attempt(key)
        except RequestInProgressError:
            assert started < lease_end
            assert time.monotonic() < deadline, "the lease never ran out"
            time.sleep(0.05)
            continue
        assert not replayed
        assert utcnow() >= lease_end
        return result


def taken_over_once_the_lease_ends(
    retry: Parent, key: str, lease_end: datetime, first_token: int
) -> Any:
    """A duplicate a moment before ``lease_end`` is told to come back very soon and runs
    nothing; after it, one takes the key over with a larger token than the first holder's,
    runs once and then replays."""
    just_before = lease_end - timedelta(milliseconds=1)
    with pytest.raises(RequestInProgressError) as raised:
        retry.attempt(key, clock=lambda: just_before)
    assert 0 < raised.value.retry_after <= 0.01
    assert retry.executions == 0

    result = take_over_after_expiry(retry, key, lease_end)
    assert result["by"] == "parent"
    assert result["token"] > first_token
    assert retry.attempt(key) == (True, result)
    assert retry.executions == 1
    return result


@pytest.mark.parametrize("mode", LEASED_MODES)
def test_sigkill_in_leased_mode_is_taken_over_after_the_lease(
    setup: Setup, mode: Mode, tmp_path: Path
) -> None:
    """After a child is SIGKILLed mid-work in leased mode, a duplicate is told the key is in
    progress until the lease ends, then takes over with a larger token and executes once."""
    key = new_key()
    with child(setup, mode, key, tmp_path) as running:
        said = running.message()
        assert said["state"] == "mid-work"
        first_token = said["token"]
        running.kill()
        setup.wait_backend_gone(said["backend"])

    assert setup.records() == [("in_progress", first_token)]
    # On the app's connection the dead child's business row died with its transaction; on the
    # store's own connections it had committed by itself: leased mode's documented gap between
    # the work and the record.
    child_rows = [(first_token, "child")] if mode == "store" else []
    assert setup.rows() == child_rows
    lease_end = setup.lease_end(key)

    with parent(setup, mode) as retry:
        token = taken_over_once_the_lease_ends(retry, key, lease_end, first_token)["token"]
    assert setup.records() == [("completed", token)]
    assert setup.rows() == [*child_rows, (token, "parent")]


def fenced_on_waking(running: Child, take_over: Callable[[], Any], first_token: int) -> Any:
    """Freeze the child mid-work (SIGSTOP, holding ``first_token``), let ``take_over`` take
    its key (a larger token), wake it (SIGCONT): its completion is refused with FencedError.
    The new holder's result."""
    running.signal(signal.SIGSTOP)
    result = take_over()
    assert result["by"] == "parent"
    assert result["token"] > first_token
    running.signal(signal.SIGCONT)
    running.go_on()
    finished = running.message()
    assert finished["state"] == "fenced", finished
    assert running.proc.wait(timeout=10) == 0
    return result


@pytest.mark.parametrize("mode", LEASED_MODES)
def test_paused_holder_is_fenced_after_a_takeover(setup: Setup, mode: Mode, tmp_path: Path) -> None:
    """A holder frozen (SIGSTOP) past its lease while another attempt takes over is refused
    with FencedError when it tries to complete; on the app's connection its business write
    rolls back, leaving exactly the new holder's row."""
    key = new_key()
    # SQLite has one writer: a holder that has written holds the file's write lock until it
    # ends, so nothing could take over while it is frozen. That child writes after it wakes.
    write_first = not (setup.kind == "sqlite" and mode == "leased")
    # An autocommit app connection is the harder case: the guard must begin the transaction
    # that its refused completion then rolls back.
    with child(setup, mode, key, tmp_path, write_first=write_first, autocommit=True) as running:
        said = running.message()
        assert said["state"] == "mid-work"
        first_token = said["token"]
        with parent(setup, mode, busy_timeout=timedelta(seconds=3)) as other:
            result = fenced_on_waking(
                running,
                lambda: take_over_after_expiry(other, key, setup.lease_end(key)),
                first_token,
            )
            assert other.attempt(key) == (True, result)
            assert other.executions == 1
    assert setup.records() == [("completed", result["token"])]
    # On the store's own connections the zombie's row had committed by itself (leased mode's
    # documented gap); its completion was refused all the same.
    child_rows = [(first_token, "child")] if mode == "store" else []
    assert setup.rows() == [*child_rows, (result["token"], "parent")]


# -- faults --------------------------------------------------------------------------------


def test_sqlite_locked_past_the_busy_timeout_fails_closed(sqlite_database: Database) -> None:
    """While another connection keeps SQLite's write lock past the busy timeout, a guarded call
    on the store's own connections raises StoreUnavailableError (an IdempotencyError) and runs
    nothing, while reading a record still answers from its WAL snapshot."""
    setup = with_business_table(sqlite_database)
    holder = sqlite3.connect(setup.location, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with parent(setup, "store", busy_timeout=timedelta(milliseconds=100)) as blocked:
            with pytest.raises(StoreUnavailableError, match="locked"):
                blocked.attempt("k-locked")
            assert blocked.store.get(Scope.of("k-locked", operation=OPERATION)) is None
            assert blocked.executions == 0
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    assert setup.records() == []
