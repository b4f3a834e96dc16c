"""Django middleware: SPEC §4's HTTP contract for Django views and Django REST framework.

    # settings.py
    IDEMPO = {"STORE": "sqlite:///idempo.db"}          # idempo migrate sqlite:///idempo.db
    MIDDLEWARE = [
        ...,
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "idempo.contrib.django.IdempotencyMiddleware",   # after auth, if PRINCIPAL reads the user
    ]

The middleware is a thin adapter over the shared HTTP lifecycle (`idempo._http.lifecycle`),
with the WSGI middleware's options, codec, key parsing, fingerprint and problems; only the
translation between Django's request and response objects and idempo's is here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import connections, transaction
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from .._http.keys import Header, headers_named
from .._http.lifecycle import Incoming, Lifecycle, Run, Unguarded, reserve
from .._http.options import OPTION_NAMES, HttpSettings, ShowsOptions
from .._http.per_route import Routed, idempotent, not_idempotent, rule_of
from .._http.response import HttpResponse as StoredResponse
from .._http.routes import NO_ROUTE, NoRoute
from ..errors import ConfigurationError, StoreUnavailableError
from ..guard import Attempt
from ..wsgi import request_headers

__all__ = [
    "IdempotencyMiddleware",
    "current_attempt",
    "idempotent",
    "not_idempotent",
    "route_template",
]

_ATTEMPT = "idempo_attempt"  # the request attribute a guarded request's attempt is put in

# The IDEMPO setting's keys are the middlewares' options (HttpOptions) in upper case.
_OPTIONS = {name.upper(): name for name in OPTION_NAMES}
# Callables that may be given as dotted paths ("myapp.idem.principal").
_CALLABLES = ("PRINCIPAL", "OPERATION", "CLASSIFY", "ROUTES", "KEY_FROM")


class IdempotencyMiddleware(ShowsOptions):
    """Runs each guarded request once per ``(principal, operation, Idempotency-Key)`` and
    answers every duplicate with the first response, byte for byte.

    Configured by the ``IDEMPO`` setting, a dict whose keys are the WSGI middleware's
    options (`idempo._http.options.HttpOptions`) in upper case: ``STORE`` (a sync store or a
    store URL) or ``IDEMPOTENCY`` (a shared `Idempotency`), and optionally ``POLICY``,
    ``LEASE``, ``METHODS``, ``REQUIRE_KEY``, ``PRINCIPAL``, ``OPERATION`` and ``ROUTES``
    (callables taking the request, or dotted paths to them), ``ALLOW_ANONYMOUS``,
    ``FINGERPRINT_FIELDS``, ``FINGERPRINT_HEADERS``, ``MAX_REQUEST_BYTES``,
    ``MAX_RESPONSE_BYTES``, ``REPLAY_STATUS_200``, ``FAIL_OPEN``, ``CLASSIFY``,
    ``MAX_RETRY_AFTER``, ``STORE_RETRY_AFTER``, ``CONNECTION`` and ``MODE``.

    ``CONNECTION`` is a database alias (``"default"``): the view then runs inside
    ``transaction.atomic(using=alias)`` and the record rides on that connection's
    transaction, so the view's ORM writes and the stored response commit together, or not
    at all. ``STORE`` must then name the same database (``idempo migrate`` it first).

    The operation defaults to ``"METHOD route"`` where the route is the URL pattern the path
    resolves to (``payments/<int:pk>``), the raw path when none does. The principal defaults
    to ``request.user`` when Django's ``AuthenticationMiddleware`` (placed before this one)
    authenticated it (``"user:<pk>"``), else a SHA-256 of the Authorization header, else
    anonymous. A ``PRINCIPAL`` callable's string is the principal (``""``: anonymous); its
    None is refused with 401 ``principal-required`` unless ``ALLOW_ANONYMOUS``, when the
    default applies.

    Example::

        IDEMPO = {
            "STORE": "postgresql://app@db/app",
            "CONNECTION": "default",                                # optional: one commit
            "PRINCIPAL": lambda request: request.headers.get("X-Tenant"),  # None: 401
        }
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response
        config: Mapping[str, Any] = getattr(settings, "IDEMPO", {})
        unknown = set(config) - set(_OPTIONS)
        if unknown:
            raise ConfigurationError(f"unknown IDEMPO settings: {sorted(unknown)}")
        options = {
            _OPTIONS[name]: import_string(value)
            if name in _CALLABLES and isinstance(value, str)
            else value
            for name, value in config.items()
        }
        alias = options.get("connection")
        if alias is not None:
            options["connection"] = _atomic(alias)
        self.settings = HttpSettings(options, owner=type(self).__name__)
        self.routes: Callable[[HttpRequest], Any] = options.get("routes") or _routed
        self.lifecycle = Lifecycle(self.settings, self.routes)
        self.idempotency = self.lifecycle.idempotency

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        lifecycle = self.lifecycle
        method = (request.method or "GET").upper()
        if method not in lifecycle.settings.methods:
            return self.get_response(request)
        headers = request_headers(request.META)
        named = headers_named(headers, lifecycle.read_headers)
        admission = lifecycle.admit(request, method, request.path, named)
        if admission is None:
            return self.get_response(request)  # not guarded (or no URL pattern matches)
        if isinstance(admission, StoredResponse):
            return _to_django(admission)
        # Django reads the body once and keeps it, so the view reads the same bytes; under
        # WSGI, a body without Content-Length (chunked) reads as empty, as it does in Django.
        body = request.body
        if len(body) > lifecycle.settings.max_request_bytes:
            return _to_django(lifecycle.too_large())
        query = str(request.META.get("QUERY_STRING", "")).encode("latin-1")
        user = lambda: getattr(request, "user", None)  # noqa: E731
        incoming = Incoming(request, method, request.path, query, headers, named, body, user)
        key = admission.key or lifecycle.hooked_key(admission, incoming)
        if key is None:
            return self.get_response(request)  # the hook found no key: none required
        if isinstance(key, StoredResponse):
            return _to_django(key)
        operation = admission.operation
        outcome = reserve(lifecycle, key, incoming, operation)
        if isinstance(outcome, StoredResponse):
            return _to_django(outcome)
        if isinstance(outcome, Unguarded):
            return self.get_response(request)  # failing open
        return _execute(self.get_response, outcome, request)


