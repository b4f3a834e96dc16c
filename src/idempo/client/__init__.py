"""The client half: httpx transports that key a request once and retry it safely.

A guarded request (POST, PATCH) without an ``Idempotency-Key`` gets a fresh UUIDv4 once, and
every retry of that logical request sends the same key, so the server executes it once and
answers every attempt with the first result. Wrap any transport; it needs ``idempo[httpx]``.

    client = httpx.Client(transport=IdempotentTransport())
    response = client.post("https://api.example/payments", json={"amount": 100})
    response.extensions["idempotency_key"], response.extensions["idempotency_attempts"]

The rules (when to retry, how long to wait) live in `RetryPolicy` and, written once,
in ``idempo.client.retry``; the two transports below only carry them out.

.. versionadded:: 0.1
"""

from __future__ import annotations

import inspect
import json
import time
import uuid
from collections.abc import Iterator

from .._optional import optional_import

with optional_import("the idempotent client needs httpx", extra="httpx"):
    import anyio
    import httpx

from .._wire import PROBLEM_MEDIA_TYPE
from ..errors import ConfigurationError
from .retry import Answer, Error, RetryPolicy, Send, Wait, parse_retry_after, retry_flow

__all__ = ["AsyncIdempotentTransport", "IdempotentTransport", "RetryPolicy"]

# What the response carries: the key every attempt sent, and how many attempts were made.
KEY_EXTENSION = "idempotency_key"
ATTEMPTS_EXTENSION = "idempotency_attempts"

# Transient by default: nothing (or nothing complete) came back, so sending again is the only
# way to learn the outcome, and the key makes it safe.
_TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    httpx.TimeoutException,
    httpx.NetworkError,
    httpx.RemoteProtocolError,
)
_TIMEOUTS = ("connect", "read", "write", "pool")


class _Run:
    """One logical request: its key, its replayable body, its attempts and the last outcome.

    Iterating yields what the driver does next: an `httpx.Request` to send (then the driver
    reports `answered` or `failed`) or a number of seconds to wait.
    """

    def __init__(self, request: httpx.Request, body: httpx.ByteStream, policy: RetryPolicy):
        self.request = request
        self.body = body
        self.policy = policy
        # A key the caller chose names its own intent; only a request without one gets a key.
        self.key = request.headers.get(policy.header) or str(uuid.uuid4())
        request.headers[policy.header] = self.key
        self.attempts = 0
        self._outcome: Answer | Error | None = None
        self._last: httpx.Response | Exception | None = None
        errors = policy.retry_errors
        self._transient = _TRANSIENT_ERRORS if errors is None else errors

    def __iter__(self) -> Iterator[httpx.Request | float]:
        flow = retry_flow(self.policy)
        step = next(flow)
        while True:
            if isinstance(step, Wait):
                yield step.seconds
                self._outcome = None
            else:
                self.attempts = step.number
                yield self._attempt(step)
            try:
                step = flow.send(self._outcome)
            except StopIteration:
                return

    def _attempt(self, step: Send) -> httpx.Request:
        extensions = dict(self.request.extensions)
        if step.time_left is not None:
            # The deadline bounds the whole call, so no attempt may outlive it.
            timeout = extensions.get("timeout") or {}
            extensions["timeout"] = {
                name: min(timeout.get(name) or step.time_left, step.time_left) for name in _TIMEOUTS
            }
        return httpx.Request(
            self.request.method,
            self.request.url,
            headers=self.request.headers,
            stream=self.body,
            extensions=extensions,
        )

    def answered(self, response: httpx.Response, raw: bytes | None = None) -> None:
        self._last = response
        headers = response.headers
        retry_after = parse_retry_after(
            headers.get("Retry-After"), date=headers.get("Date"), now=self.policy.wall_clock
        )
        problem = None
        if raw is not None and headers.get("content-type", "").startswith(PROBLEM_MEDIA_TYPE):
            problem = _problem_type(response, raw)
        self._outcome = Answer(response.status_code, retry_after, problem)

    def failed(self, exc: Exception) -> None:
        self._last = exc
        self._outcome = Error(transient=isinstance(exc, self._transient))

    def result(self) -> httpx.Response:
        """The last answer, marked with the key and the attempts; or the last error, raised."""
        last = self._last
        if isinstance(last, Exception):
            last.add_note(
                f"idempo: {self.attempts} attempt(s) sent {self.policy.header}: {self.key}; "
                "a later retry of this intent must send the same key"
            )
            raise last
        if last is None:  # pragma: no cover - the flow always makes a first attempt
            raise AssertionError("no attempt was made")
        last.extensions[KEY_EXTENSION] = self.key
        last.extensions[ATTEMPTS_EXTENSION] = self.attempts
        return last


def _problem_type(response: httpx.Response, raw: bytes) -> str | None:
    """The ``type`` of a problem answer (RFC 9457), read from its raw bytes (decoded as the
    client will decode them); None when it has none."""
    try:
        decoded = httpx.Response(200, headers=response.headers, content=raw).read()
        found = json.loads(decoded).get("type")
    except (ValueError, AttributeError, httpx.DecodingError):
        return None
    return found if isinstance(found, str) else None


def _in_memory(response: httpx.Response, raw: bytes) -> httpx.Response:
    # The client decodes and reads it as usual, from memory; nothing is left on the wire.
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=httpx.ByteStream(raw),
        extensions=dict(response.extensions),
    )


