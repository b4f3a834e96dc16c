"""Django middleware: SPEC §4's HTTP contract for Django views and Django REST framework.

    # settings.py
    IDEMPO = {"STORE": "sqlite:///idempo.db"}          # idempo migrate sqlite:///idempo.db
    MIDDLEWARE = [
        ...,
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "idempo.contrib.django.IdempotencyMiddleware",   # after auth, if PRINCIPAL reads the user
    ]

The middleware is the WSGI middleware's twin (`idempo.wsgi`): the same sync guard, codec,
key parsing, fingerprint and problems (`idempo._http`, `idempo._sync_http`); only the
translation between Django's request and response objects and idempo's is here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import Resolver404, resolve
from django.utils.module_loading import import_string

from .. import _http
from .._http import DEFAULT_BODY_LIMIT, DEFAULT_FINGERPRINT_FIELDS, NO_RESOLVER, classify_status
from .._sync_http import Run, SyncHttpGuard, Unguarded
from ..errors import ConfigurationError
from ..wsgi import request_headers

__all__ = ["IdempotencyMiddleware", "route_template"]

# IDEMPO setting -> (SyncHttpGuard option, default). The names are the WSGI middleware's
# keyword options in upper case; docs/http.md lists them.
_OPTIONS: dict[str, tuple[str, Any]] = {
    "STORE": ("store", None),
    "IDEMPOTENCY": ("idempotency", None),
    "POLICY": ("policy", None),
    "LEASE": ("lease", None),
    "METHODS": ("methods", ("POST", "PATCH")),
    "REQUIRE_KEY": ("require_key", True),
    "ALLOW_ANONYMOUS": ("allow_anonymous", False),
    "FINGERPRINT_FIELDS": ("fingerprint_fields", DEFAULT_FINGERPRINT_FIELDS),
    "FINGERPRINT_HEADERS": ("fingerprint_headers", ()),
    "MAX_REQUEST_BYTES": ("max_request_bytes", DEFAULT_BODY_LIMIT),
    "MAX_RESPONSE_BYTES": ("max_response_bytes", DEFAULT_BODY_LIMIT),
    "REPLAY_STATUS_200": ("replay_status_200", False),
    "FAIL_OPEN": ("fail_open", False),
    "CLASSIFY": ("classify", classify_status),
    "MAX_RETRY_AFTER": ("max_retry_after", 5),
    "STORE_RETRY_AFTER": ("store_retry_after", 5),
}
# Callables that may be given as dotted paths ("myapp.idem.principal").
_CALLABLES = ("PRINCIPAL", "OPERATION", "CLASSIFY")


class IdempotencyMiddleware:
    """Runs each guarded request once per ``(principal, operation, Idempotency-Key)`` and
    answers every duplicate with the first response, byte for byte.

    Configured by the ``IDEMPO`` setting, a dict: ``STORE`` (a sync store or a store URL)
    or ``IDEMPOTENCY`` (a shared `Idempotency`), and optionally ``POLICY``, ``LEASE``,
    ``METHODS``, ``REQUIRE_KEY``, ``PRINCIPAL`` and ``OPERATION`` (callables taking the
    request, or dotted paths to them), ``ALLOW_ANONYMOUS``, ``FINGERPRINT_FIELDS``,
    ``FINGERPRINT_HEADERS``, ``MAX_REQUEST_BYTES``, ``MAX_RESPONSE_BYTES``,
    ``REPLAY_STATUS_200``, ``FAIL_OPEN``, ``CLASSIFY``, ``MAX_RETRY_AFTER``,
    ``STORE_RETRY_AFTER``: the `idempo.wsgi.IdempotencyWSGIMiddleware` options.

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
            "PRINCIPAL": lambda request: request.headers.get("X-Tenant"),  # None: 401
        }
    """

    sync_capable = True
    async_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response
        config: Mapping[str, Any] = getattr(settings, "IDEMPO", {})
        unknown = set(config) - set(_OPTIONS) - set(_CALLABLES)
        if unknown:
            raise ConfigurationError(f"unknown IDEMPO settings: {sorted(unknown)}")
        resolved = {
            name: import_string(value) if name in _CALLABLES and isinstance(value, str) else value
            for name, value in config.items()
        }
        options = {
            option: resolved.get(name, default) for name, (option, default) in _OPTIONS.items()
        }
        self.guard = SyncHttpGuard(**options, owner=type(self).__name__)
        self.idempotency = self.guard.idempotency
        self.principal: Callable[[HttpRequest], str | None] | None = resolved.get("PRINCIPAL")
        self.operation: Callable[[HttpRequest], str | None] | None = resolved.get("OPERATION")

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        guard = self.guard
        method = (request.method or "GET").upper()
        if not guard.guards(method):
            return self.get_response(request)
        headers = request_headers(request.META)
        key = guard.key(headers)
        if isinstance(key, Unguarded):
            return self.get_response(request)
        if isinstance(key, _http.HttpResponse):
            return _to_django(key)
        refusal = guard.check_length(headers)
        if refusal is not None:
            return _to_django(refusal)
        # Django reads the body once and keeps it, so the view reads the same bytes; under
        # WSGI, a body without Content-Length (chunked) reads as empty, as it does in Django.
        body = request.body
        if len(body) > guard.max_request_bytes:
            return _to_django(guard.too_large())
        http_request = _http.HttpRequest(
            method=method,
            path=request.path,
            query=str(request.META.get("QUERY_STRING", "")).encode("latin-1"),
            headers=headers,
            body=body,
        )
        principal = guard.principal(
            self.principal(request) if self.principal else NO_RESOLVER,
            lambda: getattr(request, "user", None),
            headers,
        )
        if isinstance(principal, _http.HttpResponse):
            return _to_django(principal)
        outcome = guard.reserve(
            key, http_request, operation=self._operation(request, method), principal=principal
        )
        if isinstance(outcome, _http.HttpResponse):
            return _to_django(outcome)
        if isinstance(outcome, Unguarded):
            return self.get_response(request)  # failing open
        return _execute(self.get_response, outcome, request)

    def _operation(self, request: HttpRequest, method: str) -> str:
        chosen = self.operation(request) if self.operation else None
        if chosen is not None:
            return chosen
        template = route_template(request)
        return f"{method} {template if template is not None else request.path}"


def route_template(request: HttpRequest) -> str | None:
    """The URL pattern ``request`` resolves to (``api/payments/<int:pk>``), or None.

    Resolved here, before the view runs (``request.resolver_match`` is set only later), with
    the request's own urlconf. None (use the raw path) is always safe: more operations never
    replay another endpoint's answer.
    """
    try:
        match = resolve(request.path_info, getattr(request, "urlconf", None))
    except Resolver404:
        return None
    route = getattr(match, "route", None)
    return route if isinstance(route, str) and route else None


def _execute(
    get_response: Callable[[HttpRequest], HttpResponseBase], run: Run, request: HttpRequest
) -> HttpResponseBase:
    try:
        response = get_response(request)
    except BaseException as exc:
        run.fail(exc)  # before a whole response: the key is released
        raise
    if response.streaming:
        return _stream(run, response)
    content = bytes(getattr(response, "content", b""))
    if len(content) > run.guard.max_response_bytes:
        run.unkept(response.status_code, len(content))
    else:
        run.kept(response.status_code, _headers(response), content)
    # The first caller gets the view's own response object, cookies included.
    return response


def _stream(run: Run, response: HttpResponseBase) -> HttpResponseBase:
    """Hold a streaming response up to the limit, as the WSGI middleware does."""
    chunks: Iterator[bytes] = iter(response.streaming_content)
    held: list[bytes] = []
    size = 0
    limit = run.guard.max_response_bytes
    try:
        for chunk in chunks:
            held.append(bytes(chunk))
            size += len(chunk)
            if size > limit:
                response.streaming_content = _rest(run, response, held, size, chunks)
                return response
    except BaseException as exc:
        run.fail(exc)
        raise
    run.kept(response.status_code, _headers(response), b"".join(held))
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
        run.unkept(response.status_code, size)
        yield pending
    except Exception as exc:
        run.fail(exc)
        raise
    finally:
        # Closed before its end (the client went away): the response was never whole, so
        # the key is released, as the WSGI middleware does. A no-op once settled.
        run.settle(None)


def _headers(response: HttpResponseBase) -> list[_http.Header]:
    return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in response.items()]


def _to_django(response: _http.HttpResponse) -> HttpResponse:
    django_response = HttpResponse(response.body, status=response.status)
    # The stored headers are the whole set: drop the default Content-Type Django adds.
    del django_response["Content-Type"]
    for name, value in response.headers:
        django_response[name.decode("latin-1")] = value.decode("latin-1")
    return django_response
