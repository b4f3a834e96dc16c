"""The protocol of one guarded call, written once as a generator and driven sync or async.

The flow yields operations and receives their results (as httpx's auth flows do). It does no
I/O itself, so the sync and async drivers below are the only places that differ.

    Reserve ──► Acquired ──► Execute ──► Complete | Fail | Release
            ├─► Replay   ──► return the stored record
            ├─► Mismatch ──► FingerprintMismatchError
            └─► InProgress ─► RequestInProgressError, or Sleep and Reserve again (policy.wait)
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Generator
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from ._keys import Scope
from ._ops import Release, Reserve, Settle
from ._record import Acquired, InProgress, Mismatch, Record, Replay, Status
from .errors import (
    FencedError,
    FingerprintMismatchError,
    RequestInProgressError,
    ResponseTooLargeError,
    StoreError,
)
from .policy import Policy
from .stores.base import AsyncUnit, Unit

# How often a caller told to wait re-checks a key that is in progress, at most.
_POLL_SECONDS = 0.05


# Not frozen, as the ops in _ops.py: made on every call, never changed.
@dataclass(slots=True)
class Execute:
    token: int
    recovery_point: str | None


@dataclass(slots=True)
class Discard:
    pass


@dataclass(slots=True)
class Sleep:
    seconds: float


Op = Reserve | Execute | Settle | Release | Discard | Sleep


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
        """The FAILED response for a result that ran but cannot be stored (too large, or
        the serializer refused it): deterministic, so a retry must not run the work again."""
        ...

    def decode(self, record: Record) -> Any:
        """What a replay hands back (or raises) for a stored record."""
        ...


def guarded_call(
    scope: Scope, fingerprint: str, policy: Policy, codec: Codec
) -> Generator[Op, Any, Record | None]:
    """Run one call: returns the record to replay, or None once this call executed the work."""
    reservation = yield from _reserve(scope, fingerprint, policy)
    if not isinstance(reservation, Acquired):
        return reservation.record
    token = reservation.token
    try:
        value = yield Execute(token, reservation.recovery_point)
    except GeneratorExit:
        raise
    except BaseException as exc:
        yield from _abandon(scope, token, *codec.encode_error(exc), policy)
        raise
    try:
        status, body = codec.encode_result(value)
        if status is not None and len(body) > policy.max_response_bytes:
            raise ResponseTooLargeError(len(body), policy.max_response_bytes)
    except Exception as exc:
        yield from _abandon(scope, token, Status.FAILED, codec.encode_unstorable(exc), policy)
        raise
    yield _outcome(scope, token, status, body, policy)
    return None


def _abandon(
    scope: Scope, token: int, status: Status | None, body: bytes, policy: Policy
) -> Generator[Op, Any, None]:
    """Throw the work's writes away, then record the failure or release the key."""
    # The error being raised matters more than a store's: a reservation left behind still
    # ends with its lease (or with its transaction, when the connection broke).
    with suppress(FencedError, StoreError):
        yield Discard()
        yield _outcome(scope, token, status, body, policy)


def _reserve(
    scope: Scope, fingerprint: str, policy: Policy
) -> Generator[Op, Any, Acquired | Replay]:
    deadline: datetime | None = None
    while True:
        now = policy.clock()
        reservation = yield Reserve(scope, fingerprint, now, policy.lease, policy.ttl)
        if not isinstance(reservation, Acquired):
            yield Discard()  # nothing will be written: end the transaction, if there is one
        match reservation:
            case Acquired() | Replay():
                return reservation
            case Mismatch():
                raise FingerprintMismatchError(scope.key)
            case InProgress(retry_after=retry_after):
                if policy.wait is None:
                    raise RequestInProgressError(scope.key, retry_after)
                deadline = deadline or now + policy.wait
                remaining = (deadline - now).total_seconds()
                if remaining <= 0:
                    raise RequestInProgressError(scope.key, retry_after)
                yield Sleep(min(retry_after, remaining, _POLL_SECONDS))


def _outcome(
    scope: Scope, token: int, status: Status | None, body: bytes, policy: Policy
) -> Settle | Release:
    if status is None:
        return Release(scope, token)
    return Settle(scope, token, status, body, policy.clock(), policy.ttl)


def _invoke(unit: Any, op: Op) -> Any:
    """Carry out one store operation: the verb's result, or an async unit's awaitable.

    Shared by both drivers, and called inline rather than through a coroutine of its own;
    isinstance tests, not a match on class patterns: this runs several times per call, and
    either would cost more than the memory store's whole verb.
    """
    if isinstance(op, Reserve):
        return unit.reserve(op.scope, op.fingerprint, now=op.now, lease=op.lease, ttl=op.ttl)
    if isinstance(op, Settle):
        verb = unit.complete if op.status == Status.COMPLETED else unit.fail
        return verb(op.scope, op.token, op.response, now=op.now, ttl=op.ttl)
    if isinstance(op, Release):
        return unit.release(op.scope, op.token)
    if isinstance(op, Discard):
        return unit.discard()
    raise AssertionError(f"the flow yielded {op!r}, which the driver cannot perform")


def _sleep(op: Sleep, policy: Policy) -> object:
    return (policy.sleep or time.sleep)(op.seconds)


async def _asleep(op: Sleep, policy: Policy) -> None:
    if policy.sleep is None:
        await asyncio.sleep(op.seconds)
        return
    # An injected sleep (a test's clock) moves the clock the deadline is read from; other
    # tasks still get their turn.
    slept = policy.sleep(op.seconds)
    if inspect.isawaitable(slept):
        await slept
        return
    await asyncio.sleep(0)


Flow = Generator[Op, Any, Record | None]


def pump(flow: Flow, unit: Unit, policy: Policy, op: Op) -> Execute | Done:
    """Perform operations until the flow asks for the work to run, or ends."""
    try:
        while not isinstance(op, Execute):
            try:
                result = _sleep(op, policy) if isinstance(op, Sleep) else _invoke(unit, op)
            except BaseException as exc:  # noqa: BLE001 - every failure goes back into the flow
                op = flow.throw(exc)
            else:
                op = flow.send(result)
    except StopIteration as stop:
        return Done(stop.value)
    return op


async def apump(flow: Flow, unit: AsyncUnit, policy: Policy, op: Op) -> Execute | Done:
    """The asynchronous twin of `pump`.

    The flow's StopIteration is caught here: one that escaped a coroutine would turn into a
    RuntimeError (PEP 479).
    """
    try:
        while not isinstance(op, Execute):
            try:
                if isinstance(op, Sleep):
                    await _asleep(op, policy)
                    result = None
                else:
                    result = await _invoke(unit, op)
            except BaseException as exc:  # noqa: BLE001 - every failure goes back into the flow
                op = flow.throw(exc)
            else:
                op = flow.send(result)
    except StopIteration as stop:
        return Done(stop.value)
    return op
