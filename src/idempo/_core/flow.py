"""The protocol of one guarded call, written once as a generator and driven sync or async.

The flow yields operations and receives their results (as httpx's auth flows do). It does no
I/O itself, so the sync and async drivers below are the only places that differ.

    Reserve ──► Acquired ──► Execute ──► Complete | Fail | Release (or, once steps
            │                              committed, Checkpoint: the lease ends, they stay)
            ├─► Replay   ──► return the stored record
            ├─► Mismatch ──► FingerprintMismatchError
            └─► InProgress ─► RequestInProgressError, or Sleep and Reserve again (policy.wait)
"""

from __future__ import annotations

import asyncio
import dis
import inspect
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Generator
from contextlib import AbstractContextManager, nullcontext, suppress
from dataclasses import dataclass
from datetime import timedelta
from types import CodeType
from typing import Any, Protocol, cast

from ..errors import (
    ConfigurationError,
    CorruptRecordError,
    FingerprintMismatchError,
    IdempotencyError,
    RequestInProgressError,
    ResponseTooLargeError,
    TransactionOwnershipError,
    UnserializableResultError,
)
from ..policy import Policy
from .keys import Scope
from .ops import Checkpoint, Discard, Release, Renew, Reserve, Settle, StoreOp
from .record import Acquired, InProgress, Mismatch, Record, Replay, Status

# How often a caller told to wait re-checks a key that is in progress, at most, when its
# store cannot say when the record settles.
_POLL_SECONDS = 0.05


# Not frozen, as the ops in ops.py: made on every call, never changed.
@dataclass(slots=True)
class Execute:
    """Run the work. ``recovery_point``: the steps a taken-over attempt committed (opened, as
    the work reads them), then what this attempt's checkpoints record (the guard sets it
    before each one, so a checkpoint whose answer was lost counts too): while it is set, a
    transient failure ends the lease instead of forgetting them."""

    token: int
    recovery_point: str | None
    # A store fault the flow swallowed while giving up (see _abandon), for the guard to report.
    fault: BaseException | None = None


@dataclass(slots=True)
class Sleep:
    """Wait before reserving ``scope`` again, ``seconds`` at most: a store that can tell when
    a record settles (``wait_settled``) ends the wait then; with any other the caller asks
    again every `_POLL_SECONDS`."""

    seconds: float
    scope: Scope


Op = Reserve | Execute | Settle | Release | Checkpoint | Discard | Sleep


@dataclass(slots=True)
class Done:
    """The flow ended: ``record`` is the record to replay, or None once the work ran."""

    record: Record | None


class Codec(Protocol):
    """How a surface (function API, HTTP) turns what the work produced into a stored outcome.

    A status of None means transient: release the key so that a retry executes again.
    """

    def encode_result(self, value: Any) -> tuple[Status | None, bytes]: ...

    def encode_error(self, exc: BaseException) -> tuple[Status | None, bytes]: ...

    def encode_unstorable(self, exc: Exception) -> bytes:
        """The FAILED response for work that took effect but whose outcome cannot be kept:
        a result too large or refused by the serializer (outside transactional mode), or a
        block that committed the guard's transaction itself. A retry must not run it again."""
        ...

    def decode(self, record: Record) -> Any:
        """What a replay hands back (or raises) for a stored record."""
        ...

    # Optional: ``open_point(point) -> str``, the stored recovery point as the work reads it
    # (a codec that seals has one); without it, the point is read as stored (`_opened`).


# Discard has no fields: one value serves every call.
_DISCARD = Discard()

NOT_KEPT: Any = type("NotKept", (), {"__repr__": lambda self: "NOT_KEPT"})()
"""What the work's result is sent as when the attempt said `do_not_store`: its answer went
to the caller, and the key is released as for a transient failure."""


