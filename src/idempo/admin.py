"""Operator tools: list records, inspect one, evict it, resolve a stuck one.

What ``idempo list``, ``inspect``, ``evict`` and ``resolve`` do, as a typed API for admin
tools, in both faces: `Admin` on a `Store`, `AsyncAdmin` on an `AsyncStore`. Each operation
is written once, as a generator of store calls, and each face only carries the calls out.

    >>> from idempo.stores.memory import MemoryStore
    >>> admin = Admin(MemoryStore())
    >>> admin.list_records(in_progress_for=timedelta(minutes=5))
    []

Keys are addressed as the app sees them: `http_scope` computes the principal the HTTP
middleware records by default (the SHA-256 of an ``Authorization`` value) and reads the key as
the ``Idempotency-Key`` header carries it; the function API and consumers record the principal
they were given, so `Scope.of` names their records.

.. versionadded:: 0.2
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal, TypeVar

from ._core.digest import key_digest
from ._core.keys import Scope, validate_key
from ._core.record import Record, Status
from ._http.keys import parse_key
from ._http.principals import default_principal
from ._http.problems import problem
from ._http.response import encode_response
from ._http.stored_text import stored_text
from .encryption import KeyRing, record_context, sealed_key_id
from .errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    IdempotencyError,
    RequestInProgressError,
)
from .policy import Policy, utcnow
from .stores._sql.transaction import adrive, drive
from .stores.base import AsyncStore, Store

__all__ = [
    "RESOLVED_ERROR",
    "RESOLVED_PROBLEM",
    "Admin",
    "AsyncAdmin",
    "LiveLeaseError",
    "NoRecordError",
    "NotInProgressError",
    "ResolveFormat",
    "http_principal",
    "http_scope",
    "record_dict",
]

T = TypeVar("T")

ResolveFormat = Literal["auto", "http", "function"]
"""How a resolved record's problem is stored: as the HTTP middleware stores a response
(``http``), or as the function API and consumers store a failure (``function``); ``auto``
picks ``http`` for an operation shaped as HTTP names them (``POST /payments``)."""

RESOLVED_PROBLEM = "urn:idempo:problem:resolved-by-operator"
"""The ``type`` of the problem document an HTTP record is resolved with."""
RESOLVED_ERROR = "idempo.admin.Resolved"
"""The ``error_type`` a function's caller gets (`ReplayedFailureError`) for a resolved key."""

# The operations the HTTP middleware records: "METHOD /route/{template}" (or, for a path no
# route names, "METHOD sha256:<hex>").
_HTTP_OPERATION = re.compile(r"^[A-Z][A-Z0-9_-]* (/|sha256:)")


class LiveLeaseError(RequestInProgressError):
    """The record is in progress under a live lease: its holder may be running now. Pass
    ``force=True`` (``--force``) to act on it all the same."""

    def __init__(self, record: Record, now: datetime) -> None:
        lease_end = record.lease_expires_at or now
        remaining = max(0.0, (lease_end - now).total_seconds())
        super().__init__(record.scope.key, remaining)
        message = (
            f"key {record.scope.key!r} is in progress under a live lease (token"
            f" {record.token}, {remaining:.1f}s left): its holder may be running now;"
            " force it (--force, force=True) or wait for the lease to end"
        )
        self._say(message, record, now)
        self.record = record


class NoRecordError(IdempotencyError):
    """There is no record for the scope asked about."""

    status_code = 404

    def __init__(self, scope: Scope) -> None:
        super().__init__(
            f"no record of key {scope.key!r} (operation {scope.operation!r}, principal"
            f" {scope.principal!r})"
        )
        self.scope = scope


class NotInProgressError(IdempotencyError):
    """The record is settled already (COMPLETED or FAILED): there is nothing to resolve;
    evict it if it must go."""

    status_code = 409

    def __init__(self, record: Record) -> None:
        super().__init__(
            f"key {record.scope.key!r} is {record.status.value} already (token"
            f" {record.token}); only an in-progress record can be resolved (evict removes it)"
        )
        self.record = record


