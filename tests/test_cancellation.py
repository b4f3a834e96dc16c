"""Cancellation releases the key (SPEC §8, issue 10 defect 7), on every async store.

Every kind of cancellation an async caller meets (``task.cancel()``, ``asyncio.timeout``,
anyio's ``move_on_after`` and ``fail_after``, which Starlette and FastAPI use and which cancel
again at every await until the scope exits) lands at an exact moment of a guarded call: while
the reservation is sent or its reply is on its way back, while the work runs, while the
completion or the release is sent or answered. A `Gate` in front of the store holds the chosen
verb until the test has cancelled the caller. Afterwards the key is never left in progress:
a retry executes at once, or replays the completion that landed; the work ran at most once per
attempt, never after a cancellation that came before it; the caller still sees its own
cancellation, and its task is not left cancelling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import anyio
import pytest
import redis

from faults import STEP, Canceller, Gate
from idempo import (
    AsyncIdempotency,
    FencedError,
    Policy,
    RequestInProgressError,
    Scope,
    Status,
)
from idempo.stores.sqlite import AsyncSQLiteStore

OPERATION = "test.cancel"


class AppError(Exception):
    pass


async def turns(n: int = 5) -> None:
    """Let the loop go round a few times, so that anyio's scopes cancel again."""
    for _ in range(n):
        await asyncio.sleep(0)


KINDS = ["task", "timeout", "move_on_after", "fail_after"]
# (moment, gated verb, applied before the gate, the work raises, record left by the first call)
MOMENTS = [
    pytest.param("reserve", "reserve", False, False, None, id="reserve-sent"),
    pytest.param("reserve", "reserve", True, False, None, id="reserve-answered"),
    pytest.param("work", "release", False, False, None, id="work"),
    pytest.param("complete", "complete", False, False, Status.COMPLETED, id="complete-sent"),
    pytest.param("complete", "complete", True, False, Status.COMPLETED, id="complete-answered"),
    pytest.param("release", "release", False, True, None, id="release-sent"),
    pytest.param("release", "release", True, True, None, id="release-answered"),
]


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("moment", "verb", "applied", "raises", "left"), MOMENTS)
async def test_a_cancelled_call_never_leaves_its_key_in_progress(
    async_node_store: Any,
    kind: str,
    moment: str,
    verb: str,
    applied: bool,
    raises: bool,
    left: Status | None,
) -> None:
    gate = Gate(async_node_store, verb, applied=applied)
    idem = AsyncIdempotency(gate, Policy(lease=timedelta(minutes=10)))
    scope = Scope.of("k-cancel", operation=OPERATION)
    ran: list[str] = []
    working = asyncio.Event()

    async def work() -> str:
        ran.append("ran")
        if moment == "work" and not working.is_set():
            working.set()
            await asyncio.Event().wait()  # until cancelled
        if raises:
            raise AppError("transient")
        return "done"

    async def call() -> Any:
        async with idem.once(scope.key, operation=OPERATION) as attempt:
            if not attempt.replayed:
                attempt.result = await work()
        return attempt.result

    canceller = Canceller(kind)
    task = await canceller.run(call)
    await asyncio.wait_for((working if moment == "work" else gate.entered).wait(), STEP)
    canceller.fire()
    if moment == "work":
        # The work is cancelled; the guard's own release must get through the gate although
        # anyio's scopes cancel again at every await.
        await asyncio.wait_for(gate.entered.wait(), STEP)
    await turns()
    gate.opened.set()
    await canceller.outcome(task)
    if raises:
        assert isinstance(canceller.raised, asyncio.CancelledError)
        assert isinstance(canceller.raised.__context__, AppError), "the app's error is lost"

    record = await async_node_store.get(scope)
    assert (record.status if record else None) == left
    assert ran == ([] if moment == "reserve" else ["ran"]), "work after a cancellation"

    # A retry never finds the key in progress: it executes at once, or replays.
    ran.clear()
    raises = False
    try:
        again = await asyncio.wait_for(call(), STEP)
    except RequestInProgressError:
        pytest.fail("the cancelled call left its key in progress")
    assert again == "done"
    assert ran == ([] if left is Status.COMPLETED else ["ran"])


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_caller_cancelled_while_waiting_for_a_duplicate_leaves_its_record(
    async_node_store: Any, kind: str
) -> None:
    """The wait (``policy.wait``) is no cleanup: it is cut at once, and the first holder's
    reservation stays as it was."""
    waiting = asyncio.Event()

    async def sleep(seconds: float) -> None:
        waiting.set()
        await asyncio.Event().wait()

    idem = AsyncIdempotency(async_node_store, Policy(wait=timedelta(minutes=1), sleep=sleep))
    scope = Scope.of("k-wait", operation=OPERATION)
    async with idem.once(scope.key, operation=OPERATION) as first:
        canceller = Canceller(kind)

        async def duplicate() -> None:
            async with idem.once(scope.key, operation=OPERATION):
                pytest.fail("a duplicate ran while the first held the key")

        task = await canceller.run(duplicate)
        await asyncio.wait_for(waiting.wait(), STEP)
        canceller.fire()
        await canceller.outcome(task)
        record = await async_node_store.get(scope)
        assert record is not None
        assert record.status is Status.IN_PROGRESS
        assert record.token == first.token
        first.result = "first"
    record = await async_node_store.get(scope)
    assert record is not None
    assert record.status is Status.COMPLETED


