"""One guarded HTTP request, from its headers to its settled record: written once for every
adapter, with its sync and async faces side by side.

`Lifecycle` is the sans-I/O half: every decision (the key, the size limits, who asked, what
a refusal answers, what a failed recording means) with no I/O and no framework. The faces
do the guard's I/O around it, `reserve` / `Run` for thread-per-request servers (WSGI,
Django) and `areserve` / `AsyncRun` for asyncio ones (ASGI, aiohttp). An adapter reads the
request, calls the face, runs its app and hands the whole response to ``run.settle``::

    lifecycle = Lifecycle(HttpSettings(options, owner="Mine", asynchronous=True), routes)
    named = headers_named(headers, lifecycle.read_headers)
    admission = lifecycle.admit(raw, method, path, named)  # an Admission, a 400, or None
    request = Incoming(raw, method, path, query, headers, named, body, user)
    key = admission.key or lifecycle.hooked_key(admission, request)
    outcome = await areserve(lifecycle, stack, key, request, admission.operation)
    # an HttpResponse to send (replay, refusal), Unguarded (fail open), or an AsyncRun:
    response = await app(...)
    if not await outcome.settle(response):
        response = lifecycle.not_committed()
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import AsyncExitStack, ExitStack
from dataclasses import dataclass
from typing import Any, Protocol

from .._core.keys import Scope, validate_key
from .._core.renewal import Renewal, ThreadRenewal
from ..errors import (
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
from ..events import Kind, key_digest, scrub
from ..guard import AsyncHandle, Handle
from .fingerprint import canonical_parts
from .keys import KEY_HEADER, Header, parse_key
from .options import HttpSettings
from .per_route import KeyHook, Routed, RouteRule
from .principals import NO_RESOLVER
from .problems import problem, problem_for
from .response import HttpResponse, UnkeptResponse
from .routes import NO_ROUTE, RouteTemplate
from .stored_text import MAX_STORED_TEXT, stored_text

__all__ = [
    "READ_HEADERS",
    "Admission",
    "AsyncRun",
    "Incoming",
    "Lifecycle",
    "Request",
    "Run",
    "Unguarded",
    "areserve",
    "read_limited",
    "reserve",
]

logger = logging.getLogger("idempo.http")

READ_HEADERS = frozenset(
    {KEY_HEADER, b"content-length", b"content-type", b"authorization", b"cookie"}
)
"""The request headers the lifecycle reads: an adapter finds them in one pass
(`idempo._http.keys.headers_named`) and hands them on as ``named`` (the fingerprint reads
the body's type there, not in a second pass over the headers)."""

Result = HttpResponse | UnkeptResponse | None
"""What a run settles with: a whole response, one too large to keep, or None (no response:
the key is released)."""


class Request(Protocol):
    """One request as the lifecycle reads it, whatever the framework.

    Attributes:
        raw: the framework's own request (ASGI scope, WSGI environ, Django or aiohttp
            request): what the app's ``principal=`` and ``operation=`` callables take.
        headers: every request header, ``(lowercase name, value)`` bytes.
        named: the `READ_HEADERS` among them (`idempo._http.keys.headers_named`).
    """

    @property
    def raw(self) -> Any: ...
    @property
    def method(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def query(self) -> bytes: ...
    @property
    def headers(self) -> Sequence[Header]: ...
    @property
    def named(self) -> Mapping[bytes, list[bytes]]: ...
    @property
    def body(self) -> bytes: ...

    def user(self) -> Any:
        """The user the framework authenticated, None when it cannot tell."""


@dataclass(slots=True)
class Incoming:
    """A `Request` for adapters that have nothing better to hand (see `Request`)."""

    raw: Any
    method: str
    path: str
    query: bytes
    headers: Sequence[Header]
    named: Mapping[bytes, list[bytes]]
    body: bytes
    user: Callable[[], Any]


@dataclass(slots=True)  # not frozen: one is made per request, and frozen costs its __init__
class Admission:
    """A request `Lifecycle.admit` guards: its operation, and its key (None when ``hook``,
    the ``key_from`` of its route or middleware, reads it once the body is read)."""

    operation: str
    key: str | None
    hook: KeyHook | None
    required: bool


@dataclass(frozen=True, slots=True)
class Unguarded:
    """Run the request without idempotency: no key and none required, or the store is down
    and the middleware fails open. ``body`` is what was already read of the request."""

    body: bytes | None = None


class Lifecycle:
    """What one middleware decides about its requests, with no I/O (see the module's)."""

    def __init__(self, settings: HttpSettings, routes: RouteTemplate | None = None) -> None:
        self.settings = settings
        self.idempotency = settings.idempotency
        # The route-template hook (`idempo._http.routes`): the app's ``routes=`` or the
        # adapter's default for its framework, called with the framework's request.
        self.routes = routes
        # The headers a request is read for: the key's (``key_header=``) and the size, type,
        # authorization and cookie ones.
        self.read_headers = (READ_HEADERS - {KEY_HEADER}) | {settings.key_header}

    def problem(self, exc: IdempotencyError) -> HttpResponse:
        """The problem response for a refusal, with this middleware's Retry-After settings."""
        settings = self.settings
        return problem_for(
            exc,
            max_retry_after=settings.max_retry_after,
            store_retry_after=settings.store_retry_after,
            in_progress_status=settings.in_progress_status,
            mismatch_status=settings.mismatch_status,
        )

    def admit(
        self, raw: Any, method: str, path: str, named: Mapping[bytes, Sequence[bytes]]
    ) -> Admission | HttpResponse | None:
        """Whether a request of a guarded method is guarded, before its body is read: its
        `Admission` (its operation, and its key unless a ``key_from`` hook reads it from the
        body); the 400 to answer (no key, or a malformed one) or the 413 (a declared
        ``Content-Length`` over ``max_request_bytes``); or None to pass it through untouched
        (an excluded path, a route marked `not_idempotent`, no route at all, or no key where
        none is required)."""
        settings = self.settings
        paths = settings.paths
        if not paths.everything and not paths.guards(path):
            return None
        operation, rule = self.route(raw, method, path)
        if operation is None:
            return None  # no route matches: the router answers (404, 405), nothing is stored
        required, hook = settings.require_key, settings.key_from
        if rule is not None:
            if not rule.guarded:
                return None
            if rule.require_key is not None:
                required = rule.require_key
            hook = rule.key_from or hook
        if hook is None:
            try:
                key = parse_key(named.get(settings.key_header, ()))
            except IdempotencyError as exc:
                return self.problem(exc)
            if key is None:
                if required:
                    return self.problem(MissingKeyError(header=settings.key_header_name))
                return None
        else:
            key = None  # the hook reads it once the body is read
        # Refused before the body is read: a declared size over the limit (413).
        length = named.get(b"content-length")
        if length:
            declared = length[0].strip()
            if declared.isdigit() and int(declared) > settings.max_request_bytes:
                return self.too_large()
        return Admission(operation, key, hook, required)

    def hooked_key(self, admission: Admission, request: Request) -> str | HttpResponse | None:
        """The key an `Admission`'s ``key_from`` hook finds in the whole request, the 400 to
        answer, or None to run it unguarded (no key, none required)."""
        assert admission.hook is not None
        try:
            found = admission.hook(request)
            if found is not None:
                return validate_key(found)
            if admission.required:
                raise MissingKeyError(
                    "this endpoint requires an idempotency key, and none was found in the request",
                    header=self.settings.key_header_name,
                )
        except IdempotencyError as exc:
            return self.problem(exc)
        return None

    def too_large(self) -> HttpResponse:
        """413 for a body over ``max_request_bytes``."""
        return self.problem(RequestTooLargeError(self.settings.max_request_bytes))

    def principal(self, request: Request) -> str:
        """Who asked (`idempo._http.principals.Principals`): the app's resolver, called
        with ``request.raw``, else the default (``request.user()``, the user the framework
        authenticated, then the request's Authorization and Cookie headers). Raises the
        401's `PrincipalRequiredError`."""
        settings = self.settings
        resolver = settings.principal
        named = request.named
        if (
            resolver is None
            and b"authorization" not in named
            and b"cookie" not in named
            and request.user() is None
        ):
            return ""  # what `Principals.resolve` answers then, without its calls
        principal = settings.principals.resolve(
            resolver(request.raw) if resolver else NO_RESOLVER,
            request.user,
            named.get(b"authorization", []),
            b"cookie" in named,
        )
        # Hashed when it could not go into a store's key as it is (`stored_text`, inlined:
        # this runs on every request).
        if principal and (
            len(principal) > MAX_STORED_TEXT
            or not principal.isascii()
            or not principal.isprintable()
        ):
            return stored_text(principal)
        return principal

    def refused(
        self,
        exc: IdempotencyError,
        key: str | None = None,
        request: Request | None = None,
        *,
        reported: bool = True,
    ) -> HttpResponse | None:
        """The answer when the reservation raised; None to run unguarded (failing open).
        The guard has reported the refusal (`idempo.events`) unless ``reported`` is False
        (the app's connection could not be opened, before any guard ran: reported here as
        `Kind.STORE_UNAVAILABLE`); failing open is reported here, as `Kind.FAIL_OPEN`."""
        if not reported and key is not None and isinstance(exc, StoreError):
            self.idempotency.notify(
                Kind.STORE_UNAVAILABLE,
                key=key,
                operation=self._named(request),
                surface="http",
                error=exc,
            )
        # Never fail open on a corrupt record or a missing schema: the record may say the
        # work already ran, and a missing schema is a deployment to fix, not an outage.
        if (
            isinstance(exc, StoreError)
            and not isinstance(exc, CorruptRecordError | SchemaMissingError)
            and self.settings.fail_open
        ):
            if key is not None:
                operation = self._named(request)
                self.idempotency.notify(
                    Kind.FAIL_OPEN, key=key, operation=operation, surface="http", error=exc
                )
            return None
        return self.problem(exc)

    def _named(self, request: Request | None) -> str:
        """The request's operation for a report, whatever its resolver does (it may be what
        failed)."""
        if request is None:
            return "?"
        try:
            return self.operation(request) or f"{request.method} {stored_text(request.path)}"
        except Exception:  # noqa: BLE001 - a report never replaces the answer
            return f"{request.method} {stored_text(request.path)}"

    def unkept(self, status: int, size: int) -> UnkeptResponse:
        """A response that grew past ``max_response_bytes``: sent, recorded as not stored."""
        return UnkeptResponse(status, size, self.settings.max_response_bytes)

    def recorded(self, exc: IdempotencyError, key: str, on_connection: bool) -> bool:
        """Whether the client may still get the app's response after recording raised.

        On the app's connection its writes rolled back with the record (False: answer
        `not_committed`). Otherwise the work ran and the client is owed its answer; only the
        record failed (a store fault, a lost lease), and a retry may execute again once the
        lease ends.
        """
        # The guard reported the fault itself (fenced, unrecorded); this says what the
        # client gets. The key as its digest (`idempo.events.key_digest`).
        shown = self._shown(key)
        fields = {"idempo_key_digest": key_digest(key), "idempo_surface": "http"}
        error = self._scrubbed(exc, key)
        if isinstance(exc, ResponseTooLargeError):
            # The policy's own limit (a shared guard's) was stricter than the middleware's:
            # the guard recorded a response-not-stored failure; the client still gets it all.
            logger.warning(
                "idempo: the response for %s is too large to store: %s", shown, error, extra=fields
            )
            return True
        if on_connection:
            logger.warning(
                "idempo: the outcome for %s did not commit; nothing was kept: %s",
                shown,
                error,
                extra=fields,
            )
            return False
        logger.warning(
            "idempo: the response for %s is sent but could not be recorded: %s",
            shown,
            error,
            extra=fields,
        )
        return True

    def _shown(self, key: str) -> str:
        return f"key {key!r}" if self.idempotency.reveal_keys else f"key#{key_digest(key)}"

    def _scrubbed(self, exc: BaseException, key: str) -> str:
        return str(exc) if self.idempotency.reveal_keys else scrub(str(exc), key)

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
            headers=[(b"retry-after", str(self.settings.store_retry_after).encode())],
        )

    def operation(self, request: Request) -> str | None:
        """The request's operation: what the app's ``operation=`` resolver chose, else
        ``"METHOD route-template"`` (the request's route-template hook), else
        ``"METHOD path"``, the path as `stored_text` keeps it (``METHOD sha256:<hex>`` for
        one with a NUL, non-ASCII or over 256 characters). None when the hook answered
        `NO_ROUTE`: the app's router answers the request (404, 405) before any endpoint
        runs, so the adapter passes it through unguarded and stores nothing."""
        return self.route(request.raw, request.method, request.path)[0]

    def route(self, raw: Any, method: str, path: str) -> tuple[str | None, RouteRule | None]:
        """The request's `operation`, and the rule its route was marked with (`RouteRule`),
        both from one call of the route-template hook."""
        routes = self.routes
        found = routes(raw) if routes is not None else None
        rule = None
        if isinstance(found, Routed):
            rule = found.rule
            found = found.template
        resolver = self.settings.operation
        if resolver is not None:
            operation = resolver(raw)
            if operation is not None:
                return operation, rule
        if found is None:
            return f"{method} {stored_text(path)}", rule
        return (None if found is NO_ROUTE else f"{method} {found}"), rule

    def guard(
        self, key: str, request: Request, principal: str, conn: Any, operation: str | None = None
    ) -> Any:
        """The guard's handle for one request, under its scope and fingerprint, not reserved
        yet (`Idempotency.once`: the faces reserve with its ``_enter``). ``operation`` is the
        adapter's `operation` of the request, when it asked already; a `NO_ROUTE` there is
        guarded under the path (an adapter that passes such requests through asks first).
        """
        settings = self.settings
        method, path = request.method, request.path
        if operation is None:
            operation = self.operation(request)
            if operation is None:
                operation = f"{method} {stored_text(path)}"
        payload = canonical_parts(
            method,
            path,
            request.query,
            request.headers,
            request.body,
            settings.fingerprint_fields,
            settings.fingerprint_headers,
            content_type=request.named.get(b"content-type", ()),
        )
        # `Idempotency.once(...)` begun, its arguments given in order (`_Guard._begun`).
        scope = Scope(principal, operation, validate_key(key))
        return self.idempotency._begun(
            scope, payload, conn, settings.codec, None, settings.mode, "http"
        )


# --- the sync face ------------------------------------------------------------------------


def reserve(
    lifecycle: Lifecycle, key: str, request: Request, operation: str | None = None
) -> Run | HttpResponse | Unguarded:
    """Reserve the key: a `Run` to execute, a response to answer (a replay or a refusal),
    or `Unguarded` (failing open). With ``connection=``, the app's connection is opened
    here and closed when the run settles: a WSGI response may outlive the call that made it.
    ``operation``: `Lifecycle.operation` of the request, if the adapter asked it already.
    """
    stack = ExitStack()
    guarded = False
    try:
        principal = lifecycle.principal(request)
        conn = None
        if lifecycle.settings.connection is not None:
            conn = _opened(lambda: stack.enter_context(lifecycle.settings.connection()))
        guarded = True  # from here on the guard reports what it refuses
        handle = lifecycle.guard(key, request, principal, conn, operation)
        attempt = handle._enter()
    except IdempotencyError as exc:
        stack.close()
        refusal = lifecycle.refused(exc, key, request, reported=guarded)
        return Unguarded(request.body) if refusal is None else refusal
    except BaseException as exc:
        stack.__exit__(type(exc), exc, exc.__traceback__)
        raise
    if attempt.replayed:  # a replay holds nothing
        stack.close()
        replay: HttpResponse = attempt.result  # the answer itself (`HttpSettings.codec`)
        return replay
    return Run(lifecycle, handle, conn, stack)


class Run:
    """One executing request on a thread: settle it exactly once, with its response
    (`settle`) or the error that ended it (`fail`). A thread renews its lease meanwhile."""

    def __init__(
        self, lifecycle: Lifecycle, handle: Handle[Any], conn: Any, stack: ExitStack
    ) -> None:
        self.lifecycle = lifecycle
        self.attempt = handle.attempt
        self.conn = conn
        self.settled = False
        self._handle = handle
        self._stack = stack
        self._renewal = ThreadRenewal(handle.attempt, lifecycle.settings.renew_every, logger)
        self._renewal.start()

    def settle(self, result: Result) -> bool:
        """Store the outcome (None releases the key), before the client sees the end of it.
        False: on the app's connection, nothing committed (answer `Lifecycle.not_committed`)."""
        if self.settled:
            return True
        self.settled = True
        self._renewal.stop()
        try:
            with self._stack:
                self._handle.finish(result)
        except IdempotencyError as exc:
            return self.lifecycle.recorded(exc, self.attempt.scope.key, self.conn is not None)
        return True

    def fail(self, exc: BaseException) -> None:
        """The handler raised before a whole response: release the key."""
        if self.settled:
            return
        self.settled = True
        self._renewal.stop()
        try:
            self._handle.abort(exc)
        except IdempotencyError as error:
            key = self.attempt.scope.key
            logger.warning(
                "idempo: %s could not be released: %s",
                self.lifecycle._shown(key),
                self.lifecycle._scrubbed(error, key),
                extra={"idempo_key_digest": key_digest(key), "idempo_surface": "http"},
            )
        finally:
            self._stack.__exit__(type(exc), exc, exc.__traceback__)


def read_limited(read: Callable[[int], bytes], length: int | None, limit: int) -> bytes | None:
    """Read a request body through ``read(n)``: ``length`` bytes, or to EOF when None.

    None when the body passes ``limit`` (the caller answers 413). A short read (the client
    went away) returns what arrived; the app would have seen the same.
    """
    chunks: list[bytes] = []
    size = 0
    remaining = length
    while remaining is None or remaining > 0:
        want = 64 * 1024 if remaining is None else min(remaining, 64 * 1024)
        chunk = read(want)
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if remaining is not None:
            remaining -= len(chunk)
    return b"".join(chunks)


# --- the async face -----------------------------------------------------------------------


async def areserve(
    lifecycle: Lifecycle,
    stack: AsyncExitStack | None,
    key: str,
    request: Request,
    operation: str | None = None,
) -> AsyncRun | HttpResponse | Unguarded:
    """`reserve`'s async face, on an `AsyncIdempotency`. With ``connection=``, ``stack``
    holds the app's connection, opened here, for as long as the caller keeps it open. Call
    it in the task that runs the handler: a lost lease cancels that task."""
    guarded = False
    try:
        principal = lifecycle.principal(request)
        conn = None
        if stack is not None and lifecycle.settings.connection is not None:
            conn = await _aopened(stack, lifecycle.settings.connection)
        guarded = True  # from here on the guard reports what it refuses
        handle = lifecycle.guard(key, request, principal, conn, operation)
        attempt = await handle._enter()
    except IdempotencyError as exc:
        refusal = lifecycle.refused(exc, key, request, reported=guarded)
        return Unguarded(request.body) if refusal is None else refusal
    if attempt.replayed:  # a replay holds nothing
        replay: HttpResponse = attempt.result  # the answer itself (`HttpSettings.codec`)
        return replay
    return AsyncRun(lifecycle, handle, conn)


class AsyncRun:
    """`Run`'s async face: a timer renews the lease, and a lost lease cancels the task that
    runs the handler (`fail` then says so)."""

    def __init__(self, lifecycle: Lifecycle, handle: AsyncHandle[Any], conn: Any) -> None:
        self.lifecycle = lifecycle
        self.attempt = handle.attempt
        self.conn = conn
        self.settled = False
        self._handle = handle
        self._renewal = Renewal(handle.attempt, lifecycle.settings.renew_every, logger)
        self._renewal.start()

    async def settle(self, result: Result) -> bool:
        """See `Run.settle`."""
        if self.settled:
            return True
        self.settled = True
        await self._renewal.stop()
        try:
            await self._handle.finish(result)
        except IdempotencyError as exc:
            return self.lifecycle.recorded(exc, self.attempt.scope.key, self.conn is not None)
        return True

    async def fail(self, exc: BaseException) -> FencedError | None:
        """The handler raised before a whole response: release the key. The `FencedError`
        to answer (409 ``lease-lost``) when ``exc`` meant a lost lease (a refused renewal
        cancels the handler); None: re-raise ``exc``."""
        self.settled = True
        await self._renewal.stop()
        lost = self._renewal.fenced(exc)
        await self._handle.abort(lost)
        return lost if isinstance(lost, FencedError) else None


def _opened(enter: Callable[[], Any]) -> Any:
    try:
        return enter()
    except Exception as exc:
        # The database the record rides on is the store: down means 503, as for any store.
        raise StoreUnavailableError(f"could not open the app's connection: {exc}") from exc


async def _aopened(stack: AsyncExitStack, connection: Callable[[], Any]) -> Any:
    try:
        return await stack.enter_async_context(connection())
    except Exception as exc:
        raise StoreUnavailableError(f"could not open the app's connection: {exc}") from exc
