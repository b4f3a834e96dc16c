"""Celery: a task's effect happens once per intent, however often the task is delivered.

    from idempo.consumer import Consumer, current_delivery
    from idempo.contrib.celery import idempotent_task

    def billing() -> Consumer:                 # made once per worker process, on first use
        pool = ConnectionPool(DATABASE_URL)
        idem = Idempotency(PostgresStore(pool), Policy(ttl=timedelta(days=8)))
        return Consumer(idem, name="billing.charge", horizon=timedelta(days=7),
                        connection=pool.connection, fail_on=(CardDeclined,))

    @app.task(acks_late=True, reject_on_worker_lost=True)
    @idempotent_task(billing, key="payment_id")
    def charge(payment_id: str, amount: int) -> dict[str, str]:
        current_delivery().conn.execute("INSERT INTO payments ...")  # commits with the record
        return {"charged": payment_id}

    charge.delay("p-1", 500)                   # any number of times: one charge

The key is the intent's id that the producer put on the task: a task argument (``key=``
names it), the ``idempotency_key`` message header (the default; `publish` sets it), a
function of the request, or (``use_task_id=True``, opt-in) Celery's task id, which is new on
every ``apply_async`` unless the producer passes ``task_id=``. The fingerprint is the task's
arguments as canonical JSON: the same key with other arguments is refused.

This is a thin layer over the synchronous `idempo.consumer.Consumer`: the consumer runs the
task body and says what happened; the task then answers Celery:

====================  ===============================================================
Outcome reason        what the task does
====================  ===============================================================
``EXECUTED``          returns the body's result (stored with the record)
``DUPLICATE``         returns the stored result, without running the body; a stored
                      deterministic failure raises `ReplayedFailureError`
``IN_PROGRESS``       ``task.retry(countdown=...)``: tried again once the first copy
                      has had time to finish (counts towards ``max_retries``)
``UNAVAILABLE``       ``task.retry(...)``: the store or database is down, nothing ran
``FENCED``            ``task.retry(...)``: the body outlived its lease; the copy that
                      took over decides, and the retry replays its result
``TRANSIENT``         the key is released and the body's own exception raised again,
                      so Celery's ``autoretry_for`` (or a failure) follows
``FAILED``            the deterministic exception (``fail_on``) is recorded, then raised
``NO_KEY``            `MissingKeyError`
``INVALID_KEY``       `InvalidKeyError`
``MISMATCH``          `FingerprintMismatchError`
``EXPIRED``           `ExpiredTaskError` (``on_expired="ack"``: returns None)
====================  ===============================================================

Needs ``pip install 'idempo[celery]'``; docs/celery.md has the whole story, including what
``acks_late``, ``task_reject_on_worker_lost`` and Redis's ``visibility_timeout`` mean for
exactly-once.

.. versionadded:: 0.1
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, ParamSpec, TypeVar

from .._optional import optional_import

with optional_import("idempo.contrib.celery needs Celery", extra="celery"):
    from celery import current_task
    from kombu.utils import json as kombu_json

from .. import validate_key
from .._core.fingerprint import canonical_bytes
from ..consumer import Action, Consumer, Delivery, Envelope, Outcome, Reason
from ..errors import ConfigurationError, IdempotencyError, InvalidPayloadError, MissingKeyError
from ..policy import utcnow

__all__ = [
    "HEADER",
    "PUBLISHED_HEADER",
    "ExpiredTaskError",
    "idempotent_task",
    "publish",
]

logger = logging.getLogger("idempo.consumer")

P = ParamSpec("P")
R = TypeVar("R")

HEADER = "idempotency_key"
"""The message header the key travels in unless ``key=`` or ``header=`` say otherwise."""
PUBLISHED_HEADER = "idempotency_published"
"""When the intent was first published (ISO 8601, UTC), for the consumer's horizon guard."""

KeyOf = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]
"""``key(request, args, kwargs)``: the key of one task request (None: it has none)."""


class ExpiredTaskError(IdempotencyError):
    """The task was published longer ago than the records' retention (``Policy.ttl``): its
    record may be purged, so a duplicate could not be recognised, and it is not run (the
    consumer's horizon guard, docs/consumers.md)."""


