"""A fault at every store operation of a guarded call, on every store and in every mode.

For each store (memory, SQLite, PostgreSQL, MariaDB, Redis), each mode (leased on the store's
own connections; transactional and leased on the app's connection where the store binds) and
each way the work ends (a result, a transient error, a deterministic one), a clean call first
counts the store operations the call makes (reserve, discard, settle or release, the work's
renew, and on the app's connection every Begin, statement, Commit and Rollback). Then, for
every N, a call gets one fault at its N-th operation (tests/faults.py): the operation fails
before it is applied, its reply is lost after it was applied, it never answers (the caller's
timeout fires), or the caller is cancelled while it runs. Each is followed by a retry with the
same key, and SPEC §2 and §8 are checked:

* only idempo's typed errors, the app's own, or the caller's own cancellation reach the
  caller; when the work raised, the app's error, whatever the store did afterwards;
* an acknowledged completion is never lost: the record is COMPLETED (and the work's writes
  committed, on the app's connection);
* never a second execution of a completed work: a retry of a COMPLETED or FAILED record
  replays it and runs nothing;
* never a key wedged past one lease: a retry that finds the key in progress proceeds once
  the test's clock moves one lease on; in transactional mode it never finds it in progress;
* what is recorded is what committed: on the app's connection the work's writes are
  committed exactly once if the record ends COMPLETED, never otherwise, and the guard never
  leaves the app's connection inside a transaction.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import aiomysql
import psycopg
import pytest
from psycopg.pq import TransactionStatus
from pymysql.constants import SERVER_STATUS
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from faults import BindFaults, Canceller, Fault, Plan, VerbFaults, arm_sql
from helpers import Database
from idempo import (
    AsyncIdempotency,
    FencedError,
    Idempotency,
    Policy,
    ReplayedFailureError,
    RequestInProgressError,
    Scope,
    Status,
    StoreError,
)
from idempo.stores.memory import AsyncMemoryStore, MemoryStore
from idempo.stores.mysql import connect_options
from idempo.stores.redis import AsyncRedisStore, RedisStore
from idempo.testing import FakeClock

OPERATION = "test.faults"
LEASE = timedelta(seconds=30)

STORE_MODES = [
    pytest.param(("memory", "store"), id="memory"),
    pytest.param(("redis", "store"), marks=pytest.mark.redis, id="redis"),
    *[
        pytest.param((kind, mode), marks=marks, id=f"{kind}-{mode}")
        for kind, marks in (
            ("sqlite", ()),
            ("postgres", pytest.mark.postgres),
            ("mysql", pytest.mark.mysql),
        )
        for mode in ("store", "transactional", "leased")
    ],
]
OUTCOMES = ["result", "transient", "deterministic"]


class AppError(Exception):
    """The work's transient failure: the key is released."""


class Deterministic(Exception):
    """The work's deterministic failure: recorded FAILED and replayed."""


REPLAYED_FAILURE = "replayed failure"


@dataclass
class Setting:
    """A store kind and mode, with what the test needs to reach them."""

    kind: str
    mode: str
    database: Database | None = None
    redis: tuple[str, str] | None = None

    @property
    def on_conn(self) -> bool:
        return self.mode != "store"

    @property
    def effects_table(self) -> str:
        assert self.database is not None
        return self.database.table("effects")

    def committed(self, key: str) -> int:
        assert self.database is not None
        found = self.database.select(
            f"SELECT count(*) FROM {self.effects_table} WHERE k = ?", (key,)
        )
        return int(found[0][0])


@pytest.fixture(params=STORE_MODES)
def setting(request: pytest.FixtureRequest) -> Setting:
    kind, mode = request.param
    if kind == "memory":
        return Setting(kind, mode)
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        return Setting(kind, mode, redis=(url, request.getfixturevalue("redis_prefix")))
    database: Database = request.getfixturevalue(f"{kind}_database")
    database.execute(f"CREATE TABLE {database.table('effects')} (k VARCHAR(100))")
    return Setting(kind, mode, database=database)


@dataclass
class Run:
    """What one call did: its exception or value, and whether the work reached its end."""

    error: BaseException | None = None
    value: Any = None
    reached: bool = False
    cancelled: bool = False  # the caller saw its own cancellation


@dataclass
class Rig:
    """A guard on a store behind a fault plan, the app's connection, the test's clock."""

    setting: Setting
    plan: Plan
    clock: FakeClock
    store: Any  # the real store, to read records
    executions: Counter[str] = field(default_factory=Counter)
    reached: set[str] = field(default_factory=set)

    def effects(self, key: str) -> int:
        """The work's effects that stayed: committed rows on the app's connection, else
        the executions that reached the end of the work."""
        if self.setting.on_conn:
            return self.setting.committed(key)
        return self.executions[key]