def http_principal(*, authorization: str | None = None, principal: str | None = None) -> str:
    """The principal the HTTP middleware records for a request.

    Args:
        authorization: the request's ``Authorization`` value: the default principal is its
            SHA-256 (`idempo._http.principals.default_principal`), for an app with no
            resolver and no user the framework authenticated.
        principal: what the app's ``principal=`` resolver returns (``user:42``): recorded
            as it is when it is short printable ASCII, else as its ``sha256:`` digest.

    Neither: anonymous (``""``). Both: `ConfigurationError`.

    >>> http_principal(authorization="Bearer t")[:12], http_principal(principal="user:42")
    ('63a25a26464c', 'user:42')
    """
    if authorization is not None and principal is not None:
        raise ConfigurationError("give the principal or the Authorization value, not both")
    if principal is not None:
        return stored_text(principal)
    if authorization is None:
        return ""
    try:
        raw = authorization.encode("latin-1")  # what WSGI and ASGI servers carry
    except UnicodeEncodeError:
        raw = authorization.encode("utf-8")  # what a client sends for anything else
    return default_principal([raw])


def http_scope(
    key: str,
    operation: str,
    *,
    authorization: str | None = None,
    principal: str | None = None,
) -> Scope:
    """The scope the HTTP middleware records a request under.

    ``key`` is the ``Idempotency-Key`` header's value (a bare token or an RFC 8941 string:
    ``"abc"`` and ``abc`` are one key); ``operation`` is ``METHOD route-template``;
    ``authorization`` and ``principal`` as `http_principal` takes them.

    >>> http_scope('"order-42"', "POST /payments", principal="user:7")
    Scope(principal='user:7', operation='POST /payments', key='order-42')
    """
    parsed = parse_key([key.encode("latin-1", "replace")])
    if parsed is None:  # pragma: no cover - parse_key answers None only for no header
        raise ConfigurationError("no idempotency key given")
    chosen = http_principal(authorization=authorization, principal=principal)
    return Scope(chosen, operation, validate_key(parsed))


def _lease_live(record: Record, now: datetime) -> bool:
    lease_end = record.lease_expires_at
    return record.status is Status.IN_PROGRESS and lease_end is not None and lease_end > now


def record_dict(record: Record, *, now: datetime | None = None) -> dict[str, Any]:
    """``record`` as JSON-ready data (what ``--json`` prints): times in ISO 8601, the lease
    judged at ``now`` (default: this host's clock), the response (when the record was read
    whole) as base64 and, when it is UTF-8, as text too; a response sealed by a key ring
    (`idempo.encryption`) as its key id, ``response_sealed_with``, and no text.

    >>> from idempo.stores.memory import MemoryStore
    >>> store = MemoryStore(); scope = Scope.of("k1", operation="charge")
    >>> _ = store.reserve(scope, "fp", now=None, lease=timedelta(seconds=30), ttl=_TTL)
    >>> record_dict(store.get(scope))["lease"]
    'live'
    """
    at = now or utcnow()
    lease_end = record.lease_expires_at
    lease = None
    if record.status is Status.IN_PROGRESS:
        lease = "live" if _lease_live(record, at) else "expired"
    data: dict[str, Any] = {
        "key": record.scope.key,
        "key_digest": key_digest(record.scope.key),
        "operation": record.scope.operation,
        "principal": record.scope.principal,
        "status": record.status.value,
        "token": record.token,
        "fingerprint": record.fingerprint,
        "lease": lease,
        "lease_expires_at": None if lease_end is None else lease_end.isoformat(),
        "created_at": record.created_at.isoformat(),
        "updated_at": record.updated_at.isoformat(),
        "expires_at": record.expires_at.isoformat(),
        "age_seconds": round((at - record.created_at).total_seconds(), 3),
        "recovery_point": record.recovery_point,
    }
    if record.response is not None:
        body = bytes(record.response)
        data["response_bytes"] = len(body)
        data["response_base64"] = base64.b64encode(body).decode()
        data["response_sealed_with"] = key_id = sealed_key_id(body)
        try:
            # Ciphertext that happens to decode would only be noise.
            data["response_text"] = None if key_id is not None else body.decode("utf-8")
        except UnicodeDecodeError:
            data["response_text"] = None
    return data


