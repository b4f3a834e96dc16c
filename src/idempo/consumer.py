"""Message consumers: a handler's effect happens once, however often the broker delivers.

This is the broker-neutral core. An adapter (`idempo.contrib.aio_pika`, a FastStream
middleware, your own loop) turns its broker's message into an `Envelope`, calls
`AsyncConsumer.process` (or the synchronous `Consumer.process`) with the handler, and carries
out the `Outcome.action` it gets back::

    consumer = AsyncConsumer(idem, name="billing.charge", horizon=timedelta(days=7),
                             connection=pool.connection)

    async def charge(delivery: Delivery[IncomingMessage]) -> dict[str, str]:
        order = json.loads(delivery.envelope.body)
        await delivery.conn.execute("INSERT INTO payments ...")  # commits with the record
        return {"charged": order["id"]}

    envelope = Envelope(id=raw.message_id, body=raw.body, timestamp=raw.timestamp)
    outcome = await consumer.process(raw, envelope, charge)
    match outcome.action:
        case Action.ACK: ...            # handled now, or already: acknowledge
        case Action.REQUEUE: ...        # not handled: redeliver in outcome.delay seconds
        case Action.DEAD_LETTER: ...    # refused: route it to the dead-letter queue

The event id (``Envelope.id``) is the key, the consumer's ``name`` the operation, an optional
``principal`` (a tenant, a consumer group) the rest of the scope, and the fingerprint is the
body's SHA-256: an id reused with another body is refused, never executed.

===================  ==========================================================  ============
Reason               when                                                        Action
===================  ==========================================================  ============
``EXECUTED``         the handler ran and its outcome was recorded                ACK
``DUPLICATE``        the id was already handled (completed or failed)            ACK
``IN_PROGRESS``      another delivery of the id is being handled right now       REQUEUE
``TRANSIENT``        the handler raised an exception not named deterministic     REQUEUE
``UNAVAILABLE``      the store or the app's database could not be reached        REQUEUE
``FENCED``           the handler outlived its lease and lost the key             REQUEUE
``FAILED``           the handler raised a deterministic exception (recorded)     ``on_failure``
``NO_KEY``           the message has no id (and ``key_from_body`` is off)        DEAD_LETTER
``INVALID_KEY``      the id is not 1-255 printable ASCII characters              DEAD_LETTER
``MISMATCH``         the id was first used with another body                     DEAD_LETTER
``EXPIRED``          the message is older than the retention (horizon guard)     ``on_expired``
===================  ==========================================================  ============

Every outcome is counted in ``consumer.counts`` and logged on the ``idempo.consumer`` logger
(refusals, fenced holders and store failures at ERROR, requeues and failures at WARNING),
with the message id as its `idempo.events.key_digest`.

Two modes, as for the function API (docs/transactions.md):

* ``connection=`` (a factory of async context managers: ``pool.connection``,
  ``async_sessionmaker``): each message gets a connection; in the default
  ``mode="transactional"`` the reservation, the handler's writes and the record commit in one
  transaction on it (the inbox pattern). ``mode="leased"`` commits the reservation first and
  the writes with the fenced outcome at the end; the lease is renewed while the handler runs.
* no ``connection``: the record lives on the store's own connections (leased, renewed).

The horizon guard: ``horizon`` is the longest time after publication at which the broker may
still deliver a message (the dead-letter redrive window, the stream's retention). A policy
``ttl`` shorter than it is a `ConfigurationError` when the consumer is made; a message whose
``timestamp`` is older than the ``ttl`` is not executed (its record may be gone, so a
duplicate could not be recognised): it is counted, logged and dead-lettered by default.

API for adapters:

* ``Envelope(id, body, timestamp=None)``: what the core needs of a broker message.
* ``AsyncConsumer(idempotency, *, name, horizon, ...)``; ``await .process(message, envelope,
  handler) -> Outcome``; ``Consumer`` is the synchronous twin.
* ``Delivery[M]``: what a handler gets: ``message`` (the adapter's own), ``envelope``,
  ``key``, ``conn`` (None without ``connection=``) and ``attempt``.
* `current_delivery`: the delivery being handled, for handlers whose signature belongs to a
  framework (a middleware calls the framework; the handler reads the connection from here).
* ``Outcome(reason, action, key, delay, result, error)``; ``Action``; ``Reason``.

.. versionadded:: 0.1
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import (
    AbstractAsyncContextManager,
    AbstractContextManager,
    AsyncExitStack,
    ExitStack,
)
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any, Generic, Literal, TypeVar

from ._core.keys import validate_key
from ._core.record import Record, Status
from .encryption import refuse_sealed
from .errors import (
    ConfigurationError,
    FencedError,
    FingerprintMismatchError,
    InvalidKeyError,
    ReplayedFailureError,
    RequestInProgressError,
    StoreError,
    TransactionOwnershipError,
)
from .events import key_digest, scrub
from .guard import AsyncHandle, AsyncIdempotency, Attempt, FunctionCodec, Handle, Idempotency
from .serializers import Serializer
from .stores.base import Mode

__all__ = [
    "Action",
    "AsyncConsumer",
    "Consumer",
    "Delivery",
    "Envelope",
    "Outcome",
    "Reason",
    "body_key",
    "current_delivery",
]

logger = logging.getLogger("idempo.consumer")

M = TypeVar("M")


class Action(StrEnum):
    """What the adapter tells the broker."""

    ACK = "ack"
    """Acknowledge: the message is handled (now or before) and must not come back."""
    REQUEUE = "requeue"
    """Give it back for redelivery after ``Outcome.delay`` seconds (nack with requeue)."""
    DEAD_LETTER = "dead_letter"
    """Refuse it without requeue, so the broker routes it to the dead-letter queue."""


class Reason(StrEnum):
    """Why a message got its action (the table in the module docstring)."""

    EXECUTED = "executed"
    DUPLICATE = "duplicate"
    IN_PROGRESS = "in_progress"
    TRANSIENT = "transient"
    UNAVAILABLE = "unavailable"
    FENCED = "fenced"
    FAILED = "failed"
    NO_KEY = "no_key"
    INVALID_KEY = "invalid_key"
    MISMATCH = "mismatch"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class Envelope:
    """What the core needs to know of a broker message.

    Args:
        id: the producer's event id (AMQP ``message_id``, ``Nats-Msg-Id``, a Kafka header),
            minted once per event and the same on every copy; None or ``""`` if it has none.
        body: the raw body; its SHA-256 is the fingerprint.
        timestamp: when the producer published it (aware; a naive one is taken as UTC), for
            the horizon guard; None skips that check.
    """

    id: str | None
    body: bytes
    timestamp: datetime | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """What happened to one message and what the broker should do with it.

    Attributes:
        reason: why.
        action: what to tell the broker.
        key: the key the message was handled under (None if it had none usable).
        delay: with REQUEUE, seconds to wait before the message should come back.
        result: the handler's result (EXECUTED) or the stored one (DUPLICATE of a completed
            message).
        error: the exception behind a failure or a refusal, if there was one.
    """

    reason: Reason
    action: Action
    key: str | None
    delay: float = 0.0
    result: Any = None
    error: BaseException | None = None


@dataclass(frozen=True, slots=True)
class Delivery(Generic[M]):
    """What a handler gets for one message it is to handle (never for a duplicate).

    Attributes:
        message: the adapter's own message object (e.g. aio-pika's ``IncomingMessage``).
        envelope: its id, body and timestamp.
        key: the idempotency key it runs under.
        conn: the app's connection from ``connection=`` (write the effect on it), else None.
        attempt: the guard's attempt (``token``, ``renew()``); renewal is automatic.
    """

    message: M
    envelope: Envelope
    key: str
    conn: Any
    attempt: Attempt


_current: ContextVar[Delivery[Any] | None] = ContextVar("idempo_delivery", default=None)


def current_delivery() -> Delivery[Any] | None:
    """The delivery whose handler is running in this context, or None outside one.

    >>> current_delivery() is None
    True
    """
    return _current.get()


def body_key(body: bytes) -> str:
    """The key derived from a message body when ``key_from_body=True``: ``sha256:<hex>``.

    A last resort for producers that set no id: two distinct events with identical bodies
    then share one key, and the second is skipped as a duplicate.

    >>> body_key(b"{}")
    'sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a'
    """
    return "sha256:" + hashlib.sha256(body).hexdigest()


class _ConsumerCodec(FunctionCodec):
    """The function API's codec, with the consumer's idea of deterministic, and replays that
    never fail to decode (a duplicate is acknowledged whatever its stored result holds)."""

    def __init__(self, serializer: Serializer, deterministic: Callable[[BaseException], bool]):
        super().__init__(serializer, ())
        self.deterministic = deterministic

    def encode_error(self, exc: BaseException) -> tuple[Status | None, bytes]:
        if self.deterministic(exc):
            return Status.FAILED, self.encode_unstorable(exc)
        return None, b""

    def decode(self, record: Record) -> Any:
        if record.status is Status.FAILED:
            return super().decode(record)  # raises ReplayedFailureError
        response = record.response
        if response and not response[0]:  # sealed, and the guard has no key ring
            refuse_sealed(record)  # never handed back as they are
        try:
            return self.serializer.loads(response or b"null")
        except Exception:  # noqa: BLE001 - written by another serializer: hand back the bytes
            return response


# How loudly each outcome is logged: refusals, a fenced stale holder and a store failure
# need a human (ERROR), requeues and failures a look.
_LEVELS = {
    Reason.EXECUTED: logging.DEBUG,
    Reason.DUPLICATE: logging.INFO,
    Reason.IN_PROGRESS: logging.INFO,
    Reason.TRANSIENT: logging.WARNING,
    Reason.UNAVAILABLE: logging.ERROR,
    Reason.FENCED: logging.ERROR,
    Reason.FAILED: logging.WARNING,
    Reason.NO_KEY: logging.ERROR,
    Reason.INVALID_KEY: logging.ERROR,
    Reason.MISMATCH: logging.ERROR,
    Reason.EXPIRED: logging.ERROR,
}

_WHY = {
    Reason.EXECUTED: "handled",
    Reason.DUPLICATE: "already handled: a duplicate, skipped",
    Reason.IN_PROGRESS: "being handled by another delivery right now",
    Reason.TRANSIENT: "the handler failed (transient); the key is released for a retry",
    Reason.UNAVAILABLE: "the store or the app's database is unavailable; nothing ran",
    Reason.FENCED: "the handler outlived its lease and lost the key; its outcome was refused",
    Reason.FAILED: "the handler failed deterministically; the failure is recorded",
    Reason.NO_KEY: (
        "the message has no id, so a redelivery could not be recognised; refused (set an "
        "event id on the producer, or opt into key_from_body)"
    ),
    Reason.INVALID_KEY: "its id is not 1-255 printable ASCII characters; refused",
    Reason.MISMATCH: "its id was first used with another body: a producer bug; not executed",
    Reason.EXPIRED: (
        "it is older than the retention, so its record may be gone and a duplicate could "
        "not be recognised; not executed (horizon guard)"
    ),
}

FailureAction = Literal["ack", "dead_letter"]


class _Consumer:
    """Configuration and the pure half of processing, shared by the twins."""

    def __init__(
        self,
        idempotency: AsyncIdempotency | Idempotency,
        *,
        name: str,
        horizon: timedelta,
        principal: str | Callable[[Envelope], str] = "",
        connection: Callable[[], Any] | None = None,
        mode: Mode = "transactional",
        fail_on: tuple[type[BaseException], ...] | None = None,
        on_failure: FailureAction = "ack",
        on_expired: FailureAction = "dead_letter",
        key_from_body: bool = False,
        retry_delay: timedelta | float = 1.0,
        serializer: Serializer | None = None,
    ) -> None:
        policy = idempotency.policy
        if not isinstance(name, str) or not name:
            raise ConfigurationError("a consumer needs a name: it is the operation of its keys")
        if horizon < timedelta(0):
            raise ConfigurationError("the redelivery horizon cannot be negative")
        if policy.ttl < horizon:
            raise ConfigurationError(
                f"consumer {name!r}: the records' retention (Policy.ttl = {policy.ttl}) is "
                f"shorter than the broker's redelivery horizon ({horizon}); a message redelivered "
                "after its record is purged would run again. Raise the ttl to cover the horizon."
            )
        for option, value in (("on_failure", on_failure), ("on_expired", on_expired)):
            if value not in ("ack", "dead_letter"):
                raise ConfigurationError(f"{option} must be 'ack' or 'dead_letter', not {value!r}")
        if mode not in ("transactional", "leased"):
            raise ConfigurationError(f"mode must be 'transactional' or 'leased', not {mode!r}")
        if connection is not None and not idempotency.joins_transactions:
            raise ConfigurationError(
                f"{type(idempotency.store).__name__} cannot join the app's transaction;"
                " connection= needs a SQL store"
            )
        delay = retry_delay.total_seconds() if isinstance(retry_delay, timedelta) else retry_delay
        if delay < 0:
            raise ConfigurationError("retry_delay cannot be negative")
        self.idempotency = idempotency
        self.name = name
        self.horizon = horizon
        self.principal = principal
        self.connection = connection
        self.mode: Mode = mode
        self.fail_on = policy.fail_on if fail_on is None else tuple(fail_on)
        self.on_failure = Action(on_failure)
        self.on_expired = Action(on_expired)
        self.key_from_body = key_from_body
        self.retry_delay = delay
        self.codec = _ConsumerCodec(serializer or policy.serializer, self.deterministic)
        self.counts: Counter[Reason] = Counter()
        self._counting = threading.Lock()

    def deterministic(self, exc: BaseException) -> bool:
        """Whether a handler's exception is recorded as FAILED (else it is transient).

        The ``fail_on`` types, plus what is deterministic by construction: a replayed failure
        and a fingerprint mismatch (a saga step called again with other data).
        """
        return isinstance(exc, (*self.fail_on, ReplayedFailureError, FingerprintMismatchError))

    def _screen(self, envelope: Envelope) -> str | Outcome:
        """The key to run under, or the outcome of a message refused before any I/O."""
        key = envelope.id
        if not key:
            if not self.key_from_body:
                return Outcome(Reason.NO_KEY, Action.DEAD_LETTER, None)
            key = body_key(envelope.body)
        try:
            validate_key(key)
        except InvalidKeyError as exc:
            return Outcome(Reason.INVALID_KEY, Action.DEAD_LETTER, None, error=exc)
        published = envelope.timestamp
        if published is not None:
            if published.tzinfo is None:
                published = published.replace(tzinfo=UTC)
            # The publisher's clock against this host's (or the injected one): the store's
            # clock is not at hand before a reservation.
            now = self.idempotency.policy.now() or datetime.now(UTC)
            if now - published > self.idempotency.policy.ttl:
                return Outcome(Reason.EXPIRED, self.on_expired, key)
        return key

    def _begin_args(self, envelope: Envelope) -> dict[str, Any]:
        principal = self.principal if isinstance(self.principal, str) else self.principal(envelope)
        return {
            "operation": self.name,
            "payload": envelope.body,
            "principal": principal,
            "mode": self.mode,
            "codec": self.codec,
            "surface": "consumer",
            # A slow handler keeps its key; a lost lease fences it (an outcome of FENCED).
            "renew_every": self.idempotency.policy.lease / 3,
        }

    def _answered(self, reason: Reason, key: str, attempt: Attempt, envelope: Envelope) -> Outcome:
        """The outcome of a message handled now (EXECUTED) or before (DUPLICATE)."""
        return self._report(Outcome(reason, Action.ACK, key, result=attempt.result), envelope)

    def _refused(self, key: str, exc: Exception) -> Outcome:
        """The outcome when the guard would not let the handler run."""
        if isinstance(exc, ConfigurationError):
            raise exc  # a set-up the consumer cannot run with is not a message's fault
        if isinstance(exc, FingerprintMismatchError):
            return Outcome(Reason.MISMATCH, Action.DEAD_LETTER, key, error=exc)
        if isinstance(exc, RequestInProgressError):
            delay = min(exc.retry_after, self.retry_delay)
            return Outcome(Reason.IN_PROGRESS, Action.REQUEUE, key, delay=delay, error=exc)
        if isinstance(exc, ReplayedFailureError):
            return Outcome(Reason.DUPLICATE, Action.ACK, key, error=exc)
        # A store error, or the app's connection could not be opened: nothing ran.
        return self._requeue(Reason.UNAVAILABLE, key, exc)

    def _failed(self, key: str, exc: Exception) -> Outcome:
        """The outcome when the handler raised (the guard has released or recorded)."""
        if self.deterministic(exc) or isinstance(exc, TransactionOwnershipError):
            return Outcome(Reason.FAILED, self.on_failure, key, error=exc)
        if isinstance(exc, FencedError):
            return self._requeue(Reason.FENCED, key, exc)  # the lease was lost while it ran
        return self._requeue(Reason.TRANSIENT, key, exc)

    def _unrecorded(self, key: str, exc: Exception) -> Outcome:
        """The outcome when the handler returned but its outcome could not be recorded."""
        if isinstance(exc, FencedError):
            return self._requeue(Reason.FENCED, key, exc)
        if isinstance(exc, StoreError):
            return self._requeue(Reason.UNAVAILABLE, key, exc)
        # The result could not be stored (too large, not serializable): the guard recorded a
        # FAILED outcome instead, so a redelivery will not run it again.
        return Outcome(Reason.FAILED, self.on_failure, key, error=exc)

    def _requeue(self, reason: Reason, key: str, exc: Exception) -> Outcome:
        return Outcome(reason, Action.REQUEUE, key, delay=self.retry_delay, error=exc)

    def _report(self, outcome: Outcome, envelope: Envelope) -> Outcome:
        with self._counting:
            self.counts[outcome.reason] += 1
        level = _LEVELS[outcome.reason]
        if logger.isEnabledFor(level):
            # The id as its digest (`idempo.events.key_digest`) unless the guard reveals keys.
            key = outcome.key if outcome.key is not None else envelope.id
            reveal = self.idempotency.reveal_keys
            digest = key_digest(key) if key else None
            if reveal or not key:
                shown = json.dumps(key) if key else _shown_id(envelope.id)
            else:
                shown = f"#{digest}"
            error = ""
            if outcome.error is not None:
                text = str(outcome.error)
                error = f" ({type(outcome.error).__name__}: "
                error += f"{text if reveal or not key else scrub(text, key, digest)})"
            fields: dict[str, Any] = {
                "idempo_kind": outcome.reason.value,
                "idempo_outcome": outcome.reason.value,
                "idempo_action": outcome.action.value,
                "idempo_operation": self.name,
                "idempo_surface": "consumer",
                "idempo_key_digest": digest,
            }
            if reveal and key:
                fields["idempo_key"] = key
            logger.log(
                level,
                "idempo: consumer %r, message %s: %s%s -> %s",
                self.name,
                shown,
                _WHY[outcome.reason],
                error,
                outcome.action.value,
                # A transient failure's traceback is the handler's, and says where it broke.
                exc_info=outcome.error if outcome.reason is Reason.TRANSIENT else None,
                extra=fields,
            )
        return outcome


def _shown_id(message_id: str | None) -> str:
    if message_id is None:
        return "(no id)"
    return json.dumps(message_id[:80] + ("..." if len(message_id) > 80 else ""))


class AsyncConsumer(_Consumer):
    """Runs a message handler once per event id and says what to tell the broker.

    Args:
        idempotency: the guard (its store and policy: lease, ttl, clock).
        name: the consumer's name; the operation its keys are scoped to.
        horizon: the longest the broker may take to deliver a message again (dead-letter
            redrive window, stream retention). Must not exceed ``policy.ttl``.
        principal: the rest of the scope (a tenant, a consumer group), fixed or from the
            envelope.
        connection: a factory of async context managers giving the app's connection for
            one message (``pool.connection``, ``async_sessionmaker``); the handler writes its
            effect on ``delivery.conn`` and it commits with the record.
        mode: with ``connection``: ``"transactional"`` or ``"leased"`` (docs/transactions.md).
        fail_on: exception types that are deterministic failures (recorded FAILED, never
            run again); defaults to the policy's. Any other exception is transient.
        on_failure: what a deterministic failure gets: ``"ack"`` or ``"dead_letter"``.
        on_expired: what a message older than the retention gets: ``"dead_letter"``
            (quarantine, the default) or ``"ack"`` (drop it, logged and counted).
        key_from_body: a message with no id runs under `body_key` instead of being refused.
            A last resort: two distinct events with identical bodies then collide.
        retry_delay: how long a requeued message should wait (seconds or a timedelta); an
            in-progress one waits at most this, or less if the holder's lease ends sooner.
        serializer: how handler results are stored; defaults to the policy's.

    Raises:
        ConfigurationError: ``policy.ttl`` shorter than ``horizon``, or a bad option.

    >>> import asyncio
    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> consumer = AsyncConsumer(
    ...     AsyncIdempotency(AsyncMemoryStore()), name="orders", horizon=timedelta(hours=1)
    ... )
    >>> async def handle(delivery):
    ...     return {"seen": delivery.key}
    >>> first = asyncio.run(consumer.process(None, Envelope("e-1", b"{}"), handle))
    >>> again = asyncio.run(consumer.process(None, Envelope("e-1", b"{}"), handle))
    >>> print(first.reason, again.reason, again.action, again.result)
    executed duplicate ack {'seen': 'e-1'}
    """

    idempotency: AsyncIdempotency
    connection: Callable[[], AbstractAsyncContextManager[Any]] | None

    async def process(
        self,
        message: M,
        envelope: Envelope,
        handler: Callable[[Delivery[M]], Awaitable[Any]],
    ) -> Outcome:
        """Handle one message (at most once per key) and say what to tell the broker.

        Exceptions from the handler become outcomes; only a cancellation (or another
        BaseException) propagates, after the key is released.
        """
        key = self._screen(envelope)
        if isinstance(key, Outcome):
            return self._report(key, envelope)
        async with AsyncExitStack() as stack:
            try:
                conn = (
                    await stack.enter_async_context(self.connection()) if self.connection else None
                )
                handle = await self.idempotency.begin(key, conn=conn, **self._begin_args(envelope))
            except Exception as exc:  # noqa: BLE001 - every refusal becomes an outcome
                return self._report(self._refused(key, exc), envelope)
            attempt = handle.attempt
            if attempt.replayed:
                return self._answered(Reason.DUPLICATE, key, attempt, envelope)
            delivery = Delivery(message, envelope, key, conn, attempt)
            try:
                reset = _current.set(delivery)
                try:
                    result = await handler(delivery)
                finally:
                    _current.reset(reset)
            except BaseException as exc:
                error = await _aleave(handle, exc)
                if isinstance(error, FencedError):  # the renewal cancelled the handler
                    return self._report(self._failed(key, error), envelope)
                if not isinstance(exc, Exception):
                    raise  # a cancellation from outside: the key is released
                return self._report(self._failed(key, error or exc), envelope)
            try:
                await handle.finish(result)
            except Exception as exc:  # noqa: BLE001 - a failure to record becomes an outcome
                return self._report(self._unrecorded(key, exc), envelope)
            return self._answered(Reason.EXECUTED, key, attempt, envelope)


class Consumer(_Consumer):
    """The synchronous twin of `AsyncConsumer`, for an `Idempotency` guard and plain
    handlers; ``connection`` is a factory of (sync) context managers. Leases are renewed from
    a thread while the handler runs.

    >>> from idempo.stores.memory import MemoryStore
    >>> consumer = Consumer(Idempotency(MemoryStore()), name="orders", horizon=timedelta(0))
    >>> [str(consumer.process(None, Envelope("e-1", b"x"), lambda d: 1).reason) for _ in "ab"]
    ['executed', 'duplicate']
    """

    idempotency: Idempotency
    connection: Callable[[], AbstractContextManager[Any]] | None

    def process(
        self, message: M, envelope: Envelope, handler: Callable[[Delivery[M]], Any]
    ) -> Outcome:
        """Handle one message (at most once per key) and say what to tell the broker."""
        key = self._screen(envelope)
        if isinstance(key, Outcome):
            return self._report(key, envelope)
        with ExitStack() as stack:
            try:
                conn = stack.enter_context(self.connection()) if self.connection else None
                handle = self.idempotency.begin(key, conn=conn, **self._begin_args(envelope))
            except Exception as exc:  # noqa: BLE001 - every refusal becomes an outcome
                return self._report(self._refused(key, exc), envelope)
            attempt = handle.attempt
            if attempt.replayed:
                return self._answered(Reason.DUPLICATE, key, attempt, envelope)
            delivery = Delivery(message, envelope, key, conn, attempt)
            try:
                reset = _current.set(delivery)
                try:
                    result = handler(delivery)
                finally:
                    _current.reset(reset)
            except BaseException as exc:
                error = _leave(handle, exc)
                if not isinstance(exc, Exception):
                    raise
                return self._report(self._failed(key, error or exc), envelope)
            try:
                handle.finish(result)
            except Exception as exc:  # noqa: BLE001 - a failure to record becomes an outcome
                return self._report(self._unrecorded(key, exc), envelope)
            return self._answered(Reason.EXECUTED, key, attempt, envelope)


async def _aleave(
    handle: AsyncHandle[Any], exc: BaseException
) -> TransactionOwnershipError | FencedError | None:
    """Hand the handler's exception to the guard: it releases the key or records the failure.

    Returns what the outcome carries instead of the handler's own error: the guard's
    TransactionOwnershipError when the handler committed the guard's transaction itself
    (the failure is then recorded: the message is handled for good), or the FencedError of
    a lease lost while it ran (the renewal cancelled the handler).
    """
    try:
        await handle.abort(exc)
    except (TransactionOwnershipError, FencedError) as meant:
        return meant
    except Exception as fault:  # noqa: BLE001 - never raised over the handler's own error
        # The guard already swallows store faults here; anything left is logged. The key then
        # frees with its lease or transaction.
        logger.warning("idempo: could not settle after a handler error: %s", fault)
    return None


def _leave(handle: Handle[Any], exc: BaseException) -> TransactionOwnershipError | None:
    """The synchronous twin of `_aleave`."""
    try:
        handle.abort(exc)
    except TransactionOwnershipError as owned:
        return owned
    except Exception as fault:  # noqa: BLE001
        logger.warning("idempo: could not settle after a handler error: %s", fault)
    return None