def guarded_call(
    scope: Scope, fingerprint: str, policy: Policy, codec: Codec, *, discards: bool = True
) -> Generator[Op, Any, Record | None]:
    """Run one call: returns the record to replay, or None once this call executed the work.

    ``discards``: whether the unit the call runs on may hold writes of the work's to throw
    away (`Discard`); a store used directly holds none, and the flow asks it nothing then.
    """
    reservation = yield from _reserve(scope, fingerprint, policy, discards)
    if not isinstance(reservation, Acquired):
        return reservation.record
    token = reservation.token
    run = Execute(token, reservation.recovery_point)
    if run.recovery_point is not None:
        try:
            run.recovery_point = _opened(codec, scope, run.recovery_point)
        except CorruptRecordError as exc:
            # The steps it names ran: none may run again, and this is no failure of the
            # work's to record, whatever the codec counts as one. The lease ends, the point
            # stays, and a retry that can open it resumes after them.
            yield from _abandon(scope, run, codec, policy, exc, transient=True, discards=discards)
            raise
    try:
        value = yield run
    except GeneratorExit:
        raise
    except BaseException as exc:
        yield from _abandon(scope, run, codec, policy, exc, discards=discards)
        raise
    try:
        status, body = (None, b"") if value is NOT_KEPT else _encoded(codec, value, policy)
    except IdempotencyError as exc:
        yield from _abandon(scope, run, codec, policy, exc, unstorable=True, discards=discards)
        raise
    try:
        yield _outcome(scope, run, status, body, policy)
    except TransactionOwnershipError as exc:
        yield from _settle_owned(scope, token, codec, policy, exc)
        raise
    return None


def _opened(codec: Codec, scope: Scope, point: str) -> str:
    """A taken-over record's recovery point as the work reads it: opened by the codec when it
    seals (`idempo.encryption.SealedCodec.open_point`), else as stored, unless it is sealed.

    Raises:
        CorruptRecordError: it cannot be opened (`UndecryptableRecordError`).
    """
    open_point = getattr(codec, "open_point", None)
    if open_point is not None:
        return cast(str, open_point(point))
    # Only a takeover with steps gets here; idempo.encryption imports the core.
    from ..encryption import open_plain_point  # noqa: PLC0415

    return open_plain_point(point, scope)


def _encoded(codec: Codec, value: Any, policy: Policy) -> tuple[Status | None, bytes]:
    """The outcome to store for the work's result, or a typed error saying why it cannot be."""
    try:
        status, body = codec.encode_result(value)
    except IdempotencyError:
        raise
    except Exception as exc:
        raise UnserializableResultError(f"the result cannot be stored: {exc}") from exc
    if status is not None and len(body) > policy.max_response_bytes:
        raise ResponseTooLargeError(len(body), policy.max_response_bytes)
    return status, body


def _abandon(
    scope: Scope,
    run: Execute,
    codec: Codec,
    policy: Policy,
    exc: BaseException,
    *,
    unstorable: bool = False,
    transient: bool = False,
    discards: bool = True,
) -> Generator[Op, Any, None]:
    """Throw the work's writes away, then record the failure or release the key (always
    release it, if ``transient``).

    Nothing of idempo's replaces the error being raised: a store that fails here leaves a
    reservation that ends with its lease (or with its transaction, when the connection
    broke). Only an app that ended the guard's transaction itself hears of it.
    """
    token = run.token
    try:
        undone = (yield _DISCARD) if discards else False
    except TransactionOwnershipError as ended:
        yield from _settle_owned(scope, token, codec, policy, ended)
        raise ended from exc
    except Exception as fault:  # noqa: BLE001 - see above
        run.fault = fault
        return
    if transient:
        status, body = None, b""
    elif not unstorable:
        status, body = codec.encode_error(exc)
    elif undone:
        # Transactional mode: every write of the work rolled back, so nothing may say it
        # ran (SPEC §2 rule 10); the retry runs it again.
        status, body = None, b""
    else:
        # The work took effect outside any transaction of the guard's: a retry must not run
        # it again, so the refusal is what is replayed.
        status, body = Status.FAILED, codec.encode_unstorable(cast(Exception, exc))
    try:
        yield _outcome(scope, run, status, body, policy)
    except Exception as fault:  # noqa: BLE001 - see above
        run.fault = fault


def _settle_owned(
    scope: Scope, token: int, codec: Codec, policy: Policy, error: TransactionOwnershipError
) -> Generator[Op, Any, None]:
    """The app committed the guard's transaction inside the block: what it committed stays,
    so the key is recorded FAILED and never runs again. (After a rollback by the app there is
    no reservation left, and the fenced settle finds nothing.)"""
    with suppress(Exception):
        yield Settle(
            scope, token, Status.FAILED, codec.encode_unstorable(error), policy.now(), policy.ttl
        )


def _stopwatch(policy: Policy) -> Callable[[], timedelta]:
    """Time spent since now: on the injected clock (a test's, moved by its sleep), else on
    the monotonic clock, which no wall-clock step can stretch or shrink."""
    clock = policy.clock
    if clock is not None:
        started = clock()
        return lambda: clock() - started
    start = time.monotonic()
    return lambda: timedelta(seconds=time.monotonic() - start)