# -- the operations, once: generators of store calls -----------------------------------------


@dataclass(frozen=True, slots=True)
class _Ask:
    """One store call an operation needs: ``store.<verb>(*args, **kwargs)``."""

    verb: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)


_Flow = Generator[_Ask, Any, T]


def _status(value: Status | str | None) -> Status | None:
    if value is None or isinstance(value, Status):
        return value
    try:
        return Status(str(value).lower().replace("-", "_"))
    except ValueError:
        names = ", ".join(s.value for s in Status)
        raise ConfigurationError(f"unknown status {value!r}: one of {names}") from None


def _age(value: timedelta | None, what: str) -> timedelta | None:
    if value is not None and (not isinstance(value, timedelta) or value < timedelta(0)):
        raise ConfigurationError(f"{what} takes a duration of 0 or more, not {value!r}")
    return value


def _list(
    status: Status | str | None,
    operation: str | None,
    principal: str | None,
    older_than: timedelta | None,
    in_progress_for: timedelta | None,
    limit: int,
    now: datetime | None,
) -> _Flow[list[Record]]:
    chosen = _status(status)
    older = _age(older_than, "older_than")
    stuck = _age(in_progress_for, "in_progress_for")
    if stuck is not None:
        if chosen not in (None, Status.IN_PROGRESS):
            raise ConfigurationError("in_progress_for lists in-progress records only")
        chosen = Status.IN_PROGRESS
        older = stuck if older is None else max(older, stuck)
    at = now or utcnow()
    filters = {
        "status": chosen,
        "operation": operation,
        "principal": principal,
        "created_before": None if older is None else at - older,
        "limit": limit,
    }
    found: list[Record] = yield _Ask("scan", kwargs=filters)
    return found


def _evict(scope: Scope, force: bool, now: datetime | None) -> _Flow[bool]:
    try:
        record: Record | None = yield _Ask("get", (scope,))
    except CorruptRecordError:
        # What eviction is for: no holder can settle a record that cannot be read.
        return bool((yield _Ask("evict", (scope,))))
    if record is None:
        return False
    if force or record.status is not Status.IN_PROGRESS:
        return bool((yield _Ask("evict", (scope,))))
    at = now or utcnow()
    if _lease_live(record, at):
        raise LiveLeaseError(record, at)
    # The lease is over. A release is fenced on the token: if a retry took the key over
    # since the read, its live reservation stays.
    yield _Ask("release", (scope, record.token))
    after: Record | None = yield _Ask("get", (scope,))
    if after is None:
        return True
    if after.token != record.token and _lease_live(after, at):
        raise LiveLeaseError(after, at)
    # Still there under the same token: a recovery point keeps a release from deleting it,
    # or its holder settled it meanwhile. Either way no holder has a live lease on it.
    return bool((yield _Ask("evict", (scope,))))


def _problem_body(scope: Scope, reason: str, fmt: ResolveFormat, http_status: int) -> bytes:
    if fmt == "auto":
        fmt = "http" if _HTTP_OPERATION.match(scope.operation) else "function"
    if fmt == "http":
        document = problem(http_status, "resolved-by-operator", "Ended by an operator", reason)
        return encode_response(document)
    if fmt == "function":
        return json.dumps({"error": RESOLVED_ERROR, "detail": reason}).encode()
    raise ConfigurationError(f"format is auto, http or function, not {fmt!r}")


