"""What the guard decided, call by call: one `Event` per decision, for observers.

Register observers on the guard; every surface built on it (the function API, the HTTP
middlewares, message consumers) then reports through them::

    def audit(event: Event) -> None:
        if event.kind in UNCERTAIN:         # the app has something to reconcile
            reconcile_later(event.operation, event.key_digest, event.kind)

    idem = Idempotency(store, observers=[audit, OpenTelemetryObserver()])

An observer is any callable taking an `Event`. It is called synchronously, in the thread or
task of the call (a lost lease is reported from the renewal's thread or task), so it must
be quick, thread-safe and must not raise: what it raises is logged and swallowed, never
allowed to change the call's outcome.

With no observer registered a call builds no event at all: the hot path pays one check. An
observer may also have a ``dormant()`` method: while every observer's answers True (an
`idempo.otel.OpenTelemetryObserver` with no OpenTelemetry SDK set up), calls build no
events either.
The decisions that call for a look (a mismatch, a refused or failed store operation, a
fenced holder, a lost lease, an unguarded run) are logged on the standard library's
loggers whether or not an observer is registered (see `LOGGERS`).

Keys are secrets of a sort (they can be guessable order ids): an event carries their
`key_digest`, never the key itself, unless the guard was built with ``reveal_keys=True``.
Principals and bodies are never carried.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from ._core.digest import key_digest

__all__ = [
    "FINAL",
    "LOGGERS",
    "UNCERTAIN",
    "Event",
    "Kind",
    "Observer",
    "Surface",
    "dormancy",
    "key_digest",
    "scrub",
]


class Kind(StrEnum):
    """What was decided. ``final`` kinds end a call (`FINAL`); the others happen during it."""

    EXECUTED = "executed"
    """The key was reserved: the work runs now (then one of the settling kinds follows)."""
    TAKEN_OVER = "taken_over"
    """The key was reserved by taking over a previous attempt whose lease had ended (it
    crashed or outlived its lease): the work runs now, resuming after any recorded steps."""
    REPLAYED = "replayed"
    """The work ran before: its stored outcome is replayed, nothing runs."""
    MISMATCH = "mismatch"
    """The key was first used with another payload: refused (HTTP 422)."""
    IN_PROGRESS = "in_progress"
    """Another attempt holds the key: refused (HTTP 409), after ``wait`` if one was set."""
    WAITED = "waited"
    """The call waited for another attempt holding the key (``Policy.wait``), then went on."""
    COMPLETED = "completed"
    """The work's result was recorded: every retry replays it."""
    FAILED = "failed"
    """A deterministic failure was recorded: every retry replays it."""
    RELEASED = "released"
    """The work failed transiently: the key is free again, a retry runs it again."""
    FENCED = "fenced"
    """This attempt's lease was taken over: its outcome (or release) was refused."""
    STORE_UNAVAILABLE = "store_unavailable"
    """The store failed before anything ran (unreachable, no schema, a corrupt record)."""
    UNRECORDED = "unrecorded"
    """The work ran but its outcome could not be recorded (the store failed on settling):
    the key frees when its lease ends and a retry may run the work again. Reconcile."""
    LEASE_LOST = "lease_lost"
    """A renewal or checkpoint found the lease taken over while the work was running."""
    FAIL_OPEN = "fail_open"
    """The store was down and the app opted into failing open: the work ran unguarded."""
    PUBLISHED = "published"
    """The outbox relay published a staged message (the broker confirmed it); it is marked
    sent. The event's ``operation`` is the message's destination, its key the message id."""
    PUBLISH_FAILED = "publish_failed"
    """The outbox relay could not publish a staged message: it is tried again after its
    backoff."""


FINAL = frozenset(
    {
        Kind.REPLAYED,
        Kind.MISMATCH,
        Kind.IN_PROGRESS,
        Kind.COMPLETED,
        Kind.FAILED,
        Kind.RELEASED,
        Kind.FENCED,
        Kind.STORE_UNAVAILABLE,
        Kind.UNRECORDED,
        Kind.PUBLISHED,
        Kind.PUBLISH_FAILED,
    }
)
"""The kinds that end a guarded call (every call that gets past its key ends in one), and
a relay's publish of one message."""

UNCERTAIN = frozenset({Kind.UNRECORDED, Kind.LEASE_LOST, Kind.FAIL_OPEN})
"""The kinds an app must reconcile: work that ran without a record it can rely on."""

Surface = Literal["function", "http", "consumer", "relay"]

LOGGERS = {
    "function": "idempo.guard",
    "http": "idempo.http",
    "consumer": "idempo.consumer",
    "relay": "idempo.outbox",
    "store": "idempo.store",
}
"""The logger of each layer: a surface's decisions go to its own, store faults (a store
that is unavailable, an outcome it could not record) to ``idempo.store``. Message consumers
and the outbox relay log their outcomes themselves (``idempo.consumer``, ``idempo.outbox``)."""

