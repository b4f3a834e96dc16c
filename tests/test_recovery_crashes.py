"""Recovery points under SIGKILL: a three-step order killed at every crash point, then resumed.

The order (reserve stock, charge, notify, then a confirmation written with the completion)
runs in a child process, which SIGKILLs itself at one named crash point: before each step's
writes, inside each step (after its writes, before its checkpoint), right after each
checkpoint, after the last writes before the completion, and after the completion. Every
point, not a sample: `POINTS`, eleven per store. One spawned child (for the whole module)
imports everything once and forks a fresh process per point, which opens its own store and
connections, runs the order and kills itself there (``os.kill(os.getpid(), SIGKILL)``,
landed where the point is named); the points of one store run at once, on keys of their own.

On SQLite, PostgreSQL and MariaDB the steps write on the app's connection in leased mode: a
step's business row commits with its checkpoint, the confirmation with the completion (and
again with PostgreSQL's connection left in autocommit mode). On Redis, and on SQLite used
without the app's connection, the checkpoints go over the store's own connection and the
effects to a sink that deduplicates on `Attempt.downstream_key` (a SQLite table whose key
column is UNIQUE, standing in for a PSP that honours idempotency keys), which counts every
call too. Then holders killed one after another on one key hand their steps on.

After each kill the parent checks the record the child left, is told the key is in progress
until the lease ends, then takes it over (a larger token), resumes after the last recorded
step, and finds each step's effect exactly once and a result that a later duplicate replays
byte for byte. Then a stale holder (a live child whose lease ran out while another attempt
took over) has its checkpoint refused, its step's writes rolled back, and the record keeps
the new holder's point.

This file is also the child: ``python tests/test_recovery_crashes.py serve``.
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
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from helpers import Database, new_key
from idempo import (
    FencedError,
    Idempotency,
    Policy,
    RequestInProgressError,
    Scope,
    Status,
)
from idempo._core.progress import Progress
from idempo.guard import Attempt
from idempo.policy import utcnow
from idempo.stores.redis import RedisStore

pytestmark = pytest.mark.slow

OPERATION = "place-order"
ORDER = {"order": 7, "sku": "book-42", "qty": 1}
STEPS = ("reserve-stock", "charge", "notify")
CONFIRM = "confirm"  # the last writes, committed with the completion (SQL)
# Every crash point of the order, in the order the work passes them.
POINTS = (
    *(f"{where}:{step}" for step in STEPS for where in ("before", "in", "after")),
    "before-complete",
    "after-complete",
)
LEASE = timedelta(seconds=0.4)
CHILD_TIMEOUT = 60.0  # a cold child imports psycopg, redis and idempo before anything else

STORES = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", marks=pytest.mark.postgres, id="postgres"),
    pytest.param("mysql", marks=pytest.mark.mysql, id="mysql"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]
# The app's connection left in autocommit mode (the guard still begins each step's
# transaction itself, so a step's writes still wait for its checkpoint), and a SQL store used
# without the app's connection (the records on the store's own, the effects in the sink, as
# on Redis).
VARIANTS = [
    pytest.param("postgres-autocommit", marks=pytest.mark.postgres, id="postgres-autocommit"),
    pytest.param("sqlite-own", id="sqlite-own-connection"),
]


# -- the order, the same code in the child and in the parent -----------------------------


@dataclass(frozen=True)
class World:
    """Where one store's order runs (JSON, handed to the child): the store, and where the
    steps' effects go: the app's own database or the deduplicating sink."""

    kind: str
    location: str  # the SQLite file, or the PostgreSQL, MariaDB or Redis URL
    schema: str = ""  # PostgreSQL's schema, MariaDB's database
    prefix: str = ""  # Redis's key prefix
    sink: str = ""  # the sink's SQLite file: the effects go there, the records by themselves
    autocommit: bool = False  # the app's connection's mode (PostgreSQL, MariaDB)

    @property
    def database(self) -> Database:
        assert self.kind != "redis"
        return Database(self.kind, self.location, self.schema)  # type: ignore[arg-type]

    @property
    def effects_table(self) -> str:
        return self.database.table("effects")


class Shop:
    """One process's way to the world: its store, the connection the steps write on (None
    with a sink: the checkpoints use the store's own), and the effects themselves."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.sink: sqlite3.Connection | None = None
        self.conn: Any = None
        self._reader: Any = None  # the parent's, for `effects`
        if world.kind == "redis":
            self.store: Any = RedisStore(world.location, prefix=world.prefix)
        else:
            database = world.database
            self.store = database.store(pool_size=2)
        if world.sink:
            # Autocommit: a call the sink accepted stays accepted, whatever happens next.
            self.sink = sqlite3.connect(world.sink, isolation_level=None, timeout=10)
        else:
            self.conn = database.connect(self.store, autocommit=world.autocommit)
            self.insert = database.sql(
                f"INSERT INTO {world.effects_table} (idem_key, step, token) VALUES (?, ?, ?)"
            )

    def effect(self, attempt: Attempt[Any], step: str) -> int:
        """Do ``step``'s business effect; the token of the attempt whose effect stands (the
        id a PSP hands back: the first call's, when it deduplicated this one)."""
        key, token = attempt.scope.key, attempt.token
        assert token is not None
        if self.sink is None:
            # On the app's connection: commits with the step's checkpoint, or not at all.
            self.conn.execute(self.insert, (key, step, token))
            return token
        self.sink.execute("INSERT INTO calls VALUES (?, ?, ?)", (key, step, token))
        self.sink.execute(
            "INSERT INTO sink VALUES (?, ?, ?, ?) ON CONFLICT (downstream_key) DO NOTHING",
            (attempt.downstream_key(step), key, step, token),
        )
        (stands,) = self.sink.execute(
            "SELECT token FROM sink WHERE downstream_key = ?", (attempt.downstream_key(step),)
        ).fetchone()
        return int(stands)

    def effects(self, key: str) -> list[tuple[str, int]]:
        """The committed effects of ``key`` as (step, token of the attempt that did it), read
        on a connection of their own, in autocommit mode (each read sees what committed)."""
        world = self.world
        if world.sink:
            rows = self.sink.execute(  # type: ignore[union-attr] # there is a sink
                "SELECT step, token FROM sink WHERE idem_key = ?", (key,)
            ).fetchall()
            return sorted(rows)
        if self._reader is None:
            self._reader = world.database.connect(self.store, autocommit=True)
        cursor = self._reader.cursor()
        try:
            select = f"SELECT step, token FROM {world.effects_table} WHERE idem_key = ?"
            cursor.execute(world.database.sql(select), (key,))
            found = cursor.fetchall()
        finally:
            cursor.close()
        return sorted((str(step), int(token)) for step, token in found)

    def close(self) -> None:
        for conn in (self.conn, self.sink, self._reader):
            if conn is not None:
                conn.close()
        self.store.close()