def _reserve(
    scope: Scope, fingerprint: str, policy: Policy, discards: bool
) -> Generator[Op, Any, Acquired | Replay]:
    wait = policy.wait
    elapsed = None if wait is None else _stopwatch(policy)
    # The policy's bound goes with every reservation: a store's own connection meets the
    # row lock of a transactional holder too, and has no other way to learn it.
    lock_timeout = policy.lock_timeout
    clock = policy.clock  # `policy.now()`, inlined: a call less on every reservation
    while True:
        if elapsed is not None and wait is not None:
            # Every wait counts against the caller's, row-lock waits included: a
            # reservation waits on a lock no longer than what is left.
            lock_timeout = min(max(wait - elapsed(), timedelta(0)), policy.lock_timeout)
        now = None if clock is None else clock()
        reservation = yield Reserve(scope, fingerprint, now, policy.lease, policy.ttl, lock_timeout)
        # isinstance tests, not a match on class patterns: this runs on every call.
        if isinstance(reservation, Acquired):
            return reservation
        if discards:
            yield _DISCARD  # nothing will be written: end the transaction, if there is one
        if isinstance(reservation, Replay):
            return reservation
        if isinstance(reservation, Mismatch):
            raise FingerprintMismatchError(scope.key)
        if isinstance(reservation, InProgress):
            retry_after = reservation.retry_after
            if elapsed is None or wait is None:
                raise RequestInProgressError(scope.key, retry_after)
            remaining = (wait - elapsed()).total_seconds()
            if remaining <= 0:
                raise RequestInProgressError(scope.key, retry_after)
            yield Sleep(min(retry_after, remaining), scope)


def _outcome(
    scope: Scope, run: Execute, status: Status | None, body: bytes, policy: Policy
) -> Settle | Release | Checkpoint:
    if status is None:
        if run.recovery_point is not None:
            # Steps committed: a release would forget them and a retry would run them again.
            # The lease ends instead, keeping the point the record has (which may be newer
            # than the last one this attempt heard back about), and the retry resumes there.
            return Checkpoint(scope, run.token, None, policy.now(), timedelta(0))
        return Release(scope, run.token)
    return Settle(scope, run.token, status, body, policy.now(), policy.ttl)


# -- the drivers: how operations are carried out -------------------------------------


class Performer(Protocol):
    """What carries out operations: a unit (SQL, cached) that takes them as values, or
    `Verbs` in front of a verb-shaped store. An async performer returns awaitables."""

    def perform(self, op: StoreOp) -> Any: ...


class Verbs:
    """A verb-shaped store or unit (`Store`, `Unit`, a user's own) as a `Performer`: each
    operation becomes the verb of its name. This is the one op→verb table; a unit that
    takes operations itself has a ``perform`` of its own and needs none.

    A reservation's ``lock_timeout`` goes no further: only a unit on the app's transaction
    waits on another attempt's row lock, and idempo's take operations themselves. Anything
    else (``renew`` for a renewal, ``migrate``) is the target's own attribute.

    >>> class Store:  # any verb-shaped store
    ...     def release(self, scope: Scope, token: int) -> str:
    ...         return f"released {scope.key} under token {token}"
    >>> Verbs(Store()).perform(Release(Scope("", "charge", "k1"), 7))
    'released k1 under token 7'
    """

    __slots__ = ("target",)
    # Whether `Discard` may do anything: a store used directly (no work runs on it) has
    # nothing to discard, and the flow does not ask (`guarded_call`'s ``discards``).
    discards = True

    def __init__(self, target: Any) -> None:
        self.target = target

    def perform(self, op: StoreOp) -> Any:
        # isinstance tests and no table of lambdas: this runs several times per call, and a
        # frame more would cost about what the memory store's whole verb does.
        target = self.target
        if isinstance(op, Reserve):
            return target.reserve(op.scope, op.fingerprint, now=op.now, lease=op.lease, ttl=op.ttl)
        if isinstance(op, Settle):
            verb = target.complete if op.status is Status.COMPLETED else target.fail
            return verb(op.scope, op.token, op.response, now=op.now, ttl=op.ttl)
        if isinstance(op, Discard):  # after every replay on a unit: before the rarer ones
            return self.discard()
        if isinstance(op, Release):
            return target.release(op.scope, op.token)
        if isinstance(op, Renew):
            return target.renew(op.scope, op.token, now=op.now, lease=op.lease)
        if isinstance(op, Checkpoint):
            return checkpoint(target)(op.scope, op.token, op.point, now=op.now, lease=op.lease)
        raise AssertionError(f"{op!r} is no store operation")

    def discard(self) -> Any:
        return self.target.discard()

    def __getattr__(self, name: str) -> Any:
        if name == "target":  # not set yet (copying): nothing to forward to
            raise AttributeError(name)
        return getattr(self.target, name)