def policy(clock: FakeClock) -> Policy:
    return Policy(
        clock=clock, lease=LEASE, fail_on=(Deterministic,), lock_timeout=timedelta(seconds=2)
    )


def finish(rig: Rig, key: str, outcome: str) -> dict[str, str]:
    """The end of the work, after its write."""
    rig.executions[key] += 1
    rig.reached.add(key)
    if outcome == "transient":
        raise AppError("transient")
    if outcome == "deterministic":
        raise Deterministic("deterministic")
    return {"key": key}


# --- the checks, shared by both faces ---------------------------------------------------


def check_first(
    rig: Rig, key: str, outcome: str, fault: Fault | None, run: Run, status: Status | None
) -> None:
    ctx = f"{fault and fault.value} at {rig.plan.hit} of {rig.plan.ops}, work {outcome}"
    error = run.error
    allowed = (AppError, Deterministic, StoreError, FencedError)
    if fault is Fault.HANG:
        allowed += (TimeoutError,)
    if fault is Fault.CANCEL:
        allowed += (asyncio.CancelledError,)
    assert error is None or isinstance(error, allowed), f"{ctx}: raised {error!r}"
    if fault in (Fault.CANCEL, Fault.HANG) and rig.plan.hit is not None:
        assert run.cancelled, f"{ctx}: the caller's cancellation was lost ({run})"
    if run.reached and outcome != "result" and fault in (Fault.RAISE, Fault.DROP, None):
        expected = AppError if outcome == "transient" else Deterministic
        assert isinstance(error, expected), f"{ctx}: the app's error became {error!r}"
    if error is None and run.value == {"key": key}:
        assert status is Status.COMPLETED, f"{ctx}: an acknowledged completion was lost"
        assert rig.effects(key) == 1, f"{ctx}: acknowledged, but the work's writes are gone"
    if rig.setting.mode == "transactional":
        assert status is not Status.IN_PROGRESS, f"{ctx}: a transaction left a reservation"
    if fault is None:
        expected_status = {
            "result": Status.COMPLETED,
            "transient": None,
            "deterministic": Status.FAILED,
        }[outcome]
        assert status is expected_status, f"{ctx}: a clean call left {status}"


def check_retry(
    rig: Rig,
    key: str,
    before: Status | None,
    executions: int,
    retry: Run,
    final: Status | None,
    advanced: bool,
) -> None:
    ctx = f"retry after a fault at {rig.plan.hit} of {rig.plan.ops}"
    assert retry.error is None, f"{ctx}: raised {retry.error!r}"
    if advanced:
        assert before is Status.IN_PROGRESS, f"{ctx}: in progress although {before}"
    if before is Status.FAILED:
        assert retry.value == REPLAYED_FAILURE, f"{ctx}: a FAILED record gave {retry.value!r}"
    else:
        assert retry.value == {"key": key}, f"{ctx}: returned {retry.value!r}"
    ran = rig.executions[key] - executions
    if before in (Status.COMPLETED, Status.FAILED):
        assert ran == 0, f"{ctx}: a settled record's work ran again"
    else:
        assert ran == 1, f"{ctx}: the retry ran the work {ran} times"
    assert final in (Status.COMPLETED, Status.FAILED), f"{ctx}: left {final}"
    if rig.setting.on_conn:
        expected = 1 if final is Status.COMPLETED else 0
        assert rig.effects(key) == expected, f"{ctx}: {rig.effects(key)} committed writes"


def status_of(record: Any) -> Status | None:
    return record.status if record is not None else None


# --- the async face ---------------------------------------------------------------------


@asynccontextmanager
async def async_rig(setting: Setting) -> AsyncIterator[tuple[Rig, Any, Any]]:
    """The rig, the guard's store and the app's connection (None in store mode)."""
    plan = Plan()
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    async with AsyncExitStack() as stack:
        conn: Any = None
        if setting.kind == "memory":
            store: Any = AsyncMemoryStore()
            guarded: Any = VerbFaults(store, plan, asynchronous=True)
        elif setting.kind == "redis":
            assert setting.redis is not None
            store = AsyncRedisStore(setting.redis[0], prefix=setting.redis[1])
            stack.push_async_callback(store.aclose)
            guarded = VerbFaults(store, plan, asynchronous=True)
        else:
            assert setting.database is not None
            store = setting.database.async_store()
            stack.push_async_callback(store.aclose)
            arm_sql(store, plan, asynchronous=True)
            guarded = store
            if setting.on_conn:
                guarded = BindFaults(store, plan)
                conn = await _async_connect(setting.database, stack)
        yield Rig(setting, plan, clock, store), guarded, conn


