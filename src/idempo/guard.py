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
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import operator
import typing
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any, Generic, Literal, TypeVar, cast

from ._core.fingerprint import fingerprint
from ._core.flow import Codec, Done, Execute, Flow, apump, guarded_call, outlasting, pump
from ._core.keys import Scope
from ._core.record import Record, Status
from ._core.renewal import Renewal, ThreadRenewal
from ._http import evict_hint
from .errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    IdempotencyError,
    ReplayedFailureError,
)
from .policy import Policy
from .serializers import Serializer, TypedSerializer
from .stores.base import AsyncStore, AsyncTransactionalStore, Mode, Store, TransactionalStore

__all__ = ["AsyncAttempt", "AsyncIdempotency", "Attempt", "Idempotency"]

_logger = logging.getLogger("idempo")


class _FunctionCodec:
    """Return values are completions; exceptions release, unless the policy names them."""

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
        try:
            if record.status is not Status.FAILED:
                return self.serializer.loads(record.response or b"null")
            failure = json.loads(record.response or b"{}")
            error, detail = str(failure.get("error", "?")), str(failure.get("detail", ""))
        except Exception as exc:
            # Nothing runs and nothing is replayed until an operator evicts the record.
            raise CorruptRecordError(
                f"the stored {record.status.value} record of key {record.scope.key!r} cannot"
                f" be decoded ({type(exc).__name__}: {exc}); evict it:"
                f" {evict_hint(record.scope)}"
            ) from exc
        raise ReplayedFailureError(error, detail)


class Attempt:
    """What a guarded block works with.

    Attributes:
        scope: the (principal, operation, key) this attempt runs under.
        replayed: True if the work already ran; ``result`` then holds its stored result and
            the block must not do the work again.
        result: set it to the work's result before leaving the block; it is stored and
            replayed to every retry.
        token: this attempt's fencing token (None on a replay).
        recovery_point: the last step a previous, taken-over attempt recorded, if any.
        lease_lost: True once a renewal was refused (a background one included): another
            attempt took the key over and this one's outcome will be refused. Long work
            checks it, or calls `renew`, before each step it cannot take back.
    """

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
        self.recovery_point = recovery_point
        self._renew: Callable[[], Any] | None = None
        self._lost: FencedError | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.scope.key!r} replayed={self.replayed}>"

    @property
    def lease_lost(self) -> bool:
        return self._lost is not None

    def renew(self) -> None:
        """Extend this attempt's lease (long work). Raises `FencedError` if it was lost: at
        once, with no round trip, once any renewal found it lost."""
        self._check_lease()
        if self._renew is not None:
            try:
                self._renew()
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


class AsyncAttempt(Attempt):
    """The asynchronous twin of `Attempt`: ``await attempt.renew()``."""

    async def renew(self) -> None:  # type: ignore[override]
        self._check_lease()
        if self._renew is not None:
            try:
                await outlasting(self._renew())
            except FencedError as exc:
                self._lose(exc)
                raise


class _Call:
    """What one guarded block needs, before any I/O: shared by the sync and async twins."""

    def __init__(
        self,
        unit: Any,
        scope: Scope,
        payload: Any,
        policy: Policy,
        codec: Codec,
        attempt_class: type[Attempt],
        renew_every: float | None = None,
    ) -> None:
        self.unit = unit
        self.scope = scope
        self.policy = policy
        self.codec = codec
        self.renew_every = renew_every
        self.flow: Flow = guarded_call(scope, fingerprint(payload), policy, self.codec)
        self.attempt_class = attempt_class
        self.attempt: Attempt | None = None
        self.token = 0

    def replayed(self, record: Record) -> Attempt:
        self.attempt = self.attempt_class(
            self.scope, replayed=True, result=self.codec.decode(record)
        )
        return self.attempt

    def executing(self, execute: Execute) -> Attempt:
        attempt = self.attempt_class(
            self.scope,
            replayed=False,
            token=execute.token,
            recovery_point=execute.recovery_point,
        )
        self.token = execute.token
        attempt._renew = self._renew
        self.attempt = attempt
        return attempt

    def _renew(self) -> Any:
        policy = self.policy
        return self.unit.renew(self.scope, self.token, now=policy.now(), lease=policy.lease)

    def started(self, step: Execute | Done) -> Attempt:
        """The attempt a block works with: executing, or replaying the record the flow found."""
        if isinstance(step, Execute):
            return self.executing(step)
        assert step.record is not None, "the flow ended before the work with nothing to replay"
        return self.replayed(step.record)

    def resume(self, exc: BaseException | None) -> Any:
        """The first operation after the block: its result, or its exception thrown in."""
        if exc is not None:
            return self.flow.throw(exc)
        assert self.attempt is not None
        return self.flow.send(self.attempt.result)


