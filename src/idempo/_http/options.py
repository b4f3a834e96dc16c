"""The options of idempo's HTTP middlewares: one set, whatever the framework.

`HttpOptions` names every option once. The ASGI, WSGI and aiohttp middlewares take them as
keyword arguments, Django as the ``IDEMPO`` setting's keys in upper case; `HttpSettings`
checks them once, when the middleware is made, and is what the lifecycle reads per request.

    >>> from idempo.stores.memory import MemoryStore
    >>> settings = HttpSettings({"store": MemoryStore(), "lease": 10}, owner="Demo")
    >>> settings.idempotency.policy.lease, settings.renew_every
    (datetime.timedelta(seconds=10), 3.3333333333333335)
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import timedelta
from typing import Any, Generic, TypedDict, TypeVar

from ..encryption import KeyRing
from ..errors import ConfigurationError
from ..events import Observer
from ..guard import AsyncIdempotency, Idempotency
from ..policy import Policy
from ..stores import AsyncStore, open_async_store, open_store
from ..stores.base import AsyncTransactionalStore, Mode, Store, TransactionalStore
from .codec import Classifier, HttpCodec, Redactor, classify_status
from .fingerprint import DEFAULT_FINGERPRINT_FIELDS, FingerprintField
from .per_route import KeyHook, PathRules
from .principals import Principals

__all__ = [
    "DEFAULT_BODY_LIMIT",
    "HttpOptions",
    "HttpSettings",
    "ShowsOptions",
    "check_options",
    "http_policy",
]

RequestT = TypeVar("RequestT")

DEFAULT_BODY_LIMIT = 1024 * 1024
# Room for the status and headers in a stored record, on top of the body limit.
_HEAD_ROOM = 64 * 1024


class HttpOptions(TypedDict, Generic[RequestT], total=False):
    """Every option of an idempo HTTP middleware. ``RequestT`` is what the framework's
    callables take: the ASGI scope, the WSGI environ, the Django or aiohttp request.

    Attributes:
        store: a store (sync for WSGI and Django, async for ASGI and aiohttp) or a store URL;
            migrate SQL stores first. Give either this or ``idempotency``.
        idempotency: a guard (`Idempotency` or `AsyncIdempotency`) to share with the rest of
            the app; its policy applies as is.
        policy: with ``store``: leases, retention and clock; defaults to `Policy()`.
        lease: with ``store``: overrides the policy's lease (seconds or a timedelta). The
            middleware renews it every third of a lease while the handler runs.
        observers: with ``store``: `idempo.events` observers of every decision (an
            `idempo.otel.OpenTelemetryObserver`, an audit hook). A shared guard has its own.
        reveal_keys: with ``store``: events and log lines carry raw keys (default: digests).
        encryption: with ``store``: an `idempo.encryption.KeyRing`; every stored response
            is sealed with AES-256-GCM (docs/data-at-rest.md). A shared guard has its own.
        methods: the guarded methods (POST and PATCH); others pass through untouched.
        require_key: answer 400 to a guarded request without a key; if False such a request
            passes through without idempotency. A route may say otherwise
            (`idempo.http.idempotent`).
        include: shell-style path patterns (``/api/*``; ``*`` crosses ``/``): only
            requests whose path matches one are guarded. Default: every path.
        exclude: path patterns never guarded (``/login``, ``/webhooks/*``), even when
            included. A route may opt out itself (`idempo.http.not_idempotent`).
        key_header: the request header the key is read from (``Idempotency-Key``): another
            API's name (``X-Idempotency-Key``, ``PayPal-Request-Id``) or a webhook sender's
            delivery id (``X-GitHub-Delivery``), so its redeliveries are deduplicated.
        key_from: where the key comes from instead of a header: ``request -> key | None``,
            called with the whole request once its body is read (`idempo.http.json_field`
            for Stripe's ``event.id``); None is no key. A route may have its own.
        principal: who asked, from the request. A string is the principal (``""``:
            anonymous); None means the resolver cannot tell, and the request is refused with
            401 ``principal-required`` unless ``allow_anonymous``. Without a resolver: the
            user the framework authenticated, else a SHA-256 of the Authorization header,
            else anonymous (docs/http.md).
        allow_anonymous: anonymous callers are expected: a resolver's None means the default
            principal instead of a 401, and a cookie-carrying anonymous request is not
            warned of.
        operation: what was asked, from the request; None or a None result means the
            default, ``"METHOD route-template"`` (see ``routes``) or ``"METHOD path"``.
        routes: where route templates come from: a callable ``request -> template | None``,
            or what the adapter's default understands (a Flask app for WSGI); by default the
            framework's own router (`idempo._http.routes`).
        fingerprint_fields: which of ``method``, ``path``, ``query``, ``body`` count.
        fingerprint_headers: request headers that count too (e.g. ``("content-type",)``).
        max_request_bytes: a larger body gets 413 before anything is stored.
        max_response_bytes: a larger response streams to the client and is recorded as a
            FAILED ``response-not-stored`` problem: retries never execute again.
        replay_status_200: replay a stored 2xx response with status 200 (same body).
        fail_open: when the store is unreachable, run the request without idempotency
            instead of answering 503.
        classify: which statuses are stored (COMPLETED/FAILED) and which release the key
            (None); defaults to SPEC §2 rule 7.
        redact: what of a response is stored and replayed: ``HttpResponse -> HttpResponse``
            (`idempo.http.redact_headers`, `idempo.http.redact_json`); the first caller gets
            the endpoint's own response, every replay the redacted one.
        max_retry_after: the most a 409's ``Retry-After`` says, in seconds.
        in_progress_status: the answer to a duplicate of a request still running: 409
            Conflict (default) or 202 Accepted, both with ``Retry-After`` and the
            ``request-in-progress`` problem.
        mismatch_status: the answer to a key reused with another request: 422 (default) or
            409 Conflict, both with the ``fingerprint-mismatch`` problem.
        store_retry_after: ``Retry-After`` of a 503, in seconds.
        connection: opens the app's database connection for one request (a context manager
            factory: SQLAlchemy's ``engine.connect`` or session factory, a psycopg pool's
            ``connection``; async ones for ASGI and aiohttp; for Django a database alias).
            The record then rides on that connection's transaction, so the endpoint's writes
            and the stored response commit together, or not at all (docs/http.md).
        mode: with ``connection``: ``"transactional"`` (reservation, writes and response
            commit in one transaction; a duplicate waits on the row lock, then gets 409) or
            ``"leased"`` (the reservation commits first, so a duplicate gets 409 at once; the
            writes commit with the fenced response at the end).
    """

    store: Any
    idempotency: Any
    policy: Policy | None
    lease: float | timedelta | None
    observers: Sequence[Observer]
    reveal_keys: bool
    encryption: KeyRing | None
    methods: Collection[str]
    require_key: bool
    include: Collection[str]
    exclude: Collection[str]
    key_header: str
    key_from: Callable[[Any], str | None] | None
    principal: Callable[[RequestT], str | None] | None
    allow_anonymous: bool
    operation: Callable[[RequestT], str | None] | None
    routes: Any
    fingerprint_fields: Collection[FingerprintField]
    fingerprint_headers: Collection[str]
    max_request_bytes: int
    max_response_bytes: int
    replay_status_200: bool
    fail_open: bool
    classify: Classifier
    redact: Redactor | None
    max_retry_after: int
    in_progress_status: int
    mismatch_status: int
    store_retry_after: int
    connection: Any
    mode: Mode


OPTION_NAMES = frozenset(HttpOptions.__annotations__)


class HttpSettings:
    """One middleware's options, checked once and resolved for the lifecycle.

    Args:
        options: the middleware's `HttpOptions`.
        owner: the middleware's name, for messages.
        asynchronous: the guard is an `AsyncIdempotency` (ASGI, aiohttp), else `Idempotency`.

    Raises:
        TypeError: an option that is not one of `HttpOptions`.
        ConfigurationError: an impossible combination (see `check_options`).
    """

    def __init__(
        self, options: Mapping[str, Any], *, owner: str, asynchronous: bool = False
    ) -> None:
        unknown = set(options) - OPTION_NAMES
        if unknown:
            raise TypeError(f"{owner} got unknown options: {', '.join(sorted(unknown))}")
        self.owner = owner
        get = options.get
        self.max_request_bytes: int = get("max_request_bytes", DEFAULT_BODY_LIMIT)
        self.max_response_bytes: int = get("max_response_bytes", DEFAULT_BODY_LIMIT)
        self.max_retry_after: int = get("max_retry_after", 5)
        self.in_progress_status: int = get("in_progress_status", 409)
        self.mismatch_status: int = get("mismatch_status", 422)
        self.store_retry_after: int = get("store_retry_after", 5)
        self.fingerprint_fields: tuple[FingerprintField, ...] = tuple(
            get("fingerprint_fields", DEFAULT_FINGERPRINT_FIELDS)
        )
        check_options(
            max_request_bytes=self.max_request_bytes,
            max_response_bytes=self.max_response_bytes,
            max_retry_after=self.max_retry_after,
            store_retry_after=self.store_retry_after,
            fingerprint_fields=self.fingerprint_fields,
            in_progress_status=self.in_progress_status,
            mismatch_status=self.mismatch_status,
        )
        make = _async_guard if asynchronous else _sync_guard
        self.idempotency: Any = make(options, self, owner)
        self.methods = frozenset(method.upper() for method in get("methods", ("POST", "PATCH")))
        self.require_key: bool = get("require_key", True)
        self.key_header_name: str = get("key_header", "Idempotency-Key")
        self.key_header: bytes = _header_name(self.key_header_name)
        self.key_from: KeyHook | None = get("key_from")
        try:
            self.paths = PathRules(get("include", ()), get("exclude", ()))
        except ValueError as exc:
            raise ConfigurationError(f"{owner}: {exc}") from None
        self.principal: Callable[[Any], str | None] | None = get("principal")
        self.principals = Principals(allow_anonymous=get("allow_anonymous", False), owner=owner)
        self.operation: Callable[[Any], str | None] | None = get("operation")
        self.routes: Any = get("routes")
        self.fingerprint_headers = tuple(name.lower() for name in get("fingerprint_headers", ()))
        self.replay_status_200: bool = get("replay_status_200", False)
        self.fail_open: bool = get("fail_open", False)
        # Its replays are the answers themselves (`Lifecycle`'s faces send them as they are).
        self.codec = HttpCodec(
            get("classify", classify_status),
            get("redact"),
            replays=True,
            status_200=self.replay_status_200,
        )
        self.renew_every = self.idempotency.policy.lease.total_seconds() / 3
        self.mode: Mode = get("mode", "transactional")
        self.connection: Any = get("connection")
        _check_connection(self, asynchronous)


class ShowsOptions:
    """A middleware's options as its attributes (``middleware.mode``), read from its
    `HttpSettings`: the one place they are kept."""

    settings: HttpSettings

    def __getattr__(self, name: str) -> Any:
        if name == "settings":  # not set yet: __init__ failed half-way
            raise AttributeError(name)
        return getattr(self.settings, name)


def _check_connection(settings: HttpSettings, asynchronous: bool) -> None:
    if settings.mode not in ("transactional", "leased"):
        raise ConfigurationError(f"mode must be 'transactional' or 'leased', not {settings.mode!r}")
    if settings.connection is None:
        return
    store = settings.idempotency.store
    if not isinstance(store, AsyncTransactionalStore if asynchronous else TransactionalStore):
        raise ConfigurationError(
            f"{type(store).__name__} cannot join the app's transaction;"
            " connection= needs a SQL store"
        )
    if settings.fail_open:
        raise ConfigurationError(
            "fail_open cannot go with connection=: the endpoint's writes ride on the"
            " record's transaction, so there is nothing to run unguarded"
        )


def _header_name(name: object) -> bytes:
    """The ``key_header`` option as the lowercase bytes headers are matched by.

    >>> _header_name("X-GitHub-Delivery")
    b'x-github-delivery'
    """
    if not isinstance(name, str) or not _TOKEN.fullmatch(name):
        raise ConfigurationError(f"key_header must be an HTTP header name, not {name!r}")
    return name.lower().encode("ascii")


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's token: a field name


def check_options(
    *,
    max_request_bytes: int,
    max_response_bytes: int,
    max_retry_after: int,
    store_retry_after: int,
    fingerprint_fields: Collection[str],
    in_progress_status: int = 409,
    mismatch_status: int = 422,
) -> None:
    """Refuse impossible middleware options when the middleware is made, not per request.

    Raises:
        ConfigurationError: a negative size limit, a Retry-After under 1 s, an unknown
            fingerprint field, or an answer status neither convention uses.
    """
    if in_progress_status not in (409, 202):
        raise ConfigurationError(f"in_progress_status is 409 or 202, not {in_progress_status!r}")
    if mismatch_status not in (422, 409):
        raise ConfigurationError(f"mismatch_status is 422 or 409, not {mismatch_status!r}")
    if max_request_bytes < 0 or max_response_bytes < 0:
        raise ConfigurationError("max_request_bytes and max_response_bytes cannot be negative")
    if max_retry_after < 1 or store_retry_after < 1:
        raise ConfigurationError("Retry-After values are whole seconds, at least 1")
    unknown = set(fingerprint_fields) - set(DEFAULT_FINGERPRINT_FIELDS)
    if unknown:
        raise ConfigurationError(f"unknown fingerprint fields: {sorted(unknown)}")


def http_policy(
    policy: Policy | None, lease: float | timedelta | None, max_response_bytes: int
) -> Policy:
    """The policy a middleware's own guard runs with (``store=``, not a shared guard).

    ``lease`` overrides the policy's. The policy limits the stored bytes (status and headers
    included) while the middleware's limit is on the body, so the policy is raised to leave
    room for a body at that limit.

    >>> http_policy(None, 10, 1024).lease
    datetime.timedelta(seconds=10)
    """
    policy = policy or Policy()
    if lease is not None:
        policy = policy.replace(
            lease=lease if isinstance(lease, timedelta) else timedelta(seconds=lease)
        )
    room = max_response_bytes + _HEAD_ROOM
    if policy.max_response_bytes < room:
        policy = policy.replace(max_response_bytes=room)
    return policy


_OWN_GUARD = ("policy", "lease", "observers", "reveal_keys", "encryption")
"""The options that build the middleware's own guard: they go with ``store=``."""


def _shared(options: Mapping[str, Any], owner: str) -> bool:
    """Whether a shared guard was given (checked), rather than a store to build one on."""
    if (options.get("store") is None) == (options.get("idempotency") is None):
        raise ConfigurationError(f"give {owner} either store= or idempotency=")
    if options.get("idempotency") is not None:
        given = [name for name in _OWN_GUARD if options.get(name) is not None]
        if given:
            raise ConfigurationError(f"{', '.join(given)} go with store=; idempotency= has its own")
        return True
    return False


def _guard_options(options: Mapping[str, Any], s: HttpSettings) -> dict[str, Any]:
    policy = http_policy(options.get("policy"), options.get("lease"), s.max_response_bytes)
    return {
        "policy": policy,
        "observers": tuple(options.get("observers") or ()),
        "reveal_keys": bool(options.get("reveal_keys", False)),
        "encryption": options.get("encryption"),
    }


def _sync_guard(options: Mapping[str, Any], s: HttpSettings, owner: str) -> Idempotency:
    idempotency, store = options.get("idempotency"), options.get("store")
    if _shared(options, owner):
        if not isinstance(idempotency, Idempotency):
            raise ConfigurationError(f"{owner} needs a sync Idempotency, not AsyncIdempotency")
        return idempotency
    if isinstance(store, str):
        store = open_store(store)
    # Protocols check names only, so a store with coroutine methods is refused by looking.
    if not isinstance(store, Store) or inspect.iscoroutinefunction(store.reserve):
        raise ConfigurationError(
            f"{owner} needs a sync Store (open_store), not {type(store).__name__}"
        )
    return Idempotency(store, **_guard_options(options, s))


def _async_guard(options: Mapping[str, Any], s: HttpSettings, owner: str) -> AsyncIdempotency:
    store = options.get("store")
    if _shared(options, owner):
        return options["idempotency"]  # type: ignore[no-any-return]
    if isinstance(store, str):
        store = open_async_store(store)
    if not isinstance(store, AsyncStore):
        raise ConfigurationError(
            f"{owner} needs an AsyncStore (open_async_store), not {type(store).__name__}"
        )
    return AsyncIdempotency(store, **_guard_options(options, s))