class _PerProcess:
    """The consumer of a task, made by the app's factory once per process: a prefork
    worker's children each open their own pools, never one inherited across ``fork``."""

    def __init__(self, make: Callable[[], Consumer]) -> None:
        self._make = make
        self._made: tuple[int, Consumer] | None = None
        self._lock = threading.Lock()

    def __call__(self) -> Consumer:
        made, pid = self._made, os.getpid()
        if made is not None and made[0] == pid:
            return made[1]
        with self._lock:
            if self._made is None or self._made[0] != pid:
                consumer = self._make()
                if not isinstance(consumer, Consumer):
                    raise ConfigurationError(
                        "idempotent_task's factory must return an idempo.consumer.Consumer,"
                        f" not {type(consumer).__name__}"
                    )
                self._made = (pid, consumer)
            return self._made[1]


class _Task:
    """How one decorated task finds its key, fingerprint and consumer, and answers Celery."""

    def __init__(
        self,
        fn: Callable[..., Any],
        consumer: Consumer | Callable[[], Consumer],
        *,
        key: str | KeyOf | None,
        header: str,
        use_task_id: bool,
        payload: Callable[..., Any] | None,
    ) -> None:
        self.signature = inspect.signature(fn)
        if use_task_id and key is not None:
            raise ConfigurationError("give key= or use_task_id=True, not both")
        if isinstance(key, str) and key not in self.signature.parameters:
            raise ConfigurationError(f"{fn.__qualname__} has no parameter {key!r}")
        if not isinstance(header, str) or not header:
            raise ConfigurationError("header= must name a message header")
        self.fn = fn
        self.consumer = consumer if isinstance(consumer, Consumer) else _PerProcess(consumer)
        self.key = key
        self.header = header
        self.use_task_id = use_task_id
        self.payload = payload
        self.warned = False

    def consumer_now(self) -> Consumer:
        consumer = self.consumer
        return consumer if isinstance(consumer, Consumer) else consumer()

    def run(
        self, wrapper: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        task = current_task._get_current_object()
        if not _runs(task, wrapper):
            raise ConfigurationError(
                f"{self.fn.__qualname__} is guarded by idempotent_task: call it as a Celery task"
                " (.delay, .apply_async, .apply or the task object itself), and put"
                " @idempotent_task under @app.task"
            )
        request = task.request
        given = args[1:] if args and args[0] is task else args  # bind=True: less the task
        self.check_delivery(task, request)
        named = self.signature.bind(*args, **kwargs)
        named.apply_defaults()
        arguments = dict(named.arguments)
        if len(given) < len(args):
            arguments.pop(next(iter(self.signature.parameters)))  # the bound task
        fingerprinted = arguments if self.payload is None else self.payload(*given, **kwargs)
        envelope = Envelope(
            id=self.key_of(request, arguments, given, kwargs),
            body=_canonical_arguments(fingerprinted),
            timestamp=_published(request, PUBLISHED_HEADER),
        )
        try:
            consumer = self.consumer_now()
        except ConfigurationError:
            raise
        except Exception as exc:
            # The worker could not make its consumer (its database is down): nothing ran.
            raise task.retry(exc=exc) from exc

        def body(delivery: Delivery[Any]) -> Any:
            return self.fn(*args, **kwargs)

        return self.answer(task, consumer.process(request, envelope, body))

    def check_delivery(self, task: Any, request: Any) -> None:
        """Say once, per task and process, what a worker lost mid-task does without
        ``acks_late``: the message is gone, and the effect may never happen."""
        if self.warned or request.is_eager or request.called_directly:
            return
        self.warned = True
        if not task.acks_late:
            logger.warning(
                "idempo: task %r runs without acks_late: a worker lost mid-task loses the task"
                " (at most once, not exactly once); set acks_late=True (docs/celery.md)",
                task.name,
            )

    def key_of(
        self,
        request: Any,
        arguments: dict[str, Any],
        given: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> str | None:
        """The key as the task says where to find it; ``arguments`` by parameter name,
        ``given`` and ``kwargs`` as Celery passed them (less a bound task)."""
        if self.use_task_id:
            found: Any = request.id
        elif isinstance(self.key, str):
            found = arguments.get(self.key)
        elif self.key is not None:
            found = self.key(request, given, kwargs)
        else:
            found = (request.headers or {}).get(self.header)
        if found is None or isinstance(found, str):
            return found
        if isinstance(found, int) and not isinstance(found, bool):
            return str(found)  # an integer id: its decimal form
        return found  # type: ignore[no-any-return] # refused as an invalid key, named

    def missing(self, task: Any) -> str:
        if isinstance(self.key, str):
            where = f"its argument {self.key!r} is empty"
        elif self.key is not None:
            where = "its key function found none"
        else:
            where = (
                f"its message has no {self.header!r} header: publish it with"
                f" apply_async(..., headers={{{self.header!r}: intent_id}}) or"
                " idempo.contrib.celery.publish"
            )
        return f"task {task.name!r} has no idempotency key: {where}"

    def answer(self, task: Any, outcome: Outcome) -> Any:
        """What the task returns or raises for ``outcome`` (the module docstring's table)."""
        reason = outcome.reason
        if reason is Reason.EXECUTED:
            return outcome.result
        if reason is Reason.DUPLICATE:
            if outcome.error is not None:
                raise outcome.error  # a stored deterministic failure, replayed
            return outcome.result
        if outcome.action is Action.REQUEUE and reason is not Reason.TRANSIENT:
            # In progress, unavailable or fenced: nothing of this copy's stands; try later.
            raise task.retry(countdown=outcome.delay, exc=outcome.error)
        if reason is Reason.NO_KEY:
            raise MissingKeyError(self.missing(task), header=self.header)
        if reason is Reason.EXPIRED:
            if outcome.action is Action.ACK:
                return None
            raise ExpiredTaskError(
                f"task {task.name!r} was published more than the records' retention ago"
                f" ({self.consumer_now().idempotency.policy.ttl}); not run (horizon guard)"
            )
        # TRANSIENT (released), FAILED (recorded), INVALID_KEY, MISMATCH: the error itself.
        assert outcome.error is not None, f"a {reason.value} outcome without its error"
        raise outcome.error


def _canonical_arguments(arguments: Any) -> bytes:
    """The canonical JSON of a task's arguments, with the types Celery's own JSON carries
    (datetime, UUID, Decimal, bytes) in the tagged form kombu sends them in: a task that
    takes a datetime is fingerprinted, not refused."""
    try:
        return canonical_bytes(arguments)
    except InvalidPayloadError:
        pass
    try:
        carried = json.loads(kombu_json.dumps(arguments))  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        raise InvalidPayloadError(
            "cannot fingerprint the task's arguments: they have no JSON form (pickled"
            " objects?); say what identifies the intent with payload= (docs/celery.md)"
        ) from exc
    return canonical_bytes(carried)


def _runs(task: Any, wrapper: Callable[..., Any]) -> bool:
    """Whether ``task`` (the task running now, or None) is the one made of ``wrapper``:
    Celery keeps the function it was given as ``__wrapped__``; ``autoretry_for`` and
    ``pydantic=True`` wrap it in turn, each keeping what they wrapped."""
    fn = getattr(task, "__wrapped__", None)
    while fn is not None:
        fn = getattr(fn, "__func__", fn)  # bind=True: a method of the task
        if fn is wrapper:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def _published(request: Any, header: str) -> datetime | None:
    stamped = (request.headers or {}).get(header)
    if not isinstance(stamped, str):
        return None
    try:
        return datetime.fromisoformat(stamped)
    except ValueError:
        return None  # not ours to refuse: the horizon check is skipped


def idempotent_task(
    consumer: Consumer | Callable[[], Consumer],
    *,
    key: str | KeyOf | None = None,
    header: str = HEADER,
    use_task_id: bool = False,
    payload: Callable[..., Any] | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Make a Celery task's body run once per key; copies get the stored result.

    Put it under ``@app.task`` (it wraps the function Celery turns into the task, keeping
    its signature, so Celery still checks the arguments a producer passes). The body reads
    its database connection, when the consumer has ``connection=``, from
    ``idempo.consumer.current_delivery().conn``: its writes commit with the record.

    Args:
        consumer: the `Consumer` (its name is the task's operation: one consumer per task),
            or a function that makes it, called once per worker process on the first task
            (a prefork worker's children then each open their own connection pools).
        key: where the key is: the name of a task parameter, or a function
            ``key(request, args, kwargs)`` of Celery's request (``args`` without a bound
            task's ``self``). By default the ``header`` message header.
        header: the message header the key travels in when ``key`` is not given.
        use_task_id: opt in to Celery's task id as the key. It is new on every
            ``apply_async`` (and the same on ``self.retry``), so a producer that publishes
            again must pass the same ``task_id=``.
        payload: what to fingerprint, a function of the task's arguments; by default all of
            them, by parameter name, as canonical JSON.

    Raises:
        ConfigurationError: ``key`` names no parameter, or both ``key`` and ``use_task_id``.

    >>> from datetime import timedelta
    >>> from celery import Celery
    >>> from idempo import Idempotency
    >>> from idempo.consumer import Consumer
    >>> from idempo.stores.memory import MemoryStore
    >>> app = Celery("doctest", set_as_current=False)
    >>> orders = Consumer(Idempotency(MemoryStore()), name="ship", horizon=timedelta(0))
    >>> shipped = []
    >>> @app.task
    ... @idempotent_task(orders, key="order_id")
    ... def ship(order_id: str) -> str:
    ...     shipped.append(order_id)
    ...     return f"shipped {order_id}"
    >>> [ship.apply(("o-1",)).get() for _ in range(3)], shipped
    (['shipped o-1', 'shipped o-1', 'shipped o-1'], ['o-1'])
    """

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        spec = _Task(fn, consumer, key=key, header=header, use_task_id=use_task_id, payload=payload)

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            result: R = spec.run(wrapper, args, kwargs)
            return result

        # Celery checks a producer's arguments against the task's signature, read without
        # following __wrapped__: it must see the body's, not (*args, **kwargs).
        wrapper.__signature__ = spec.signature  # type: ignore[attr-defined]
        return wrapper

    return decorate


def publish(
    task: Any,
    args: tuple[Any, ...] | list[Any] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    key: str,
    header: str = HEADER,
    published: datetime | None = None,
    **options: Any,
) -> Any:
    """Send ``task`` with the intent's key in the ``header`` message header, and the time
    it was first published for the consumer's horizon guard.

    Mint ``key`` once per intent and send every retry of that intent with it: the worker
    deduplicates on it. Other keyword arguments go to ``task.apply_async`` (``countdown``,
    ``queue``, ``headers``...). ``self.retry`` keeps both headers.

    Args:
        task: the Celery task (decorated with `idempotent_task`).
        args, kwargs: the task's arguments.
        key: the intent's id (1-255 printable ASCII characters).
        header: the header the task reads its key from.
        published: when the intent was first published (aware); now by default. Pass the
            first time on a later retry of the same intent.

    Returns:
        Celery's ``AsyncResult``.

    Raises:
        InvalidKeyError: ``key`` could not be an idempotency key; nothing was sent.

    >>> from datetime import timedelta
    >>> from celery import Celery
    >>> from idempo import Idempotency
    >>> from idempo.consumer import Consumer
    >>> from idempo.stores.memory import MemoryStore
    >>> app = Celery("doctest", set_as_current=False)
    >>> app.conf.task_always_eager = True  # here: run in this process
    >>> events = Consumer(Idempotency(MemoryStore()), name="notify", horizon=timedelta(0))
    >>> @app.task(shared=False)
    ... @idempotent_task(events)
    ... def notify(user_id: int) -> str:
    ...     return f"told {user_id}"
    >>> [publish(notify, (42,), key="evt-1").get() for _ in range(2)], dict(events.counts)
    (['told 42', 'told 42'], {<Reason.EXECUTED: 'executed'>: 1, <Reason.DUPLICATE: 'duplicate'>: 1})
    """
    validate_key(key)
    headers = dict(options.pop("headers", None) or {})
    headers[header] = key
    headers[PUBLISHED_HEADER] = (published or utcnow()).isoformat()
    return task.apply_async(args, kwargs, headers=headers, **options)