class _Once:
    """Context manager returned by `Idempotency.once`."""

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._renewal: ThreadRenewal | None = None

    def __enter__(self) -> Attempt:
        call = self._call
        attempt = call.started(pump(call.flow, call.unit, call.policy, next(call.flow)))
        if call.renew_every is not None and not attempt.replayed:
            self._renewal = ThreadRenewal(attempt, call.renew_every, _logger)
            self._renewal.start()
        return attempt

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        call = self._call
        if call.attempt is None or call.attempt.replayed:
            return False
        if self._renewal is not None:
            self._renewal.stop()  # a lost lease marked the attempt; its outcome is fenced
        try:
            step = pump(call.flow, call.unit, call.policy, call.resume(exc))
        except BaseException as raised:
            if raised is exc:
                return False
            raise
        if isinstance(step, Done):
            return False
        raise AssertionError("the flow asked to execute twice")


class _AsyncOnce:
    """Async context manager returned by `AsyncIdempotency.once`."""

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._renewal: Renewal | None = None

    async def __aenter__(self) -> AsyncAttempt:
        call = self._call
        step = await apump(call.flow, call.unit, call.policy, next(call.flow))
        attempt = cast(AsyncAttempt, call.started(step))
        if call.renew_every is not None and not attempt.replayed:
            # Started in the task that runs the block: a lost lease cancels that task.
            self._renewal = Renewal(attempt, call.renew_every, _logger)
            self._renewal.start()
        return attempt

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        call = self._call
        if call.attempt is None or call.attempt.replayed:
            return False
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
                call.flow, call.unit, call.policy, call.resume(ended), cancelled=cancelled
            )
        except BaseException as raised:
            if raised is exc:
                return False
            raise
        if isinstance(step, Done):
            if ended is not exc and ended is not None:
                raise ended
            return False
        raise AssertionError("the flow asked to execute twice")


def _forward(verb: str) -> Any:
    return property(operator.attrgetter(f"_store.{verb}"))


class _Leased:
    """A store used directly: none of the work runs on it, so there is nothing to discard."""

    def __init__(self, store: Any) -> None:
        self._store = store

    # The verbs are forwarded by name: __getattr__ alone would fail a lookup first, which
    # costs more than the memory store's verb itself.
    reserve = _forward("reserve")
    complete = _forward("complete")
    fail = _forward("fail")
    release = _forward("release")
    renew = _forward("renew")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def discard(self) -> bool:
        return False  # the work's effects are its own, out of any transaction of idempo's


class _AsyncLeased(_Leased):
    async def discard(self) -> bool:  # type: ignore[override]
        return False


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
        for name in (key, conn):
            if isinstance(name, str) and name not in self.signature.parameters:
                raise ConfigurationError(f"{fn.__qualname__} has no parameter {name!r}")
        self.key = key
        self.operation = operation or f"{fn.__module__}.{fn.__qualname__}"
        self.payload = payload
        self.principal = principal
        self.conn = conn
        self.serializer = serializer or _serializer_for(fn)
        self.renew_every = renew_every

    def resolve(self, args: Any, kwargs: Any) -> dict[str, Any]:
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        named = bound.arguments
        key = named[self.key] if isinstance(self.key, str) else self.key(*args, **kwargs)
        if self.payload is not None:
            payload = self.payload(*args, **kwargs)
        else:
            payload = {name: value for name, value in named.items() if name != self.conn}
        principal = (
            self.principal if isinstance(self.principal, str) else self.principal(*args, **kwargs)
        )
        return {
            "key": key,
            "operation": self.operation,
            "payload": payload,
            "principal": principal,
            "conn": named[self.conn] if self.conn else None,
            "serializer": self.serializer,
            "renew_every": self.renew_every,
        }