@pytest.mark.anyio
async def test_a_hung_store_cannot_hold_a_cancelled_caller(
    async_node_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cleanup is bounded: a release that never answers is given up after
    ``CLEANUP_TIMEOUT``; the cancellation still reaches the caller."""
    from idempo._core import flow as _flow

    monkeypatch.setattr(_flow, "CLEANUP_TIMEOUT", 0.05)
    gate = Gate(async_node_store, "release", applied=False)  # never opened
    idem = AsyncIdempotency(gate)
    working = asyncio.Event()

    async def call() -> None:
        async with idem.once("k-hung", operation=OPERATION):
            working.set()
            await asyncio.Event().wait()

    canceller = Canceller("move_on_after")
    task = await canceller.run(call)
    await asyncio.wait_for(working.wait(), STEP)
    canceller.fire()
    assert await canceller.outcome(task) == "moved on"
    assert gate.entered.is_set()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_cancellation_that_comes_while_the_work_is_cancelled_is_not_lost(
    async_node_store: Any, kind: str
) -> None:
    """The work is cancelled by a plain ``task.cancel()``; the caller's scope fires while
    the guard releases: both reach the caller, nothing is uncancelled twice."""
    gate = Gate(async_node_store, "release", applied=False)
    idem = AsyncIdempotency(gate)
    working = asyncio.Event()
    scope = Scope.of("k-twice", operation=OPERATION)

    async def call() -> None:
        async with idem.once(scope.key, operation=OPERATION):
            working.set()
            await asyncio.Event().wait()

    canceller = Canceller(kind)
    task = await canceller.run(call)
    await asyncio.wait_for(working.wait(), STEP)
    canceller.fire()
    await asyncio.wait_for(gate.entered.wait(), STEP)
    task.cancel()  # a second canceller: the server shutting down
    await turns()
    gate.opened.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), STEP)
    assert await async_node_store.get(scope) is None


@pytest.mark.anyio
async def test_a_sqlite_reserve_cancelled_in_its_thread_commits_nothing(
    async_sqlite_store: AsyncSQLiteStore,
) -> None:
    """The store's own verbs too: the worker thread of a cancelled reserve rolls back instead
    of leaving a reservation nobody knows the token of."""
    store = async_sqlite_store
    scope = Scope.of("k-thread", operation=OPERATION)
    blocker = store._sync.connect()
    blocker.execute("BEGIN IMMEDIATE")  # the reserve's thread waits for the write lock
    try:
        reserving = asyncio.ensure_future(
            store.reserve(
                scope, "fp", now=_now(), lease=timedelta(seconds=30), ttl=timedelta(hours=1)
            )
        )
        await _held_by_another_thread(store._sync._writer)
        reserving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reserving
    finally:
        blocker.rollback()
        blocker.close()
    # Another writer queues behind the cancelled one's thread: once it is through, that
    # thread has finished.
    other = Scope.of("k-after", operation=OPERATION)
    await store.reserve(
        other, "fp", now=_now(), lease=timedelta(seconds=30), ttl=timedelta(hours=1)
    )
    assert await store.get(scope) is None


class RedisGate:
    """Holds the first call of an `AsyncRedisStore` that ``holds`` picks, at a ``moment``:
    ``before`` it is started, once it is ``answered`` (its reply read), or ``in-flight`` (its
    command sent, its reply owed: the first command ``on_wire`` picks, on the store's lane);
    ``listing`` is ``before`` for the listing's pipeline. ``seen``: the task that reached it.
    Once the gate has held a call, every call passes freely."""

    def __init__(
        self,
        store: Any,
        monkeypatch: pytest.MonkeyPatch,
        moment: str,
        holds: Callable[[Any], bool],
        on_wire: Callable[[bytes], bool],
    ) -> None:
        from idempo.stores.redis import _lane

        self.entered, self.opened = asyncio.Event(), asyncio.Event()
        self.seen: list[asyncio.Task[Any] | None] = []
        self._holds, self._on_wire = holds, on_wire
        self._before = moment in ("before", "listing")
        self._start, self._send = store._start, _lane._asend
        if moment == "in-flight":
            monkeypatch.setattr(_lane, "_asend", self._in_flight)
        else:
            monkeypatch.setattr(store, "_start", self._gated)

    async def _hold(self) -> None:
        self.seen.append(asyncio.current_task())
        self.entered.set()
        await self.opened.wait()

    def _gated(self, call: Any) -> Any:
        if self.entered.is_set() or not self._holds(call):
            return self._start(call)
        return self._held(call)

    async def _held(self, call: Any) -> Any:
        if self._before:
            await self._hold()
        reply = await self._start(call)
        if not self._before:
            await self._hold()
        return reply

    async def _in_flight(self, conn: Any, packed: bytes) -> Any:
        if self.entered.is_set() or not self._on_wire(packed):
            return await self._send(conn, packed)
        await conn.send_packed_command(packed)
        await self._hold()  # cancelled here, the reply is owed as when the lane's read is
        return await conn.read_response(disconnect_on_error=False)

    async def cancel(
        self, kind: str, call: Callable[[], Awaitable[Any]], read: Callable[[], Any]
    ) -> Any:
        """Run ``call`` under ``kind`` of cancellation, fire it once the gate holds a call of
        the caller's own task, then open the gate: what ``read`` (a blocking read of the
        record) found at the instant the caller heard its cancellation, with no turn of the
        loop in between (so what the cancellation left, not what an undo in the background
        leaves later)."""
        found: list[Any] = []

        async def watched() -> Any:
            try:
                return await call()
            except BaseException:
                found.append(read())
                raise

        canceller = Canceller(kind)
        task = await canceller.run(watched)
        await asyncio.wait_for(self.entered.wait(), STEP)
        assert self.seen == [task], "the reservation ran in a task of its own"
        canceller.fire()
        await turns()
        self.opened.set()
        await canceller.outcome(task)
        assert len(found) == 1
        return found[0]


# Where the cancellation lands in a Redis reservation: before its SET is sent, with the SET
# sent and its reply on its way, with the reply read, and (on a given clock) in the listing
# that follows a reservation taken.
REDIS_MOMENTS = ["before", "in-flight", "answered", "listing"]


@pytest.mark.redis
@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("moment", REDIS_MOMENTS)
async def test_a_redis_reserve_cancelled_under_way_leaves_nothing_held(
    async_redis_store: Any,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    moment: str,
) -> None:
    """A caller cancelled at any moment of its Redis reservation finds the key free once it
    sees its cancellation, and a retry runs the work. The reservation runs in the caller's
    own task (`AsyncRedisStore.undoes_cancelled_reserve`), so the cancellation cuts it short
    and the store's undo is what frees the key."""
    from idempo.stores.redis._ops import Batch, Command

    store = async_redis_store

    def holds(call: Any) -> bool:
        if moment == "listing":
            return isinstance(call, Batch)
        return isinstance(call, Command) and call.name == "execute_command"

    gate = RedisGate(store, monkeypatch, moment, holds, on_wire=lambda packed: True)
    clock = _now if moment == "listing" else None
    idem = AsyncIdempotency(store, Policy(lease=timedelta(minutes=10), clock=clock))
    scope = Scope.of("k-redis-cancel", operation=OPERATION)
    ran: list[str] = []

    async def call() -> Any:
        async with idem.once(scope.key, operation=OPERATION) as attempt:
            if not attempt.replayed:
                ran.append("ran")
                attempt.result = "done"
        return attempt.result

    with redis.Redis.from_url(redis_url) as reader:
        found = await gate.cancel(kind, call, lambda: reader.get(store._keys.key(scope)))
    assert ran == []
    assert found is None or found[:1] == b"x", "the key was held when the caller heard"
    assert await asyncio.wait_for(call(), STEP) == "done"
    assert ran == ["ran"]


@pytest.mark.redis
@pytest.mark.anyio
@pytest.mark.parametrize("how", ["task-cancel", "anyio-scope-cancel"])
async def test_a_redis_call_cancelled_at_any_turn_of_the_loop_sees_it_and_frees_the_key(
    async_redis_store: Any, how: str
) -> None:
    """A cancellation requested at once (``task.cancel()``, an anyio scope's ``cancel()``)
    after any number of turns of the loop into a guarded call on Redis, wherever it lands:
    the caller sees it (an anyio scope's, unless the call ends first), its task is not left
    cancelling, and the key is either free (the work did not run) or completed (the
    cancellation came after it). On Python 3.11,
    ``asyncio.wait_for``, which redis-py sends each command under, swallows a cancellation
    that lands in the turn its send ends; the reservation runs in the caller's task, so the
    guard must notice it. (A deadline's cancellation may come after the call ended: these
    two are requested when fired.)"""
    store = async_redis_store
    idem = AsyncIdempotency(store, Policy(lease=timedelta(minutes=10)))
    ran: list[str] = []
    scopes: list[anyio.CancelScope] = []

    async def call(key: str) -> Any:
        async with idem.once(key, operation=OPERATION) as attempt:
            if not attempt.replayed:
                ran.append(key)
                attempt.result = "done"
        return attempt.result

    async def scoped(key: str) -> Any:
        try:
            with anyio.CancelScope() as scope:
                scopes.append(scope)
                return await call(key)
            return "moved on"
        finally:
            me = asyncio.current_task()
            assert me is not None
            assert me.cancelling() == 0, "the scope's cancellation was not taken back"

    await call("k-warm")  # the token clock's first TIME and the kept connection
    turns = 0 if how == "task-cancel" else 1  # a scope exists once its task has started
    while True:
        key = f"k-turn-{turns}"
        task = asyncio.ensure_future(call(key) if how == "task-cancel" else scoped(key))
        for _ in range(turns):
            await asyncio.sleep(0)
        if task.done():
            break  # the call is shorter than this many turns: every turn was tried
        if how == "task-cancel":
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            scopes[-1].cancel()
            # Delivered at the next await that suspends: a call that reaches none first ends.
            outcome = await task
            assert outcome == "moved on" or key in ran, (turns, outcome)
        record = await store.get(Scope.of(key, operation=OPERATION))
        left = record.status if record else None
        assert left is (Status.COMPLETED if key in ran else None), (turns, left)
        turns += 1
    await task
    assert turns > 3


# Where the cancellation lands in a takeover of an expired attempt that recorded a step,
# and on whose clock: the reserve script sent and its reply on its way, its reply read, and
# (on a given clock) the listing that follows the takeover.
TAKEOVER_MOMENTS = [
    pytest.param("in-flight", "given", id="in-flight-given"),
    pytest.param("in-flight", "redis", id="in-flight-redis"),
    pytest.param("answered", "given", id="answered-given"),
    pytest.param("answered", "redis", id="answered-redis"),
    pytest.param("listing", "given", id="listing-given"),
]


@pytest.mark.redis
@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("moment", "clock"), TAKEOVER_MOMENTS)
async def test_a_redis_takeover_of_committed_steps_cancelled_under_way_is_free_at_once(
    async_redis_store: Any,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    moment: str,
    clock: str,
) -> None:
    """A caller cancelled while its reservation takes over an expired attempt that recorded
    a step: the record and its step stay (they committed), and its lease is over when the
    caller hears its cancellation. So a retry right after takes over at once (no 409 for a
    lease) and resumes after the step, and the stalled first attempt's completion is
    refused."""
    from idempo.stores.redis._ops import Batch, Run
    from idempo.stores.redis._protocol import decode
    from idempo.stores.redis._scripts import RESERVE
    from idempo.testing import FakeClock

    store = async_redis_store
    fake = FakeClock() if clock == "given" else None
    stalled_lease = timedelta(minutes=1) if fake else timedelta(milliseconds=100)
    first = AsyncIdempotency(store, Policy(lease=stalled_lease, clock=fake))
    idem = AsyncIdempotency(store, Policy(lease=timedelta(minutes=10), clock=fake))
    scope = Scope.of("k-redis-steps", operation=OPERATION)
    checkpointed, stalled_on = asyncio.Event(), asyncio.Event()

    async def stalled() -> None:
        async with first.once(scope.key, operation=OPERATION) as attempt:
            await attempt.checkpoint("step-1")
            checkpointed.set()
            await stalled_on.wait()
            attempt.result = "stale"

    def holds(call: Any) -> bool:
        if moment == "listing":
            return isinstance(call, Batch)
        return isinstance(call, Run) and call.script == RESERVE

    ran: list[tuple[str, ...]] = []

    async def call() -> Any:
        async with idem.once(scope.key, operation=OPERATION) as attempt:
            if not attempt.replayed:
                ran.append(attempt.steps)
                attempt.result = "resumed"
        return attempt.result

    stalling = asyncio.ensure_future(stalled())
    try:
        await asyncio.wait_for(checkpointed.wait(), STEP)
        if fake is None:
            await asyncio.sleep(0.2)  # past the stalled lease on Redis's clock (longer is as good)
        else:
            fake.advance(timedelta(minutes=2))
        # Loaded before the gate: a first EVALSHA answered NOSCRIPT would be the one held.
        await store.client.script_load(store._scripts[RESERVE].script)
        gate = RedisGate(
            store, monkeypatch, moment, holds, on_wire=lambda packed: b"EVALSHA" in packed[:32]
        )
        with redis.Redis.from_url(redis_url) as reader:
            found = await gate.cancel(kind, call, lambda: reader.get(store._keys.key(scope)))
        assert ran == []
        assert found is not None
        left = decode(found, scope).record
        assert left is not None
        assert (left.status, left.recovery_point is not None) == (Status.IN_PROGRESS, True)
        assert left.lease_expires_at is not None
        assert left.lease_expires_at <= left.updated_at, "the key was held when the caller heard"

        try:
            assert await asyncio.wait_for(call(), STEP) == "resumed"
        except RequestInProgressError:
            pytest.fail("the cancelled takeover left its key in progress for a lease")
        assert ran == [("step-1",)]
        stalled_on.set()
        with pytest.raises(FencedError):
            await asyncio.wait_for(stalling, STEP)
        record = await store.get(scope)
        assert record is not None
        assert record.status is Status.COMPLETED
        assert await asyncio.wait_for(call(), STEP) == "resumed"  # replayed
        assert ran == [("step-1",)]
    finally:
        stalling.cancel()  # a failed check leaves it stalled