def checkpoint(target: Any) -> Callable[..., Any]:
    """``target``'s checkpoint verb; a store without one cannot record recovery points, and
    `ConfigurationError` says so (it is optional: a store written before them still works
    for everything else)."""
    verb = getattr(target, "checkpoint", None)
    if verb is None:
        store = getattr(target, "target", target)  # the store behind `Verbs`
        raise ConfigurationError(
            f"{type(store).__name__} cannot record recovery points (it has no checkpoint"
            " verb): guard step-by-step work with a store that has one"
        )
    return cast(Callable[..., Any], verb)


class StoreVerbs(Verbs):
    """A store used directly: none of the work runs on it, so there is nothing to discard."""

    __slots__ = ()
    discards = False

    def discard(self) -> bool:
        return False


class AsyncStoreVerbs(Verbs):
    """An async store used directly.

    ``undoes_cancelled_reserve``: whether the store promises that its ``reserve``, cancelled
    under way, leaves nothing held once it has raised (it undoes what it may have reserved,
    and the undo reaches the store after the reserve): `apump` then awaits it with no task
    of its own. Only a store whose class declares it can promise it (a wrapper that forwards
    attributes to such a store, a cache or a test's gate, promises nothing); the store's own
    value says whether it does (one may, another of its class not).
    """

    __slots__ = ("undoes_cancelled_reserve",)
    discards = False

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        declared = hasattr(type(target), "undoes_cancelled_reserve")
        self.undoes_cancelled_reserve = declared and target.undoes_cancelled_reserve is True

    async def discard(self) -> bool:
        return False


def performer(target: Any, direct: type[Verbs] = Verbs) -> Performer:
    """``target`` itself when it takes operations as values, else ``direct`` in front of it.

    The capability is read from the class: a wrapper that forwards attributes to a store
    (``__getattr__``) keeps its own verbs in the path.
    """
    if callable(getattr(type(target), "perform", None)):
        return cast(Performer, target)
    return direct(target)


def _waiter(unit: Performer, policy: Policy) -> Callable[[Scope, float], Any] | None:
    """The store's ``wait_settled(scope, seconds)``, woken when the record settles, is
    released or deleted; None where the store has none, or where a test's clock or sleep
    is injected (waits then move that clock, one poll at a time)."""
    if policy.sleep is not None or policy.clock is not None:
        return None
    return cast("Callable[[Scope, float], Any] | None", getattr(unit, "wait_settled", None))


def _sleep(op: Sleep, policy: Policy, unit: Performer) -> object:
    wait = _waiter(unit, policy)
    if wait is not None:
        return wait(op.scope, op.seconds)
    return (policy.sleep or time.sleep)(min(op.seconds, _POLL_SECONDS))


async def _asleep(op: Sleep, policy: Policy, unit: Performer) -> None:
    wait = _waiter(unit, policy)
    if wait is not None:
        await wait(op.scope, op.seconds)
        return
    seconds = min(op.seconds, _POLL_SECONDS)
    if policy.sleep is None:
        await asyncio.sleep(seconds)
        return
    # An injected sleep (a test's clock) moves the clock the deadline is read from; other
    # tasks still get their turn.
    slept = policy.sleep(seconds)
    if inspect.isawaitable(slept):
        await slept
        return
    await asyncio.sleep(0)


Flow = Generator[Op, Any, Record | None]


def pump(flow: Flow, unit: Performer, policy: Policy, op: Op) -> Execute | Done:
    """Perform operations until the flow asks for the work to run, or ends."""
    perform = unit.perform
    try:
        while not isinstance(op, Execute):
            try:
                result = _sleep(op, policy, unit) if isinstance(op, Sleep) else perform(op)
            except BaseException as exc:  # noqa: BLE001 - every failure goes back into the flow
                op = flow.throw(exc)
            else:
                op = flow.send(result)
    except StopIteration as stop:
        return Done(stop.value)
    return op


# How long, at most, a cancelled caller waits for the guard's own store operations (the one
# under way when it was cancelled, then the release or settle that follows) before it gives
# up on a hung store. The key then frees when its lease ends. Seconds.
CLEANUP_TIMEOUT = 5.0
# Then, how long the operation given up on may take to end once cancelled (a statement
# cancelled on the server, a rollback), and once cancelled again. Seconds.
WIND_DOWN_TIMEOUTS = (1.0, 0.25)