def _serializer_for(fn: Callable[..., Any]) -> Serializer | None:
    """A typed serializer when the return annotation says more than "JSON": dataclasses,
    pydantic models, and containers of them come back as what the function returned."""
    try:
        hint = typing.get_type_hints(fn).get("return")
    except (NameError, TypeError):
        return None
    if hint in (None, type(None), object, Any) or hint in _PLAIN_JSON:
        return None
    try:
        return TypedSerializer(hint)
    except Exception:  # noqa: BLE001 - no pydantic, or a type it cannot describe: plain JSON
        return None


_PLAIN_JSON = (str, int, float, bool, dict, list)


OnceT = TypeVar("OnceT", _Once, _AsyncOnce)


class _Guard(Generic[OnceT]):
    """What `Idempotency` and `AsyncIdempotency` share: everything but the I/O driver."""

    _once: Callable[[_Call], OnceT]
    _attempt: type[Attempt]
    _leased: type[_Leased]
    _capability: type[Any]

    def __init__(self, store: Any, policy: Policy | None = None) -> None:
        self.store = store
        self.policy = policy or Policy()
        # Checked once: a runtime Protocol check costs more than a round trip's worth of
        # Python on every call.
        self._binds = isinstance(store, self._capability)

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
    ) -> OnceT:
        """Guard a block: it runs once per scope; retries get ``attempt.result`` replayed.

        Use ``with`` on `Idempotency`, ``async with`` on `AsyncIdempotency`.

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

        Raises:
            FingerprintMismatchError: the key was used with another payload.
            RequestInProgressError: another attempt holds the key (after ``policy.wait``).
            ReplayedFailureError: the first execution failed deterministically.
            FencedError: (on leaving the block) the lease was lost to another attempt.
        """
        scope = Scope.of(key, operation=operation, principal=principal)
        unit = self._unit(conn, mode)
        codec = codec or _FunctionCodec(serializer or self.policy.serializer, self.policy.fail_on)
        every = self._renewal_period(renew_every, held=conn is not None and mode == "transactional")
        return self._once(_Call(unit, scope, payload, self.policy, codec, self._attempt, every))

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
            return self._leased(self.store)
        if not self._binds:
            raise ConfigurationError(
                f"{type(self.store).__name__} cannot join the app's transaction"
            )
        binder = cast(Any, self.store)
        return binder.bind(conn, mode=mode, lock_timeout=self.policy.lock_timeout)

    def idempotent(
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
        and replays its return value.

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


class Idempotency(_Guard[_Once]):
    """Runs work once per scope against a synchronous store and replays its result.

    Args:
        store: where records live (`open_store`).
        policy: leases, retention, serialization and failure rules; defaults to `Policy()`.

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
    _attempt = Attempt
    _leased = _Leased
    _capability = TransactionalStore

    def __init__(self, store: Store, policy: Policy | None = None) -> None:
        super().__init__(store, policy)

    def _wrap(self, func: Callable[..., Any], spec: _Decorated, mode: Mode) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.once(**spec.resolve(args, kwargs), mode=mode) as attempt:
                if not attempt.replayed:
                    attempt.result = func(*args, **kwargs)
            return attempt.result

        return wrapper


class AsyncIdempotency(_Guard[_AsyncOnce]):
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
    _attempt = AsyncAttempt
    _leased = _AsyncLeased
    _capability = AsyncTransactionalStore

    def __init__(self, store: AsyncStore, policy: Policy | None = None) -> None:
        super().__init__(store, policy)

    def _wrap(self, func: Callable[..., Any], spec: _Decorated, mode: Mode) -> Callable[..., Any]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            async with self.once(**spec.resolve(args, kwargs), mode=mode) as attempt:
                if not attempt.replayed:
                    attempt.result = await func(*args, **kwargs)
            return attempt.result

        return wrapper
