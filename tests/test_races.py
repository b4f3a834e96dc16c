"""Races: many threads, many processes, and many asyncio tasks fire the same scope at once.

Every round releases all callers together (a barrier) at one key, over hundreds of keys. The
work leaves a side effect that cannot lie: a business row in a table with no unique constraint
on the key (so a second execution shows as a second row), or a locked counter for the memory
store. Every caller must get the one execution's result (a replay) or an in-progress answer.
"""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, closing, contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import aiomysql
import anyio
import anyio.lowlevel
import pytest

from helpers import Database, pg_aconnect
from idempo import AsyncIdempotency, Idempotency, Policy, RequestInProgressError
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.mysql import connect_options

pytestmark = pytest.mark.slow

THREADS = 32
PROCESSES = 4
KEYS = 200
OPERATION = "race"
BARRIER_TIMEOUT = 60.0
BUSY_TIMEOUT = timedelta(seconds=30)  # SQLite's
# Long enough that no lease expires and no duplicate gives up waiting during a race: every
# second execution the tests could see would then be a real bug, not a legitimate takeover.
POLICY = Policy(lease=timedelta(minutes=5), lock_timeout=timedelta(seconds=30))

Kind = Literal["executed", "replayed", "in_progress", "error"]
# transactional: reservation, business row and completion in one transaction on the app's
# connection; leased: mode="leased" on the app's connection; store: leased mode on the store's
# own connections, with the business row committed on its own.
Mode = Literal["transactional", "leased", "store"]


@dataclass(frozen=True)
class Outcome:
    """What one caller got for one key."""

    kind: Kind
    key: str
    result: Any = None


Call = Callable[[str], Outcome]


def refused(key: str, worker: str, exc: Exception) -> Outcome:
    """What a caller whose guarded call raised got: an in-progress answer, or an error."""
    if isinstance(exc, RequestInProgressError):
        return Outcome("in_progress", key)
    return Outcome("error", key, f"{worker}: {exc!r}")


def attempt(
    idem: Idempotency,
    key: str,
    worker: str,
    effect: Callable[[str, str], None],
    *,
    conn: Any = None,
    mode: Literal["transactional", "leased"] = "transactional",
) -> Outcome:
    """One caller's guarded call: the work performs ``effect`` and returns a unique nonce."""
    try:
        with idem.once(key, operation=OPERATION, payload={"key": key}, conn=conn, mode=mode) as a:
            if a.replayed:
                return Outcome("replayed", key, a.result)
            nonce = uuid.uuid4().hex
            effect(key, nonce)
            a.result = {"key": key, "worker": worker, "nonce": nonce, "token": a.token}
    except Exception as exc:
        return refused(key, worker, exc)
    return Outcome("executed", key, a.result)


@dataclass(frozen=True)
class Target:
    """A database and a way of calling it, rebuilt from plain data inside a spawned process."""

    database: Database
    mode: Mode

    def open_store(self, pool_size: int = 4) -> Any:
        return self.database.store(busy_timeout=BUSY_TIMEOUT, pool_size=pool_size)

    def prepare(self) -> None:
        """Create a business table with no unique constraint on the key."""
        self.database.create_business_table("idem_key TEXT NOT NULL, nonce TEXT")

    @property
    def insert(self) -> str:
        return self.database.sql(
            f"INSERT INTO {self.database.business_table} (idem_key, nonce) VALUES (?, ?)"
        )

    @contextmanager
    def caller(self, idem: Idempotency, worker: str) -> Iterator[Call]:
        """A call function with its own app connection, for one thread or process."""
        conn = self.database.connect(idem.store, autocommit=self.mode == "store")
        with closing(conn):
            insert = self.insert

            def effect(key: str, nonce: str) -> None:
                # Transactional and leased: on the guarded transaction. Store mode: the
                # connection is in autocommit mode, so the row commits on its own.
                conn.execute(insert, (key, nonce))

            if self.mode == "store":
                yield lambda key: attempt(idem, key, worker, effect)
            else:
                mode = self.mode
                yield lambda key: attempt(idem, key, worker, effect, conn=conn, mode=mode)

    def effects(self) -> dict[str, list[str]]:
        """The nonces of the business rows, per key."""
        rows: dict[str, list[str]] = defaultdict(list)
        business = self.database.business_table
        for key, nonce in self.database.select(f"SELECT idem_key, nonce FROM {business}"):
            rows[key].append(nonce)
        return rows


@dataclass
class Tally:
    """How the callers fared over a whole race."""

    executed: int = 0
    replayed: int = 0
    in_progress: int = 0
    errors: list[str] = field(default_factory=list)