_logger = logging.getLogger("idempo")


class _GaveUp(Exception):
    """A store operation outlived `CLEANUP_TIMEOUT` after the caller was cancelled."""


# Whether a coroutine's code can suspend at all, per code object.
_SUSPENDS: dict[CodeType | None, bool] = {}


def _suspends(awaitable: Awaitable[Any]) -> bool:
    """False only for a coroutine whose code has no await at all (the memory store's verbs,
    a unit's no-op discard): it runs to its end in one step, so no cancellation can reach
    it, and it needs no task of its own (which would cost more than the verb)."""
    code = getattr(awaitable, "cr_code", None)
    if code is None:
        return True
    known = _SUSPENDS.get(code)
    if known is None:
        # Every suspension point (await, async with, async for) compiles to YIELD_VALUE.
        known = any(i.opname == "YIELD_VALUE" for i in dis.get_instructions(code))
        _SUSPENDS[code] = known
    return known


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark an abandoned operation's outcome as seen, so asyncio does not log it."""
    if not task.cancelled():
        task.exception()


def _shielded() -> AbstractContextManager[object]:
    """While a cancelled caller waits for its cleanup: anyio's cancel scopes cancel the task
    again at every await until they exit, so inside one the wait is shielded from them."""
    anyio = sys.modules.get("anyio")
    if anyio is None:
        return nullcontext()
    scope: AbstractContextManager[object] = anyio.CancelScope(shield=True)
    return scope


