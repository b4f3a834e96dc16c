"""WSGI middleware: SPEC §4's HTTP contract for Flask and any WSGI app.

    from flask import Flask
    from idempo.wsgi import IdempotencyWSGIMiddleware

    app = Flask(__name__)
    app.wsgi_app = IdempotencyWSGIMiddleware(app.wsgi_app, store="sqlite:///idem.db")

Every guarded request (POST and PATCH by default) goes through the sync `Idempotency.once`
with the same `HttpCodec`, key parsing, fingerprint and problems as the ASGI middleware
(`idempo._http`), so both answer the same way, row for row. docs/http.md has the table.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Collection, Iterable, Iterator
from datetime import timedelta
from http import HTTPStatus
from types import TracebackType
from typing import Any

from ._http import (
    DEFAULT_BODY_LIMIT,
    DEFAULT_FINGERPRINT_FIELDS,
    NO_RESOLVER,
    Classifier,
    FingerprintField,
    Header,
    HttpRequest,
    HttpResponse,
    classify_status,
)
from ._sync_http import Run, SyncHttpGuard, Unguarded, read_limited
from .guard import Idempotency
from .policy import Policy
from .stores.base import Store

__all__ = [
    "IdempotencyWSGIMiddleware",
    "flask_login_user",
    "flask_route_template",
    "request_headers",
]

Environ = dict[str, Any]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
Write = Callable[[bytes], object]
StartResponse = Callable[..., Write]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]


class IdempotencyWSGIMiddleware:
    """Runs each guarded request once per ``(principal, operation, Idempotency-Key)`` and
    answers every duplicate with the first response, byte for byte.

    The options are the ASGI middleware's (`idempo.asgi.IdempotencyMiddleware`), with the
    WSGI ``environ`` where that one takes the ASGI scope.

    Args:
        app: the WSGI app to guard (for Flask, ``flask_app.wsgi_app``).
        store: a sync `Store` or a store URL (``open_store``); migrate SQL stores first.
            Give either this or ``idempotency``.
        idempotency: an `Idempotency` to share with the rest of the app (its policy applies).
        policy: with ``store``: leases, retention and clock; defaults to `Policy()`.
        lease: with ``store``: overrides the policy's lease (seconds or a timedelta). A
            thread renews it every third of a lease while the app runs.
        methods: the guarded methods; others pass through untouched.
        require_key: answer 400 to a guarded request without a key; if False such a
            request passes through without idempotency.
        principal: who asked, from the environ (e.g. ``environ["REMOTE_USER"]``). A string
            is the principal (``""``: anonymous); None means the resolver cannot tell, and
            the request is refused with 401 ``principal-required`` unless
            ``allow_anonymous``. Without a resolver: Flask-Login's ``current_user`` when the
            Flask app has a login manager and the user is authenticated, else a SHA-256 of
            the Authorization header, else anonymous (docs/http.md).
        allow_anonymous: anonymous callers are expected: a resolver's None means the
            default principal instead of a 401, and a cookie-carrying anonymous request is
            not warned of.
        operation: what was asked, from the environ; None or a None result means the
            default, ``"METHOD route-template"`` (see ``routes``) or ``"METHOD path"``.
        routes: where route templates come from: a Flask app (anything with a Werkzeug
            ``url_map``) or a callable ``environ -> template | None``. By default the Flask
            app is found on ``app`` itself or, for ``flask_app.wsgi_app``, its ``__self__``.
        fingerprint_fields: which of ``method``, ``path``, ``query``, ``body`` count.
        fingerprint_headers: request headers that count too (e.g. ``("content-type",)``).
        max_request_bytes: a larger body gets 413 before anything is stored.
        max_response_bytes: a larger response streams to the client and is recorded as a
            FAILED ``response-not-stored`` problem: retries never execute again.
        replay_status_200: replay a stored 2xx response with status 200 (same body).
        fail_open: when the store is unreachable, run the request without idempotency
            instead of answering 503.
        classify: which statuses are stored (COMPLETED/FAILED) and which release the key.
        max_retry_after: the most a 409's ``Retry-After`` says, in seconds.
        store_retry_after: ``Retry-After`` of a 503, in seconds.

    >>> from idempo.stores.memory import MemoryStore
    >>> def app(environ, start_response): ...
    >>> guarded = IdempotencyWSGIMiddleware(app, store=MemoryStore(), lease=10)
    >>> guarded.idempotency.policy.lease
    datetime.timedelta(seconds=10)
    """

    def __init__(
        self,
        app: WSGIApp,
        *,
        store: Store | str | None = None,
        idempotency: Idempotency | None = None,
        policy: Policy | None = None,
        lease: float | timedelta | None = None,
        methods: Collection[str] = ("POST", "PATCH"),
        require_key: bool = True,
        principal: Callable[[Environ], str | None] | None = None,
        allow_anonymous: bool = False,
        operation: Callable[[Environ], str | None] | None = None,
        routes: Any = None,
        fingerprint_fields: Collection[FingerprintField] = DEFAULT_FINGERPRINT_FIELDS,
        fingerprint_headers: Collection[str] = (),
        max_request_bytes: int = DEFAULT_BODY_LIMIT,
        max_response_bytes: int = DEFAULT_BODY_LIMIT,
        replay_status_200: bool = False,
        fail_open: bool = False,
        classify: Classifier = classify_status,
        max_retry_after: int = 5,
        store_retry_after: int = 5,
    ) -> None:
        self.app = app
        self.guard = SyncHttpGuard(
            store=store,
            idempotency=idempotency,
            policy=policy,
            lease=lease,
            methods=methods,
            require_key=require_key,
            allow_anonymous=allow_anonymous,
            fingerprint_fields=fingerprint_fields,
            fingerprint_headers=fingerprint_headers,
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            replay_status_200=replay_status_200,
            fail_open=fail_open,
            classify=classify,
            max_retry_after=max_retry_after,
            store_retry_after=store_retry_after,
            owner=type(self).__name__,
        )
        self.idempotency = self.guard.idempotency
        self.principal = principal
        self.operation = operation
        self.flask_app = _flask_app_of(app)
        if self.flask_app is None and hasattr(routes, "url_map"):
            self.flask_app = routes
        self.routes = routes if routes is not None else self.flask_app

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        guard = self.guard
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        if not guard.guards(method):
            return self.app(environ, start_response)
        headers = request_headers(environ)
        key = guard.key(headers)
        if isinstance(key, Unguarded):
            return self.app(environ, start_response)  # never buffered: no key, none required
        if isinstance(key, HttpResponse):
            return _answer(start_response, key)
        refusal = guard.check_length(headers)
        if refusal is not None:
            return _answer(start_response, refusal)
        body = _read_body(environ, guard.max_request_bytes)
        if body is None:
            return _answer(start_response, guard.too_large())
        # The app reads the body again, from what was read here.
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        path = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
        request = HttpRequest(
            method=method,
            path=path,
            query=str(environ.get("QUERY_STRING", "")).encode("latin-1"),
            headers=headers,
            body=body,
        )
        principal = guard.principal(
            self.principal(environ) if self.principal else NO_RESOLVER,
            lambda: flask_login_user(self.flask_app, environ, body),
            headers,
        )
        if isinstance(principal, HttpResponse):
            return _answer(start_response, principal)
        outcome = guard.reserve(
            key, request, operation=self._operation(environ, method, path), principal=principal
        )
        if isinstance(outcome, HttpResponse):
            return _answer(start_response, outcome)
        if isinstance(outcome, Unguarded):
            return self.app(environ, start_response)  # failing open
        return _execute(self.app, outcome, environ, start_response)

    def _operation(self, environ: Environ, method: str, path: str) -> str:
        chosen = self.operation(environ) if self.operation else None
        if chosen is not None:
            return chosen
        template: str | None = None
        if hasattr(self.routes, "url_map"):
            template = flask_route_template(self.routes, environ)
        elif callable(self.routes):
            template = self.routes(environ)
        return f"{method} {template if template is not None else path}"


def request_headers(environ: Environ) -> list[Header]:
    """The request headers in an environ, as ``(lowercase name, value)`` bytes pairs.

    >>> request_headers({"HTTP_IDEMPOTENCY_KEY": "k", "CONTENT_TYPE": "text/plain"})
    [(b'idempotency-key', b'k'), (b'content-type', b'text/plain')]
    """
    headers: list[Header] = []
    for name, value in environ.items():
        if name.startswith("HTTP_"):
            field = name[5:]
        elif name in ("CONTENT_TYPE", "CONTENT_LENGTH") and value:
            field = name
        else:
            continue
        # PEP 3333: environ strings carry the header bytes as Latin-1.
        headers.append(
            (field.replace("_", "-").lower().encode("latin-1"), str(value).encode("latin-1"))
        )
    return headers


def flask_route_template(flask_app: Any, environ: Environ) -> str | None:
    """The Flask (Werkzeug) rule a request matches (``/payments/<int:id>``), or None.

    Duck-typed on ``url_map.bind_to_environ(environ).match(return_rule=True)``, so idempo
    imports no framework. None (use the raw path) is always safe: more operations never
    replay another endpoint's answer.
    """
    try:
        rule, _ = flask_app.url_map.bind_to_environ(environ).match(return_rule=True)
    except Exception:  # noqa: BLE001 - NotFound, MethodNotAllowed, a redirect: no template
        return None
    template = getattr(rule, "rule", None)
    return template if isinstance(template, str) else None


def flask_login_user(flask_app: Any, environ: Environ, body: bytes) -> str | None:
    """The id (``get_id()``) of the user Flask-Login authenticated for this request; None
    when none is, or there is no Flask app with a login manager, or no Flask-Login.

    The middleware runs outside Flask's request context, so one is pushed here for the
    lookup: the session is opened and the app's user loader runs, as they will again for the
    view, and the app's teardown handlers run when it is popped. The id is read inside it,
    while the user's database session is still open. The context reads a copy of the body,
    so a request loader that reads the form leaves the app's intact.
    """
    if flask_app is None or getattr(flask_app, "login_manager", None) is None:
        return None
    try:
        # By name: an optional dependency, untyped, that only apps using it have.
        flask_login = importlib.import_module("flask_login")
    except ImportError:
        return None
    lookup = {**environ, "wsgi.input": io.BytesIO(body)}
    with flask_app.request_context(lookup):
        user = flask_login.current_user
        if not user.is_authenticated:
            return None
        found = user.get_id()
        return None if found is None else str(found)


def _flask_app_of(app: Any) -> Any:
    # ``flask_app.wsgi_app`` is a bound method: its __self__ is the Flask app.
    for candidate in (app, getattr(app, "__self__", None)):
        if hasattr(candidate, "url_map"):
            return candidate
    return None


def _read_body(environ: Environ, limit: int) -> bytes | None:
    declared = str(environ.get("CONTENT_LENGTH") or "").strip()
    stream = environ.get("wsgi.input")
    if stream is None:
        return b""
    if declared.isdigit():
        return read_limited(stream.read, int(declared), limit)
    # PEP 3333 forbids reading past Content-Length; without one, only a server that marks
    # the input as terminated (chunked bodies) lets the app read to its end.
    if environ.get("wsgi.input_terminated"):
        return read_limited(stream.read, None, limit)
    return b""


def _status_line(status: int) -> str:
    try:
        return f"{status} {HTTPStatus(status).phrase}"
    except ValueError:
        return f"{status} Unknown"


def _answer(start_response: StartResponse, response: HttpResponse) -> list[bytes]:
    start_response(
        _status_line(response.status),
        [(name.decode("latin-1"), value.decode("latin-1")) for name, value in response.headers],
    )
    return [response.body]


class _Capture:
    """The app's ``start_response``: holds status and headers until the response is whole."""

    def __init__(self, run: Run, start_response: StartResponse) -> None:
        self.run = run
        self.start_response = start_response
        self.status: str | None = None
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.write: Write | None = None  # the server's, once streaming

    def __call__(
        self, status: str, headers: list[tuple[str, str]], exc_info: ExcInfo | None = None
    ) -> Write:
        if self.write is not None:
            # Headers already went out: the server raises exc_info, as PEP 3333 asks.
            return self.start_response(status, headers, exc_info)
        # Nothing was sent yet, so a second call (an error page) simply replaces the first.
        self.status, self.headers = status, list(headers)
        return self._write

    def _write(self, data: bytes) -> None:
        # The legacy write() callable: its bytes come before the iterable's.
        if self.write is not None:
            self.write(data)
        else:
            self.add(data)

    def add(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        self.size += len(chunk)

    @property
    def status_code(self) -> int:
        assert self.status is not None
        return int(self.status.split(None, 1)[0])

    def header_bytes(self) -> list[Header]:
        return [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers]

    def send_start(self) -> None:
        assert self.status is not None
        self.write = self.start_response(self.status, self.headers)


def _execute(
    app: WSGIApp, run: Run, environ: Environ, start_response: StartResponse
) -> Iterable[bytes]:
    capture = _Capture(run, start_response)
    limit = run.guard.max_response_bytes
    try:
        result = app(environ, capture)
        iterator = iter(result)
        try:
            for chunk in iterator:
                capture.add(chunk)
                if capture.size > limit and capture.status is not None:
                    # Holding a response this big would hold the client hostage to the
                    # store's limit: stream it, and record that it could not be kept.
                    capture.send_start()
                    return _Streaming(run, capture, iterator, result)
        except BaseException:
            _close(result)
            raise
        _close(result)
    except BaseException as exc:
        run.fail(exc)  # before a whole response: the key is released
        raise
    if capture.status is None:
        # The app never started a response: nothing to store. Hand on what it produced, so
        # the server reacts as it would without idempo.
        run.settle(None)
        return capture.chunks
    body = b"".join(capture.chunks)
    if capture.size > limit:
        run.unkept(capture.status_code, capture.size)
    else:
        run.kept(capture.status_code, capture.header_bytes(), body)
    # The first caller gets the app's own status line and headers, cookies included.
    start_response(capture.status, capture.headers)
    return [body]


def _close(result: Iterable[bytes]) -> None:
    close = getattr(result, "close", None)
    if close is not None:
        close()


class _Streaming:
    """The rest of an over-size response, passed through as the app produces it."""

    def __init__(
        self, run: Run, capture: _Capture, iterator: Iterator[bytes], result: Iterable[bytes]
    ) -> None:
        self._run = run
        self._capture = capture
        self._iterator = iterator
        self._result = result
        self._chunks = self._stream()

    def __iter__(self) -> Iterator[bytes]:
        return self._chunks

    def _stream(self) -> Iterator[bytes]:
        capture = self._capture
        pending = b"".join(capture.chunks)
        capture.chunks = []
        try:
            for chunk in self._iterator:
                yield pending
                pending = chunk
                capture.size += len(chunk)
        except Exception as exc:
            self._run.fail(exc)
            raise
        # One chunk behind, so the record settles before the client sees the end of it.
        self._run.unkept(capture.status_code, capture.size)
        yield pending

    def close(self) -> None:
        try:
            _close(self._result)
        finally:
            # Closed before its end (the client went away): the response was never whole,
            # so the key is released, as when an ASGI send fails.
            self._run.settle(None)
