"""Pure ASGI middleware: SPEC §4's HTTP contract for Starlette, FastAPI and any ASGI app.

    from fastapi import FastAPI
    from idempo import open_async_store
    from idempo.asgi import IdempotencyMiddleware

    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=open_async_store("sqlite:///idem.db"))

Every guarded request (POST and PATCH by default) goes through the shared HTTP lifecycle
(`idempo._http.lifecycle`) on `AsyncIdempotency`, so the middleware is one more surface of
the same guard as the function API, not a second implementation of the contract. This
module only translates ASGI messages. docs/http.md has the full table of answers.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import AsyncExitStack
from typing import Any, Unpack

from ._core.renewal import Renewal as _Renewal  # noqa: F401 - tests switch renewal off here
from ._http.before_endpoint import (
    BEFORE_ENDPOINT_SCOPE_KEY,
    answered_before_endpoint,
    watch_litestar,
    watch_starlette,
)
from ._http.keys import headers_named
from ._http.lifecycle import AsyncRun, Lifecycle, Unguarded, areserve
from ._http.options import HttpOptions, HttpSettings, ShowsOptions
from ._http.response import HttpResponse
from ._http.routes import StarletteRoutes, route_template
from ._reexport import publish
from .errors import IdempotencyError, RequestTooLargeError, StoreUnavailableError

__all__ = ["IdempotencyMiddleware", "answered_before_endpoint", "route_template"]

publish(__name__, route_template, answered_before_endpoint)

ASGIScope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[ASGIScope, Receive, Send], Awaitable[None]]

# Where a guarded request's attempt and connection are put in the app's ASGI scope.
ATTEMPT_SCOPE_KEY = "idempo.attempt"
CONNECTION_SCOPE_KEY = "idempo.connection"
# Extensions that hand the server a body outside http.response.body messages (a file path,
# a zero-copy fd) or add trailers: a guarded app must not see them, or its response could
# not be captured and replayed byte for byte.
_UNCAPTURABLE = frozenset(
    {"http.response.pathsend", "http.response.zerocopysend", "http.response.trailers"}
)


class IdempotencyMiddleware(ShowsOptions):
    """Runs each guarded request once per ``(principal, operation, Idempotency-Key)`` and
    answers every duplicate with the first response, byte for byte.

    Args:
        app: the ASGI app to guard.
        options: the `idempo._http.options.HttpOptions`, with an `AsyncStore` (or a URL for
            ``open_async_store``) or an `AsyncIdempotency`. The ``principal``,
            ``operation`` and ``routes`` callables take the ASGI scope. Without
            ``principal``: ``scope["user"]`` when an outer auth middleware (Starlette's,
            Litestar's) authenticated one. Without ``routes``: Starlette/FastAPI route
            templates, or Litestar's ``path_template``. ``connection`` is an async context
            manager factory (SQLAlchemy's ``engine.connect`` or ``async_sessionmaker``, a
            psycopg ``AsyncConnectionPool.connection``); the endpoint gets the connection
            from `idempo.contrib.starlette.idempotent_connection` (a FastAPI dependency
            too), so its writes and the stored response commit together (docs/http.md).

    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> async def app(scope, receive, send): ...
    >>> guarded = IdempotencyMiddleware(app, store=AsyncMemoryStore(), lease=10)
    >>> guarded.idempotency.policy.lease
    datetime.timedelta(seconds=10)
    """

    def __init__(self, app: ASGIApp, **options: Unpack[HttpOptions[ASGIScope]]) -> None:
        self.app = app
        settings = HttpSettings(options, owner=type(self).__name__, asynchronous=True)
        self.templates = settings.routes or StarletteRoutes(app)
        self.lifecycle = Lifecycle(settings, self.templates)
        self.settings = settings
        self.idempotency = settings.idempotency
        self.methods = settings.methods
        # Which answers are given before the endpoint ran: FastAPI's validation (422) is
        # seen through its exception handler, Litestar's refusals through an exception hook.
        watch_starlette(app)
        watch_litestar(app)
        self.unhooked = True  # until the first guarded run looks for a Litestar app
        self.undocumented = True  # until the first request looks for a FastAPI app's schema

    @property
    def renew_every(self) -> float:
        """How often a running handler's lease is renewed, in seconds (a third of it)."""
        return self.settings.renew_every

    @renew_every.setter
    def renew_every(self, seconds: float) -> None:
        self.settings.renew_every = seconds

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if self.undocumented and scope["type"] == "http":
            self.undocumented = False
            _document_openapi(self, scope)
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        # Everything about one request lives in its own object: the middleware stays
        # stateless and shareable between concurrent requests.
        await _Exchange(self, scope, receive, send).run()


def _document_openapi(middleware: IdempotencyMiddleware, scope: ASGIScope) -> None:
    """A FastAPI app (duck-typed: ``openapi()`` and ``openapi_schema``) documents in its
    OpenAPI schema what ``middleware`` guards, under the server's root path
    (`idempo.contrib.fastapi`)."""
    app = scope.get("app", middleware.app)
    if callable(getattr(app, "openapi", None)) and hasattr(app, "openapi_schema"):
        from .contrib.fastapi import document_served  # noqa: PLC0415 - imports FastAPI

        document_served(app, middleware, str(scope.get("root_path", "")))


class _Exchange:
    """One guarded request: its key, body, run and captured response."""

    # Defaults until the work runs, kept on the class: one request sets few of them.
    body = b""
    run_: AsyncRun | None = None
    start: Message | None = None
    size = 0
    streaming = False

    def __init__(
        self, middleware: IdempotencyMiddleware, scope: ASGIScope, receive: Receive, send: Send
    ) -> None:
        self.mw = middleware
        self.lifecycle = middleware.lifecycle
        self.scope = scope
        self.receive = receive
        self.send = send
        # What the lifecycle reads of the request (this is its `Request`):
        self.raw = scope
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.query = bytes(scope.get("query_string", b""))
        self.headers: list[Any] = list(scope.get("headers") or [])
        self.named = headers_named(self.headers, self.lifecycle.read_headers)

    async def run(self) -> None:
        lifecycle = self.lifecycle
        admission = lifecycle.admit(self.scope, self.method, self.path, self.named)
        if admission is None:
            # Not guarded: excluded, marked so, unrouted (the router answers 404 or 405), or
            # without a key where none is required.
            await self.mw.app(self.scope, self.receive, self.send)
            return
        if isinstance(admission, HttpResponse):
            await self._answer(admission)
            return
        try:
            body = await self._read_body()
        except IdempotencyError as exc:
            await self._answer(lifecycle.problem(exc))
            return
        if body is None:
            return  # the client went away before sending its whole body
        self.body = body
        key = admission.key or lifecycle.hooked_key(admission, self)
        if key is None:  # the hook found no key, and none is required
            await self.mw.app(self.scope, self._receive_body(body), self.send)
            return
        if isinstance(key, HttpResponse):
            await self._answer(key)
            return
        if lifecycle.settings.connection is None:
            await self._guarded(key, admission.operation, body, None)
            return
        # The app's connection, when it carries the record, lives exactly as long as the
        # guarded call: opened after the cheap refusals, closed after the outcome commits.
        async with AsyncExitStack() as connection:
            await self._guarded(key, admission.operation, body, connection)

    async def _guarded(
        self, key: str, operation: str, body: bytes, connection: AsyncExitStack | None
    ) -> None:
        outcome = await areserve(self.lifecycle, connection, key, self, operation)
        if isinstance(outcome, HttpResponse):
            await self._answer(outcome)
        elif isinstance(outcome, Unguarded):
            # Failing open: outside the reservation, so the app's own errors are not chained
            # to the store's.
            await self.mw.app(self.scope, self._receive_body(body), self.send)
        else:
            await self._execute(outcome, body)

    async def _execute(self, run: AsyncRun, body: bytes) -> None:
        self.run_ = run
        self.chunks: list[bytes] = []  # the response held until it is stored
        try:
            await self.mw.app(self._app_scope(run), self._receive_body(body), self._capture)
        except BaseException as exc:
            if run.settled:
                raise
            # Before a whole response: the guard releases the key (transient failure). A
            # refused renewal cancels the work: that cancellation is the lost lease, answered
            # as such rather than passed on to the server as a cancelled request.
            lost = await run.fail(exc)
            if lost is None:
                raise
            if not self.streaming:
                await self._answer(self.lifecycle.problem(lost))
            return
        if not run.settled:
            # The app returned without a whole response: there is nothing to store. Pass on
            # what it did send, so the server reacts as it would without idempo.
            await run.settle(None)
            if self.start is not None and not self.streaming:
                await self.send(self.start)
                body_so_far = b"".join(self.chunks)
                await self.send(
                    {"type": "http.response.body", "body": body_so_far, "more_body": True}
                )

    async def _capture(self, message: Message) -> None:
        """The app's ``send``: holds the response until it is whole and stored, so a client
        that has its answer can count on a retry replaying it."""
        run = self.run_
        assert run is not None
        kind = message["type"]
        if kind == "http.response.start" and self.start is None and not run.settled:
            self.start = message
            return
        if kind != "http.response.body" or self.start is None or run.settled:
            await self.send(message)
            return
        chunk = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        self.size += len(chunk)
        if self.streaming:
            if not more and not await run.settle(self._unkept()):
                # Most of a response whose writes rolled back is out: end it broken, never
                # whole, so the client cannot take it for an answer.
                raise StoreUnavailableError("the writes behind this response did not commit")
            await self.send(message)
            return
        self.chunks.append(chunk)
        if self.size > self.lifecycle.settings.max_response_bytes:
            # Holding a response this big would hold the client hostage to the store's
            # limit: stream it, and record that it could not be kept.
            self.streaming = True
            if not more and not await run.settle(self._unkept()):
                await self._answer(self.lifecycle.not_committed())
                return
            held, self.chunks = b"".join(self.chunks), []
            await self.send(self.start)
            await self.send({"type": "http.response.body", "body": held, "more_body": more})
            return
        if more:
            return
        response = HttpResponse(
            int(self.start["status"]),
            tuple([(bytes(name), bytes(value)) for name, value in self.start.get("headers", [])]),
            b"".join(self.chunks),
        )
        if not await run.settle(response):
            await self._answer(self.lifecycle.not_committed())
            return
        await self.send(self.start)
        await self.send({"type": "http.response.body", "body": response.body, "more_body": False})

    def _unkept(self) -> Any:
        assert self.start is not None
        return self.lifecycle.unkept(int(self.start["status"]), self.size)

    async def _read_body(self) -> bytes | None:
        # A declared Content-Length over the limit was refused already (`Lifecycle.admit`).
        limit = self.lifecycle.settings.max_request_bytes
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = bytes(message.get("body", b""))
            size += len(chunk)
            if size > limit:
                raise RequestTooLargeError(limit)
            if message.get("more_body", False):
                chunks.append(chunk)
            elif not chunks:
                return chunk  # the usual request: its whole body in one message
            else:
                chunks.append(chunk)
                return b"".join(chunks)

    def _receive_body(self, body: bytes) -> Receive:
        """A ``receive`` that hands the app the body already read, then the client's own."""
        delivered = False

        async def receive() -> Message:
            nonlocal delivered
            if delivered:
                return await self.receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        return receive

    def _app_scope(self, run: AsyncRun) -> ASGIScope:
        scope = dict(self.scope)
        # What the endpoint may use: idempo.contrib.starlette reads these.
        scope[ATTEMPT_SCOPE_KEY] = run.attempt
        scope[BEFORE_ENDPOINT_SCOPE_KEY] = run.attempt  # `answered_before_endpoint` marks it
        if self.mw.unhooked:
            # Litestar runs a middleware per route, inside its app: its first run finds it.
            self.mw.unhooked = False
            watch_litestar(scope.get("litestar_app"))
        if run.conn is not None:
            scope[CONNECTION_SCOPE_KEY] = run.conn
        extensions = scope.get("extensions")
        if extensions:
            scope["extensions"] = {
                name: value for name, value in extensions.items() if name not in _UNCAPTURABLE
            }
        return scope

    def user(self) -> Any:
        """The user an outer auth middleware (Starlette's, Litestar's) authenticated."""
        return self.scope.get("user")

    async def _answer(self, response: HttpResponse) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": list(response.headers),
            }
        )
        await self.send({"type": "http.response.body", "body": response.body, "more_body": False})
