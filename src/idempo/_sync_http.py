"""The synchronous half of the HTTP middlewares: what WSGI and Django share.

`_http` turns requests and responses into keys, fingerprints and records; this module drives
`Idempotency.once` with them for a thread-per-request server: the reservation, the replay,
lease renewal in a thread while the handler runs, and settling the record once the response
is whole. The adapters (`idempo.wsgi`, `idempo.contrib.django`) only translate their
framework's request and response to `HttpRequest` and `HttpResponse`.
"""

from __future__ import annotations

import inspect
import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ._http import (
    DEFAULT_BODY_LIMIT,
    DEFAULT_FINGERPRINT_FIELDS,
    KEY_HEADER,
    Classifier,
    FingerprintField,
    Header,
    HttpCodec,
    HttpRequest,
    HttpResponse,
    Principals,
    UnkeptResponse,
    canonical_request,
    check_options,
    classify_status,
    header_values,
    http_policy,
    parse_key,
    problem_for,
)
from .errors import (
    ConfigurationError,
    CorruptRecordError,
    IdempotencyError,
    MissingKeyError,
    RequestTooLargeError,
    ResponseTooLargeError,
    SchemaMissingError,
    StoreError,
)
from .guard import Attempt, Idempotency
from .policy import Policy
from .stores import open_store
from .stores.base import Store

logger = logging.getLogger("idempo.http")


@dataclass(frozen=True, slots=True)
class Unguarded:
    """Run the request without idempotency: no key and none required, or the store is down
    and the middleware fails open. ``body`` is what was already read of the request."""

    body: bytes | None = None


class SyncHttpGuard:
    """A sync middleware's options and guard (see `idempo.wsgi.IdempotencyWSGIMiddleware`
    for what each option means)."""

    def __init__(
        self,
        *,
        store: Store | str | None,
        idempotency: Idempotency | None,
        policy: Policy | None,
        lease: float | timedelta | None,
        methods: Collection[str],
        require_key: bool,
        allow_anonymous: bool,
        fingerprint_fields: Collection[FingerprintField],
        fingerprint_headers: Collection[str],
        max_request_bytes: int,
        max_response_bytes: int,
        replay_status_200: bool,
        fail_open: bool,
        classify: Classifier,
        max_retry_after: int,
        store_retry_after: int,
        owner: str,
    ) -> None:
        check_options(
            max_request_bytes=max_request_bytes,
            max_response_bytes=max_response_bytes,
            max_retry_after=max_retry_after,
            store_retry_after=store_retry_after,
            fingerprint_fields=fingerprint_fields,
        )
        self.idempotency = _guard(store, idempotency, policy, lease, max_response_bytes, owner)
        self.methods = frozenset(method.upper() for method in methods)
        self.require_key = require_key
        self.principals = Principals(allow_anonymous=allow_anonymous, owner=owner)
        self.fingerprint_fields = tuple(fingerprint_fields)
        self.fingerprint_headers = tuple(name.lower() for name in fingerprint_headers)
        self.max_request_bytes = max_request_bytes
        self.max_response_bytes = max_response_bytes
        self.replay_status_200 = replay_status_200
        self.fail_open = fail_open
        self.codec = HttpCodec(classify)
        self.max_retry_after = max_retry_after
        self.store_retry_after = store_retry_after
        self.renew_every = self.idempotency.policy.lease.total_seconds() / 3

    def guards(self, method: str) -> bool:
        """Whether requests with this method go through the guard at all."""
        return method.upper() in self.methods

    def problem(self, exc: IdempotencyError) -> HttpResponse:
        """The problem response for a refusal, with this middleware's Retry-After settings."""
        return problem_for(
            exc, max_retry_after=self.max_retry_after, store_retry_after=self.store_retry_after
        )

    def key(self, headers: Sequence[Header]) -> str | HttpResponse | Unguarded:
        """The request's key; or the 400 to answer; or `Unguarded` (no key, none required)."""
        try:
            key = parse_key(header_values(headers, KEY_HEADER))
            if key is None and self.require_key:
                raise MissingKeyError("the Idempotency-Key header is missing")
        except IdempotencyError as exc:
            return self.problem(exc)
        return Unguarded() if key is None else key

    def check_length(self, headers: Sequence[Header]) -> HttpResponse | None:
        """413 at once for a declared ``Content-Length`` over the limit, before reading."""
        declared = header_values(headers, b"content-length")
        if declared and declared[0].strip().isdigit() and int(declared[0]) > self.max_request_bytes:
            return self.problem(RequestTooLargeError(self.max_request_bytes))
        return None

    def too_large(self) -> HttpResponse:
        """413 for a body that grew past the limit while being read."""
        return self.problem(RequestTooLargeError(self.max_request_bytes))

    def principal(
        self, chosen: str | None, user: Callable[[], Any], headers: Sequence[Header]
    ) -> str | HttpResponse:
        """Who asked (`idempo._http.Principals`), or the problem to answer (401
        ``principal-required``).

        Args:
            chosen: what the app's resolver returned, or `idempo._http.NO_RESOLVER`.
            user: reads the user the framework authenticated, None when there is none.
            headers: the request's.
        """
        try:
            return self.principals.resolve(
                chosen,
                user,
                header_values(headers, b"authorization"),
                bool(header_values(headers, b"cookie")),
            )
        except IdempotencyError as exc:
            return self.problem(exc)

    def reserve(
        self, key: str, request: HttpRequest, *, operation: str, principal: str
    ) -> Run | HttpResponse | Unguarded:
        """Reserve the key: a `Run` to execute, a response to answer (a replay or a
        refusal), or `Unguarded` when the store is down and the middleware fails open."""
        payload = canonical_request(
            request, fields=self.fingerprint_fields, headers=self.fingerprint_headers
        )
        once = self.idempotency.once(
            key, operation=operation, payload=payload, principal=principal, codec=self.codec
        )
        try:
            attempt = once.__enter__()
        except (CorruptRecordError, SchemaMissingError) as exc:
            # Never fail open here: the record may say the work already ran, and a missing
            # schema is a deployment to fix, not an outage to run through.
            logger.error("idempo: %s", exc)  # noqa: TRY400 - the error is the message
            return self.problem(exc)
        except StoreError as exc:
            if not self.fail_open:
                return self.problem(exc)
            logger.warning("idempo: store unavailable, running the request unguarded: %s", exc)
            return Unguarded(request.body)
        except IdempotencyError as exc:
            return self.problem(exc)
        if attempt.replayed:
            once.__exit__(None, None, None)
            response: HttpResponse = attempt.result
            return response.replay(status_200=self.replay_status_200)
        return Run(self, once, attempt)