def no_crash(point: str, attempt: Attempt[Any]) -> None:
    """Where the child kills itself; the parent's runs pass every point."""


@dataclass
class Run:
    """What one call of `place_order` saw and did."""

    replayed: bool
    token: int | None
    resumed: bool = False
    inherited: tuple[str, ...] = ()  # the steps a taken-over attempt had recorded
    ran: list[str] = field(default_factory=list)  # the steps this call did
    result: Any = None


def place_order(
    shop: Shop,
    key: str,
    *,
    crash: Callable[[str, Attempt[Any]], None] = no_crash,
    clock: Callable[[], datetime] | None = None,
) -> Run:
    """The order: three recorded steps, then the confirmation and the result."""
    idem = Idempotency(shop.store, Policy(lease=LEASE, clock=clock))
    guard = idem.once(key, operation=OPERATION, payload=ORDER, conn=shop.conn, mode="leased")
    with guard as attempt:
        run = Run(attempt.replayed, attempt.token, attempt.resumed, attempt.steps)
        if attempt.replayed:
            run.result = attempt.result
            return run
        for step in STEPS:
            if attempt.needs(step):
                run.ran.append(step)
                crash(f"before:{step}", attempt)
                stands = shop.effect(attempt, step)
                crash(f"in:{step}", attempt)
                attempt.checkpoint(step, {step: stands})
                crash(f"after:{step}", attempt)
        confirmation = shop.effect(attempt, CONFIRM)
        crash("before-complete", attempt)
        attempt.result = {"order": ORDER["order"], "effects": dict(attempt.state),
                          "confirmation": confirmation}  # fmt: skip
        run.result = attempt.result
    crash("after-complete", attempt)
    return run


# -- the child -----------------------------------------------------------------------------


def say(**message: Any) -> None:
    # One write of one line: the forked processes share the pipe (atomic below PIPE_BUF).
    os.write(sys.stdout.fileno(), (json.dumps(message) + "\n").encode())


