"""The function API: run work once per scope and replay its stored result.

idem = Idempotency(open_store("sqlite:///app.db"))

@idem.idempotent(key="order_id")
def charge(order_id: str, amount: int) -> dict[str, str]:
    return psp.charge(order_id, amount)

with idem.once(key, operation="charge", payload=order, conn=conn) as attempt:
    if not attempt.replayed:
        conn.execute("INSERT ...")          # commits with the record, or not at all
        attempt.result = {"id": order.id}
return attempt.result

Integrations that cannot wrap the work in one block (a middleware whose response arrives in
pieces, a consumer that maps every ending to a broker action) take the same call in two
phases: ``handle = idem.begin(...)``, then ``handle.finish(result)`` or
``handle.abort(exc)``. ``once`` is that handle with ``with`` around it.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from datetime import timedelta
from types import MappingProxyType, TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    NamedTuple,
    ParamSpec,
    Required,
    TypedDict,
    TypeVar,
    Unpack,
    cast,
    overload,
)

from ._core.digest import key_ref
from ._core.fingerprint import fingerprint
from ._core.flow import (
    NOT_KEPT,
    AsyncStoreVerbs,
    Codec,
    Done,
    Execute,
    Flow,
    StoreVerbs,
    Verbs,
    apump,
    checkpoint,
    guarded_call,
    outlasting,
    performer,
    pump,
)
from ._core.keys import Scope, derive_key, evict_hint, validate_key
from ._core.observed import AsyncObserved, Observed
from ._core.progress import NO_PROGRESS, Progress
from ._core.record import Record, Status
from ._core.renewal import Renewal, ThreadRenewal
from .encryption import KeyRing, SealedCodec, refuse_sealed
from .errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    FingerprintMismatchError,
    IdempotencyError,
    ReplayedFailureError,
    RequestInProgressError,
    StoreError,
)
from .events import Emitter, Kind, Observer, Surface, dormancy
from .policy import Policy
from .serializers import Serializer, return_serializer
from .stores.base import AsyncStore, AsyncTransactionalStore, Mode, Store, TransactionalStore

__all__ = [
    "AsyncAttempt",
    "AsyncHandle",
    "AsyncIdempotency",
    "Attempt",
    "FunctionCodec",
    "Handle",
    "Idempotency",
    "IdempotentOptions",
]

_logger = logging.getLogger("idempo")


def _debugging() -> bool:
    """Whether any layer's logger would show the normal path's DEBUG lines."""
    return any(
        logging.getLogger(name).isEnabledFor(logging.DEBUG)
        for name in ("idempo.guard", "idempo.http")
    )


if TYPE_CHECKING:
    # A bare `Attempt` stays `Attempt[Any]` under `mypy --strict` (PEP 696), as before it
    # was generic; typing_extensions is only needed by the type checker.
    from typing_extensions import TypeVar as _TypeVar

    T = _TypeVar("T", default=Any)
else:
    T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")


class FunctionCodec:
    """The function API's `Codec`: return values are completions; exceptions release the key,
    unless they are one of ``fail_on`` (recorded FAILED and replayed as `ReplayedFailureError`).

    Integrations that store what a function returns (consumers, sagas) subclass it to change
    what counts as deterministic.

    >>> from idempo.serializers import JsonSerializer
    >>> codec = FunctionCodec(JsonSerializer(), fail_on=(ValueError,))
    >>> codec.encode_result({"id": 1}), codec.encode_error(KeyError("k"))
    ((<Status.COMPLETED: 'completed'>, b'{"id":1}'), (None, b''))
    """

    def __init__(self, serializer: Serializer, fail_on: tuple[type[BaseException], ...]) -> None:
        self.serializer = serializer
        self.fail_on = fail_on

    def encode_result(self, value: Any) -> tuple[Status | None, bytes]:
        return Status.COMPLETED, self.serializer.dumps(value)

    def encode_error(self, exc: BaseException) -> tuple[Status | None, bytes]:
        if isinstance(exc, self.fail_on) and not isinstance(exc, IdempotencyError):
            return Status.FAILED, self.encode_unstorable(exc)
        return None, b""

    def encode_unstorable(self, exc: BaseException) -> bytes:
        kind = type(exc)
        failure = {"error": f"{kind.__module__}.{kind.__qualname__}", "detail": str(exc)}
        return json.dumps(failure).encode()

    def decode(self, record: Record) -> Any:
        response = record.response
        if response and not response[0]:
            # Sealed bytes (they start with a NUL, which JSON never does) met by a guard with
            # no key ring: refused, never handed to a serializer that may return them as is.
            refuse_sealed(record)
        try:
            if record.status is not Status.FAILED:
                return self.serializer.loads(response or b"null")
            failure = json.loads(response or b"{}")
            error, detail = str(failure.get("error", "?")), str(failure.get("detail", ""))
        except Exception as exc:
            # Nothing runs and nothing is replayed until an operator evicts the record.
            raise CorruptRecordError(
                f"the stored {record.status.value} record of {key_ref(record.scope.key)}"
                f" (operation {record.scope.operation!r}) cannot be decoded"
                f" ({type(exc).__name__}: {exc}); to evict it, {evict_hint(record.scope)}"
            ) from exc
        raise ReplayedFailureError(error, detail)


class Attempt(Generic[T]):
    """What a guarded block works with.

    Attributes:
        scope: the (principal, operation, key) this attempt runs under.
        replayed: True if the work already ran; ``result`` then holds its stored result and
            the block must not do the work again.
        result: set it to the work's result before leaving the block; it is stored and
            replayed to every retry. (Typed ``T``: ``Attempt[Receipt]``; None until set.)
        token: this attempt's fencing token (None on a replay).
        lease_lost: True once a renewal was refused (a background one included): another
            attempt took the key over and this one's outcome will be refused. Long work
            checks it, or calls `renew`, before each step it cannot take back.
        resumed: True when a previous attempt, taken over, had committed steps (`steps`).

    Work made of steps (leased mode) records each one with `checkpoint` and skips the ones
    already done with `needs`; a takeover after a crash resumes after the last recorded
    step, with the state recorded with them (docs/recovery-points.md)::

        with idem.once(order_id, operation="place-order", payload=order) as attempt:
            if attempt.needs("charge"):
                charge = psp.charge(order, key=attempt.downstream_key("charge"))
                attempt.checkpoint("charge", {"charge_id": charge.id})
            attempt.result = {"charge": attempt.state["charge_id"]}
    """

    result: T
    # Set on the instance only by `do_not_store`: the hot path never writes it.
    _unkept = False
    # The call that executes this attempt (None on a replay): it renews and records steps.
    # Set by that call; like `_lost` (a refused renewal), a default on the class until then.
    _handle: _Pending[Any] | None = None
    _lost: FencedError | None = None

    def __init__(
        self,
        scope: Scope,
        *,
        replayed: bool,
        result: Any = None,
        token: int | None = None,
        recovery_point: str | None = None,
    ) -> None:
        self.scope = scope
        self.replayed = replayed
        self.result = result
        self.token = token
        self._progress = NO_PROGRESS if recovery_point is None else Progress.decode(recovery_point)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.scope.key!r} replayed={self.replayed}>"

    @property
    def lease_lost(self) -> bool:
        return self._lost is not None

    def do_not_store(self) -> None:
        """Give this attempt's answer to its caller without storing it, and release the
        key, so a caller that fixes its request may retry with the same key (SPEC §2 rule
        7, as for an answer given before the endpoint ran: a validation failure, a refused
        login). On the app's connection the work's writes roll back with the release: a
        retry runs it again. Over HTTP the request's answer is sent, not stored:

            attempt = current_attempt(request)
            if not valid(payload):
                attempt.do_not_store()
                return JSONResponse({"error": "invalid"}, status_code=400)

        >>> from idempo.stores.memory import MemoryStore
        >>> idem = Idempotency(MemoryStore())
        >>> with idem.once("k-9", operation="quote") as attempt:
        ...     attempt.result = {"error": "stale price"}
        ...     attempt.do_not_store()
        >>> idem.begin("k-9", operation="quote").attempt.replayed
        False
        """
        self._unkept = True

    @property
    def keeps_answer(self) -> bool:
        """False once `do_not_store` was called."""
        return not self._unkept

    @property
    def outcome(self) -> Any:
        """What the flow records: the result, or `NOT_KEPT` after `do_not_store`."""
        return NOT_KEPT if self._unkept else self.result

    @property
    def resumed(self) -> bool:
        return self._progress.resumed

    @property
    def recovery_point(self) -> str | None:
        """The last step recorded (by this attempt, or by one it took over from), if any."""
        return self._progress.last

    @property
    def steps(self) -> tuple[str, ...]:
        """The steps recorded so far, oldest first."""
        return self._progress.steps

    @property
    def state(self) -> Mapping[str, Any]:
        """What the recorded steps recorded with them (merged; read-only)."""
        return MappingProxyType(dict(self._progress.state))

    def needs(self, step: str) -> bool:
        """True if ``step`` is still to do: no attempt recorded it (`checkpoint`)."""
        return step not in self._progress.steps

    def downstream_key(self, label: str) -> str:
        """The key to send to the outside call named ``label`` (a PSP charge, a mail):
        `derive_key` over this attempt's whole scope, the same on every retry and takeover
        and distinct per principal and operation."""
        scope = self.scope
        return derive_key(scope.key, f"{label}|{scope.principal}|{scope.operation}")

    def _next_point(self, step: str, state: Mapping[str, Any] | None) -> tuple[Progress, str]:
        if self._handle is None:
            raise ConfigurationError(
                "a replayed attempt records no steps: the work already ran"
                if self.replayed
                else "this attempt cannot record steps"
            )
        progress = self._progress.after(step, state)
        point = progress.encode()
        self._check_lease()
        return progress, point

    def checkpoint(self, step: str, state: Mapping[str, Any] | None = None) -> None:
        """Record that ``step`` committed, with ``state`` (small, JSON: ids, not results)
        merged into `state`, fenced on this attempt's token; it extends the lease too.

        On the app's connection (``conn=`` with ``mode="leased"``) the step's own writes
        commit in the same transaction as its record, and the next step's writes begin a
        new one. On the store's own connection only the record is written: a step whose
        effect is elsewhere passes `downstream_key` to that system, so that running it
        again after a crash before its record is harmless there.

        Raises:
            FencedError: another attempt took the key over; nothing was recorded (and, on
                the app's connection, the step's writes rolled back).
            ConfigurationError: transactional mode (everything commits at the end, so a
                crash leaves no step to resume), or a replayed attempt.
            UnserializableResultError: ``state`` is not JSON, or the point is too large.
        """
        progress, point = self._next_point(step, state)
        try:
            self._handle._checkpoint(point)  # type: ignore[union-attr] # set, per _next_point
        except FencedError as exc:
            self._lose(exc)
            raise
        self._progress = progress

    def renew(self) -> None:
        """Extend this attempt's lease (long work). Raises `FencedError` if it was lost: at
        once, with no round trip, once any renewal found it lost."""
        self._check_lease()
        if self._handle is not None:
            try:
                self._handle._renew()
            except FencedError as exc:
                self._lose(exc)
                raise

    def _check_lease(self) -> None:
        if self._lost is not None:
            # A fresh error each time: the work and a renewal thread may both raise it.
            raise FencedError(str(self._lost))

    def _lose(self, exc: FencedError) -> None:
        if self._lost is None:
            self._lost = exc
            if self._handle is not None:
                self._handle._events().emit(Kind.LEASE_LOST, token=self.token, error=exc)


class AsyncAttempt(Attempt[T]):
    """The asynchronous twin of `Attempt`: ``await attempt.renew()``, ``await
    attempt.checkpoint(step, state)``."""

    async def renew(self) -> None:  # type: ignore[override]
        self._check_lease()
        if self._handle is not None:
            try:
                await outlasting(self._handle._renew())
            except FencedError as exc:
                self._lose(exc)
                raise

    async def checkpoint(  # type: ignore[override]
        self, step: str, state: Mapping[str, Any] | None = None
    ) -> None:
        progress, point = self._next_point(step, state)
        try:
            await outlasting(self._handle._checkpoint(point))  # type: ignore[union-attr]
        except FencedError as exc:
            self._lose(exc)
            raise
        self._progress = progress


class _Pending(Generic[T]):
    """One guarded call, before any I/O: what the sync and async handles share.

    Its flow is None once nothing is held any more (a replay, or the call settled), which
    makes settling a second time a no-op.
    """

    attempt: Attempt[T]
    _attempt_class: type[Attempt[Any]]
    _renewal_class: type[ThreadRenewal] | type[Renewal]
    _observed_class: type[Observed]
    _run: Execute  # once the work runs: its recovery point is kept current for the flow
    # Set only when someone observes the guard (`idempo.events`): the unit is then observed.
    _observed: Observed | None = None
    # Until the work runs (a replay never sets them): defaults on the class, not per call.
    _token = 0
    _renewal: Any = None

    def __init__(
        self,
        unit: Any,
        scope: Scope,
        payload: Any,
        policy: Policy,
        codec: Codec,
        renew_every: float | None,
        guard: _Guard[Any, Any],
        surface: Surface = "function",
    ) -> None:
        self._guard = guard
        self._surface = surface
        # The one test a call with no observer pays; observers that can go dormant (an
        # OpenTelemetry observer with no SDK behind it) are asked on each call.
        if guard._observing and not (guard._dormant is not None and guard._dormant()):
            self._observed = unit = self._observed_class(
                unit, guard._emitter(scope, surface), policy
            )
        self._unit = unit
        self._scope = scope
        self._policy = policy
        self._codec = codec
        self._every = renew_every
        self._flow: Flow | None = guarded_call(
            scope, fingerprint(payload), policy, codec, discards=getattr(unit, "discards", True)
        )

    def _started(self, step: Execute | Done) -> Any:
        """The attempt the work runs with (renewed, if asked), or the replay the flow found."""
        if isinstance(step, Execute):
            attempt = self._attempt_class(
                self._scope,
                replayed=False,
                token=step.token,
                recovery_point=step.recovery_point,
            )
            self._token = step.token
            self._run = step
            attempt._handle = self
            self.attempt = attempt
            observed = self._observed
            if observed is not None:
                observed.report(
                    observed.acquired or Kind.EXECUTED,
                    token=step.token,
                    store_seconds=observed.store_seconds,
                )
            if self._every is not None:
                # Async: started in the task that runs the work; a lost lease cancels it.
                self._renewal = self._renewal_class(attempt, self._every, _logger)  # type: ignore[arg-type]
                self._renewal.start()
            return attempt
        assert step.record is not None, "the flow ended before the work with nothing to replay"
        self._flow = None  # a replay holds nothing
        self.attempt = self._attempt_class(
            self._scope, replayed=True, result=self._codec.decode(step.record)
        )
        observed = self._observed
        if observed is not None:
            observed.report(
                Kind.REPLAYED, token=step.record.token, store_seconds=observed.store_seconds
            )
        return self.attempt

    def _begin(self) -> Any:
        raise NotImplementedError

    def _events(self) -> Emitter:
        """This call's emitter; made on the spot for a decision worth reporting even when
        nobody observes the guard (a refusal, a fault: it is logged)."""
        observed = self._observed
        if observed is not None:
            return observed.emitter
        return self._guard._emitter(self._scope, self._surface)

    def _refused(self, exc: BaseException) -> None:
        """Report why the reservation ended without the work (the error being raised)."""
        if isinstance(exc, ReplayedFailureError):
            kind = Kind.REPLAYED  # a recorded failure, replayed as the error it was
        elif isinstance(exc, FingerprintMismatchError):
            kind = Kind.MISMATCH
        elif isinstance(exc, RequestInProgressError):
            kind = Kind.IN_PROGRESS
        elif isinstance(exc, Exception):
            kind = Kind.STORE_UNAVAILABLE  # a store fault, or one the store was set up with
        else:
            return  # a cancellation: the flow released what it held, and said so
        observed = self._observed
        if observed is None:
            self._events().emit(kind, error=exc)
            return
        wait = observed.wait_seconds() if kind is Kind.IN_PROGRESS else None
        observed.report(kind, wait_seconds=wait, store_seconds=observed.store_seconds, error=exc)

    def _settled(self, observed: Observed, exc: BaseException | None) -> None:
        """Report how the call settled: what the observed unit heard, with ``exc`` (what the
        work or the settling raised) as its error when the store had none."""
        settled = observed.settled
        if settled is None:
            # No settling answer came: the flow swallowed a store fault (a discard that
            # failed), and the key stays in progress until its lease ends.
            observed.report(Kind.UNRECORDED, token=self._token, error=exc)
            return
        kind, seconds, error = settled
        observed.report(kind, token=self._token, store_seconds=seconds, error=error or exc)

    def _gave_up(self, exc: BaseException) -> None:
        """After work that raised ``exc`` (raised on, as it is): report the release or the
        recorded failure, or what kept the flow from making it (the key then frees when
        its lease ends)."""
        observed = self._observed
        if observed is not None:
            self._settled(observed, self._run.fault or exc)
        elif self._run.fault is not None:
            self._unsettled(self._run.fault)

    def _unsettled(self, exc: BaseException) -> None:
        """After the work: report a settling that raised ``exc`` (to the app)."""
        observed = self._observed
        if observed is not None:
            self._settled(observed, exc)
        elif isinstance(exc, FencedError):
            self._events().emit(Kind.FENCED, token=self._token, error=exc)
        elif isinstance(exc, StoreError):
            self._events().emit(Kind.UNRECORDED, token=self._token, error=exc)

    def _renew(self) -> Any:
        policy = self._policy
        return self._unit.renew(self._scope, self._token, now=policy.now(), lease=policy.lease)

    def _checkpoint(self, point: str) -> Any:
        policy = self._policy
        verb = checkpoint(self._unit)
        ring = self._guard.encryption
        if ring is not None:
            point = ring.seal_point(point, self._scope)
        # Before the call: one whose answer is lost may still have recorded the step, and a
        # failure from here on must not forget it (flow.py, _outcome).
        self._run.recovery_point = point
        return verb(self._scope, self._token, point, now=policy.now(), lease=policy.lease)


class Handle(_Pending[T]):
    """One guarded call in two phases: `Idempotency.begin` reserved it; end it with exactly
    one of `finish` or `abort` (later calls do nothing).

    On a replay (``handle.attempt.replayed``) nothing is held and ending it is optional.
    An executing handle that is never ended keeps its key until the lease (or the app's
    transaction) ends: use `Idempotency.once` where the work fits in one block.

    >>> from idempo.stores.memory import MemoryStore
    >>> idem = Idempotency(MemoryStore())
    >>> handle = idem.begin("k-1", operation="pay")
    >>> handle.attempt.replayed
    False
    >>> handle.finish({"paid": 5})
    >>> idem.begin("k-1", operation="pay").attempt.result
    {'paid': 5}

    Attributes:
        attempt: the call's `Attempt` (scope, replayed, result, token, ``renew()``).
    """

    attempt: Attempt[T]
    _attempt_class = Attempt
    _renewal_class = ThreadRenewal
    _observed_class = Observed
    _renewal: ThreadRenewal | None

    def _enter(self) -> Attempt[T]:
        # Typed locals, not cast(): this runs on every call, and casts are calls.
        flow: Flow = self._flow  # type: ignore[assignment]
        try:
            attempt: Attempt[T] = self._started(pump(flow, self._unit, self._policy, next(flow)))
        except BaseException as exc:
            self._refused(exc)
            raise
        return attempt

    def _begin(self) -> Handle[T]:
        self._enter()
        return self

    def finish(self, result: T) -> None:
        """Store ``result`` as the work's outcome (per the codec: a completion, a recorded
        failure or a release), to be replayed to every retry.

        Raises:
            FencedError: the lease was lost to another attempt; the outcome was refused.
            ResponseTooLargeError, UnserializableResultError: the result cannot be stored.
            TransactionOwnershipError: the work committed or ended the guard's transaction.
            StoreError: the store failed to record it.
        """
        if self._flow is not None:
            self.attempt.result = result
            self._exit(None, None, None)

    def abort(self, exc: BaseException) -> None:
        """The work raised ``exc``: release the key, or record the failure (``fail_on``).

        Returns when ``exc`` is what the caller should raise (``except BaseException as exc:
        handle.abort(exc); raise``). Raises instead only what is truer than ``exc``:
        `TransactionOwnershipError` when the work committed the guard's transaction itself.
        A store fault while releasing never replaces ``exc``.
        """
        self._exit(type(exc), exc, exc.__traceback__)

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        flow = self._flow
        if flow is None:
            return
        self._flow = None
        if self._renewal is not None:
            self._renewal.stop()  # a lost lease marked the attempt; its outcome is fenced
        try:
            step = pump(
                flow,
                self._unit,
                self._policy,
                flow.send(self.attempt.outcome) if exc is None else flow.throw(exc),
            )
        except BaseException as raised:
            if raised is exc:
                self._gave_up(raised)
                return
            self._unsettled(raised)
            raise
        if self._observed is not None:
            self._settled(self._observed, None)
        if isinstance(step, Done):
            return
        raise AssertionError("the flow asked to execute twice")


class _Once(Handle[T]):
    """What `Idempotency.once` returns: the handle, begun on entering the block and
    finished or aborted on leaving it."""

    __enter__ = Handle._enter
    __exit__ = Handle._exit


class AsyncHandle(_Pending[T]):
    """The asynchronous twin of `Handle`: ``handle = await idem.begin(...)``, then ``await
    handle.finish(result)`` or ``await handle.abort(exc)``.

    The guard's own store operations are shielded from the caller's cancellation and bounded
    (as on leaving ``async with idem.once(...)``). With ``renew_every``, the renewal runs in
    the task that awaited `AsyncIdempotency.begin`; a lost lease cancels that task, and
    `abort` of that cancellation raises `FencedError`.

    >>> import asyncio
    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> idem = AsyncIdempotency(AsyncMemoryStore())
    >>> async def twice():
    ...     for _ in range(2):
    ...         handle = await idem.begin("e-1", operation="ship")
    ...         if not handle.attempt.replayed:
    ...             await handle.finish("shipped")
    ...     return handle.attempt.replayed, handle.attempt.result
    >>> asyncio.run(twice())
    (True, 'shipped')
    """

    attempt: AsyncAttempt[T]
    _attempt_class = AsyncAttempt
    _renewal_class = Renewal
    _observed_class = AsyncObserved
    _renewal: Renewal | None

    async def _enter(self) -> AsyncAttempt[T]:
        flow: Flow = self._flow  # type: ignore[assignment]
        try:
            attempt: AsyncAttempt[T] = self._started(
                await apump(flow, self._unit, self._policy, next(flow))
            )
        except BaseException as exc:
            self._refused(exc)
            raise
        return attempt

    async def _begin(self) -> AsyncHandle[T]:
        await self._enter()
        return self

    def finish(self, result: T) -> Coroutine[Any, Any, None]:
        """Store ``result``; see `Handle.finish`. Raises `FencedError` also when the work
        swallowed the cancellation a lost lease caused."""
        if self._flow is not None:
            self.attempt.result = result
        return self._exit(None, None, None)

    def abort(self, exc: BaseException) -> Coroutine[Any, Any, None]:
        """See `Handle.abort`; raises `FencedError` when ``exc`` is the cancellation a lost
        lease caused (``renew_every``)."""
        return self._exit(type(exc), exc, exc.__traceback__)

    async def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        flow = self._flow
        if flow is None:
            return
        self._flow = None
        ended = exc
        if self._renewal is not None:
            await self._renewal.stop()
            # The renewal's own cancellation of the work is the lost lease, raised as such.
            ended = self._renewal.outcome(exc)
        # A cancelled work's cleanup is shielded and bounded from its first operation: anyio
        # scopes cancel every await again, and a hung store must not hold the caller.
        cancelled = ended if isinstance(ended, asyncio.CancelledError) else None
        try:
            step = await apump(
                flow,
                self._unit,
                self._policy,
                flow.send(self.attempt.outcome) if ended is None else flow.throw(ended),
                cancelled=cancelled,
            )
        except BaseException as raised:
            if raised is exc:
                self._gave_up(raised)
                return
            self._unsettled(raised)
            raise
        if self._observed is not None:
            self._settled(self._observed, None)
        if isinstance(step, Done):
            if ended is not exc and ended is not None:
                raise ended
            return
        raise AssertionError("the flow asked to execute twice")


class _AsyncOnce(AsyncHandle[T]):
    """What `AsyncIdempotency.once` returns: ``async with`` begins and ends the handle."""

    __aenter__ = AsyncHandle._enter
    __aexit__ = AsyncHandle._exit


class IdempotentOptions(TypedDict, total=False):
    """The keyword arguments of `Idempotency.idempotent` (see there), for type checkers."""

    key: Required[str | Callable[..., str]]
    operation: str | None
    payload: Callable[..., Any] | None
    principal: str | Callable[..., str]
    conn: str | None
    mode: Mode
    serializer: Serializer | None
    renew_every: float | timedelta | None


_MISSING = inspect.Parameter.empty


class _Plain(NamedTuple):
    """A signature whose parameters can all be named: their names and defaults in order
    (`_MISSING`: none), how many may be given by position, and the names as a set."""

    names: tuple[str, ...]
    rest: tuple[tuple[str, Any], ...]
    positional: int
    known: frozenset[str]


def _plain_parameters(signature: inspect.Signature) -> _Plain | None:
    params = list(signature.parameters.values())
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    if not all(p.kind in named for p in params):
        return None
    names = tuple(p.name for p in params)
    positional = sum(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params)
    rest = tuple((p.name, p.default) for p in params)
    return _Plain(names, rest, positional, frozenset(names))


# What `_Decorated.resolve` gives: scope, payload, conn, codec and renew_every, as
# `_Guard._begun` takes them.
Resolved = tuple[Scope, Any, Any, Codec, float | timedelta | None]


class _Decorated:
    """How a decorated function's arguments give key, payload, principal and connection."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        key: str | Callable[..., str],
        operation: str | None,
        payload: Callable[..., Any] | None,
        principal: str | Callable[..., str],
        conn: str | None,
        serializer: Serializer | None,
        renew_every: float | timedelta | None,
    ) -> None:
        self.signature = inspect.signature(fn)
        self._plain = _plain_parameters(self.signature)
        for name in (key, conn):
            if isinstance(name, str) and name not in self.signature.parameters:
                raise ConfigurationError(f"{fn.__qualname__} has no parameter {name!r}")
        self.key = key
        self.operation = operation or f"{fn.__module__}.{fn.__qualname__}"
        self.payload = payload
        self.principal = principal
        self.conn = conn
        self.serializer = serializer or return_serializer(fn)
        self.renew_every = renew_every
        self._codec: tuple[Policy, FunctionCodec] | None = None

    def arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Each parameter's argument, defaults applied, in the signature's order: what
        ``Signature.bind`` and ``apply_defaults`` give, which cost a guarded call more than
        its reservation's Python. Matched here when every parameter is named (no ``*args``,
        ``**kwargs`` or positional-only ones); any call this cannot match (a missing, an
        unknown or a repeated argument) goes to ``bind``, which raises as Python would.

        >>> def pay(order_id, amount=1, *, note=""): ...
        >>> _Decorated(pay, key="order_id", operation=None, payload=None, principal="",
        ...            conn=None, serializer=None, renew_every=None).arguments(("o-1",), {})
        {'order_id': 'o-1', 'amount': 1, 'note': ''}
        """
        plain = self._plain
        if plain is not None and len(args) <= plain.positional:
            named = dict(zip(plain.names, args, strict=False))  # the first len(args) names
            used = len(named)
            for name, default in plain.rest[used:]:
                value = kwargs.get(name, default)
                if value is _MISSING:
                    break
                named[name] = value
            else:
                if not kwargs or (
                    kwargs.keys() <= plain.known and kwargs.keys().isdisjoint(plain.names[:used])
                ):
                    return named
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def codec(self, policy: Policy) -> FunctionCodec:
        """The calls' codec under ``policy``: made once per policy, as it holds nothing of a
        call's (a guard's policy may be replaced after decorating)."""
        made = self._codec
        if made is None or made[0] is not policy:
            made = self._codec = (
                policy,
                FunctionCodec(self.serializer or policy.serializer, policy.fail_on),
            )
        return made[1]

    def resolve(self, args: Any, kwargs: Any, policy: Policy) -> Resolved:
        """The call's `_Guard._begun` arguments, in order, up to its mode."""
        named = self.arguments(args, kwargs)
        key = named[self.key] if isinstance(self.key, str) else self.key(*args, **kwargs)
        if self.payload is not None:
            payload = self.payload(*args, **kwargs)
        elif self.conn is None:
            payload = named  # a dict of the call's own: every argument
        else:
            payload = {name: value for name, value in named.items() if name != self.conn}
        principal = (
            self.principal if isinstance(self.principal, str) else self.principal(*args, **kwargs)
        )
        conn = named[self.conn] if self.conn else None
        scope = Scope(principal, self.operation, validate_key(key))
        return scope, payload, conn, self.codec(policy), self.renew_every


