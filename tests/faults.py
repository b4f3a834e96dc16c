"""Fault injection at the store operations of a guarded call (a plain module, not a conftest).

A `Plan` counts every store operation one guarded call makes and, at the N-th, injects a
`Fault`. Operations are counted where they are atomic:

* on the store's own connections, each verb (memory, Redis: `VerbFaults`) or each transaction
  a SQL store runs (`arm_sql`: its ``run``, which ``OnStore`` operations reach too): before
  it (nothing applied) or after it (committed, the reply lost);
* on the app's connection (a bound unit, `BindFaults`), each transaction operation the unit
  sends: Begin, every statement, Commit, Rollback.

A raised fault is a `StoreUnavailableError`, what the stores map a broken connection to. On
the app's connection, a statement that fails before it ran leaves the transaction to the
unit's own handling; a failed Commit or Rollback rolls back, and a reply lost after the server
ran the operation means the connection broke, so the server ends the transaction: a
connection that stays alive with its transaction open is not a fault a server can produce.
"""

from __future__ import annotations

import asyncio
import enum
import math
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import anyio

from idempo import StoreUnavailableError
from idempo._core import flow as _flow
from idempo.stores._sql.dialect import Statement
from idempo.stores._sql.transaction import Commit, OnStore, Rollback


class Fault(enum.Enum):
    RAISE = "raise"  # the operation fails before the store applied it
    DROP = "drop"  # the store applied it; its reply is lost
    HANG = "hang"  # the store never answers; the caller's own timeout fires
    CANCEL = "cancel"  # the caller is cancelled while the operation runs


class Plan:
    """Which operation of the next call gets which fault, and the operations seen."""

    def __init__(self) -> None:
        self.at: int | None = None
        self.fault: Fault | None = None
        self.on_cancel: Callable[[], None] | None = None
        self.ops: list[str] = []
        self.armed = False

    def arm(
        self, at: int | None, fault: Fault | None, on_cancel: Callable[[], None] | None = None
    ) -> None:
        self.at, self.fault, self.on_cancel = at, fault, on_cancel
        self.ops = []
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def tick(self, name: str) -> Fault | None:
        """Count one operation; its fault, if it is the chosen one."""
        if not self.armed:
            return None
        index = len(self.ops)
        self.ops.append(name)
        if index != self.at:
            return None
        if self.fault in (Fault.CANCEL, Fault.HANG):
            assert self.on_cancel is not None, "a cancelling fault needs a canceller"
            self.on_cancel()
        return self.fault

    @property
    def hit(self) -> str | None:
        """The operation the fault was injected at, if the call got that far."""
        if self.at is None or self.at >= len(self.ops):
            return None
        return self.ops[self.at]


def _failed(name: str) -> StoreUnavailableError:
    return StoreUnavailableError(f"injected: the connection broke before {name}")


def _lost(name: str) -> StoreUnavailableError:
    return StoreUnavailableError(f"injected: the reply to {name} was lost")


def perform(plan: Plan, name: str, call: Callable[[], Any]) -> Any:
    fault = plan.tick(name)
    if fault is Fault.RAISE:
        raise _failed(name)
    result = call()
    if fault is Fault.DROP:
        raise _lost(name)
    return result


# How long the guard waits for a hung operation once its caller was cancelled, in the tests.
HANG_BOUND = 0.05


class _FirstBound(float):
    """``CLEANUP_TIMEOUT`` while an operation hangs: the short bound for the first deadline
    the guard computes (its caller's, cancelled because of the hang), the real bound again
    for every later one, so the cleanup after the hang is not cut short on a loaded machine.
    """

    restore: float

    def __radd__(self, other: float) -> float:  # loop.time() + CLEANUP_TIMEOUT
        _flow.CLEANUP_TIMEOUT = self.restore
        return other + float(self)