class _Buffer:
    """Collects a streamed request body, refusing it past the policy's limit."""

    def __init__(self, request: httpx.Request, limit: int) -> None:
        self.request = request
        self.limit = limit
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise ConfigurationError(
                f"the streamed body of {self.request.method} {self.request.url} is over "
                f"RetryPolicy.max_body_bytes ({self.limit}); every retry must send the same "
                "bytes, so idempo reads it into memory first: raise the limit or send bytes"
            )
        self.chunks.append(chunk)

    def stream(self) -> httpx.ByteStream:
        return httpx.ByteStream(b"".join(self.chunks))


class IdempotentTransport(httpx.BaseTransport):
    """An httpx transport that keys each guarded request once and retries it safely.

    Wraps ``transport`` (default: a plain `httpx.HTTPTransport`). A POST or PATCH without an
    ``Idempotency-Key`` gets a UUIDv4, sent unchanged on every retry; connection errors,
    timeouts, 5xx, 408, 425, 429 and 409 with ``Retry-After`` are retried per ``policy``;
    400 and 422 never are. The response carries ``extensions["idempotency_key"]`` and
    ``extensions["idempotency_attempts"]``. Other methods pass through untouched.

    The whole answer of a guarded request is read inside the transport, so a connection
    that drops in the middle of the body is retried like one that drops before it.

    >>> import httpx
    >>> keys = []
    >>> def flaky(request):
    ...     keys.append(request.headers["Idempotency-Key"])
    ...     return httpx.Response(503 if len(keys) < 3 else 201)
    >>> transport = IdempotentTransport(
    ...     httpx.MockTransport(flaky), policy=RetryPolicy(sleep=lambda seconds: None)
    ... )
    >>> client = httpx.Client(transport=transport)
    >>> response = client.post("https://api.example/payments", json={"amount": 100})
    >>> response.status_code, response.extensions["idempotency_attempts"], len(set(keys))
    (201, 3, 1)

    .. versionadded:: 0.1
    """

    def __init__(
        self, transport: httpx.BaseTransport | None = None, *, policy: RetryPolicy | None = None
    ) -> None:
        self.transport = transport if transport is not None else httpx.HTTPTransport()
        self.policy = policy if policy is not None else RetryPolicy()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        policy = self.policy
        if request.method not in policy.methods:
            return self.transport.handle_request(request)
        run = _Run(request, _replayable(request, policy.max_body_bytes), policy)
        for step in run:
            if not isinstance(step, httpx.Request):
                (policy.sleep or time.sleep)(step)
                continue
            try:
                response = self.transport.handle_request(step)
                raw = None
                if not response.is_stream_consumed:
                    try:
                        raw = b"".join(response.iter_raw())
                    finally:
                        response.close()
                    response = _in_memory(response, raw)
            except Exception as exc:  # noqa: BLE001 - the policy decides which errors are transient
                run.failed(exc)
            else:
                run.answered(response, raw)
        return run.result()

    def close(self) -> None:
        self.transport.close()


class AsyncIdempotentTransport(httpx.AsyncBaseTransport):
    """The async twin of `IdempotentTransport`, for `httpx.AsyncClient`.

        async with httpx.AsyncClient(transport=AsyncIdempotentTransport()) as client:
            response = await client.post("https://api.example/payments", json=order)

    .. versionadded:: 0.1
    """

    def __init__(
        self,
        transport: httpx.AsyncBaseTransport | None = None,
        *,
        policy: RetryPolicy | None = None,
    ) -> None:
        self.transport = transport if transport is not None else httpx.AsyncHTTPTransport()
        self.policy = policy if policy is not None else RetryPolicy()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        policy = self.policy
        if request.method not in policy.methods:
            return await self.transport.handle_async_request(request)
        run = _Run(request, await _areplayable(request, policy.max_body_bytes), policy)
        for step in run:
            if not isinstance(step, httpx.Request):
                await _asleep(policy, step)
                continue
            try:
                response = await self.transport.handle_async_request(step)
                raw = None
                if not response.is_stream_consumed:
                    try:
                        raw = b"".join([chunk async for chunk in response.aiter_raw()])
                    finally:
                        await response.aclose()
                    response = _in_memory(response, raw)
            except Exception as exc:  # noqa: BLE001 - the policy decides which errors are transient
                run.failed(exc)
            else:
                run.answered(response, raw)
        return run.result()

    async def aclose(self) -> None:
        await self.transport.aclose()


def _replayable(request: httpx.Request, limit: int) -> httpx.ByteStream:
    stream = request.stream
    if isinstance(stream, httpx.ByteStream):  # bytes, JSON, a form: replayable as it is
        return stream
    if not isinstance(stream, httpx.SyncByteStream):
        raise ConfigurationError("an async request body cannot be sent by the sync transport")
    buffer = _Buffer(request, limit)
    for chunk in stream:
        buffer.add(chunk)
    return buffer.stream()


async def _areplayable(request: httpx.Request, limit: int) -> httpx.ByteStream:
    stream = request.stream
    if isinstance(stream, httpx.ByteStream):
        return stream
    if not isinstance(stream, httpx.AsyncByteStream):
        raise ConfigurationError("a sync request body cannot be sent by the async transport")
    buffer = _Buffer(request, limit)
    async for chunk in stream:
        buffer.add(chunk)
    return buffer.stream()


async def _asleep(policy: RetryPolicy, seconds: float) -> None:
    if policy.sleep is None:
        await anyio.sleep(seconds)
        return
    slept = policy.sleep(seconds)
    if inspect.isawaitable(slept):
        await slept