# How loudly each decision is logged (SPEC: levels that mean something): the normal path is
# DEBUG, what needs a look WARNING, a fenced stale holder or a store failure ERROR.
LEVELS = {
    Kind.EXECUTED: logging.DEBUG,
    Kind.REPLAYED: logging.DEBUG,
    Kind.COMPLETED: logging.DEBUG,
    Kind.FAILED: logging.DEBUG,
    Kind.RELEASED: logging.DEBUG,
    Kind.WAITED: logging.INFO,
    Kind.IN_PROGRESS: logging.INFO,
    Kind.TAKEN_OVER: logging.WARNING,
    Kind.MISMATCH: logging.WARNING,
    Kind.LEASE_LOST: logging.WARNING,
    Kind.FAIL_OPEN: logging.WARNING,
    Kind.FENCED: logging.ERROR,
    Kind.STORE_UNAVAILABLE: logging.ERROR,
    Kind.UNRECORDED: logging.ERROR,
    Kind.PUBLISHED: logging.DEBUG,
    Kind.PUBLISH_FAILED: logging.WARNING,
}

_WHAT = {
    Kind.EXECUTED: "reserved; the work runs",
    Kind.TAKEN_OVER: "took over a previous attempt whose lease ended; the work runs",
    Kind.REPLAYED: "replayed the stored outcome",
    Kind.MISMATCH: "refused: the key was first used with another payload",
    Kind.IN_PROGRESS: "refused: another attempt holds the key",
    Kind.WAITED: "waited for another attempt holding the key",
    Kind.COMPLETED: "recorded the result",
    Kind.FAILED: "recorded a deterministic failure",
    Kind.RELEASED: "released the key for a retry",
    Kind.FENCED: "fenced: the lease was taken over and this outcome refused",
    Kind.STORE_UNAVAILABLE: "the store failed; nothing ran",
    Kind.UNRECORDED: "the work ran but its outcome could not be recorded",
    Kind.LEASE_LOST: "the lease was taken over while the work ran",
    Kind.FAIL_OPEN: "the store failed; the work runs unguarded (fail open)",
    Kind.PUBLISHED: "published the staged message",
    Kind.PUBLISH_FAILED: "could not publish the staged message; it is tried again later",
}

_STORE_FAULTS = frozenset({Kind.STORE_UNAVAILABLE, Kind.UNRECORDED})
_BY_SURFACE = {surface: logging.getLogger(name) for surface, name in LOGGERS.items()}
_STORE_LOGGER = _BY_SURFACE["store"]


def _logger(surface: str) -> logging.Logger:
    # Looked up once per surface: getLogger takes logging's module lock.
    logger = _BY_SURFACE.get(surface)
    if logger is None:
        logger = _BY_SURFACE[surface] = logging.getLogger(f"idempo.{surface}")
    return logger


# Not frozen: made for every decision of an observed call, and a frozen dataclass pays a
# guarded setattr per field (about 1.3 k instructions each). Observers read it, never change it.
@dataclass(slots=True)
class Event:
    """One decision of one guarded call (read-only by convention).

    Attributes:
        kind: what was decided.
        operation: the call's operation (a function's name, ``"POST /orders/{id}"``).
        store: the store's class name (``"PostgresStore"``).
        surface: ``"function"``, ``"http"``, ``"consumer"`` or ``"relay"``.
        key_digest: `key_digest` of the key.
        call: an id shared by every event of one call (to pair a call's first and last).
        started: when the call began, `time.perf_counter` seconds (for a span's start).
        token: the attempt's fencing token (the replayed record's, on a replay), if known.
        store_seconds: how long the store operation behind this decision took.
        wait_seconds: how long the call waited for another attempt (``Policy.wait``).
        duration_seconds: for a final event, how long the whole call took.
        error: the exception behind a refusal or a fault, if any.
        key: the raw key, only when the guard was built with ``reveal_keys=True``.
    """

    kind: Kind
    operation: str
    store: str
    surface: str
    key_digest: str
    call: int
    started: float
    token: int | None = None
    store_seconds: float | None = None
    wait_seconds: float | None = None
    duration_seconds: float | None = None
    error: BaseException | None = None
    key: str | None = None

    @property
    def final(self) -> bool:
        """Whether this decision ended the call (`FINAL`)."""
        return self.kind in FINAL

    @property
    def uncertain(self) -> bool:
        """Whether the app has something to reconcile (`UNCERTAIN`)."""
        return self.kind in UNCERTAIN


Observer = Callable[[Event], Any]
"""A callable that takes each `Event`; its return value is ignored."""

_calls = itertools.count(1)
_failing = logging.getLogger("idempo.events")


