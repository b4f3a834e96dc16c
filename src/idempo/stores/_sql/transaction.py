"""How a guarded call runs on the app's own connection, written once for every driver.

The logic here yields transaction operations (`Begin`, SQL `Statement`s, `Commit`,
`Rollback`, `OnStore`) and receives their results; an executor per kind of connection
(psycopg, sqlite3, SQLAlchemy; sync or async) carries them out. `SyncUnit` and `AsyncUnit`
are the only sync/async twins, and they only forward.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Generator
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import Enum
from typing import Any, Protocol, TypeVar

from ..._core.digest import key_ref
from ..._core.keys import Scope
from ..._core.ops import Checkpoint, Discard, Release, Renew, Reserve, Settle, StoreOp
from ..._core.record import Acquired, InProgress, Record, Replay, Reservation, Status
from ...errors import (
    ConfigurationError,
    FencedError,
    StoreUnavailableError,
    TransactionOwnershipError,
)
from .._scan import ScanFilter
from ..base import Mode
from .dialect import SqlDialect, SqlGen, Statement

T = TypeVar("T")


def drive(
    gen: Generator[Any, Any, T],
    execute: Callable[[Any], Any],
    error: Callable[[BaseException], BaseException] | None = None,
) -> T:
    """Run a generator of I/O operations to its result with a synchronous executor.

    A failed operation is thrown back into the generator, so its ``except`` clauses see it;
    ``error`` says first what the failure means (the driver's error as idempo's): errors
    are mapped once, where they cross from the executor into the logic, and only when one
    happens.
    """
    try:
        op = next(gen)
        while True:
            try:
                result = execute(op)
            except BaseException as exc:  # noqa: BLE001 - the generator decides
                op = gen.throw(exc if error is None else error(exc))
            else:
                op = gen.send(result)
    except StopIteration as stop:
        value: T = stop.value
        return value


async def adrive(
    gen: Generator[Any, Any, T],
    execute: Callable[[Any], Awaitable[Any]],
    error: Callable[[BaseException], BaseException] | None = None,
) -> T:
    """The asynchronous twin of `drive`."""
    try:
        op = next(gen)
        while True:
            try:
                result = await execute(op)
            except BaseException as exc:  # noqa: BLE001 - the generator decides
                op = gen.throw(exc if error is None else error(exc))
            else:
                op = gen.send(result)
    except StopIteration as stop:
        value: T = stop.value
        return value


class Executor(Protocol):
    """Carries out transaction operations on one connection (a face of a driver: sync, or
    async with awaitable results). ``pending``: statements queued and not sent yet, which
    `execute` sends once the logic is done; ``error`` maps a driver error."""

    pending: list[Any]

    def do(self, op: Any) -> Any: ...

    def error(self, exc: BaseException) -> BaseException: ...

    def flush(self) -> Any: ...


def execute(executor: Executor, gen: TxGen[T]) -> T:
    """Run the logic ``gen`` on a synchronous executor to its result."""
    try:
        return drive(gen, executor.do, executor.error)
    finally:
        if executor.pending:
            executor.flush()


async def aexecute(executor: Executor, gen: TxGen[T]) -> T:
    """Run the logic ``gen`` on an asynchronous executor to its result."""
    try:
        return await adrive(gen, executor.do, executor.error)
    finally:
        if executor.pending:
            await executor.flush()


# One call an executor's sans-I/O half asks its face to make: the method and its arguments.
Call = tuple[Callable[..., Any], tuple[Any, ...]]


def call(made: Call) -> Any:
    """Make one call (a sync face)."""
    return made[0](*made[1])


async def acall(made: Call) -> Any:
    """Make one call and await it (an async face)."""
    return await made[0](*made[1])


def mapped(exc: BaseException, error: BaseException) -> BaseException:
    """``error`` (what the driver's ``exc`` means) with ``exc`` as its cause."""
    if error is not exc:
        error.__cause__ = exc
    return error


class LockTimeoutError(Exception):
    """Internal: a duplicate waited on the first attempt's row lock longer than allowed."""


class TransactionConflict(Exception):
    """Internal: the database gave up on the app's transaction (a serialization failure, a
    deadlock). ``error`` is the driver's own exception: the caller gets that one, as it would
    from its own statements, so its usual retry logic applies."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class TransactionEnded(Exception):
    """Internal: the transaction the guard reserved in is over: the app committed or rolled
    it back inside the block (its savepoint is gone)."""


@dataclass(frozen=True, slots=True)
class Begin:
    """Start a transaction on the app's connection unless one is open, with the connection's
    own settings (isolation level, read-only, deferrable); the result is True when this began
    one (a conflict may then be retried in a fresh one).

    ``reserves``: a reservation follows, in this transaction. ``lock_timeout``: how long it
    may wait on a row lock (None: the executor's own); the app's statements after it keep
    the connection's setting. SQLite takes the write lock at once for it (BEGIN IMMEDIATE).
    False (leased mode: the reservation committed apart): no lock timeout, and SQLite's
    transaction is deferred, taking the write lock at the work's first write.
    """

    lock_timeout: timedelta | None = None
    reserves: bool = True


@dataclass(frozen=True, slots=True)
class Bound:
    """On the store's own connection: the reservation that follows waits on another
    transaction's row lock at most ``lock_timeout`` (the policy's, or what is left of its
    wait). Executors that bound the wait otherwise (MariaDB's statement carries it) ignore
    it."""

    lock_timeout: timedelta


@dataclass(frozen=True, slots=True)
class Commit:
    pass


@dataclass(frozen=True, slots=True)
class Rollback:
    pass


@dataclass(frozen=True, slots=True)
class Mark:
    """Take the savepoint the work's writes can be rolled back to. It follows the whole
    reservation, so rolling back to it keeps the reservation and its row lock."""


@dataclass(frozen=True, slots=True)
class Undo:
    """Roll back to the mark: the work's writes go, the reservation and its lock stay.
    Raises `TransactionEnded` if the mark is gone."""


@dataclass(frozen=True, slots=True)
class Check:
    """Make sure the marked transaction is still the one open (the app neither committed
    nor rolled it back). Raises `TransactionEnded` now, or from the statements it is sent
    with: a pipelining executor sends it with the completion."""


@dataclass(frozen=True, slots=True)
class OnStore:
    """Run a statement generator on the store's own connection, committed at once."""

    gen: SqlGen[Any]


TxOp = Statement | Begin | Bound | Commit | Rollback | Mark | Undo | Check | OnStore
TxGen = Generator[TxOp, Any, T]

SAVEPOINT = "idempo_work"
"""The savepoint transactional mode takes after the reservation; executors name it so."""


class UnitLogic(Protocol):
    """The verbs of a `Unit` as generators of transaction operations."""

    def reserve(self, op: Reserve) -> TxGen[Reservation]: ...

    def settle(self, op: Settle) -> TxGen[None]: ...

    def release(self, op: Release) -> TxGen[None]: ...

    def renew(self, op: Renew) -> TxGen[None]: ...

    def checkpoint(self, op: Checkpoint) -> TxGen[None]: ...

    def discard(self, op: Discard) -> TxGen[bool]: ...


# A reservation that meets a serialization failure or a deadlock in a transaction the guard
# began is tried again in a fresh one (with a fresh snapshot, that sees what the other
# transaction committed); at most this many times in all.
_CONFLICT_TRIES = 3


class _State(Enum):
    IDLE = "idle"  # no transaction of the guard's open
    HELD = "held"  # reserved, the work's writes since the mark
    UNDONE = "undone"  # the work's writes rolled back to the mark; the lock still held
    REPLAYED = "replayed"  # a replay read the record; its transaction still open
    ENDED = "ended"  # the app committed the guard's transaction, reservation and all
    GONE = "gone"  # the guard's transaction rolled back (the app's doing): nothing is left


class TransactionLogic:
    """Transactional mode: reservation, the work's writes and the outcome commit together.

    A duplicate waits on the first attempt's row lock, bounded by the lock timeout; the row
    lock is the lease, so ``renew`` has nothing to do. A savepoint right after the
    reservation lets a failure throw the work's writes away while the reservation and its
    lock stay: a deterministic failure is recorded before any duplicate can take the key
    (SPEC §2 rule 10), and the savepoint's absence at the end shows that the app ended the
    guard's transaction itself.
    """

    def __init__(
        self,
        dialect: SqlDialect,
        lock_timeout: timedelta,
        waiting: Callable[[timedelta], SqlDialect] | None = None,
    ) -> None:
        self._dialect = dialect
        self._lock_timeout = lock_timeout
        # The statements for a reservation bounded by another lock wait, where the wait is
        # part of the statement itself (MariaDB's SET STATEMENT).
        self._waiting = waiting
        self._state = _State.IDLE
        self._reserved: Reserve | None = None
        self._token = 0

    def reserve(self, op: Reserve) -> TxGen[Reservation]:
        self._reserved = op
        dialect = self._dialect
        # Only a bound shorter than the unit's own changes anything (a caller with a
        # deadline): the unit was made with the policy's.
        limit = op.lock_timeout
        if limit is not None and limit >= self._lock_timeout:
            limit = None
        if limit is not None and self._waiting is not None:
            dialect = self._waiting(limit)
        for tries_left in reversed(range(_CONFLICT_TRIES)):
            began = False
            try:
                # SQLite waits for the lock here, in BEGIN IMMEDIATE.
                began = yield Begin(lock_timeout=limit)
                reservation = yield from dialect.reserve(op)
                if isinstance(reservation, Acquired):
                    yield Mark()
            except LockTimeoutError:
                yield Rollback()
                self._state = _State.IDLE
                return InProgress(retry_after=self._lock_timeout.total_seconds())
            except TransactionConflict:
                yield Rollback()
                self._state = _State.IDLE
                if began and tries_left:
                    continue
                raise
            except BaseException:
                yield Rollback()
                self._state = _State.IDLE
                raise
            if isinstance(reservation, Acquired):
                self._state, self._token = _State.HELD, reservation.token
            elif isinstance(reservation, Replay):
                self._state = _State.REPLAYED
            return reservation
        raise AssertionError("unreachable: the last try raises")

    def settle(self, op: Settle) -> TxGen[None]:
        if self._state is _State.ENDED:
            # The app's commit took the reservation with it: the record is settled on the
            # store's own connection, fenced on the token.
            yield OnStore(self._dialect.settle(op))
            return
        if self._state is _State.GONE:
            return  # no reservation left to settle
        try:
            if self._state is _State.HELD:
                yield Check()
            yield from self._dialect.settle(op)
            yield Commit()
        except TransactionEnded:
            error = yield from self._ended()
            raise error from None
        except BaseException:
            yield Rollback()
            self._state = _State.IDLE
            raise
        self._state = _State.IDLE

    def release(self, op: Release) -> TxGen[None]:
        if self._state in (_State.ENDED, _State.GONE):
            return  # committed by the app (the flow records it), or nothing left
        yield Rollback()
        self._state = _State.IDLE

    def renew(self, op: Renew) -> TxGen[None]:
        return
        yield  # a generator that does nothing

    def checkpoint(self, op: Checkpoint) -> TxGen[None]:
        if self._state is _State.HELD:
            raise ConfigurationError(
                "recovery points need leased mode: in transactional mode every step commits"
                " with the outcome, so a crash leaves no step to resume (pass mode='leased')"
            )
        # A taken-over point after the work's writes rolled back: the takeover goes with
        # them, and the record keeps the point it had.
        yield from self.release(Release(op.scope, op.token))

    def discard(self, op: Discard | None = None) -> TxGen[bool]:
        """End the transaction after a reservation that will write nothing, or throw the
        work's writes away (keeping the reservation). True when nothing the work wrote can
        commit any more."""
        state = self._state
        if state is _State.HELD:
            try:
                yield Undo()
            except TransactionEnded:
                error = yield from self._ended()
                if self._state is _State.ENDED:
                    raise error from None
                # Rolled back whole (by the app, or by the server, as InnoDB does a deadlock
                # victim's): nothing of the work or of the reservation is left.
                return True
            except BaseException:
                # Then nothing can be recorded: the whole transaction goes, reservation too.
                yield Rollback()
                self._state = _State.IDLE
                raise
            self._state = _State.UNDONE
            return True
        if state in (_State.UNDONE, _State.GONE):
            return True
        if state is _State.REPLAYED:
            # A replay is a success that only read: it commits, which ends it as a rollback
            # would, without making drivers such as psycopg forget their prepared statements
            # (they do on every ROLLBACK).
            yield Commit()
        elif state is not _State.ENDED:
            yield Rollback()
        self._state = _State.IDLE
        return False

    def _ended(self) -> TxGen[TransactionOwnershipError]:
        """The guard's savepoint is gone: the app ended the transaction inside the block.
        Roll back what it began since, and ask the store whether its commit took the
        reservation with it (then the work's committed part must never run again)."""
        yield Rollback()
        assert self._reserved is not None, "no reservation to have ended"
        record = yield OnStore(self._dialect.get(self._reserved.scope))
        committed = (
            record is not None
            and record.token == self._token
            and record.status is Status.IN_PROGRESS
        )
        self._state = _State.ENDED if committed else _State.GONE
        return _ownership()


def _ownership() -> TransactionOwnershipError:
    return TransactionOwnershipError(
        "the guarded block committed or rolled back the transaction the guard owns on this "
        "connection. What it committed stays committed and the key is recorded as failed, so "
        "no retry runs the work again. Leave COMMIT and ROLLBACK to the guard (use a "
        "savepoint, a nested transaction, to undo part of the work), or guard work that "
        "commits by itself without conn= (leased mode on the store's own connection)."
    )


def _caller() -> tuple[int, weakref.ref[asyncio.Task[Any]] | None]:
    """Who is calling: the thread, and the asyncio task within it (None: none). The task
    itself, not its id: a task that reserved and ended leaves its id free, and a renewal's
    task made later at the same address would pass for the work (the example API's
    renewals took the write lock in its transaction that way, and its payment provider's
    own transaction then waited for it). A weak reference, so that a unit does not keep an
    ended task (and its result) alive: weak references to one live task are equal, and one
    whose task died equals no other (Python compares dead references by identity)."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no event loop in this thread
        task = None
    return threading.get_ident(), None if task is None else weakref.ref(task)


class LeasedLogic:
    """Leased mode on the app's connection: the reservation commits at once on the store's
    own connection; the work's writes and the fenced outcome commit together on the app's.

    A holder that lost its lease has its outcome refused inside its own transaction, so its
    business writes roll back with it: fencing reaches the business write. As in
    `TransactionLogic` the guard begins that transaction itself, right after the
    reservation, and takes a savepoint in it: its absence at the end shows that the app
    committed or rolled back the guard's transaction. The guard cannot tell which (the
    reservation committed apart), so it takes the safe reading: the work took effect, the
    key is recorded FAILED and `TransactionOwnershipError` raised, never a second execution.

    Renewing from the work itself (``attempt.renew()`` in the block's thread or task) takes
    the record's row lock in the work's transaction (SQLite: the write lock), fenced on the
    token: from then on the lock is the lease, as in transactional mode, and a renewal has
    nothing left to do. So no renewal writes the record from outside while the work's
    transaction is open, which snapshot isolation would refuse at the completion, and
    SQLite never waits for the lock its own work holds. A renewal from elsewhere (a
    background renewer) before that still renews on the store's own connection.
    """

    def __init__(self, dialect: SqlDialect) -> None:
        self._dialect = dialect
        self._state = _State.IDLE
        self._locked = False  # the work's transaction holds the record's lock
        # One of the guard's own statements on the app's connection failed: a transaction
        # found ended since is that failure's doing (the connection broke), not the app's.
        self._broken = False
        # Who reserved: only its renewals may use the app's connection.
        self._owner: tuple[int, weakref.ref[asyncio.Task[Any]] | None] = (0, None)

    def reserve(self, op: Reserve) -> TxGen[Reservation]:
        self._state, self._locked, self._broken = _State.IDLE, False, False
        reservation: Reservation = yield OnStore(self._dialect.reserve(op))
        if not isinstance(reservation, Acquired):
            return reservation  # the app's connection is left as it was
        try:
            yield from self._open()
        except BaseException:
            # Nothing ran: the key is free again at once (or when its lease ends).
            with contextlib.suppress(Exception):
                yield OnStore(self._dialect.release(Release(op.scope, reservation.token)))
            raise
        self._state, self._owner = _State.HELD, _caller()
        return reservation

    def _open(self) -> TxGen[None]:
        """Begin the work's transaction and take its savepoint (rolled back if that fails).
        The work's writes must wait for the fenced outcome, even on a connection the app left
        in autocommit mode; the savepoint shows at the end that the transaction is still the
        guard's."""
        try:
            yield Begin(reserves=False)
            yield Mark()
        except BaseException:
            with contextlib.suppress(Exception):
                yield Rollback()
            raise

    def settle(self, op: Settle) -> TxGen[None]:
        if self._state is not _State.HELD:
            # After a discard (a failure, recorded) or the app's own commit (the flow
            # records FAILED): on the store's own connection, fenced on the token.
            yield OnStore(self._dialect.settle(op))
            return
        yield from self._commit(self._dialect.settle(op), op.scope, op.token)
        self._state = _State.IDLE

    def checkpoint(self, op: Checkpoint) -> TxGen[None]:
        """A step's writes and its recovery point commit together, fenced on the token (a
        stale holder's step rolls back whole); the next step's writes begin a new
        transaction. After a discard, the point is recorded on the store's own connection
        (the lease ending, for a retry to resume)."""
        if self._state is not _State.HELD:
            yield OnStore(self._dialect.checkpoint(op))
            return
        yield from self._commit(self._dialect.checkpoint(op), op.scope, op.token)
        self._locked = False  # the commit let the row lock go
        try:
            yield from self._open()
        except BaseException:
            self._state = _State.UNDONE
            raise

    def _commit(self, write: SqlGen[None], scope: Scope, token: int) -> TxGen[None]:
        """Commit the work's transaction with ``write``, the fenced record statement."""
        try:
            yield Check()
            yield from write
            yield Commit()
        except TransactionEnded as ended:
            if self._broken:
                yield from self._lost(scope, token)
                raise StoreUnavailableError(
                    f"the transaction of {key_ref(scope.key)} was lost with its connection"
                ) from ended
            raise (yield from self._ended()) from None
        except TransactionConflict:
            # The database gave up on the work's transaction: nothing of it committed, so
            # the key is free again at once, as for any transient failure.
            yield Rollback()
            self._state = _State.UNDONE
            with contextlib.suppress(Exception):  # the conflict is what the caller gets
                yield OnStore(self._dialect.release(Release(scope, token)))
            raise
        except BaseException:
            yield Rollback()
            self._state = _State.UNDONE
            raise

    def release(self, op: Release) -> TxGen[None]:
        yield from self.discard()
        yield OnStore(self._dialect.release(op))

    def renew(self, op: Renew) -> TxGen[None]:
        if self._locked:
            return  # the row lock holds the key until the commit
        if self._state is _State.HELD and _caller() == self._owner:
            try:
                owned = yield from self._dialect.lock(op)
            except LockTimeoutError as exc:
                self._broken = True
                raise StoreUnavailableError(
                    f"cannot renew {key_ref(op.scope.key)}: its record stayed locked: {exc}"
                ) from exc
            except BaseException:
                self._broken = True
                raise
            if not owned:
                raise FencedError(
                    f"cannot renew {key_ref(op.scope.key)}: token {op.token} is stale"
                )
            self._locked = True
            return
        yield OnStore(self._dialect.renew(op))

    def discard(self, op: Discard | None = None) -> TxGen[bool]:
        # Only the transaction this call began is thrown away; after a replay or a refusal
        # the app's connection is left as it was. False: the reservation committed apart,
        # so the work may have taken effect where no rollback reaches.
        if self._state is _State.HELD:
            try:
                yield Undo()  # fails if the app ended the guard's transaction
            except TransactionEnded:
                if not self._broken:
                    raise (yield from self._ended()) from None
            except BaseException:
                yield Rollback()
                self._state = _State.UNDONE
                raise
            yield Rollback()
            self._state = _State.UNDONE
        return False

    def _lost(self, scope: Scope, token: int) -> TxGen[None]:
        """The work's transaction went with a broken connection: nothing of it committed."""
        yield Rollback()
        self._state = _State.UNDONE
        with contextlib.suppress(Exception):
            yield OnStore(self._dialect.release(Release(scope, token)))

    def _ended(self) -> TxGen[TransactionOwnershipError]:
        """The savepoint is gone: the app committed or rolled back the guard's transaction.
        Roll back what it began since; the reservation committed apart, so the record
        cannot say which it was, and the work is taken to have taken effect."""
        yield Rollback()
        self._state = _State.ENDED
        return _ownership()


class StoreLogic:
    """Leased mode on the store's own connection: every verb commits by itself.

    A reservation waits on another transaction's row lock (a transactional holder's) no
    longer than its ``lock_timeout`` (`Bound`; ``waiting``: the dialect whose statement
    carries that bound, on MariaDB), then answers in progress, as a transactional duplicate
    does. Any other verb that waits too long is the store's failure, never idempo's
    internal error.
    """

    def __init__(
        self,
        dialect: SqlDialect,
        waiting: Callable[[timedelta], SqlDialect] | None = None,
        *,
        bounds: bool = True,
    ) -> None:
        self._dialect = dialect
        self._waiting = waiting
        # False where the store's own BEGIN has waited already (SQLite's BEGIN IMMEDIATE):
        # a Bound there would be one more step on every reservation, for nothing.
        self._bounds = bounds

    def reserve(self, op: Reserve) -> TxGen[Reservation]:
        dialect, limit = self._dialect, op.lock_timeout
        if limit is not None and self._bounds:
            yield Bound(limit)
            if self._waiting is not None:
                dialect = self._waiting(limit)
        try:
            return (yield from dialect.reserve(op))
        except LockTimeoutError:
            return InProgress(retry_after=(limit or _STORE_WAIT).total_seconds())

    def settle(self, op: Settle) -> TxGen[None]:
        yield from _unlocked(self._dialect.settle(op))

    def release(self, op: Release) -> TxGen[None]:
        yield from _unlocked(self._dialect.release(op))

    def renew(self, op: Renew) -> TxGen[None]:
        yield from _unlocked(self._dialect.renew(op))

    def checkpoint(self, op: Checkpoint) -> TxGen[None]:
        yield from _unlocked(self._dialect.checkpoint(op))

    def discard(self, op: Discard | None = None) -> TxGen[bool]:
        return False
        yield  # nothing of the work's runs on the store's connection


# What a store's own reservation tells a caller to wait when no bound was given.
_STORE_WAIT = timedelta(seconds=1)


def _unlocked(gen: SqlGen[T]) -> TxGen[T]:
    """``gen``, a record's row lock that stayed held being the store's failure."""
    try:
        return (yield from gen)
    except LockTimeoutError as exc:
        raise StoreUnavailableError(
            f"a record stayed locked by another transaction: {exc}"
        ) from exc


_STEPS = {Reserve: "reserve", Settle: "settle", Release: "release", Renew: "renew"}
_STEPS[Checkpoint] = "checkpoint"
_STEPS[Discard] = "discard"


class _Verbs:
    """The `Unit` verbs of a unit that takes operations as values: each makes its operation
    and performs it (an async unit's ``perform`` returns the awaitable)."""

    def perform(self, op: StoreOp) -> Any:
        raise NotImplementedError

    def reserve(
        self,
        scope: Scope,
        fingerprint: str,
        *,
        now: datetime | None,
        lease: timedelta,
        ttl: timedelta,
        lock_timeout: timedelta | None = None,
    ) -> Any:
        """``lock_timeout``: how long this reservation may wait on another attempt's row
        lock, if less than the unit's own (a caller with a deadline)."""
        return self.perform(Reserve(scope, fingerprint, now, lease, ttl, lock_timeout))

    def complete(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> Any:
        return self.perform(Settle(scope, token, Status.COMPLETED, response, now, ttl))

    def fail(
        self, scope: Scope, token: int, response: bytes, *, now: datetime | None, ttl: timedelta
    ) -> Any:
        return self.perform(Settle(scope, token, Status.FAILED, response, now, ttl))

    def release(self, scope: Scope, token: int) -> Any:
        return self.perform(Release(scope, token))

    def renew(self, scope: Scope, token: int, *, now: datetime | None, lease: timedelta) -> Any:
        return self.perform(Renew(scope, token, now, lease))

    def checkpoint(
        self, scope: Scope, token: int, point: str | None, *, now: datetime | None, lease: timedelta
    ) -> Any:
        """Record the recovery point ``point`` and extend the lease; fenced on ``token``."""
        return self.perform(Checkpoint(scope, token, point, now, lease))

    def discard(self) -> Any:
        """Throw the work's writes away; True when none of them can commit any more (every
        effect of the work was in this transaction, as far as idempo can know)."""
        return self.perform(Discard())


class SyncUnit(_Verbs):
    """A `Unit` whose operations run a `UnitLogic` through a synchronous executor.

    ``discards``: False for a store used directly, where none of the work runs (a Discard
    is answered at once, without running the logic).
    """

    discards = True

    def __init__(self, logic: UnitLogic, run: Callable[[TxGen[Any]], Any]) -> None:
        self._logic = logic
        self._run = run

    def perform(self, op: StoreOp) -> Any:
        if not self.discards and isinstance(op, Discard):
            return False
        try:
            return self._run(getattr(self._logic, _STEPS[type(op)])(op))
        except TransactionConflict as conflict:
            raise conflict.error from None


def _awaited(verb: Callable[..., Any]) -> Callable[..., Coroutine[Any, Any, Any]]:
    """``verb`` as a coroutine function (what callers test async verbs by)."""

    @functools.wraps(verb)
    async def call(*args: Any, **kwargs: Any) -> Any:
        return await verb(*args, **kwargs)

    return call


NOT_NOW: Any = type("NotNow", (), {"__repr__": lambda self: "NOT_NOW"})()
"""What an `AsyncUnit`'s ``now`` answers when it cannot run a transaction at once without
waiting (the generator is then untouched, for ``run`` to take)."""


class AsyncUnit(_Verbs):
    """The asynchronous face of `SyncUnit`: ``perform`` returns an awaitable.

    ``now``: runs a transaction at once, on the caller's thread, when it can do so without
    waiting (a local database whose lock is free), else answers `NOT_NOW`; the operation is
    then done when ``perform`` returns, and its awaitable never suspends (the async driver
    spends no task on it).
    """

    discards = True
    reserve = _awaited(_Verbs.reserve)
    complete = _awaited(_Verbs.complete)
    fail = _awaited(_Verbs.fail)
    release = _awaited(_Verbs.release)
    renew = _awaited(_Verbs.renew)
    checkpoint = _awaited(_Verbs.checkpoint)
    discard = _awaited(_Verbs.discard)

    def __init__(
        self,
        logic: UnitLogic,
        run: Callable[[TxGen[Any]], Awaitable[Any]],
        now: Callable[[TxGen[Any]], Any] | None = None,
    ) -> None:
        self._logic = logic
        self._run = run
        self._now = now

    def perform(self, op: StoreOp) -> Awaitable[Any]:
        if not self.discards and isinstance(op, Discard):
            return _nothing()  # never suspends: the async driver spends no task on it
        gen = getattr(self._logic, _STEPS[type(op)])(op)
        if self._now is not None:
            try:
                done = self._now(gen)
            except TransactionConflict as conflict:
                raise conflict.error from None
            if done is not NOT_NOW:
                return done_at_once(done)
        return self._perform(gen)

    def in_thread(self, op: StoreOp) -> Awaitable[Any]:
        """`perform`, by ``run`` only (never at once)."""
        return self._perform(getattr(self._logic, _STEPS[type(op)])(op))

    async def _perform(self, gen: TxGen[Any]) -> Any:
        try:
            return await self._run(gen)
        except TransactionConflict as conflict:
            raise conflict.error from None


async def _nothing() -> bool:
    return False


async def done_at_once(value: Any) -> Any:
    """``value``, as an awaitable that never suspends (the async driver awaits it inline)."""
    return value


def _ddl(sql: str) -> SqlGen[None]:
    yield Statement(sql, {}, fetch=False)


class SqlStore(SyncUnit):
    """The `Store` verbs of any SQL store; subclasses say how `run` reaches the database."""

    dialect: SqlDialect
    discards = False
    bounds_lock_waits = True  # see StoreLogic

    def __init__(self, dialect: SqlDialect) -> None:
        self.dialect = dialect
        super().__init__(StoreLogic(dialect, bounds=self.bounds_lock_waits), self.run)

    def run(self, gen: TxGen[T]) -> T:
        """Run statements on the store's own connection, committed at once."""
        raise NotImplementedError

    def read(self, gen: TxGen[T]) -> T:
        """Run statements that only read; stores that lock for writes may lock less."""
        return self.run(gen)

    def migrate(self) -> None:
        """Create the records table and its index if they do not exist."""
        for sql in self.dialect.ddl():
            self.run(_ddl(sql))
        self.dialect.schema_changed()

    def get(self, scope: Scope) -> Record | None:
        return self.read(self.dialect.get(scope))

    def evict(self, scope: Scope) -> bool:
        """Delete the record whatever its state; True if there was one."""
        return self.run(self.dialect.evict(scope))

    def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        return self.run(self.dialect.purge(before, limit))

    def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        return self.read(self.dialect.stats())

    def scan(
        self,
        *,
        status: Status | None = None,
        operation: str | None = None,
        principal: str | None = None,
        created_before: datetime | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """Up to ``limit`` records passing every filter given, oldest first, without their
        responses (`get` reads one whole). See `idempo.stores._scan.ScanFilter`."""
        where = ScanFilter(status, operation, principal, created_before, limit)
        return self.read(self.dialect.scan(where))


class AsyncSqlStore(AsyncUnit):
    """The asynchronous twin of `SqlStore`."""

    dialect: SqlDialect
    discards = False
    bounds_lock_waits = True  # see StoreLogic

    def __init__(self, dialect: SqlDialect, now: Callable[[TxGen[Any]], Any] | None = None) -> None:
        self.dialect = dialect
        super().__init__(StoreLogic(dialect, bounds=self.bounds_lock_waits), self.run, now)

    async def run(self, gen: TxGen[T]) -> T:
        """Run statements on the store's own connection, committed at once."""
        raise NotImplementedError

    async def migrate(self) -> None:
        """Create the records table and its index if they do not exist."""
        for sql in self.dialect.ddl():
            await self.run(_ddl(sql))
        self.dialect.schema_changed()

    async def get(self, scope: Scope) -> Record | None:
        return await self.run(self.dialect.get(scope))

    async def evict(self, scope: Scope) -> bool:
        """Delete the record whatever its state; True if there was one."""
        return await self.run(self.dialect.evict(scope))

    async def purge(self, *, before: datetime | None = None, limit: int = 1000) -> int:
        return await self.run(self.dialect.purge(before, limit))

    async def stats(self) -> dict[str, int]:
        """How many records are in each state."""
        return await self.run(self.dialect.stats())

    async def scan(
        self,
        *,
        status: Status | None = None,
        operation: str | None = None,
        principal: str | None = None,
        created_before: datetime | None = None,
        limit: int = 100,
    ) -> list[Record]:
        """The asynchronous face of `SqlStore.scan`."""
        where = ScanFilter(status, operation, principal, created_before, limit)
        return await self.run(self.dialect.scan(where))


def bound(dialect: SqlDialect, mode: Mode, lock_timeout: timedelta, executor: Executor) -> SyncUnit:
    """The unit of a guarded call on the app's connection, run by ``executor``."""
    return SyncUnit(unit_logic(dialect, mode, lock_timeout), functools.partial(execute, executor))


def abound(
    dialect: SqlDialect, mode: Mode, lock_timeout: timedelta, executor: Executor
) -> AsyncUnit:
    """The asynchronous face of `bound`."""
    logic = unit_logic(dialect, mode, lock_timeout)
    return AsyncUnit(logic, functools.partial(aexecute, executor))


def unit_logic(
    dialect: SqlDialect,
    mode: Mode,
    lock_timeout: timedelta,
    waiting: Callable[[timedelta], SqlDialect] | None = None,
) -> UnitLogic:
    """The logic of a guarded call on the app's connection, in the given mode. ``waiting``:
    the dialect for a reservation bounded by another lock wait, where the statement carries
    its own (see `TransactionLogic`)."""
    if mode == "transactional":
        return TransactionLogic(dialect, lock_timeout, waiting)
    return LeasedLogic(dialect)
