"""Pure ASGI middleware: SPEC §4's HTTP contract for Starlette, FastAPI and any ASGI app.

    from fastapi import FastAPI
    from idempo import open_async_store
    from idempo.asgi import IdempotencyMiddleware

    app = FastAPI()
    app.add_middleware(IdempotencyMiddleware, store=open_async_store("sqlite:///idem.db"))

Every guarded request (POST and PATCH by default) goes through `AsyncIdempotency.once` with
an HTTP codec, so the middleware is one more surface of the same guard as the function API,
not a second implementation of the contract. docs/http.md has the full table of answers.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, MutableMapping
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from datetime import timedelta
from typing import Any

from ._core.renewal import Renewal as _Renewal
from ._http import (
    DEFAULT_BODY_LIMIT,
    DEFAULT_FINGERPRINT_FIELDS,
    KEY_HEADER,
    NO_RESOLVER,
    Classifier,
    FingerprintField,
    HttpCodec,
    HttpResponse,
    Principals,
    UnkeptResponse,
    canonical_parts,
    check_options,
    classify_status,
    headers_named,
    http_policy,
    parse_key,
    problem,
    problem_for,
)
from .errors import (
    ConfigurationError,
    CorruptRecordError,
    FencedError,
    IdempotencyError,
    MissingKeyError,
    RequestTooLargeError,
    ResponseTooLargeError,
    SchemaMissingError,
    StoreError,
    StoreUnavailableError,
)
from .guard import AsyncAttempt, AsyncIdempotency
from .policy import Policy
from .stores import AsyncStore, open_async_store
from .stores.base import AsyncTransactionalStore, Mode

__all__ = ["IdempotencyMiddleware", "route_template"]

ASGIScope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[ASGIScope, Receive, Send], Awaitable[None]]

logger = logging.getLogger("idempo.http")

_MIB = DEFAULT_BODY_LIMIT
# Where a guarded request's attempt and connection are put in the app's ASGI scope.
ATTEMPT_SCOPE_KEY = "idempo.attempt"
CONNECTION_SCOPE_KEY = "idempo.connection"
# Extensions that hand the server a body outside http.response.body messages (a file path,
# a zero-copy fd) or add trailers: a guarded app must not see them, or its response could
# not be captured and replayed byte for byte.
_UNCAPTURABLE = frozenset(
    {"http.response.pathsend", "http.response.zerocopysend", "http.response.trailers"}
)
# The request headers the middleware reads itself, found in one pass over the request's.
_READ_HEADERS = frozenset({KEY_HEADER, b"content-length", b"authorization", b"cookie"})


class IdempotencyMiddleware:
    """Runs each guarded request once per ``(principal, operation, Idempotency-Key)`` and
    answers every duplicate with the first response, byte for byte.

    Args:
        app: the ASGI app to guard.
        store: an `AsyncStore` or a store URL (``open_async_store``); migrate SQL stores
            first. Give either this or ``idempotency``.
        idempotency: an `AsyncIdempotency` to share with the rest of the app (its policy
            applies as is).
        policy: with ``store``: leases, retention and clock; defaults to `Policy()`.
        lease: with ``store``: overrides the policy's lease (seconds or a timedelta). The
            middleware renews it every third of a lease while the handler runs.
        methods: the guarded methods; others pass through untouched.
        require_key: answer 400 to a guarded request without a key; if False such a
            request passes through without idempotency.
        principal: who asked, from the ASGI scope (e.g. the user id an outer auth
            middleware set). A string is the principal (``""``: anonymous); None means the
            resolver cannot tell, and the request is refused with 401 ``principal-required``
            unless ``allow_anonymous``. Without a resolver: ``scope["user"]`` when an
            outer auth middleware (Starlette's, Litestar's) authenticated one, else a
            SHA-256 of the Authorization header, else anonymous (docs/http.md).
        allow_anonymous: anonymous callers are expected: a resolver's None means the
            default principal instead of a 401, and a cookie-carrying anonymous request is
            not warned of.
        operation: what was asked, from the scope; None or a None result means the default,
            ``"METHOD route-template"`` (Starlette/FastAPI routes) or ``"METHOD path"``.
        fingerprint_fields: which of ``method``, ``path``, ``query``, ``body`` count in the
            request fingerprint.
        fingerprint_headers: request headers that count too (e.g. ``("content-type",)``).
        max_request_bytes: a larger body gets 413 before anything is stored.
        max_response_bytes: a larger response is streamed to the client as it comes and
            recorded as a FAILED ``response-not-stored`` problem: retries get that problem,
            never a second execution (docs/http.md).
        replay_status_200: replay a stored 2xx response with status 200 (the body is the same).
        fail_open: when the store is unreachable, run the request without idempotency
            instead of answering 503.
        classify: which response statuses are stored (COMPLETED/FAILED) and which release
            the key (None); defaults to SPEC §2 rule 7.
        max_retry_after: the most a 409's ``Retry-After`` says, in seconds.
        store_retry_after: ``Retry-After`` of a 503, in seconds.
        connection: opens the app's database connection for one request (an async context
            manager factory: SQLAlchemy's ``engine.connect`` or ``async_sessionmaker``, a
            psycopg ``AsyncConnectionPool.connection``). The record then rides on that
            connection's transaction, and the endpoint gets the connection from
            `idempo.contrib.starlette.idempotent_connection` (a FastAPI dependency too), so
            its writes and the stored response commit together (docs/http.md).
        mode: with ``connection``: ``"transactional"`` (reservation, writes and response
            commit in one transaction; a duplicate waits on the row lock, then gets 409) or
            ``"leased"`` (the reservation commits first, so a duplicate gets 409 at once; the
            writes commit with the fenced response at the end — for handlers that call out
            to other systems).

    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> async def app(scope, receive, send): ...
    >>> guarded = IdempotencyMiddleware(app, store=AsyncMemoryStore(), lease=10)
    >>> guarded.idempotency.policy.lease
    datetime.timedelta(seconds=10)
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: AsyncStore | str | None = None,
        idempotency: AsyncIdempotency | None = None,
        policy: Policy | None = None,
        lease: float | timedelta | None = None,
        methods: Collection[str] = ("POST", "PATCH"),
        require_key: bool = True,
        principal: Callable[[ASGIScope], str | None] | None = None,
        allow_anonymous: bool = False,
        operation: Callable[[ASGIScope], str | None] | None = None,
        fingerprint_fields: Collection[FingerprintField] = DEFAULT_FINGERPRINT_FIELDS,
        fingerprint_headers: Collection[str] = (),
        max_request_bytes: int = _MIB,
        max_response_bytes: int = _MIB,
        replay_status_200: bool = False,
        fail_open: bool = False,
        classify: Classifier = classify_status,
        max_retry_after: int = 5,
        store_retry_after: int = 5,
        connection: Callable[[], AbstractAsyncContextManager[Any]] | None = None,
        mode: Mode = "transactional",
    ) -> None:
        check_options(
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            max_retry_after=max_retry_after,
            store_retry_after=store_retry_after,
            fingerprint_fields=fingerprint_fields,
        )
        self.app = app
        self.idempotency = _guard(store, idempotency, policy, lease, max_response_bytes)
        self.methods = frozenset(method.upper() for method in methods)
        self.require_key = require_key
        self.principal = principal
        self.principals = Principals(allow_anonymous=allow_anonymous, owner=type(self).__name__)
        self.operation = operation
        self.fingerprint_fields = tuple(fingerprint_fields)
        self.fingerprint_headers = tuple(name.lower() for name in fingerprint_headers)
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self.replay_status_200 = replay_status_200
        self.fail_open = fail_open
        self.codec = HttpCodec(classify)
        self.templates = _RouteTemplates()
        self.max_retry_after = max_retry_after
        self.store_retry_after = store_retry_after
        self.renew_every = self.idempotency.policy.lease.total_seconds() / 3
        if mode not in ("transactional", "leased"):
            raise ConfigurationError(f"mode must be 'transactional' or 'leased', not {mode!r}")
        if connection is not None and not isinstance(
            self.idempotency.store, AsyncTransactionalStore
        ):
            raise ConfigurationError(
                f"{type(self.idempotency.store).__name__} cannot join the app's transaction;"
                " connection= needs a SQL store"
            )
        if connection is not None and fail_open:
            raise ConfigurationError(
                "fail_open cannot go with connection=: the endpoint's writes ride on the"
                " record's transaction, so there is nothing to run unguarded"
            )
        self.connection = connection
        self.mode: Mode = mode

    async def __call__(self, scope: ASGIScope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        # Everything about one request lives in its own object: the middleware stays
        # stateless and shareable between concurrent requests.
        await _Exchange(self, scope, receive, send).run()

    def problem(self, exc: IdempotencyError) -> HttpResponse:
        """The problem response for a refusal, with this middleware's Retry-After settings."""
        return problem_for(
            exc, max_retry_after=self.max_retry_after, store_retry_after=self.store_retry_after
        )

    def not_committed(self) -> HttpResponse:
        """The answer when, on the app's connection, the outcome failed to commit (a lost
        lease, a store fault, a constraint checked at commit): the writes rolled back with
        it, so the app's own response would describe work that was not kept."""
        return problem(
            503,
            "not-committed",
            "Request not committed",
            "The request ran, but its writes and its stored response did not commit, so "
            "nothing was kept. Retry with the same key.",
            headers=[(b"retry-after", str(self.store_retry_after).encode())],
        )


def _guard(
    store: AsyncStore | str | None,
    idempotency: AsyncIdempotency | None,
    policy: Policy | None,
    lease: float | timedelta | None,
    max_response_bytes: int,
) -> AsyncIdempotency:
    if (store is None) == (idempotency is None):
        raise ConfigurationError("give IdempotencyMiddleware either store= or idempotency=")
    if idempotency is not None:
        if policy is not None or lease is not None:
            raise ConfigurationError("policy= and lease= go with store=; idempotency= has its own")
        return idempotency
    if isinstance(store, str):
        store = open_async_store(store)
    if not isinstance(store, AsyncStore):
        raise ConfigurationError(
            f"IdempotencyMiddleware needs an AsyncStore (open_async_store), not "
            f"{type(store).__name__}"
        )
    return AsyncIdempotency(store, http_policy(policy, lease, max_response_bytes))


async def _open(
    stack: AsyncExitStack, connection: Callable[[], AbstractAsyncContextManager[Any]]
) -> Any:
    try:
        return await stack.enter_async_context(connection())
    except Exception as exc:
        # The database the record rides on is the store: down means 503, as for any store.
        raise StoreUnavailableError(f"could not open the app's connection: {exc}") from exc


class _Exchange:
    """One guarded request: its key, body, attempt and captured response."""

    def __init__(
        self, middleware: IdempotencyMiddleware, scope: ASGIScope, receive: Receive, send: Send
    ) -> None:
        self.mw = middleware
        self.scope = scope
        self.receive = receive
        self.send = send
        self.headers: list[Any] = list(scope.get("headers") or [])
        self.named = headers_named(self.headers, _READ_HEADERS)
        # Set once the work runs:
        self.once: Any = None
        self.conn: Any = None
        self.attempt: AsyncAttempt | None = None
        self.renewal: _Renewal | None = None
        self.start: Message | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.streaming = False
        self.settled = False

    async def run(self) -> None:
        mw = self.mw
        try:
            key = parse_key(self.named.get(KEY_HEADER, []))
        except IdempotencyError as exc:
            await self._answer(mw.problem(exc))
            return
        if key is None and not mw.require_key:
            await mw.app(self.scope, self.receive, self.send)
            return
        try:
            if key is None:
                raise MissingKeyError("the Idempotency-Key header is missing")
            body = await self._read_body()
        except IdempotencyError as exc:
            await self._answer(mw.problem(exc))
            return
        if body is None:
            return  # the client went away before sending its whole body
        if mw.connection is None:
            await self._guarded(key, body, None)
            return
        # The app's connection, when it carries the record, lives exactly as long as the
        # guarded call: opened after the cheap refusals, closed after the outcome commits.
        async with AsyncExitStack() as connection:
            await self._guarded(key, body, connection)

    async def _guarded(self, key: str, body: bytes, connection: AsyncExitStack | None) -> None:
        attempt = await self._reserve(key, body, connection)
        if attempt is None:
            return
        if attempt.replayed:
            await self.once.__aexit__(None, None, None)
            await self._answer(attempt.result.replay(status_200=self.mw.replay_status_200))
            return
        await self._execute(attempt, body)

    async def _reserve(
        self, key: str, body: bytes, connection: AsyncExitStack | None
    ) -> AsyncAttempt | None:
        """The attempt to run or replay, or None once the request has been answered."""
        mw = self.mw
        try:
            principal = self._principal()
            if connection is not None and mw.connection is not None:
                self.conn = await _open(connection, mw.connection)
            self.once = mw.idempotency.once(
                key,
                operation=self._operation(),
                payload=self._payload(body),
                principal=principal,
                conn=self.conn,
                mode=mw.mode,
                codec=mw.codec,
            )
            attempt: AsyncAttempt = await self.once.__aenter__()
        except (CorruptRecordError, SchemaMissingError) as exc:
            # Never fail open here: the record may say the work already ran, and a missing
            # schema is a deployment to fix, not an outage to run through.
            logger.error("idempo: %s", exc)  # noqa: TRY400 - the error is the message
            await self._answer(mw.problem(exc))
            return None
        except StoreError as exc:
            if mw.fail_open:
                logger.warning("idempo: store unavailable, running the request unguarded: %s", exc)
            else:
                await self._answer(mw.problem(exc))
                return None
        except IdempotencyError as exc:
            await self._answer(mw.problem(exc))
            return None
        else:
            return attempt
        # Failing open: outside the except block, so the app's own errors are not chained
        # to the store's.
        await mw.app(self.scope, self._receive_body(body), self.send)
        return None

    async def _execute(self, attempt: AsyncAttempt, body: bytes) -> None:
        self.attempt = attempt
        self.renewal = _Renewal(attempt, self.mw.renew_every, logger)
        self.renewal.start()
        try:
            await self.mw.app(self._app_scope(), self._receive_body(body), self._capture)
        except BaseException as exc:
            if self.settled:
                raise
            # Before a whole response: the guard releases the key (transient failure).
            self.settled = True
            await self.renewal.stop()
            # A refused renewal cancels the work: that cancellation is the lost lease,
            # answered as such rather than passed on to the server as a cancelled request.
            lost = self.renewal.fenced(exc)
            await self.once.__aexit__(type(lost), lost, lost.__traceback__)
            if not isinstance(lost, FencedError):
                raise
            if not self.streaming:
                await self._answer(self.mw.problem(lost))
            return
        finally:
            await self.renewal.stop()
        if not self.settled:
            # The app returned without a whole response: there is nothing to store. Pass on
            # what it did send, so the server reacts as it would without idempo.
            await self._settle(None)
            if self.start is not None and not self.streaming:
                await self.send(self.start)
                body_so_far = b"".join(self.chunks)
                await self.send(
                    {"type": "http.response.body", "body": body_so_far, "more_body": True}
                )

    async def _capture(self, message: Message) -> None:
        """The app's ``send``: holds the response until it is whole and stored, so a client
        that has its answer can count on a retry replaying it."""
        kind = message["type"]
        if kind == "http.response.start" and self.start is None and not self.settled:
            self.start = message
            return
        if kind != "http.response.body" or self.start is None or self.settled:
            await self.send(message)
            return
        chunk = bytes(message.get("body", b""))
        more = bool(message.get("more_body", False))
        self.size += len(chunk)
        if self.streaming:
            if not more and not await self._settle(self._unkept()):
                # Most of a response whose writes rolled back is out: end it broken, never
                # whole, so the client cannot take it for an answer.
                raise StoreUnavailableError("the writes behind this response did not commit")
            await self.send(message)
            return
        self.chunks.append(chunk)
        if self.size > self.mw.max_response_bytes:
            # Holding a response this big would hold the client hostage to the store's
            # limit: stream it, and record that it could not be kept.
            self.streaming = True
            if not more and not await self._settle(self._unkept()):
                await self._answer(self.mw.not_committed())
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
        if not await self._settle(response):
            await self._answer(self.mw.not_committed())
            return
        await self.send(self.start)
        await self.send({"type": "http.response.body", "body": response.body, "more_body": False})

    def _unkept(self) -> UnkeptResponse:
        assert self.start is not None
        return UnkeptResponse(int(self.start["status"]), self.size, self.mw.max_response_bytes)

    async def _settle(self, result: HttpResponse | UnkeptResponse | None) -> bool:
        """Store the outcome (or release the key), before the client sees the end of it.

        False when recording failed. On the app's connection its writes then rolled back
        with the record, so the response it made must not be sent.
        """
        assert self.attempt is not None
        assert self.renewal is not None
        self.settled = True
        await self.renewal.stop()
        self.attempt.result = result
        try:
            await self.once.__aexit__(None, None, None)
        except ResponseTooLargeError as exc:
            # The policy's own limit (a shared guard's) was stricter than the middleware's:
            # the guard recorded a response-not-stored failure; the client still gets it all.
            logger.warning(
                "idempo: the response for key %r is too large to store: %s",
                self.attempt.scope.key,
                exc,
            )
        except IdempotencyError as exc:
            if self.conn is not None:
                logger.warning(
                    "idempo: the outcome for key %r did not commit; nothing was kept: %s",
                    self.attempt.scope.key,
                    exc,
                )
                return False
            # The work ran and the client is owed its answer; only the record failed (a
            # store fault, a lost lease). A retry may execute again once the lease ends.
            logger.warning(
                "idempo: the response for key %r is sent but could not be recorded: %s",
                self.attempt.scope.key,
                exc,
            )
        return True

    async def _read_body(self) -> bytes | None:
        limit = self.mw.max_request_bytes
        declared = self.named.get(b"content-length")
        if declared and declared[0].strip().isdigit() and int(declared[0]) > limit:
            raise RequestTooLargeError(limit)
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
            chunks.append(chunk)
            if not message.get("more_body", False):
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

    def _app_scope(self) -> ASGIScope:
        scope = dict(self.scope)
        # What the endpoint may use: idempo.contrib.starlette reads these.
        scope[ATTEMPT_SCOPE_KEY] = self.attempt
        if self.conn is not None:
            scope[CONNECTION_SCOPE_KEY] = self.conn
        extensions = scope.get("extensions")
        if extensions:
            scope["extensions"] = {
                name: value for name, value in extensions.items() if name not in _UNCAPTURABLE
            }
        return scope

    def _operation(self) -> str:
        chosen = self.mw.operation(self.scope) if self.mw.operation else None
        if chosen is not None:
            return chosen
        method = self.scope["method"]
        template = self.mw.templates.find(self.scope.get("app", self.mw.app), self.scope)
        return f"{method} {template if template is not None else self.scope['path']}"

    def _principal(self) -> str:
        mw = self.mw
        return mw.principals.resolve(
            mw.principal(self.scope) if mw.principal else NO_RESOLVER,
            lambda: self.scope.get("user"),
            self.named.get(b"authorization", []),
            b"cookie" in self.named,
        )

    def _payload(self, body: bytes) -> bytes:
        scope = self.scope
        return canonical_parts(
            scope["method"],
            scope["path"],
            bytes(scope.get("query_string", b"")),
            self.headers,
            body,
            self.mw.fingerprint_fields,
            self.mw.fingerprint_headers,
        )

    async def _answer(self, response: HttpResponse) -> None:
        await self.send(
            {
                "type": "http.response.start",
                "status": response.status,
                "headers": list(response.headers),
            }
        )
        await self.send({"type": "http.response.body", "body": response.body, "more_body": False})


def route_template(app: Any, scope: ASGIScope) -> str | None:
    """The route template a request matches (``/payments/{id}``), or None.

    A framework that routes before its middleware runs says so in the scope: Litestar sets
    ``path_template`` (its app-level ``middleware=`` run per route). Otherwise works on
    anything shaped like a Starlette router (Starlette, FastAPI): ``routes`` whose items
    answer ``matches(scope)`` and carry a ``path``; mounts and FastAPI's included routers are
    searched too. Found by duck typing, so idempo imports no framework. None (use the raw
    path) is always safe: more operations never replay another endpoint's answer.
    """
    routed = scope.get("path_template")
    if isinstance(routed, str) and routed:
        return routed
    routes = _routes(app)
    if not routes:
        return None
    return _match(routes, dict(scope), "")


def _routes(app: Any) -> Any:
    routes = getattr(app, "routes", None)
    if routes is None:
        routes = getattr(getattr(app, "router", None), "routes", None)
    return routes


# The matches() of route classes that read nothing of the scope but its type, method, path
# and root path: Starlette's and FastAPI's own (not Host, which reads the Host header).
_PATH_MATCHERS = frozenset(
    {
        "starlette.routing.Route.matches",
        "starlette.routing.Mount.matches",
        "starlette.routing.WebSocketRoute.matches",
        "fastapi.routing.APIRoute.matches",
        "fastapi.routing.APIWebSocketRoute.matches",
    }
)


def _decided_by_path(routes: Any) -> bool:
    """True if the method, path and root path alone decide which of ``routes`` a request
    matches: then `route_template` may be remembered per (method, root path, path). Walks
    the routes as `_try` does."""
    for route in routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if callable(contexts):
            rewritten = [getattr(context, "starlette_route", None) for context in contexts()]
            # Contexts without a rewritten route are matched on their path regex and methods.
            if not _decided_by_path([found for found in rewritten if found is not None]):
                return False
            continue
        matches = getattr(type(route), "matches", None)
        name = f"{getattr(matches, '__module__', '')}.{getattr(matches, '__qualname__', '')}"
        if name not in _PATH_MATCHERS:
            return False
        inner = getattr(route, "routes", None) if hasattr(route, "routes") else None
        if inner and not _decided_by_path(inner):
            return False
    return True


class _RouteTemplates:
    """`route_template`, remembered per (method, root path, path) for an app whose routes
    are matched on those alone (`_decided_by_path`): matching walks every route before the
    one that matches, on every request.

    A different app, routes list or number of routes starts afresh, so routes added at run
    time are seen (inside a mount they are not: a template there is as the first request to
    the path found it). At most `LIMIT` paths are kept; then the memory starts again.
    """

    LIMIT = 1024

    def __init__(self) -> None:
        # One tuple, replaced whole: concurrent requests never see half of a reset.
        self._state: tuple[Any, Any, int, dict[tuple[str, str, str], str | None] | None] = (
            None,
            None,
            0,
            None,
        )

    def find(self, app: Any, scope: ASGIScope) -> str | None:
        """`route_template` of ``app`` for ``scope``."""
        routes = _routes(app)
        if not routes or "path_template" in scope:
            return route_template(app, scope)
        known_app, known_routes, count, known = self._state
        if app is not known_app or routes is not known_routes or len(routes) != count:
            known = {} if _decided_by_path(routes) else None
            self._state = (app, routes, len(routes), known)
        if known is None:
            return route_template(app, scope)
        where = (scope["method"], scope.get("root_path", ""), scope["path"])
        try:
            return known[where]
        except KeyError:
            pass
        template = route_template(app, scope)
        if len(known) >= self.LIMIT:
            known.clear()
        known[where] = template
        return template


# Starlette's Match enum, by name: FULL (path and method), PARTIAL (path only: the app will
# answer 405, under the same template), NONE.
_FULL, _PARTIAL = "FULL", "PARTIAL"


def _match(routes: Any, scope: dict[str, Any], prefix: str) -> str | None:
    # Starlette's Router takes the first FULL match, else the first PARTIAL one.
    partial: str | None = None
    for route in routes:
        found = _try(route, scope, prefix)
        if found is None:
            continue
        kind, template = found
        if kind == _FULL:
            return template
        if partial is None:
            partial = template
    return partial


def _try(route: Any, scope: dict[str, Any], prefix: str) -> tuple[str, str | None] | None:
    """How one route matches: (FULL or PARTIAL, its template), or None."""
    contexts = getattr(route, "effective_route_contexts", None)
    if callable(contexts):
        # FastAPI's included router: its routes as included (prefix applied), not as written.
        return _try_contexts(contexts(), scope, prefix)
    matches = getattr(route, "matches", None)
    if not callable(matches):
        return None
    try:
        match, child = matches(scope)
    except Exception:  # noqa: BLE001 - a route we cannot ask is one we skip
        return None
    kind = getattr(match, "name", "")
    if kind not in (_FULL, _PARTIAL):
        return None
    path = prefix + str(getattr(route, "path", ""))
    if not hasattr(route, "routes"):
        return kind, path
    # A Mount: its own routes decide. A mounted app we cannot see into has no template.
    inner = getattr(route, "routes", None)
    if not inner:
        return kind, None
    return kind, _match(inner, {**scope, **dict(child or {})}, path)


def _try_contexts(
    contexts: Any, scope: dict[str, Any], prefix: str
) -> tuple[str, str | None] | None:
    partial: tuple[str, str | None] | None = None
    for context in contexts:
        rewritten = getattr(context, "starlette_route", None)
        if rewritten is not None:
            # A plain route or mount, rebuilt with the inclusion's prefix.
            found = _try(rewritten, scope, prefix)
        else:
            found = _try_path_regex(context, scope, prefix)
        if found is not None and found[0] == _FULL:
            return found
        if found is not None and partial is None:
            partial = found
    return partial


def _try_path_regex(route: Any, scope: dict[str, Any], prefix: str) -> tuple[str, str] | None:
    regex = getattr(route, "path_regex", None)
    template = getattr(route, "path_format", None)
    if regex is None or not isinstance(template, str) or not regex.match(_route_path(scope)):
        return None
    methods = getattr(route, "methods", None)
    kind = _FULL if not methods or scope.get("method") in methods else _PARTIAL
    return kind, prefix + template


def _route_path(scope: dict[str, Any]) -> str:
    """The path below the scope's root path, as Starlette's routers see it."""
    path = str(scope.get("path", ""))
    root = str(scope.get("root_path", ""))
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :]
    return path