def _now() -> datetime:
    return datetime.now(UTC)


async def _held_by_another_thread(lock: Any) -> None:
    """Until a worker thread holds ``lock`` (the store's writer lock)."""
    deadline = asyncio.get_running_loop().time() + STEP
    while lock.acquire(blocking=False):
        lock.release()
        assert asyncio.get_running_loop().time() < deadline, "the reserve never started"
        await asyncio.sleep(0.001)


def _request(key: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/payments",
        "raw_path": b"/payments",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"idempotency-key", key.encode()), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


@pytest.mark.anyio
@pytest.mark.parametrize("kind", KINDS)
async def test_a_request_cancelled_in_its_handler_releases_its_key(
    async_node_store: Any, kind: str
) -> None:
    """Over ASGI: the server or the framework cancels the request while the handler runs (a
    client that went away, a timeout); the middleware's release gets through, and the retry
    runs the handler."""
    from idempo.asgi import IdempotencyMiddleware

    gate = Gate(async_node_store, "release", applied=False)
    handling = asyncio.Event()
    calls: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        calls.append("handled")
        if len(calls) == 1:
            handling.set()
            await asyncio.Event().wait()  # until cancelled
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})

    middleware = IdempotencyMiddleware(
        app, idempotency=AsyncIdempotency(gate), principal=lambda scope: "alice"
    )

    async def request() -> list[dict[str, Any]]:
        body = [{"type": "http.request", "body": b"{}", "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            if body:
                return body.pop()
            await asyncio.Event().wait()  # the client stays
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await middleware(_request("k-http"), receive, send)
        return sent

    canceller = Canceller(kind)
    task = await canceller.run(request)
    await asyncio.wait_for(handling.wait(), STEP)
    canceller.fire()
    await asyncio.wait_for(gate.entered.wait(), STEP)
    await turns()
    gate.opened.set()
    await canceller.outcome(task)
    retried = await asyncio.wait_for(request(), STEP)
    assert retried[0]["status"] == 201, retried
    assert calls == ["handled", "handled"]