async def _hang() -> None:
    """Never answer; the guard gives up on it once its bound is over."""
    bound = _FirstBound(HANG_BOUND)
    bound.restore = _flow.CLEANUP_TIMEOUT
    _flow.CLEANUP_TIMEOUT = bound
    try:
        await asyncio.Event().wait()
    finally:
        if _flow.CLEANUP_TIMEOUT is bound:  # given up on before any deadline was set
            _flow.CLEANUP_TIMEOUT = bound.restore


async def aperform(plan: Plan, name: str, call: Callable[[], Awaitable[Any]]) -> Any:
    fault = plan.tick(name)
    if fault is Fault.RAISE:
        raise _failed(name)
    if fault is Fault.HANG:
        await _hang()
    result = await call()
    if fault is Fault.DROP:
        raise _lost(name)
    return result


VERBS = ("reserve", "complete", "fail", "release", "renew")


class VerbFaults:
    """A memory or Redis store whose verbs (each atomic on the server) go through a plan."""

    def __init__(self, store: Any, plan: Plan, *, asynchronous: bool) -> None:
        self._store = store
        self._plan = plan
        self._async = asynchronous

    def __getattr__(self, name: str) -> Any:
        verb = getattr(self._store, name)
        if name not in VERBS:
            return verb
        if self._async:
            return lambda *a, **k: aperform(self._plan, name, lambda: verb(*a, **k))
        return lambda *a, **k: perform(self._plan, name, lambda: verb(*a, **k))


def arm_sql(store: Any, plan: Plan, *, asynchronous: bool) -> None:
    """Count every transaction a SQL store runs on its own connections (its verbs, and the
    ``OnStore`` operations of units bound later)."""
    run = store.run

    def name(gen: Any) -> str:
        return f"store.{getattr(gen, '__name__', 'run')}"

    if asynchronous:

        async def arun(gen: Any) -> Any:
            return await aperform(plan, name(gen), lambda: run(gen))

        store.run = store._run = arun
        # Every operation goes through `run`, where one can hang or be cancelled: a store
        # that writes at once when it can (AsyncSQLiteStore) runs the same transaction code
        # as its sync twin, whose faults the sync tests inject, and so do its single
        # statements (a fresh reservation, a settle).
        store._now = None
        if hasattr(store, "_sync"):
            store._sync._writes_alone = False
    else:

        def srun(gen: Any) -> Any:
            return perform(plan, name(gen), lambda: run(gen))

        store.run = store._run = srun
        written = getattr(store, "_written", None)
        if written is not None:
            # SQLiteStore's single statements, which write without `run`.
            def swritten(op: Any, *args: Any) -> Any:
                alone = f"store.{type(op).__name__.lower()}_alone"
                return perform(plan, alone, lambda: written(op, *args))

            store._written = swritten


class BindFaults:
    """A SQL store whose bound units send their transaction operations through a plan."""

    def __init__(self, store: Any, plan: Plan) -> None:
        self._store = store
        self._plan = plan

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def bind(self, conn: Any, **options: Any) -> Any:
        unit = self._store.bind(conn, **options)
        run = unit._run
        unit._run = lambda gen: run(faulty(gen, self._plan))
        return unit


def _describe(op: Any) -> str:
    if isinstance(op, Statement):
        return f"conn.{op.sql.split(None, 1)[0].lower()}"
    return f"conn.{type(op).__name__.lower()}"


def faulty(gen: Generator[Any, Any, Any], plan: Plan) -> Generator[Any, Any, Any]:
    """A unit's transaction operations, each counted, the chosen one faulted.

    A hang cannot be made here (a generator cannot wait): on the app's connection it acts as
    a cancellation of the caller, which `Plan.tick` has already fired.
    """
    try:
        op = next(gen)
        while True:
            fault = None if isinstance(op, OnStore) else plan.tick(_describe(op))
            if fault is Fault.RAISE and not isinstance(op, Commit | Rollback):
                op = gen.throw(_failed(_describe(op)))
                continue
            sent = Rollback() if fault is Fault.RAISE else op
            try:
                result = yield sent
            except BaseException as exc:  # the unit's logic decides what a failure means
                op = gen.throw(exc)
                continue
            if fault is Fault.DROP and not isinstance(op, Commit | Rollback):
                # The connection broke after the server ran it: the server ends its
                # transaction.
                yield Rollback()
            if fault in (Fault.RAISE, Fault.DROP):
                op = gen.throw(_lost(_describe(op)))
                continue
            op = gen.send(result)
    except StopIteration as stop:
        return stop.value