class _Cancellation:
    """The caller's cancellation, held while the guard's own store operations finish.

    Each operation that may suspend runs in a task of its own, so a cancellation (asyncio's
    task cancel or timeout, anyio's scopes, which cancel again at every await) never cuts it
    short: the flow always learns its result (a reservation taken, a completion stored) and
    releases what it holds. The cancellation is delivered afterwards, the same exception and
    never uncancelled, so `asyncio.timeout` and anyio's scopes still see their own.
    """

    __slots__ = ("deadline", "error")

    def __init__(self, error: BaseException | None) -> None:
        self.error: BaseException | None = None
        self.deadline = 0.0
        if error is not None:
            self.hold(error)

    def hold(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
            self.deadline = asyncio.get_running_loop().time() + CLEANUP_TIMEOUT

    async def complete(self, awaitable: Awaitable[Any]) -> Any:
        """The operation's result, however often the caller is cancelled meanwhile."""
        if not _suspends(awaitable):
            return await awaitable
        task = asyncio.ensure_future(awaitable)
        if self.error is None:
            waiter = task.get_loop().create_future()
            task.add_done_callback(lambda _: _wake(waiter))
            try:
                await waiter  # cancelling the caller cancels this waiter, never the task
            except asyncio.CancelledError as exc:
                self.hold(exc)
        if not task.done():
            await self._outlast(task)
        return task.result()

    async def _outlast(self, task: asyncio.Future[Any]) -> None:
        with _shielded():
            if await _ended(task, self.deadline):
                return
            _logger.warning(
                "idempo: the store did not answer within %s s of a cancellation;"
                " the key stays in progress until its lease ends",
                CLEANUP_TIMEOUT,
            )
            task.add_done_callback(_retrieve)
            # The operation may run on the app's own connection: it is cancelled, and given
            # a moment to leave that connection usable (psycopg cancels the statement on the
            # server, then the unit rolls back). Cancelled again past that, a driver drops a
            # connection it cannot vouch for (psycopg closes it; a pool replaces it).
            for wind_down in WIND_DOWN_TIMEOUTS:
                task.cancel()
                if await _ended(task, task.get_loop().time() + wind_down):
                    break
            raise _GaveUp


_NOTHING_HELD = _Cancellation(None)
"""What `apump` holds until an operation may suspend: no cancellation (never changed)."""


async def _ended(task: asyncio.Future[Any], deadline: float) -> bool:
    """Whether ``task`` ended by ``deadline`` (the loop's time), however often the caller is
    cancelled meanwhile: the first cancellation is the one delivered."""
    loop = task.get_loop()
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            return False
        with suppress(asyncio.CancelledError):
            await asyncio.wait((task,), timeout=remaining)
    return True


async def outlast(task: asyncio.Future[Any]) -> None:
    """Wait for ``task``, a store's own cleanup started as its caller was cancelled, however
    often the caller is cancelled meanwhile, `CLEANUP_TIMEOUT` at most (it then goes on
    alone); the caller raises its cancellation next."""
    with _shielded():
        await _ended(task, task.get_loop().time() + CLEANUP_TIMEOUT)


async def outlasting(awaitable: Awaitable[Any]) -> Any:
    """One store operation outside the flow (a renewal), run as the flow runs its own: to
    its end however the caller is cancelled meanwhile (bounded), then the cancellation."""
    held = _Cancellation(None)
    try:
        result = await held.complete(awaitable)
    except BaseException:
        if held.error is None:
            raise
        # Given up on, or failed after the caller was cancelled: the cancellation wins.
        raise held.error  # noqa: B904 - the operation's error is its context
    if held.error is not None:
        raise held.error
    return result


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def apump(  # noqa: PLR0912 - one loop, inlined: it runs on every guarded call
    flow: Flow,
    unit: Performer,
    policy: Policy,
    op: Op,
    *,
    cancelled: BaseException | None = None,
) -> Execute | Done:
    """The asynchronous twin of `pump`; ``cancelled``: the caller is being cancelled already
    (the work was), so every operation is its cleanup, shielded and bounded.

    A cancellation during a store operation is held until that operation ends, then thrown
    into the flow where it can act on it (the work about to start, a wait about to begin):
    the flow releases the key, then the cancellation propagates. The flow's StopIteration is
    caught here: one that escaped a coroutine would turn into a RuntimeError (PEP 479).

    A reservation is the one operation that may be cut short instead, on a store that
    undoes a cancelled reserve itself (`AsyncStoreVerbs.undoes_cancelled_reserve`): it is
    awaited in the caller's task, and its cancellation reaches the flow once nothing is held
    (a takeover of an attempt whose steps committed is left with its lease ended, as the
    flow's own checkpoint would leave it). The guard's other operations settle what a
    reservation took, and no store can undo those: they stay shielded.
    """
    # Made when first needed (an operation that may suspend): most calls never hold one.
    held = _NOTHING_HELD if cancelled is None else _Cancellation(cancelled)
    perform = unit.perform
    # Only the verbs in front of a store used directly may skip the shield: a unit that
    # forwards attributes to such a store (a cache, an observer) promises nothing itself.
    undoes = type(unit) is AsyncStoreVerbs and unit.undoes_cancelled_reserve
    try:
        while held.error is not None or not isinstance(op, Execute):
            if held.error is not None and isinstance(op, Execute | Sleep):
                op = flow.throw(held.error)
                continue
            try:
                if isinstance(op, Sleep):
                    await _asleep(op, policy, unit)  # a wait is never shielded
                    result = None
                else:
                    done = perform(op)  # type: ignore[arg-type] # never Execute
                    # `_Cancellation.complete`'s first test, inlined: most verbs (the memory
                    # store's) cannot suspend, and run here in one step.
                    if _SUSPENDS.get(getattr(done, "cr_code", None)) is False:
                        result = await done
                    elif undoes and held.error is None and isinstance(op, Reserve):
                        # In the caller's own task: a cancellation that reaches the
                        # reservation is the store's to undo. One that an await inside it
                        # swallowed still counts in the task (Python 3.11's
                        # `asyncio.wait_for`, which redis-py sends each command under, drops
                        # one that lands as its send ends): held here, as the shield would
                        # hold it, so the flow gives back what was reserved, then raises it
                        # (over a store error too, as after the shield).
                        task = cast("asyncio.Task[Any]", asyncio.current_task())
                        asked = task.cancelling()
                        try:
                            result = await done
                        finally:
                            if task.cancelling() > asked:
                                held = _Cancellation(asyncio.CancelledError())
                    else:
                        if held is _NOTHING_HELD:
                            held = _Cancellation(None)
                        result = await held.complete(done)
            except _GaveUp:
                flow.close()
                break
            except BaseException as exc:  # noqa: BLE001 - every failure goes back into the flow
                op = flow.throw(exc)
            else:
                op = flow.send(result)
        else:
            return op
    except StopIteration as stop:
        if held.error is None:
            return Done(stop.value)
    except BaseException as exc:
        if held.error is None or isinstance(exc, asyncio.CancelledError):
            raise
        # The flow ended in an error (the app's, a refusal) after the caller was cancelled:
        # the cancellation wins, as at any await in an except block, with the error as its
        # context.
        raise held.error  # noqa: B904 - the context is the point
    assert held.error is not None
    raise held.error
