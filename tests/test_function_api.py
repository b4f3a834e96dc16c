"""The function API: the decorator and ``once``, sync and async, on every store.

Most tests are written once as async tests against `Guard`, which puts the sync guard
(`Idempotency`) and the async one (`AsyncIdempotency`) behind the same awaited calls; the
``store_face`` fixture runs them on every store in both faces. Time is the test's FakeClock:
waiting advances it instead of sleeping.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, closing
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import anyio
import psycopg
import pydantic
import pytest

from idempo import (
    AsyncIdempotency,
    Attempt,
    FencedError,
    FingerprintMismatchError,
    Idempotency,
    InvalidKeyError,
    InvalidPayloadError,
    Policy,
    ReplayedFailureError,
    RequestInProgressError,
    ResponseTooLargeError,
    Scope,
    Status,
    UnserializableResultError,
)
from idempo.stores.postgres import AsyncPostgresStore, PostgresStore
from idempo.stores.sqlite import SQLiteStore
from idempo.testing import FakeClock

OPERATION = "test.charge"


class Guard:
    """A sync or async guard behind awaited calls, with its store and the test clock."""

    def __init__(self, store: Any, is_async: bool, policy: Policy) -> None:
        self.store = store
        self.is_async = is_async
        self.policy = policy
        self.idem: Any = AsyncIdempotency(store, policy) if is_async else Idempotency(store, policy)

    def replace(self, **changes: Any) -> Guard:
        """The same guard and store under a changed policy."""
        return Guard(self.store, self.is_async, self.policy.replace(**changes))

    @property
    def clock(self) -> FakeClock:
        clock = self.policy.clock
        assert isinstance(clock, FakeClock)
        return clock

    def idempotent(self, **options: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorate a body (sync, or async without real suspension under the sync guard);
        the result is awaited whichever guard wraps it."""

        def decorate(body: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
            is_coroutine = inspect.iscoroutinefunction(body)
            if self.is_async:
                guarded: Callable[..., Awaitable[Any]] = self.idem.idempotent(**options)(
                    body if is_coroutine else _as_async(body)
                )
                return guarded
            function = self.idem.idempotent(**options)(_run_sync(body) if is_coroutine else body)

            async def call(*args: Any, **kwargs: Any) -> Any:
                return function(*args, **kwargs)

            return call

        return decorate

    @asynccontextmanager
    async def once(self, key: Any, **options: Any) -> AsyncIterator[Attempt]:
        options.setdefault("operation", OPERATION)
        if self.is_async:
            async with self.idem.once(key, **options) as attempt:
                yield attempt
        else:
            with self.idem.once(key, **options) as attempt:
                yield attempt

    async def renew(self, attempt: Attempt) -> None:
        await _maybe(attempt.renew())

    async def get(self, key: str, *, operation: str = OPERATION, principal: str = "") -> Any:
        scope = Scope.of(key, operation=operation, principal=principal)
        return await _maybe(self.store.get(scope))

    async def stats(self) -> dict[str, int]:
        stats: dict[str, int] = await _maybe(self.store.stats())
        return {state: count for state, count in stats.items() if count}


async def _maybe(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _as_async(body: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
    """An async function with ``body``'s signature and annotations."""

    @functools.wraps(body)
    async def run(*args: Any, **kwargs: Any) -> Any:
        return body(*args, **kwargs)

    return run


def _run_sync(body: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
    """A sync function with ``body``'s signature, for async bodies that never suspend
    (their awaits are on sync connections)."""

    @functools.wraps(body)
    def run(*args: Any, **kwargs: Any) -> Any:
        coroutine = body(*args, **kwargs)
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
        coroutine.close()
        raise AssertionError("the body suspended; a sync guard cannot run it")

    return run


GuardFactory = Callable[..., Guard]


@pytest.fixture
def make_guard(store_face: tuple[Any, bool], clock: FakeClock) -> GuardFactory:
    """A guard on every store, sync and async; keyword arguments change the policy."""
    store, is_async = store_face

    def make(**policy: Any) -> Guard:
        policy.setdefault("clock", clock)
        policy.setdefault("sleep", clock.sleep)
        return Guard(store, is_async, Policy(**policy))

    return make


class Calls:
    """Counts executions of a function body."""

    def __init__(self) -> None:
        self.args: list[Any] = []

    def __len__(self) -> int:
        return len(self.args)


@dataclasses.dataclass(frozen=True)
class Receipt:
    id: str
    amount: int
    tags: list[str]


class Payment(pydantic.BaseModel):
    id: str
    cents: int
    at: datetime


class CardDeclinedError(Exception):
    """A deterministic failure of the test's payment function."""


# -- once and replay -----------------------------------------------------------------------


@pytest.mark.anyio
async def test_decorated_function_runs_once_and_replays(make_guard: GuardFactory) -> None:
    """The first call executes; retries with the same key replay its result; another key
    executes again."""
    guard = make_guard()
    calls = Calls()

    @guard.idempotent(key="order_id", operation=OPERATION)
    def charge(order_id: str, amount: int) -> dict[str, Any]:
        calls.args.append(order_id)
        return {"charged": amount, "n": len(calls)}

    first = await charge("o-1", 5)
    assert await charge("o-1", 5) == first == {"charged": 5, "n": 1}
    assert await charge(order_id="o-1", amount=5) == first
    assert await charge("o-2", 5) == {"charged": 5, "n": 2}
    assert calls.args == ["o-1", "o-2"]
    record = await guard.get("o-1")
    assert record.status is Status.COMPLETED


@pytest.mark.anyio
async def test_decorator_resolves_key_payload_and_principal(make_guard: GuardFactory) -> None:
    """Callables pick the key, the fingerprinted payload and the principal from the
    arguments: the same key for another principal runs separately, and arguments left out
    of the payload do not count as a change."""
    guard = make_guard()
    calls = Calls()

    @guard.idempotent(
        key=lambda request, user, trace: request["id"],
        payload=lambda request, user, trace: request["body"],
        principal=lambda request, user, trace: user,
        operation=OPERATION,
    )
    def handle(request: dict[str, Any], user: str, trace: str) -> str:
        calls.args.append((user, trace))
        return f"{user}:{request['body']}"

    request = {"id": "r-1", "body": {"amount": 5}}
    assert await handle(request, "alice", "t-1") == "alice:{'amount': 5}"
    assert await handle(request, "alice", "t-2") == "alice:{'amount': 5}"
    assert await handle(request, "bob", "t-3") == "bob:{'amount': 5}"
    with pytest.raises(FingerprintMismatchError):
        await handle({"id": "r-1", "body": {"amount": 6}}, "alice", "t-4")
    assert calls.args == [("alice", "t-1"), ("bob", "t-3")]
    assert (await guard.get("r-1", principal="bob")).status is Status.COMPLETED


@pytest.mark.anyio
async def test_falsy_results_are_stored_and_replayed(make_guard: GuardFactory) -> None:
    """0, False, None, {}, [] and "" are results like any other: stored, then replayed."""
    guard = make_guard()
    values: list[Any] = [0, False, None, {}, [], ""]
    calls = Calls()

    @guard.idempotent(key="key", operation=OPERATION)
    def work(key: str, index: int) -> Any:
        calls.args.append(key)
        return values[index]

    for index, value in enumerate(values):
        first = await work(f"k-{index}", index)
        replayed = await work(f"k-{index}", index)
        assert first == replayed == value
        assert type(replayed) is type(value)
    assert len(calls) == len(values)
    assert await guard.stats() == {"completed": len(values)}


@pytest.mark.anyio
async def test_dataclass_and_pydantic_results_replay_as_themselves(
    make_guard: GuardFactory,
) -> None:
    """A return annotation naming a dataclass or a pydantic model brings the replay back as
    that type, equal to the first result."""
    guard = make_guard()
    at = datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)

    @guard.idempotent(key="key", operation="receipt")
    def receipt(key: str) -> Receipt:
        return Receipt(id=key, amount=7, tags=["a", "b"])

    @guard.idempotent(key="key", operation="payment")
    def payment(key: str) -> Payment:
        return Payment(id=key, cents=1999, at=at)

    assert await receipt("r-1") == Receipt("r-1", 7, ["a", "b"])
    replayed_receipt = await receipt("r-1")
    assert type(replayed_receipt) is Receipt
    assert replayed_receipt == Receipt("r-1", 7, ["a", "b"])

    await payment("p-1")
    replayed_payment = await payment("p-1")
    assert type(replayed_payment) is Payment
    assert replayed_payment == Payment(id="p-1", cents=1999, at=at)
    assert (await guard.get("r-1", operation="receipt")).status is Status.COMPLETED


@pytest.mark.anyio
async def test_containers_of_dataclasses_replay_as_themselves(make_guard: GuardFactory) -> None:
    """A ``list[Receipt] | None`` annotation round-trips a list of dataclasses, not dicts."""
    guard = make_guard()

    @guard.idempotent(key="key", operation="receipts")
    def receipts(key: str) -> list[Receipt] | None:
        return [Receipt(id=key, amount=1, tags=[]), Receipt(id=key, amount=2, tags=["x"])]

    first = await receipts("r-1")
    replayed = await receipts("r-1")
    assert replayed == first
    assert all(type(item) is Receipt for item in replayed)


@pytest.mark.anyio
async def test_dataclass_arguments_are_fingerprinted_by_their_fields(
    make_guard: GuardFactory,
) -> None:
    """A dataclass argument counts as its fields: the same fields replay, other fields are a
    mismatch."""
    guard = make_guard()
    calls = Calls()

    @guard.idempotent(key="key", operation=OPERATION)
    def pay(key: str, receipt: Receipt) -> int:
        calls.args.append(receipt)
        return receipt.amount

    assert await pay("k-1", Receipt("r", 5, ["a"])) == 5
    assert await pay("k-1", Receipt("r", 5, ["a"])) == 5
    with pytest.raises(FingerprintMismatchError):
        await pay("k-1", Receipt("r", 6, ["a"]))
    assert len(calls) == 1


# -- refusals ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_fingerprint_mismatch_refuses_without_executing(make_guard: GuardFactory) -> None:
    """The same key with other arguments raises FingerprintMismatchError and runs nothing;
    the first result stays stored."""
    guard = make_guard()
    calls = Calls()

    @guard.idempotent(key="order_id", operation=OPERATION)
    def charge(order_id: str, amount: int) -> int:
        calls.args.append(amount)
        return amount

    assert await charge("o-1", 5) == 5
    with pytest.raises(FingerprintMismatchError) as info:
        await charge("o-1", 6)
    assert info.value.key == "o-1"
    assert info.value.status_code == 422
    assert calls.args == [5]
    assert await charge("o-1", 5) == 5
    assert (await guard.get("o-1")).response == b"5"


@pytest.mark.anyio
@pytest.mark.parametrize(
    "key",
    ["", "x" * 256, "clé", "tab\there", "new\nline", "nul\x00", "del\x7f", "with space", 42, None],
    ids=["empty", "256-chars", "non-ascii", "tab", "newline", "nul", "del", "space", "int", "none"],
)
async def test_bad_keys_are_refused_and_store_nothing(make_guard: GuardFactory, key: Any) -> None:
    """A malformed key raises InvalidKeyError before anything runs or is stored."""
    guard = make_guard()
    calls = Calls()

    @guard.idempotent(key="key", operation=OPERATION)
    def work(key: Any) -> str:
        calls.args.append(key)
        return "ran"

    with pytest.raises(InvalidKeyError):
        await work(key)
    with pytest.raises(InvalidKeyError):
        async with guard.once(key):
            calls.args.append(key)
    assert len(calls) == 0
    assert await guard.stats() == {}


@pytest.mark.anyio
async def test_non_json_payload_is_refused(make_guard: GuardFactory) -> None:
    """A payload that cannot be fingerprinted raises InvalidPayloadError and stores nothing."""
    guard = make_guard()
    calls = Calls()

    @guard.idempotent(key="key", operation=OPERATION)
    def work(key: str, tags: Any) -> str:
        calls.args.append(key)
        return "ran"

    with pytest.raises(InvalidPayloadError):
        await work("k-1", {"a", "b"})
    for payload in (object(), float("nan"), {1: "int key"}, {"nested": b"bytes"}):
        with pytest.raises(InvalidPayloadError):
            async with guard.once("k-2", payload=payload):
                calls.args.append(payload)
    assert len(calls) == 0
    assert await guard.stats() == {}


# -- failures ------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_a_policy_replaced_after_decorating_decides_the_next_calls(
    make_guard: GuardFactory,
) -> None:
    """A decorated function's codec is made once per policy, not once for ever: a guard whose
    policy is replaced (here: which errors are recorded) decides with the new one."""
    guard = make_guard()
    calls = Calls()

    @guard.idempotent(key="order_id", operation=OPERATION)
    def charge(order_id: str) -> str:
        calls.args.append(order_id)
        raise CardDeclinedError("insufficient funds")

    with pytest.raises(CardDeclinedError):
        await charge("o-1")
    assert await guard.get("o-1") is None  # not fail_on: released
    guard.idem.policy = guard.idem.policy.replace(fail_on=(CardDeclinedError,))
    with pytest.raises(CardDeclinedError):
        await charge("o-1")
    with pytest.raises(ReplayedFailureError):
        await charge("o-1")
    assert len(calls) == 2


@pytest.mark.anyio
async def test_exception_releases_the_key_and_a_retry_executes(make_guard: GuardFactory) -> None:
    """An exception propagates unchanged, leaves no record, and the retry runs again."""
    guard = make_guard(fail_on=(CardDeclinedError,))
    calls = Calls()

    @guard.idempotent(key="order_id", operation=OPERATION)
    def charge(order_id: str) -> str:
        calls.args.append(order_id)
        if len(calls) == 1:
            raise TimeoutError("psp timed out")
        return "charged"

    with pytest.raises(TimeoutError, match="psp timed out"):
        await charge("o-1")
    assert await guard.get("o-1") is None
    assert await charge("o-1") == "charged"
    assert await charge("o-1") == "charged"
    assert len(calls) == 2


@pytest.mark.anyio
async def test_fail_on_exception_is_stored_and_replayed(make_guard: GuardFactory) -> None:
    """An exception the policy names is raised to the first caller, stored as FAILED, and
    replayed to retries as ReplayedFailureError without running again."""
    guard = make_guard(fail_on=(CardDeclinedError,))
    calls = Calls()

    @guard.idempotent(key="order_id", operation=OPERATION)
    def charge(order_id: str) -> str:
        calls.args.append(order_id)
        raise CardDeclinedError("insufficient funds")

    with pytest.raises(CardDeclinedError):
        await charge("o-1")
    for _ in range(2):
        with pytest.raises(ReplayedFailureError) as info:
            await charge("o-1")
        assert info.value.error_type.endswith(".CardDeclinedError")
        assert info.value.detail == "insufficient funds"
    assert len(calls) == 1
    assert (await guard.get("o-1")).status is Status.FAILED


@pytest.mark.anyio
async def test_oversized_result_is_refused_and_recorded_as_a_failure(
    make_guard: GuardFactory,
) -> None:
    """A result over max_response_bytes raises ResponseTooLargeError and is never stored, not
    even truncated; the refusal is recorded as FAILED so a retry does not run the work again."""
    guard = make_guard(max_response_bytes=100)
    calls = Calls()

    @guard.idempotent(key="key", operation=OPERATION)
    def work(key: str) -> str:
        calls.args.append(key)
        return "x" * 200

    with pytest.raises(ResponseTooLargeError) as info:
        await work("k-1")
    assert (info.value.size, info.value.limit) == (202, 100)
    record = await guard.get("k-1")
    assert record.status is Status.FAILED
    assert b"x" * 101 not in record.response
    with pytest.raises(ReplayedFailureError) as replayed:
        await work("k-1")
    assert replayed.value.error_type.endswith(".ResponseTooLargeError")
    assert len(calls) == 1


@pytest.mark.anyio
async def test_result_the_serializer_refuses_is_recorded_as_a_failure(
    make_guard: GuardFactory,
) -> None:
    """A result the serializer cannot encode raises UnserializableResultError (the
    serializer's error as its cause) once and is then replayed as a failure: the work already
    ran, so a retry must not run it again."""
    guard = make_guard()
    calls = Calls()

    @guard.idempotent(key="key", operation=OPERATION)
    def work(key: str) -> object:
        calls.args.append(key)
        return object()

    with pytest.raises(UnserializableResultError) as raised:
        await work("k-1")
    assert isinstance(raised.value.__cause__, TypeError)
    with pytest.raises(ReplayedFailureError) as replayed:
        await work("k-1")
    assert replayed.value.error_type.endswith(".UnserializableResultError")
    assert len(calls) == 1


# -- in progress, waiting, renewing --------------------------------------------------------


@pytest.mark.anyio
async def test_duplicate_in_progress_is_refused(make_guard: GuardFactory) -> None:
    """While the first attempt holds the key, a duplicate raises RequestInProgressError
    with the time left on the lease, and does not run."""
    guard = make_guard(lease=timedelta(seconds=30))
    calls = Calls()
    async with guard.once("k-1", payload={"n": 1}) as first:
        guard.clock.advance(seconds=12)
        with pytest.raises(RequestInProgressError) as info:
            async with guard.once("k-1", payload={"n": 1}):
                calls.args.append("duplicate")
        assert info.value.retry_after == pytest.approx(18.0, abs=0.01)
        assert info.value.status_code == 409
        first.result = "first"
    assert len(calls) == 0
    async with guard.once("k-1", payload={"n": 1}) as retry:
        assert retry.replayed
        assert retry.result == "first"


@pytest.mark.anyio
async def test_waiter_gives_up_after_the_bound(make_guard: GuardFactory) -> None:
    """With Policy(wait=...), a duplicate polls while the first is running and gives up
    with RequestInProgressError once the bound has passed, without running."""
    guard = make_guard(wait=timedelta(seconds=2), lease=timedelta(seconds=30))
    calls = Calls()
    async with guard.once("k-1") as first:
        started = guard.clock()
        with pytest.raises(RequestInProgressError):
            async with guard.once("k-1"):
                calls.args.append("duplicate")
        waited = guard.clock() - started
        first.result = "first"
    assert timedelta(seconds=2) <= waited < timedelta(seconds=2.2)
    assert len(calls) == 0


def test_sync_waiter_replays_once_the_first_finishes(store: Any, clock: FakeClock) -> None:
    """A sync duplicate told to wait replays the first attempt's result as soon as it
    finishes, without running itself."""
    holder = None
    polls: list[float] = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        clock.sleep(seconds)
        if len(polls) == 3:  # the first attempt finishes while the duplicate waits
            assert holder is not None
            holder.__exit__(None, None, None)

    idem = Idempotency(store, Policy(clock=clock, sleep=sleep, wait=timedelta(seconds=5)))
    holder = idem.once("k-1", operation=OPERATION, payload={"n": 1})
    first = holder.__enter__()
    first.result = {"id": "pay-1"}

    with idem.once("k-1", operation=OPERATION, payload={"n": 1}) as second:
        assert second.replayed
        assert second.result == {"id": "pay-1"}
    assert len(polls) == 3
    assert all(0 < seconds <= 0.05 for seconds in polls)


@pytest.mark.anyio
async def test_async_waiter_replays_once_the_first_finishes(
    async_store: Any, clock: FakeClock
) -> None:
    """An async duplicate told to wait replays the result of a first attempt that finishes
    in another task while it waits, without running itself."""
    finish = anyio.Event()
    polls: list[float] = []

    def sleep(seconds: float) -> None:
        polls.append(seconds)
        clock.sleep(seconds)
        finish.set()

    idem = AsyncIdempotency(
        async_store, Policy(clock=clock, sleep=sleep, wait=timedelta(seconds=30))
    )
    held = anyio.Event()

    async def first() -> None:
        async with idem.once("k-1", operation=OPERATION) as attempt:
            held.set()
            await finish.wait()
            attempt.result = {"id": "pay-1"}

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(first)
        await held.wait()
        async with idem.once("k-1", operation=OPERATION) as second:
            assert second.replayed
            assert second.result == {"id": "pay-1"}
    assert polls
    assert clock() - datetime(2026, 1, 1, tzinfo=UTC) < timedelta(seconds=30)


@pytest.mark.anyio
async def test_renew_keeps_duplicates_out(make_guard: GuardFactory) -> None:
    """attempt.renew() extends the lease, so a duplicate after the original lease is still
    refused, and the attempt completes normally."""
    guard = make_guard(lease=timedelta(seconds=10))
    async with guard.once("k-1") as attempt:
        guard.clock.advance(seconds=8)
        await guard.renew(attempt)
        guard.clock.advance(seconds=8)  # 16 s: past the first lease, within the renewed one
        with pytest.raises(RequestInProgressError) as info:
            async with guard.once("k-1"):
                pass
        assert info.value.retry_after == pytest.approx(2.0, abs=0.01)
        attempt.result = "done"
    assert (await guard.get("k-1")).response == b'"done"'


@pytest.mark.anyio
async def test_renew_and_completion_after_takeover_are_fenced(make_guard: GuardFactory) -> None:
    """A holder whose lease was taken over cannot renew or complete: both raise FencedError,
    and retries replay the new holder's result."""
    guard = make_guard(lease=timedelta(seconds=10))

    async def zombie_call() -> None:
        async with guard.once("k-1") as zombie:
            guard.clock.advance(seconds=11)
            async with guard.once("k-1") as successor:
                assert not successor.replayed
                assert successor.token > zombie.token
                successor.result = "successor"
            with pytest.raises(FencedError):
                await guard.renew(zombie)
            zombie.result = "zombie"

    with pytest.raises(FencedError):
        await zombie_call()
    async with guard.once("k-1") as retry:
        assert retry.replayed
        assert retry.result == "successor"


# -- the app's own connection --------------------------------------------------------------


class AppDb:
    """A business table next to the records, reached through the app's own connections."""

    def __init__(self, kind: str, guard: Guard, url: str, table: str, autocommit: bool) -> None:
        self.kind = kind
        self.autocommit = autocommit
        self.guard = guard
        self.url = url
        self.table = table
        self._opened: list[Any] = []

    async def connect(self) -> Any:
        if self.kind == "sqlite":
            conn: Any = self.guard.store.connect()
        elif self.guard.is_async:
            conn = await psycopg.AsyncConnection.connect(self.url, autocommit=self.autocommit)
        else:
            conn = psycopg.connect(self.url, autocommit=self.autocommit)
        self._opened.append(conn)
        return conn

    async def insert(self, conn: Any, label: str) -> None:
        mark = "?" if self.kind == "sqlite" else "%s"
        await _maybe(conn.execute(f"INSERT INTO {self.table} (label) VALUES ({mark})", [label]))

    def labels(self) -> list[str]:
        """What is committed, read on a fresh connection."""
        sql = f"SELECT label FROM {self.table} ORDER BY label"
        if self.kind == "sqlite":
            with closing(sqlite3.connect(self.url)) as conn:
                return [label for (label,) in conn.execute(sql)]
        with psycopg.connect(self.url) as conn:
            return [label for (label,) in conn.execute(sql)]

    def records(self) -> int:
        """How many idempotency records are committed, read on a fresh connection."""
        sql = f"SELECT count(*) FROM {self.guard.store.dialect.table}"
        if self.kind == "sqlite":
            with closing(sqlite3.connect(self.url)) as conn:
                return int(conn.execute(sql).fetchone()[0])
        with psycopg.connect(self.url) as conn:
            row = conn.execute(sql).fetchone()
            assert row is not None
            return int(row[0])

    def idle(self, conn: Any) -> bool:
        """The guard left the connection outside any transaction."""
        if self.kind == "sqlite":
            return not conn.in_transaction
        return bool(conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE)

    async def close(self) -> None:
        for conn in self._opened:
            await _maybe(conn.close())


# (database, async guard, the app's connections in autocommit mode)
TX_BACKENDS = [
    pytest.param(("sqlite", False, False), id="sqlite3"),
    pytest.param(("postgres", False, False), marks=pytest.mark.postgres, id="psycopg"),
    pytest.param(("postgres", False, True), marks=pytest.mark.postgres, id="psycopg-autocommit"),
    pytest.param(("postgres", True, False), marks=pytest.mark.postgres, id="psycopg-async"),
]


@pytest.fixture(params=TX_BACKENDS)
async def app_db(
    request: pytest.FixtureRequest, tmp_path: Path, clock: FakeClock
) -> AsyncIterator[AppDb]:
    """A guard on a store that can join the app's transaction, and the app's database."""
    kind, is_async, autocommit = request.param
    policy = Policy(clock=clock, sleep=clock.sleep, lease=timedelta(seconds=10))
    store: Any
    if kind == "sqlite":
        path = str(tmp_path / "app.db")
        store = SQLiteStore(path)
        store.migrate()
        url, table = path, "payments"
    else:
        url = request.getfixturevalue("postgres_url")
        schema = request.getfixturevalue("pg_schema")
        table = f"{schema}.payments"
        if is_async:
            store = AsyncPostgresStore(url, table=f"{schema}.idempo_records")
            await store.migrate()
        else:
            store = PostgresStore(url, table=f"{schema}.idempo_records")
            store.migrate()
    db = AppDb(kind, Guard(store, is_async, policy), url, table, autocommit)
    setup = await db.connect()
    await _maybe(setup.execute(f"CREATE TABLE {table} (label TEXT NOT NULL)"))
    if not autocommit:
        await _maybe(setup.commit())
    try:
        yield db
    finally:
        await db.close()
        await _maybe(store.aclose() if is_async else store.close())


@pytest.mark.anyio
async def test_business_write_and_record_commit_together(app_db: AppDb) -> None:
    """In transactional mode neither the business write nor the record is visible until
    the block ends; then both are committed, and a retry replays without running."""
    conn = await app_db.connect()
    async with app_db.guard.once("k-1", payload={"amount": 5}, conn=conn) as attempt:
        assert not attempt.replayed
        await app_db.insert(conn, "pay-1")
        assert app_db.labels() == []
        assert app_db.records() == 0
        attempt.result = {"id": "pay-1"}
    assert app_db.labels() == ["pay-1"]
    assert app_db.records() == 1
    assert app_db.idle(conn)

    async with app_db.guard.once("k-1", payload={"amount": 5}, conn=conn) as retry:
        assert retry.replayed
        assert retry.result == {"id": "pay-1"}
    assert app_db.labels() == ["pay-1"]
    assert app_db.idle(conn)
    record = await app_db.guard.get("k-1")
    assert (record.status, record.response) == (Status.COMPLETED, b'{"id":"pay-1"}')


@pytest.mark.anyio
async def test_exception_rolls_back_business_write_and_record(app_db: AppDb) -> None:
    """An exception in transactional mode rolls back the business write with the
    reservation, so the retry runs again and commits once."""
    conn = await app_db.connect()

    async def interrupted() -> None:
        async with app_db.guard.once("k-1", conn=conn):
            await app_db.insert(conn, "lost")
            raise TimeoutError

    with pytest.raises(TimeoutError):
        await interrupted()
    assert app_db.labels() == []
    assert app_db.records() == 0
    assert app_db.idle(conn)

    async with app_db.guard.once("k-1", conn=conn) as retry:
        assert not retry.replayed
        await app_db.insert(conn, "kept")
        retry.result = "ok"
    assert app_db.labels() == ["kept"]


@pytest.mark.anyio
async def test_decorated_function_on_the_apps_connection(app_db: AppDb) -> None:
    """The decorator's ``conn`` parameter runs the function in the guard's transaction,
    leaves the connection out of the fingerprint, and replays without running."""
    calls = Calls()

    @app_db.guard.idempotent(key="order_id", conn="conn", operation=OPERATION)
    async def charge(conn: Any, order_id: str, amount: int) -> str:
        calls.args.append(order_id)
        await app_db.insert(conn, f"{order_id}:{amount}")
        return f"paid {amount}"

    first, second = await app_db.connect(), await app_db.connect()
    assert await charge(first, "o-1", 5) == "paid 5"
    assert await charge(second, "o-1", 5) == "paid 5"
    with pytest.raises(FingerprintMismatchError):
        await charge(second, "o-1", 6)
    assert calls.args == ["o-1"]
    assert app_db.labels() == ["o-1:5"]
    assert app_db.idle(first)
    assert app_db.idle(second)


@pytest.mark.anyio
async def test_fail_on_in_transactional_mode_keeps_only_the_outcome(app_db: AppDb) -> None:
    """A deterministic failure rolls back the business write but records the failure, which
    is replayed to retries."""
    guard = app_db.guard.replace(fail_on=(CardDeclinedError,))
    conn = await app_db.connect()

    async def declined() -> None:
        async with guard.once("k-1", conn=conn):
            await app_db.insert(conn, "declined")
            raise CardDeclinedError("no")

    with pytest.raises(CardDeclinedError):
        await declined()
    assert app_db.labels() == []
    assert app_db.idle(conn)
    with pytest.raises(ReplayedFailureError):
        async with guard.once("k-1", conn=conn):
            await app_db.insert(conn, "retry")
    assert app_db.labels() == []
    assert (await guard.get("k-1")).status is Status.FAILED


@pytest.mark.anyio
async def test_leased_zombie_is_fenced_and_its_write_rolled_back(app_db: AppDb) -> None:
    """In leased mode a holder whose lease was taken over gets FencedError at completion,
    and its business write rolls back with the refused completion."""
    zombie_conn = await app_db.connect()
    successor_conn = await app_db.connect()
    guard = app_db.guard

    async def zombie_call() -> None:
        async with guard.once("k-1", conn=zombie_conn, mode="leased") as zombie:
            assert app_db.records() == 1  # the reservation committed at once
            guard.clock.advance(seconds=11)
            async with guard.once("k-1", conn=successor_conn, mode="leased") as successor:
                assert successor.token > zombie.token
                await app_db.insert(successor_conn, "successor")
                successor.result = "successor"
            await app_db.insert(zombie_conn, "zombie")
            zombie.result = "zombie"

    with pytest.raises(FencedError):
        await zombie_call()

    assert app_db.labels() == ["successor"]
    assert app_db.idle(zombie_conn)
    if app_db.kind == "postgres":
        assert zombie_conn.autocommit is app_db.autocommit
    async with guard.once("k-1", conn=zombie_conn, mode="leased") as retry:
        assert retry.replayed
        assert retry.result == "successor"


@pytest.mark.anyio
async def test_do_not_store_gives_the_answer_and_releases_the_key(app_db: AppDb) -> None:
    """An attempt told not to store its result releases the key, and on the app's
    connection its writes roll back with it: the retry runs the work again, once."""
    conn = await app_db.connect()
    async with app_db.guard.once("k-1", conn=conn, operation=OPERATION) as attempt:
        await app_db.insert(conn, "stale quote")
        attempt.result = {"error": "stale"}
        attempt.do_not_store()
    assert not attempt.keeps_answer
    assert app_db.labels() == []
    assert await app_db.guard.get("k-1", operation=OPERATION) is None
    for expected_replayed in (False, True):
        async with app_db.guard.once("k-1", conn=conn, operation=OPERATION) as attempt:
            assert attempt.replayed is expected_replayed
            if not attempt.replayed:
                await app_db.insert(conn, "fresh quote")
                attempt.result = {"price": 5}
    assert attempt.result == {"price": 5}
    assert app_db.labels() == ["fresh quote"]
    assert app_db.idle(conn)