class Emitter:
    """The events of one call: built only when there is someone to tell (an observer), or
    when a decision is worth a log line by itself (a refusal, a fault). Internal."""

    __slots__ = (
        "_digest",
        "call",
        "key",
        "observers",
        "operation",
        "reveal",
        "started",
        "store",
        "surface",
    )

    def __init__(
        self,
        observers: tuple[Observer, ...],
        *,
        operation: str,
        key: str,
        store: str,
        surface: str,
        reveal: bool,
    ) -> None:
        self.observers = observers
        self.operation = operation
        self.key = key
        self.store = store
        self.surface = surface
        self.reveal = reveal
        self.call = next(_calls)
        self.started = time.perf_counter()
        self._digest: str | None = None

    def emit(
        self,
        kind: Kind,
        *,
        token: int | None = None,
        store_seconds: float | None = None,
        wait_seconds: float | None = None,
        error: BaseException | None = None,
    ) -> Event:
        """Build the event, log it at its level and hand it to every observer."""
        digest = self._digest
        if digest is None:
            digest = self._digest = key_digest(self.key)
        event = Event(
            kind,
            self.operation,
            self.store,
            self.surface,
            digest,
            self.call,
            self.started,
            token,
            store_seconds,
            wait_seconds,
            time.perf_counter() - self.started if kind in FINAL else None,
            error,
            self.key if self.reveal else None,
        )
        log(event, self.key)
        notify(self.observers, event)
        return event


def dormancy(observers: tuple[Observer, ...]) -> Callable[[], bool] | None:
    """When every observer can say it would do nothing (a ``dormant()`` method, as
    `idempo.otel.OpenTelemetryObserver` has): a check of whether all of them say so now,
    and then a call builds no event at all. None when one of them always listens.

    >>> dormancy([print]) is None
    True
    """
    found = [getattr(observer, "dormant", None) for observer in observers]
    checks: list[Callable[[], bool]] = [check for check in found if check is not None]
    if not checks or len(checks) < len(found):
        return None
    if len(checks) == 1:
        return checks[0]
    return lambda: all(check() for check in checks)


def notify(observers: Iterable[Observer], event: Event) -> None:
    """Hand ``event`` to each observer; one that raises is logged, and the others still
    hear of it."""
    for observer in observers:
        try:
            observer(event)
        except Exception:  # noqa: BLE001 - an observer never changes a call's outcome
            _failing.exception("idempo: observer %r failed on a %s event", observer, event.kind)


def log(event: Event, key: str | None = None) -> None:
    """Log ``event`` on its layer's logger (`LOGGERS`) at its kind's level, with its fields
    in ``extra`` (``idempo_kind``, ``idempo_operation``, ``idempo_key_digest``, ...).
    ``key``: the raw key, taken out of the error's text unless the event reveals it."""
    if event.surface in ("consumer", "relay"):
        return  # consumers and the relay log each message's outcome themselves
    level = LEVELS[event.kind]
    logger = _STORE_LOGGER if event.kind in _STORE_FAULTS else _logger(event.surface)
    if not logger.isEnabledFor(level):
        return
    shown = f"key {event.key!r}" if event.key is not None else f"key#{event.key_digest}"
    error = ""
    if event.error is not None:
        text = str(event.error)
        if key is not None and event.key is None:
            text = scrub(text, key, event.key_digest)
        error = f": {type(event.error).__name__}: {text}"
    logger.log(
        level,
        "idempo: %s %s: %s%s",
        event.operation,
        shown,
        _WHAT[event.kind],
        error,
        extra=log_fields(event),
    )


def scrub(text: str, key: str, digest: str | None = None) -> str:
    """``text`` with ``key`` replaced by its digest: quoted, as messages show keys, and bare
    when it is long enough not to match by chance (a store's message, an evict hint).

    >>> scrub("key 'order-1234' is in progress", "order-1234")
    'key #71983129e5088fcb is in progress'
    """
    shown = f"#{digest or key_digest(key)}"
    text = text.replace(repr(key), shown)
    if len(key) >= 8:
        text = text.replace(key, shown)
    return text


def log_fields(event: Event) -> dict[str, Any]:
    """The structured fields of ``event``'s log record (its ``extra``), names prefixed with
    ``idempo_`` so that they never collide with a `logging.LogRecord` attribute."""
    fields: dict[str, Any] = {
        "idempo_kind": event.kind.value,
        "idempo_outcome": event.kind.value,
        "idempo_operation": event.operation,
        "idempo_store": event.store,
        "idempo_surface": event.surface,
        "idempo_key_digest": event.key_digest,
        "idempo_token": event.token,
    }
    if event.wait_seconds is not None:
        fields["idempo_wait_seconds"] = event.wait_seconds
    if event.store_seconds is not None:
        fields["idempo_store_seconds"] = event.store_seconds
    if event.key is not None:
        fields["idempo_key"] = event.key
    return fields
