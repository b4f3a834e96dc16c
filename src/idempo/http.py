"""The HTTP lifecycle for framework adapters: what idempo's own middlewares are written on.

An adapter asks `Lifecycle` whether a request is guarded and under which key
(`Lifecycle.admit`), translates it into an `Incoming`, lets `reserve` (thread-per-request
servers) or `areserve` (asyncio) reserve it, runs the handler and settles the `Run` /
`AsyncRun` with the whole response. Every option is one
of `HttpOptions`; `HttpSettings` checks them. docs/extending.md, "Writing a framework
adapter", walks through `idempo.contrib.aiohttp` as the worked example::

    lifecycle = Lifecycle(HttpSettings(options, owner="Mine", asynchronous=True), routes)
    named = headers_named(headers, lifecycle.read_headers)
    admission = lifecycle.admit(raw, method, path, named)  # Admission, a 400/413, or None
"""

from __future__ import annotations

from ._http.keys import KEY_HEADER, Header, header_values, headers_named
from ._http.lifecycle import (
    READ_HEADERS,
    Admission,
    AsyncRun,
    Incoming,
    Lifecycle,
    Request,
    Run,
    Unguarded,
    areserve,
    read_limited,
    reserve,
)
from ._http.options import DEFAULT_BODY_LIMIT, HttpOptions, HttpSettings, ShowsOptions
from ._http.per_route import (
    KeyHook,
    PathRules,
    Routed,
    RouteRule,
    header_key,
    idempotent,
    json_field,
    not_idempotent,
    rule_of,
)
from ._http.redact import REDACTED, redact_headers, redact_json
from ._http.response import HttpResponse, UnkeptResponse
from ._http.routes import NO_ROUTE, NoRoute, RouteTemplate
from ._reexport import publish

__all__ = [
    "DEFAULT_BODY_LIMIT",
    "KEY_HEADER",
    "NO_ROUTE",
    "READ_HEADERS",
    "REDACTED",
    "Admission",
    "AsyncRun",
    "Header",
    "HttpOptions",
    "HttpResponse",
    "HttpSettings",
    "Incoming",
    "KeyHook",
    "Lifecycle",
    "NoRoute",
    "PathRules",
    "Request",
    "RouteRule",
    "RouteTemplate",
    "Routed",
    "Run",
    "ShowsOptions",
    "Unguarded",
    "UnkeptResponse",
    "areserve",
    "header_key",
    "header_values",
    "headers_named",
    "idempotent",
    "json_field",
    "not_idempotent",
    "read_limited",
    "redact_headers",
    "redact_json",
    "reserve",
    "rule_of",
]

publish(
    __name__,
    Admission,
    PathRules,
    RouteRule,
    Routed,
    header_key,
    idempotent,
    json_field,
    not_idempotent,
    rule_of,
    AsyncRun,
    HttpOptions,
    HttpResponse,
    HttpSettings,
    Incoming,
    Lifecycle,
    NoRoute,
    Request,
    Run,
    ShowsOptions,
    Unguarded,
    UnkeptResponse,
    areserve,
    header_values,
    headers_named,
    read_limited,
    redact_headers,
    redact_json,
    reserve,
)