async def _async_connect(database: Database, stack: AsyncExitStack) -> Any:
    if database.kind == "postgres":
        pg = await psycopg.AsyncConnection.connect(database.location)
        stack.push_async_callback(pg.close)
        return pg
    if database.kind == "mysql":
        options = connect_options(database.location)
        options["db"] = options.pop("database")
        my = await aiomysql.connect(**options)
        stack.push_async_callback(my.ensure_closed)
        return my
    engine = create_async_engine(f"sqlite+aiosqlite:///{database.location}")
    stack.push_async_callback(engine.dispose)
    alchemy = await engine.connect()
    stack.push_async_callback(alchemy.close)
    return alchemy


async def _async_write(conn: Any, table: str, key: str) -> None:
    if isinstance(conn, psycopg.AsyncConnection):
        await conn.execute(f"INSERT INTO {table} (k) VALUES (%s)", (key,))
    elif isinstance(conn, aiomysql.Connection):
        async with conn.cursor() as cursor:
            await cursor.execute(f"INSERT INTO {table} (k) VALUES (%s)", (key,))
    else:
        await conn.execute(text(f"INSERT INTO {table} (k) VALUES (:k)"), {"k": key})


def _async_in_transaction(conn: Any) -> bool:
    if isinstance(conn, psycopg.AsyncConnection):
        return conn.info.transaction_status != TransactionStatus.IDLE
    if isinstance(conn, aiomysql.Connection):
        return bool(conn.get_transaction_status())
    return bool(conn.in_transaction())