def _resolve(
    scope: Scope,
    reason: str,
    force: bool,
    now: datetime | None,
    ttl: timedelta,
    fmt: ResolveFormat,
    http_status: int,
    ring: KeyRing | None = None,
) -> _Flow[Record]:
    if not isinstance(reason, str) or not reason.strip():
        raise ConfigurationError("a resolution needs a reason (what the caller will be told)")
    if not 400 <= http_status <= 599:
        raise ConfigurationError(f"a resolved request answers 4xx or 5xx, not {http_status}")
    if ttl <= timedelta(0):
        raise ConfigurationError("ttl must be positive")
    body = _problem_body(scope, reason, fmt, http_status)
    if ring is not None:  # sealed as the app's guard seals, or it would refuse the answer
        body = ring.seal(body, record_context(scope, Status.FAILED.value))
    record: Record | None = yield _Ask("get", (scope,))
    if record is None:
        raise NoRecordError(scope)
    if record.status is not Status.IN_PROGRESS:
        raise NotInProgressError(record)
    at = now or utcnow()
    if not force and _lease_live(record, at):
        raise LiveLeaseError(record, at)
    try:
        # Fenced on the token read: if the holder settles first, or a retry takes the key
        # over, this write is refused and nothing changes; once it lands, the holder's own
        # completion is the one refused.
        yield _Ask("fail", (scope, record.token, body), {"now": now, "ttl": ttl})
    except FencedError as exc:
        raise FencedError(
            f"key {scope.key!r} changed while it was being resolved (its holder settled it,"
            f" or a retry took it over, after token {record.token} was read): nothing was"
            " written"
        ) from exc
    resolved: Record | None = yield _Ask("get", (scope,))
    if resolved is None:  # pragma: no cover - evicted in the instant since
        raise NoRecordError(scope)
    return resolved


def _call(store: Any, ask: _Ask) -> Any:
    verb = getattr(store, ask.verb, None)
    if verb is None:
        raise ConfigurationError(
            f"{type(store).__name__} cannot {ask.verb} records (it has no {ask.verb} verb)"
        )
    return verb(*ask.args, **ask.kwargs)


_TTL = Policy().ttl


