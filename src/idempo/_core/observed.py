"""A performer that times the store and notes what each operation decided.

Put in front of a call's unit only when someone observes (`idempo.events`): a call with no
observer never meets it. It reads decisions off the operations and their answers, so the
flow itself knows nothing of observers; the guard reports them (`report`), in the caller's
own thread or task (an async store operation may run in a task of its own, and a tracer's
current span belongs to the caller's context):

    Reserve → Acquired      executed (taken_over: the store said so, or steps to resume)
            → Replay        (the guard reports the replay once its record decodes)
            → InProgress    the wait begins; the next answer ends it (waited)
    Settle  → COMPLETED / FAILED recorded;  Release, Checkpoint (lease ended) → released
    any settling op raises  FencedError → fenced;  another error → unrecorded

Refusals (mismatch, in progress, the store down) are reported by the guard, which sees
them as the errors it raises, observed or not.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..errors import FencedError, TransactionOwnershipError
from ..events import FINAL, Emitter, Kind
from ..policy import Policy
from .ops import Checkpoint, Discard, Release, Reserve, Settle, StoreOp
from .record import Acquired, InProgress, Status


class Observed:
    """The sync performer in front of ``inner`` (a unit, or `Verbs` in front of a store)."""

    __slots__ = (
        "_clock",
        "_inner",
        "_waiting_since",
        "acquired",
        "emitter",
        "ended",
        "settled",
        "store_seconds",
        "waited",
    )

    def __init__(self, inner: Any, emitter: Emitter, policy: Policy) -> None:
        self._inner = inner
        self.emitter = emitter
        # Waits are read on the clock the flow's deadline is read on (a test's fake clock
        # moves with its sleep); store latency always on the monotonic clock.
        clock = policy.clock
        self._clock: Callable[[], float] = (
            time.monotonic if clock is None else (lambda: clock().timestamp())
        )
        self._waiting_since: float | None = None
        self.ended = False
        self.store_seconds: float | None = None
        self.waited: float | None = None  # a wait that ended, to report with its decision
        self.acquired: Kind | None = None  # EXECUTED or TAKEN_OVER, once reserved
        # What settling decided: (kind, store seconds, error); the guard reports it.
        self.settled: tuple[Kind, float, BaseException | None] | None = None

    def __getattr__(self, name: str) -> Any:
        # renew, checkpoint, target...: what the guard reads of its unit goes to the inner one.
        if name == "_inner":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def perform(self, op: StoreOp) -> Any:
        start = time.perf_counter()
        try:
            result = self._inner.perform(op)
        except BaseException as exc:
            self.failed(op, exc, time.perf_counter() - start)
            raise
        self.answered(op, result, time.perf_counter() - start)
        return result

    def wait_seconds(self) -> float | None:
        """How long the call has waited on another attempt, if it did."""
        since = self._waiting_since
        return None if since is None else max(self._clock() - since, 0.0)

    def answered(self, op: StoreOp, result: Any, seconds: float) -> None:
        """Note what a store operation's answer decides."""
        if isinstance(op, Discard):
            return
        self.store_seconds = seconds
        if isinstance(op, Reserve):
            if isinstance(result, InProgress):
                if self._waiting_since is None:
                    self._waiting_since = self._clock()
                return
            self.waited = self.wait_seconds()
            if isinstance(result, Acquired):
                taken = getattr(result, "taken_over", False) or result.recovery_point is not None
                self.acquired = Kind.TAKEN_OVER if taken else Kind.EXECUTED
            return
        if isinstance(op, Settle):
            kind = Kind.COMPLETED if op.status is Status.COMPLETED else Kind.FAILED
        elif isinstance(op, Release | Checkpoint):
            kind = Kind.RELEASED
        else:
            return
        self.settled = (kind, seconds, None)

    def failed(self, op: StoreOp, exc: BaseException, seconds: float) -> None:
        """Note what a store operation's failure decides (refusals are the guard's)."""
        if not isinstance(op, Settle | Release | Checkpoint) or isinstance(
            exc, TransactionOwnershipError
        ):
            return  # the flow records the owned transaction as FAILED next
        self.store_seconds = seconds
        kind = Kind.FENCED if isinstance(exc, FencedError) else Kind.UNRECORDED
        self.settled = (kind, seconds, exc)

    def report(self, kind: Kind, **fields: Any) -> None:
        """Emit ``kind`` for this call, after the wait it ended, if it waited. Final kinds
        are reported once: the first ends the call."""
        if self.ended:
            return
        waited, self.waited = self.waited, None
        if waited is not None:
            self.emitter.emit(Kind.WAITED, wait_seconds=waited, store_seconds=self.store_seconds)
            fields.setdefault("wait_seconds", waited)
        if kind in FINAL:
            self.ended = True
        self.emitter.emit(kind, **fields)


class AsyncObserved(Observed):
    """The async twin: the inner performer returns awaitables, and so does this one."""

    __slots__ = ()

    def perform(self, op: StoreOp) -> Any:
        return self._perform(op)

    async def _perform(self, op: StoreOp) -> Any:
        start = time.perf_counter()
        try:
            result = await self._inner.perform(op)
        except BaseException as exc:
            self.failed(op, exc, time.perf_counter() - start)
            raise
        self.answered(op, result, time.perf_counter() - start)
        return result