STEP = 5.0  # seconds a test waits for a moment it has arranged, before failing


class Gate:
    """A store whose ``verb`` waits at the gate until the test opens it: before the real
    verb (nothing applied yet) or after it (applied, its reply not yet returned)."""

    def __init__(self, store: Any, verb: str | None, *, applied: bool) -> None:
        self._store = store
        self.verb = verb
        self.applied = applied
        self.entered = asyncio.Event()
        self.opened = asyncio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    async def _through(self, verb: str, *args: Any, **kwargs: Any) -> Any:
        if verb != self.verb:
            return await getattr(self._store, verb)(*args, **kwargs)
        self.verb = None  # the retry passes freely
        if not self.applied:
            await self._wait()
        result = await getattr(self._store, verb)(*args, **kwargs)
        if self.applied:
            await self._wait()
        return result

    async def _wait(self) -> None:
        self.entered.set()
        await self.opened.wait()

    async def reserve(self, *args: Any, **kwargs: Any) -> Any:
        return await self._through("reserve", *args, **kwargs)

    async def complete(self, *args: Any, **kwargs: Any) -> Any:
        return await self._through("complete", *args, **kwargs)

    async def fail(self, *args: Any, **kwargs: Any) -> Any:
        return await self._through("fail", *args, **kwargs)

    async def release(self, *args: Any, **kwargs: Any) -> Any:
        return await self._through("release", *args, **kwargs)

    async def renew(self, *args: Any, **kwargs: Any) -> Any:
        return await self._through("renew", *args, **kwargs)


class Canceller:
    """Runs a call under one kind of cancellation and fires it on demand."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fire: Callable[[], None] | None = None
        self.cancelling_after: int | None = None
        self.raised: BaseException | None = None

    async def run(self, call: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(self._under(call))
        await asyncio.sleep(0)  # the task enters its scope before anything can fire
        return task

    async def _call(self, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await call()
        except BaseException as exc:
            self.raised = exc
            raise

    async def _under(self, call: Callable[[], Awaitable[Any]]) -> Any:
        me = asyncio.current_task()
        assert me is not None
        try:
            if self.kind == "task":
                self._fire = me.cancel
                return await self._call(call)
            if self.kind == "timeout":
                async with asyncio.timeout(None) as timeout:
                    self._fire = lambda: timeout.reschedule(asyncio.get_running_loop().time())
                    return await self._call(call)
            scope_of = anyio.move_on_after if self.kind == "move_on_after" else anyio.fail_after
            with scope_of(math.inf) as scope:
                self._fire = lambda: setattr(scope, "deadline", 0)
                return await self._call(call)
            assert scope.cancelled_caught, "move_on_after saw its cancellation"
            return "moved on"
        finally:
            self.cancelling_after = me.cancelling()

    def fire(self) -> None:
        assert self._fire is not None
        self._fire()

    async def outcome(self, task: asyncio.Task[Any]) -> BaseException | Any:
        """The call's exception, checked to be the one this kind of cancellation gives."""
        try:
            result = await asyncio.wait_for(asyncio.shield(task), STEP)
        except asyncio.CancelledError as exc:
            assert self.kind == "task", f"{self.kind} leaked a CancelledError"
            assert task.cancelled()
            return exc
        except TimeoutError as exc:
            assert self.kind in ("timeout", "fail_after"), f"{self.kind}: {exc!r}"  # noqa: PT017
            assert task.done(), "the cancelled call did not end"
            # The scope's own cancellation was recognised and taken back.
            assert self.cancelling_after == 0
            return exc
        assert self.kind == "move_on_after", f"{self.kind} ended with {result!r}"
        assert self.cancelling_after == 0
        return result
