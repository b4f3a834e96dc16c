"""HTTP pieces every framework adapter shares: no framework imports.

The ASGI (`idempo.asgi`), WSGI (`idempo.wsgi`), Django (`idempo.contrib.django`) and
aiohttp (`idempo.contrib.aiohttp`) middlewares are thin adapters over this package, so the
contract has one implementation. Its rooms, each with one job:

* `keys`: the ``Idempotency-Key`` header (a token or an RFC 8941 sf-string);
* `principals`: who asked; `fingerprint`: the canonical request;
* `response`: what is stored and replayed; `codec`: the guard's `Codec` for HTTP;
* `problems`: RFC 9457 refusals; `routes`: the route-template hook and its defaults;
* `options`: the one set of middleware options (`HttpOptions`, `HttpSettings`);
* `lifecycle`: one guarded request, its sans-I/O decisions with a sync and an async face.

This module re-exports the I/O-free pieces (`options` and `lifecycle` import the guard, which
imports this package, so they are imported from their own modules; `idempo.http` is their
public face for adapters written outside idempo)::

    key = parse_key(header_values(headers, b"idempotency-key"))   # None when absent
    payload = canonical_request(HttpRequest(method, path, query, headers, body))
    async with idem.once(key, operation=op, payload=payload, codec=HttpCodec()) as attempt:
        ...
"""

from __future__ import annotations

from .._core.keys import evict_hint
from .._wire import PROBLEM_TYPE_BASE
from ..errors import MissingKeyError, RequestTooLargeError
from .codec import Classifier, HttpCodec, classify_status
from .fingerprint import (
    DEFAULT_FINGERPRINT_FIELDS,
    FingerprintField,
    HttpRequest,
    canonical_parts,
    canonical_request,
    request_fingerprint,
)
from .keys import KEY_HEADER, Header, header_values, headers_named, parse_key
from .principals import NO_RESOLVER, Principals, default_principal, user_principal
from .problems import problem, problem_for
from .response import (
    REPLAYED_HEADER,
    HttpResponse,
    UnkeptResponse,
    decode_response,
    encode_response,
)

__all__ = [
    "DEFAULT_FINGERPRINT_FIELDS",
    "KEY_HEADER",
    "NO_RESOLVER",
    "PROBLEM_TYPE_BASE",
    "REPLAYED_HEADER",
    "Classifier",
    "FingerprintField",
    "Header",
    "HttpCodec",
    "HttpRequest",
    "HttpResponse",
    "MissingKeyError",
    "Principals",
    "RequestTooLargeError",
    "UnkeptResponse",
    "canonical_parts",
    "canonical_request",
    "classify_status",
    "decode_response",
    "default_principal",
    "encode_response",
    "evict_hint",
    "header_values",
    "headers_named",
    "parse_key",
    "problem",
    "problem_for",
    "request_fingerprint",
    "user_principal",
]