def check_exactly_once(
    outcomes: list[Outcome], keys: list[str], callers: int, effects: dict[str, list[str]]
) -> Tally:
    """Exactly one execution per key, one side effect per key, and every other caller got that
    execution's result or an in-progress answer."""
    tally = Tally()
    by_key: dict[str, list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_key[outcome.key].append(outcome)
        if outcome.kind == "error":
            tally.errors.append(outcome.result)
        else:
            setattr(tally, outcome.kind, getattr(tally, outcome.kind) + 1)
    assert not tally.errors, tally.errors[:5]
    assert set(by_key) == set(keys)
    assert set(effects) == set(keys), "a key ran no work, or work ran for an unknown key"
    for key in keys:
        got = by_key[key]
        assert len(got) == callers, (key, got)
        executed = [o for o in got if o.kind == "executed"]
        assert len(executed) == 1, (key, executed)
        winner = executed[0].result
        assert effects[key] == [winner["nonce"]], (key, effects[key], winner)
        for outcome in got:
            assert outcome.kind in {"executed", "replayed", "in_progress"}
            if outcome.kind == "replayed":
                assert outcome.result == winner, (key, outcome.result, winner)
    return tally


def check_race(target: Target, outcomes: list[Outcome], keys: list[str], callers: int) -> Tally:
    """`check_exactly_once` against the target's business rows; in transactional mode a
    duplicate waits on the first attempt's lock, then replays: none is turned away."""
    tally = check_exactly_once(outcomes, keys, callers, target.effects())
    if target.mode == "transactional":
        assert tally.in_progress == 0, tally
    return tally


def race_threads(threads: int, keys: list[str], caller: Callable[[str], Any]) -> list[Outcome]:
    """Run ``threads`` threads; for each key a barrier releases all of them at once.

    ``caller(worker)`` is a context manager giving one thread its call function (and its own
    connection).
    """
    barrier = threading.Barrier(threads)
    outcomes: list[Outcome] = []
    lock = threading.Lock()

    def run(index: int) -> None:
        try:
            with caller(f"thread-{index}") as call:
                for key in keys:
                    barrier.wait(timeout=BARRIER_TIMEOUT)
                    outcome = call(key)
                    with lock:
                        outcomes.append(outcome)
        except BaseException:
            barrier.abort()  # never leave the others waiting for a thread that died
            raise

    with ThreadPoolExecutor(max_workers=threads) as pool:
        futures = [pool.submit(run, index) for index in range(threads)]
        for future in futures:
            future.result()
    return outcomes


def make_keys(prefix: str) -> list[str]:
    return [f"{prefix}-{uuid.uuid4().hex[:12]}-{n}" for n in range(KEYS)]


# -- threads -------------------------------------------------------------------------------


def test_threads_memory_store_executes_once_per_key() -> None:
    """32 threads released together at each of 200 keys on MemoryStore execute each key once."""
    idem = Idempotency(MemoryStore(), POLICY)
    effects: dict[str, list[str]] = defaultdict(list)
    lock = threading.Lock()

    def effect(key: str, nonce: str) -> None:
        with lock:
            effects[key].append(nonce)

    @contextmanager
    def caller(worker: str) -> Iterator[Call]:
        yield lambda key: attempt(idem, key, worker, effect)

    keys = make_keys("mem")
    outcomes = race_threads(THREADS, keys, caller)
    tally = check_exactly_once(outcomes, keys, THREADS, effects)
    assert tally.executed == KEYS


SQL_MODES = [
    pytest.param("transactional", id="transactional"),
    pytest.param("leased", id="leased-on-app-connection"),
    pytest.param("store", id="leased-on-store-connections"),
]


def _thread_race(target: Target) -> Tally:
    target.prepare()
    store = target.open_store(pool_size=4)
    try:
        idem = Idempotency(store, POLICY)
        keys = make_keys(f"{target.database.kind}-{target.mode}")
        outcomes = race_threads(THREADS, keys, lambda worker: target.caller(idem, worker))
    finally:
        store.close()
    return check_race(target, outcomes, keys, THREADS)


@pytest.mark.parametrize("mode", SQL_MODES)
def test_threads_execute_once_per_key(database: Database, mode: Mode) -> None:
    """32 threads, each on its own sqlite3, psycopg or PyMySQL connection, released together at
    each of 200 keys of one SQLite file, PostgreSQL or MariaDB, leave exactly one business row
    per key."""
    _thread_race(Target(database, mode))


# -- processes -----------------------------------------------------------------------------


def _process_main(
    target: Target,
    index: int,
    keys: list[str],
    barrier: Any,
    results: Any,
) -> None:
    """A spawned process: its own store and connection, one call per key at the barrier."""
    outcomes: list[Outcome] = []
    problem = None
    try:
        store = target.open_store(pool_size=2)
        try:
            idem = Idempotency(store, POLICY)
            with target.caller(idem, f"process-{index}") as call:
                for key in keys:
                    barrier.wait(timeout=BARRIER_TIMEOUT)
                    outcomes.append(call(key))
        finally:
            store.close()
    except BaseException as exc:
        barrier.abort()
        problem = repr(exc)
    results.put((index, outcomes, problem))


def report_outcomes(
    index: int, barrier: Any, results: Any, run: Callable[[list[Outcome]], None]
) -> None:
    """The end of a spawned process of `run_processes`: ``run`` appends its outcomes; what
    it raised aborts the barrier (so the other processes stop waiting) and is reported."""
    outcomes: list[Outcome] = []
    problem = None
    try:
        run(outcomes)
    except BaseException as exc:
        barrier.abort()
        problem = repr(exc)
    results.put((index, outcomes, problem))


def run_processes(
    main: Callable[..., None], args: tuple[Any, ...], keys: list[str]
) -> list[Outcome]:
    """Run ``main(*args, index, keys, barrier, results)`` in PROCESSES spawned processes that
    a barrier releases together at each key; gather every caller's outcome."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(PROCESSES)
    results = context.Queue()
    processes = [
        context.Process(target=main, args=(*args, index, keys, barrier, results))
        for index in range(PROCESSES)
    ]
    for process in processes:
        process.start()
    outcomes: list[Outcome] = []
    problems = []
    try:
        for _ in processes:
            _, got, problem = results.get(timeout=150)
            outcomes.extend(got)
            if problem:
                problems.append(problem)
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
                process.join()
    assert not problems, problems
    assert all(process.exitcode == 0 for process in processes)
    return outcomes


def _process_race(target: Target) -> Tally:
    target.prepare()
    keys = make_keys(f"{target.database.kind}-{target.mode}-proc")
    outcomes = run_processes(_process_main, (target,), keys)
    return check_race(target, outcomes, keys, PROCESSES)


@pytest.mark.parametrize("mode", SQL_MODES)
def test_processes_execute_once_per_key(database: Database, mode: Mode) -> None:
    """4 spawned processes, each with its own store and connection, sharing one SQLite file,
    PostgreSQL or MariaDB and released together at each of 200 keys, leave exactly one business
    row per key."""
    _process_race(Target(database, mode))


# -- asyncio tasks on the async stores -----------------------------------------------------

TASKS = 32


async def attempt_async(
    idem: AsyncIdempotency,
    key: str,
    worker: str,
    effect: Callable[[str, str], Awaitable[None]],
    *,
    conn: Any = None,
    mode: Literal["transactional", "leased"] = "transactional",
) -> Outcome:
    """The asynchronous twin of `attempt`."""
    try:
        guard = idem.once(key, operation=OPERATION, payload={"key": key}, conn=conn, mode=mode)
        async with guard as a:
            if a.replayed:
                return Outcome("replayed", key, a.result)
            nonce = uuid.uuid4().hex
            await effect(key, nonce)
            a.result = {"key": key, "worker": worker, "nonce": nonce, "token": a.token}
    except Exception as exc:
        return refused(key, worker, exc)
    return Outcome("executed", key, a.result)


AsyncCall = Callable[[str], Awaitable[Outcome]]


async def race_tasks(calls: list[AsyncCall], keys: list[str]) -> list[Outcome]:
    """For each key, start one task per call and release them all at once."""
    outcomes: list[Outcome] = []
    for key in keys:
        go = anyio.Event()

        async def fire(call: AsyncCall, go: anyio.Event = go, key: str = key) -> None:
            await go.wait()
            outcomes.append(await call(key))

        with anyio.fail_after(BARRIER_TIMEOUT):
            async with anyio.create_task_group() as group:
                for call in calls:
                    group.start_soon(fire, call)
                await anyio.lowlevel.checkpoint()  # every task is now parked on the event
                go.set()
    return outcomes


@pytest.mark.anyio
async def test_tasks_async_memory_store_executes_once_per_key() -> None:
    """32 tasks released together at each of 200 keys on AsyncMemoryStore execute each key
    once."""
    idem = AsyncIdempotency(AsyncMemoryStore(), POLICY)
    effects: dict[str, list[str]] = defaultdict(list)

    async def effect(key: str, nonce: str) -> None:
        await anyio.lowlevel.checkpoint()  # give the duplicates a chance to arrive mid-work
        effects[key].append(nonce)

    def call_for(worker: str) -> AsyncCall:
        return lambda key: attempt_async(idem, key, worker, effect)

    keys = make_keys("amem")
    outcomes = await race_tasks([call_for(f"task-{i}") for i in range(TASKS)], keys)
    tally = check_exactly_once(outcomes, keys, TASKS, effects)
    assert tally.in_progress > 0, "no duplicate ever arrived while the work ran"


@pytest.mark.anyio
async def test_tasks_async_sqlite_store_executes_once_per_key(sqlite_database: Database) -> None:
    """32 tasks released together at each of 200 keys on AsyncSQLiteStore (leased, on its own
    connections) leave exactly one business row per key."""
    target = Target(sqlite_database, "store")
    target.prepare()
    store = sqlite_database.async_store(busy_timeout=BUSY_TIMEOUT)
    idem = AsyncIdempotency(store, POLICY)
    app = sqlite_database.store().connect()
    insert = target.insert
    try:

        async def effect(key: str, nonce: str) -> None:
            await anyio.to_thread.run_sync(app.execute, insert, (key, nonce))

        def call_for(worker: str) -> AsyncCall:
            return lambda key: attempt_async(idem, key, worker, effect)

        keys = make_keys("asqlite")
        outcomes = await race_tasks([call_for(f"task-{i}") for i in range(TASKS)], keys)
    finally:
        app.close()
        await store.aclose()
    check_race(target, outcomes, keys, TASKS)


@pytest.mark.postgres
@pytest.mark.anyio
@pytest.mark.parametrize("mode", SQL_MODES)
async def test_tasks_async_postgres_execute_once_per_key(
    postgres_database: Database, mode: Mode
) -> None:
    """32 tasks, each on its own psycopg AsyncConnection, released together at each of 200 keys
    leave exactly one business row per key in PostgreSQL."""
    target = Target(postgres_database, mode)
    target.prepare()
    store = postgres_database.async_store(pool_size=4)
    idem = AsyncIdempotency(store, POLICY)
    async with AsyncExitStack() as stack:
        stack.push_async_callback(store.aclose)
        calls: list[AsyncCall] = []
        for index in range(TASKS):
            conn = await pg_aconnect(postgres_database.location, autocommit=mode == "store")
            await stack.enter_async_context(conn)

            async def effect(key: str, nonce: str, conn: Any = conn) -> None:
                await conn.execute(target.insert, (key, nonce))

            calls.append(_async_call(idem, conn, effect, mode, f"task-{index}"))
        keys = make_keys(f"apg-{mode}")
        outcomes = await race_tasks(calls, keys)
    check_race(target, outcomes, keys, TASKS)


@pytest.mark.mysql
@pytest.mark.anyio
@pytest.mark.parametrize("mode", SQL_MODES)
async def test_tasks_async_mysql_execute_once_per_key(mysql_database: Database, mode: Mode) -> None:
    """32 tasks, each on its own aiomysql connection, released together at each of 200 keys
    leave exactly one business row per key in MariaDB."""
    target = Target(mysql_database, mode)
    target.prepare()
    store = mysql_database.async_store(pool_size=4)
    idem = AsyncIdempotency(store, POLICY)
    options = connect_options(mysql_database.location)
    options["db"] = options.pop("database")
    async with AsyncExitStack() as stack:
        stack.push_async_callback(store.aclose)
        calls: list[AsyncCall] = []
        for index in range(TASKS):
            conn = await aiomysql.connect(**options, autocommit=mode == "store")
            stack.callback(conn.close)

            async def effect(key: str, nonce: str, conn: Any = conn) -> None:
                async with conn.cursor() as cursor:
                    await cursor.execute(target.insert, (key, nonce))

            calls.append(_async_call(idem, conn, effect, mode, f"task-{index}"))
        keys = make_keys(f"amysql-{mode}")
        outcomes = await race_tasks(calls, keys)
    check_race(target, outcomes, keys, TASKS)


def _async_call(
    idem: AsyncIdempotency,
    conn: Any,
    effect: Callable[[str, str], Awaitable[None]],
    mode: Mode,
    worker: str,
) -> AsyncCall:
    if mode == "store":
        return lambda key: attempt_async(idem, key, worker, effect)
    guarded_mode: Literal["transactional", "leased"] = mode
    return lambda key: attempt_async(idem, key, worker, effect, conn=conn, mode=guarded_mode)