class Run:
    """One executing request: renews its lease until the response settles."""

    def __init__(self, guard: SyncHttpGuard, once: Any, attempt: Attempt) -> None:
        self.guard = guard
        self._once = once
        self.attempt = attempt
        self.settled = False
        self._stop = threading.Event()
        # A daemon thread: a process exiting mid-request must not wait for it, and its
        # lease then ends as a crashed holder's should.
        self._renewer = threading.Thread(
            target=self._renew, name=f"idempo-renew-{attempt.scope.key[:32]}", daemon=True
        )
        self._renewer.start()

    def _renew(self) -> None:
        # A handler slower than its lease would otherwise be taken over by a duplicate and
        # run twice. Renewal stops with the handler, so a crashed process's key still frees.
        while not self._stop.wait(self.guard.renew_every):
            try:
                self.attempt.renew()
            except Exception as exc:  # noqa: BLE001 - a lost lease or a store fault ends renewal, never the request
                logger.warning(
                    "idempo: stopped renewing the lease of key %r: %s", self.attempt.scope.key, exc
                )
                return

    def _stop_renewing(self) -> None:
        """Stop renewing; waits for a renewal in flight rather than racing it."""
        self._stop.set()
        self._renewer.join()

    def kept(self, status: int, headers: Sequence[Header], body: bytes) -> HttpResponse:
        """Store a whole response (or release the key, per its status) and return it."""
        response = HttpResponse(status, tuple(headers), body)
        self.settle(response)
        return response

    def unkept(self, status: int, size: int) -> None:
        """Record a response that streamed past ``max_response_bytes`` as not stored."""
        self.settle(UnkeptResponse(status, size, self.guard.max_response_bytes))

    def settle(self, result: HttpResponse | UnkeptResponse | None) -> None:
        """Store the outcome (None releases the key), before the client sees the end of it."""
        if self.settled:
            return
        self.settled = True
        self._stop_renewing()
        self.attempt.result = result
        key = self.attempt.scope.key
        try:
            self._once.__exit__(None, None, None)
        except ResponseTooLargeError as exc:
            # The policy's own limit (a shared guard's) was stricter than the middleware's:
            # the guard recorded a response-not-stored failure; the client still gets it all.
            logger.warning("idempo: the response for key %r is too large to store: %s", key, exc)
        except IdempotencyError as exc:
            # The work ran and the client is owed its answer; only the record failed (a
            # store fault, a lost lease). A retry may execute again once the lease ends.
            logger.warning(
                "idempo: the response for key %r is sent but could not be recorded: %s", key, exc
            )

    def fail(self, exc: BaseException) -> None:
        """The handler raised before a whole response: release the key."""
        if self.settled:
            return
        self.settled = True
        self._stop_renewing()
        try:
            self._once.__exit__(type(exc), exc, exc.__traceback__)
        except IdempotencyError as error:
            logger.warning(
                "idempo: the key %r could not be released: %s", self.attempt.scope.key, error
            )


def _guard(
    store: Store | str | None,
    idempotency: Idempotency | None,
    policy: Policy | None,
    lease: float | timedelta | None,
    max_response_bytes: int,
    owner: str,
) -> Idempotency:
    if (store is None) == (idempotency is None):
        raise ConfigurationError(f"give {owner} either store= or idempotency=")
    if idempotency is not None:
        if policy is not None or lease is not None:
            raise ConfigurationError("policy= and lease= go with store=; idempotency= has its own")
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
    return Idempotency(store, http_policy(policy, lease, max_response_bytes))


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


__all__ = [
    "DEFAULT_BODY_LIMIT",
    "DEFAULT_FINGERPRINT_FIELDS",
    "Run",
    "SyncHttpGuard",
    "Unguarded",
    "classify_status",
    "read_limited",
]