def crash_at(point: str) -> Callable[[str, Attempt[Any]], None]:
    def crash(here: str, attempt: Attempt[Any]) -> None:
        if here == point:
            say(at=point, token=attempt.token, steps=attempt.steps)
            os.kill(os.getpid(), signal.SIGKILL)

    return crash


def crash_child(world: World, runs: list[list[str]]) -> None:
    """For each (point, key): fork a process that runs the order and dies at that point, and
    report how it ended. Forked before any connection is opened: each has its own. They run
    at once (each on its own key): what is measured is each one's own crash."""
    forked = []
    for point, key in runs:
        pid = os.fork()
        if pid == 0:
            try:
                place_order(Shop(world), key, crash=crash_at(point))
            except BaseException:  # said, then the parent fails on it
                say(point=point, error=traceback.format_exc())
            os._exit(3)  # the order ran past its crash point: the parent fails on the code
        forked.append((pid, point, key))
    for pid, point, key in forked:
        _, status = os.waitpid(pid, 0)
        signalled = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        say(point=point, key=key, signal=signalled, code=os.waitstatus_to_exitcode(status))


def stale_child(world: World, key: str) -> None:
    """Record the first step, wait (the parent takes the key over meanwhile), then try the
    second: its effect and its checkpoint."""
    shop = Shop(world)
    idem = Idempotency(shop.store, Policy(lease=LEASE))
    try:
        guard = idem.once(key, operation=OPERATION, payload=ORDER, conn=shop.conn, mode="leased")
        with guard as attempt:
            attempt.checkpoint(STEPS[0], {STEPS[0]: shop.effect(attempt, STEPS[0])})
            say(state="paused", token=attempt.token)
            read_line()
            stands = shop.effect(attempt, STEPS[1])
            try:
                attempt.checkpoint(STEPS[1], {STEPS[1]: stands})
            except FencedError as exc:
                say(state="fenced", refusal=str(exc), lost=attempt.lease_lost, steps=attempt.steps)
                raise
            say(state="recorded")  # wrong: the parent fails on it
    except FencedError:
        pass
    finally:
        shop.close()
    say(state="done")


def read_line() -> str:
    """One line from stdin, unbuffered: what is left in the pipe stays for a forked process
    (the stale holder reads its "go on" there)."""
    line = bytearray()
    while not line.endswith(b"\n") and (byte := os.read(0, 1)):
        line += byte
    return line.decode()


def serve() -> None:
    """The child: imports everything once, then forks the processes each command (one JSON
    line on stdin) asks for and says when they are over, until stdin closes."""
    while line := read_line():
        command = json.loads(line)
        world = World(**command["world"])
        if command["role"] == "crash":
            crash_child(world, command["runs"])
        else:
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    stale_child(world, command["key"])
                except BaseException:
                    say(error=traceback.format_exc())
                    code = 1
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            say(state="exited", code=os.waitstatus_to_exitcode(status))
        say(state="served")


# -- the parent ----------------------------------------------------------------------------