def _atomic(alias: Any) -> Callable[[], Any]:
    """``CONNECTION``'s factory: Django's own ``transaction.atomic`` on ``alias``, yielding
    the driver connection beneath it for the store to write the record on."""
    if not isinstance(alias, str) or alias not in settings.DATABASES:
        raise ConfigurationError(f"IDEMPO CONNECTION must name a database alias, not {alias!r}")

    @contextmanager
    def atomic() -> Iterator[Any]:
        with transaction.atomic(using=alias):
            wrapper = connections[alias]
            wrapper.ensure_connection()
            yield wrapper.connection

    return atomic


def _routed(request: HttpRequest) -> str | Routed | NoRoute | None:
    """The default hook: `route_template` (a `Routed` for a view marked `idempotent` or
    `not_idempotent`), `NO_ROUTE` when no URL pattern matches."""
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
    except Resolver404:
        return NO_ROUTE
    route = getattr(match, "route", None)
    template = route if isinstance(route, str) and route else None
    rule = rule_of(match.func)
    return template if rule is None else Routed(template, rule)


def route_template(request: HttpRequest) -> str | None:
    """The URL pattern ``request`` resolves to (``api/payments/<int:pk>``), or None.

    Resolved here, before the view runs (``request.resolver_match`` is set only later), with
    the request's own urlconf. None (use the raw path) is always safe: more operations never
    replay another endpoint's answer.
    """
    found = _routed(request)
    if isinstance(found, Routed):
        return found.template
    return None if found is NO_ROUTE else found


def _execute(
    get_response: Callable[[HttpRequest], HttpResponseBase], run: Run, request: HttpRequest
) -> HttpResponseBase:
    setattr(request, _ATTEMPT, run.attempt)
    try:
        response = get_response(request)
    except BaseException as exc:
        run.fail(exc)  # before a whole response: the key is released
        raise
    if response.streaming:
        return _stream(run, response)
    content = bytes(getattr(response, "content", b""))
    lifecycle = run.lifecycle
    if len(content) > lifecycle.settings.max_response_bytes:
        kept = run.settle(lifecycle.unkept(response.status_code, len(content)))
    else:
        kept = run.settle(StoredResponse(response.status_code, _headers(response), content))
    # The first caller gets the view's own response object, cookies included.
    return response if kept else _to_django(lifecycle.not_committed())


def _stream(run: Run, response: HttpResponseBase) -> HttpResponseBase:
    """Hold a streaming response up to the limit, as the WSGI middleware does."""
    chunks: Iterator[bytes] = iter(response.streaming_content)
    held: list[bytes] = []
    size = 0
    lifecycle = run.lifecycle
    try:
        for chunk in chunks:
            held.append(bytes(chunk))
            size += len(chunk)
            if size > lifecycle.settings.max_response_bytes:
                response.streaming_content = _rest(run, response, held, size, chunks)
                return response
    except BaseException as exc:
        run.fail(exc)
        raise
    if not run.settle(StoredResponse(response.status_code, _headers(response), b"".join(held))):
        return _to_django(lifecycle.not_committed())
    response.streaming_content = held
    return response


def _rest(
    run: Run, response: HttpResponseBase, held: list[bytes], size: int, chunks: Iterator[bytes]
) -> Iterator[bytes]:
    pending = b"".join(held)
    try:
        for chunk in chunks:
            yield pending
            pending = bytes(chunk)
            size += len(pending)
        # One chunk behind, so the record settles before the client sees the end of it.
        if not run.settle(run.lifecycle.unkept(response.status_code, size)):
            # The writes behind it rolled back: end it broken, never whole.
            raise StoreUnavailableError("the writes behind this response did not commit")
        yield pending
    except Exception as exc:
        run.fail(exc)
        raise
    finally:
        # Closed before its end (the client went away): the response was never whole, so
        # the key is released, as the WSGI middleware does. A no-op once settled.
        run.settle(None)


def _headers(response: HttpResponseBase) -> tuple[Header, ...]:
    return tuple(
        [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.items()]
    )


def _to_django(response: StoredResponse) -> HttpResponse:
    django_response = HttpResponse(response.body, status=response.status)
    # The stored headers are the whole set: drop the default Content-Type Django adds.
    del django_response["Content-Type"]
    for name, value in response.headers:
        django_response[name.decode("latin-1")] = value.decode("latin-1")
    return django_response


def current_attempt(request: HttpRequest) -> Attempt:
    """This request's attempt: its scope (principal, operation, key) and fencing token, for
    downstream keys (`Attempt.downstream_key`) and `Attempt.do_not_store`.

    Raises:
        ConfigurationError: the request is not guarded by the middleware.
    """
    attempt = getattr(request, _ATTEMPT, None)
    if not isinstance(attempt, Attempt):
        raise ConfigurationError("this request is not guarded by IdempotencyMiddleware")
    return attempt