ASYNC_FAULTS = [
    pytest.param(Fault.RAISE, None, id="raise"),
    pytest.param(Fault.DROP, None, id="drop"),
    pytest.param(Fault.HANG, "timeout", id="hang"),
    pytest.param(Fault.CANCEL, "task", id="cancel-task"),
    pytest.param(Fault.CANCEL, "move_on_after", id="cancel-anyio"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("fault", "canceller"), ASYNC_FAULTS)
async def test_a_fault_at_any_async_store_operation_breaks_no_guarantee(
    setting: Setting, fault: Fault, canceller: str | None
) -> None:
    async with async_rig(setting) as (rig, guarded, conn):
        idem = AsyncIdempotency(guarded, policy(rig.clock))
        options = {"conn": conn, "mode": setting.mode} if conn is not None else {}

        async def call(key: str, outcome: str) -> Any:
            async with idem.once(key, operation=OPERATION, **options) as attempt:
                if not attempt.replayed:
                    await attempt.renew()
                    if conn is not None:
                        await _async_write(conn, setting.effects_table, key)
                    attempt.result = finish(rig, key, outcome)
            return attempt.result

        async def first(key: str, outcome: str, at: int | None) -> Run:
            run = Run()
            cancel = Canceller(canceller) if canceller else None
            rig.plan.arm(at, fault if at is not None else None, cancel and cancel.fire)
            try:
                if cancel is None:
                    run.value = await call(key, outcome)
                else:
                    task = await cancel.run(lambda: call(key, outcome))
                    await asyncio.wait((task,))
                    if task.cancelled():
                        run.error = cancel.raised or asyncio.CancelledError()
                    elif task.exception() is not None:
                        run.error = task.exception()
                    else:
                        run.value = task.result()
                    run.cancelled = run.value == "moved on" or isinstance(
                        run.error, asyncio.CancelledError | TimeoutError
                    )
            except BaseException as exc:  # checked against what is allowed
                run.error = exc
            finally:
                rig.plan.disarm()
            run.reached = key in rig.reached
            return run

        async def retry(key: str) -> tuple[Run, bool]:
            run, advanced = Run(), False
            for _ in range(2):
                try:
                    run.value = await call(key, "result")
                except ReplayedFailureError:
                    run.value = REPLAYED_FAILURE
                except RequestInProgressError:
                    if advanced:
                        run.error = RequestInProgressError(key, 0)
                        break
                    rig.clock.advance(LEASE + timedelta(seconds=1))
                    advanced = True
                    continue
                except BaseException as exc:  # checked: nothing may be raised
                    run.error = exc
                break
            return run, advanced

        for outcome in OUTCOMES:
            clean = f"clean-{outcome}"
            run = await first(clean, outcome, None)
            count = len(rig.plan.ops)
            assert count >= 2, rig.plan.ops
            keys = [clean] + [f"k{n}-{outcome}" for n in range(count)]
            for n, key in enumerate(keys):
                if n:
                    run = await first(key, outcome, n - 1)
                scope = Scope.of(key, operation=OPERATION)
                if conn is not None:
                    assert not _async_in_transaction(conn), (
                        f"{key}: {fault.value} at {rig.plan.hit} of {rig.plan.ops}:"
                        " the guard left the app's connection in a transaction"
                    )
                before = status_of(await rig.store.get(scope))
                check_first(rig, key, outcome, fault if n else None, run, before)
                executions = rig.executions[key]
                again, advanced = await retry(key)
                final = status_of(await rig.store.get(scope))
                check_retry(rig, key, before, executions, again, final, advanced)


# --- the sync face ----------------------------------------------------------------------


@contextmanager
def sync_rig(setting: Setting) -> Any:
    plan = Plan()
    clock = FakeClock(datetime(2026, 1, 1, tzinfo=UTC))
    closing: list[Callable[[], Any]] = []
    conn: Any = None
    try:
        if setting.kind == "memory":
            store: Any = MemoryStore()
            guarded: Any = VerbFaults(store, plan, asynchronous=False)
        elif setting.kind == "redis":
            assert setting.redis is not None
            store = RedisStore(setting.redis[0], prefix=setting.redis[1])
            closing.append(store.close)
            guarded = VerbFaults(store, plan, asynchronous=False)
        else:
            assert setting.database is not None
            store = setting.database.store()
            closing.append(store.close)
            arm_sql(store, plan, asynchronous=False)
            guarded = store
            if setting.on_conn:
                guarded = BindFaults(store, plan)
                conn = setting.database.connect(store)
                closing.append(conn.close)
        yield Rig(setting, plan, clock, store), guarded, conn
    finally:
        for close in reversed(closing):
            close()


def _sync_write(conn: Any, table: str, key: str) -> None:
    if isinstance(conn, sqlite3.Connection):
        conn.execute(f"INSERT INTO {table} (k) VALUES (?)", (key,))
    else:
        conn.execute(f"INSERT INTO {table} (k) VALUES (%s)", (key,))


def _sync_in_transaction(conn: Any) -> bool:
    if isinstance(conn, sqlite3.Connection):
        return conn.in_transaction
    if isinstance(conn, psycopg.Connection):
        return conn.info.transaction_status != TransactionStatus.IDLE
    return bool(conn.server_status & SERVER_STATUS.SERVER_STATUS_IN_TRANS)


@pytest.mark.parametrize("fault", [Fault.RAISE, Fault.DROP], ids=["raise", "drop"])
def test_a_fault_at_any_sync_store_operation_breaks_no_guarantee(
    setting: Setting, fault: Fault
) -> None:
    with sync_rig(setting) as (rig, guarded, conn):
        idem = Idempotency(guarded, policy(rig.clock))
        options = {"conn": conn, "mode": setting.mode} if conn is not None else {}

        def call(key: str, outcome: str) -> Any:
            with idem.once(key, operation=OPERATION, **options) as attempt:
                if not attempt.replayed:
                    attempt.renew()
                    if conn is not None:
                        _sync_write(conn, setting.effects_table, key)
                    attempt.result = finish(rig, key, outcome)
            return attempt.result

        def first(key: str, outcome: str, at: int | None) -> Run:
            run = Run()
            rig.plan.arm(at, fault if at is not None else None)
            try:
                run.value = call(key, outcome)
            except Exception as exc:  # checked against what is allowed
                run.error = exc
            finally:
                rig.plan.disarm()
            run.reached = key in rig.reached
            return run

        def retry(key: str) -> tuple[Run, bool]:
            run, advanced = Run(), False
            for _ in range(2):
                try:
                    run.value = call(key, "result")
                except ReplayedFailureError:
                    run.value = REPLAYED_FAILURE
                except RequestInProgressError:
                    if advanced:
                        run.error = RequestInProgressError(key, 0)
                        break
                    rig.clock.advance(LEASE + timedelta(seconds=1))
                    advanced = True
                    continue
                except Exception as exc:  # checked: nothing may be raised
                    run.error = exc
                break
            return run, advanced

        for outcome in OUTCOMES:
            clean = f"clean-{outcome}"
            run = first(clean, outcome, None)
            count = len(rig.plan.ops)
            assert count >= 2, rig.plan.ops
            keys = [clean] + [f"k{n}-{outcome}" for n in range(count)]
            for n, key in enumerate(keys):
                if n:
                    run = first(key, outcome, n - 1)
                scope = Scope.of(key, operation=OPERATION)
                if conn is not None:
                    assert not _sync_in_transaction(conn), (
                        f"{key}: {fault.value} at {rig.plan.hit} of {rig.plan.ops}:"
                        " the guard left the app's connection in a transaction"
                    )
                before = status_of(rig.store.get(scope))
                check_first(rig, key, outcome, fault if n else None, run, before)
                executions = rig.executions[key]
                again, advanced = retry(key)
                final = status_of(rig.store.get(scope))
                check_retry(rig, key, before, executions, again, final, advanced)