def setup_world(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> World:
    """A fresh database (records and effects tables) or Redis prefix for one test, and the
    sink where the effects go when the records are on the store's own connection. ``kind``:
    a store, then ``-autocommit`` (the app's connection's mode) or ``-own`` (no app's
    connection: the store's own, and the sink)."""
    kind, _, variant = kind.partition("-")
    sink = ""
    if kind == "redis" or variant == "own":
        sink = str(tmp_path / "sink.db")
        with closing(sqlite3.connect(sink, isolation_level=None)) as conn:
            conn.execute(
                "CREATE TABLE sink (downstream_key TEXT NOT NULL UNIQUE, idem_key TEXT NOT NULL,"
                " step TEXT NOT NULL, token INTEGER NOT NULL)"
            )
            conn.execute("CREATE TABLE calls (idem_key TEXT, step TEXT, token INTEGER)")
    if kind == "redis":
        url, prefix = request.getfixturevalue("redis_url"), request.getfixturevalue("redis_prefix")
        return World("redis", url, prefix=prefix, sink=sink)
    database: Database = request.getfixturevalue(f"{kind}_database")  # migrated
    world = World(database.kind, database.location, database.schema, sink=sink,
                  autocommit=variant == "autocommit")  # fmt: skip
    database.execute(
        f"CREATE TABLE {world.effects_table} (idem_key VARCHAR(80) NOT NULL,"
        " step VARCHAR(40) NOT NULL, token INTEGER NOT NULL)"
    )
    return world


def calls(world: World, key: str) -> Counter[str]:
    """How many times each step called the sink."""
    with closing(sqlite3.connect(world.sink)) as conn:
        rows = conn.execute("SELECT step FROM calls WHERE idem_key = ?", (key,)).fetchall()
    return Counter(step for (step,) in rows)


def scope(key: str) -> Scope:
    return Scope.of(key, operation=OPERATION)


class Talk:
    """The child, spoken to over its stdin and stdout."""

    def __init__(self, proc: subprocess.Popen[str], log: Path) -> None:
        self.proc = proc
        self.log = log
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def message(self) -> dict[str, Any]:
        try:
            line = self.lines.get(timeout=CHILD_TIMEOUT)
        except queue.Empty:
            pytest.fail(f"the child said nothing for {CHILD_TIMEOUT}s: {self.log.read_text()}")
        if line is None:
            pytest.fail(f"the child exited ({self.proc.wait()}): {self.log.read_text()}")
        said: dict[str, Any] = json.loads(line)
        assert "error" not in said, said["error"]
        return said

    def until(self, state: str) -> list[dict[str, Any]]:
        """The messages before the next one in ``state``."""
        said = []
        while (message := self.message()).get("state") != state:
            said.append(message)
        return said

    def write(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def send(self, **command: Any) -> None:
        self.write(json.dumps(command))


@pytest.fixture(scope="module")
def forks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Talk]:
    """The child that forks the test's processes: one for the module, so that the imports
    (psycopg, PyMySQL, redis, idempo) are paid once."""
    log = tmp_path_factory.mktemp("recovery-crashes") / "child.log"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, __file__, "serve"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
        try:
            yield Talk(proc, log)
        finally:
            assert proc.stdin is not None
            proc.stdin.close()  # the child's loop ends
            try:
                proc.wait(timeout=10)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                assert proc.stdout is not None
                proc.stdout.close()


def killed(forks: Talk, world: World, keys: dict[str, str]) -> dict[str, dict[str, Any]]:
    """A process per (point, key) of ``keys``, run at once and killed at its point. Returns
    point -> what it said there (its ``token``, its ``steps`` so far)."""
    forks.send(role="crash", world=asdict(world), runs=list(keys.items()))
    said = forks.until("served")
    landed, ended = {}, {}
    for message in said:
        if "at" in message:
            landed[message["at"]] = message
        else:
            ended[message["point"]] = message
    # Each process said it reached its point, and died there of SIGKILL: no point was passed.
    assert list(ended) == sorted(landed, key=POINTS.index) == list(keys), said
    for point, message in ended.items():
        assert (message["signal"], message["code"]) == (signal.SIGKILL, -signal.SIGKILL), point
    return landed


def killed_everywhere(forks: Talk, world: World) -> dict[str, tuple[str, int]]:
    """For every point, a fresh key and a process killed there. Returns point -> (key, the
    dead holder's token)."""
    keys = {point: new_key() for point in POINTS}
    landed = killed(forks, world, keys)
    return {point: (keys[point], landed[point]["token"]) for point in POINTS}


def recorded(point: str) -> tuple[str, ...]:
    """The steps the dead holder had recorded when it died at ``point``."""
    if point.endswith("-complete"):
        return STEPS
    where, step = point.split(":")
    done = STEPS.index(step) + (where == "after")
    return STEPS[:done]


def taken_over(shop: Shop, key: str, lease_end: datetime) -> Run:
    """A duplicate a moment before the lease ends is told the key is in progress; after it
    (polled, to a bound, on the stores' real clocks) one takes the key over."""
    with pytest.raises(RequestInProgressError):
        place_order(shop, key, clock=lambda: lease_end - timedelta(milliseconds=1))
    deadline = time.monotonic() + 10
    while True:
        started = utcnow()
        try:
            return place_order(shop, key)
        except RequestInProgressError:
            assert started < lease_end + timedelta(milliseconds=50), "the lease never ran out"
            assert time.monotonic() < deadline
            time.sleep(0.02)


def check_resumed(world: World, shop: Shop, point: str, key: str, dead: int) -> None:
    """What the holder killed at ``point`` (token ``dead``) left, and the retry after it."""
    record = shop.store.get(scope(key))
    assert record is not None, point
    assert record.token == dead
    before = recorded(point)
    assert Progress.decode(record.recovery_point).steps == before, point

    # Whose effect stands for each step: the dead holder's for the steps it recorded, and with
    # a sink also for the one it called just before dying (the sink kept that first call).
    inside = point.split(":")[1] if point.startswith("in:") else None
    if point == "before-complete":
        inside = CONFIRM
    kept_first = {*before, *([inside] if world.sink and inside else [])}
    if point == "after-complete":
        kept_first.add(CONFIRM)
        assert record.status is Status.COMPLETED
        run = place_order(shop, key)
        assert run.replayed
        retry_token = dead
    else:
        assert record.status is Status.IN_PROGRESS
        assert record.lease_expires_at is not None
        run = taken_over(shop, key, record.lease_expires_at)
        assert not run.replayed
        assert run.token is not None
        assert run.token > dead
        # It resumed right after the last recorded step, with that step's state.
        assert (run.inherited, run.resumed) == (before, bool(before)), point
        assert run.ran == [s for s in STEPS if s not in before]
        retry_token = run.token

    stands = {s: dead if s in kept_first else retry_token for s in STEPS}
    confirmation = dead if CONFIRM in kept_first else retry_token
    # Each step's effect happened exactly once (and the confirmation too).
    assert shop.effects(key) == sorted([*stands.items(), (CONFIRM, confirmation)]), point
    if world.sink:
        # The steps that ran twice across the crash: the sink's key made them harmless.
        expected = Counter([*STEPS, CONFIRM])
        if inside is not None:
            expected[inside] += 1
        assert calls(world, key) == expected, point
    assert run.result == {"order": 7, "effects": stands, "confirmation": confirmation}

    # Completed, and a later duplicate replays it byte for byte.
    done = shop.store.get(scope(key))
    assert done is not None
    assert done.status is Status.COMPLETED
    assert done.token == retry_token
    duplicate = place_order(shop, key)
    assert duplicate.replayed
    assert json.dumps(duplicate.result) == json.dumps(run.result)
    again = shop.store.get(scope(key))
    assert again is not None
    assert again.response == done.response
    assert shop.effects(key) == sorted([*stands.items(), (CONFIRM, confirmation)])


@pytest.mark.parametrize("kind", [*STORES, *VARIANTS])
def test_a_sigkill_at_every_crash_point_resumes_at_the_right_step(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, forks: Talk
) -> None:
    """Every crash point of the order, each on a key of its own: the retry after the lease
    resumes after the last recorded step, every effect happened once, and the completed
    result replays byte for byte."""
    world = setup_world(kind, request, tmp_path)
    dead = killed_everywhere(forks, world)
    shop = Shop(world)
    try:
        for point, (key, token) in dead.items():
            check_resumed(world, shop, point, key, token)
    finally:
        shop.close()
    print(f"{kind}: {len(dead)} crash points, each killed there and resumed")
    assert len(dead) == len(POINTS) == 11


# Three holders of one key in a row, each killed at another point: the second and third take
# over from a dead holder, as the parent's last attempt does.
CHAIN = ("after:reserve-stock", "in:charge", "before-complete")


def lease_waited_out(shop: Shop, key: str) -> None:
    """Wait until the dead holder's lease of ``key`` ends (at most `LEASE` from now)."""
    record = shop.store.get(scope(key))
    assert record is not None
    assert record.lease_expires_at is not None
    left = (record.lease_expires_at - utcnow()).total_seconds()
    assert left <= LEASE.total_seconds()
    time.sleep(max(left, 0) + 0.01)


@pytest.mark.parametrize("kind", STORES)
def test_crash_after_crash_each_takeover_inherits_every_step_before_it(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, forks: Talk
) -> None:
    """Holders that die one after another on the same key hand their steps on: each takes
    over from the last (a larger token), inherits everything recorded before it, with its
    state, and adds its own; the last attempt completes with each effect done once."""
    world = setup_world(kind, request, tmp_path)
    key, shop = new_key(), Shop(world)
    holders: list[dict[str, Any]] = []
    try:
        for point in CHAIN:
            if holders:
                lease_waited_out(shop, key)
            holders.append(killed(forks, world, {point: key})[point])
        lease_waited_out(shop, key)
        run = place_order(shop, key)
        assert place_order(shop, key).result == run.result
        found = shop.effects(key)
    finally:
        shop.close()
    first, second, third = (holder["token"] for holder in holders)
    assert run.token is not None
    assert first < second < third < run.token
    # What each had recorded when it died: its predecessors' steps, then its own.
    assert [holder["steps"] for holder in holders] == [[STEPS[0]], [STEPS[0]], list(STEPS)]
    assert (run.resumed, run.inherited, run.ran) == (True, STEPS, [])
    # The charge the second holder made before dying stands on a sink (its downstream key
    # made the third one's call harmless) and rolled back on the app's connection.
    charged = second if world.sink else third
    confirmation = third if world.sink else run.token
    stands = {STEPS[0]: first, STEPS[1]: charged, STEPS[2]: third}
    assert run.result == {"order": 7, "effects": stands, "confirmation": confirmation}
    assert found == sorted([*stands.items(), (CONFIRM, confirmation)])
    if world.sink:
        assert calls(world, key) == Counter({STEPS[0]: 1, STEPS[1]: 2, STEPS[2]: 1, CONFIRM: 2})


# -- a stale holder --------------------------------------------------------------------------


@contextmanager
def stale_holder(
    forks: Talk, world: World, key: str
) -> Iterator[tuple[int, Callable[[], dict[str, Any]]]]:
    """A forked process holding ``key`` with its first step recorded, paused before the
    second: (its token, a function that lets it go on and returns what it said then). It is
    over, and the child ready for the next test, when the block ends (even a failing one)."""
    forks.send(role="stale", world=asdict(world), key=key)
    paused = forks.message()
    assert paused["state"] == "paused", paused
    said: list[dict[str, Any]] = []

    def go_on() -> dict[str, Any]:
        forks.write("go on")
        said.append(forks.message())
        return said[0]

    try:
        yield paused["token"], go_on
    finally:
        if not said:
            go_on()
        assert forks.until("served") == [{"state": "done"}, {"state": "exited", "code": 0}]


@pytest.mark.parametrize("kind", STORES)
def test_a_stale_holders_checkpoint_is_refused_and_its_step_rolls_back(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, forks: Talk
) -> None:
    """A live holder whose lease ran out while another attempt took over and recorded the
    same step: its checkpoint raises FencedError, its step's writes roll back (app's
    connection) and the record keeps the new holder's point."""
    world = setup_world(kind, request, tmp_path)
    key, charge = new_key(), STEPS[1]
    shop = Shop(world)
    try:
        with stale_holder(forks, world, key) as (stale, go_on):
            record = shop.store.get(scope(key))
            assert record is not None
            assert record.lease_expires_at is not None
            after_lease = record.lease_expires_at + timedelta(milliseconds=1)
            idem = Idempotency(shop.store, Policy(lease=LEASE * 100, clock=lambda: after_lease))
            guard = idem.once(
                key, operation=OPERATION, payload=ORDER, conn=shop.conn, mode="leased"
            )
            with guard as attempt:
                assert attempt.token is not None
                assert attempt.token > stale
                assert (attempt.steps, dict(attempt.state)) == ((STEPS[0],), {STEPS[0]: stale})
                attempt.checkpoint(charge, {charge: shop.effect(attempt, charge)})
                point = shop.store.get(scope(key))
                assert point is not None

                fenced = go_on()  # the stale holder does its charge and records it
                assert fenced["state"] == "fenced", fenced
                assert fenced["lost"] is True
                assert fenced["steps"] == [STEPS[0]]  # nothing recorded

                # Its charge rolled back (with the sink: the downstream key absorbed it), and
                # the record keeps the new holder's point and lease.
                assert shop.effects(key) == sorted([(STEPS[0], stale), (charge, attempt.token)])
                if world.sink:
                    assert calls(world, key)[charge] == 2
                kept = shop.store.get(scope(key))
                assert kept is not None
                assert (kept.status, kept.token) == (Status.IN_PROGRESS, attempt.token)
                assert kept.recovery_point == point.recovery_point
                progress = Progress.decode(kept.recovery_point)
                assert (progress.steps, dict(progress.state)) == (
                    (STEPS[0], charge),
                    {STEPS[0]: stale, charge: attempt.token},
                )
                assert kept.lease_expires_at == point.lease_expires_at

                attempt.checkpoint(STEPS[2], {STEPS[2]: shop.effect(attempt, STEPS[2])})
                attempt.result = dict(attempt.state)
        done = shop.store.get(scope(key))
        assert done is not None
        assert (done.status, done.token) == (Status.COMPLETED, attempt.token)
        assert [step for step, _ in shop.effects(key)] == sorted(STEPS)
    finally:
        shop.close()


if __name__ == "__main__":
    assert sys.argv[1:] == ["serve"], sys.argv
    serve()