OnceT = TypeVar("OnceT", bound=_Pending[Any])
BegunT = TypeVar("BegunT")


class _Guard(Generic[OnceT, BegunT]):
    """What `Idempotency` and `AsyncIdempotency` share: everything but the I/O driver."""

    _once: Callable[..., OnceT]
    _leased: type[Verbs]
    _capability: type[Any]

    def __init__(
        self,
        store: Any,
        policy: Policy | None = None,
        *,
        observers: Iterable[Observer] = (),
        reveal_keys: bool = False,
        encryption: KeyRing | None = None,
    ) -> None:
        if encryption is not None and not isinstance(encryption, KeyRing):
            raise ConfigurationError(
                f"encryption= takes an idempo.encryption.KeyRing, not {type(encryption).__name__}"
            )
        self.encryption = encryption
        self.store = store
        self.policy = policy or Policy()
        # Checked once: a runtime Protocol check costs more than a round trip's worth of
        # Python on every call.
        self._binds = isinstance(store, self._capability)
        self.observers: tuple[Observer, ...] = tuple(observers)
        self.reveal_keys = reveal_keys
        self.store_name = type(store).__name__
        # Decided once, as the capability: every call is observed when someone listens,
        # which includes a DEBUG logger for the guard's layers (the normal path's decisions
        # are logged at DEBUG). Refusals and faults are reported either way.
        self._observing = bool(self.observers) or _debugging()
        self._dormant = dormancy(self.observers) if not _debugging() else None

    def _emitter(self, scope: Scope, surface: str) -> Emitter:
        return Emitter(
            self.observers,
            operation=scope.operation,
            key=scope.key,
            store=self.store_name,
            surface=surface,
            reveal=self.reveal_keys,
        )

    def notify(
        self,
        kind: Kind,
        *,
        key: str,
        operation: str,
        surface: Surface,
        error: BaseException | None = None,
    ) -> None:
        """Report a decision an integration made around this guard (an HTTP middleware
        failing open, `Kind.FAIL_OPEN`) to its observers and its layer's logger.

        >>> from idempo.events import key_digest
        >>> from idempo.stores.memory import MemoryStore
        >>> seen = []
        >>> idem = Idempotency(MemoryStore(), observers=[seen.append])
        >>> idem.notify(Kind.FAIL_OPEN, key="k-1", operation="POST /pay", surface="http")
        >>> seen[0].kind, seen[0].key_digest == key_digest("k-1"), seen[0].key
        (<Kind.FAIL_OPEN: 'fail_open'>, True, None)
        """
        self._emitter(Scope("", operation, key), surface).emit(kind, error=error)

    @property
    def joins_transactions(self) -> bool:
        """Whether the store can run a call in the app's transaction (``conn=``): the SQL
        stores can; Redis, the memory store and the cache cannot."""
        return self._binds

    def once(
        self,
        key: str,
        *,
        operation: str,
        payload: Any = b"",
        principal: str = "",
        conn: Any = None,
        mode: Mode = "transactional",
        serializer: Serializer | None = None,
        codec: Codec | None = None,
        renew_every: float | timedelta | None = None,
        surface: Surface = "function",
    ) -> OnceT:
        """Guard a block: it runs once per scope; retries get ``attempt.result`` replayed.

        Use ``with`` on `Idempotency`, ``async with`` on `AsyncIdempotency`. The key is
        reserved on entering the block; `begin` does the same in two phases.

        Args:
            key: the idempotency key, minted once per intent by the caller.
            operation: what is being done (scopes the key).
            payload: what was asked; a retry with the same key and another payload raises
                `FingerprintMismatchError`. JSON data, dataclasses, pydantic models or bytes.
            principal: who asked (scopes the key); ``""`` for anonymous.
            conn: the app's database connection (psycopg, sqlite3, SQLAlchemy session). The
                guard then owns its transaction: it begins it and commits it when the block
                succeeds, together with the record.
            mode: with ``conn``: ``"transactional"`` (reservation, writes and record commit
                together) or ``"leased"`` (the reservation commits first, visible at once).
            serializer: overrides the policy's for this call.
            codec: for integrations (HTTP, consumers): how the block's result becomes a stored
                outcome and a record becomes a replay. Replaces ``serializer`` and
                ``policy.fail_on``.
            renew_every: for work that may outlast ``policy.lease``: renew the lease this
                often (seconds or a timedelta, shorter than the lease) while the block runs.
                A refused renewal means another attempt took the key over: the attempt is
                marked ``lease_lost`` and its next ``renew()`` raises `FencedError`; on
                `AsyncIdempotency` the block's task is also cancelled and the block raises
                `FencedError`. Not needed in transactional mode, where the row lock holds
                the key.
            surface: for integrations: the surface the call comes from, as observers see
                it (`idempo.events.Event.surface`): ``"http"``, ``"consumer"``...

        Raises:
            FingerprintMismatchError: the key was used with another payload.
            RequestInProgressError: another attempt holds the key (after ``policy.wait``).
            ReplayedFailureError: the first execution failed deterministically.
            FencedError: (on leaving the block) the lease was lost to another attempt.
        """
        codec = codec or FunctionCodec(serializer or self.policy.serializer, self.policy.fail_on)
        scope = Scope(principal, operation, validate_key(key))  # `Scope.of`, inlined
        return self._begun(scope, payload, conn, codec, renew_every, mode, surface)

    def _begun(
        self,
        scope: Scope,
        payload: Any,
        conn: Any,
        codec: Codec,
        renew_every: float | timedelta | None,
        mode: Mode,
        surface: Surface = "function",
    ) -> OnceT:
        """`once`, its arguments given in order and its key in its `Scope`, validated (a
        decorated function's calls and the HTTP lifecycle's: keywords cost them more than
        the rest of this)."""
        unit = self._unit(conn, mode)
        if self.encryption is not None:
            codec = SealedCodec(codec, self.encryption, scope)  # sealed for this scope only
        every = None
        if renew_every is not None:
            held = conn is not None and mode == "transactional"
            every = self._renewal_period(renew_every, held=held)
        return self._once(unit, scope, payload, self.policy, codec, every, self, surface)

    def begin(
        self,
        key: str,
        *,
        operation: str,
        payload: Any = b"",
        principal: str = "",
        conn: Any = None,
        mode: Mode = "transactional",
        serializer: Serializer | None = None,
        codec: Codec | None = None,
        renew_every: float | timedelta | None = None,
        surface: Surface = "function",
    ) -> BegunT:
        """Reserve the key now and return the `Handle` (``await`` it on `AsyncIdempotency`:
        an `AsyncHandle`); end the call with ``handle.finish(result)`` or
        ``handle.abort(exc)``. For integrations whose work does not fit in one ``with``
        block. The arguments, and what is raised, are those of `once`.

            handle = idem.begin(key, operation="charge", payload=order)
            if not handle.attempt.replayed:
                try:
                    result = charge(order)
                except BaseException as exc:
                    handle.abort(exc)        # releases the key, or records the failure
                    raise
                handle.finish(result)        # stores it; may raise FencedError
            return handle.attempt.result
        """
        once = self.once(
            key,
            operation=operation,
            payload=payload,
            principal=principal,
            conn=conn,
            mode=mode,
            serializer=serializer,
            codec=codec,
            renew_every=renew_every,
            surface=surface,
        )
        begun: BegunT = once._begin()
        return begun

    def _renewal_period(self, every: float | timedelta | None, *, held: bool) -> float | None:
        if every is None:
            return None
        seconds = every.total_seconds() if isinstance(every, timedelta) else float(every)
        if not 0 < seconds < self.policy.lease.total_seconds():
            raise ConfigurationError(
                f"renew_every must be positive and shorter than the lease"
                f" ({self.policy.lease.total_seconds():g} s), not {seconds:g} s"
            )
        return None if held else seconds  # the row lock holds the key until the commit

    def _unit(self, conn: Any, mode: Mode) -> Any:
        if conn is None:
            # A store used directly: it takes operations itself (SQL, cached stores), or its
            # verbs do (nothing of the work runs on it, so there is nothing to discard).
            # Made once per store: it holds nothing of a call's.
            direct = self.__dict__.get("_direct")
            if direct is None or direct[0] is not self.store:
                direct = self.__dict__["_direct"] = (
                    self.store,
                    performer(self.store, self._leased),
                )
            return direct[1]
        if not self._binds:
            raise ConfigurationError(
                f"{type(self.store).__name__} cannot join the app's transaction"
            )
        binder = cast(Any, self.store)
        unit = binder.bind(conn, mode=mode, lock_timeout=self.policy.lock_timeout)
        # A unit that takes operations itself (idempo's SQL units) goes as it is; another
        # (a user's store's) through the table of verbs. Tested inline: this is per call.
        return unit if hasattr(type(unit), "perform") else Verbs(unit)

    def _idempotent(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        key: str | Callable[..., str],
        operation: str | None = None,
        payload: Callable[..., Any] | None = None,
        principal: str | Callable[..., str] = "",
        conn: str | None = None,
        mode: Mode = "transactional",
        serializer: Serializer | None = None,
        renew_every: float | timedelta | None = None,
    ) -> Any:
        """Decorate a function (``async def`` on `AsyncIdempotency`) so it runs once per key
        and replays its return value. The decorated function keeps its signature and return
        type for type checkers (``mypy --strict``).

        Args:
            key: the parameter that holds the key, or a function of the arguments.
            operation: defaults to the function's qualified name.
            payload: a function of the arguments giving what to fingerprint; by default all
                arguments but ``conn``.
            principal: a fixed principal, or a function of the arguments.
            conn: the parameter that holds the app's connection: run in its transaction.
            mode: see `once`.
            serializer: defaults to a typed one when the return annotation says more than
                plain JSON (a dataclass, a pydantic model, a list of them), else the policy's.
            renew_every: see `once`: keep the lease alive while a long call runs.
        """

        def decorate(func: Callable[..., Any]) -> Callable[..., Any]:
            spec = _Decorated(
                func,
                key=key,
                operation=operation,
                payload=payload,
                principal=principal,
                conn=conn,
                serializer=serializer,
                renew_every=renew_every,
            )
            wrapper = functools.wraps(func)(self._wrap(func, spec, mode))
            wrapper.idempotency = self  # type: ignore[attr-defined]
            return wrapper

        return decorate(fn) if fn is not None else decorate

    def _wrap(self, func: Callable[..., Any], spec: _Decorated, mode: Mode) -> Callable[..., Any]:
        raise NotImplementedError