class Admin:
    """Operator actions on a synchronous store.

    Args:
        store: any `Store`; listing needs its optional ``scan`` verb (every store idempo
            ships has it).
        encryption: the app's `idempo.encryption.KeyRing`, when its guard has one: a
            resolved answer is then sealed as the guard seals (which refuses plaintext).
            Listing and `inspect` show records as stored (responses sealed).

    >>> from idempo.stores.memory import MemoryStore
    >>> store = MemoryStore(); scope = Scope.of("k1", operation="charge")
    >>> _ = store.reserve(scope, "fp", now=None, lease=timedelta(seconds=30), ttl=_TTL)
    >>> admin = Admin(store)
    >>> [r.scope.key for r in admin.list_records(status="in_progress")]
    ['k1']
    >>> admin.resolve(scope, "stuck since the outage", force=True).status
    <Status.FAILED: 'failed'>
    """

    def __init__(self, store: Store, *, encryption: KeyRing | None = None) -> None:
        self.store = store
        self.encryption = encryption

    def _run(self, flow: _Flow[T]) -> T:
        return drive(flow, lambda ask: _call(self.store, ask))

    def list_records(
        self,
        *,
        status: Status | str | None = None,
        operation: str | None = None,
        principal: str | None = None,
        older_than: timedelta | None = None,
        in_progress_for: timedelta | None = None,
        limit: int = 100,
        now: datetime | None = None,
    ) -> list[Record]:
        """Up to ``limit`` records passing every filter, oldest first, without responses.

        Args:
            status: a `Status` or its name (``"in_progress"``).
            operation, principal: exact matches (as stored).
            older_than: created more than this long before ``now``.
            in_progress_for: in progress and created more than this long ago: stuck keys.
            limit: 1 to 10000.
            now: the instant ages count from (default: this host's clock).
        """
        return self._run(
            _list(status, operation, principal, older_than, in_progress_for, limit, now)
        )

    def inspect(self, scope: Scope) -> Record | None:
        """The record of ``scope``, whole (response included), or None."""
        return self._run(_inspect(scope))

    def evict(self, scope: Scope, *, force: bool = False, now: datetime | None = None) -> bool:
        """Delete the record of ``scope``; True if there was one.

        An in-progress record under a live lease (judged at ``now``, default this host's
        clock) is refused with `LiveLeaseError` unless ``force``: its holder may be running.
        One whose lease ended is deleted by a release fenced on its token, so a retry that
        took the key over in the meantime keeps its reservation.
        """
        return self._run(_evict(scope, force, now))

    def resolve(
        self,
        scope: Scope,
        reason: str,
        *,
        force: bool = False,
        now: datetime | None = None,
        ttl: timedelta = _TTL,
        format: ResolveFormat = "auto",
        http_status: int = 500,
    ) -> Record:
        """End the in-progress record of ``scope`` as FAILED, with ``reason`` stored as the
        answer every retry of the key then gets (a problem document for HTTP, a
        `ReplayedFailureError` for the function API and consumers); the FAILED record.

        Fenced on the record's token: if its holder completes first, or a retry takes the key
        over, this raises `FencedError` and writes nothing; once it lands, the holder's own
        completion is refused. A live lease is refused (`LiveLeaseError`) unless ``force``.

        Raises:
            NoRecordError: no record. NotInProgressError: it is settled already.
        """
        return self._run(
            _resolve(scope, reason, force, now, ttl, format, http_status, self.encryption)
        )


def _inspect(scope: Scope) -> _Flow[Record | None]:
    record: Record | None = yield _Ask("get", (scope,))
    return record


class AsyncAdmin:
    """The asynchronous face of `Admin`, on an `AsyncStore`: the same operations, awaited.

    >>> import asyncio
    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> asyncio.run(AsyncAdmin(AsyncMemoryStore()).list_records())
    []
    """

    def __init__(self, store: AsyncStore, *, encryption: KeyRing | None = None) -> None:
        self.store = store
        self.encryption = encryption

    async def _run(self, flow: _Flow[T]) -> T:
        return await adrive(flow, lambda ask: _call(self.store, ask))

    async def list_records(
        self,
        *,
        status: Status | str | None = None,
        operation: str | None = None,
        principal: str | None = None,
        older_than: timedelta | None = None,
        in_progress_for: timedelta | None = None,
        limit: int = 100,
        now: datetime | None = None,
    ) -> list[Record]:
        """See `Admin.list_records`."""
        return await self._run(
            _list(status, operation, principal, older_than, in_progress_for, limit, now)
        )

    async def inspect(self, scope: Scope) -> Record | None:
        """See `Admin.inspect`."""
        return await self._run(_inspect(scope))

    async def evict(
        self, scope: Scope, *, force: bool = False, now: datetime | None = None
    ) -> bool:
        """See `Admin.evict`."""
        return await self._run(_evict(scope, force, now))

    async def resolve(
        self,
        scope: Scope,
        reason: str,
        *,
        force: bool = False,
        now: datetime | None = None,
        ttl: timedelta = _TTL,
        format: ResolveFormat = "auto",
        http_status: int = 500,
    ) -> Record:
        """See `Admin.resolve`."""
        return await self._run(
            _resolve(scope, reason, force, now, ttl, format, http_status, self.encryption)
        )


def listed(records: list[Record], *, now: datetime | None = None) -> list[dict[str, Any]]:
    """`record_dict` of each record (a listing's ``--json``)."""
    at = now or utcnow()
    return [record_dict(dataclasses.replace(r, response=None), now=at) for r in records]
