"""aiohttp server middleware: SPEC §4's HTTP contract for aiohttp.web apps, a thin adapter
on the public HTTP lifecycle (`idempo.http`; docs/extending.md has it as the worked example).

    app = web.Application(middlewares=[IdempotencyMiddleware(store="sqlite:///idem.db")])
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, Unpack

from .._optional import optional_import

with optional_import("the aiohttp middleware needs aiohttp", extra="aiohttp"):
    from aiohttp import web

from .. import http
from ..errors import ConfigurationError
from ..guard import AsyncAttempt

__all__ = ["USER", "IdempotencyMiddleware", "current_attempt", "idempotent_connection"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
USER = web.RequestKey("user", object)  # where an auth middleware puts the signed-in user
_ATTEMPT = web.RequestKey("idempo.attempt", AsyncAttempt)
_CONNECTION = web.RequestKey("idempo.connection", object)


class IdempotencyMiddleware(http.ShowsOptions):
    """Runs each guarded request once per ``(principal, operation, Idempotency-Key)``; every
    duplicate gets the first response. Takes the `idempo.http.HttpOptions`; the principal
    defaults to ``request[USER]``, the route template to the matched resource's.

    >>> from idempo.stores.memory import AsyncMemoryStore
    >>> IdempotencyMiddleware(store=AsyncMemoryStore(), lease=10).idempotency.policy.lease
    datetime.timedelta(seconds=10)
    """

    __middleware_version__ = 1  # aiohttp's new-style (request, handler) middleware

    def __init__(self, **options: Unpack[http.HttpOptions[web.Request]]) -> None:
        self.settings = http.HttpSettings(options, owner=type(self).__name__, asynchronous=True)
        self.lifecycle = http.Lifecycle(self.settings, self.settings.routes or _routed)
        self.idempotency = self.settings.idempotency

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        lifecycle = self.lifecycle
        if request.method not in self.settings.methods:
            return await handler(request)
        headers: list[http.Header] = [(name.lower(), value) for name, value in request.raw_headers]
        named = http.headers_named(headers, lifecycle.read_headers)
        admission = lifecycle.admit(request, request.method, request.path, named)
        if admission is None or request.match_info.http_exception is not None:
            return await handler(request)  # unguarded, or answered before any endpoint ran
        if isinstance(admission, http.HttpResponse):
            return _to_aiohttp(admission)
        try:  # read once: aiohttp keeps the bytes for the handler's read(), json(), text()
            body = await request.read()
            if len(body) > self.settings.max_request_bytes:
                raise web.HTTPRequestEntityTooLarge(self.settings.max_request_bytes, len(body))
        except web.HTTPRequestEntityTooLarge:
            return _to_aiohttp(lifecycle.too_large())
        query = request.query_string.encode()
        user = lambda: request.get(USER)  # noqa: E731
        incoming = http.Incoming(
            request, request.method, request.path, query, headers, named, body, user
        )
        key = admission.key or lifecycle.hooked_key(admission, incoming)
        if key is None:
            return await handler(request)  # the key_from hook found none: none required
        if isinstance(key, http.HttpResponse):
            return _to_aiohttp(key)
        async with AsyncExitStack() as stack:
            outcome = await http.areserve(lifecycle, stack, key, incoming, admission.operation)
            if isinstance(outcome, http.HttpResponse):
                return _to_aiohttp(outcome)
            if isinstance(outcome, http.Unguarded):
                return await handler(request)  # failing open
            return await _execute(request, handler, outcome)


async def _execute(
    request: web.Request, handler: Handler, run: http.AsyncRun
) -> web.StreamResponse:
    request[_ATTEMPT], request[_CONNECTION] = run.attempt, run.conn
    lifecycle = run.lifecycle
    try:
        response = await handler(request)
    except web.HTTPException as raised:  # aiohttp's raised answers are responses too
        response = raised
    except BaseException as exc:
        lost = await run.fail(exc)  # before a response: the key is released
        if lost is None:
            raise
        return _to_aiohttp(lifecycle.problem(lost))
    if not await run.settle(_result(lifecycle, response)):
        return _to_aiohttp(lifecycle.not_committed())
    if isinstance(response, web.HTTPException):
        raise response
    return response


def _result(lifecycle: http.Lifecycle, response: web.StreamResponse) -> Any:
    body = response.body if isinstance(response, web.Response) else None
    if response.prepared or not isinstance(body, bytes):
        # Already streamed to the client: sent whole, but there is nothing to replay.
        return lifecycle.unkept(response.status, response.body_length)
    if len(body) > lifecycle.settings.max_response_bytes:
        return lifecycle.unkept(response.status, len(body))
    headers = [
        (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.headers.items()
    ]
    return http.HttpResponse(response.status, tuple(headers), body)


def route_template(request: web.Request) -> str | None:
    """The template of the resource the request matched (``/payments/{id}``), or None."""
    resource = request.match_info.route.resource
    return None if resource is None else resource.canonical


def _routed(request: web.Request) -> str | http.Routed | None:
    """The default hook: `route_template`, and the rule the handler was marked with."""
    template, rule = route_template(request), http.rule_of(request.match_info.handler)
    return template if rule is None else http.Routed(template, rule)


def idempotent_connection(request: web.Request) -> Any:
    """The connection whose transaction carries this request's record (``connection=``)."""
    if request.get(_CONNECTION) is None:
        raise ConfigurationError("no idempotent connection: use IdempotencyMiddleware(connection=)")
    return request[_CONNECTION]


def current_attempt(request: web.Request) -> AsyncAttempt:
    """This request's attempt: its scope (principal, operation, key) and fencing token."""
    if _ATTEMPT not in request:
        raise ConfigurationError("this request is not guarded by IdempotencyMiddleware")
    return request[_ATTEMPT]


def _to_aiohttp(response: http.HttpResponse) -> web.Response:
    answer = web.Response(status=response.status, body=response.body)
    answer.headers.clear()  # the stored headers are the whole set, as sent the first time
    for name, value in response.headers:
        answer.headers.add(name.decode("latin-1"), value.decode("latin-1"))
    return answer
