"""WSGI middleware: SPEC §4's HTTP contract for Flask and any WSGI app.

    from flask import Flask
    from idempo.wsgi import IdempotencyWSGIMiddleware

    app = Flask(__name__)
    app.wsgi_app = IdempotencyWSGIMiddleware(app.wsgi_app, store="sqlite:///idem.db")

Every guarded request (POST and PATCH by default) goes through the shared HTTP lifecycle
(`idempo._http.lifecycle`) on the sync `Idempotency`, with the same options, codec, key
parsing, fingerprint and problems as the ASGI middleware, so both answer the same way, row
for row; this module only translates WSGI. docs/http.md has the table.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Callable, Iterable, Iterator
from http import HTTPStatus
from types import TracebackType
from typing import Any, Unpack

from ._http.keys import Header, headers_named
from ._http.lifecycle import (
    Incoming,
    Lifecycle,
    Run,
    Unguarded,
    read_limited,
    reserve,
)
from ._http.options import HttpOptions, HttpSettings, ShowsOptions
from ._http.response import HttpResponse
from ._http.routes import FlaskRoutes, flask_route_template
from ._reexport import publish
from .errors import ConfigurationError, StoreUnavailableError
from .guard import Attempt

__all__ = [
    "IdempotencyWSGIMiddleware",
    "current_attempt",
    "flask_login_user",
    "flask_route_template",
    "idempotent_connection",
    "request_headers",
]

publish(__name__, flask_route_template)

Environ = dict[str, Any]
ExcInfo = tuple[type[BaseException], BaseException, TracebackType | None]
Write = Callable[[bytes], object]
StartResponse = Callable[..., Write]
WSGIApp = Callable[[Environ, StartResponse], Iterable[bytes]]

# Where a guarded request's attempt and connection are put in the app's environ.
ATTEMPT_ENVIRON_KEY = "idempo.attempt"
CONNECTION_ENVIRON_KEY = "idempo.connection"


class IdempotencyWSGIMiddleware(ShowsOptions):
    """Runs each guarded request once per ``(principal, operation, Idempotency-Key)`` and
    answers every duplicate with the first response, byte for byte.

    Args:
        app: the WSGI app to guard (for Flask, ``flask_app.wsgi_app``).
        options: the `idempo._http.options.HttpOptions` (the ASGI middleware's), with a
            sync `Store` (or a URL for ``open_store``) or an `Idempotency`. The
            ``principal``, ``operation`` and ``routes`` callables take the WSGI environ.
            Without ``principal``: Flask-Login's ``current_user`` when the Flask app has a
            login manager. ``routes`` may also be a Flask app (anything with a Werkzeug
            ``url_map``); by default the Flask app is found on ``app`` itself or, for
            ``flask_app.wsgi_app``, its ``__self__``. ``connection`` is a context manager
            factory (SQLAlchemy's ``engine.connect`` or ``sessionmaker``, a psycopg
            ``ConnectionPool.connection``); the view writes on `idempotent_connection`, so
            its writes and the stored response commit together (docs/http.md).

    >>> from idempo.stores.memory import MemoryStore
    >>> def app(environ, start_response): ...
    >>> guarded = IdempotencyWSGIMiddleware(app, store=MemoryStore(), lease=10)
    >>> guarded.idempotency.policy.lease
    datetime.timedelta(seconds=10)
    """

    def __init__(self, app: WSGIApp, **options: Unpack[HttpOptions[Environ]]) -> None:
        self.app = app
        settings = HttpSettings(options, owner=type(self).__name__)
        routes = settings.routes
        self.flask_app = _flask_app_of(app)
        if self.flask_app is None and hasattr(routes, "url_map"):
            self.flask_app = routes
        if routes is None or hasattr(routes, "url_map"):
            routes = FlaskRoutes(self.flask_app) if self.flask_app is not None else None
        self.routes: Callable[[Environ], Any] | None = routes
        self.settings = settings
        self.lifecycle = Lifecycle(settings, routes)
        self.idempotency = settings.idempotency

    def __call__(self, environ: Environ, start_response: StartResponse) -> Iterable[bytes]:
        lifecycle = self.lifecycle
        settings = lifecycle.settings
        method = str(environ.get("REQUEST_METHOD", "GET")).upper()
        if method not in settings.methods:
            return self.app(environ, start_response)
        headers = request_headers(environ)
        named = headers_named(headers, lifecycle.read_headers)
        path = str(environ.get("SCRIPT_NAME", "")) + str(environ.get("PATH_INFO", ""))
        admission = lifecycle.admit(environ, method, path, named)
        if admission is None:
            return self.app(environ, start_response)  # not guarded: never buffered
        if isinstance(admission, HttpResponse):
            return _answer(start_response, admission)
        body = _read_body(environ, settings.max_request_bytes)
        if body is None:
            return _answer(start_response, lifecycle.too_large())
        # The app reads the body again, from what was read here.
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        query = str(environ.get("QUERY_STRING", "")).encode("latin-1")
        user = lambda: flask_login_user(self.flask_app, environ, body)  # noqa: E731
        request = Incoming(environ, method, path, query, headers, named, body, user)
        key = admission.key or lifecycle.hooked_key(admission, request)
        if key is None:
            return self.app(environ, start_response)  # the hook found no key: none required
        if isinstance(key, HttpResponse):
            return _answer(start_response, key)
        outcome = reserve(lifecycle, key, request, admission.operation)
        if isinstance(outcome, HttpResponse):
            return _answer(start_response, outcome)
        if isinstance(outcome, Unguarded):
            return self.app(environ, start_response)  # failing open
        environ[ATTEMPT_ENVIRON_KEY] = outcome.attempt
        if outcome.conn is not None:
            environ[CONNECTION_ENVIRON_KEY] = outcome.conn
        return _execute(self.app, outcome, environ, start_response)


def idempotent_connection(environ: Environ) -> Any:
    """The connection whose transaction carries this request's idempotency record (for
    Flask: ``idempotent_connection(request.environ)``).

    Raises:
        ConfigurationError: the request is not guarded by a middleware with ``connection=``.
    """
    conn = environ.get(CONNECTION_ENVIRON_KEY)
    if conn is None:
        raise ConfigurationError(
            "no idempotent connection for this request: guard it with"
            " IdempotencyWSGIMiddleware(connection=...) and a guarded method"
        )
    return conn


def current_attempt(environ: Environ) -> Attempt:
    """This request's attempt: its scope (principal, operation, key) and fencing token.

    Raises:
        ConfigurationError: the request is not guarded by the middleware.
    """
    attempt = environ.get(ATTEMPT_ENVIRON_KEY)
    if not isinstance(attempt, Attempt):
        raise ConfigurationError("this request is not guarded by IdempotencyWSGIMiddleware")
    return attempt


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

    def header_bytes(self) -> tuple[Header, ...]:
        return tuple(
            [(name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers]
        )

    def send_start(self) -> None:
        assert self.status is not None
        self.write = self.start_response(self.status, self.headers)


def _execute(
    app: WSGIApp, run: Run, environ: Environ, start_response: StartResponse
) -> Iterable[bytes]:
    capture = _Capture(run, start_response)
    lifecycle = run.lifecycle
    limit = lifecycle.settings.max_response_bytes
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
        kept = run.settle(lifecycle.unkept(capture.status_code, capture.size))
    else:
        kept = run.settle(HttpResponse(capture.status_code, capture.header_bytes(), body))
    if not kept:
        return _answer(start_response, lifecycle.not_committed())
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
        if not self._run.settle(self._run.lifecycle.unkept(capture.status_code, capture.size)):
            # Most of a response whose writes rolled back is out: end it broken, never
            # whole, so the client cannot take it for an answer.
            raise StoreUnavailableError("the writes behind this response did not commit")
        yield pending

    def close(self) -> None:
        try:
            _close(self._result)
        finally:
            # Closed before its end (the client went away): the response was never whole,
            # so the key is released, as when an ASGI send fails.
            self._run.settle(None)