class Idempotency(_Guard[_Once[Any], Handle[Any]]):
    """Runs work once per scope against a synchronous store and replays its result.

    Args:
        store: where records live (`open_store`).
        policy: leases, retention, serialization and failure rules; defaults to `Policy()`.
        observers: callables told of every decision (`idempo.events.Event`): executed,
            replayed, refused, fenced... (`idempo.otel.OpenTelemetryObserver` makes spans
            and metrics of them). With none, a call builds no event.
        reveal_keys: put raw keys in events and log lines; by default they carry
            `idempo.events.key_digest` only.
        encryption: an `idempo.encryption.KeyRing`: every stored result and recovery point
            is sealed with AES-256-GCM and bound to its scope (docs/data-at-rest.md). A
            record it cannot open raises `UndecryptableRecordError`: never replayed, never
            run again.

    >>> from idempo.stores.memory import MemoryStore
    >>> idem = Idempotency(MemoryStore())
    >>> calls = []
    >>> @idem.idempotent(key="order_id")
    ... def charge(order_id: str, amount: int) -> int:
    ...     calls.append(order_id)
    ...     return amount
    >>> charge("o-1", 5), charge("o-1", 5), len(calls)
    (5, 5, 1)
    """

    _once = _Once
    _leased = StoreVerbs
    _capability = TransactionalStore

    def __init__(
        self,
        store: Store,
        policy: Policy | None = None,
        *,
        observers: Iterable[Observer] = (),
        reveal_keys: bool = False,
        encryption: KeyRing | None = None,
    ) -> None:
        super().__init__(
            store, policy, observers=observers, reveal_keys=reveal_keys, encryption=encryption
        )

    @overload
    def idempotent(
        self, fn: Callable[P, R], **options: Unpack[IdempotentOptions]
    ) -> Callable[P, R]: ...
    @overload
    def idempotent(
        self, fn: None = None, **options: Unpack[IdempotentOptions]
    ) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
    def idempotent(self, fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        return self._idempotent(fn, **options)

    idempotent.__doc__ = _Guard._idempotent.__doc__

    def _wrap(self, func: Callable[P, R], spec: _Decorated, mode: Mode) -> Callable[P, R]:
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            with self._begun(*spec.resolve(args, kwargs, self.policy), mode) as attempt:
                if not attempt.replayed:
                    attempt.result = func(*args, **kwargs)
            result: R = attempt.result
            return result

        return wrapper


class AsyncIdempotency(_Guard[_AsyncOnce[Any], Coroutine[Any, Any, AsyncHandle[Any]]]):
    """The asynchronous twin of `Idempotency`, for an `AsyncStore` and ``async def`` work.

    >>> import asyncio
    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> idem = AsyncIdempotency(AsyncMemoryStore())
    >>> @idem.idempotent(key="event_id")
    ... async def handle(event_id: str) -> str:
    ...     return "done"
    >>> asyncio.run(handle("e-1"))
    'done'
    """

    _once = _AsyncOnce
    _leased = AsyncStoreVerbs
    _capability = AsyncTransactionalStore

    def __init__(
        self,
        store: AsyncStore,
        policy: Policy | None = None,
        *,
        observers: Iterable[Observer] = (),
        reveal_keys: bool = False,
        encryption: KeyRing | None = None,
    ) -> None:
        super().__init__(
            store, policy, observers=observers, reveal_keys=reveal_keys, encryption=encryption
        )

    @overload
    def idempotent(
        self, fn: Callable[P, Awaitable[R]], **options: Unpack[IdempotentOptions]
    ) -> Callable[P, Coroutine[Any, Any, R]]: ...
    @overload
    def idempotent(
        self, fn: None = None, **options: Unpack[IdempotentOptions]
    ) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Coroutine[Any, Any, R]]]: ...
    def idempotent(self, fn: Callable[..., Any] | None = None, **options: Any) -> Any:
        return self._idempotent(fn, **options)

    idempotent.__doc__ = _Guard._idempotent.__doc__

    def _wrap(
        self, func: Callable[P, Awaitable[R]], spec: _Decorated, mode: Mode
    ) -> Callable[P, Coroutine[Any, Any, R]]:
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            async with self._begun(*spec.resolve(args, kwargs, self.policy), mode) as attempt:
                if not attempt.replayed:
                    attempt.result = await func(*args, **kwargs)
            result: R = attempt.result
            return result

        return wrapper
